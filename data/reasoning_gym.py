"""Problems from reasoning-gym's procedural tasks (`data=reasoning_gym`).

A task (`data.task`) or a weighted mix of tasks (`data.tasks`, through reasoning-gym's own
`composite` dataset) generates problems as a function of `trainer.seed` and an index. Held-out
and train come from one index range: indices 0, 1, 2, ... are generated in order, repeated
questions are dropped (the first copy is kept), the first `data.heldout_size` distinct
questions are held out and the next `data.num_train` trained on. So the two never share a
question and two runs with one seed get the same lists.

Each Problem carries what the `reasoning_gym` verifier (reward/gym.py) needs to call the task's
own `score_answer`: the task's name, its config and the entry's metadata, in `fields`. Its
warm-up target is the bare answer (`<think></think><answer>...</answer>`): reasoning-gym's
tasks carry no worked solution in a form a small model can copy. The exception is a sum of two
non-negative integers (chain_sum, basic_arithmetic with `+` only), which gets the built-in
task's digit-by-digit scratchpad.

reasoning-gym is an extra (`pip install -e .[gym]`); without it this says how to install it.
"""
from __future__ import annotations

import difflib
import re
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Tuple

from common.problem import Problem
from data.errors import DataError
from data.scratchpads import solve_addition

if TYPE_CHECKING:
    from common.config import DataConfig

__all__ = ["INSTALL_HINT", "DEFAULT_NUM_TRAIN", "gym_problems", "gym_version", "task_specs", "warmup_target"]

INSTALL_HINT = "data=reasoning_gym needs reasoning-gym: pip install -e '.[gym]' (or pip install reasoning-gym==0.1.25)"
DEFAULT_NUM_TRAIN = 10_000
"""Training problems when data.num_train is 0: reasoning-gym's question spaces are mostly unbounded."""
# Indices tried per problem wanted before giving up on a task whose question space is small:
# narrow configs (two one-digit terms) repeat questions often.
_TRIES_PER_PROBLEM = 4


def _import():
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(INSTALL_HINT) from None
    return reasoning_gym


