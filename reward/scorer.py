"""A killable child process that runs verifier calls, each under a hard wall-clock limit.

math-verify's own timeouts use signal.alarm (main thread only) and a custom verifier or a
regex can spin forever in C code where no signal reaches it; the only limit that always holds
is killing the process. So each verifier actor owns one child process (`python -m
reward.scorer`, started once and kept warm) and streams it calls; a call that is not answered
within `timeout_s` scores 0, is counted as a timeout, and its process is killed (with its
process group) and replaced, after which the remaining calls are sent again.

Messages are pickles over two pipes (multiprocessing.connection): parent -> child
``("score", requests, calls)``; child -> parent one ``(request, name, score, status)`` per call, in
order, with status ``ok``, ``timeout`` (the verifier gave up itself, e.g. the code sandbox) or
``error`` (it raised; scored 0).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import List, Sequence, Tuple

from common.child import ChildProcess, attach
from common.config import RewardConfig
from common.messages import Outcome, ScoringRequest
from reward.registry import combine

__all__ = ["VerifierScorer"]

STARTUP_TIMEOUT_S = 120.0
"""Importing math-verify (sympy) and custom verifier modules; far above the usual 1-2 s."""


class VerifierScorer:
    """The Scorer (common/backends.py) of the configured verifiers: they run in a child process
    that a call which overruns `reward.timeout_s` gets killed with."""

    def __init__(self, settings: RewardConfig, search_path: Sequence[str] = ()):
        self.settings, self.search_path = settings, list(search_path)
        self.names = list(dict.fromkeys(settings.verifiers))
        self.restarts = 0
        """Child processes started after the first (each after a timeout or a crash)."""
        self._start()
        self._await_ready()

    # ------------------------------------------------------------------ process

    @property
    def pid(self) -> int:
        return self._child.pid

    def _start(self) -> None:
        """Spawn the child and send it the settings; do not wait (see _await_ready)."""
        self._child = ChildProcess("reward.scorer", (self.settings, self.search_path))
        self._ready = False

    def _await_ready(self) -> None:
        """Wait for the child's imports. A replacement started after a timeout imports while
        the caller goes on, so the completion that timed out does not also pay for it."""
        if self._ready:
            return
        failure = self._child.await_ready(STARTUP_TIMEOUT_S)
        if failure is not None:
            raise RuntimeError(f"the verifier process {failure}")
        self._ready = True

    def _kill(self) -> None:
        self._child.kill()

    def _restart(self) -> None:
        self._kill()
        self.restarts += 1
        self._start()

    # ------------------------------------------------------------------ scoring

    def score(self, requests: Sequence[ScoringRequest]) -> List[Outcome]:
        """Every selected verifier on every request: exactly one Outcome per request, in order."""
        items = list(requests)
        calls = [(i, name) for i in range(len(items)) for name in self.names]
        outcomes = [Outcome() for _ in items]

        def record(i: int, name: str, score: float, status: str) -> None:
            outcomes[i].scores[name] = score
            if status == "timeout":
                outcomes[i].timed_out.append(name)
            elif status == "error":
                outcomes[i].errors.append(name)

        pos, crashed = 0, set()
        while pos < len(calls):
            self._await_ready()
            try:
                self._child.send_conn.send(("score", items, calls[pos:]))
            except OSError:  # the child died between batches
                self._restart()
                continue
            while pos < len(calls):
                i, name = calls[pos]
                if not self._child.recv_conn.poll(self.settings.timeout_s):
                    record(i, name, 0.0, "timeout")
                    pos += 1
                    self._restart()
                    break
                try:
                    got_i, got_name, score, status = self._child.recv_conn.recv()
                except (EOFError, OSError):
                    # The process died inside this call: killed from outside (the OOM killer),
                    # or the completion crashes the verifier (a segfault in C code). Try the call
                    # once more in a new process; a second crash scores it 0 as an error.
                    if pos in crashed:
                        record(i, name, 0.0, "error")
                        pos += 1
                    else:
                        crashed.add(pos)
                    self._restart()
                    break
                assert (got_i, got_name) == (i, name), "verifier process answered out of order"
                record(i, name, score, status)
                pos += 1
        return [dataclasses.replace(o, reward=combine(o.scores, self.settings.weights)) for o in outcomes]


# ---------------------------------------------------------------------- child process


def _score_one(call, request: ScoringRequest) -> Tuple[float, str]:
    from reward.errors import VerifierTimeout

    try:
        score = float(call(request.prompt, request.completion, request.answer, request.fields))
    except VerifierTimeout:
        return 0.0, "timeout"
    except BaseException:  # a custom verifier's sys.exit or bug must not end the process
        return 0.0, "error"
    if not math.isfinite(score):
        return 0.0, "error"
    return score, "ok"


def _child_main(argv) -> None:
    attached = attach(argv)  # dies with the verifier actor that owns it
    if attached is None:
        return
    recv_conn, send_conn, (settings, search_path) = attached
    try:
        from reward.registry import build_verifiers

        verifiers = build_verifiers(settings, search_path)
        import math_verify  # noqa: F401  (warm: the first math call should not pay the import)
        if "reasoning_gym" in verifiers:
            import reasoning_gym  # noqa: F401  (its import registers ~100 tasks: seconds, paid once here)
    except BaseException as exc:
        send_conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    send_conn.send(("ready", None))
    while True:
        try:
            _, items, calls = recv_conn.recv()
        except EOFError:
            return
        for i, name in calls:
            score, status = _score_one(verifiers[name], items[i])
            send_conn.send((i, name, score, status))


if __name__ == "__main__":
    _child_main(sys.argv)
