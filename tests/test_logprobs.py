"""Per-token log-probs and entropy in bounded memory (learner/logprobs.py): the same values and
gradients as a full log-softmax, and a real learner step whose memory follows the token budget."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import learner.logprobs as lp

SCENARIO = str(Path(__file__).with_name("memory_scenario.py"))


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


def test_a_learner_step_at_a_real_vocabulary_stays_within_the_token_budget(tmp_path):
    """151,936-token vocabulary, 700-token rows, budget 700 tokens (one row per micro-batch).
    What a micro-batch may hold at once: its logits, their gradient and float32 chunks, under
    3 x budget x vocab x 4 bytes (1.28 GB); the full batch's logits alone would be 4 x 425 MB,
    with a float32 log-softmax 3 more copies. Twice the rows must not raise the peak."""
    budget, vocab = 700, 151936
    # the first step (its one-time allocations) is not measured
    proc = subprocess.run([sys.executable, SCENARIO, str(tmp_path), str(budget), "2", "2", "4"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    bound = 3 * budget * vocab * 4
    small, large = out["2"], out["4"]
    assert large["micro_batches"] == 4 and small["micro_batches"] == 2
    assert small["rise_bytes"] <= bound and large["rise_bytes"] <= bound, out
    assert large["rise_bytes"] <= small["rise_bytes"] + 0.1 * bound, out
