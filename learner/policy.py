"""What a learner rank trains and what it sends: the policy's DeepSpeed engine, its optimizer
and its frozen reference, pi_ref.

Full weights until the reference's snapshot; with `learner.lora.rank` > 0 GRPO then trains LoRA
adapters on that base, and the reference is the same engine with its adapters off. The warm-up,
the update, the weight-sync sender and the checkpoints ask this class what to train, send or
save rather than branching on LoRA themselves.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from common.config import AlgoConfig, LearnerConfig
from learner import engines


class PolicyModel:
    def __init__(self, model_path: str, cfg: LearnerConfig, algo: AlgoConfig, ds_config: dict, dtype, on_gpu: bool,
                 checkpointed: bool, adapters_from_start: bool = False):
        """`adapters_from_start`: with LoRA, nothing trains the whole model first (no warm-up),
        so the rank builds the adapters' engine on the loaded model at once. The whole model's
        engine is never made: under ZeRO-3 it allocates its AdamW moments and gradient
        partitions at build, 12 bytes per parameter over the ranks that LoRA never uses, and
        that build, not the step, set the LoRA layout's peak (bench/memory_scale.py)."""
        self.cfg, self.algo, self.ds_config, self.dtype, self.on_gpu = cfg, algo, ds_config, dtype, on_gpu
        self.ref_model = None
        self.lora = False  # GRPO trains LoRA adapters (learner.lora.rank > 0), from the reference's snapshot on
        # The LoRA base is the model the engines loaded at start (adapters from the start, no
        # resume): they never need it pushed, not even after a restart.
        self.base_is_initial = bool(cfg.lora.rank and adapters_from_start)
        if self.base_is_initial:
            self._train_adapters(engines.pretrained_base(model_path, dtype, checkpointed))
        else:
            self.engine, self.optimizer = engines.policy_engine(model_path, cfg, ds_config, dtype, checkpointed)
        self.device = self.engine.device

    @property
    def module(self):
        return self.engine.module

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ---- the frozen reference ----------------------------------------------------------------
    def snapshot_reference(self) -> None:
        """Freeze a copy of the current policy as pi_ref (GRPO starts from the warmed-up model)."""
        if self.lora:
            return  # adapters from the start: pi_ref is already the base with them off
        if self.cfg.lora.rank:
            self.start_lora()
            return
        if self.algo.beta <= 0:
            return  # beta = 0 needs no reference model at all
        self.ref_model = engines.reference_from_policy(self.engine.module, self.ds_config, self.dtype, self.device,
                                                       self.on_gpu)

    def start_lora(self, base_state: Optional[dict] = None) -> None:
        """From here on GRPO trains LoRA adapters on the current policy (or on `base_state`, a
        checkpoint's base): a fresh base model gets its weights (under ZeRO-3 partition by
        partition), the old engine and its optimizer go, and the new engine's optimizer holds
        only the adapters. pi_ref is the same engine with its adapters off."""
        old = self.engine.module
        self.base_is_initial = False  # a warmed-up or saved base: the engines need it once
        base = engines.fresh_base(old.config, self.dtype, engines.checkpointing(self.cfg, self.on_gpu))
        zero3 = self.cfg.zero_stage == 3
        if base_state is None and zero3:
            engines.copy_partitions(old, base)
        elif base_state is None:
            base.load_state_dict(old.state_dict())
        elif zero3:
            engines.load_partitions(base, base_state)
        else:
            base.load_state_dict(base_state, strict=False)
            base.tie_weights()
        if hasattr(self.engine, "destroy"):
            self.engine.destroy()
        self.engine = self.optimizer = old = None
        self._train_adapters(base)

    def _train_adapters(self, base) -> None:
        self.engine, self.optimizer = engines.lora_engine(base, self.cfg, self.ds_config)
        self.lora = True
        self.ref_model = engines.AdaptersOff(self.engine) if self.algo.beta > 0 else None

    def load_reference(self, state: dict) -> None:
        """pi_ref from a checkpoint's `reference/` (a LoRA policy's is its own base instead)."""
        self.ref_model = engines.reference_from_state(self.engine.module.config, state, self.ds_config, self.dtype,
                                                      self.device, self.on_gpu)

    @property
    def saves_reference(self) -> bool:
        """Whether a checkpoint holds pi_ref apart (`reference/`): not with LoRA, whose
        reference is the saved base with its adapters off."""
        return not self.lora

    # ---- what the weight push sends ----------------------------------------------------------
    @property
    def pushes_adapters(self) -> bool:
        """The push sends only the adapters (the engines serve them on the base they got once)."""
        return self.lora and self.cfg.lora.push == "adapter"

    def sync_tensors(self, part: str = "policy") -> Dict[str, "torch.Tensor"]:
        """What vLLM loads, by checkpoint name. `policy`: every state_dict entry of the model, or
        with LoRA's adapter push only the adapters (by peft's saved names); `base`: a LoRA
        policy's base by the plain model's names. A tied output head is sent too, as the
        embedding it shares: vLLM's layerwise reload expects its own copy and otherwise keeps
        the old one (measured: greedy outputs then differ)."""
        module = self.engine.module
        tensors = dict(module.named_parameters(remove_duplicate=False))
        tensors.update(module.named_buffers(remove_duplicate=False))
        # state_dict's keys only: under ZeRO-3 its values are empty placeholders.
        names = list(module.state_dict().keys())
        if not self.lora:
            return {name: tensors[name] for name in names}
        if part == "policy" and self.cfg.lora.push == "adapter":
            return {engines.adapter_name(n): tensors[n] for n in names if engines.LORA_MARK in n}
        return {engines.base_name(n): tensors[n] for n in names if engines.LORA_MARK not in n}

    def merged_pairs(self, part: str) -> dict:
        """The merged push's (A, B, scale) by weight name: each adapted weight is sent as
        W + scale B A. Empty unless a LoRA policy pushes merged weights."""
        if self.lora and part == "policy" and self.cfg.lora.push == "merged":
            return engines.lora_pairs(self.engine.module)
        return {}

    def adapter_config(self) -> dict:
        """The adapters' peft config, which the engines serve them by."""
        return engines.adapter_config_dict(self.engine.module)

    def gathered_bytes(self) -> int:
        """Bytes of full parameters this rank holds right now (ZeRO-3: only those gathered)."""
        params = list(self.engine.module.parameters())
        if self.cfg.zero_stage == 3:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            params = [p for p in params if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE]
        return sum(p.numel() * p.element_size() for p in params)
