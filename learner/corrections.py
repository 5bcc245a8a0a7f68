"""Off-policy corrections: how each token's ratio rho = pi_old / pi_sampler enters the GRPO loss,
and the sampler/trainer mismatch that every step logs (docs/design.md, "Corrections").

The sampler's log-probs may come from older weights (async mode, partial rollouts across a
push) or from other numbers (vLLM's kernels against the learner's). Each correction turns the
per-token ratios into per-token weights w that multiply the clipped surrogate
(`grpo.policy_loss`'s `is_weights`); positions off the mask get 1:

- `tis`: w = min(rho, cap)                                    (truncated IS; veRL's token TIS)
- `mis`: w = rho if low <= rho <= high else 0                 (masked IS: such tokens leave the surrogate)
- `icepop`: the same two-sided mask, with IcePop's bounds     (Ring-1T's IcePop: M(k) = k in [a, b], else 0)
- `seq_mask`: w = 1 for every token of a completion whose geometric-mean ratio
  exp(mean_t log rho_t) is within [low, high], else 0 for all of them (veRL's geometric
  rejection sampling)

Pure torch; no config import beyond the allowed names, so the maths is tested on its own.
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
from torch import Tensor

from common.config import CORRECTIONS

MASKING = ("mis", "icepop", "seq_mask")


def _log_ratio(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log rho on the mask, 0 off it (padding may hold anything)."""
    return torch.where(mask, old_logprobs - sampler_logprobs, torch.zeros_like(old_logprobs))


def _inside(log_value: Tensor, low: float, high: float) -> Tensor:
    """low <= exp(log_value) <= high, compared in log space (no overflow for wild ratios)."""
    floor = math.log(low) if low > 0 else -math.inf
    return (log_value >= floor) & (log_value <= math.log(high))


def _sequence_log_mean(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """Per row, the mean of log rho over its masked tokens ([N, 1]; 0 for a row without any)."""
    count = mask.sum(dim=1, keepdim=True).clamp(min=1)
    return log_ratio.sum(dim=1, keepdim=True) / count


def correction_weights(kind: str, old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor,
                       low: float, high: float) -> Tensor:
    """Per-token weights [N, T] (no gradient) of correction `kind` with its bounds (`tis`: `high`
    is the cap, `low` unused). Rows are whole completions: `seq_mask` averages over each row."""
    if kind not in CORRECTIONS:
        raise ValueError(f"unknown correction {kind!r}; expected one of {CORRECTIONS}")
    mask = mask.bool()
    log_ratio = _log_ratio(old_logprobs, sampler_logprobs, mask)
    rho = torch.exp(log_ratio)
    if kind == "tis":
        w = rho.clamp(max=high)
    elif kind == "seq_mask":
        keep = _inside(_sequence_log_mean(log_ratio, mask), low, high)
        w = keep.to(rho.dtype).expand_as(rho)
    else:  # mis, icepop: the ratio where it is inside the bounds, nothing outside
        w = torch.where(_inside(log_ratio, low, high), rho, torch.zeros_like(rho))
    return torch.where(mask, w, torch.ones_like(w)).detach()


def bounds(algo, kind: str = None) -> Tuple[float, float]:
    """(low, high) of correction `kind` (default: the configured one) from the algo section."""
    kind = algo.correction if kind is None else kind
    if kind == "tis":
        return 0.0, algo.is_cap
    return getattr(algo, f"{kind}_low"), getattr(algo, f"{kind}_high")


def active(algo) -> bool:
    """Whether the configured correction weights the loss (`tis` with is_cap 0 is off)."""
    return algo.correction != "tis" or algo.is_cap > 0


def weights(algo, old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """The configured correction's weights."""
    return correction_weights(algo.correction, old_logprobs, sampler_logprobs, mask, *bounds(algo))


def mismatch_metrics(algo, old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Dict[str, float]:
    """Token means over the mask (learner/metrics.py TOKEN_MEANS), rho = pi_old / pi_sampler:

    - `sampler_logprob_gap`: mean |log rho|;
    - `mismatch_k3`: k3 estimate of KL(pi_sampler || pi_old), mean of rho - 1 - log rho (the
      tokens were drawn by the sampler; 0 when the two agree, >= 0 token by token);
    - `mismatch_chi2`: chi-squared divergence of pi_old from pi_sampler per token, mean rho^2 - 1;
    - `is_weight_mean`: mean weight of the configured correction (1 where it is off);
    - `is_capped_fraction`: share of tokens with rho above algo.is_cap (TIS's cap; 0 when off);
    - `masked_fraction_<kind>` for mis, icepop, seq_mask: share of tokens that correction, with
      its configured bounds, leaves out, whichever correction is on (what the others would do).
    """
    mask = mask.bool()
    with torch.no_grad():
        # float64, and expm1: in sync mode the ratios differ from 1 by float32 rounding (1e-7),
        # where rho - 1 - log rho and rho^2 - 1 in float32 would read 0.
        log_ratio = _log_ratio(old_logprobs.double(), sampler_logprobs.double(), mask)
        rho = torch.exp(log_ratio)
        count = mask.sum().clamp(min=1)

        def mean(x: Tensor) -> Tensor:
            return torch.where(mask, x, torch.zeros_like(x)).sum() / count

        used = weights(algo, old_logprobs, sampler_logprobs, mask) if active(algo) else torch.ones_like(rho)
        values = {
            "sampler_logprob_gap": mean(log_ratio.abs()),
            "mismatch_k3": mean(torch.expm1(log_ratio) - log_ratio),
            "mismatch_chi2": mean(torch.expm1(2 * log_ratio)),
            "is_weight_mean": mean(used),
            "is_capped_fraction": mean((rho > algo.is_cap).to(rho.dtype)) if algo.is_cap > 0 else rho.new_zeros(()),
        }
        for kind in MASKING:
            w = correction_weights(kind, old_logprobs, sampler_logprobs, mask, *bounds(algo, kind))
            values[f"masked_fraction_{kind}"] = mean((w == 0).to(rho.dtype))
        keys = list(values)
        numbers = torch.stack([values[k].double() for k in keys]).tolist()  # one read back
    return dict(zip(keys, numbers))
