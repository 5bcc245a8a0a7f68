"""Verifiers: pure functions of text that score one completion against its gold answer.

Every verifier returns a float in [0, 1] and never raises on odd input (empty, huge,
malformed or adversarial completions score 0). Imports only the ground floor (common/).

- ``extract_answer`` (from common/answers.py): the answer a completion commits to (last
  ``<answer>`` block, else the last balanced ``\\boxed{...}``).
- ``math_score``: 1.0 iff the extracted answer equals the gold answer mathematically
  (``math_verify``: ``3/4`` == ``0.75``, ``\\frac{1}{2}`` == ``0.5``, ``1,234`` == ``1234``).
- ``format_score``: 1.0 iff the completion has the R1 layout
  ``<think>...</think><answer>...</answer>`` and nothing else.

The registry of verifier names (these two, code, language, length, custom ones) is
reward/registry.py.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from typing import Optional

from common.answers import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN, extract_answer
from reward.errors import VerifierTimeout

__all__ = [
    "extract_answer",
    "math_score",
    "format_score",
    "DEFAULT_TIMEOUT_S",
    "MAX_ANSWER_CHARS",
]

DEFAULT_TIMEOUT_S: float = 5.0
"""Per-call parse / compare limit given to math_verify (main thread only, see math_score)."""

MAX_ANSWER_CHARS: int = 1000
"""An extracted answer longer than this scores 0 without being parsed: no real answer is that
long, and sympy on megabytes of text (with no timeout off the main thread) could hang."""

# ---------------------------------------------------------------------------- math


_GROUPED_NUMBER = re.compile(r"[+-]?\d{1,3}(?:(?:,|\\,|\{,\}| )\d{3})+(?:\.\d+)?")
_GROUP_SEPARATORS = re.compile(r"\\,|\{,\}|[, ]")


# A number followed only by words (units: "18 dollars", "1,234 people"): math_verify's LaTeX
# mode reads the words as a product of symbols (18*d*o*l*l*a*r*s). Words need 3+ letters so
# that "2 pi" or "3 x" are not cut down to a bare number.
_NUMBER_THEN_WORDS = re.compile(r"([+-]?\d[\d,]*(?:\.\d+)?)\s+[A-Za-z]{3,}(?:\s+[A-Za-z]+)*\.?")


def _normalise(text: str) -> str:
    """Undo what math_verify misreads in a plain-number answer.

    - A number followed by unit words keeps only the number (``18 dollars`` -> ``18``).
    - ``$1 234$`` parses as the mixed number 1 + 234 = 235 and ``1{,}234`` as a set; a text
      that is one thousands-grouped number becomes plain digits.
    Other text is left alone.
    """
    text = text.strip()
    m = _NUMBER_THEN_WORDS.fullmatch(text)
    if m:
        text = m.group(1)
    if _GROUPED_NUMBER.fullmatch(text):
        return _GROUP_SEPARATORS.sub("", text)
    return text


def _mv_timeout(timeout_s: Optional[float]) -> Optional[int]:
    """math_verify's timeouts use signal.alarm: whole seconds, main thread only."""
    if timeout_s is None or timeout_s <= 0:
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    return max(1, math.ceil(timeout_s))


def _parse(text: str, timeout: Optional[int]) -> list:
    """Parse one answer string (gold or extracted) with math_verify.

    Wrapped in ``$...$`` first: LaTeX mode reads plain numbers, ``3/4``, ``1,234``, decimals and
    LaTeX (``\\frac12``, ``10^{3}``, ``\\sqrt{2}``) correctly, whereas raw text drops LaTeX
    (``\\frac12`` gives nothing) or truncates it (``10^{3}`` gives 10). If that yields no sympy
    object, the raw text is tried (it finds the number in prose such as ``18 dollars``).
    """
    import math_verify  # local: keeps importing this module cheap

    def is_expr(x) -> bool:
        return not isinstance(x, str)

    text = _normalise(text)
    if not text:
        return []
    parsed = math_verify.parse(f"${text}$", parsing_timeout=timeout)
    if any(is_expr(x) for x in parsed):
        return parsed
    raw = math_verify.parse(text, parsing_timeout=timeout)
    if any(is_expr(x) for x in raw):
        return raw
    return parsed or raw


_PLAIN_INTEGER = re.compile(r"[+-]?\d{1,1000}")


