"""The policy update of one step, one strategy per advantage estimator.

`GroupUpdate` (GRPO, RLOO): one advantage per completion from its group's rewards; the KL to
pi_ref is a term of the loss. `CriticUpdate` (PPO, `algo.adv_estimator=gae`): per-token
advantages from a value model by GAE; the KL is a per-token reward; the value model trains
beside the policy. Both run the same loop: `algo.num_iterations` passes over the batch, each in
`learner.minibatches` optimizer steps, each minibatch in micro-batches whose gradients
accumulate. The maths is learner/grpo.py and learner/ppo.py; docs/design.md states it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from common.config import AlgoConfig
from learner import corrections, grpo, ppo
from learner.batching import MicroBatcher, Rollouts
from learner.collectives import global_std, global_sum
from learner.logprobs import takes
from learner.metrics import TOKEN_MEANS, combine_metrics


@dataclass
class Fixed:
    """What stays fixed for the whole step, computed once before any update."""

    advantages: torch.Tensor
    """[N] per completion, or [N, T-1] per token (token_level)."""
    old_logprobs: Optional[torch.Tensor] = None
    """pi_old; None when the one update's own log-probs, detached, are the same numbers."""
    ref_logprobs: Optional[torch.Tensor] = None
    """pi_ref, for the loss's KL term (None: beta = 0, or PPO, whose KL is in the reward)."""
    is_weights: Optional[torch.Tensor] = None
    """Per-token weights of algo.correction from pi_old / pi_sampler (learner/corrections.py; None: off)."""
    metrics: Dict[str, float] = field(default_factory=dict)
    first_minibatch_own: bool = False
    """The first minibatch of the first pass is trained before any optimizer step, so pi_old
    there is the policy being differentiated: its own log-probs, detached. Those rows of
    old_logprobs (and is_weights) are filled in by that forward, which saves that share of
    pi_old's forward pass."""
    token_level: bool = False
    extra: Dict[str, torch.Tensor] = field(default_factory=dict)


