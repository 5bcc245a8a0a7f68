"""Chunked work dispatch over a pool of Ray actors: each chunk goes to whichever actor is free.

A fixed share per actor waits on the unluckiest share (long completions, slow verifiers); handing
out small chunks as actors free up makes the pool finish when the work does. Each call returns
its chunk's results as separate return values (so they are owned by the caller and outlive the
actor) followed by one dict of stats, summed over chunks. A stat named `per_item/...` is a list
with one value per item instead of a sum.

Ground floor: imports only Ray (rollout/ and reward/ both use it).
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray

from common.messages import RestartEvent
from common.ray_utils import death_cause

Submit = Callable[[Any, List[Any]], List[ray.ObjectRef]]
"""submit(actor, items) -> refs: one per item, then one to the chunk's stats."""


def chunk_size(num_items: int, num_actors: int, chunks_per_actor: int) -> int:
    return max(1, math.ceil(num_items / (max(num_actors, 1) * chunks_per_actor)))


def dispatch(actors: Sequence[Any], submit: Submit, items: Sequence[Any], size: int,
             stats: Dict[str, Any], on_failure: Optional[Callable[[int], None]] = None,
             on_done: Optional[Callable[[range, List[ray.ObjectRef]], None]] = None, role: str = "actor",
             ) -> Tuple[List[ray.ObjectRef], Dict[str, Any]]:
    """Run `items` in chunks of `size` on whichever actor is free; returns (one result ref per
    item, in order; `stats` with every chunk's stats added).

    With `on_failure`, a chunk whose actor died is handed out again once `on_failure(actor
    index)` returns (it waits for the restarted actor and readies it); its results are then
    those of the re-run only, so every item is done exactly once. `actor_restarts` counts them.
    Each restart is also described in `restart_events` (a RestartEvent of `role`: actor index,
    cause, seconds until the actor was back and ready). Without it the actor's error is raised. `on_done(positions, refs)` is called as each chunk
    completes (the next stage can start on it while the others still run)."""
    n = len(items)
    out: List[ray.ObjectRef] = [None] * n  # type: ignore[list-item]
    if n == 0:
        return out, stats
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
            chunk_stats = ray.get(done[0])
        except ray.exceptions.RayActorError as error:
            if on_failure is None:
                raise
            started = time.monotonic()
            on_failure(a)
            stats["actor_restarts"] = stats.get("actor_restarts", 0.0) + 1
            stats.setdefault("restart_events", []).append(
                RestartEvent(role, death_cause(error), a, time.monotonic() - started))
            queue.appendleft(chunk)
            idle.append(a)
            continue
        add_stats(stats, chunk_stats, chunk, n)
        for i, ref in zip(chunk, refs):
            out[i] = ref
        idle.append(a)
        if on_done is not None:
            on_done(chunk, refs)
    return out, stats


def call_when_up(method, timeout_s: float = 600.0, poll_s: float = 1.0) -> Any:
    """`ray.get(method.remote())` on an actor Ray may still be restarting.

    With `max_task_retries=0` Ray fails a call to a restarting actor at once
    (ActorUnavailableError) instead of queueing it: how long the restart takes (a fresh vLLM
    engine, a loaded machine) decides whether a plain call succeeds. Retry until it answers; a
    dead actor (ActorDiedError) or the deadline raises."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(method.remote(), timeout=max(deadline - time.monotonic(), 0.1))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(poll_s)


def add_stats(total: Dict[str, Any], stats: Dict[str, Any], positions: Sequence[int], n: int) -> None:
    for key, value in stats.items():
        if key.startswith("per_item/"):
            column = total.setdefault(key, [None] * n)
            for i, v in zip(positions, value):
                column[i] = v
        elif isinstance(value, (int, float)):
            total[key] = total.get(key, 0.0) + value
        else:  # a record (an agent's first error, a session's first drift): the first chunk's is kept
            total.setdefault(key, value)


def as_list(refs) -> List[ray.ObjectRef]:
    """`num_returns=1` gives a bare ref, more give a list."""
    return refs if isinstance(refs, list) else [refs]
