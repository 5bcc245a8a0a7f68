"""Packed forwards: a micro-batch's rows without their padding (`learner.pack_sequences`).

Rows of long-tailed lengths padded to their micro-batch's longest waste the forward's work on
padding, even sorted by length (the learner's `padded_fraction`). Packed, the rows are placed
end to end in bins as wide as the longest row (first fit, longest first), with position ids that
restart at 0 for each row and no attention mask: transformers (5.x) then builds a block-causal
mask from the position ids (its `find_packed_sequence_indices`), so no token sees another row's,
and the positions under RoPE are the padded path's. It does so only without a KV cache
(`use_cache=False`, which the learner always passes) and only for a model whose forward takes
`position_ids`; with flash-attention on GPUs the same position ids select its variable-length
kernel. Bins rather than one long row: on CPUs the block-causal mask is dense, so attention
costs a bin's width squared, as a padded row's. The result is laid out as the padded path's,
[rows, T-1], so the loss and its gradient are the padded path's (tests/unit/test_packing.py
checks both, with eager and sdpa attention).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from learner.logprobs import _TokenLogprobs, _overwritable, takes


def packable(model) -> bool:
    """Whether the model's forward takes the position ids that packing needs."""
    return takes(model, "position_ids")


def packed_token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0,
                          with_entropy: bool = False, targets: Optional[Tensor] = None,
                          first: Optional[int] = None):
    """`learner.logprobs.token_logprobs` through one packed forward: the same [N, T-1] result
    (with `with_entropy` a pair), rows right-padded (`attention_mask` marks each row's tokens,
    from column 0). `targets` and `first` are taken for the same call signature; the logits of
    every packed position are computed (packed bins have no common first target column)."""
    if not packable(model):
        raise ValueError("learner.pack_sequences: this model's forward takes no position_ids; set it to false")
    rows, width = input_ids.shape
    lengths = attention_mask.sum(dim=1).tolist()
    bins, bin_width = pack_rows(lengths, width)  # bins as wide as the ids (learner/batching.py's plan)
    (src_r, src_c, dst_b, dst_c), positions, has_next = _layout(bins, bin_width, lengths, input_ids.device)
    packed = input_ids.new_zeros((len(bins), bin_width))
    packed[dst_b, dst_c] = input_ids[src_r, src_c]
    extra = {"use_cache": False} if takes(model, "use_cache") else {}
    logits = model(input_ids=packed, position_ids=positions, **extra).logits     # [bins, W, V]
    following = torch.zeros_like(packed)
    following[dst_b[has_next], dst_c[has_next]] = input_ids[src_r[has_next], src_c[has_next] + 1]
    flat = logits.reshape(-1, logits.shape[-1])
    chosen, ent = _TokenLogprobs.apply(flat, following.reshape(-1), float(temperature), with_entropy,
                                       torch.is_grad_enabled() and _overwritable(flat))
    del logits, flat
    # Back to the padded layout [N, T-1]: token t of a row predicts its column t target.
    take = (dst_b * bin_width + dst_c)[has_next]
    where = (src_r[has_next], src_c[has_next])

    def unpack(values: Tensor) -> Tensor:
        out = values.new_zeros((rows, width - 1))
        return out.index_put(where, values[take]) if values.numel() else out

    if not with_entropy:
        return unpack(chosen)
    return unpack(chosen), unpack(ent)


def _layout(bins, bin_width: int, lengths, device):
    """Where each token goes (source row and column, bin and column: token t of a row placed at
    offset o is at column o + t), the bins' position ids, and which tokens have a next token of
    their row to predict (a row's last token has none: its spare target 0 is never read, so its
    gradient is 0)."""
    src_rows, src_cols, dst_bins, dst_cols, positions = [], [], [], [], []
    for b, placed in enumerate(bins):
        offset = 0
        for row in placed:
            n = lengths[row]
            src_rows += [row] * n
            src_cols += range(n)
            dst_bins += [b] * n
            dst_cols += range(offset, offset + n)
            offset += n
        # The bin's unused tail: padding as one more sequence of its own (positions from 0), so
        # no real token attends to it; its logits are never read.
        positions.append([p for row in placed for p in range(lengths[row])] + list(range(bin_width - offset)))
    index = [torch.tensor(v, dtype=torch.long, device=device) for v in (src_rows, src_cols, dst_bins, dst_cols)]
    has_next = torch.tensor([t < lengths[r] - 1 for r, t in zip(src_rows, src_cols)], dtype=torch.bool,
                            device=device)
    return index, torch.tensor(positions, dtype=torch.long, device=device), has_next


def pack_rows(lengths, width: int = 0) -> tuple:
    """Rows placed in bins of `width` (at least the longest row), first fit in decreasing
    length: (the rows of each bin, the bins' width). Attention over a packed bin costs its
    width squared on CPUs, where the block-causal mask is dense, so bins stay as wide as the
    padded rows were and what packing removes is the padding."""
    width = max(width, max(lengths, default=0))
    bins, used = [], []
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, filled in enumerate(used):
            if filled + lengths[row] <= width:
                bins[b].append(row)
                used[b] += lengths[row]
                break
        else:
            bins.append([row])
            used.append(lengths[row])
    return bins, width


def packed_positions(lengths, width: int = 0) -> int:
    """The positions a packed forward of rows of these lengths computes (bins x their width)."""
    bins, width = pack_rows(lengths, width)
    return len(bins) * width
