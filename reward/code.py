"""The `code` verifier: run the completion's program against the row's unit tests.

A row's `tests` field is Python source with assertions (MBPP / HumanEval style), run after the
program in the same namespace inside reward.sandbox. The score is 1.0 only if every statement of
the tests ran; a timeout raises VerifierTimeout so the pool can count it.
"""
from __future__ import annotations

import re
from typing import Optional

from reward.errors import VerifierTimeout
from common.sandbox import SandboxLimits, run_python
from reward.verifiers import extract_answer

MAX_PROGRAM_CHARS = 100_000
"""Longer programs score 0 without running (no real solution to a test problem is this long)."""

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_program(completion: str) -> Optional[str]:
    """The program a completion commits to: the last fenced code block inside the answer
    block (or anywhere, when there is no answer block), else the answer block itself."""
    if not completion or not isinstance(completion, str):
        return None
    answer = extract_answer(completion)
    for text in (answer, completion):
        if text:
            blocks = _FENCE.findall(text)
            if blocks:
                return blocks[-1]
    return answer or None


def code_score(completion: str, tests: Optional[str], limits: SandboxLimits) -> float:
    """1.0 iff the extracted program followed by `tests` runs to the end in the sandbox."""
    program = extract_program(completion)
    if not program or not program.strip() or len(program) > MAX_PROGRAM_CHARS:
        return 0.0
    if not isinstance(tests, str) or not tests.strip():
        return 0.0  # nothing to pass: a program is not rewarded for merely running
    result = run_python(program, tests, limits)
    if result.timed_out:
        raise VerifierTimeout(f"program ran past {limits.timeout_s:g} s")
    return 1.0 if result.passed else 0.0
