"""Compose the run's config: schema <- conf/ YAML groups <- command-line overrides (Hydra grammar).

Every way a config can be wrong ends here as a `ConfigError` with one line that names the key,
so the CLI can exit with status 2 before Ray or any actor starts.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Sequence

from omegaconf import DictConfig, OmegaConf

from cluster.config import Config

if TYPE_CHECKING:
    from reward.registry import VerifierSettings

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
SCHEMA_NAME = "grpo_schema"
# Schema fields that are free-form mappings: any sub-key is valid there.
MAPPING_KEYS = ("reward.weights.", "reward.custom.", "learner.deepspeed.")


class ConfigError(ValueError):
    """A config that cannot run; its message is one line naming the key to change."""


def schema_keys(node=Config, prefix: str = "") -> List[str]:
    """Every dotted key of the schema, e.g. `trainer.max_steps`."""
    keys = []
    for f in fields(node):
        key = f"{prefix}{f.name}"
        keys.append(key)
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            keys.extend(schema_keys(type(default), key + "."))
    return keys


def _nearest_key(key: str) -> str:
    candidates = schema_keys()
    # Prefer keys in the same section, then any key: a typo rarely changes the section.
    section = key.split(".")[0] + "."
    same = [c for c in candidates if c.startswith(section)]
    match = difflib.get_close_matches(key, same, n=1, cutoff=0.5) or difflib.get_close_matches(
        key, candidates, n=1, cutoff=0.5
    )
    return f" (did you mean '{match[0]}'?)" if match else ""


GROUPS = ("model", "data", "logger")


def _check_keys(overrides: Sequence[str]) -> None:
    """Every override must name a schema key, a config group, or a key under a free-form mapping.

    Checked before Hydra composes: for a `+key=value` typo Hydra would add the key and the
    schema would then drop it silently, so the run would go on with the default.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as exc:  # the grammar itself was violated
        raise ConfigError(f"cannot parse overrides: {str(exc).splitlines()[0]}") from exc
    known = set(schema_keys())
    for override in parsed:
        key = override.key_or_group
        if override.is_delete() or key in known or key in GROUPS or key.startswith(MAPPING_KEYS):
            continue
        raise ConfigError(f"unknown config key '{key}'{_nearest_key(key)}")


def _explain(exc: Exception) -> str:
    """Turn Hydra's multi-line composition errors into one line naming the key."""
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    full_key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), "")
    text = lines[0] if lines else type(cause).__name__
    if "Could not find" in str(exc):
        # Keep Hydra's list of available options, drop its search-path dump.
        first = str(exc).split("Config search path")[0]
        text = " ".join(line.strip() for line in first.splitlines() if line.strip())
    return f"{full_key}: {text}" if full_key and full_key not in text else text


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Schema + conf/config.yaml defaults + overrides, as a typed (struct) DictConfig."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra

    _check_keys(overrides)
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="grpo"):
            return compose(config_name="config", overrides=list(overrides))
    except Exception as exc:  # Hydra/OmegaConf raise many types; all are a bad config here
        raise ConfigError(_explain(exc)) from exc


def load_config(overrides: Sequence[str] = ()) -> Config:
    """Composed, type-checked and validated config as the schema's dataclass."""
    cfg = compose_config(overrides)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{missing[0]} is required: set it on the command line ({missing[0]}=...)")
    try:
        config = OmegaConf.to_object(cfg)
    except Exception as exc:
        raise ConfigError(str(exc).splitlines()[0]) from exc
    assert isinstance(config, Config)
    validate(config)
    resolve_auto(config)
    return config


def resolve_auto(cfg: Config) -> None:
    """Settings whose default depends on the device: the rollout's dtype and CUDA graphs."""
    on_gpu = cfg.rollout.num_gpus_per_worker > 0
    if cfg.rollout.dtype == "auto":
        cfg.rollout.dtype = "bfloat16" if on_gpu else "float32"
    if cfg.rollout.enforce_eager is None:
        cfg.rollout.enforce_eager = not on_gpu


