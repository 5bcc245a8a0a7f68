"""Reading the answer a text commits to: the last `<answer>` block, else the last balanced
`\\boxed{...}`. Shared by the verifiers (what a completion answers) and the datasets (the gold
answer inside a MATH-style solution), so both read a box the same way.
"""
from __future__ import annotations

import re
from typing import List, Optional, Tuple

__all__ = ["extract_answer", "ANSWER_OPEN", "ANSWER_CLOSE", "THINK_OPEN", "THINK_CLOSE"]

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_BOXED = "\\boxed{"


def _last_answer_block(text: str) -> Optional[str]:
    """Content of the last complete ``<answer>...</answer>`` (linear: two rfind calls)."""
    end = text.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(ANSWER_OPEN):end]


_BRACE_TOKENS = re.compile(r"\\boxed\{|\\[{}]|[{}]")


def _last_boxed(text: str) -> Optional[str]:
    """Content of the last balanced ``\\boxed{...}``, in one linear pass.

    "Last" is the box that closes last; an unclosed (truncated) box is skipped, so an earlier
    complete box is still found. Escaped braces ``\\{`` ``\\}`` do not count as grouping.
    """
    if _BOXED not in text:
        return None
    stack: List[int] = []  # for each open group: start of its content if a box, else -1
    best: Optional[Tuple[int, int]] = None
    for m in _BRACE_TOKENS.finditer(text):
        tok = m.group()
        if tok == _BOXED:
            stack.append(m.end())
        elif tok == "{":
            stack.append(-1)
        elif tok == "}":
            if not stack:
                continue  # a stray closing brace: ignore it
            content_start = stack.pop()
            if content_start >= 0:
                best = (content_start, m.start())
        # escaped braces: not grouping
    if best is None:
        return None
    return text[best[0]:best[1]]


def extract_answer(completion: str) -> Optional[str]:
    """The answer a completion commits to, stripped of surrounding whitespace.

    The content of the last ``<answer>...</answer>`` if there is one, else the content of the
    last ``\\boxed{...}`` with balanced braces, else None. An empty answer block gives ``""``.
    """
    if not completion or not isinstance(completion, str):
        return None
    block = _last_answer_block(completion)
    if block is None:
        block = _last_boxed(completion)
    return None if block is None else block.strip()