@functools.lru_cache(maxsize=8192)
def _equal(gold_text: str, pred_text: str, timeout: Optional[int]) -> bool:
    """math_verify's verdict on one (gold, answer) pair. Cached: the G answers of a group share
    their gold and often each other (parsing was most of a verifier actor's time); a timeout or
    an error raises through the cache and is not remembered. Two plain integers are compared
    as integers: math_verify's verdict on them is integer equality (`007` == `7`, `-0` == `0`),
    at a thousandth of its cost."""
    if _PLAIN_INTEGER.fullmatch(gold_text) and _PLAIN_INTEGER.fullmatch(pred_text):
        return int(gold_text) == int(pred_text)
    import math_verify

    gold = _parse(gold_text, timeout)
    pred = _parse(pred_text, timeout)
    if not gold or not pred:
        return False
    return bool(math_verify.verify(gold, pred, timeout_seconds=timeout))


def math_score(completion: str, answer: str, *, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S,
               max_answer_chars: int = MAX_ANSWER_CHARS, raise_timeout: bool = False) -> float:
    """1.0 iff the extracted answer equals the gold ``answer`` mathematically, else 0.0.

    Uses ``math_verify.verify(gold, pred)`` (gold first: the comparison is asymmetric). No
    extractable answer, an over-long one, an unparsable one, or any exception inside
    math_verify gives 0.0. ``timeout_s`` bounds each parse and compare, but only on the main
    thread (math_verify uses signal.alarm); from any other thread the limit is off, so the
    call cannot raise there, and ``max_answer_chars`` is the only guard. With
    ``raise_timeout`` a timeout raises VerifierTimeout instead of scoring 0 (the pool counts it).
    """
    pred_text = extract_answer(completion)
    if not pred_text or len(pred_text) > max_answer_chars:
        return 0.0
    if answer is None:
        return 0.0
    gold_text = str(answer).strip()
    if not gold_text:
        return 0.0
    timeout = _mv_timeout(timeout_s)
    from math_verify.errors import TimeoutException  # a BaseException, not an Exception

    try:
        ok = _equal(gold_text, pred_text, timeout)
    except TimeoutException:
        if raise_timeout:
            raise VerifierTimeout(f"math-verify ran past {timeout} s") from None
        return 0.0
    except Exception:
        return 0.0
    return 1.0 if ok else 0.0


# ---------------------------------------------------------------------------- format


# Any spelling of a think/answer tag (case, spaces, attributes, self-closing): the layout must
# contain exactly the four canonical tags and no other variant.
_ANY_TAG = re.compile(r"<\s*/?\s*(?:think|answer)\b", re.IGNORECASE)


def _r1_layout(completion: str) -> bool:
    s = completion.strip()
    if not (s.startswith(THINK_OPEN) and s.endswith(ANSWER_CLOSE)):
        return False
    for tag in (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE):
        if s.count(tag) != 1:
            return False
    if len(_ANY_TAG.findall(s)) != 4:
        return False
    think_close = s.index(THINK_CLOSE)
    answer_open = s.index(ANSWER_OPEN)
    if answer_open < think_close:
        return False
    between = s[think_close + len(THINK_CLOSE):answer_open]
    if between.strip():
        return False  # text between </think> and <answer>
    answer_body = s[answer_open + len(ANSWER_OPEN):-len(ANSWER_CLOSE)]
    return bool(answer_body.strip())


def format_score(completion: str, pattern: Optional[str] = None) -> float:
    """1.0 iff the completion has the R1 layout, else 0.0.

    Default layout: ``<think>...</think><answer>...</answer>``, optionally with whitespace
    around the whole and between the two blocks; each tag exactly once (no other spelling of a
    think/answer tag anywhere), nothing outside the two blocks, and a non-blank answer. The check
    is str.count / index arithmetic plus one linear regex scan: no catastrophic backtracking.

    With ``pattern``, 1.0 iff ``re.fullmatch(pattern, completion, re.DOTALL)`` (the pattern's
    own cost is the caller's responsibility).
    """
    if not completion or not isinstance(completion, str):
        return 0.0
    if pattern is not None:
        return 1.0 if re.fullmatch(pattern, completion, re.DOTALL) else 0.0
    return 1.0 if _r1_layout(completion) else 0.0