def check_gpu_layout(cfg: Config, cluster_gpus: float) -> None:
    """No two roles on one GPU by accident (NCCL refuses two ranks on one GPU, and a second vLLM
    engine on a GPU fails its free-memory check)."""
    tp = cfg.rollout.tensor_parallel_size
    if cluster_gpus > 0 and os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
        raise ConfigError("VLLM_BATCH_INVARIANT=1 is not supported on GPUs: it pins NCCL settings inside the "
                          "engines that the learner's weight-sync sender does not share; unset it")
    if cluster_gpus > 0 and cfg.rollout.num_gpus_per_worker == 0:
        raise ConfigError(f"the cluster has {cluster_gpus:g} GPUs but rollout.num_gpus_per_worker=0: every vLLM "
                          f"engine would see all of them and use GPU 0; set rollout.num_gpus_per_worker={tp}")


def _one_of(key: str, value, options) -> None:
    if value not in options:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, options))} (got '{value}')")


def _at_least(key: str, value, minimum) -> None:
    if value < minimum:
        raise ConfigError(f"{key} must be at least {minimum} (got {value})")


def validate(cfg: Config) -> None:
    """Settings that type-check but cannot run. Raises ConfigError naming the key."""
    _at_least("algo.group_size", cfg.algo.group_size, 2)
    _at_least("algo.num_iterations", cfg.algo.num_iterations, 1)
    _at_least("algo.beta", cfg.algo.beta, 0.0)
    _at_least("algo.clip_low", cfg.algo.clip_low, 0.0)
    _at_least("algo.clip_high", cfg.algo.clip_high, 0.0)
    _one_of("algo.adv_scale", cfg.algo.adv_scale, ("group", "batch", "none"))
    _one_of("algo.adv_estimator", cfg.algo.adv_estimator, ("grpo", "rloo", "gae"))
    if cfg.algo.adv_estimator == "gae" and cfg.learner.max_tokens_per_microbatch:
        raise ConfigError("learner.max_tokens_per_microbatch is not supported with algo.adv_estimator=gae "
                          "yet: set it to 0")
    _one_of("algo.kl_estimator", cfg.algo.kl_estimator, ("k1", "k2", "k3"))
    _one_of("algo.ratio_level", cfg.algo.ratio_level, ("token", "sequence"))
    _at_least("algo.overlong_buffer", cfg.algo.overlong_buffer, 0)
    if cfg.algo.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(f"algo.overlong_buffer={cfg.algo.overlong_buffer} exceeds "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}")
    _at_least("algo.max_sampling_rounds", cfg.algo.max_sampling_rounds, 1)
    _at_least("algo.max_staleness", cfg.algo.max_staleness, 0)
    if cfg.algo.is_cap != 0 and cfg.algo.is_cap < 1:
        raise ConfigError(f"algo.is_cap must be 0 (off) or at least 1 (got {cfg.algo.is_cap})")
    _one_of("trainer.mode", cfg.trainer.mode, ("sync", "async"))
    _at_least("trainer.async_lookahead", cfg.trainer.async_lookahead, 1)
    _one_of("algo.loss_agg", cfg.algo.loss_agg,
            ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"))
    _at_least("trainer.max_steps", cfg.trainer.max_steps, 0)
    _at_least("trainer.prompts_per_step", cfg.trainer.prompts_per_step, 1)
    _at_least("rollout.num_workers", cfg.rollout.num_workers, 1)
    _at_least("learner.num_ranks", cfg.learner.num_ranks, 1)
    _at_least("learner.minibatches", cfg.learner.minibatches, 1)
    _at_least("reward.num_workers", cfg.reward.num_workers, 1)
    _one_of("learner.zero_stage", cfg.learner.zero_stage, (0, 1, 2, 3))
    _one_of("learner.backend", cfg.learner.backend, ("auto", "gloo", "nccl"))
    _one_of("data.chat_template", str(cfg.data.chat_template).lower(), ("auto", "true", "false"))
    _at_least("eval.n", cfg.eval.n, 0)
    for k in cfg.eval.k:
        if not 1 <= k <= max(cfg.eval.n, 1):
            raise ConfigError(f"eval.k={list(cfg.eval.k)}: each k must be between 1 and eval.n={cfg.eval.n}")
    if cfg.eval.n and cfg.eval.temperature <= 0:
        raise ConfigError(f"eval.temperature must be > 0 for sampled evaluation (got {cfg.eval.temperature})")
    if cfg.data.eval_path and cfg.data.eval_split:
        raise ConfigError("data.eval_path and data.eval_split: give one evaluation set, not both")
    if cfg.data.eval_split and cfg.data.source != "hf":
        raise ConfigError("data.eval_split is a split of a `datasets` set (data=hf); for a file use data.eval_path")
    _one_of("learner.optimizer", cfg.learner.optimizer, ("adamw", "sgd"))
    _one_of("learner.lr_schedule", cfg.learner.lr_schedule, ("constant", "linear"))
    _one_of("data.source", cfg.data.source, ("arithmetic", "jsonl", "hf"))
    _one_of("model.name", cfg.model.name, ("tiny", "hf"))
    _one_of("logger.backend", cfg.logger.backend, ("wandb", "none"))
    _one_of("rollout.dtype", cfg.rollout.dtype, ("auto", "float32", "bfloat16", "float16"))
    gpus = cfg.rollout.num_gpus_per_worker
    if gpus and gpus != cfg.rollout.tensor_parallel_size:
        raise ConfigError(f"rollout.num_gpus_per_worker={gpus:g} with rollout.tensor_parallel_size="
                          f"{cfg.rollout.tensor_parallel_size}: an engine takes one whole GPU per tensor-parallel "
                          "rank (its ranks run inside the actor, on its GPUs); make them equal")
    if cfg.learner.num_gpus_per_rank not in (0, 1):
        raise ConfigError(f"learner.num_gpus_per_rank={cfg.learner.num_gpus_per_rank:g}: a learner rank uses one "
                          "whole GPU (1) or none (0); NCCL refuses two ranks on one GPU")
    for role in ("rollout", "learner", "reward"):
        _one_of(f"cluster.strategy.{role}", getattr(cfg.cluster.strategy, role),
                ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    if cfg.rollout.temperature <= 0:
        raise ConfigError(f"rollout.temperature must be above 0 for sampling (got {cfg.rollout.temperature}); "
                          "evaluation is greedy anyway")
    _at_least("rollout.max_new_tokens", cfg.rollout.max_new_tokens, 1)
    _at_least("rollout.top_k", cfg.rollout.top_k, 0)
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1] (got {cfg.rollout.top_p})")
    _at_least("rollout.chunks_per_worker", cfg.rollout.chunks_per_worker, 1)
    if cfg.rollout.kv_cache_gib <= 0:
        raise ConfigError(f"rollout.kv_cache_gib must be above 0 (got {cfg.rollout.kv_cache_gib})")
    _at_least("rollout.tensor_parallel_size", cfg.rollout.tensor_parallel_size, 1)
    if cfg.rollout.num_gpus_per_worker and cfg.rollout.num_gpus_per_worker < cfg.rollout.tensor_parallel_size:
        raise ConfigError(f"rollout.num_gpus_per_worker={cfg.rollout.num_gpus_per_worker:g} is less than "
                          f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size}: one GPU per TP rank")
    if any(not s for s in cfg.rollout.stop):
        raise ConfigError("rollout.stop: an empty stop string would end every completion at once")
    _at_least("data.heldout_size", cfg.data.heldout_size, 1)
    _at_least("warmup.check_every", cfg.warmup.check_every, 1)
    _at_least("warmup.probe_size", cfg.warmup.probe_size, 1)
    _at_least("trainer.save_every", cfg.trainer.save_every, 0)
    _at_least("trainer.keep_checkpoints", cfg.trainer.keep_checkpoints, 0)
    if cfg.trainer.resume == "auto" and not cfg.trainer.run_name:
        raise ConfigError("trainer.resume=auto needs trainer.run_name: the name of the run to continue")
    if cfg.trainer.resume not in (None, "auto"):
        from cluster.checkpoint import STATE_FILE

        if not (Path(cfg.trainer.resume).expanduser() / STATE_FILE).is_file():
            raise ConfigError(f"trainer.resume: '{cfg.trainer.resume}' is not a complete checkpoint "
                              f"(no {STATE_FILE}); use auto or a checkpoints/step-N folder")
    _check_verifiers(cfg)
    # Groups are the unit that learner ranks split: advantages need a whole group on one rank.
    groups_per_rank, rest = divmod(cfg.trainer.prompts_per_step, cfg.learner.num_ranks)
    if rest:
        raise ConfigError(
            f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} cannot be split over "
            f"learner.num_ranks={cfg.learner.num_ranks}: make it a multiple of the ranks"
        )
    if groups_per_rank * cfg.algo.group_size < cfg.learner.minibatches:
        raise ConfigError(
            f"learner.minibatches={cfg.learner.minibatches} exceeds the "
            f"{groups_per_rank * cfg.algo.group_size} completions each learner rank gets per step"
        )
    if cfg.warmup.steps and cfg.warmup.batch_size % cfg.learner.num_ranks:
        raise ConfigError(
            f"warmup.batch_size={cfg.warmup.batch_size} cannot be split over "
            f"learner.num_ranks={cfg.learner.num_ranks}"
        )
    if cfg.rollout.max_new_tokens >= cfg.rollout.max_model_len:
        raise ConfigError(
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for the prompt "
            f"in rollout.max_model_len={cfg.rollout.max_model_len}"
        )
    if cfg.model.name == "hf" and not cfg.model.path:
        raise ConfigError("model.path is required with model=hf (a local folder or a hub id)")
    if cfg.data.source == "jsonl" and not cfg.data.path:
        raise ConfigError("data.path is required with data=jsonl (a .jsonl or .parquet file)")
    if cfg.data.source == "hf" and not (cfg.data.name or cfg.data.path):
        raise ConfigError("data.name (or data.path of a saved dataset) is required with data=hf")
    if cfg.data.source == "jsonl" and not os.path.exists(os.path.expanduser(cfg.data.path)):
        raise ConfigError(f"data.path: no such file '{cfg.data.path}'")
    if cfg.data.source == "arithmetic":
        _at_least("data.min_digits", cfg.data.min_digits, 2)
        _at_least("data.max_digits", cfg.data.max_digits, cfg.data.min_digits)


def verifier_settings(reward) -> VerifierSettings:
    """The verifier pool's settings from the `reward` config section."""
    from reward.registry import VerifierSettings

    return VerifierSettings(
        verifiers=list(reward.verifiers), weights=dict(reward.weights), timeout_s=reward.timeout_s,
        format_pattern=reward.format_pattern, language=reward.language,
        length_budget=reward.length_budget, custom=dict(reward.custom),
        memory_mb=reward.sandbox_memory_mb, max_file_mb=reward.sandbox_max_file_mb,
        max_processes=reward.sandbox_max_processes, search_path=[os.getcwd()],
    )


def _check_verifiers(cfg: Config) -> None:
    """Unknown verifiers, missing weights, custom ones that do not import, a sandbox that cannot
    work here: all found before any actor starts."""
    from reward.registry import check_settings
    from reward.sandbox import sandbox_problem

    try:
        check_settings(verifier_settings(cfg.reward))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if "code" in cfg.reward.verifiers:
        problem = sandbox_problem()
        if problem:
            raise ConfigError(f"reward.verifiers: {problem}")