class GroupUpdate:
    """GRPO / RLOO: the group's rewards are the baseline; no value model."""

    def __init__(self, algo: AlgoConfig, minibatches: int, max_length: int, micro: MicroBatcher, world_size: int):
        self.algo, self.minibatches, self.max_length = algo, minibatches, max_length
        self.micro, self.world_size = micro, world_size

    # ---- what the strategies differ in ---------------------------------------------------------
    def fix(self, policy, reference, batch: Rollouts, temperature: float) -> Fixed:
        algo = self.algo
        scale, eps = algo.adv_scale, algo.adv_eps
        # "batch" means the whole step's batch, across ranks, not this rank's share of it.
        A = grpo.compute_advantages(batch.rewards, batch.group_size, scale="none" if scale == "batch" else scale,
                                    eps=eps, estimator=algo.adv_estimator, std=algo.adv_std)
        if scale == "batch":
            A = A / (global_std(batch.rewards, unbiased=algo.adv_std == "sample") + eps)
        use_is = corrections.active(algo) and batch.sampler_logprobs is not None
        # Before the first optimizer step pi_old is the policy being differentiated: its
        # log-probs are the same numbers, detached (ratio = 1). So pi_old's forward runs over
        # the other minibatches only; the first minibatch's rows, and their importance weights,
        # are filled in from its own forward (`_micro_loss`), for the metrics and later passes.
        # With one update per batch and no importance weights nothing of pi_old is kept at all.
        if algo.num_iterations == 1 and self.minibatches == 1 and not use_is:
            return self._with_reference(Fixed(A), reference, batch, temperature)
        own_rows = len(self.minibatch_rows(len(batch), batch.ids.device)[0])
        old = self.micro.fixed_logprobs(policy, batch.ids, batch.attention, batch.mask, temperature,
                                         first_row=own_rows)
        fixed = Fixed(A, old_logprobs=old, first_minibatch_own=True)
        if use_is:  # pi_old / pi_sampler, corrected (algo.correction): the sampler's weights may be older
            fixed.is_weights = torch.ones_like(old)  # the first minibatch's rows: from its forward
            fixed.is_weights[own_rows:] = corrections.weights(algo, old[own_rows:], batch.sampler_logprobs[own_rows:],
                                                              batch.mask[own_rows:])
        return self._with_reference(fixed, reference, batch, temperature)

    def _with_reference(self, fixed: Fixed, reference, batch: Rollouts, temperature: float) -> Fixed:
        if reference is not None:
            fixed.ref_logprobs = self.micro.fixed_logprobs(reference, batch.ids, batch.attention, batch.mask,
                                                           temperature)
        return fixed

    def after_policy_step(self, mb, batch: Rollouts, fixed: Fixed) -> Dict[str, float]:
        """Anything trained beside the policy on the same minibatch (nothing here)."""
        return {}

    # ---- the loop both share ----------------------------------------------------------------------
    def run(self, policy, reference, batch: Rollouts, temperature: float) -> Dict[str, float]:
        """Every optimizer step of this step; returns the step's metrics (learner/metrics.py:
        token means over every minibatch's tokens)."""
        with torch.no_grad():
            fixed = self.fix(policy, reference, batch, temperature)
        step_metrics: List[Dict[str, object]] = []  # 0-dim tensors and floats until host_floats
        for iteration in range(self.algo.num_iterations):
            for k, mb in enumerate(self.minibatch_rows(len(batch), batch.ids.device)):
                own_old = fixed.old_logprobs is None or (fixed.first_minibatch_own and iteration == 0 and k == 0)
                metrics = self.policy_step(policy, mb, batch, fixed, temperature, own_old)
                metrics.update(self.after_policy_step(mb, batch, fixed))
                metrics["grad_norm"] = float(policy.get_global_grad_norm() or 0.0)
                step_metrics.append(metrics)
        if fixed.first_minibatch_own and batch.sampler_logprobs is not None:  # now that every row's pi_old is known
            fixed.metrics = corrections.mismatch_metrics(self.algo, fixed.old_logprobs, batch.sampler_logprobs,
                                                         batch.mask)
        out = combine_metrics(step_metrics)
        out["loss_tokens"] = batch.mask.sum().double()  # once, however many passes
        out["advantage_abs_mean"] = fixed.advantages.abs().mean()
        return host_floats({**out, **fixed.metrics})

    def minibatch_rows(self, n: int, device) -> List[torch.Tensor]:
        """Row indices of each minibatch of a batch of n rows, in the order they are trained."""
        return list(torch.arange(n, device=device).chunk(self.minibatches))

    def policy_step(self, policy, mb, batch: Rollouts, fixed: Fixed, temperature: float,
                    own_old: bool) -> Dict[str, object]:
        """One optimizer step of the policy on minibatch `mb` (row indices), in micro-batches;
        `own_old`: pi_old is the policy's own log-probs, detached (no step taken yet)."""
        micros = self.micro.plan(mb, batch.attention, batch.mask)
        num_tokens = None
        if self.algo.loss_agg == "token-mean":  # the batch's tokens, over every rank
            num_tokens = global_sum(batch.mask[mb].sum()) / self.world_size
        weights = self._micro_weights(micros, exact=num_tokens is not None)
        tokens = sum(m.target_tokens for m in micros)
        metrics: Dict[str, object] = {}  # 0-dim tensors until the step ends
        computed = 0  # token positions the forwards ran over, padding included
        for j, (micro, T) in enumerate(accumulating(policy, micros, batch)):
            loss, micro_metrics = self._micro_loss(policy, micro.rows, T, micro.first_target, batch, fixed,
                                                   temperature, num_tokens, own_old)
            policy.backward(loss * weights[j] if weights[j] != 1.0 else loss)
            _accumulate(metrics, micro_metrics, weights[j], micro.target_tokens / tokens if tokens else 1 / len(micros))
            computed += micro.packed_positions if self.micro.pack else len(micro.rows) * T
        policy.step()
        metrics["micro_batches"] = float(len(micros))
        # The share of the forwards' positions that is padding (long-tailed lengths raise it).
        metrics["padded_fraction"] = 1.0 - sum(m.tokens for m in micros) / max(computed, 1)
        metrics["loss_tokens"] = float(tokens)  # the weight of this minibatch's token means
        return metrics

    def _micro_weights(self, micros, exact: bool) -> List[float]:
        """Each micro-batch's loss is weighted so that their sum is the minibatch's loss."""
        if exact or len(micros) == 1:  # token-mean divides by the global count already
            return [1.0] * len(micros)
        if self.algo.loss_agg == "seq-mean-token-mean":
            rows = [float(m.rows_with_targets) for m in micros]
        else:
            rows = [float(len(m.rows)) for m in micros]
        total = max(sum(rows), 1.0)
        return [r / total for r in rows]

    def _micro_loss(self, policy, micro, T: int, first: int, batch: Rollouts, fixed: Fixed, temperature: float,
                    num_tokens, own_old: bool):
        algo = self.algo
        mask = batch.mask[micro, :T - 1]
        logprobs, entropy = self.micro.logprobs(policy, batch.ids[micro, :T], batch.attention[micro, :T],
                                                temperature, with_entropy=True, targets=mask, first=first)
        if own_old and fixed.old_logprobs is not None:  # this minibatch's pi_old, for metrics and later passes
            fixed.old_logprobs[micro, :T - 1] = logprobs.detach()
            if fixed.is_weights is not None:
                sampled = batch.sampler_logprobs[micro, :T - 1]
                fixed.is_weights[micro, :T - 1] = corrections.weights(algo, logprobs.detach(), sampled, mask)
        loss, metrics = grpo.policy_loss(
            logprobs,
            logprobs.detach() if own_old else fixed.old_logprobs[micro, :T - 1],
            None if fixed.ref_logprobs is None else fixed.ref_logprobs[micro, :T - 1],
            fixed.advantages[micro, :T - 1] if fixed.token_level else fixed.advantages[micro], mask,
            clip_low=algo.clip_low, clip_high=algo.clip_high,
            beta=0.0 if fixed.token_level else algo.beta, kl_estimator=algo.kl_estimator,
            # Dr. GRPO divides by a constant, the longest completion allowed.
            loss_agg=algo.loss_agg, max_length=self.max_length, ratio_level=algo.ratio_level,
            num_tokens=num_tokens, is_weights=None if fixed.is_weights is None else fixed.is_weights[micro, :T - 1],
        )
        metrics["entropy"] = grpo.masked_mean(entropy, mask)
        return loss, metrics


