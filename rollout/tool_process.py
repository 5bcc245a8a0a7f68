"""A killable child process that runs custom tool calls (`module:function`), one at a time.

A custom function can hang in C code, loop forever or sleep: a thread that runs it can be
abandoned but never stopped, and each one abandoned holds its slot for good. So custom tools
run in child processes (`python -m rollout.tool_process`, started once per slot and kept warm,
so module state such as a loaded index survives between calls); a call that has no answer
within its time limit kills the process (with its process group) and starts a replacement,
which imports while the next call waits for it (that wait is not counted in the call's limit).

Messages are pickles over two pipes (multiprocessing.connection): parent -> child
``("call", name, arguments, max_chars)``; child -> parent ``("ok", text, dropped)`` (the text cut
to `max_chars`, and how many characters were cut) or ``("raised", "TypeName: message")``.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Mapping, Sequence, Tuple

from common.child import ChildProcess, attach

STARTUP_TIMEOUT_S = 60.0
"""Importing the custom tools' modules; far above the usual fraction of a second."""


class ToolProcessError(Exception):
    """The call got no answer: it timed out (the process was killed) or the process died."""


class ToolRaised(Exception):
    """The tool raised; the message is its exception's, as `TypeName: message`."""


class ToolProcess:
    def __init__(self, custom: Mapping[str, str], search_path: Sequence[str] = ()):
        self.custom, self.search_path = dict(custom), list(search_path)
        self.restarts = 0
        self.closed = self._busy = False
        self._lock = threading.Lock()
        self._start()

    @property
    def pid(self) -> int:
        return self._child.pid

    def _start(self) -> None:
        # the caller's import path: a module the caller can import (a test's tmp folder, the
        # user's working directory) imports in the child too
        self._child = ChildProcess("rollout.tool_process", (self.custom, self.search_path + list(sys.path)))
        self._ready = False

    def ready(self) -> None:
        """Wait until the child has imported every custom tool (ToolProcessError if it cannot)."""
        if self._ready:
            return
        if self.closed:
            raise ToolProcessError("the tool box is closed")
        failure = self._child.await_ready(STARTUP_TIMEOUT_S)
        if failure is not None:
            self._restart()
            raise ToolProcessError(f"the custom tools' process {failure}")
        self._ready = True

    def call(self, name: str, arguments: Any, timeout_s: float, max_chars: int,
             start: Callable[[], None] = lambda: None) -> Tuple[str, int]:
        """(text cut to max_chars, characters cut); `start()` runs once the process is ready,
        when the time limit begins. Raises ToolProcessError when the call timed out or the
        process died in it (either way a fresh process takes the next call), ToolRaised when
        the tool raised."""
        with self._lock:
            if self.closed:
                raise ToolProcessError("the tool box is closed")
            self._busy = True
        try:
            self.ready()
            start()
            return self._exchange(name, arguments, timeout_s, max_chars)
        finally:
            with self._lock:
                self._busy = False
                if self.closed:
                    self.kill()

    def _exchange(self, name: str, arguments: Any, timeout_s: float, max_chars: int) -> Tuple[str, int]:
        child = self._child
        try:
            child.send_conn.send(("call", name, arguments, max_chars))
            answered = child.recv_conn.poll(timeout_s)
            reply = child.recv_conn.recv() if answered else None
        except (EOFError, OSError):
            status = child.proc.poll()
            self._restart()
            raise ToolProcessError(f"the tool's process died (exit status {status})") from None
        if reply is None:
            self._restart()
            raise ToolProcessError(f"timed out after {timeout_s:g} s")
        if reply[0] == "raised":
            raise ToolRaised(reply[1])
        return reply[1], reply[2]

    def _restart(self) -> None:
        self.kill()
        if not self.closed:
            self.restarts += 1
            self._start()

    def kill(self) -> None:
        self._child.kill()

    def close(self) -> None:
        """Kill the process. A call running in another thread sees it die and cleans up
        itself (its pipes are closed by that thread, never under its feet)."""
        with self._lock:
            self.closed = True
            busy = self._busy
        if busy:
            self._child.signal_group()
        else:
            self.kill()


# ---------------------------------------------------------------------- child process


def _run_one(fn, arguments: Any, max_chars: int) -> tuple:
    try:
        out = fn(**arguments) if isinstance(arguments, Mapping) else fn(arguments)
    except BaseException as exc:  # a tool's sys.exit or bug must not end the process
        return ("raised", f"{type(exc).__name__}: {str(exc)[:200]}")
    text = "" if out is None else str(out)
    return ("ok", text[:max_chars], max(len(text) - max_chars, 0))


def _child_main(argv) -> None:
    attached = attach(argv)  # dies with the generation actor that owns it
    if attached is None:
        return
    recv, send, (custom, path) = attached
    try:
        from common.plugins import load_function

        tools = {name: load_function(spec, path) for name, spec in custom.items()}
    except BaseException as exc:
        send.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    send.send(("ready", None))
    while True:
        try:
            _, name, arguments, max_chars = recv.recv()
        except EOFError:
            return
        send.send(_run_one(tools[name], arguments, max_chars))


if __name__ == "__main__":
    _child_main(sys.argv)
