"""A learner rank's part of a checkpoint (its DeepSpeed shard, its RNG; on rank 0 the frozen
reference, a LoRA policy's base and adapters, the model's config and tokenizer) and the Hugging
Face export of the policy. The checkpoint's layout is cluster/loop/checkpoint.py's.
"""
from __future__ import annotations

import os
import random
from typing import Optional

import torch

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
        # With LoRA the frozen base is not DeepSpeed's to save: base.pt holds it (below).
        policy.engine.save_checkpoint(learner_dir, tag="ds", exclude_frozen_parameters=policy.lora)
        if self.critic is not None:
            self.critic.save_checkpoint(os.path.join(folder, "critic"), tag="ds")
        torch.save(rng_state(policy.on_gpu), os.path.join(learner_dir, f"rng_rank{self.rank}.pt"))
        if policy.lora:
            self._save_lora(folder)
        reference = (engines.full_state(engines.unwrapped(policy.ref_model), zero_stage, keep=self.rank == 0)
                     if policy.ref_model is not None and policy.saves_reference else None)
        if self.rank == 0:
            if reference is not None:
                torch.save(reference, os.path.join(folder, "reference.pt"))
            policy.module.config.save_pretrained(os.path.join(folder, "model"))
            self.tokenizer.save_pretrained(os.path.join(folder, "model"))

    def _save_lora(self, folder: str) -> None:
        """A LoRA policy's base (`base.pt`, the plain model's names; the frozen reference too)
        and its adapter folder (`adapter/`, what `grpo export` writes)."""
        state = engines.full_state(self.policy.module, self.policy.cfg.zero_stage, keep=self.rank == 0)
        if self.rank == 0:
            base, _ = engines.split_state(state)
            torch.save(base, os.path.join(folder, "base.pt"))
            self.policy.module.save_pretrained(os.path.join(folder, "adapter"), state_dict=state)

    def load(self, folder: str) -> None:
        """Restore what `save` wrote: weights, optimizer, RNG, the reference model."""
        policy = self.policy
        learner_dir = os.path.join(folder, "learner")
        lora_base = os.path.join(folder, "base.pt")
        if os.path.exists(lora_base):  # memory-mapped: under ZeRO-3 a rank reads only its partitions' pages
            policy.start_lora(torch.load(lora_base, map_location="cpu", mmap=True))
        path, _ = policy.engine.load_checkpoint(learner_dir, tag="ds", load_optimizer_states=True,
                                                load_lr_scheduler_states=True, load_module_strict=not policy.lora)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {learner_dir}")
        if self.critic is not None:
            self.critic.load_checkpoint(os.path.join(folder, "critic"), tag="ds", load_optimizer_states=True)
        set_rng_state(torch.load(os.path.join(learner_dir, f"rng_rank{self.rank}.pt"), weights_only=False),
                      policy.on_gpu)
        if policy.algo.beta > 0 and policy.saves_reference:
            # Memory-mapped: under ZeRO-3 a rank reads only its partitions' pages.
            policy.load_reference(torch.load(os.path.join(folder, "reference.pt"), map_location="cpu", mmap=True))

    def save_pretrained(self, folder: str, part: str = "merged") -> Optional[str]:
        """Write the policy as a Hugging Face folder (rank 0 writes; every rank joins ZeRO-3's
        gather). With LoRA, `part`: `merged`, the model with its adapters merged in and the
        adapter folder (peft's save_pretrained) in `folder`/adapter; `adapter`, the adapter
        folder alone; `base`, the base model alone."""
        module = self.policy.module
        state = engines.full_state(module, self.policy.cfg.zero_stage, keep=self.rank == 0)  # one parameter at a time
        if self.rank != 0:
            return None
        if self.policy.lora:
            base, _ = engines.split_state(state)
            if part != "base":
                adapter_dir = folder if part == "adapter" else os.path.join(folder, "adapter")
                module.save_pretrained(adapter_dir, state_dict=state)
                self.tokenizer.save_pretrained(adapter_dir)
                if part == "adapter":
                    return folder
                base = engines.merged_state(base, engines.adapters_by_weight(state, module.peft_config["default"]))
            module, state = module.get_base_model(), base
        module.save_pretrained(folder, state_dict=state)
        self.tokenizer.save_pretrained(folder)
        return folder


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
