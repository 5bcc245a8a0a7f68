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


def _tiny_lm():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return Qwen2ForCausalLM(config).eval()


def test_targets_skip_the_output_head_over_the_prompt_and_change_no_used_value_or_gradient():
    model = _tiny_lm()
    ids = torch.randint(0, 50, (3, 10))
    attention = torch.ones_like(ids)
    attention[2, 8:] = 0
    targets = torch.zeros((3, 9), dtype=torch.bool)
    for row, (start, end) in enumerate([(4, 10), (6, 10), (3, 8)]):  # completions' first and end tokens
        targets[row, start - 1:end - 1] = True
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    weights = torch.randn(3, 9)

    full, full_entropy = lp.token_logprobs(model, ids, attention, with_entropy=True)
    full_grads = torch.autograd.grad((full * targets * weights).sum(), list(model.parameters()))
    kept, kept_entropy = lp.token_logprobs(model, ids, attention, with_entropy=True, targets=targets)
    kept_grads = torch.autograd.grad((kept * targets * weights).sum(), list(model.parameters()))

    assert seen == [10, 8], "the head ran over positions 2..9 only: the first target column is 2"
    assert kept.shape == full.shape == kept_entropy.shape == (3, 9)
    assert not kept[:, :2].any() and not kept_entropy[:, :2].any()
    torch.testing.assert_close(kept[targets], full[targets], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kept_entropy[targets], full_entropy[targets], rtol=1e-6, atol=1e-6)
    for got, want in zip(kept_grads, full_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_model_without_logits_to_keep_gets_every_position():
    inner = _tiny_lm()

    class Plain(torch.nn.Module):  # a forward that takes no logits_to_keep (some remote-code models)
        def forward(self, input_ids, attention_mask):
            return inner(input_ids=input_ids, attention_mask=attention_mask)

    ids = torch.randint(0, 50, (2, 6))
    targets = torch.zeros((2, 5), dtype=torch.bool)
    targets[:, 3:] = True
    got = lp.token_logprobs(Plain(), ids, torch.ones_like(ids), targets=targets)
    torch.testing.assert_close(got, lp.token_logprobs(inner, ids, torch.ones_like(ids)))
    assert not lp.keeps_logits(Plain()) and lp.keeps_logits(inner)


def _reference(model, ids, attention, temperature):
    """float64 log-softmax over the model's own logits: chosen log-probs and entropy, [N, T-1]."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].double() / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    return log_p.gather(-1, ids[:, 1:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_one_pass_over_the_heads_logits_equals_a_float64_log_softmax(monkeypatch, temperature):
    """The learner's call shape: logits straight from the head, overwritten by their gradient in
    the backward. float32 logits of size ~1 over 50 entries: a log-prob's rounding is a few ulps
    of |log p| (< 10), the entropy's a few ulps of each of 50 terms."""
    monkeypatch.setattr(lp, "CHUNK_ELEMENTS", 50 * 4)  # chunks of 4 rows over 27
    model = _tiny_lm()
    ids = torch.randint(0, 50, (3, 10))
    attention = torch.ones_like(ids)
    weights = torch.randn(3, 9)
    params = list(model.parameters())
    want, want_entropy = _reference(model, ids, attention, temperature)
    want_grads = torch.autograd.grad((want * weights).sum(), params)
    got, got_entropy = lp.token_logprobs(model, ids, attention, temperature, with_entropy=True)
    assert got.dtype == got_entropy.dtype == torch.float32 and not got_entropy.requires_grad
    got_grads = torch.autograd.grad((got * weights).sum(), params)
    torch.testing.assert_close(got.double(), want, rtol=8 * 2**-23, atol=1e-6)
    torch.testing.assert_close(got_entropy.double(), want_entropy, rtol=0, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_only_a_heads_own_output_is_overwritten_by_its_gradient():
    head = torch.nn.Linear(8, 50, bias=False)
    x = torch.randn(2, 5, 8, requires_grad=True)
    assert lp._overwritable(head(x).reshape(10, 50))  # a matrix product saves its input, not its output
    assert not lp._overwritable(torch.randn(10, 50, requires_grad=True))  # a leaf: the caller's own tensor
    assert not lp._overwritable(torch.tanh(head(x)).reshape(10, 50))  # tanh saves its output (soft-capping)


def test_a_soft_capped_head_keeps_its_saved_output_and_gets_the_right_gradient():
    inner = _tiny_lm()

    class SoftCapped(torch.nn.Module):  # Gemma 2's final_logit_softcapping: tanh saves its output
        def forward(self, input_ids, attention_mask, **kwargs):
            out = inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            out.logits = 3.0 * torch.tanh(out.logits / 3.0)
            return out

    model = SoftCapped()
    ids = torch.randint(0, 50, (2, 7))
    attention = torch.ones_like(ids)
    want, _ = _reference(model, ids, attention, 1.0)
    (want_grad,) = torch.autograd.grad(want.sum(), [inner.lm_head.weight])
    (got_grad,) = torch.autograd.grad(lp.token_logprobs(model, ids, attention).sum(), [inner.lm_head.weight])
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)
