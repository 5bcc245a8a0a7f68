"""A learner rank's part of a checkpoint (its DeepSpeed shard, its RNG; on rank 0 the frozen
reference, a LoRA policy's base and adapters, the model's config and tokenizer) and the Hugging
Face export of the policy. The checkpoint's layout is cluster/loop/checkpoint.py's.
"""
from __future__ import annotations

import collections
import os
import random
from typing import Optional

import torch

from common import state_files
from learner import engines
from learner.policy import PolicyModel


class CheckpointState:
    def __init__(self, policy: PolicyModel, critic, tokenizer, rank: int):
        self.policy, self.critic, self.tokenizer, self.rank = policy, critic, tokenizer, rank

    def save(self, folder: str) -> None:
        """Every rank writes its DeepSpeed shard and its RNG; rank 0 also the frozen reference
        and the model's config and tokenizer (see cluster/loop/checkpoint.py for the layout)."""
        policy, zero_stage = self.policy, self.policy.cfg.zero_stage
        learner_dir = os.path.join(folder, "learner")
        # With LoRA the frozen base is not DeepSpeed's to save: base/ holds it (below).
        policy.engine.save_checkpoint(learner_dir, tag="ds", exclude_frozen_parameters=policy.lora)
        if self.critic is not None:
            self.critic.save_checkpoint(os.path.join(folder, "critic"), tag="ds")
        torch.save(rng_state(policy.on_gpu), os.path.join(learner_dir, f"rng_rank{self.rank}.pt"))
        if policy.lora:
            self._save_lora(folder)
        if policy.ref_model is not None and policy.saves_reference:
            self._write(engines.state_blocks(engines.unwrapped(policy.ref_model), zero_stage, self.rank == 0),
                        os.path.join(folder, "reference"))
        if self.rank == 0:
            policy.module.config.save_pretrained(os.path.join(folder, "model"))
            self.tokenizer.save_pretrained(os.path.join(folder, "model"))

    def _write(self, blocks, folder: str) -> None:
        """Rank 0 writes the blocks as they come (a shard at a time); every other rank only
        joins each block's gather."""
        if self.rank == 0:
            try:
                state_files.write(folder, blocks)
            except BaseException:
                # A disk that filled: the other ranks still wait in the remaining blocks' gathers.
                collections.deque(blocks, maxlen=0)
                raise
        else:
            collections.deque(blocks, maxlen=0)

    def _lora_blocks(self, adapters: dict, merge: bool = False):
        """The LoRA policy's base by the plain model's names (the adapters merged in if `merge`),
        block by block; its adapters, by peft's names, gathered into `adapters` on the way."""
        module = self.policy.module
        for block in engines.state_blocks(module, self.policy.cfg.zero_stage, keep=self.rank == 0):
            base, _ = engines.split_state(block)
            adapters.update({k: v for k, v in block.items() if engines.is_adapter(k)})
            if merge:
                base = engines.merged_state(base, engines.adapters_by_weight(block, module.peft_config["default"]))
            yield base

    def _save_lora(self, folder: str) -> None:
        """A LoRA policy's base (`base/`, the plain model's names; the frozen reference too)
        and its adapter folder (`adapter/`, what `grpo export` writes)."""
        adapters = {}
        self._write(self._lora_blocks(adapters), os.path.join(folder, "base"))
        if self.rank == 0:
            self.policy.module.save_pretrained(os.path.join(folder, "adapter"), state_dict=adapters)

    def load(self, folder: str) -> None:
        """Restore what `save` wrote: weights, optimizer, RNG, the reference model."""
        policy = self.policy
        learner_dir = os.path.join(folder, "learner")
        base = state_files.saved(folder, "base")
        if base is not None:
            policy.start_lora(base)
        try:
            path, _ = policy.engine.load_checkpoint(learner_dir, tag="ds", load_optimizer_states=True,
                                                    load_lr_scheduler_states=True, load_module_strict=not policy.lora)
        except ValueError as exc:
            if "doesn't match the size" not in str(exc) or policy.cfg.zero_stage != 3:
                raise
            # Checkpoints written before ZeRO-3's optimizer was stepped a block at a time hold one
            # optimizer sub-group (learner/engines.py, zero3_bounds).
            raise RuntimeError(f"{learner_dir}: its optimizer state has other sub-groups than this run's; a "
                               "checkpoint saved before sub-groups were a block each resumes with "
                               "+learner.deepspeed.zero_optimization.sub_group_size=1e12") from exc
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {learner_dir}")
        if self.critic is not None:
            self.critic.load_checkpoint(os.path.join(folder, "critic"), tag="ds", load_optimizer_states=True)
        set_rng_state(torch.load(os.path.join(learner_dir, f"rng_rank{self.rank}.pt"), weights_only=False),
                      policy.on_gpu)
        if policy.algo.beta > 0 and policy.saves_reference:
            policy.load_reference(state_files.saved(folder, "reference"))

    def save_pretrained(self, folder: str, part: str = "merged") -> Optional[str]:
        """Write the policy as a Hugging Face folder, a block at a time (rank 0 writes; every
        rank joins ZeRO-3's gathers). With LoRA, `part`: `merged`, the model with its adapters
        merged in and the adapter folder (peft's save_pretrained) in `folder`/adapter;
        `adapter`, the adapter folder alone; `base`, the base model alone."""
        module, keep = self.policy.module, self.rank == 0
        adapters = {}
        if not self.policy.lora:
            self._write(engines.state_blocks(module, self.policy.cfg.zero_stage, keep), folder)
        elif part == "adapter":  # only the adapters are gathered
            for block in engines.state_blocks(module, self.policy.cfg.zero_stage, keep, only=engines.is_adapter):
                adapters.update(block)
        else:
            self._write(self._lora_blocks(adapters, merge=part == "merged"), folder)
        if not keep:
            return None
        if self.policy.lora and part != "base":
            adapter_dir = folder if part == "adapter" else os.path.join(folder, "adapter")
            module.save_pretrained(adapter_dir, state_dict=adapters)
            self.tokenizer.save_pretrained(adapter_dir)
            if part == "adapter":
                return folder
        _save_config(module.get_base_model() if self.policy.lora else module, folder)
        self.tokenizer.save_pretrained(folder)
        return folder


def _save_config(model, folder: str) -> None:
    """What transformers' save_pretrained writes besides the weights: the config, stamped with
    the weights' dtype and the model's class, and the generation config."""
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def rng_state(on_gpu: bool) -> dict:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if on_gpu:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, on_gpu: bool) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if on_gpu and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
