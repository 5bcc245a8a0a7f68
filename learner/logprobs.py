"""Per-token log-probabilities and entropy from a model's logits, in bounded memory.

A full-vocabulary float32 `log_softmax` over a batch is what runs a real model out of memory:
Qwen2.5's 151,936-token vocabulary at 8 k tokens is 4.9 GB per float32 copy, and autograd keeps
several. Here the logits stay in the model's dtype and are read in row chunks of about
`CHUNK_ELEMENTS` floats: the forward keeps only each row's log-sum-exp, and the backward
rebuilds the softmax chunk by chunk, so the extra memory is one gradient the size of the logits
(in their dtype) plus one float32 chunk, whatever the vocabulary. Each row's arithmetic is
the same as the unchunked `log_softmax(...).gather(...)`.

Given the target mask, the output head runs only from the first target position on: a prompt is
never a target, and at a real vocabulary the head's matrix product and the log-softmax over the
prompt's positions are a large share of a forward's work and of its logits' memory.
"""
from __future__ import annotations

import inspect
from typing import Dict, Optional

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 24  # 64 MB of float32 per chunk


def _chunks(rows: int, vocab: int):
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


class _ChosenLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[target] for 2-D logits [M, V], targets [M]; float32 [M]."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for s, e in _chunks(rows, vocab):
            chunk = logits[s:e].float()
            if temperature != 1.0:
                chunk = chunk / temperature
            lse[s:e] = torch.logsumexp(chunk, dim=-1)
            out[s:e] = chunk.gather(-1, targets[s:e, None]).squeeze(-1) - lse[s:e]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, targets, lse = ctx.saved_tensors
        temperature = ctx.temperature
        grad = torch.empty_like(logits)
        rows, vocab = logits.shape
        for s, e in _chunks(rows, vocab):
            chunk = logits[s:e].float()
            if temperature != 1.0:
                chunk = chunk / temperature
            g_out = grad_out[s:e, None].float()
            g = torch.exp(chunk - lse[s:e, None]).mul_(-g_out)  # d/dz of z_t - lse(z): onehot - softmax
            g.scatter_add_(-1, targets[s:e, None], g_out)
            if temperature != 1.0:
                g.div_(temperature)
            grad[s:e] = g.to(grad.dtype)
        return grad, None, None


def chosen_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log pi(target) at each position: logits [..., V], targets [...] -> float32 [...]."""
    shape = targets.shape
    flat = _ChosenLogprobs.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), float(temperature))
    return flat.view(shape)


@torch.no_grad()
def entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """The entropy of softmax(logits / T) at each position, float32 [...], no gradient."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for s, e in _chunks(*flat.shape):
        chunk = flat[s:e].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        lse = torch.logsumexp(chunk, dim=-1, keepdim=True)
        out[s:e] = lse.squeeze(-1) - (torch.exp(chunk - lse) * chunk).sum(-1)
    return out.view(logits.shape[:-1])


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
    # Logits of positions first..T-1; the last is dropped: it predicts no token of this row.
    logits = model(input_ids=input_ids, attention_mask=attention_mask, **keep).logits[:, :-1]
    chosen = _left_zeros(chosen_logprobs(logits, input_ids[:, first + 1:], temperature), first)
    if not with_entropy:
        return chosen
    return chosen, _left_zeros(entropy(logits.detach(), temperature), first)


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
