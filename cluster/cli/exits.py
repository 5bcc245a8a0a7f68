"""How a `grpo` command ends: exit statuses, one-line errors, Ctrl-C, SIGTERM.

Bad input (config, data, requests) is status 2 with one line, before any actor starts where
possible; a run that failed and says why is status 1; Ctrl-C is 130 once everything the run
started has been stopped.

SIGTERM (`ray job stop`, a scheduler's preemption) during the GRPO steps lets the current step
end, writes a checkpoint of it, stops every part and exits with 143 and the line to resume; a
second SIGTERM exits at once (143), which loses at most the checkpoint being written: the ones
already on disk are whole (cluster/checkpoint.py). Before the steps begin there is nothing to
save: the run stops cleanly at once, as on Ctrl-C.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Callable, Optional

EXIT_RUN_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # what a shell reports for a command stopped by Ctrl-C
EXIT_PREEMPTED = 143  # 128 + SIGTERM: what schedulers expect of a job that ended on their signal


class Preempted(Exception):
    """The run stopped on SIGTERM; the message says where and how to go on."""


_stop_requested = threading.Event()
_steps_running = False


def fail(message: str) -> int:
    print(f"grpo: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def guarded(command: Callable[[], int]) -> int:
    """Run `command` with the errors it may raise turned into statuses and one line each."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where every thread is
    signal.signal(signal.SIGINT, _interrupt)
    watch_sigterm()
    try:
        return command()
    except KeyboardInterrupt:  # the run has already let its actors and Ray go (cluster/run.py)
        print("grpo: interrupted; everything the run started has been stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Preempted as stopped:
        print(f"grpo: {stopped}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    except Exception as exc:
        status = _status(exc)
        if status is None:
            raise
        return status


def _status(exc: Exception) -> Optional[int]:
    """The exit status of an error a command reports in one line; None for any other (a bug:
    its traceback is shown). The error types are imported only here, once something failed,
    so that `grpo --help` and config errors stay instant (no torch, no Ray)."""
    from common.config import ConfigError
    from data.datasets import DataError

    if isinstance(exc, (ConfigError, DataError)):
        return fail(str(exc))
    from cluster.checkpoint import CheckpointError
    from cluster.sync_channel import WeightSyncError
    from learner.group import LearnerError
    from rollout.worker import EngineStartError

    if isinstance(exc, (LearnerError, EngineStartError, WeightSyncError, CheckpointError)):  # the run failed, and says why
        print(f"grpo: error: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return None


def _interrupt(signum, frame) -> None:
    """The first Ctrl-C stops the run cleanly (KeyboardInterrupt, then its clean-up); a second
    one while that clean-up runs exits at once."""
    import signal

    signal.signal(signal.SIGINT, lambda *_: os._exit(EXIT_INTERRUPTED))
    raise KeyboardInterrupt


def watch_sigterm() -> None:
    """Install the SIGTERM handler; again after `ray.init`, which replaces it with its own."""
    import signal

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)


class steps_running:
    """While the GRPO steps run, SIGTERM only asks them to stop at the next step boundary."""

    def __enter__(self):
        global _steps_running
        watch_sigterm()
        _steps_running = True
        return self

    def __exit__(self, *_):
        global _steps_running
        _steps_running = False


def stop_requested() -> bool:
    return _stop_requested.is_set()


def _terminate(signum, frame) -> None:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_PREEMPTED))
    _stop_requested.set()
    if not _steps_running:
        raise Preempted("stopped by SIGTERM before the GRPO steps began; everything the run started "
                        "has been stopped (nothing to save yet: run it again)")
    print("grpo: SIGTERM: stopping after this step, with a checkpoint of it (a second SIGTERM exits at once)",
          file=sys.stderr, flush=True)
