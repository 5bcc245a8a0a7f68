"""Compose the run's config: schema <- conf/ YAML groups <- command-line overrides (Hydra grammar).

Every way a config can be wrong ends here as a `ConfigError` with one line that names the key,
so the CLI can exit with status 2 before Ray or any actor starts.
"""
from __future__ import annotations

import difflib
import functools
import os
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import List, Optional, Sequence

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from common.config import LORA_RANKS, Config, ConfigError
from common.messages import STATE_FILE
from common.plugins import load_function
from common.sandbox import sandbox_problem
from data.tiny_model import tiny_model_dir, variant
from reward.registry import check_settings
from rollout.worker import sampling_is_seeded

__all__ = ["ConfigError", "compose_config", "load_config", "schema_keys"]

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
SCHEMA_NAME = "grpo_schema"
# Schema fields that are free-form mappings: any sub-key is valid there.
MAPPING_KEYS = ("reward.weights.", "reward.custom.", "learner.deepspeed.", "rollout.custom_tools.", "data.tasks.",
                "data.task_config.")


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
    parser = OverridesParser.create()
    parsed = []
    for index, text in enumerate(overrides):  # one at a time, so that the error can name the key
        try:
            parsed.extend(parser.parse_overrides([text]))
        except Exception as exc:  # the grammar itself was violated
            raise ConfigError(_unreadable(text, overrides[index - 1] if index else None)) from exc
    known = set(schema_keys())
    for override in parsed:
        key = override.key_or_group
        if override.is_delete() or key in known or key in GROUPS or key.startswith(MAPPING_KEYS):
            continue
        raise ConfigError(f"unknown config key '{key}'{_nearest_key(key)}")


def _unreadable(text: str, before: Optional[str]) -> str:
    """One line for an override the grammar cannot read, with the quoting that works. Most often
    the shell ate the quotes around a value with spaces, tags or braces, or split it in words."""
    key, equals, value = text.partition("=")
    key = key.lstrip("+~")
    if not equals:
        if before and "=" in before:
            last = before.partition("=")[0].lstrip("+~")
            return (f"'{text}' is not an override (key=value): if it is part of {last}'s value, the shell split it; "
                    f"quote the whole override, e.g. '{last}=\"value with spaces\"'")
        return f"'{text}' is not an override (key=value, group=option or ~key; see grpo train --cfg for the keys)"
    inner, outer = ("'", '"') if '"' in value else ('"', "'")
    quoted = f"{outer}{key}={inner}{value}{inner}{outer}"
    return (f"{key}: the override grammar cannot read the value '{value}'; quote the value for Hydra "
            f"inside quotes for the shell: {quoted}")


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


def _logger_backends(overrides: Sequence[str]) -> List[str]:
    """`logger=[wandb,tensorboard]`: Hydra merges the groups' files, and a list in the later file
    replaces the earlier one's, so the backends of every group picked are joined here (an
    explicit logger.backends=... wins)."""
    picked: List[str] = []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if override.key_or_group == "logger.backends":
            return []
        if override.key_or_group == "logger" and isinstance(override.value(), list):
            picked = [str(option) for option in override.value()]
    backends: List[str] = []
    for option in picked:
        group_file = CONF_DIR / "logger" / f"{option}.yaml"
        if group_file.is_file():  # an unknown option: Hydra says which ones exist
            backends += [b for b in OmegaConf.load(group_file).get("backends", []) if b not in backends]
    return [f"logger.backends=[{','.join(backends)}]"] if picked else []


@functools.cache
def _store_schema() -> None:
    """The schema into Hydra's ConfigStore, once per process: storing converts the dataclasses
    to an OmegaConf node, over a quarter of a composition's time (the unit tests compose
    hundreds)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Schema + conf/config.yaml defaults + overrides, as a typed (struct) DictConfig."""
    _check_keys(overrides)
    overrides = list(overrides) + _logger_backends(overrides)
    _store_schema()
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
    return resolve_auto(config)


