"""GRPO maths: advantages, KL penalty, clipped surrogate loss (docs/design.md, "GRPO, exactly").

Pure torch. Shapes: B prompts x G samples = N completions, T tokens per (padded) completion.
Names follow the maths: r rewards, A advantages, rho the importance ratio.
"""
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from common.config import ADV_ESTIMATORS, ADV_SCALES, ADV_STDS, KL_ESTIMATORS, LOSS_AGGS, RATIO_LEVELS

GROUP_BASELINES = tuple(e for e in ADV_ESTIMATORS if e != "gae")  # gae: the critic's (learner/ppo.py)


def _check(name: str, value: str, allowed: Tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {allowed}")


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of x over positions where mask is true; 0 (not NaN) where there are none."""
    mask = mask.bool()
    x = torch.where(mask, x, torch.zeros_like(x))  # where, not x*mask: NaN*0 would stay NaN
    if dim is None:
        return x.sum() / mask.sum().clamp(min=1)
    return x.sum(dim) / mask.sum(dim).clamp(min=1)


def compute_advantages(rewards: Tensor, group_size: int, scale: str = "group",
                       eps: float = 1e-4, estimator: str = "grpo", std: str = "sample") -> Tensor:
    """One advantage per completion from rewards ordered group by group ([B*G] -> [B*G]).

    grpo: A_i = r_i - mean(r);  rloo: A_i = r_i - mean_{j != i} r_j  (leave-one-out baseline).
    scale: "group" divides by the group's std of r (+eps), "batch" by the whole batch's std of r
    (+eps), "none" keeps the centred value (Dr. GRPO).
    std: "sample" (1/(n-1), veRL's and TRL's torch.std) or "population" (1/n), n the G rewards of
    a group or the batch's N; population/sample = sqrt((n-1)/n), so "population" advantages are
    sqrt(n/(n-1)) times larger (1.069x at G=8, 1.155x at 4, 1.414x at 2).
    The std is always that of the rewards (for rloo too), as docs/design.md states.
    """
    _check("scale", scale, ADV_SCALES)
    _check("std", std, ADV_STDS)
    _check("advantage estimator", estimator, GROUP_BASELINES)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a baseline needs peers), got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards are not divisible into groups of {group_size}")
    r = rewards.view(-1, group_size)                          # [B, G]
    G = group_size
    mean = r.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        A = r - mean
    else:  # rloo: mean of the other G-1 rewards = (sum - r_i) / (G - 1)
        A = r - (r.sum(dim=1, keepdim=True) - r) / (G - 1)
    unbiased = std == "sample"
    if scale == "group":
        A = A / (r.std(dim=1, unbiased=unbiased, keepdim=True) + eps)
    elif scale == "batch":
        A = A / (rewards.std(unbiased=unbiased) + eps)
    # Float rounding of the mean can leave tiny non-zeros; a group with no signal gets exactly 0.
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)
    A = torch.where(equal, torch.zeros_like(A), A)
    return A.reshape(-1)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman's k1/k2/k3)."""
    _check("kl estimator", estimator, KL_ESTIMATORS)
    log_r = ref_logprobs - logprobs                           # log(pi_ref / pi_theta)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r ** 2
    return torch.exp(log_r) - log_r - 1                       # k3: unbiased and >= 0


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_length - buffer tokens,
    then linearly down to -penalty at max_length (and -penalty beyond)."""
    if buffer <= 0 or buffer > max_length:
        raise ValueError(f"the overlong buffer must be in 1..{max_length} tokens (got {buffer})")
    over = (lengths.to(torch.float32) - (max_length - buffer)).clamp(min=0)
    return -penalty * (over / buffer).clamp(max=1.0)


def truncated_is_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor,
                         cap: float) -> Tuple[Tensor, Dict[str, float]]:
    """Per-token min(pi_old / pi_sampler, cap) (truncated importance sampling, as in veRL's TIS
    and IMPALA's truncated rho): corrects the surrogate for samples drawn by a sampler whose
    weights lag the learner's (async mode) or whose numbers differ (vLLM vs training kernels),
    with the variance bounded by `cap`. Positions outside `mask` get 1. With the metrics of
    `is_metrics`."""
    return is_weights(old_logprobs, sampler_logprobs, mask, cap), is_metrics(old_logprobs, sampler_logprobs, mask,
                                                                             cap)


def is_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float) -> Tensor:
    """The weights of `truncated_is_weights` alone: no metric, so no read back to the host."""
    mask = mask.bool()
    w = torch.exp(torch.where(mask, old_logprobs - sampler_logprobs, torch.zeros_like(old_logprobs)))
    return torch.where(mask, w.clamp(max=cap), torch.ones_like(w)).detach()


def is_metrics(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float) -> Dict[str, float]:
    """Over the masked tokens: the mean truncated weight, the fraction capped, and the mean
    |log pi_old - log pi_sampler|."""
    mask = mask.bool()
    with torch.no_grad():
        log_w = torch.where(mask, old_logprobs - sampler_logprobs, torch.zeros_like(old_logprobs))
        w = torch.exp(log_w)
        return {
            "is_weight_mean": masked_mean(torch.where(mask, w.clamp(max=cap), torch.ones_like(w)), mask).item(),
            "is_capped_fraction": masked_mean((w > cap).to(w.dtype), mask).item(),
            "sampler_logprob_gap": masked_mean(log_w.abs(), mask).item(),
        }


def _check_loss_args(logprobs, ref_logprobs, advantages, mask, beta, kl_estimator, loss_agg, max_length,
                     ratio_level) -> None:
    _check("loss_agg", loss_agg, LOSS_AGGS)
    _check("ratio_level", ratio_level, RATIO_LEVELS)
    _check("kl estimator", kl_estimator, KL_ESTIMATORS)
    if loss_agg == "seq-mean-token-sum-norm" and (max_length is None or max_length <= 0):
        raise ValueError("loss_agg 'seq-mean-token-sum-norm' needs a positive max_length")
    if beta != 0 and ref_logprobs is None:
        raise ValueError("beta != 0 needs ref_logprobs")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape) or mask.shape != logprobs.shape:
        raise ValueError(f"shapes: logprobs {tuple(logprobs.shape)}, mask {tuple(mask.shape)}, "
                         f"advantages {tuple(advantages.shape)} (want [N, T], [N, T], [N] or [N, T])")


def aggregate(per_token: Tensor, mask: Tensor, loss_agg: str, max_length: Optional[int] = None,
              num_tokens: Optional[float] = None) -> Tensor:
    """The loss from per-token losses [N, T] (zero off the mask), by `loss_agg`."""
    n_tokens = mask.sum(dim=1)                                # [N]
    if loss_agg == "seq-mean-token-mean":
        per_seq = per_token.sum(dim=1) / n_tokens.clamp(min=1)
        return per_seq.sum() / (n_tokens > 0).sum().clamp(min=1)
    if loss_agg == "token-mean":
        divisor = mask.sum().clamp(min=1) if num_tokens is None else max(float(num_tokens), 1e-12)
        return per_token.sum() / divisor
    # Dr. GRPO: a constant normaliser, so long answers are not down-weighted per token
    return (per_token.sum(dim=1) / max_length).mean()


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Optional[Tensor],
                advantages: Tensor, mask: Tensor, *, clip_low: float = 0.2,
                clip_high: float = 0.2, beta: float = 0.04, kl_estimator: str = "k3",
                loss_agg: str = "seq-mean-token-mean", max_length: Optional[int] = None,
                ratio_level: str = "token", num_tokens: Optional[float] = None,
                is_weights: Optional[Tensor] = None,
                ) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Clipped GRPO loss -(surrogate - beta*KL) over completion tokens, aggregated by loss_agg.

    logprobs/old_logprobs/ref_logprobs/mask: [N, T]; advantages: [N]. Returns (scalar loss,
    metrics as 0-dim tensors: reading each back here would make the host wait for the device
    several times per micro-batch; the update reads them once per step, `host_floats`). A
    completion with no mask tokens adds 0 and, under seq-mean-token-mean, is left out of the
    mean over completions (so it never gives NaN).
    `num_tokens` replaces the token count that token-mean divides by: with data-parallel
    ranks, the whole batch's count divided by the number of ranks, so that averaging the
    ranks' gradients gives the mean over every token of the batch, not a mean of means.
    `is_weights` [N, T] (no gradient) multiply each token's surrogate: truncated importance
    weights pi_old / pi_sampler for samples drawn by other weights than pi_old (see
    `truncated_is_weights`); the KL term is not weighted.
    """
    _check_loss_args(logprobs, ref_logprobs, advantages, mask, beta, kl_estimator, loss_agg, max_length,
                     ratio_level)
    mask = mask.bool()
    zero = torch.zeros_like(logprobs)
    # Padding may hold garbage (-inf, NaN); zero it before exp so neither loss nor grad sees it.
    log_ratio = torch.where(mask, logprobs - old_logprobs, zero)
    if ratio_level == "sequence":  # GSPO: one ratio per completion, geometric mean over its tokens
        log_ratio = masked_mean(log_ratio, mask, dim=1).unsqueeze(1).expand_as(logprobs)
    rho = torch.exp(log_ratio)
    A = advantages.to(logprobs.dtype)
    if A.dim() == 1:
        A = A.unsqueeze(1)                                    # [N, 1], broadcast over tokens
    # [N, T]: one advantage per token (PPO's GAE)
    surrogate = torch.min(rho * A, torch.clamp(rho, 1 - clip_low, 1 + clip_high) * A)
    if is_weights is not None:
        surrogate = surrogate * torch.where(mask, is_weights.detach().to(surrogate.dtype), zero)
    per_token = -surrogate
    if beta != 0:
        kl = kl_penalty(torch.where(mask, logprobs, zero),
                        torch.where(mask, ref_logprobs, zero), kl_estimator)
        per_token = per_token + beta * kl

    loss = aggregate(torch.where(mask, per_token, zero), mask, loss_agg, max_length, num_tokens)
    with torch.no_grad():
        # The clipped branch is the active minimum only when rho left the band on A's side.
        clipped = ((A > 0) & (rho > 1 + clip_high)) | ((A < 0) & (rho < 1 - clip_low))
        none = zero.new_zeros(())
        metrics = {
            "loss": loss.detach(),
            "kl": masked_mean(kl, mask) if beta != 0 else none,
            "clip_fraction": masked_mean(clipped.to(rho.dtype), mask),
            "ratio_mean": masked_mean(rho, mask),
            # rho > 0, so the zeros off the mask never win; an empty mask gives 0
            "ratio_max": torch.where(mask, rho, zero).max() if rho.numel() else none,
        }
    return loss, metrics
