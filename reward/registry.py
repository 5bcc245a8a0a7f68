"""Verifier names -> scoring calls, built from the `reward` config section (a child process builds them).

Every call has one shape, ``call(prompt, completion, answer, fields) -> float``, where `fields`
holds the row's other columns (`tests` for code, `language`, ...). Built-in verifiers:

| name       | score                                                                 |
|------------|-----------------------------------------------------------------------|
| `math`     | 1 iff the answer equals the gold answer (math-verify, gold first)     |
| `format`   | 1 iff the R1 layout (or `reward.format_pattern` matches the whole)    |
| `code`     | 1 iff the program passes the row's `tests` in the sandbox             |
| `language` | share of letters in the row's `language` (else `reward.language`)     |
| `length`   | 0 within `reward.length_budget` characters, down to -1 at twice that  |
| `reasoning_gym` | the row's reasoning-gym task's own `score_answer` (reward/gym.py) |
| `reward_model` | a sequence-classification model's logit on prompt + completion (reward/reward_model.py) |
| `judge`    | an LLM judge's verdict on vLLM engines of its own (reward/judge.py)   |

Custom verifiers come from `reward.custom` (name -> ``module:function``) and take what reward
functions for other GRPO trainers take: keyword lists ``prompts``, ``completions``, ``answer``
and every other row field, one element each; they return a list of floats (None counts as 0).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from common.config import RewardConfig
from common.plugins import load_function
from reward.code import code_score
from reward.language import language_score, length_penalty, script_of
from common.sandbox import MARGIN_S as SANDBOX_MARGIN_S
from common.sandbox import SandboxLimits
from reward.gym import INSTALL_HINT as GYM_INSTALL_HINT
from reward.gym import gym_score
from reward.verifiers import format_score, math_score

__all__ = ["BUILTIN", "MODEL_VERIFIERS", "build_verifiers", "check_judge", "check_reward_model", "check_settings",
           "combine", "sandbox_limits"]

Call = Callable[[str, str, str, Mapping[str, Any]], float]

BUILTIN = ("math", "format", "code", "language", "length", "reasoning_gym", "reward_model", "judge")
MODEL_VERIFIERS = ("reward_model", "judge")
"""Verifiers served by pools of model actors (reward/reward_model.py, reward/judge.py), not by the
verifier process (reward/model_scorer.py joins them)."""


def sandbox_limits(cfg: RewardConfig) -> SandboxLimits:
    """The code sandbox's limits from the reward section."""
    return SandboxLimits(timeout_s=max(cfg.timeout_s - SANDBOX_MARGIN_S, 0.1), memory_mb=cfg.sandbox_memory_mb,
                         max_file_mb=cfg.sandbox_max_file_mb, max_processes=cfg.sandbox_max_processes)


def _custom_call(fn: Callable[..., Any]) -> Call:
    def call(prompt: str, completion: str, answer: str, fields: Mapping[str, Any]) -> float:
        extra = {k: [v] for k, v in fields.items() if k not in ("prompts", "completions", "answer")}
        out = fn(prompts=[prompt], completions=[completion], answer=[answer], **extra)
        value = list(out)[0]
        return 0.0 if value is None else float(value)
    return call


def check_reward_model(path: Optional[str]) -> None:
    """ValueError of one line unless `path` is a folder with a sequence-classification model of
    one logit and a pad token (batches are padded; Qwen2's config has none by default)."""
    if not path:
        raise ValueError("reward.model.path is required with the reward_model verifier (a local folder)")
    folder = Path(os.path.expanduser(path))
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"reward.model.path: '{path}' has no config.json (not a Hugging Face model folder)")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"reward.model.path: '{path}' has no sequence-classification head (architectures: "
                         f"{', '.join(architectures) or 'none'}); save one with "
                         "AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)")
    labels = len(config.get("id2label") or {}) or config.get("num_labels") or 2  # transformers' default is 2
    if labels != 1:
        raise ValueError(f"reward.model.path: '{path}' has a head of {labels} logits; a reward model has one "
                         "(num_labels=1)")
    if config.get("pad_token_id") is None:
        raise ValueError(f"reward.model.path: '{path}' sets no pad_token_id in config.json, which batched "
                         "scoring needs (set it to the tokenizer's pad token id)")


