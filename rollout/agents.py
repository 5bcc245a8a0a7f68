"""Users' agents (`rollout.agent=module:function`), run in processes apart from the engine.

An agent is called once per sample as `function(client, row, index)`: an `async def` agent gets an
`openai.AsyncOpenAI`, a plain `def` one an `openai.OpenAI`, each pointed at its own session of
the worker's endpoint (rollout/endpoint.py) with that session's key and nothing else of the run.
It returns the final answer text, or None (the verifiers then read the transcript).

Each agent runs in a process of a small pool (`rollout.agent_concurrency` of them, started once
per worker and reused), so that an agent that hangs, even in C code or a busy loop, is killed at
`rollout.agent_timeout_s` and its process replaced, and one that raises or exits ends only its
own episode. The processes die with the worker (a parent-death signal).

An episode's time limit starts when its process is ready (interpreter, `openai` and the agent's
module imported), not when the task is handed over: a cold pool of 32 processes importing on
2 busy cores took over a minute to start, and the first step's episodes timed out waiting for
their own process (bench/agent_throughput.py). A process that is not ready within
`START_LIMIT_S` (or the time limit, if longer) fails its task and is replaced.
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

START_LIMIT_S = 300.0
"""How long an agent process may take to become ready before its task fails."""
_READY = "ready"  # what a process sends once its agent is loaded

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
    # One HTTP client (and event loop) per process, not per episode: a new `openai` client builds
    # its own httpx client and TLS context, 20-50 ms of CPU, more than the rest of an episode's
    # requests cost the tiny model (bench/agent_throughput.py). Each episode still gets its own
    # `openai` client with its session's URL and key; only the connection pool is shared.
    loop = asyncio.new_event_loop() if asynchronous else None
    new_http = openai.DefaultAsyncHttpxClient if asynchronous else openai.DefaultHttpxClient
    http = new_http()
    conn.send(_READY)
    while True:
        try:
            task: AgentTask = conn.recv()
        except EOFError:
            return
        if http.is_closed:  # an agent closed its client (`with OpenAI(...)`): the pool went with it
            http = new_http()
        try:
            kind = openai.AsyncOpenAI if asynchronous else openai.OpenAI
            client = kind(base_url=task.base_url, api_key=task.api_key, max_retries=0, timeout=timeout_s,
                          http_client=http)
            answer = (loop.run_until_complete(fn(client, task.row, task.index)) if asynchronous
                      else fn(client, task.row, task.index))
            result = AgentResult(task.task_id, None if answer is None else str(answer))
        except BaseException as exc:  # the agent's own failure ends its episode, not the pool
            result = AgentResult(task.task_id, None, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        conn.send(result)


class AgentPool:
    """`size` agent processes; `run(tasks)` hands each task to a free one and collects results,
    killing (and replacing) a process whose task passes `timeout_s` from the moment the process
    was ready."""

    def __init__(self, path: str, size: int, timeout_s: float, search_path: Sequence[str] = ()):
        self.path, self.size, self.timeout_s, self.search_path = path, size, timeout_s, list(search_path)
        self.start_limit_s = max(START_LIMIT_S, timeout_s)
        # Never fork the actor (it holds the engine's threads): the processes are forked from
        # multiprocessing's fork server, a clean process started once that has imported `openai`
        # and this module. Spawned instead, each process imported them anew, and Ray's worker
        # module as its parent's main: 8 took 7.3 s to get ready against 2.0 s from the fork
        # server, on 2 busy cores. They still die with the actor: the fork server exits when its
        # parent does, and each process when the fork server does (die_with_parent).
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["openai", "rollout.agents"])
        self._procs: List[Tuple[Any, Any]] = []
        self._started: List[float] = []  # per slot: when its process was spawned
        self._ready: set = set()  # slots whose process has loaded the agent
        self._queue: List[AgentTask] = []
        # slot -> (task, deadline); the deadline is None until the slot's process is ready
        self._busy: Dict[int, Tuple[AgentTask, Optional[float]]] = {}
        self.results: List[AgentResult] = []

    def _spawn(self, slot: int) -> None:
        """A new process in `slot` (a new slot at the end), not ready until it says so."""
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_agent_main, args=(child, self.path, self.search_path, self.timeout_s),
                                 daemon=True)
        proc.start()
        child.close()
        if slot == len(self._procs):
            self._procs.append((proc, parent))
            self._started.append(time.monotonic())
        else:
            self._procs[slot], self._started[slot] = (proc, parent), time.monotonic()
        self._ready.discard(slot)

    def submit(self, tasks: Sequence[AgentTask]) -> None:
        while len(self._procs) < min(self.size, len(tasks) + len(self._busy)):
            self._spawn(len(self._procs))
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
                self._busy[slot] = (task, self._deadline(slot))

    def _deadline(self, slot: int) -> Optional[float]:
        return time.monotonic() + self.timeout_s if slot in self._ready else None

    def poll(self, wait_s: float = 0.0) -> List[AgentResult]:
        """Results that arrived (waiting up to `wait_s` for one), timeouts and dead processes."""
        listening = set(self._busy) | (set(range(len(self._procs))) - self._ready)
        conns = {self._procs[slot][1]: slot for slot in listening}
        ready = wait(list(conns), timeout=wait_s) if conns else []
        done: List[AgentResult] = []
        for conn in ready:
            slot = conns[conn]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                busy = self._busy.pop(slot, None)
                if busy is not None:
                    done.append(AgentResult(busy[0].task_id, None, "the agent's process died"))
                self._replace(slot)
                continue
            if message == _READY:
                self._ready.add(slot)
                if slot in self._busy:  # its task's time starts now
                    self._busy[slot] = (self._busy[slot][0], self._deadline(slot))
                continue
            del self._busy[slot]
            done.append(message)
        now = time.monotonic()
        for slot, (task, deadline) in list(self._busy.items()):
            if deadline is not None and now > deadline:
                error, timed_out = f"timed out after {self.timeout_s:g} s", True
            elif deadline is None and now > self._started[slot] + self.start_limit_s:
                error, timed_out = f"the agent's process did not start within {self.start_limit_s:g} s", False
            else:
                continue
            del self._busy[slot]
            done.append(AgentResult(task.task_id, None, error, timed_out=timed_out))
            self._replace(slot)
        self._dispatch()
        self.results += done
        return done

    def _replace(self, slot: int) -> None:
        proc, conn = self._procs[slot]
        proc.kill()
        proc.join(timeout=5)
        conn.close()
        self._spawn(slot)

    def close(self) -> None:
        for proc, conn in self._procs:
            conn.close()
            proc.kill()
        for proc, _ in self._procs:
            proc.join(timeout=5)
        self._procs.clear()
        self._started.clear()
        self._ready.clear()
