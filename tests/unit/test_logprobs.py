"""Per-token log-probs and entropy in bounded memory (learner/logprobs.py): the same values and
gradients as a full log-softmax (tests/integration/test_learner_memory.py runs a real learner step)."""
from __future__ import annotations

import pytest
import torch

import learner.logprobs as lp


def _full(logits, targets, temperature):
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    return log_p.gather(-1, targets[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("vocab, temperature", [(50, 1.0), (50, 0.7), (1000, 1.3)])
def test_chunked_equals_full_log_softmax_values_and_gradients(monkeypatch, vocab, temperature):
    monkeypatch.setattr(lp, "CHUNK_ELEMENTS", vocab * 3)  # chunks of 3 rows over 20 rows
    torch.manual_seed(vocab)
    logits = torch.randn(4, 5, vocab, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (4, 5))
    weights = torch.randn(4, 5, dtype=torch.float64)
    want, want_entropy = _full(logits, targets, temperature)
    got = lp.chosen_logprobs(logits, targets, temperature)
    assert got.dtype == torch.float32 and got.shape == (4, 5)
    # float32 inside: a few ulps of |log p| (up to ~10 here), whatever the CPU's vector width
    torch.testing.assert_close(got.double(), want, rtol=8 * 2**-23, atol=1e-6)
    torch.testing.assert_close(lp.entropy(logits, temperature).double(), want_entropy, rtol=0, atol=1e-5)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), logits)
    (got_grad,) = torch.autograd.grad((got.double() * weights).sum(), logits)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-6)


def test_gradient_keeps_the_logits_dtype_and_one_row_chunks_work(monkeypatch):
    monkeypatch.setattr(lp, "CHUNK_ELEMENTS", 1)  # one row per chunk
    logits = torch.randn(6, 32).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 32, (6,))
    lp.chosen_logprobs(logits, targets).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    want = torch.nn.functional.one_hot(targets, 32) - torch.softmax(logits.detach().float(), -1)
    torch.testing.assert_close(logits.grad.float(), want, rtol=0, atol=1e-2)  # bf16 rounding
