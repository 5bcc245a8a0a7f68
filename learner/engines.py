"""The DeepSpeed engines of one learner rank: the policy, PPO's value model, the frozen reference.

Every engine is built from the same generated DeepSpeed config (ZeRO stage, clipping, bf16 on
GPUs), with `learner.deepspeed` merged over it.
"""
from __future__ import annotations

import contextlib

import torch

from common.config import AlgoConfig, LearnerConfig


def deep_merge(base: dict, override: dict) -> dict:
    """`override` over `base`, recursively for nested dicts (DeepSpeed settings from the config)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def ds_config(cfg: LearnerConfig, on_gpu: bool) -> dict:
    config = deep_merge({
        "train_micro_batch_size_per_gpu": 1,  # batches are formed here, not by DeepSpeed
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": on_gpu},
        "steps_per_print": 10**9,
    }, dict(cfg.deepspeed or {}))
    return with_fp32_accumulation(config, dict(cfg.deepspeed or {}))


def with_fp32_accumulation(config: dict, user: dict) -> dict:
    """Gradients accumulate over micro-batches in float32 when the model is in a 16-bit dtype
    (`data_types.grad_accum_dtype`; DeepSpeed's default is the model's dtype, which loses the
    small micro-batches' share of a sum of ten or more). Always, not only with several
    micro-batches: how many a step has depends on its completions' lengths, known only then.
    ZeRO stage 0 is left as it is: DeepSpeed refuses the mix there (its DDP path reduces in
    the model's dtype). A `data_types.grad_accum_dtype` in `learner.deepspeed` wins."""
    sixteen_bit = any(dict(config.get(key) or {}).get("enabled") for key in ("bf16", "fp16"))
    stage = int(dict(config.get("zero_optimization") or {}).get("stage", 0))
    if not sixteen_bit or stage < 1 or "grad_accum_dtype" in dict(user.get("data_types") or {}):
        return config
    return deep_merge(config, {"data_types": {"grad_accum_dtype": "fp32"}})


OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def checkpointing(cfg: LearnerConfig, on_gpu: bool) -> bool:
    """Whether the trained models recompute activations (`learner.gradient_checkpointing`)."""
    return on_gpu if cfg.gradient_checkpointing is None else bool(cfg.gradient_checkpointing)


def prepare_for_training(model, checkpointed: bool):
    """When `checkpointed`, the model's own gradient checkpointing (the forwards pass
    use_cache=False: learner/logprobs.py). Transformers checkpoints only modules in training
    mode and `from_pretrained` returns the model in eval mode: train mode turns it on."""
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


def policy_engine(model_path: str, cfg: LearnerConfig, config: dict, dtype, checkpointed: bool = False):
    """(engine, optimizer) of the policy."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    model = prepare_for_training(AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype), checkpointed)
    optimizer = OPTIMIZERS[cfg.optimizer](model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, optimizer


def critic_engine(model_path: str, cfg: LearnerConfig, algo: AlgoConfig, config: dict, dtype,
                  checkpointed: bool = False):
    """PPO's value model: the policy's architecture with a scalar head per token, its own
    DeepSpeed engine and optimizer (what GRPO does without)."""
    import deepspeed
    from transformers import AutoModelForTokenClassification

    critic = prepare_for_training(
        AutoModelForTokenClassification.from_pretrained(model_path, num_labels=1, dtype=dtype), checkpointed)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=algo.critic_lr, weight_decay=cfg.weight_decay)
    engine, _, _, _ = deepspeed.initialize(model=critic, optimizer=optimizer, config=config)
    return engine


def frozen_reference(model_config, state: dict, config: dict, dtype, device, on_gpu: bool):
    """pi_ref from a full state dict. Under ZeRO-3 it is partitioned like the policy (a
    DeepSpeed engine with no optimizer, each rank holding its shard, gathered layer by layer
    in its forward): a full copy per rank is what ZeRO-3 is there to avoid."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    ref.load_state_dict(state, strict=True)
    ref = ref.to(device).eval().requires_grad_(False)
    if config["zero_optimization"]["stage"] != 3:
        return ref
    import deepspeed

    inference = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "bf16": {"enabled": on_gpu},
                 "zero_optimization": dict(config["zero_optimization"])}
    engine, _, _, _ = deepspeed.initialize(model=ref, config=inference)
    engine.eval()  # DeepSpeed's eval() returns None, not the engine
    return engine


def unwrapped(model):
    """The torch module inside a DeepSpeed engine (or the module itself)."""
    return getattr(model, "module", model)


def gathered(params, zero_stage: int):
    """Full copies of `params` for the duration, on every rank (ZeRO-3 only; the other stages
    hold them whole)."""
    if zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([p for p in params if hasattr(p, "ds_id")], modifier_rank=None)


def full_state(module, zero_stage: int) -> dict:
    """The full weights on CPU (a collective under ZeRO-3: every rank calls it)."""
    with gathered(list(module.parameters()), zero_stage):
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
