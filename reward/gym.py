"""The `reasoning_gym` verifier: a reasoning-gym task's own `score_answer` on the extracted answer.

The row's fields (data/reasoning_gym.py puts them there) name the task (`task`), its config
(`task_config`) and the entry's `metadata`; the task is built once per (task, config) in the
scoring process and asked to score `{"question", "answer", "metadata"}` as reasoning-gym's own
training loops do. The score is the task's partial credit in [0, 1], with two rules of ours:

- No extractable answer scores 0, without asking the task (several give 0.01 for None).
- A score below `reward.gym_score_floor` (default 0.1) counts 0: several tasks give 0.01-0.05 to
  any wrong answer, so a group of wrong answers would otherwise have unequal rewards, pass
  dynamic sampling as informative and hand out advantages of +-1 for format noise. With the
  floor, an all-wrong group is uniform (advantage 0, dropped by dynamic sampling); real partial
  credit (0.5 for a near answer) is kept.
"""
from __future__ import annotations

import functools
import json
import math
from typing import Any, Mapping, Optional

from common.answers import extract_answer

__all__ = ["INSTALL_HINT", "answer_of", "check_task", "gym_score", "task_dataset"]

INSTALL_HINT = "the reasoning_gym verifier needs reasoning-gym: pip install -e '.[gym]' (or pip install reasoning-gym==0.1.25)"

MAX_ANSWER_CHARS = 10_000
"""A longer extracted answer scores 0 unread: some tasks parse answers with sympy or regexes."""


@functools.lru_cache(maxsize=64)
def _dataset(task: str, config_json: str):
    import reasoning_gym

    # size=1: scoring needs the task's config, not its problems (some build word lists per item).
    return reasoning_gym.create_dataset(task, seed=0, size=1, **json.loads(config_json))


def task_dataset(task: str, config: Optional[Mapping[str, Any]] = None):
    """The task's dataset object, built once per (task, config) in this process."""
    return _dataset(task, json.dumps(dict(config or {}), sort_keys=True, default=list))


def check_task(task: str) -> None:
    """ValueError of one line, with the nearest names, when reasoning-gym has no such task."""
    import difflib

    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    if task not in DATASETS:
        near = difflib.get_close_matches(task, list(DATASETS), n=3, cutoff=0.5)
        raise ValueError(f"reasoning-gym has no task '{task}'" + (f" (nearest: {', '.join(near)})" if near else ""))


def answer_of(completion: str, extract: str = "answer") -> Optional[str]:
    """The answer the task scores: the last `<answer>` block (else the last `\\boxed{}`), or the
    whole completion stripped with `extract="whole"`; None when there is none."""
    if extract == "whole":
        text = completion.strip()
        return text or None
    return extract_answer(completion)


def gym_score(completion: str, answer: str, fields: Mapping[str, Any], extract: str = "answer",
              floor: float = 0.0) -> float:
    """The task's `score_answer` on the extracted answer, in [0, 1]; see the module's rules.
    A row without a `task` field, or a task that raises, scores 0."""
    task = fields.get("task")
    if not task:
        return 0.0
    given = answer_of(completion, extract)
    if given is None or len(given) > MAX_ANSWER_CHARS:
        return 0.0
    entry = {"question": fields.get("question", ""), "answer": answer, "metadata": dict(fields.get("metadata") or {})}
    try:
        score = float(task_dataset(str(task), fields.get("task_config")).score_answer(given, entry))
    except Exception:  # a task's parser on adversarial text: the completion is wrong, not the run
        return 0.0
    if not math.isfinite(score):
        return 0.0
    score = min(max(score, 0.0), 1.0)
    return 0.0 if score < floor else score
