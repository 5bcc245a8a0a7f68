"""The generation workers as one group: start them, hand out prompts in chunks, collect references."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import ray

from cluster.dispatch import as_list, chunk_size, dispatch
from rollout.datasets import Problem
from rollout.worker import GenerationWorker


class RolloutPool:
    def __init__(self, model_path: str, rollout_cfg: dict, num_workers: int, seed: int,
                 num_cpus: float, num_gpus: float):
        actor = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(GenerationWorker)
        self.cfg = rollout_cfg
        self.workers = [actor.remote(model_path, rollout_cfg, seed + i) for i in range(num_workers)]
        ray.get([w.ready.remote() for w in self.workers])

    @property
    def sync_ranks(self) -> int:
        """Members of the weight-sync group per worker: one per tensor-parallel rank."""
        return self.cfg["tensor_parallel_size"]

    def generate(self, batch: Sequence[tuple], n: int, greedy: bool, seed: int
                 ) -> Tuple[List[ray.ObjectRef], Dict[str, Any]]:
        """Refs to one PromptGroup per (index, Problem) in `batch`, in order, and the stats
        (completions, completion_tokens, per_item/policy_version).

        The batch is cut into chunks handed to whichever worker is free. A seed per (step,
        prompt) makes a prompt's samples the same whichever worker draws it, and no two prompts
        share a random stream.
        """
        prompts = [(index, problem.prompt, problem.answer, problem.fields) for index, problem in batch]
        seeds = {p[0]: hash((seed, p[0])) % (2**31) for p in prompts}

        def submit(worker, chunk):
            return as_list(worker.generate.options(num_returns=len(chunk) + 1).remote(
                *chunk, n=n, greedy=greedy, seeds=[seeds[p[0]] for p in chunk]))

        size = chunk_size(len(prompts), len(self.workers), self.cfg["chunks_per_worker"])
        return dispatch(self.workers, submit, prompts, size, {})

    def versions(self) -> List[int]:
        return ray.get([w.ready.remote() for w in self.workers])

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)


def as_batch(problems: Sequence[Problem]) -> list:
    return list(enumerate(problems))