def resolve_auto(cfg: Config) -> Config:
    """`cfg` with the settings whose default depends on the device resolved, as a new config
    (`cfg` is left as it is): the rollout's dtype, CUDA graphs, seeded sampling and the rank
    of the adapters the engines serve."""
    rollout, lora = cfg.rollout, cfg.learner.lora
    on_gpu = rollout.num_gpus_per_worker > 0
    max_lora_rank = rollout.max_lora_rank
    if max_lora_rank == 0 and lora.rank and lora.push == "adapter":
        max_lora_rank = next(r for r in LORA_RANKS if r >= lora.rank)
    return replace(cfg, rollout=replace(
        rollout, seeded_sampling=sampling_is_seeded(rollout.seeded_sampling, on_gpu),
        dtype=("bfloat16" if on_gpu else "float32") if rollout.dtype == "auto" else rollout.dtype,
        enforce_eager=not on_gpu if rollout.enforce_eager is None else rollout.enforce_eager,
        max_lora_rank=max_lora_rank))


def validate(cfg: Config) -> None:
    """Settings that type-check but cannot run. Raises ConfigError naming the key: the schema's
    own checks (common/config.py), then what needs this machine: files and the verifiers."""
    cfg.check()
    if cfg.trainer.resume not in (None, "auto"):
        if not (Path(cfg.trainer.resume).expanduser() / STATE_FILE).is_file():
            raise ConfigError(f"trainer.resume: '{cfg.trainer.resume}' is not a complete checkpoint "
                              f"(no {STATE_FILE}); use auto or a checkpoints/step-N folder")
    if cfg.data.source == "jsonl" and not os.path.exists(os.path.expanduser(cfg.data.path)):
        raise ConfigError(f"data.path: no such file '{cfg.data.path}'")
    _check_model(cfg)
    _check_verifiers(cfg)
    _check_tools(cfg)
    _check_loggers(cfg)


def _check_model(cfg: Config) -> None:
    """`model.path` with the built-in model is only the builder's own folder: any other folder or
    hub id would run as `tiny` (no chat template by name, the tiny model's learning rate)."""
    if cfg.model.name != "tiny" or not cfg.model.path:
        return
    built = tiny_model_dir(cfg.model, cfg.trainer.seed, **variant(cfg.rollout))
    if Path(os.path.expanduser(cfg.model.path)).absolute() != built.absolute():
        raise ConfigError(f"model.path='{cfg.model.path}' with model.name=tiny (the built-in model, built in "
                          "model.cache_dir): for your own model add model=hf, and a learning rate for it "
                          "(e.g. learner.lr=1e-6)")


def _check_tools(cfg: Config) -> None:
    """Custom tools that do not import, a python tool without a working sandbox."""
    for name, path in cfg.rollout.custom_tools.items():
        try:
            load_function(path, [os.getcwd()])
        except ValueError as exc:
            raise ConfigError(f"rollout.custom_tools.{name}: {exc}") from None
    if cfg.rollout.agent is not None:
        try:
            load_function(cfg.rollout.agent, [os.getcwd()])
        except ValueError as exc:
            raise ConfigError(f"rollout.agent: {exc}") from None
    if "python" in cfg.rollout.tools:
        problem = sandbox_problem()
        if problem:
            raise ConfigError(f"rollout.tools: the python tool: {problem}")


# The module each dashboard imports, and the package that brings it.
LOGGER_PACKAGES = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard"),
                   "mlflow": ("mlflow", "mlflow-skinny")}


def _check_loggers(cfg: Config) -> None:
    """A dashboard whose package is missing would fail only once the run has started."""
    from importlib.util import find_spec

    for backend in cfg.logger.backends:
        module, package = LOGGER_PACKAGES[backend]
        if find_spec(module) is None:
            raise ConfigError(f"logger.backends: {backend} is not installed here (pip install {package}, or the "
                              "project's `loggers` extra)")


def _check_verifiers(cfg: Config) -> None:
    """Unknown verifiers, missing weights, custom ones that do not import, a sandbox that cannot
    work here: all found before any actor starts."""
    try:
        check_settings(cfg.reward, [os.getcwd()])
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if "code" in cfg.reward.verifiers:
        problem = sandbox_problem()
        if problem:
            raise ConfigError(f"reward.verifiers: {problem}")
