"""learner/corrections.py against float64 loop-by-loop computations, and the mismatch metrics on
a policy whose samples grow stale."""
import math

import pytest
import torch

from common.config import AlgoConfig
from learner import corrections, grpo
from learner.metrics import version_token_metrics

D = torch.float64


def _batch():
    """pi_old and pi_sampler of 3 completions x 4 positions; the last row has 2 tokens."""
    old = [[0.5, 0.2, 0.9, 0.4], [0.3, 0.3, 0.3, 0.25], [0.6, 0.7, 0.1, 0.1]]
    sampler = [[0.5, 0.05, 0.3, 0.41], [0.6, 0.3, 0.1, 0.25], [0.59, 0.71, 0.8, 0.3]]
    mask = [[True] * 4, [True] * 4, [True, True, False, False]]
    return old, sampler, mask


def _tensors(old, sampler, mask):
    return (torch.log(torch.tensor(old, dtype=D)), torch.log(torch.tensor(sampler, dtype=D)),
            torch.tensor(mask))


def ref_weights(kind, old, sampler, mask, low, high):
    """Explicit loops: rho = pi_old / pi_sampler per token; off the mask 1."""
    out = []
    for o_row, s_row, m_row in zip(old, sampler, mask):
        rhos = [o / s for o, s, m in zip(o_row, s_row, m_row) if m]
        if kind == "seq_mask":
            geo = math.exp(sum(math.log(r) for r in rhos) / len(rhos))
            keep = 1.0 if low <= geo <= high else 0.0
        row = []
        for o, s, m in zip(o_row, s_row, m_row):
            rho = o / s
            if not m:
                row.append(1.0)
            elif kind == "tis":
                row.append(min(rho, high))
            elif kind == "seq_mask":
                row.append(keep)
            else:
                row.append(rho if low <= rho <= high else 0.0)
        out.append(row)
    return torch.tensor(out, dtype=D)


@pytest.mark.parametrize("kind,low,high", [("tis", 0.0, 2.0), ("mis", 0.0, 2.0), ("mis", 0.6, 2.5),
                                           ("icepop", 0.45, 5.0), ("icepop", 0.9, 1.5),
                                           ("seq_mask", 0.99, 1.01), ("seq_mask", 0.5, 1.3)])
def test_weights_match_float64_loops(kind, low, high):
    old, sampler, mask = _batch()
    got = corrections.correction_weights(kind, *_tensors(old, sampler, mask), low, high)
    torch.testing.assert_close(got, ref_weights(kind, old, sampler, mask, low, high), rtol=1e-12, atol=1e-12)
    assert not got.requires_grad


def test_hand_worked_masks():
    old, sampler, mask = _batch()
    lp_old, lp_s, m = _tensors(old, sampler, mask)
    # Row 0's ratios: 1, 4, 3, 0.9756; row 1's: 0.5, 1, 3, 1; row 2's: 1.017, 0.986 (then padding).
    mis = corrections.correction_weights("mis", lp_old, lp_s, m, 0.0, 2.0)
    assert (mis == 0).tolist() == [[False, True, True, False], [False, False, True, False], [False] * 4]
    icepop = corrections.correction_weights("icepop", lp_old, lp_s, m, 0.6, 5.0)
    assert (icepop == 0).tolist() == [[False] * 4, [True, False, False, False], [False] * 4]
    assert icepop[0, 1].item() == pytest.approx(4.0)  # kept tokens keep their ratio
    # Geometric means: row 0 (12 * 0.9756)^(1/4) = 1.85, row 1 1.5^(1/4) = 1.107, row 2 1.0016.
    seq = corrections.correction_weights("seq_mask", lp_old, lp_s, m, 0.99, 1.01)
    assert seq.tolist() == [[0.0] * 4, [0.0] * 4, [1.0] * 4]
    seq = corrections.correction_weights("seq_mask", lp_old, lp_s, m, 0.9, 1.2)
    assert seq.tolist() == [[0.0] * 4, [1.0] * 4, [1.0] * 4]