def check_judge(judge) -> None:
    """ValueError of one line for a judge that cannot run: no model folder, a template without
    `{completion}` (or with a field it cannot fill), a verdict pattern that does not compile."""
    from reward.verdicts import template_problem, verdict_regex

    if not judge.path:
        raise ValueError("reward.judge.path is required with the judge verifier (a local causal-LM folder)")
    config_file = Path(os.path.expanduser(judge.path)) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"reward.judge.path: '{judge.path}' has no config.json (not a Hugging Face model folder)")
    limit = json.loads(config_file.read_text()).get("max_position_embeddings")
    if limit and judge.max_model_len > limit:
        raise ValueError(f"reward.judge.max_model_len={judge.max_model_len} exceeds the judge's "
                         f"max_position_embeddings={limit}")
    problem = template_problem(judge.template)
    if problem:
        raise ValueError(f"reward.judge.template: {problem}")
    try:
        verdict_regex(judge)
    except re.error as exc:
        raise ValueError(f"reward.judge.verdict_pattern does not compile: {exc}") from None


def build_verifiers(settings: RewardConfig, search_path: Sequence[str] = ()) -> Dict[str, Call]:
    """One call per selected verifier name (a name listed twice is built once). `search_path`:
    folders tried first when importing custom verifiers (the driver's working directory)."""
    limits = sandbox_limits(settings)
    pattern = settings.format_pattern
    calls: Dict[str, Call] = {}
    for name in settings.verifiers:
        if name in calls:
            continue
        if name in settings.custom:
            calls[name] = _custom_call(load_function(settings.custom[name], search_path))
        elif name == "math":
            calls[name] = lambda p, c, a, f: math_score(c, a, timeout_s=settings.timeout_s,
                                                        raise_timeout=True)
        elif name == "format":
            calls[name] = lambda p, c, a, f: format_score(c, pattern)
        elif name == "code":
            calls[name] = lambda p, c, a, f: code_score(c, f.get("tests"), limits)
        elif name == "language":
            calls[name] = lambda p, c, a, f: language_score(c, f.get("language") or settings.language)
        elif name == "length":
            calls[name] = lambda p, c, a, f: length_penalty(c, settings.length_budget)
        elif name == "reasoning_gym":
            calls[name] = lambda p, c, a, f: gym_score(c, a, f, settings.gym_extract, settings.gym_score_floor)
        else:
            raise ValueError(f"unknown verifier '{name}'")
    return calls


def check_settings(settings: RewardConfig, search_path: Sequence[str] = ()) -> None:
    """Raise ValueError with one line for anything that would fail only once scoring starts."""
    if not settings.verifiers:
        raise ValueError("reward.verifiers is empty: name at least one verifier (e.g. [math,format])")
    known = list(BUILTIN) + [n for n in settings.custom if n not in BUILTIN]
    for name in settings.verifiers:
        if name not in BUILTIN and name not in settings.custom:
            raise ValueError(f"reward.verifiers: unknown verifier '{name}' (known: {', '.join(known)}; "
                             f"add your own with +reward.custom.{name}=module:function)")
        if name not in settings.weights:
            raise ValueError(f"reward.weights: no weight for verifier '{name}' "
                             f"(set +reward.weights.{name}=1.0)")
    for name, path in settings.custom.items():
        if name in BUILTIN:
            raise ValueError(f"reward.custom.{name}: '{name}' is a built-in verifier; pick another name")
        try:
            load_function(path, search_path)
        except ValueError as exc:
            raise ValueError(f"reward.custom.{name}: {exc}") from None
    if settings.timeout_s <= 0:
        raise ValueError(f"reward.timeout_s must be positive (got {settings.timeout_s})")
    if settings.format_pattern is not None:
        try:
            re.compile(settings.format_pattern)
        except re.error as exc:
            raise ValueError(f"reward.format_pattern is not a valid regular expression: {exc}") from None
    try:
        script_of(settings.language)
    except ValueError as exc:
        raise ValueError(f"reward.language: {exc}") from None
    if "reasoning_gym" in settings.verifiers:
        from importlib.util import find_spec

        if find_spec("reasoning_gym") is None:
            raise ValueError(GYM_INSTALL_HINT)
    if "reward_model" in settings.verifiers:
        check_reward_model(settings.model.path)
    if "judge" in settings.verifiers:
        check_judge(settings.judge)
    if "length" in settings.verifiers and settings.length_budget <= 0:
        raise ValueError(f"reward.length_budget must be a positive number of characters "
                         f"(got {settings.length_budget})")


def combine(scores: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """The reward: sum over verifiers of weight x score."""
    return float(sum(float(weights[name]) * score for name, score in scores.items()))
