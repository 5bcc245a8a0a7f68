"""Before and around the actors: the model folder, the prompts as the model sees them, the run
folder, and every check that can fail a run before (or as) Ray starts, each a ConfigError with
one line. Shared by `grpo train` and `grpo eval`.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Optional

from cluster.placement import ROLES, check
from common.config import Config, ConfigError, freeze
from common.messages import PromptInfo, ResolvedInputs

# Quiet, reproducible actors: the progress bar is the run's voice, errors still propagate.
ACTOR_ENV = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
}


def say(message: str, since: Optional[float] = None) -> None:
    stamp = f"[{time.time() - since:6.1f}s] " if since is not None else ""
    print(f"{stamp}{message}", flush=True)


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
    from data.tiny_model import build_tiny_model, variant

    folder = build_tiny_model(cfg.model, cfg.trainer.seed, **variant(cfg.rollout))
    check_model_length(cfg, folder)
    check_lora_targets(cfg, folder)
    return folder


def is_built_in(cfg: Config, model_path: Optional[str] = None) -> bool:
    """Whether `model_path` (the resolved model.path; by default `cfg.model.path`) is the
    built-in model's folder, written by this project's builder for this config, rather than a
    folder or hub id the user named."""
    from data.tiny_model import tiny_model_dir, variant

    path = cfg.model.path if model_path is None else model_path
    return cfg.model.name == "tiny" and bool(path) and \
        Path(path) == tiny_model_dir(cfg.model, cfg.trainer.seed, **variant(cfg.rollout))


def prepare_prompts(cfg: Config, model_path: str, heldout, train_set):
    """Every row rendered into the text the model sees (prompt template, system prompt, chat
    template) by the model at `model_path` (resolve_model's answer); returns the rendered
    splits and the run's resolved inputs, whose stops join rollout.stop_token_ids and the
    stops that end a turn (the config itself is left as validated)."""
    from data.prompts import prepare

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


def run_config(cfg: Config, inputs: ResolvedInputs, run_name: str, threads: Optional[ThreadPlan] = None) -> Config:
    """`cfg` with what the run resolved filled in, as a new config (the validated one is never
    written): the model folder, the stops, the run's name and the CPU threads. The roles are
    started with it and config.yaml records it; it is read-only as well."""
    learner, rollout = cfg.learner, cfg.rollout
    if threads is not None:
        learner = replace(learner, num_threads=threads.learner)
        rollout = replace(rollout, num_threads=threads.rollout)
    return freeze(replace(cfg, model=replace(cfg.model, path=inputs.model_path),
                          rollout=replace(rollout, stop_token_ids=list(inputs.stop_token_ids)),
                          learner=learner, trainer=replace(cfg.trainer, run_name=run_name)))


def show_prompt(run_dir: Path, prompts: PromptInfo, started: float) -> None:
    """What the model sees for the first training row, printed and saved as prompt_example.txt."""
    how = "chat template applied" if prompts.chat_template else "no chat template"
    stops = ", ".join(prompts.stop_tokens)
    (run_dir / "prompt_example.txt").write_text(prompts.first_prompt)
    text = prompts.first_prompt
    shown = text if len(text) <= 600 else text[:600] + f"... ({len(text)} characters)"
    say(f"the first training prompt as the model sees it ({how}; a completion stops at {stops}):\n"
        f"{shown}\n---", started)
    if prompts.tools:
        say(prompts.tools, started)


def check_inputs(cfg: Config, train_set) -> None:
    """What the schema cannot know: the size of the data."""
    if len(train_set) < cfg.trainer.prompts_per_step:
        raise ConfigError(f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} exceeds the "
                          f"{len(train_set)} training prompts")
    with_solution = sum(1 for p in train_set if p.solution)
    if cfg.warmup.steps and with_solution and with_solution < cfg.warmup.batch_size:
        raise ConfigError(f"warmup.batch_size={cfg.warmup.batch_size} exceeds the {with_solution} "
                          "training rows with a solution")


def check_resources(cfg: Config, roles=ROLES) -> None:
    """Every role's CPUs and GPUs, on the nodes cluster.nodes names, against what the
    connected cluster has (a placement group it cannot hold would wait forever)."""
    import ray

    _check_nodes(cfg, ray.nodes(), ray.cluster_resources().get("GPU", 0.0), roles)


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
    _check_nodes(cfg, [node], gpus or 0.0, roles)


def _check_nodes(cfg: Config, nodes, cluster_gpus: float, roles) -> None:
    from cluster.compose import check_gpu_layout

    check_gpu_layout(cfg, cluster_gpus, _learner_gpus(cfg, nodes, cluster_gpus) if "learner" in roles else 0.0)
    missing = check(cfg, nodes, roles)
    if missing:
        raise ConfigError(
            f"the actors need {'; '.join(missing)}: lower rollout/learner/reward num_workers, num_ranks "
            "or their num_cpus_*/num_gpus_*, add nodes (or raise ray.num_cpus locally)")


def _learner_gpus(cfg: Config, nodes, cluster_gpus: float) -> float:
    """GPUs on the nodes the learner may run on: those with its `cluster.nodes.learner` resource,
    or the whole cluster's when it names none."""
    label = cfg.cluster.nodes.learner
    if not label:
        return cluster_gpus
    return sum(n["Resources"].get("GPU", 0.0) for n in nodes
               if n.get("Alive", True) and n["Resources"].get(label, 0) > 0)


def node_cpus() -> int:
    """CPUs of the smallest node of the connected Ray that has any (the roles may share any one
    of them; a head started with no CPUs holds no role)."""
    import ray

    counts = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    return min([c for c in counts if c > 0], default=1)


@dataclass(frozen=True)
class ThreadPlan:
    """CPU threads per learner rank and per vLLM engine (learner/rollout.num_threads resolved)."""
    learner: int
    rollout: int
    line: str
    """What each role got, in one line for the run's output."""


def plan_threads(cfg: Config, cpus: int) -> Optional[ThreadPlan]:
    """learner.num_threads and rollout.num_threads, those left at 0 (auto) filled for roles on
    CPUs, and the line that says what each role got (None when every role is on GPUs).

    Sync mode: generation, scoring and training take turns, so the phase that runs gets every
    CPU: each of the R learner ranks max(1, cpus // R) threads, each of the E engines
    max(1, cpus // E). Async mode: the engines generate while the ranks train, so they share
    the CPUs: max(1, cpus // (R + E)) each. More threads than cores would make the running
    phase's threads wait on each other (and on an idle role's)."""
    learner, rollout = cfg.learner, cfg.rollout
    ranks = learner.num_ranks if learner.num_gpus_per_rank == 0 else 0
    engines = rollout.num_workers if rollout.num_gpus_per_worker == 0 and rollout.tensor_parallel_size == 1 else 0
    if not ranks and not engines:
        return None
    if cfg.trainer.mode == "async":
        share_learner = share_engine = max(1, cpus // (ranks + engines))
    else:
        share_learner, share_engine = max(1, cpus // max(ranks, 1)), max(1, cpus // max(engines, 1))
    learner_threads = (learner.num_threads or share_learner) if ranks else learner.num_threads
    rollout_threads = (rollout.num_threads or share_engine) if engines else rollout.num_threads
    parts = []
    if ranks:
        parts.append(f"{ranks} learner ranks x {learner_threads}")
    if engines:
        parts.append(f"{engines} vLLM engines x {rollout_threads}")
    turns = "the phases take turns" if cfg.trainer.mode == "sync" else "generation and training at once"
    return ThreadPlan(learner_threads, rollout_threads,
                      f"CPU threads: {', '.join(parts)} ({cfg.trainer.mode} mode: {turns} on {cpus} CPUs per node)")


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


def run_name(cfg: Config) -> str:
    """trainer.run_name, or by default one from the time it is asked."""
    return cfg.trainer.run_name or time.strftime("grpo-%Y%m%d-%H%M%S")


def make_run_dir(cfg: Config) -> Path:
    """The run folder of `cfg` (a run_config: its run_name is set), with the config.yaml of it."""
    run_dir = Path(cfg.trainer.output_dir).expanduser() / cfg.trainer.run_name
    if (run_dir / "metrics.jsonl").exists() and cfg.trainer.resume is None:
        # Never overwrite what a finished or running job produced.
        raise ConfigError(f"trainer.run_name: '{run_dir}' already holds a run; pick another name")
    run_dir.mkdir(parents=True, exist_ok=True)
    from omegaconf import OmegaConf

    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return run_dir
