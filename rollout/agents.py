"""Users' agents (`rollout.agent=module:function`), run in processes apart from the engine.

An agent is called once per sample as `function(client, row, index)`: an `async def` agent gets an
`openai.AsyncOpenAI`, a plain `def` one an `openai.OpenAI`, each pointed at its own session of
the worker's endpoint (rollout/endpoint.py) with that session's key and nothing else of the run.
It returns the final answer text, or None (the verifiers then read the transcript).

Agents run in a small pool of processes per worker, started once and reused: a `def` agent one
episode per process (`rollout.agent_concurrency` processes), so that one that hangs, even in C
code or a busy loop, is killed at `rollout.agent_timeout_s` and its process replaced, and one
that raises or exits ends only its own episode; an `async def` agent
`rollout.agent_episodes_per_process` episodes per process on its event loop, each cancelled at
the time limit (one that blocks the loop instead stalls its process's other episodes, and the
process is stopped with them). The processes die with the worker (a parent-death signal).

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
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from typing import Any, Dict, List, Optional, Sequence, Tuple

from common.child import die_with_parent
from common.errors import one_line

START_LIMIT_S = 300.0
"""How long an agent process may take to become ready before its task fails."""
_READY = "ready"  # what a process sends, with how many episodes it takes at once, once its agent is loaded
ASYNC_GRACE_S = 2.0
"""How long past an episode's time limit an `async def` agent's process may take to end it itself
(it cancels the episode at the limit) before the pool stops the process."""

# What an agent's process keeps of the worker's environment: no credentials of the run.
_SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "WANDB", "RAY_", "AWS_", "HF_")


@dataclass(frozen=True)
class AgentTask:
    task_id: int
    base_url: str
    api_key: str
    row: Dict[str, Any]
    index: int
    deadline: Optional[float] = None
    """When the episode must end, on the monotonic clock (one for every process of the machine),
    as the pool set it when it handed the task to a ready process; None: `timeout_s` from when
    the process reads the task."""


@dataclass(frozen=True)
class AgentResult:
    task_id: int
    answer: Optional[str]
    error: Optional[str] = None
    timed_out: bool = False


def _agent_main(conn, path: str, search_path: Sequence[str], timeout_s: float, per_process: int) -> None:
    """One agent process: load the function once, then run the tasks it is sent: a `def` agent's
    one at a time, an `async def` agent's up to `per_process` at once on one event loop. Tells
    the pool, once ready, how many it takes at once."""
    die_with_parent()
    for name in list(os.environ):
        if any(marker in name.upper() for marker in _SECRET_MARKERS):
            os.environ.pop(name, None)
    import asyncio
    import ssl

    from common.plugins import load_function

    fn = load_function(path, search_path)
    # Each episode gets its own HTTP client (an agent may close it: `with OpenAI(...)`), all on
    # one TLS context built here: building it is most of a new client's cost in CPU, more than
    # the rest of an episode's requests cost the tiny model (bench/agent_throughput.py).
    tls = ssl.create_default_context()
    if inspect.iscoroutinefunction(fn):
        conn.send((_READY, per_process))
        asyncio.run(_serve_async(conn, fn, tls, timeout_s))
        return
    conn.send((_READY, 1))
    while True:
        try:
            task: AgentTask = conn.recv()
        except EOFError:
            return
        conn.send(_run_sync(fn, task, tls, timeout_s))


def _run_sync(fn, task: AgentTask, tls, timeout_s: float) -> AgentResult:
    import openai

    http = openai.DefaultHttpxClient(verify=tls)
    try:
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0, timeout=timeout_s,
                               http_client=http)
        answer = fn(client, task.row, task.index)
        return AgentResult(task.task_id, None if answer is None else str(answer))
    except BaseException as exc:  # the agent's own failure ends its episode, not the pool
        return AgentResult(task.task_id, None, one_line(exc))
    finally:
        http.close()


async def _serve_async(conn, fn, tls, timeout_s: float) -> None:
    """Start an episode for each task as it arrives (the pool sends no more than the process
    takes at once); return when the pool closes the connection."""
    import asyncio

    loop = asyncio.get_running_loop()
    inbox: "asyncio.Queue[Optional[AgentTask]]" = asyncio.Queue()

    def arrived() -> None:
        try:
            inbox.put_nowait(conn.recv())
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            inbox.put_nowait(None)

    loop.add_reader(conn.fileno(), arrived)
    running = set()
    while (task := await inbox.get()) is not None:
        episode = asyncio.ensure_future(_run_async(conn, fn, task, tls, timeout_s))
        running.add(episode)
        episode.add_done_callback(running.discard)


async def _run_async(conn, fn, task: AgentTask, tls, timeout_s: float) -> None:
    """One episode, cancelled at its time limit (an agent that blocks the event loop instead is
    the pool's to stop: AgentPool.poll)."""
    import asyncio

    import openai

    http = openai.DefaultAsyncHttpxClient(verify=tls)
    deadline = task.deadline if task.deadline is not None else time.monotonic() + timeout_s
    try:
        client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0, timeout=timeout_s,
                                    http_client=http)
        answer = await asyncio.wait_for(fn(client, task.row, task.index), max(deadline - time.monotonic(), 0.0))
        result = AgentResult(task.task_id, None if answer is None else str(answer))
    except BaseException as exc:  # the agent's own failure ends its episode, not its process
        if isinstance(exc, asyncio.TimeoutError) and time.monotonic() >= deadline:
            result = AgentResult(task.task_id, None, f"timed out after {timeout_s:g} s", timed_out=True)
        else:
            result = AgentResult(task.task_id, None, one_line(exc))
    try:
        await http.aclose()
    except Exception:  # the episode's outcome stands whatever closing its client does
        pass
    try:
        conn.send(result)
    except OSError:  # the pool is gone (it closed the connection): nobody to tell
        pass


