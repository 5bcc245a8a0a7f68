"""Per-token log-probabilities and entropy from a model's logits, in bounded memory.

A full-vocabulary float32 `log_softmax` over a batch is what runs a real model out of memory:
Qwen2.5's 151,936-token vocabulary at 8 k tokens is 4.9 GB per float32 copy, and autograd keeps
several. Here a micro-batch's logits exist once, in the model's dtype:
- the model's forward makes them for the positions from the first target on (Hugging Face's
  `logits_to_keep`), contiguous, with one spare row per sequence (the last position predicts no
  token) that is dropped from the float32 result instead of slicing the logits, which would
  make the next reshape copy them;
- one pass over row chunks of about `CHUNK_ELEMENTS` floats gives the chosen log-probs and the
  entropy together, keeping only each row's log-sum-exp;
- the backward rebuilds the softmax chunk by chunk and writes the gradient over the saved logits
  when nothing else holds them (the output head's matrix product saves its input, not its
  output: `_overwritable`), so no second tokens x vocabulary tensor is made.
What remains, counted by learner/memory_plan.py (`logits_bytes`, `logprob_working_bytes`): the
logits, a few float32 chunks, and the output head's weight gradient. A fused head that never
makes the logits (Liger-Kernel's fused linear cross-entropy) would save the one copy, but it
must take the head's weight out of the model, which ZeRO-3 partitions and gathers in the head's
own forward hooks; the model's forward is kept. Each row's arithmetic is the same as the
unchunked `log_softmax(...).gather(...)`.
"""
from __future__ import annotations

import inspect
from typing import Dict, Optional

import torch
from torch import Tensor

from learner.memory_plan import LOGPROB_CHUNK_ELEMENTS

CHUNK_ELEMENTS = LOGPROB_CHUNK_ELEMENTS  # 64 MB of float32 per chunk

# A tensor made by one of these saves nothing of its output for its own backward, so the log-prob
# backward may write the gradient over it; the views between the head and the logits pass through.
_HEAD_NODES = ("MmBackward0", "AddmmBackward0", "BmmBackward0", "LinearBackward0",
               "LinearFunctionForZeroStage3Backward")
_VIEW_NODES = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")


def _chunks(rows: int, vocab: int):
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _scaled(chunk: Tensor, temperature: float) -> Tensor:
    """float32 logits / T (the chunk itself, not a copy, when it is float32 and T = 1)."""
    chunk = chunk.float()
    return chunk / temperature if temperature != 1.0 else chunk


