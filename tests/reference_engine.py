"""Fresh vLLM engines to compare synced workers with, for modules that need several.

An engine's process spends ~10 CPU-s importing vLLM, torch and transformers before its `LLM(...)`
takes ~1 (measured: a second engine built in the same process cost 1.1 CPU-s against 9.5 for the
first), and tests/integration/test_weight_sync.py compares four pushes with four fresh engines.
`ReferenceEngines` starts one actor per module and builds each engine in it from the saved
folder: a new `LLM` that reads the weights from disk, after vLLM's own clean-up of the last one
(`cleanup_dist_env_and_memory`, what vLLM's tests run between engines in one process). Nothing
the last engine loaded carries over, only the imported code, so a push that left a worker
different from an engine started from the saved files still fails the comparison.
"""
from __future__ import annotations

import os
import sys

import ray

from rollout.worker import GenerationWorker


class RebuiltEngine(GenerationWorker):
    """A GenerationWorker that can start a new engine in its own process."""

    def rebuild(self, model_path, rollout_cfg, seed) -> None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        # Give stderr back to the process: the new engine's start captures it again (its reader
        # thread of the old pipe ends once nothing writes to it).
        os.dup2(self._stderr._real, 2)
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
        if self.actor is None:
            self.actor = ray.remote(num_cpus=0.5)(RebuiltEngine).remote(model_path, rollout_cfg, seed)
            return self.actor
        try:
            ray.get(self.actor.rebuild.remote(model_path, rollout_cfg, seed))
        except BaseException:
            self.shutdown()  # half rebuilt: not used again
            raise
        return self.actor

    def shutdown(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None
