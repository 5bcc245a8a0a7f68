"""A run's set-up once its inputs are checked: the actors' environment, the Ray cluster's room
for every role, CPU threads per role, the run's config (what it resolved, filled into a copy)
and its folder, and the lines the run prints. Shared by `grpo train` and `grpo eval`."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import ray
from omegaconf import OmegaConf

from cluster.layout import ROLES, check_nodes
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


def check_resources(cfg: Config, roles=ROLES) -> None:
    """Every role's CPUs and GPUs, on the nodes cluster.nodes names, against what the
    connected cluster has (a placement group it cannot hold would wait forever)."""
    check_nodes(cfg, ray.nodes(), ray.cluster_resources().get("GPU", 0.0), roles)


def node_cpus() -> int:
    """CPUs of the smallest node of the connected Ray that has any (the roles may share any one
    of them; a head started with no CPUs holds no role)."""
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
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return run_dir
