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

Custom verifiers come from `reward.custom` (name -> ``module:function``) and take what reward
functions for other GRPO trainers take: keyword lists ``prompts``, ``completions``, ``answer``
and every other row field, one element each; they return a list of floats (None counts as 0).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, Mapping, Sequence

from common.config import RewardConfig
from common.plugins import load_function
from reward.code import code_score
from reward.language import language_score, length_penalty, script_of
from common.sandbox import MARGIN_S as SANDBOX_MARGIN_S
from common.sandbox import SandboxLimits
from reward.verifiers import format_score, math_score

__all__ = ["BUILTIN", "build_verifiers", "check_settings", "combine", "sandbox_limits"]

Call = Callable[[str, str, str, Mapping[str, Any]], float]

BUILTIN = ("math", "format", "code", "language", "length")

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
    if "length" in settings.verifiers and settings.length_budget <= 0:
        raise ValueError(f"reward.length_budget must be a positive number of characters "
                         f"(got {settings.length_budget})")


def combine(scores: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """The reward: sum over verifiers of weight x score."""
    return float(sum(float(weights[name]) * score for name, score in scores.items()))
