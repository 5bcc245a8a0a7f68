"""A pool of model-serving actors for the verifiers that need one (a reward model, an LLM judge).

Each worker is its own Ray actor with the CPUs and GPUs its section asks for, restarted in place
when it dies (`max_restarts=-1`); a call that was running on it is retried on the restarted actor,
so the verifier actor's batch is scored again rather than lost.
"""
from __future__ import annotations

from typing import Any, List

import ray

TASK_RETRIES = 3


class ModelActorPool:
    """`settings.num_workers` actors of `worker_cls`; the verifier actors' scorers call them directly."""
    worker_cls: Any = None

    def __init__(self, settings: Any):
        actor = ray.remote(num_cpus=settings.num_cpus_per_worker, num_gpus=settings.num_gpus_per_worker,
                           max_restarts=-1, max_task_retries=TASK_RETRIES)(self.worker_cls)
        self.workers: List[Any] = [actor.remote(settings) for _ in range(settings.num_workers)]

    def ready(self) -> None:
        ray.get([w.pid.remote() for w in self.workers])

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
