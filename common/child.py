"""A warm child process that runs code a thread could never stop, killed with its process group.

Custom verifiers, custom tools and users' agents can hang in C code or loop forever: the only
limit that always holds is killing the process. The verifier's scorer (reward/scorer.py) and the
custom tools' process (rollout/tool_process.py) are both `python -m MODULE DOWN_FD UP_FD
PARENT_PID`, a new session of its own, spoken to with pickles over two pipes
(multiprocessing.connection); this module is that shared plumbing: the parent side
(`ChildProcess`) and the child side (`attach`, `die_with_parent`).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Optional, Tuple

__all__ = ["ChildProcess", "attach", "die_with_parent"]


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG), so that a
    child never outlives the actor that owns it. Safe in a forked child before exec."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the owner's kill still ends the child
        pass


class ChildProcess:
    """`python -m module` with two pipes; `init` is the first message it receives."""

    def __init__(self, module: str, init: Any):
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        cmd = [sys.executable, "-m", module, str(down_r), str(up_w), str(os.getpid())]
        self.proc = subprocess.Popen(cmd, pass_fds=(down_r, up_w), start_new_session=True)
        os.close(down_r)
        os.close(up_w)
        self.send_conn = Connection(down_w, readable=False)
        self.recv_conn = Connection(up_r, writable=False)
        self.send_conn.send(("init", init))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def await_ready(self, timeout_s: float) -> Optional[str]:
        """None once the child said it is ready; otherwise why not (it is then killed)."""
        if not self.recv_conn.poll(timeout_s):
            self.kill()
            return f"did not start within {timeout_s:g} s"
        try:
            kind, detail = self.recv_conn.recv()
        except (EOFError, OSError):
            kind, detail = "failed", f"exit status {self.proc.wait()}"
        if kind != "ready":
            self.kill()
            return f"failed to start: {detail}"
        return None

    def signal_group(self) -> None:
        """SIGKILL the child's process group without touching the pipes (another thread may be
        reading them: it sees the child die and cleans up itself)."""
        if self.proc.returncode is not None:  # reaped: its pid may belong to another process now
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Close the pipes, kill the process group and reap the child."""
        self.send_conn.close()
        self.recv_conn.close()
        self.signal_group()
        self.proc.wait()


def attach(argv) -> Optional[Tuple[Connection, Connection, Any]]:
    """The child's side of `ChildProcess`, from its `sys.argv`: (receive, send, init message),
    or None when the parent is already gone (the process should then just return)."""
    down_fd, up_fd, parent_pid = (int(a) for a in argv[1:4])
    die_with_parent()
    if os.getppid() != parent_pid:
        return None
    recv_conn = Connection(down_fd, writable=False)
    send_conn = Connection(up_fd, readable=False)
    _, init = recv_conn.recv()
    return recv_conn, send_conn, init
