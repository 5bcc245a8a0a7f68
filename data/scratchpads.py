"""Worked solutions (warm-up targets) that several prompt sources share: the built-in addition task
(data/datasets.py) and reasoning-gym's two-term sums (data/reasoning_gym.py)."""
from __future__ import annotations

__all__ = ["solve_addition"]


def solve_addition(a: int, b: int) -> str:
    """R1-layout completion of `a+b=` with a scratchpad of per-digit sums.

    From the least significant digit, each entry is `x+y+carry=sum`; the shorter operand is
    padded with 0 digits, so 5-digit operands give 5 entries:
    `solve_addition(47, 85) == "<think>7+5+0=12,4+8+1=13</think><answer>132</answer>"`.
    """
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, int) or not isinstance(b, int):
        raise TypeError(f"solve_addition takes two ints (got {a!r}, {b!r})")
    if a < 0 or b < 0:
        raise ValueError(f"solve_addition takes non-negative operands (got {a}, {b})")
    da, db = str(a)[::-1], str(b)[::-1]
    width = max(len(da), len(db))
    da, db = da.ljust(width, "0"), db.ljust(width, "0")
    steps = []
    carry = 0
    for x, y in zip(da, db):
        total = int(x) + int(y) + carry
        steps.append(f"{x}+{y}+{carry}={total}")
        carry = total // 10
    return f"<think>{','.join(steps)}</think><answer>{a + b}</answer>"
