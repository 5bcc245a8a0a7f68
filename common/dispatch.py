"""Chunked work dispatch over a pool of Ray actors: each chunk goes to whichever actor is free.

A fixed share per actor waits on the unluckiest share (long completions, slow verifiers); handing
out small chunks as actors free up makes the pool finish when the work does. Each call returns
its chunk's results as separate return values (so they are owned by the caller and outlive the
actor) followed by one ChunkReport (common/messages.py); `Dispatched` merges a batch's reports:
stats summed, each item's own values (policy version, informative group) in its place.

Ground floor: imports only Ray (rollout/ and reward/ both use it).
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray

from common.errors import RunFailed
from common.messages import ChunkReport, RestartEvent
from common.ray_utils import death_cause

Submit = Callable[[Any, List[Any]], List[ray.ObjectRef]]
"""submit(actor, items) -> refs: one per item, then one to the chunk's ChunkReport."""


@dataclass
class Dispatched:
    """A pool's results for a whole batch, merged from its chunks' reports as they come in."""
    refs: List[Optional[ray.ObjectRef]]
    """One result per item, in the batch's order (None until its chunk is done)."""
    stats: Dict[str, float]
    """Every chunk's stats added up (`actor_restarts` counts the chunks handed out again)."""
    versions: List[Optional[int]]
    """Generation: the policy version that made each item's group."""
    informative: List[Optional[bool]]
    """Scoring: whether each group's rewards differ."""
    records: Dict[str, Any] = field(default_factory=dict)
    """The first chunk's record of each name (ChunkReport.records)."""
    restarts: List[RestartEvent] = field(default_factory=list)
    """Pool actors that died during the batch and came back (their chunks ran again)."""

    @classmethod
    def empty(cls, n: int, stats: Optional[Dict[str, float]] = None) -> "Dispatched":
        return cls([None] * n, dict(stats or {}), [None] * n, [None] * n)

    def add(self, report: ChunkReport, positions: Sequence[int], refs: Sequence[ray.ObjectRef] = ()) -> None:
        """Merge one chunk's report (and its items' result refs) at `positions` of the batch."""
        for key, value in report.stats.items():
            self.stats[key] = self.stats.get(key, 0.0) + value
        for column, values in ((self.versions, report.versions), (self.informative, report.informative),
                               (self.refs, refs)):
            for i, value in zip(positions, values):
                column[i] = value
        for key, value in report.records.items():
            self.records.setdefault(key, value)


def chunk_size(num_items: int, num_actors: int, chunks_per_actor: int) -> int:
    return max(1, math.ceil(num_items / (max(num_actors, 1) * chunks_per_actor)))


def dispatch(actors: Sequence[Any], submit: Submit, items: Sequence[Any], size: int,
             stats: Dict[str, float], on_failure: Optional[Callable[[int], None]] = None,
             on_done: Optional[Callable[[range, List[ray.ObjectRef]], None]] = None, role: str = "actor",
             ) -> Dispatched:
    """Run `items` in chunks of `size` on whichever actor is free; returns every item's result
    ref, in order, with the chunks' reports merged over `stats`.

    With `on_failure`, a chunk whose actor died is handed out again once `on_failure(actor
    index)` returns (it waits for the restarted actor and readies it); its results are then
    those of the re-run only, so every item is done exactly once. `actor_restarts` counts them,
    and each restart is a RestartEvent of `role` in `restarts` (actor index, cause, seconds
    until the actor was back and ready). Without it the actor's error is raised.
    `on_done(positions, refs)` is called as each chunk completes (the next stage can start on it
    while the others still run)."""
    n = len(items)
    out = Dispatched.empty(n, stats)
    if n == 0:
        return out
    queue = deque(range(start, min(start + size, n)) for start in range(0, n, size))
    idle = list(range(len(actors)))[::-1]
    running: Dict[ray.ObjectRef, Tuple[int, range, List[ray.ObjectRef]]] = {}
    while queue or running:
        while queue and idle:
            a, chunk = idle.pop(), queue.popleft()
            refs = submit(actors[a], [items[i] for i in chunk])
            running[refs[-1]] = (a, chunk, refs[:-1])
        done, _ = ray.wait(list(running), num_returns=1)
        a, chunk, refs = running.pop(done[0])
        try:
            report: ChunkReport = ray.get(done[0])
        except ray.exceptions.RayActorError as error:
            if on_failure is None:
                raise
            started = time.monotonic()
            on_failure(a)
            out.stats["actor_restarts"] = out.stats.get("actor_restarts", 0.0) + 1
            out.restarts.append(RestartEvent(role, death_cause(error), a, time.monotonic() - started))
            queue.appendleft(chunk)
            idle.append(a)
            continue
        out.add(report, chunk, refs)
        idle.append(a)
        if on_done is not None:
            on_done(chunk, refs)
    return out


def call_when_up(method, timeout_s: float = 600.0, poll_s: float = 1.0, what: str = "an actor") -> Any:
    """`ray.get(method.remote())` on an actor Ray may still be restarting.

    With `max_task_retries=0` Ray fails a call to a restarting actor at once
    (ActorUnavailableError) instead of queueing it: how long the restart takes (a fresh vLLM
    engine, a loaded machine) decides whether a plain call succeeds. Retry until it answers; a
    dead actor or the deadline ends the run in one line naming `what` (an engine killed by
    Ray's memory monitor on every start never answers)."""
    deadline, late = time.monotonic() + timeout_s, f"{what} did not come back within {timeout_s:g} s of its restart"
    while True:
        try:
            return ray.get(method.remote(), timeout=max(deadline - time.monotonic(), 0.1))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise RunFailed(late) from None
            time.sleep(poll_s)
        except ray.exceptions.GetTimeoutError:
            raise RunFailed(late) from None
        except ray.exceptions.RayActorError as error:
            raise RunFailed(f"{what} did not come back after its restart: {death_cause(error)}") from error


def as_list(refs) -> List[ray.ObjectRef]:
    """`num_returns=1` gives a bare ref, more give a list."""
    return refs if isinstance(refs, list) else [refs]
