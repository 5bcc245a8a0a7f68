"""Learner groups for test modules that start many differently configured learners.

A learner rank's process spends ~6 CPU-s importing torch, DeepSpeed and transformers before
its first step, and a module such as test_learner_equivalence needs ~30 ranks (every world
size, ZeRO stage, budget and loss setting). The pool starts one group per world size and
rebuilds it in place for each configuration: the same processes and process group, a fresh
policy, optimizer, reference and update (everything LearnerRank.__init__ builds, from the
model's files and the seed, as a new process would). A rebuild takes ~0.1-0.5 s.

A rebuilt rank keeps the C allocator settings its process started with (learner/peak_memory.py
sets them by ZeRO stage at a process's start): they change how much memory a step holds, which
no test here measures, not what it computes.

A group whose use raised is shut down, not reused: a failed collective can leave its ranks
anywhere. A weight-sync group that rank 0 joined (tests/integration/test_weight_sync.py) is
dropped at the next rebuild, as a new rank starts without one. Tests that kill ranks start
their own learners.
"""
from __future__ import annotations

import gc
import sys
from contextlib import contextmanager

import ray

from learner import engines
from learner.actor import LearnerRank
from learner.group import LearnerGroup


class RebuiltRank(LearnerRank):
    """A LearnerRank that can start over with other settings in its own process."""

    def __init__(self, rank, world_size, master_addr, master_port, *settings):
        self._place = (rank, world_size, master_addr, master_port)
        super().__init__(*self._place, *settings)

    def rebuild(self, *settings) -> None:
        """`settings`: LearnerRank's from `model_path` on. torch.distributed is initialised
        already: DeepSpeed's init_distributed keeps its group; the weight-sync group is dropped.
        A start freezes the heap (common/heap.py): the last configuration's engines are dropped,
        the heap unfrozen and collected first, so that they are freed (DeepSpeed's engines hold
        reference cycles), as in a new process."""
        place = self._place
        self.__dict__.clear()
        self._place = place
        gc.unfreeze()
        gc.collect()
        LearnerRank.__init__(self, *self._place, *settings)


# ---- probes: run on every rank through Ray's `__ray_call__` (`probe(learner, state_copy)`) -------
def probe(learner, fn, *args) -> list:
    """`fn(rank, *args)` on every rank of `learner` at once (a ZeRO-3 gather needs all), in
    rank order."""
    return ray.get([r.__ray_call__.remote(fn, *args) for r in learner.ranks])


def state_copy(rank) -> dict:
    """Full parameters on CPU."""
    return engines.full_state(rank.policy.module, rank.cfg.zero_stage)


def checkpointed_blocks(rank) -> int:
    """Blocks of the policy that recompute their activations in the backward pass."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(1 for m in rank.policy.module.modules()
               if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and m.training)


def reference_numel(rank) -> dict:
    """Elements of pi_ref this rank holds (under ZeRO-3 its partitions), and the full model's."""
    params = list(engines.unwrapped(rank.policy.ref_model).parameters())
    held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
    return {"held": held, "full": sum(getattr(p, "ds_numel", p.numel()) for p in params)}


def reference_state(rank) -> dict:
    """pi_ref's full parameters on CPU (a collective under ZeRO-3)."""
    return engines.full_state(engines.unwrapped(rank.policy.ref_model), rank.cfg.zero_stage)


def trained_numel(rank) -> dict:
    """Elements with optimizer state on this rank (under ZeRO-3 its partitions), and the full
    trainable and every parameter's."""
    import torch

    optimizer, module = rank.policy.optimizer, rank.policy.module
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    # ZeRO-3 empties its inner optimizer's groups between steps; its flat fp32 partitions stay.
    params = getattr(optimizer, "fp32_partitioned_groups_flat", None) or [
        p for g in optimizer.param_groups for p in g["params"]]
    return {"optimizer_params": sum(p.numel() for p in params), "state": sum(t.numel() for t in state),
            "trainable": sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad),
            "all": sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())}


# Ray workers cannot import this module (it lives on pytest's path, not the package's): its
# class travels by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class LearnerPool:
    def __init__(self):
        self.idle: dict = {}  # world size -> LearnerGroup

    @contextmanager
    def learner(self, model_path: str, cfg, algo, max_new_tokens: int, seed: int, adapters_from_start: bool = False):
        """A LearnerGroup of `cfg.num_ranks` ranks built from these settings, for the `with` body."""
        settings = (model_path, cfg, algo, max_new_tokens, seed, adapters_from_start)
        group = self.idle.pop(cfg.num_ranks, None)
        if group is None:
            group = LearnerGroup(*settings[:-1], rank_class=RebuiltRank, adapters_from_start=adapters_from_start)
        else:
            ray.get([r.rebuild.remote(*settings) for r in group.ranks])
        try:
            yield group
        except BaseException:
            group.shutdown()
            raise
        self.idle[cfg.num_ranks] = group

    def shutdown(self) -> None:
        for group in self.idle.values():
            group.shutdown()
        self.idle.clear()
