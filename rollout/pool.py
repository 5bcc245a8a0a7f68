"""The generation workers as one group: start them, hand out prompts in chunks, collect references.

The workers are GenerationBackends (common/backends.py); vLLM's GenerationWorker unless the
caller names another class.
"""
from __future__ import annotations

import re
import threading
from contextlib import contextmanager, nullcontext
from typing import Callable, List, Optional, Sequence, Type

import ray

from common.backends import GenerationBackend
from common.config import RolloutConfig
from common.dispatch import Dispatched, as_list, call_when_up, chunk_size, dispatch
from common.messages import GenerationRequest
from common.ray_utils import actor_index
from common.seeds import engine_seed
from rollout.worker import EngineStartError, GenerationWorker


class RolloutPool:
    def __init__(self, model_path: str, rollout_cfg: RolloutConfig, seed: int, placement=None,
                 backend: Type[GenerationBackend] = GenerationWorker):
        """`rollout_cfg.num_workers` engines of class `backend`, worker i seeded `seed + i`;
        `placement(i)`: Ray actor options for worker i (its placement group bundle)."""
        # Ray restarts a dead worker (a fresh engine); the pool hands its unfinished prompts out
        # again only after `recover` gave it the current weights (no automatic task retry: a
        # retry on the fresh engine would sample with its initial weights).
        actor = ray.remote(num_cpus=rollout_cfg.num_cpus_per_worker, num_gpus=rollout_cfg.num_gpus_per_worker,
                           max_restarts=-1, max_task_retries=0)(backend)
        self.cfg = rollout_cfg
        self._submitting = threading.RLock()  # held by `between_calls` (a weight push)
        self.pause_stream = None
        """Set by a streaming batch source (cluster/loop/streaming.py) without partial rollouts:
        a context manager in which its engines carry no running request (a push then waits for
        them to finish, and no new one starts until the push is done)."""
        self.recover = None
        """Set by the driver to the weight-sync channel's `recover` (re-joins a restarted worker
        and pushes the current weights to it); None: a dead worker's error is raised."""
        self.workers = [actor.options(**(placement(i) if placement else {})).remote(model_path, rollout_cfg, engine_seed(seed, i))
                        for i in range(rollout_cfg.num_workers)]
        try:
            ray.get([w.ready.remote() for w in self.workers])
        except ray.exceptions.RayActorError as error:  # the cause is inside Ray's multi-line message
            self.shutdown()
            found = re.search(r"EngineStartError: (the vLLM engine did not start: [^\n]*)", str(error))
            raise EngineStartError(found.group(1) if found else f"a generation worker died at start: "
                                   f"{str(error).strip().splitlines()[-1][:300]}") from None
        self._sync_ranks = ray.get(self.workers[0].sync_ranks.remote()) if self.workers else 0

    @property
    def sync_ranks(self) -> int:
        """Members of the weight-sync group per worker: one per tensor-parallel rank."""
        return self._sync_ranks

    def generate(self, requests: Sequence[GenerationRequest], n: int, greedy: bool,
                 temperature: Optional[float] = None,
                 on_chunk: Optional[Callable[[range, List[ray.ObjectRef]], None]] = None) -> Dispatched:
        """Refs to one PromptGroup per request, in order, with the stats (completions,
        completion_tokens, ...) and the policy version of each group.

        The batch is cut into chunks handed to whichever worker is free; each request's own seed
        makes its samples the same whichever worker draws it. `on_chunk(positions, refs)` hears
        of each chunk as it is done.
        """
        def submit(worker, chunk):
            with self._submitting:
                return as_list(worker.generate.options(num_returns=len(chunk) + 1).remote(
                    *chunk, n=n, greedy=greedy, temperature=temperature))

        size = chunk_size(len(requests), len(self.workers), self.cfg.chunks_per_worker)
        return dispatch(self.workers, submit, list(requests), size, {"actor_restarts": 0.0},
                        on_failure=self._restarted if self.recover else None, on_done=on_chunk,
                        role="generation worker")

    def advance(self, index: int, requests: Sequence[GenerationRequest], tickets: Sequence[int], n: int,
                return_after: int):
        """Streaming: worker `index` takes `requests` beside those it carries and runs a short
        call; an iterator of refs: each group that finished during it, then its StreamReport
        (the refs are owned by the caller: a worker that dies later loses nothing it returned)."""
        with self._submitting:
            return self.workers[index].advance.options(num_returns="streaming").remote(
                *requests, tickets=list(tickets), n=n, max_steps=self.cfg.stream_steps, return_after=return_after)

    def abort_stream(self) -> None:
        """Every worker drops the streaming requests it carries (a dead worker carries none)."""
        calls = [w.abort_stream.remote() for w in self.workers]
        ray.wait(calls, num_returns=len(calls))

    def _restarted(self, index: int) -> None:
        """Wait for worker `index` to come back, then give it the current weights; it must then
        hold the channel's version before it generates again."""
        call_when_up(self.workers[index].ready, what=f"generation worker {index}")
        self.recover()
        versions = self.versions()
        if len(set(versions)) != 1:
            raise RuntimeError(f"after re-joining a restarted worker the versions differ: {versions}")

    @contextmanager
    def between_calls(self):
        """Every worker idle, and no new generation call submitted, until the block ends: what a
        weight push needs before its process group starts waiting. In async mode a worker may be
        in the middle of a chunk, and a receive queued behind it would spend the sync group's
        timeout waiting for it (on NCCL the watchdog then takes the learner down). Calls the
        block submits (the receives) queue before any later generation call."""
        with self.pause_stream() if self.pause_stream is not None else nullcontext():
            with self._submitting:
                idle = [w.ready.remote() for w in self.workers]
                ray.wait(idle, num_returns=len(idle))  # a dead worker's error is the push's to handle
                yield

    def sync_members(self) -> list:
        """The workers in the weight-sync group, in order: worker i's tensor-parallel ranks are
        the group's ranks 1 + i * sync_ranks on."""
        return list(self.workers)

    def worker_index(self, cause) -> int:
        """The index of the worker `cause` (a RayActorError) names; -1 when it names none."""
        return actor_index(self.workers, cause)

    def versions(self) -> List[int]:
        return ray.get([w.ready.remote() for w in self.workers])

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)

