"""Learning rate per GRPO step. Linear decay steadies the end of a run, where greedy accuracy
otherwise swings by several points from one evaluation to the next (measured on the built-in task)."""
from __future__ import annotations


def lr_at(step: int, total_steps: int, base_lr: float, schedule: str, min_lr_ratio: float) -> float:
    """`constant`, or `linear` from base_lr at step 1 to base_lr * min_lr_ratio at the last step."""
    if schedule == "constant" or total_steps <= 1:
        return base_lr
    if schedule == "linear":
        progress = (step - 1) / (total_steps - 1)
        return base_lr * (1.0 - (1.0 - min_lr_ratio) * progress)
    raise ValueError(f"unknown learning rate schedule {schedule!r}")