def gym_version() -> str:
    """The installed release (reasoning_gym.__version__ lags behind the package's own)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("reasoning-gym")
    except PackageNotFoundError:
        raise DataError(INSTALL_HINT) from None


def task_specs(data_cfg: "DataConfig") -> List[Tuple[str, float, Dict[str, Any]]]:
    """(task, weight, task config) of each task the section names: `data.task` alone (weight 1,
    `data.task_config` its config), or `data.tasks` (name -> weight; `data.task_config` then maps
    each task name to its config)."""
    configs = dict(data_cfg.task_config or {})
    if data_cfg.task and data_cfg.tasks:
        raise DataError("data.task and data.tasks: name one task, or several with weights, not both")
    if data_cfg.task:
        return [(str(data_cfg.task), 1.0, configs)]
    if not data_cfg.tasks:
        raise DataError("data.task is required with data=reasoning_gym (e.g. data.task=chain_sum)")
    unknown = sorted(set(configs) - set(data_cfg.tasks))
    if unknown:
        raise DataError(f"data.task_config.{unknown[0]}: with data.tasks, task_config maps each task "
                        f"({', '.join(data_cfg.tasks)}) to its config")
    specs = []
    for name, weight in data_cfg.tasks.items():
        if not weight > 0:
            raise DataError(f"data.tasks.{name}: weights must be positive (got {weight})")
        config = configs.get(name) or {}
        if not isinstance(config, Mapping):
            raise DataError(f"data.task_config.{name} must be a mapping of that task's config keys")
        specs.append((str(name), float(weight), dict(config)))
    return specs


def _plain(value: Any) -> Any:
    """OmegaConf containers (lists, dicts inside task_config) as plain Python values."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _make(name: str, config: Dict[str, Any], seed: int, size: int, key: str):
    """One task's dataset; an unknown name, a key its config does not take, or a value its
    config refuses is a DataError of one line naming the setting."""
    gym = _import()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        near = difflib.get_close_matches(name, list(DATASETS), n=3, cutoff=0.5)
        hint = f" (nearest: {', '.join(near)})" if near else f" ({len(DATASETS)} tasks; e.g. chain_sum, spell_backward)"
        raise DataError(f"{key}: reasoning-gym has no task '{name}'{hint}")
    config = _plain(config)
    for reserved in ("seed", "size"):
        if reserved in config:
            raise DataError(f"{key}: '{reserved}' is set by the run (trainer.seed, data.num_train), "
                            "not in data.task_config")
    try:
        return gym.create_dataset(name, seed=seed, size=size, **config)
    except TypeError as exc:
        from dataclasses import fields

        taken = sorted(f.name for f in fields(DATASETS[name][1]) if f.name not in ("seed", "size"))
        bad = next((k for k in config if k not in taken), None)
        if bad is None:
            raise DataError(f"{key}: {exc}") from None
        near = difflib.get_close_matches(bad, taken, n=1, cutoff=0.5)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise DataError(f"data.task_config: task '{name}' takes no key '{bad}' ({hint}its keys: "
                        f"{', '.join(taken)})") from None
    except (AssertionError, ValueError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise DataError(f"data.task_config of task '{name}': {message}") from None


def _dataset(data_cfg: "DataConfig", seed: int, size: int):
    """The task's dataset, or reasoning-gym's composite over the weighted tasks; and each task's
    config by name (what scoring rebuilds the task with)."""
    specs = task_specs(data_cfg)
    datasets = {name: _make(name, config, seed, size, "data.task" if data_cfg.task else f"data.tasks.{name}")
                for name, _, config in specs}
    configs = {name: _plain(config) for name, _, config in specs}
    if data_cfg.task:
        return datasets[specs[0][0]], configs
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    composite = CompositeConfig(size=size, seed=seed,
                                datasets=[DatasetSpec(name, weight, configs[name]) for name, weight, _ in specs])
    return CompositeDataset(composite), configs


# A sum of two non-negative integers (chain_sum's and basic_arithmetic's `expression`): the one
# shape with a worked solution here, the built-in task's digit-by-digit scratchpad.
_TWO_TERM_SUM = re.compile(r"\s*(\d{1,9})\s*\+\s*(\d{1,9})\s*")


def warmup_target(metadata: Mapping[str, Any], answer: str) -> str:
    """The warm-up's target: a worked solution where one exists (two-term sums), else the bare
    answer, `<think></think><answer>ANSWER</answer>`."""
    match = _TWO_TERM_SUM.fullmatch(str(metadata.get("expression", "")))
    if match and str(int(match.group(1)) + int(match.group(2))) == answer:
        return solve_addition(int(match.group(1)), int(match.group(2)))
    return f"<think></think><answer>{answer}</answer>"


def _problem(entry: Mapping[str, Any], configs: Mapping[str, Dict[str, Any]], single: str) -> Problem:
    metadata = dict(entry.get("metadata") or {})
    task = str(metadata.get("source_dataset") or single)
    answer = "" if entry.get("answer") is None else str(entry["answer"])
    return Problem(prompt=str(entry["question"]), answer=answer, solution=warmup_target(metadata, answer),
                   fields={"task": task, "task_config": configs.get(task, {}), "metadata": metadata})


def gym_problems(data_cfg: "DataConfig", seed: int, heldout_size: int) -> Tuple[List[Problem], List[Problem]]:
    """(held-out, train) problems of the configured task(s), deterministic in `seed`, disjoint by
    question text."""
    if heldout_size < 0:
        raise DataError(f"data.heldout_size must be at least 0 (got {heldout_size})")
    num_train = data_cfg.num_train or DEFAULT_NUM_TRAIN
    wanted = heldout_size + num_train
    limit = wanted * _TRIES_PER_PROBLEM
    dataset, configs = _dataset(data_cfg, seed, limit)
    single = str(data_cfg.task or "")
    seen, problems = set(), []
    for index in range(limit):
        entry = dataset[index]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        problems.append(_problem(entry, configs, single))
        if len(problems) == wanted:
            break
    heldout, train = problems[:heldout_size], problems[heldout_size:]
    if not train:
        raise DataError(f"data.heldout_size={heldout_size} leaves no training problems: the task config gives "
                        f"only {len(problems)} distinct questions in {limit} tries (widen data.task_config)")
    return heldout, train