class AgentPool:
    """Agent processes for `size` episodes at once; `run(tasks)` hands each task to a process
    with room and collects results, killing (and replacing) a process whose task passes
    `timeout_s` from the moment the process was ready. A `def` agent's process runs one episode
    at a time; an `async def` agent's, `per_process` (so `size / per_process` processes). How
    many a process takes is known once the first process is ready: until then the pool starts
    processes as for an `async def` agent, then more if the agent is a `def`."""

    def __init__(self, path: str, size: int, timeout_s: float, search_path: Sequence[str] = (), per_process: int = 1):
        self.path, self.size, self.timeout_s, self.search_path = path, size, timeout_s, list(search_path)
        self.per_process = max(1, min(per_process, size))
        self.capacity: Optional[int] = None  # episodes at once per process, as the first ready process tells
        self.start_limit_s = max(START_LIMIT_S, timeout_s)
        # Never fork the actor (it holds the engine's threads): the processes are forked from
        # multiprocessing's fork server, a clean process started once that has imported `openai`
        # and this module. Spawned instead, each process imported them anew, and Ray's worker
        # module as its parent's main, and took several times as long to get ready as from the
        # fork server (bench/agent_throughput.py). They still die with the actor: the fork server exits when its
        # parent does, and each process when the fork server does (die_with_parent).
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["openai", "rollout.agents"])
        self._procs: List[Tuple[Any, Any]] = []
        self._started: List[float] = []  # per slot: when its process was spawned
        self._ready: set = set()  # slots whose process has loaded the agent
        self._queue: List[AgentTask] = []
        # slot -> task id -> (task, deadline); a deadline is None until the slot's process is ready
        self._busy: Dict[int, Dict[int, Tuple[AgentTask, Optional[float]]]] = {}
        self.results: List[AgentResult] = []

    def _spawn(self, slot: int) -> None:
        """A new process in `slot` (a new slot at the end), not ready until it says so."""
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_agent_main, daemon=True,
                                 args=(child, self.path, self.search_path, self.timeout_s, self.per_process))
        proc.start()
        child.close()
        if slot == len(self._procs):
            self._procs.append((proc, parent))
            self._started.append(time.monotonic())
        else:
            self._procs[slot], self._started[slot] = (proc, parent), time.monotonic()
        self._ready.discard(slot)

    def _room(self, slot: int) -> int:
        """Tasks `slot` may take now: one before its process is ready (it may be a `def` agent's)."""
        held = len(self._busy.get(slot, {}))
        return (self.capacity if slot in self._ready and self.capacity else 1) - held

    def _running(self) -> int:
        return sum(len(tasks) for tasks in self._busy.values())

    def _grow(self) -> None:
        """Processes enough for the tasks outstanding, at most enough for `size` episodes at once."""
        per = self.capacity or self.per_process
        outstanding = len(self._queue) + self._running()
        while len(self._procs) < min(-(-self.size // per), -(-outstanding // per)):
            self._spawn(len(self._procs))

    def submit(self, tasks: Sequence[AgentTask]) -> None:
        self._queue.extend(tasks)
        self._grow()
        self._dispatch()

    @property
    def pending(self) -> bool:
        return bool(self._queue or any(self._busy.values()))

    def _dispatch(self) -> None:
        """Queued tasks to processes with room, never more than `size` episodes at once."""
        running = self._running()
        for slot in range(len(self._procs)):
            while self._queue and self._room(slot) > 0 and running < self.size:
                deadline = self._deadline(slot)
                task = replace(self._queue[0], deadline=deadline)
                try:
                    self._procs[slot][1].send(task)
                except OSError:  # its process died while idle (nothing listened): a new one, the task waits
                    self._replace(slot)
                    continue
                self._queue.pop(0)
                self._busy.setdefault(slot, {})[task.task_id] = (task, deadline)
                running += 1

    def _deadline(self, slot: int) -> Optional[float]:
        return time.monotonic() + self.timeout_s if slot in self._ready else None

    def _fail(self, slot: int, message: str, late: Optional[Sequence[int]] = None) -> List[AgentResult]:
        """Every task of `slot` ends and its process is replaced: those in `late` timed out,
        the others stopped with them (`late` None: every one failed with `message`)."""
        tasks = self._busy.pop(slot, {})
        self._replace(slot)
        if late is None:
            return [AgentResult(tid, None, message) for tid in tasks]
        return [AgentResult(tid, None, message, timed_out=True) if tid in late else
                AgentResult(tid, None, f"its process was stopped: another episode in it {message}") for tid in tasks]

    def poll(self, wait_s: float = 0.0) -> List[AgentResult]:
        """Results that arrived (waiting up to `wait_s` for one), timeouts and dead processes."""
        listening = {slot for slot, tasks in self._busy.items() if tasks} | (set(range(len(self._procs))) - self._ready)
        conns = {self._procs[slot][1]: slot for slot in listening}
        ready = wait(list(conns), timeout=wait_s) if conns else []
        done: List[AgentResult] = []
        for conn in ready:
            done += self._receive(conns[conn], conn)
        # An async agent's process ends a late episode itself; past this grace its event loop is
        # blocked (a computation that never awaits), and the pool stops the process.
        grace = ASYNC_GRACE_S if (self.capacity or 1) > 1 else 0.0
        now = time.monotonic()
        for slot, tasks in list(self._busy.items()):
            late = [tid for tid, (_, deadline) in tasks.items() if deadline is not None and now > deadline + grace]
            if late:
                done += self._fail(slot, f"timed out after {self.timeout_s:g} s", late=late)
            elif tasks and slot not in self._ready and now > self._started[slot] + self.start_limit_s:
                done += self._fail(slot, f"the agent's process did not start within {self.start_limit_s:g} s")
        self._grow()
        self._dispatch()
        self.results += done
        return done

    def _receive(self, slot: int, conn) -> List[AgentResult]:
        """Every message waiting from `slot`'s process (an async agent's episodes may have
        finished together: read one at a time, the rest would still be waiting at the
        deadlines' check)."""
        done: List[AgentResult] = []
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return done + self._fail(slot, "the agent's process died")
            if isinstance(message, tuple) and message[0] == _READY:
                self._ready.add(slot)
                self.capacity = message[1]  # per_process (at most `size`) or 1
                for tid, (task, _) in self._busy.get(slot, {}).items():  # their time starts now
                    self._busy[slot][tid] = (task, self._deadline(slot))
            else:
                self._busy.get(slot, {}).pop(message.task_id, None)
                done.append(message)
            if not conn.poll():
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