def test_tis_is_todays_truncated_weights_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(6, 9, generator=g) * 0.5 - 2
    sampler = old + torch.randn(6, 9, generator=g) * 0.4
    mask = torch.rand(6, 9, generator=g) > 0.3
    algo = AlgoConfig()
    assert algo.correction == "tis"
    assert torch.equal(corrections.weights(algo, old, sampler, mask), grpo.is_weights(old, sampler, mask, algo.is_cap))
    metrics = corrections.mismatch_metrics(algo, old, sampler, mask)
    for key, value in grpo.is_metrics(old, sampler, mask, algo.is_cap).items():
        assert metrics[key] == pytest.approx(value, rel=1e-6), key


def test_masked_tokens_leave_the_surrogate_but_keep_the_kl():
    """A weight of 0 takes a token's surrogate (and its gradient) out of the loss; the KL term
    and the denominators of the aggregation stay, as with TIS's weights."""
    old, sampler, mask = _batch()
    lp_old, lp_s, m = _tensors(old, sampler, mask)
    logprobs = (lp_old + 0.05).clone().requires_grad_()
    ref = lp_old - 0.1
    w = corrections.correction_weights("mis", lp_old, lp_s, m, 0.0, 2.0)
    loss, _ = grpo.policy_loss(logprobs, lp_old, ref, torch.tensor([1.0, -1.0, 0.5], dtype=D), m,
                               beta=0.04, is_weights=w)
    loss.backward()
    beta_only = logprobs.grad.clone()
    logprobs.grad = None
    kl_loss, _ = grpo.policy_loss(logprobs, lp_old, ref, torch.zeros(3, dtype=D), m, beta=0.04)
    kl_loss.backward()
    masked = w == 0
    torch.testing.assert_close(beta_only[masked], logprobs.grad[masked], rtol=1e-12, atol=1e-15)
    assert not torch.allclose(beta_only[~masked & m], logprobs.grad[~masked & m])


def test_metrics_match_float64_loops():
    old, sampler, mask = _batch()
    algo = AlgoConfig(correction="icepop", icepop_low=0.6, icepop_high=3.5)
    got = corrections.mismatch_metrics(algo, *_tensors(old, sampler, mask))
    rhos = [o / s for o_row, s_row, m_row in zip(old, sampler, mask) for o, s, m in zip(o_row, s_row, m_row) if m]
    n = len(rhos)
    assert got["mismatch_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in rhos) / n, rel=1e-12)
    assert got["mismatch_chi2"] == pytest.approx(sum(r * r for r in rhos) / n - 1, rel=1e-12)
    assert got["sampler_logprob_gap"] == pytest.approx(sum(abs(math.log(r)) for r in rhos) / n, rel=1e-12)
    icepop = [r if 0.6 <= r <= 3.5 else 0.0 for r in rhos]
    assert got["is_weight_mean"] == pytest.approx(sum(icepop) / n, rel=1e-12)
    assert got["is_capped_fraction"] == pytest.approx(sum(r > 2.0 for r in rhos) / n)
    assert got["masked_fraction_icepop"] == pytest.approx(sum(w == 0 for w in icepop) / n)
    assert got["masked_fraction_mis"] == pytest.approx(sum(r > 2.0 for r in rhos) / n)
    assert got["masked_fraction_seq_mask"] == pytest.approx(8 / 10)  # rows 0 and 1 (4 + 4 of 10 tokens)


def _stale_samples(staleness: int, steps: int = 6, tokens: int = 20000, vocab: int = 16, seed: int = 0):
    """A categorical policy whose logits take a step of noise per version; `tokens` tokens drawn
    by the version `staleness` steps before the newest, scored by the newest (pi_old) and by
    the version that drew them (the sampler)."""
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(vocab, generator=g, dtype=D)]
    for _ in range(steps):
        logits.append(logits[-1] + 0.15 * torch.randn(vocab, generator=g, dtype=D))
    newest, sampler = logits[-1].log_softmax(0), logits[-1 - staleness].log_softmax(0)
    drawn = torch.multinomial(sampler.exp(), tokens, replacement=True, generator=g)
    return newest[drawn].view(1, -1), sampler[drawn].view(1, -1), torch.ones(1, tokens, dtype=torch.bool)


