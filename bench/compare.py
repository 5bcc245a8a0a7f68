"""A against B so that the host's drift cannot decide it: both sides in one process tree, in
alternating order (A B A B ...), several pairs, and the ratio reported per pair.

    from bench.compare import alternate
    cmp = alternate(lambda i: run_agent(i), lambda i: run_loop(i), pairs=3,
                    value=lambda r: r["tokens_per_s"], target=0.8)
    cmp.summary()     # {"ratios": [...], "median": ..., "min": ..., "max": ..., "target": 0.8, "met": False, ...}

The ratio is A / B for a figure where more is better (tokens/s), B / A where less is better
(seconds: `lower_is_better=True`), so above 1 A is ahead either way. A target is met only when
the worst pair meets it: the median says what is typical, the minimum what can be claimed. On a
2-core host a pair measured minutes apart can differ by more than the effect; a pair whose sides
run back to back differs by much less, and three pairs show how much.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

PAIRS = 3


@dataclass(frozen=True)
class Comparison:
    """Per-pair figures of A and B, in the order they ran, and what they say together."""
    a: Sequence[float]
    b: Sequence[float]
    lower_is_better: bool = False
    target: Optional[float] = None
    order: Sequence[str] = field(default_factory=tuple)
    label_a: str = "A"
    label_b: str = "B"

    def __post_init__(self):
        if len(self.a) != len(self.b) or not self.a:
            raise ValueError(f"a comparison needs as many A as B figures, at least one pair: {len(self.a)} and "
                             f"{len(self.b)}")

    @property
    def ratios(self) -> List[float]:
        """Per pair: A / B (more is better) or B / A (less is better); above 1 A is ahead."""
        return [(b / a if self.lower_is_better else a / b) if (a and b) else float("nan")
                for a, b in zip(self.a, self.b)]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def worst(self) -> float:
        return min(self.ratios)

    @property
    def best(self) -> float:
        return max(self.ratios)

    @property
    def met(self) -> Optional[bool]:
        """Whether every pair reaches the target (None without one); a failed pair (a zero
        figure, its ratio nan) never does."""
        return None if self.target is None else all(r >= self.target for r in self.ratios)

    def summary(self) -> Dict[str, Any]:
        return {"a": self.label_a, "b": self.label_b, "a_runs": list(self.a), "b_runs": list(self.b),
                "order": list(self.order), "ratio": "B / A" if self.lower_is_better else "A / B",
                "ratios": self.ratios, "median": self.median, "min": self.worst, "max": self.best,
                "pairs": len(self.a), "target": self.target, "met": self.met}

    def sentence(self) -> str:
        """One line for a table or a log: the median ratio, its range, and the verdict."""
        text = (f"{self.label_a} / {self.label_b}: {self.median:.2f}x (min {self.worst:.2f}, max {self.best:.2f}, "
                f"{len(self.a)} pairs)")
        if self.target is not None:
            text += (f"; target {self.target:.2f} met by every pair" if self.met else
                     f"; target {self.target:.2f} not met (worst pair {self.worst:.2f})")
        return text


def alternate(run_a: Callable[[int], Any], run_b: Callable[[int], Any], pairs: int = PAIRS,
              value: Callable[[Any], float] = float, lower_is_better: bool = False, target: Optional[float] = None,
              label_a: str = "A", label_b: str = "B", on_run: Optional[Callable[[str, int, Any], None]] = None
              ) -> Comparison:
    """Run A then B, `pairs` times (A B A B ...), each called with the pair's index; `value` takes
    a run's result to the figure compared; `on_run(side, pair, result)` sees every raw result
    (to record it) as it comes."""
    if pairs < 1:
        raise ValueError("pairs must be at least 1")
    a, b, order = [], [], []
    for i in range(pairs):
        for side, run, into in (("A", run_a, a), ("B", run_b, b)):
            result = run(i)
            order.append(side)
            if on_run is not None:
                on_run(side, i, result)
            into.append(float(value(result)))
    return Comparison(a=a, b=b, lower_is_better=lower_is_better, target=target, order=order,
                      label_a=label_a, label_b=label_b)
