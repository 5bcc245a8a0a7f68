"""The all-reduces the update needs beyond DeepSpeed's gradient reduction.

Each is one collective over the learner's data-parallel group: every rank must call it, in the
same order (a rank that skips one hangs the others).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def global_max(value: float, device) -> float:
    """The largest `value` over the ranks."""
    total = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return float(total)


def global_sum(x: torch.Tensor) -> float:
    """The sum of a one-element tensor over the ranks."""
    total = x.detach().double().reshape(1).clone()
    dist.all_reduce(total)
    return float(total)


def global_std(r: torch.Tensor, unbiased: bool = True) -> float:
    """The std of every rank's elements of `r` together (not a mean of per-rank stds): the sample
    std (1/(N-1), as torch.std) when `unbiased`, else the population std (1/N)."""
    stats = torch.stack([r.sum(), (r * r).sum(), r.new_tensor(float(r.numel()))]).double()
    dist.all_reduce(stats)
    total, n = stats[0], stats[2]
    mean = total / n
    # Sum of squared deviations from the sums: the float64 cancellation is far below the eps added
    # to the std, for rewards of order 1.
    squares = (stats[1] - total * mean).clamp(min=0)
    return float((squares / (n - 1 if unbiased else n).clamp(min=1)).sqrt())
