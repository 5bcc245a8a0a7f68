"""learner/packing.py: a packed forward is the padded one, in values, loss and gradient."""
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner import batching, grpo
from learner.batching import MicroBatcher
from learner.logprobs import token_logprobs
from learner.packing import packed_token_logprobs

D = torch.float64
LENGTHS = [7, 3, 12, 5, 9]


def _model(attention: str) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation=attention)
    return Qwen2ForCausalLM(config).to(D)


def _rows(lengths=LENGTHS, prompt=2):
    """Right-padded rows of random tokens (pad id 0), and their completion targets [N, T-1]."""
    g = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    targets = torch.zeros(len(lengths), width - 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, 48, (n,), generator=g)
        attention[i, :n] = 1
        targets[i, prompt - 1:n - 1] = True
    return ids, attention, targets


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_transformers_builds_a_block_causal_mask_from_restarting_position_ids(attention):
    """What packing rests on: with position ids restarting per row, no attention mask and no
    KV cache, each packed row's logits are its padded row's; without the position ids the
    rows would see each other."""
    model = _model(attention).eval()
    ids, mask, _ = _rows()
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        packed_ids = ids[mask.bool()].view(1, -1)
        positions = torch.cat([torch.arange(n) for n in LENGTHS]).view(1, -1)
        packed = model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits[0]
        causal = model(input_ids=packed_ids, use_cache=False).logits[0]
    start = 0
    for i, n in enumerate(LENGTHS):
        # sdpa: float64 throughout; eager: its softmax in float32 (a few ulps)
        torch.testing.assert_close(packed[start:start + n], padded[i, :n], rtol=0,
                                   atol=1e-12 if attention == "sdpa" else 1e-6)
        if i:
            assert (causal[start:start + n] - padded[i, :n]).abs().max() > 1e-2
        start += n


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_loss_and_gradient_equal_the_padded_path(attention):
    ids, mask, targets = _rows()
    grads, values = [], []
    for forward in (token_logprobs, packed_token_logprobs):
        model = _model(attention)
        logprobs, entropy = forward(model, ids, mask, 0.9, with_entropy=True, targets=targets)
        g = torch.Generator().manual_seed(2)
        old = logprobs.detach() + 0.05 * torch.randn(logprobs.shape, generator=g, dtype=D)
        ref = logprobs.detach() - 0.1
        loss, _ = grpo.policy_loss(logprobs, old, ref, torch.tensor([1.0, -0.5, 0.3, -1.0, 0.7], dtype=D), targets)
        loss.backward()
        values.append((torch.where(targets, logprobs, 0).detach(), torch.where(targets, entropy, 0), loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    # sdpa stays in float64; eager takes its attention softmax in float32 (Qwen2's eager_attention_forward),
    # where the padded row's longer sum rounds differently: a few float32 ulps.
    tol = 1e-9 if attention == "sdpa" else 2e-6
    for padded, packed in zip(*values):
        torch.testing.assert_close(packed, padded, rtol=tol, atol=tol)
    torch.testing.assert_close(grads[1], grads[0], rtol=tol, atol=tol * 1e-2)
    assert grads[0].abs().max() > 1e-4


def test_packed_micro_batches_are_cut_by_real_tokens(monkeypatch):
    monkeypatch.setattr(batching, "global_max", lambda value, device: value)
    lengths = [30, 4, 4, 4, 4, 4, 4, 4]
    _, attention, _ = _rows(lengths)
    padded = MicroBatcher(60, "cpu").split(torch.arange(8), attention)
    packed = MicroBatcher(60, "cpu", pack=True).split(torch.arange(8), attention)
    assert len(padded) == 2 and len(packed) == 1  # 58 real tokens, 8 rows x 30 padded
    plan = MicroBatcher(60, "cpu").plan(torch.arange(8), attention)
    assert [m.tokens for m in plan] == [28, 30]


def test_rows_are_packed_first_fit_into_bins_as_wide_as_the_longest():
    from learner.packing import pack_rows, packed_positions

    bins, width = pack_rows([30, 4, 12, 20, 9, 30, 3])
    assert width == 30
    assert bins == [[0], [5], [3, 4], [2, 1, 6]]  # longest first; each into the first bin with room
    assert packed_positions([30, 4, 12, 20, 9, 30, 3]) == 4 * 30  # against 7 x 30 padded


def test_a_model_without_position_ids_is_refused():
    class Plain(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            raise AssertionError("not called")

    ids, mask, targets = _rows()
    with pytest.raises(ValueError, match="pack_sequences"):
        packed_token_logprobs(Plain(), ids, mask, targets=targets)