def _overwritable(logits: Tensor) -> bool:
    """Whether `logits` came straight (through views) from a matrix product, so that no node of
    the graph but the log-prob one holds it: then its storage can take the gradient."""
    node = logits.grad_fn
    while node is not None and type(node).__name__ in _VIEW_NODES:
        node = node.next_functions[0][0]
    return node is not None and type(node).__name__ in _HEAD_NODES


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[target] and, with `with_entropy`, the entropy of softmax(logits /
    T), for 2-D logits [M, V] and targets [M]: float32 [M] each (the entropy empty without it,
    and never differentiated)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool, overwrite: bool):
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        ent = torch.empty(rows if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for s, e in _chunks(rows, vocab):
            chunk = _scaled(logits[s:e], temperature)
            chunk_lse = torch.logsumexp(chunk, dim=-1)
            lse[s:e] = chunk_lse
            out[s:e] = chunk.gather(-1, targets[s:e, None]).squeeze(-1) - chunk_lse
            if with_entropy:  # H = lse - sum_v p_v z_v; the sum as a batched dot, no third chunk
                p = (chunk - chunk_lse[:, None]).exp_()
                ent[s:e] = chunk_lse - torch.bmm(p[:, None, :], chunk[:, :, None]).view(-1)
                del p
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.overwrite = temperature, overwrite
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        temperature = ctx.temperature
        grad = logits if ctx.overwrite else torch.empty_like(logits)
        rows, vocab = logits.shape
        for s, e in _chunks(rows, vocab):
            g_out = grad_out[s:e, None].float()
            # d/dz of z_t - lse(z): onehot - softmax. A new tensor: the chunk may be a view of
            # the logits, read whole before its rows are overwritten below.
            g = torch.sub(_scaled(logits[s:e], temperature), lse[s:e, None]).exp_().mul_(-g_out)
            g.scatter_add_(-1, targets[s:e, None], g_out)
            if temperature != 1.0:
                g.div_(temperature)
            grad[s:e] = g
            del g
        return grad, None, None, None, None


def chosen_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log pi(target) at each position: logits [..., V], targets [...] -> float32 [...]."""
    flat = logits.reshape(-1, logits.shape[-1])
    out, _ = _TokenLogprobs.apply(flat, targets.reshape(-1), float(temperature), False, _overwritable(flat))
    return out.view(targets.shape)


@torch.no_grad()
def entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """The entropy of softmax(logits / T) at each position, float32 [...], no gradient."""
    flat = logits.reshape(-1, logits.shape[-1])
    targets = torch.zeros(flat.shape[0], dtype=torch.long, device=logits.device)
    _, ent = _TokenLogprobs.apply(flat, targets, float(temperature), True, False)
    return ent.view(logits.shape[:-1])


def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, targets: Optional[Tensor] = None, first: Optional[int] = None):
    """log pi(token_t | tokens_<t) for t = 1..T-1, shape [N, T-1]; with `with_entropy`, also the
    policy's entropy at those positions (no gradient), as a pair. `targets` [N, T-1]: the
    positions whose values are used (the completion tokens); when given, the columns before the
    first of them are 0 and the model computes no logits for them (Hugging Face's
    `logits_to_keep`, for models whose forward takes it). `first`: that first column, when the
    caller knows it already (learner/batching.py's plan: `first_target` reads it back from the
    device)."""
    if targets is None or not keeps_logits(model):
        first = 0
    elif first is None:
        first = first_target(targets)
    keep = {"logits_to_keep": input_ids.shape[1] - first} if first else {}
    if takes(model, "use_cache"):  # no KV cache to build: nothing generates here
        keep["use_cache"] = False
    # Logits of positions first..T-1, contiguous [N, T - first, V]: the flat view below is no copy.
    logits = model(input_ids=input_ids, attention_mask=attention_mask, **keep).logits
    rows, kept, vocab = logits.shape
    # Each row's last position predicts no token: a spare target (0), its value dropped below
    # (its gradient is then 0), where slicing it off the logits would copy them all.
    shifted = torch.nn.functional.pad(input_ids[:, first + 1:], (0, 1))
    flat = logits.reshape(rows * kept, vocab)
    chosen, ent = _TokenLogprobs.apply(flat, shifted.reshape(-1), float(temperature), with_entropy,
                                       torch.is_grad_enabled() and _overwritable(flat))
    del logits, flat  # the saved logits are the log-prob node's alone
    chosen = _left_zeros(chosen.view(rows, kept)[:, :-1], first)
    if not with_entropy:
        return chosen
    return chosen, _left_zeros(ent.view(rows, kept)[:, :-1], first)


def first_target(targets: Tensor) -> int:
    """The first column any row targets (0 when none does)."""
    columns = targets.any(dim=0).nonzero()
    return int(columns[0, 0]) if columns.numel() else 0


_TAKES: Dict[tuple, bool] = {}


def takes(model, argument: str) -> bool:
    """Whether the model's forward takes `argument` by name."""
    module = getattr(model, "module", model)  # a DeepSpeed engine holds the model as .module
    if hasattr(module, "get_base_model"):  # peft passes what it does not name on to the base model
        module = module.get_base_model()
    key = (type(module), argument)
    if key not in _TAKES:
        _TAKES[key] = argument in inspect.signature(module.forward).parameters
    return _TAKES[key]


def keeps_logits(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (every causal LM of transformers 5
    does; a remote-code model may not)."""
    return takes(model, "logits_to_keep")


def _left_zeros(values: Tensor, columns: int) -> Tensor:
    return torch.nn.functional.pad(values, (columns, 0)) if columns else values