def test_mismatch_metrics_are_zero_on_policy_and_grow_with_staleness():
    algo = AlgoConfig()
    on_policy = corrections.mismatch_metrics(algo, *_stale_samples(0))
    for key in ("mismatch_k3", "mismatch_chi2", "sampler_logprob_gap", "masked_fraction_mis",
                "masked_fraction_icepop", "masked_fraction_seq_mask", "is_capped_fraction"):
        assert on_policy[key] == 0.0, key
    assert on_policy["is_weight_mean"] == 1.0
    by_staleness = [corrections.mismatch_metrics(algo, *_stale_samples(k)) for k in (1, 2, 4)]
    for key in ("mismatch_k3", "mismatch_chi2", "sampler_logprob_gap"):
        values = [m[key] for m in by_staleness]
        assert 0 < values[0] < values[1] < values[2], (key, values)
    # The sample's geometric-mean ratio leaves [0.99, 1.01] once the policy has moved.
    assert by_staleness[-1]["masked_fraction_seq_mask"] == 1.0


def test_unknown_correction_is_refused():
    old, sampler, mask = _tensors(*_batch())
    with pytest.raises(ValueError, match="unknown correction"):
        corrections.correction_weights("gspo", old, sampler, mask, 0.5, 2.0)


def test_tokens_per_version_sum_over_ranks_relative_to_the_newest():
    parts = [{"loss": 1.0, "version_tokens/7": 30.0, "version_tokens/6": 10.0},
             {"loss": 3.0, "version_tokens/7": 5.0, "version_tokens/5": 2.0}]
    rest, versions = version_token_metrics(parts)
    assert rest == [{"loss": 1.0}, {"loss": 3.0}]
    assert versions == {"tokens_version_lag/0": 35.0, "tokens_version_lag/1": 10.0, "tokens_version_lag/2": 2.0,
                        "version_spread": 2.0}
    assert version_token_metrics([{"loss": 1.0}]) == ([{"loss": 1.0}], {})


def test_tokens_are_counted_by_each_spans_own_version():
    from types import SimpleNamespace

    from learner.batching import version_tokens

    whole = SimpleNamespace(group_size=2, policy_version=4, completion_ids=[[1, 2, 3], [1]], version_spans=None)
    spanning = SimpleNamespace(group_size=2, policy_version=4, completion_ids=[[1, 2, 3, 4, 5], [1, 2]],
                               version_spans=[[(4, 0, 2), (5, 2, 5)], [(5, 0, 2)]])
    assert version_tokens([whole, spanning]) == {4: 6, 5: 5}


def test_float32_rounding_mismatch_is_measured_not_lost():
    """Sync mode: sampler and learner differ by float32 rounding only; the metrics are float64
    and use expm1, so k3 reads about mean(x^2)/2 and chi-squared mean(2x), not 0."""
    g = torch.Generator().manual_seed(0)
    old = (torch.rand(4, 50, generator=g) * -3).float()
    sampler = old + torch.randn(4, 50, generator=g).float() * 3e-7
    mask = torch.ones(4, 50, dtype=torch.bool)
    x = (old.double() - sampler.double())
    got = corrections.mismatch_metrics(AlgoConfig(), old, sampler, mask)
    assert got["mismatch_k3"] == pytest.approx(float((x ** 2 / 2).mean()), rel=1e-3)
    assert got["mismatch_chi2"] == pytest.approx(float((2 * x + 2 * x ** 2).mean()), rel=1e-3, abs=1e-15)
    assert 0 < got["mismatch_k3"] < 1e-12
