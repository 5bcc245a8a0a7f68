"""From prompt groups to padded tensors, and from a minibatch to micro-batches within a token budget."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence

import torch

from learner.collectives import global_max
from learner.logprobs import token_logprobs
from learner.packing import pack_rows, packed_positions, packed_token_logprobs


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
    version_tokens: Dict[int, int] = field(default_factory=dict)
    """Completion tokens by the policy version that sampled them (each span's own version when
    a sample spans a weight push, else the sample's `policy_version`)."""

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
                    truncated, _sampler_logprobs(sampled, starts, mask), groups[0].group_size,
                    version_tokens(groups))


def version_tokens(groups: list) -> Dict[int, int]:
    """Completion tokens per policy version over the groups: from each sample's version spans
    (version, start, end) where it has them, else all of its tokens at the group's version."""
    counts: Dict[int, int] = {}
    for g in groups:
        spans = getattr(g, "version_spans", None) or [None] * g.group_size
        for ids, sample_spans in zip(g.completion_ids, spans):
            for version, start, end in sample_spans or [(g.policy_version, 0, len(ids))]:
                counts[int(version)] = counts.get(int(version), 0) + int(end) - int(start)
    return counts


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
    """Cuts a minibatch's rows into micro-batches of at most `budget` (padded) tokens; 0 keeps one.
    With `pack`, each micro-batch's forward is one packed row (learner/packing.py) and the
    budget counts real tokens, not padded ones."""

    def __init__(self, budget: int, device, pack: bool = False):
        self.budget, self.device, self.pack = budget, device, pack

    def logprobs(self, model, ids, attention, temperature: float, with_entropy: bool = False, targets=None,
                 first=None):
        """A micro-batch's per-token log-probs [n, T-1] (and entropy): learner/logprobs.py's
        `token_logprobs`, or its packed equivalent."""
        if self.pack:
            return packed_token_logprobs(model, ids, attention, temperature, with_entropy, targets, first)
        return token_logprobs(model, ids, attention, temperature, with_entropy=with_entropy, targets=targets,
                              first=first)

    def split(self, rows: torch.Tensor, attention: torch.Tensor) -> List[torch.Tensor]:
        """The rows of each micro-batch (`plan` without what it knows of them)."""
        return [micro.rows for micro in self.plan(rows, attention)]

    def plan(self, rows: torch.Tensor, attention: torch.Tensor,
             targets: Optional[torch.Tensor] = None) -> List["Micro"]:
        """Rows sorted by length, cut so that rows x longest row <= the budget: each micro-batch
        is trimmed to its own longest row, so rows of like length share one and little of the
        compute goes to padding. Every rank ends with the same number of micro-batches (the
        most any rank needs), because under ZeRO-3 each forward and backward is a collective.
        The order of rows within a minibatch changes no loss: each micro-batch's share of it is
        weighted by what it holds.

        What the update needs to know of each micro-batch on the host (its longest row, its
        first target column, its rows with targets; `targets`: [N, T-1]) is read back here, once
        per minibatch: read per micro-batch, each would make the host wait for the device."""
        lengths, rows_list, firsts, counts = _host_rows(rows, attention, targets)
        if self.budget <= 0:
            groups = [list(range(len(rows_list)))]
        else:
            groups = self._cut(sorted(range(len(rows_list)), key=lambda i: (lengths[i], rows_list[i])), lengths)
        # Packed, every micro-batch's bins are as wide as the minibatch's longest row, the width
        # its rows were binned at (`_cut_bins`); the forward reads it as the ids' width.
        widest = max(lengths, default=0)
        return [Micro(torch.tensor([rows_list[i] for i in g], device=self.device) if self.budget > 0 else rows,
                      widest if self.pack else max((lengths[i] for i in g), default=0),
                      min((f for f in (firsts[i] for i in g) if f is not None), default=0),
                      sum(1 for i in g if firsts[i] is not None),
                      sum(counts[i] for i in g),
                      sum(lengths[i] for i in g),
                      packed_positions([lengths[i] for i in g], widest) if self.pack else 0)
                for g in groups]

    def _cut(self, order: List[int], lengths: List[int]) -> List[List[int]]:
        """Positions in `order` (by length; ties by row index: the same cut on every run) cut
        within the budget, then split until every rank has as many micro-batches."""
        micros = self._cut_bins(order, lengths) if self.pack else self._cut_sorted(order, lengths)
        target = int(global_max(len(micros), self.device))
        while len(micros) < target:  # split the largest micro-batch until every rank has as many
            i = max(range(len(micros)), key=lambda k: len(micros[k]))
            half = len(micros[i]) // 2
            micros[i:i + 1] = [micros[i][:half], micros[i][half:]]
        return micros

    def _cut_sorted(self, order: List[int], lengths: List[int]) -> List[List[int]]:
        """Padded: consecutive rows (sorted by length) while rows x longest row fits the budget."""
        micros: List[List[int]] = []
        current: List[int] = []
        longest = 0
        for i in order:
            if current and (len(current) + 1) * max(longest, lengths[i]) > self.budget:
                micros.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, lengths[i])
        micros.append(current)
        return micros

    def _cut_bins(self, order: List[int], lengths: List[int]) -> List[List[int]]:
        """Packed: the minibatch's rows first fit into bins as wide as its longest row (short rows
        fill long rows' bins; sorted, like lengths would share a micro-batch and leave the same
        padding), whole bins to a micro-batch, as many as fit the budget."""
        bins, width = pack_rows([lengths[i] for i in order])
        per_micro = max(1, self.budget // max(width, 1)) if self.budget > 0 else len(bins)
        return [[order[k] for b in bins[j:j + per_micro] for k in b] for j in range(0, len(bins), per_micro)]

    @torch.no_grad()
    def fixed_logprobs(self, model, ids, attention, targets, temperature: float, first_row: int = 0) -> torch.Tensor:
        """Log-probs [N, T-1] of a model that does not change during the step (pi_old, pi_ref),
        in the same micro-batches as the update, so a forward's memory is bounded by the
        token budget, not the batch. Rows before `first_row` are left at 0 (not needed), and so
        are the columns before a micro-batch's first target (`targets`: the mask of completion
        tokens; learner/logprobs.py)."""
        return self.per_token(lambda i, a, t, first: self.logprobs(model, i, a, temperature, targets=t, first=first),
                              ids, attention, first_row, targets)

    @torch.no_grad()
    def per_token(self, forward, ids, attention, first_row: int = 0, targets=None) -> torch.Tensor:
        """`forward(ids, attention)` -> [n, T-1] float32, run micro-batch by micro-batch (each
        trimmed to its longest row) and laid out as [N, T-1]; rows before `first_row` stay 0.
        With `targets` [N, T-1] the forward is also given the micro-batch's share of them and
        its first target column."""
        out = torch.zeros((ids.shape[0], ids.shape[1] - 1), dtype=torch.float32, device=ids.device)
        if first_row >= ids.shape[0]:
            return out
        for micro in self.plan(torch.arange(first_row, ids.shape[0], device=ids.device), attention, targets):
            rows, T = micro.rows, micro.length
            share = () if targets is None else (targets[rows, :T - 1], micro.first_target)
            out[rows, :T - 1] = forward(ids[rows, :T], attention[rows, :T], *share)
        return out


class Micro(NamedTuple):
    """One micro-batch: its rows (on the device) and, read back once, its longest row, its
    first target column (0 when none), how many of its rows have targets and how many targets,
    and how many tokens its rows hold (the rest of rows x length is padding)."""

    rows: torch.Tensor
    length: int
    first_target: int
    rows_with_targets: int
    target_tokens: int
    tokens: int = 0
    packed_positions: int = 0
    """With packing: the positions its packed bins hold (its tokens and the bins' unused tails)."""


def _host_rows(rows: torch.Tensor, attention: torch.Tensor, targets: Optional[torch.Tensor]):
    """Each row's length, index, first target column (None: no targets) and number of targets,
    in one read."""
    columns = [attention[rows].sum(dim=1), rows]
    if targets is not None:
        t = targets[rows].bool()
        columns += [torch.where(t.any(dim=1), t.int().argmax(dim=1), torch.full_like(rows, -1)), t.sum(dim=1)]
    values = torch.stack([c.to(torch.long) for c in columns]).tolist()
    if targets is None:
        return values[0], values[1], [None] * len(values[1]), [0] * len(values[1])
    return values[0], values[1], [None if f < 0 else f for f in values[2]], values[3]
