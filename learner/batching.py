"""From prompt groups to padded tensors, and from a minibatch to micro-batches within a token budget."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from learner.collectives import global_max
from learner.logprobs import token_logprobs


@dataclass
class Rollouts:
    """One rank's share of a step, one row per completion (prompt + completion, right-padded).
    `mask` marks the completion tokens as targets, shifted by one: [N, T-1]."""

    ids: torch.Tensor
    attention: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor
    lengths: List[int]
    truncated: List[bool]
    sampler_logprobs: Optional[torch.Tensor]
    group_size: int

    def __len__(self) -> int:
        return self.ids.shape[0]


def pad(sequences: Sequence[Sequence[int]], completion_starts: Sequence[int], pad_id: int, device):
    """Right-padded ids, attention mask, and the mask of completion tokens (as targets)."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), length), dtype=torch.long)
    target_mask = torch.zeros((len(sequences), length - 1), dtype=torch.bool)
    for i, (seq, start) in enumerate(zip(sequences, completion_starts)):
        assert start >= 1, "a completion needs at least one prompt token before it"
        ids[i, : len(seq)] = torch.tensor(list(seq))
        attention[i, : len(seq)] = 1
        target_mask[i, start - 1: len(seq) - 1] = True  # targets are shifted by one
    return ids.to(device), attention.to(device), target_mask.to(device)


def flatten(groups: list, pad_id: int, device) -> Rollouts:
    """Every completion of every group as a row, in group order (advantages need whole groups)."""
    seqs, starts, rewards, lengths, truncated, sampled, own = [], [], [], [], [], [], []
    for g in groups:
        behaviour = getattr(g, "sampler_logprobs", None) or [None] * g.group_size
        loss_masks = getattr(g, "loss_masks", None) or [None] * g.group_size
        for ids, reason, reward, lps, loss_mask in zip(g.completion_ids, g.finish_reasons, g.rewards, behaviour,
                                                       loss_masks):
            seqs.append(list(g.prompt_ids) + list(ids))
            starts.append(len(g.prompt_ids))
            rewards.append(reward)
            lengths.append(len(ids))
            truncated.append(reason == "length")
            sampled.append(lps)
            own.append(loss_mask)
    ids, attention, mask = pad(seqs, starts, pad_id, device)
    mask = model_tokens_only(mask, own, starts)
    return Rollouts(ids, attention, mask, torch.tensor(rewards, dtype=torch.float32, device=device), lengths,
                    truncated, _sampler_logprobs(sampled, starts, mask), groups[0].group_size)


def model_tokens_only(mask: torch.Tensor, own, starts) -> torch.Tensor:
    """Episodes with tool results: only the tokens the sampler chose stay targets."""
    if all(m is None for m in own):
        return mask
    keep = torch.ones_like(mask)
    for i, (loss_mask, start) in enumerate(zip(own, starts)):
        if loss_mask is not None:
            keep[i, start - 1: start - 1 + len(loss_mask)] = torch.tensor(loss_mask, dtype=torch.bool)
    return mask & keep.to(mask.device)


def _sampler_logprobs(sampled, starts, mask) -> Optional[torch.Tensor]:
    """The sampler's log-probs laid out like the learner's targets [N, T-1]; None when some
    completion has none (greedy outputs, or groups from elsewhere)."""
    if any(lps is None for lps in sampled):
        return None
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for i, (lps, start) in enumerate(zip(sampled, starts)):
        out[i, start - 1: start - 1 + len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return out.to(mask.device)


class MicroBatcher:
    """Cuts a minibatch's rows into micro-batches of at most `budget` (padded) tokens; 0 keeps one."""

    def __init__(self, budget: int, device):
        self.budget, self.device = budget, device

    def split(self, rows: torch.Tensor, attention: torch.Tensor) -> List[torch.Tensor]:
        """Rows sorted by length, cut so that rows x longest row <= the budget: each micro-batch
        is trimmed to its own longest row, so rows of like length share one and little of the
        compute goes to padding. Every rank ends with the same number of micro-batches (the
        most any rank needs), because under ZeRO-3 each forward and backward is a collective.
        The order of rows within a minibatch changes no loss: each micro-batch's share of it is
        weighted by what it holds."""
        if self.budget <= 0:
            return [rows]
        lengths = attention[rows].sum(dim=1).tolist()
        by_length = sorted(zip(lengths, rows.tolist()))  # ties by row index: the same cut on every run
        micros: List[List[int]] = []
        current: List[int] = []
        longest = 0
        for length, row in by_length:
            if current and (len(current) + 1) * max(longest, length) > self.budget:
                micros.append(current)
                current, longest = [], 0
            current.append(row)
            longest = max(longest, length)
        micros.append(current)
        target = int(global_max(len(micros), self.device))
        while len(micros) < target:  # split the largest micro-batch until every rank has as many
            i = max(range(len(micros)), key=lambda k: len(micros[k]))
            half = len(micros[i]) // 2
            micros[i:i + 1] = [micros[i][:half], micros[i][half:]]
        return [torch.tensor(m, device=self.device) for m in micros]

    @torch.no_grad()
    def fixed_logprobs(self, model, ids, attention, targets, temperature: float, first_row: int = 0) -> torch.Tensor:
        """Log-probs [N, T-1] of a model that does not change during the step (pi_old, pi_ref),
        in the same micro-batches as the update, so a forward's memory is bounded by the
        token budget, not the batch. Rows before `first_row` are left at 0 (not needed), and so
        are the columns before a micro-batch's first target (`targets`: the mask of completion
        tokens; learner/logprobs.py)."""
        return self.per_token(lambda i, a, t: token_logprobs(model, i, a, temperature, targets=t), ids, attention,
                              first_row, targets)

    @torch.no_grad()
    def per_token(self, forward, ids, attention, first_row: int = 0, targets=None) -> torch.Tensor:
        """`forward(ids, attention)` -> [n, T-1] float32, run micro-batch by micro-batch (each
        trimmed to its longest row) and laid out as [N, T-1]; rows before `first_row` stay 0.
        With `targets` [N, T-1] the forward is also given the micro-batch's share of them."""
        out = torch.zeros((ids.shape[0], ids.shape[1] - 1), dtype=torch.float32, device=ids.device)
        if first_row >= ids.shape[0]:
            return out
        for micro in self.split(torch.arange(first_row, ids.shape[0], device=ids.device), attention):
            T = int(attention[micro].sum(dim=1).max())
            share = () if targets is None else (targets[micro, :T - 1],)
            out[micro, :T - 1] = forward(ids[micro, :T], attention[micro, :T], *share)
        return out
