"""Before any actor, and before Ray or torch is imported: the model folder, the prompts as the
model sees them, and every check that can fail a run then, each a ConfigError with one line.
Shared by `grpo train` and `grpo eval`; what follows once Ray runs is cluster/loop/launch.py.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Optional

from cluster.layout import ROLES, check_nodes
from common.config import Config, ConfigError
from common.messages import PromptInfo, ResolvedInputs
from data.prompts import prepare
from data.tiny_model import build_tiny_model, tiny_model_dir, variant


def resolve_model(cfg: Config) -> str:
    """The model folder (or hub id) that learner and rollout load; builds the tiny model once."""
    path = cfg.model.path
    if path:
        local = os.path.expanduser(path)
        looks_local = local.startswith((".", "/", "~")) or os.path.exists(local)
        if looks_local and not os.path.isdir(local):
            raise ConfigError(f"model.path: no such folder '{path}'")
        if looks_local:
            check_model_length(cfg, local)
            check_lora_targets(cfg, local)
        return local if looks_local else path
    folder = build_tiny_model(cfg.model, cfg.trainer.seed, **variant(cfg.rollout))
    check_model_length(cfg, folder)
    check_lora_targets(cfg, folder)
    return folder


def is_built_in(cfg: Config, model_path: Optional[str] = None) -> bool:
    """Whether `model_path` (the resolved model.path; by default `cfg.model.path`) is the
    built-in model's folder, written by this project's builder for this config, rather than a
    folder or hub id the user named."""
    path = cfg.model.path if model_path is None else model_path
    return cfg.model.name == "tiny" and bool(path) and \
        Path(path) == tiny_model_dir(cfg.model, cfg.trainer.seed, **variant(cfg.rollout))


def prepare_prompts(cfg: Config, model_path: str, heldout, train_set):
    """Every row rendered into the text the model sees (prompt template, system prompt, chat
    template) by the model at `model_path` (resolve_model's answer); returns the rendered
    splits and the run's resolved inputs, whose stops join rollout.stop_token_ids and the
    stops that end a turn (the config itself is left as validated)."""
    name = model_path if cfg.model.name == "hf" else cfg.model.name
    rendered, info = prepare(cfg.data, model_path, name, {"train": train_set, "eval": heldout}, cfg.rollout,
                             built_in=is_built_in(cfg, model_path))
    prompts = PromptInfo.from_dict(info)
    tokens, where = prompts.longest_prompt
    if tokens + cfg.rollout.max_new_tokens > cfg.rollout.max_model_len:
        raise ConfigError(f"the longest prompt ({where}, {tokens} tokens as rendered) plus rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens} exceeds rollout.max_model_len={cfg.rollout.max_model_len}")
    stops = tuple(sorted(set(cfg.rollout.stop_token_ids) | set(prompts.stop_token_ids)))
    return rendered["eval"], rendered["train"], ResolvedInputs(model_path, stops, prompts)


def check_inputs(cfg: Config, train_set) -> None:
    """What the schema cannot know: the size of the data."""
    if len(train_set) < cfg.trainer.prompts_per_step:
        raise ConfigError(f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} exceeds the "
                          f"{len(train_set)} training prompts")
    with_solution = sum(1 for p in train_set if p.solution)
    if cfg.warmup.steps and with_solution and with_solution < cfg.warmup.batch_size:
        raise ConfigError(f"warmup.batch_size={cfg.warmup.batch_size} exceeds the {with_solution} "
                          "training rows with a solution")


def check_local_resources(cfg: Config, roles=ROLES) -> None:
    """check_resources before a local Ray starts, for what it will have: ray.num_cpus or the
    CPUs Ray counts on this machine, and ray.num_gpus when set (left to Ray's detection, GPUs
    are checked once it runs). A shortfall then exits in a second instead of after Ray's start.
    Nothing to do when joining a cluster (ray.address, RAY_ADDRESS): checked once joined."""
    if cfg.ray.address or os.environ.get("RAY_ADDRESS"):
        return
    try:  # Ray's own count (cgroup limits included); a private helper, so only an early check
        from ray._private.utils import get_num_cpus
    except ImportError:
        return
    cpus = cfg.ray.num_cpus if cfg.ray.num_cpus is not None else get_num_cpus()
    gpus = cfg.ray.num_gpus
    node = {"Alive": True, "Resources": {"CPU": float(cpus), "GPU": float("inf") if gpus is None else float(gpus)}}
    check_nodes(cfg, [node], gpus or 0.0, roles)


def check_model_length(cfg: Config, folder: str) -> None:
    config_file = Path(folder) / "config.json"
    if not config_file.exists():
        raise ConfigError(f"model.path: '{folder}' has no config.json (not a Hugging Face model folder)")
    limit = json.loads(config_file.read_text()).get("max_position_embeddings")
    if limit and cfg.rollout.max_model_len > limit:
        raise ConfigError(f"rollout.max_model_len={cfg.rollout.max_model_len} exceeds the model's "
                          f"max_position_embeddings={limit}")


def lora_targets(cfg: Config, folder: str) -> Dict[str, tuple]:
    """(d_in, d_out) of each linear layer that `learner.lora.target_modules` names (by peft's
    matching: a full name or its last parts), from the model's config alone (built on the meta
    device: no weights are read). None of target_modules: every linear projection but the head."""
    # Only a LoRA run needs them, and bad input elsewhere answers without torch's import.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    linear = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = cfg.learner.lora.target_modules
    if not targets:
        head = model.get_output_embeddings()
        return {n: dims for n, dims in linear.items() if model.get_submodule(n) is not head}
    return {n: dims for n, dims in linear.items() if any(n == t or n.endswith("." + t) for t in targets)}


def check_lora_targets(cfg: Config, folder: str) -> None:
    """LoRA's targets exist in the model and each is wider than the rank (B A of rank r needs
    r <= min(d_in, d_out) to be a rank-r update)."""
    rank = cfg.learner.lora.rank
    if not rank:
        return
    found = lora_targets(cfg, folder)
    if not found:
        raise ConfigError(f"learner.lora.target_modules={list(cfg.learner.lora.target_modules or [])} names no "
                          f"linear layer of the model in '{folder}' (e.g. q_proj, v_proj, down_proj)")
    name, dims = min(found.items(), key=lambda item: min(item[1]))
    if rank > min(dims):
        raise ConfigError(f"learner.lora.rank={rank} exceeds the layer {name} ({dims[0]} -> {dims[1]}): "
                          f"use a rank of at most {min(dims)}")