def host_floats(metrics: Dict[str, object]) -> Dict[str, float]:
    """The step's metrics as python floats: those still tensors on the device are read back
    together, one wait for the device per step instead of several per micro-batch."""
    on_device = [v.double() for v in metrics.values() if isinstance(v, torch.Tensor)]
    values = iter(torch.stack(on_device).tolist() if on_device else [])
    return {k: next(values) if isinstance(v, torch.Tensor) else float(v) for k, v in metrics.items()}


def accumulating(engine, micros: list, batch: Rollouts):
    """(micro-batch, its length T) for each micro-batch (`MicroBatcher.plan`) of one optimizer
    step of `engine`; with several, their gradients accumulate (reduced and stepped after the
    last) and each is trimmed to the padding it needs."""
    for j, micro in enumerate(micros):
        T = batch.ids.shape[1]
        if len(micros) > 1:
            engine.set_gradient_accumulation_boundary(j == len(micros) - 1)
            T = micro.length
        yield micro, T


def _accumulate(total: Dict[str, torch.Tensor], metrics: Dict[str, torch.Tensor], loss_weight: float,
                token_share: float) -> None:
    """A micro-batch's metrics (0-dim tensors) into the minibatch's, on the device: the loss by
    its weight in the minibatch's loss, the largest ratio as a max, the TOKEN_MEANS by the
    micro-batch's share of the minibatch's tokens (any other metric is refused: say how it adds
    up first). In float64, the arithmetic python floats did when they were read each time
    (except that a NaN ratio now reaches the max, as it reaches the loss, instead of being
    dropped by python's max)."""
    for key, value in metrics.items():
        value = value.double()
        if key == "ratio_max":
            total[key] = torch.maximum(total[key], value) if key in total else value.clamp(min=0.0)
        elif key == "loss" or key in TOKEN_MEANS:
            total[key] = total.get(key, 0.0) + (loss_weight if key == "loss" else token_share) * value
        else:
            raise KeyError(f"micro-batch metric {key!r}: not in learner.metrics.TOKEN_MEANS")


