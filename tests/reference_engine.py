"""Fresh vLLM engines to compare synced workers with, for modules that need several.

Most of an engine's start is its process importing vLLM, torch and transformers (measured in
one process: the first engine for the built-in model cost 5.1-9.5 CPU-s, a second one 1.0-1.1;
bench/idle_costs.py rebuild), and tests/integration/test_weight_sync.py compares four pushes
with four fresh engines. `ReferenceEngines` starts one actor for the tests that run one after
another with it, and builds each engine in it from the saved folder: a new `LLM` that reads the
weights from disk, after vLLM's own clean-up of the last one (`cleanup_dist_env_and_memory`,
what vLLM's tests run between engines in one process). What carries over is process state
(imported code, compile caches, thread settings, environment), not weights: each case saves
other weights, so an engine that kept the last one's would fail the comparison rather than
pass it.
"""
from __future__ import annotations

import sys

import ray

from rollout.worker import GenerationWorker


class RebuiltEngine(GenerationWorker):
    """A GenerationWorker that can start a new engine in its own process."""

    def rebuild(self, model_path, rollout_cfg, seed) -> None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self._stderr.close()  # the new engine's start captures stderr again
        self.__dict__.clear()
        cleanup_dist_env_and_memory()  # unfreezes the heap the last start froze and collects it
        GenerationWorker.__init__(self, model_path, rollout_cfg, seed)


# Ray workers cannot import this module (it lives on pytest's path, not the package's): its
# class travels by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ReferenceEngines:
    def __init__(self):
        self.actor = None

    def engine(self, model_path: str, rollout_cfg, seed: int):
        """An engine freshly built from `model_path` (the actor; valid until the next call)."""
        try:
            if self.actor is None:
                self.actor = ray.remote(num_cpus=0.5)(RebuiltEngine).remote(model_path, rollout_cfg, seed)
                ray.get(self.actor.__ray_ready__.remote())
            else:
                ray.get(self.actor.rebuild.remote(model_path, rollout_cfg, seed))
        except BaseException:
            self.shutdown()  # half rebuilt: not used again
            raise
        return self.actor

    def shutdown(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None
