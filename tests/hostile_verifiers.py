"""Custom verifiers that misbehave on purpose (loaded by import path in the hostile-input tests).
Each misbehaves only when its trigger word is in the completion, so control rows score normally."""
import math
import re
import sys


def _each(completions, trigger, bad, good=1.0):
    return [bad() if trigger in c else good for c in completions]


def hang_in_c(prompts, completions, **fields):
    """A regex that backtracks for ages inside C code: no Python signal handler can stop it."""
    return _each(completions, "HANG", lambda: float(bool(re.match(r"(a*)*b", "a" * 60))))


def exits(prompts, completions, **fields):
    return _each(completions, "EXIT", lambda: sys.exit(0))


def not_a_number(prompts, completions, **fields):
    return _each(completions, "NAN", lambda: math.nan)


def crashes(prompts, completions, **fields):
    import ctypes

    return _each(completions, "CRASH", lambda: ctypes.string_at(0))  # segfault
