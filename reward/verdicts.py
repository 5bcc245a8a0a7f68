"""The LLM judge's prompt and verdict rules (reward/judge.py serves the judge): pure text, no Ray,
so that the driver checks a template or a pattern before any actor starts."""
from __future__ import annotations

import re
import string
from typing import Optional

from common.config import JudgeConfig

__all__ = ["TEMPLATE_FIELDS", "judge_prompt", "parse_verdict", "template_problem", "verdict_regex"]

_YES_NO = r"\b(yes|no)\b"
_NUMBER = r"([+-]?\d+(?:\.\d+)?)"
TEMPLATE_FIELDS = ("prompt", "completion", "answer")


def template_problem(template: str) -> Optional[str]:
    """Why `template` cannot be a judge's prompt (None: it can): it must name `{completion}` and
    no field but those of TEMPLATE_FIELDS."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        return f"{exc} (write literal braces as {{{{ and }}}})"
    unknown = [n for n in names if n not in TEMPLATE_FIELDS]
    if unknown:
        return f"'{{{unknown[0]}}}' is not a field the judge fills ({', '.join('{%s}' % f for f in TEMPLATE_FIELDS)})"
    if "completion" not in names:
        return "it has no {completion}: the judge would not see what it judges"
    return None


def verdict_regex(settings: JudgeConfig) -> "re.Pattern[str]":
    """The compiled verdict rule (re.error for a pattern that does not compile)."""
    default = _YES_NO if settings.verdict == "yes_no" else _NUMBER
    pattern = re.compile(settings.verdict_pattern or default, re.IGNORECASE)
    if pattern.groups < 1:
        raise re.error("the pattern needs a group (...) around the verdict")
    return pattern


def judge_prompt(template: str, prompt: str, completion: str, answer: str) -> str:
    return template.format(prompt=prompt, completion=completion, answer=answer)


def parse_verdict(reply: str, settings: JudgeConfig, pattern: Optional["re.Pattern[str]"] = None) -> Optional[float]:
    """The score a reply gives, in [0, 1]; None when it has no verdict."""
    pattern = pattern or verdict_regex(settings)
    match = pattern.search(reply)
    if match is None or match.group(1) is None:
        return None
    value = match.group(1).strip().lower()
    if settings.verdict == "yes_no":
        return 1.0 if value == "yes" else 0.0 if value == "no" else None
    try:
        number = float(value)
    except ValueError:
        return None
    return min(max(number / settings.max_score, 0.0), 1.0)


