"""Kill a process's children when it dies, however it dies.

vLLM's engine core, in the layout GPUs use, is a child process of the engine's actor and watches
nothing of its parent: when Ray SIGKILLs the actor (a node under memory pressure, `ray.kill`, a
crash) the engine core lives on, holding most of the GPU, and the restarted actor then fails
vLLM's free-memory check. Ray kills a dead worker's children only when its raylet was started
with per-worker process groups or the subreaper (docs/cluster.md), which a user's `ray start`
may not have. So the actor starts a reaper: a small process of its own session that polls the
actor and, once it is gone, SIGKILLs the children it was given (with their descendants), then
exits. It also exits when those children are gone (the engine shut down), so it never lingers.

Processes are named by (pid, start time), so a pid reused by another process is never killed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Iterable, List, Optional, Tuple

import psutil

__all__ = ["start_reaper"]

POLL_S = 0.5


def _identity(proc: psutil.Process) -> str:
    return f"{proc.pid}:{proc.create_time()!r}"


def start_reaper(children: Optional[Iterable[psutil.Process]] = None) -> Optional[subprocess.Popen]:
    """Start a reaper for this process's children (all of its descendants now, by default).
    Returns the reaper, or None when there is nothing to guard."""
    me = psutil.Process()
    procs = list(me.children(recursive=True) if children is None else children)
    if not procs:
        return None
    cmd = [sys.executable, "-m", "common.reaper", _identity(me), *(_identity(p) for p in procs)]
    return subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _alive(identity: str) -> Optional[psutil.Process]:
    pid, created = identity.split(":", 1)
    try:
        proc = psutil.Process(int(pid))
        if repr(proc.create_time()) != created or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def _kill_trees(procs: List[psutil.Process]) -> None:
    victims = []
    for proc in procs:
        try:
            victims += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            pass
    for proc in victims:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(victims, timeout=10)


def watch(owner: str, children: Tuple[str, ...]) -> None:
    """Until the owner dies (then kill the children still alive) or every child is gone."""
    while True:
        alive = [p for p in map(_alive, children) if p is not None]
        if not alive:
            return
        if _alive(owner) is None:
            _kill_trees(alive)
            return
        time.sleep(POLL_S)


if __name__ == "__main__":
    os.nice(5)  # a poll twice a second: never in the engine's way
    watch(sys.argv[1], tuple(sys.argv[2:]))
