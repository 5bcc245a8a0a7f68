"""The `language` verifier (DeepSeek-R1's language-consistency reward) and the `length` penalty.

`language_score` is the share of the completion's letters written in the expected script; tags,
digits, punctuation, LaTeX commands and fenced code do not count. `length_penalty` is 0 up to a
budget of characters and falls linearly to -1 at twice the budget (the seeds' overthinking
failure: long answers that add nothing).
"""
from __future__ import annotations

import re
import unicodedata

SCRIPTS = {
    "latin": ("LATIN",),
    "han": ("CJK",),
    "cyrillic": ("CYRILLIC",),
    "greek": ("GREEK",),
    "arabic": ("ARABIC",),
    "hebrew": ("HEBREW",),
    "devanagari": ("DEVANAGARI",),
    "hangul": ("HANGUL",),
    "japanese": ("CJK", "HIRAGANA", "KATAKANA"),
    "thai": ("THAI",),
}
"""Script name -> prefixes of the Unicode character names that belong to it."""

LANGUAGES = {"en": "latin", "fr": "latin", "de": "latin", "es": "latin", "it": "latin",
             "pt": "latin", "zh": "han", "ru": "cyrillic", "uk": "cyrillic", "el": "greek",
             "ar": "arabic", "he": "hebrew", "hi": "devanagari", "ko": "hangul",
             "ja": "japanese", "th": "thai"}
"""ISO 639-1 code -> script, so a row may say `language: zh` or `language: han`."""

_NOT_PROSE = re.compile(r"```.*?```|\\[A-Za-z]+|</?(?:think|answer)>", re.DOTALL)


def script_of(language: str) -> str:
    key = str(language).strip().lower()
    key = LANGUAGES.get(key, key)
    if key not in SCRIPTS:
        raise ValueError(f"unknown language or script {language!r} (scripts: {', '.join(SCRIPTS)}; "
                         f"codes: {', '.join(LANGUAGES)})")
    return key


def language_score(completion: str, language: str = "latin") -> float:
    """Share of letters in the expected script; 1.0 when the text has no letters at all
    (digits and symbols are language-neutral), 0.0 for an empty completion."""
    if not completion or not isinstance(completion, str):
        return 0.0
    prefixes = SCRIPTS[script_of(language)]
    total = matched = 0
    for ch in _NOT_PROSE.sub(" ", completion):
        if not ch.isalpha():
            continue
        total += 1
        name = unicodedata.name(ch, "")
        if name.startswith(prefixes):
            matched += 1
    return 1.0 if total == 0 else matched / total


def length_penalty(completion: str, budget_chars: int) -> float:
    """0.0 within `budget_chars`, then linearly down to -1.0 at twice the budget (and beyond)."""
    if budget_chars <= 0:
        raise ValueError("the length budget must be a positive number of characters")
    over = len(completion or "") - budget_chars
    return 0.0 if over <= 0 else -min(1.0, over / budget_chars)
