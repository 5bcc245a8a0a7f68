"""Users' agents (`rollout.agent=module:function`), run in processes apart from the engine.

An agent is called once per sample as `function(client, row, index)`: an `async def` agent gets an
`openai.AsyncOpenAI`, a plain `def` one an `openai.OpenAI`, each pointed at its own session of
the worker's endpoint (rollout/endpoint.py) with that session's key and nothing else of the run.
It returns the final answer text, or None (the verifiers then read the transcript).

Each agent runs in a process of a small pool (`rollout.agent_concurrency` of them, started once
per worker and reused), so that an agent that hangs, even in C code or a busy loop, is killed at
`rollout.agent_timeout_s` and its process replaced, and one that raises or exits ends only its
own episode. The processes die with the worker (a parent-death signal).
"""
from __future__ import annotations

import inspect
import multiprocessing
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Dict, List, Optional, Sequence, Tuple

from common.child import die_with_parent

# What an agent's process keeps of the worker's environment: no credentials of the run.
_SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "WANDB", "RAY_", "AWS_", "HF_")


@dataclass(frozen=True)
class AgentTask:
    task_id: int
    base_url: str
    api_key: str
    row: Dict[str, Any]
    index: int


@dataclass(frozen=True)
class AgentResult:
    task_id: int
    answer: Optional[str]
    error: Optional[str] = None
    timed_out: bool = False


def _agent_main(conn, path: str, search_path: Sequence[str], timeout_s: float) -> None:
    """One agent process: load the function once, then run the tasks it is sent, one at a time."""
    die_with_parent()
    for name in list(os.environ):
        if any(marker in name.upper() for marker in _SECRET_MARKERS):
            os.environ.pop(name, None)
    import asyncio

    import openai

    from common.plugins import load_function

    fn = load_function(path, search_path)
    asynchronous = inspect.iscoroutinefunction(fn)
    while True:
        try:
            task: AgentTask = conn.recv()
        except EOFError:
            return
        try:
            kind = openai.AsyncOpenAI if asynchronous else openai.OpenAI
            client = kind(base_url=task.base_url, api_key=task.api_key, max_retries=0, timeout=timeout_s)
            answer = asyncio.run(fn(client, task.row, task.index)) if asynchronous else fn(client, task.row,
                                                                                          task.index)
            result = AgentResult(task.task_id, None if answer is None else str(answer))
        except BaseException as exc:  # the agent's own failure ends its episode, not the pool
            result = AgentResult(task.task_id, None, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        conn.send(result)


class AgentPool:
    """`size` agent processes; `run(tasks)` hands each task to a free one and collects results,
    killing (and replacing) a process whose task passes `timeout_s`."""

    def __init__(self, path: str, size: int, timeout_s: float, search_path: Sequence[str] = ()):
        self.path, self.size, self.timeout_s, self.search_path = path, size, timeout_s, list(search_path)
        self._ctx = multiprocessing.get_context("spawn")  # never fork an actor holding an engine's threads
        self._procs: List[Tuple[Any, Any]] = []
        self._queue: List[AgentTask] = []
        self._busy: Dict[int, Tuple[AgentTask, float]] = {}  # slot -> (task, deadline)
        self.results: List[AgentResult] = []

    def _spawn(self):
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_agent_main, args=(child, self.path, self.search_path, self.timeout_s),
                                 daemon=True)
        proc.start()
        child.close()
        return proc, parent

    def submit(self, tasks: Sequence[AgentTask]) -> None:
        while len(self._procs) < min(self.size, len(tasks) + len(self._busy)):
            self._procs.append(self._spawn())
        self._queue.extend(tasks)
        self._dispatch()

    @property
    def pending(self) -> bool:
        return bool(self._queue or self._busy)

    def _dispatch(self) -> None:
        for slot in range(len(self._procs)):
            if not self._queue:
                return
            if slot not in self._busy:
                task = self._queue.pop(0)
                self._procs[slot][1].send(task)
                self._busy[slot] = (task, time.monotonic() + self.timeout_s)

    def poll(self, wait_s: float = 0.0) -> List[AgentResult]:
        """Results that arrived (waiting up to `wait_s` for one), timeouts and dead processes."""
        conns = {self._procs[slot][1]: slot for slot in self._busy}
        ready = wait(list(conns), timeout=wait_s) if conns else []
        done: List[AgentResult] = []
        for conn in ready:
            slot = conns[conn]
            task, _ = self._busy.pop(slot)
            try:
                done.append(conn.recv())
            except (EOFError, OSError):
                done.append(AgentResult(task.task_id, None, "the agent's process died"))
                self._replace(slot)
        now = time.monotonic()
        for slot, (task, deadline) in list(self._busy.items()):
            if now > deadline:
                del self._busy[slot]
                done.append(AgentResult(task.task_id, None, f"timed out after {self.timeout_s:g} s", timed_out=True))
                self._replace(slot)
        self._dispatch()
        self.results += done
        return done

    def _replace(self, slot: int) -> None:
        proc, conn = self._procs[slot]
        proc.kill()
        proc.join(timeout=5)
        conn.close()
        self._procs[slot] = self._spawn()

    def close(self) -> None:
        for proc, conn in self._procs:
            conn.close()
            proc.kill()
        for proc, _ in self._procs:
            proc.join(timeout=5)
        self._procs.clear()
