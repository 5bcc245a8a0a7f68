"""PPO maths for the critic baseline (`algo.adv_estimator=gae`; docs/design.md, "GRPO, exactly").

Pure torch, per-token tensors [N, T] aligned with the log-probs (position t holds the action
token t and the critic's value of the state before it). The sequence's reward arrives at its
last token; the KL to the reference is a per-token reward, -beta * (log pi_old - log pi_ref),
as in RLHF's PPO (GRPO puts it in the loss instead).
"""
from typing import Dict, Tuple

import torch
from torch import Tensor

from learner.grpo import masked_mean


def token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Per-token rewards: -beta * kl on every completion token, plus the score on the last."""
    mask = mask.bool()
    rewards = torch.where(mask, -beta * kl, torch.zeros_like(kl))
    has = mask.any(dim=1)
    last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & mask  # the last true position
    rewards = rewards + torch.where(last & has[:, None], scores[:, None].to(rewards.dtype),
                                    torch.zeros_like(rewards))
    return rewards


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> Tuple[Tensor, Tensor]:
    """Generalised advantage estimation over each completion's tokens: (advantages, returns).

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token is 0);
    A_t = delta_t + gamma * lam * A_{t+1}; returns R_t = A_t + V_t. Zero off the mask.
    """
    mask = mask.to(values.dtype)
    N, T = values.shape
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(N, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv * m
        # Positions off the mask (padding) pass the running values through unchanged.
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, adv, next_adv)
    returns = (advantages + values) * mask
    return advantages, returns


def whiten(advantages: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Advantages shifted and scaled to mean 0, std 1 over the mask (the usual PPO practice)."""
    mask = mask.bool()
    mean = masked_mean(advantages, mask)
    var = masked_mean((advantages - mean) ** 2, mask)
    return torch.where(mask, (advantages - mean) / (var.sqrt() + eps), torch.zeros_like(advantages))


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float = 0.2) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old +- clip, token mean.
    Metrics as 0-dim tensors, read back once per step by the update (like `grpo.policy_loss`'s)."""
    mask = mask.bool()
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_err = (values - returns) ** 2
    clipped_err = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_err, clipped_err), mask)
    with torch.no_grad():
        metrics = {
            "value_loss": loss.detach(),
            "value_clip_fraction": masked_mean((clipped_err > unclipped_err).to(values.dtype), mask),
            "value_mean": masked_mean(values, mask),
        }
    return loss, metrics