class CriticUpdate(GroupUpdate):
    """PPO with a value model (`algo.adv_estimator=gae`): the baseline GRPO removes."""

    def __init__(self, algo: AlgoConfig, minibatches: int, max_length: int, micro: MicroBatcher, world_size: int,
                 critic):
        super().__init__(algo, minibatches, max_length, micro, world_size)
        self.critic = critic

    def values(self, ids, attention, grad: bool = False):
        """The critic's value of the state before each token, aligned with the log-probs [N, T-1]."""
        with contextlib.nullcontext() if grad else torch.no_grad():
            no_cache = {"use_cache": False} if takes(self.critic, "use_cache") else {}
            return self.critic(input_ids=ids, attention_mask=attention, **no_cache).logits[:, :-1, 0].float()

    def fix(self, policy, reference, batch: Rollouts, temperature: float) -> Fixed:
        algo = self.algo
        old = self.micro.fixed_logprobs(policy, batch.ids, batch.attention, batch.mask, temperature)
        sampled = batch.sampler_logprobs
        is_weights = (corrections.weights(algo, old, sampled, batch.mask)
                      if corrections.active(algo) and sampled is not None else None)
        is_metrics = corrections.mismatch_metrics(algo, old, sampled, batch.mask) if sampled is not None else {}
        ref = (self.micro.fixed_logprobs(reference, batch.ids, batch.attention, batch.mask, temperature)
               if reference is not None else None)
        # Token-level advantages from the critic (GAE); the KL is in the reward, not the loss.
        old_values = self.micro.per_token(self.values, batch.ids, batch.attention)
        kl = old - ref if ref is not None else torch.zeros_like(old)
        token_r = ppo.token_rewards(batch.rewards, kl, batch.mask, algo.beta)
        A, returns = ppo.gae(token_r, old_values, batch.mask, algo.gamma, algo.lam)
        return Fixed(ppo.whiten(A, batch.mask), old_logprobs=old, is_weights=is_weights, metrics=is_metrics,
                     token_level=True, extra={"old_values": old_values, "returns": returns, "kl": kl})

    def after_policy_step(self, mb, batch: Rollouts, fixed: Fixed) -> Dict[str, float]:
        """The value model's step on the same minibatch, in the policy's micro-batches: the
        loss is a token mean over the minibatch, so each micro-batch's mean is weighted by its
        share of the minibatch's tokens (and so are the metrics, which are means too)."""
        micros = self.micro.plan(mb, batch.attention, batch.mask)
        tokens = float(max(sum(m.target_tokens for m in micros), 1))
        metrics: Dict[str, object] = {}  # 0-dim tensors until the step ends
        for micro, T in accumulating(self.critic, micros, batch):
            rows = micro.rows
            share = micro.target_tokens / tokens
            values = self.values(batch.ids[rows, :T], batch.attention[rows, :T], grad=True)
            loss, micro_metrics = ppo.value_loss(values, fixed.extra["old_values"][rows, :T - 1],
                                                 fixed.extra["returns"][rows, :T - 1], batch.mask[rows, :T - 1],
                                                 self.algo.value_clip)
            self.critic.backward(loss * share if share != 1.0 else loss)
            _accumulate(metrics, micro_metrics, 1.0, share)  # value_*: TOKEN_MEANS, by the tokens' share
        self.critic.step()
        metrics["kl"] = grpo.masked_mean(fixed.extra["kl"][mb], batch.mask[mb]).double()  # this minibatch's token mean
        return metrics


def make_update(algo: AlgoConfig, minibatches: int, max_length: int, micro: MicroBatcher, world_size: int,
                critic=None) -> GroupUpdate:
    if algo.adv_estimator == "gae":
        return CriticUpdate(algo, minibatches, max_length, micro, world_size, critic)
    return GroupUpdate(algo, minibatches, max_length, micro, world_size)


def shape_rewards(batch: Rollouts, algo: AlgoConfig, max_length: int) -> torch.Tensor:
    """DAPO's length rules, applied to `batch` in place: the overlong penalty joins the rewards
    (returned, for the metric) and truncated completions leave the loss (`mask_truncated`)."""
    shaping = torch.zeros_like(batch.rewards)
    if algo.overlong_buffer > 0:  # a soft penalty before the length limit
        lengths = torch.tensor(batch.lengths, device=batch.rewards.device)
        shaping = grpo.overlong_penalty(lengths, max_length, algo.overlong_buffer, algo.overlong_penalty)
        batch.rewards = batch.rewards + shaping
    if algo.mask_truncated:  # a cut-off answer teaches nothing about its end
        cut = torch.tensor(batch.truncated, dtype=torch.bool, device=batch.mask.device)
        batch.mask = batch.mask & ~cut[:, None]
    return shaping
