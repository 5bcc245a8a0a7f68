"""The generation workers as one group: start them, split prompts over them, collect references."""
from __future__ import annotations

from typing import List, Sequence

import ray

from rollout.datasets import Problem
from rollout.worker import GenerationWorker


class RolloutPool:
    def __init__(self, model_path: str, rollout_cfg: dict, num_workers: int, seed: int,
                 num_cpus: float, num_gpus: float):
        actor = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(GenerationWorker)
        self.workers = [actor.remote(model_path, rollout_cfg, seed + i) for i in range(num_workers)]
        ray.get([w.ready.remote() for w in self.workers])

    def generate(self, batch: Sequence[tuple], n: int, greedy: bool, seed: int) -> List[ray.ObjectRef]:
        """Refs to one PromptGroup per (index, Problem) in `batch`, in order.

        Equal strided shares, one per worker: in synchronous mode every worker then has the
        same amount of work (and the same version of the weights).
        """
        num = len(self.workers)
        calls = []
        for w, worker in enumerate(self.workers):
            positions = list(range(w, len(batch), num))
            if not positions:
                continue
            prompts = [(batch[i][0], batch[i][1].prompt, batch[i][1].answer, batch[i][1].fields) for i in positions]
            # A seed per (step, prompt): reruns reproduce, and no two prompts share a stream.
            seeds = [hash((seed, p[0])) % (2**31) for p in prompts]
            calls.append((positions, worker.generate.remote(prompts, n, greedy, seeds)))
        refs: List[ray.ObjectRef] = [None] * len(batch)  # type: ignore[list-item]
        for positions, call in calls:
            for i, ref in zip(positions, ray.get(call)):
                refs[i] = ref
        return refs

    def versions(self) -> List[int]:
        return ray.get([w.ready.remote() for w in self.workers])

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)


def as_batch(problems: Sequence[Problem]) -> list:
    return list(enumerate(problems))
