"""Checks learner/grpo.py against a separate float64 loop-by-loop reference and hand-worked numbers."""
import itertools
import math

import pytest
import torch

from learner.grpo import (compute_advantages, kl_penalty, masked_mean, overlong_penalty, policy_loss,
                          truncated_is_weights)

D = torch.float64


# ---------------------------------------------------------------- reference (explicit loops)

def ref_advantages(rewards, G, scale, eps, estimator, std="sample"):
    ddof = 1 if std == "sample" else 0
    r = [float(x) for x in rewards]
    batch_mean = sum(r) / len(r)
    batch_std = math.sqrt(sum((x - batch_mean) ** 2 for x in r) / (len(r) - ddof))
    out = []
    for g in range(len(r) // G):
        grp = r[g * G:(g + 1) * G]
        mu = sum(grp) / G
        sd = math.sqrt(sum((x - mu) ** 2 for x in grp) / (G - ddof))
        for i, x in enumerate(grp):
            if estimator == "grpo":
                a = x - mu
            else:
                others = [y for j, y in enumerate(grp) if j != i]
                a = x - sum(others) / len(others)
            if scale == "group":
                a = a / (sd + eps)
            elif scale == "batch":
                a = a / (batch_std + eps)
            if all(y == grp[0] for y in grp):
                a = 0.0
            out.append(a)
    return torch.tensor(out, dtype=D)


def ref_kl(lp, ref, est):
    d = ref - lp
    if est == "k1":
        return -d
    if est == "k2":
        return 0.5 * d * d
    return torch.exp(d) - d - 1


def ref_policy_loss(lp, old, ref, adv, mask, clip_low, clip_high, beta, kl_est, agg,
                    max_length, ratio_level):
    """Token by token with python control flow; returns a 0-d tensor that autograd can follow."""
    N, T = lp.shape
    seq_losses, all_token_losses = [], []
    for i in range(N):
        toks = [t for t in range(T) if bool(mask[i, t])]
        if ratio_level == "sequence" and toks:
            seq_rho = torch.exp(sum(lp[i, t] - old[i, t] for t in toks) / len(toks))
        token_losses = []
        for t in toks:
            rho = seq_rho if ratio_level == "sequence" else torch.exp(lp[i, t] - old[i, t])
            unclipped = rho * adv[i]
            clipped = min(max(rho, torch.tensor(1 - clip_low, dtype=D)),
                          torch.tensor(1 + clip_high, dtype=D)) * adv[i]
            sur = unclipped if unclipped <= clipped else clipped
            kl = ref_kl(lp[i, t], ref[i, t], kl_est) if beta != 0 else 0.0
            token_losses.append(-(sur - beta * kl))
        all_token_losses += token_losses
        if agg == "seq-mean-token-mean":
            if toks:
                seq_losses.append(sum(token_losses) / len(token_losses))
        elif agg == "seq-mean-token-sum-norm":
            seq_losses.append(sum(token_losses, lp.new_zeros(())) / max_length)
    if agg == "token-mean":
        return sum(all_token_losses) / len(all_token_losses)
    return sum(seq_losses) / len(seq_losses)


# ---------------------------------------------------------------- random inputs

def random_batch(seed, N=6, T=7):
    g = torch.Generator().manual_seed(seed)
    lp = -3 * torch.rand(N, T, generator=g, dtype=D)
    old = lp + 0.3 * torch.randn(N, T, generator=g, dtype=D)   # ratios well outside [0.8, 1.2]
    ref = lp + 0.5 * torch.randn(N, T, generator=g, dtype=D)
    adv = torch.randn(N, generator=g, dtype=D)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[2] = 0                                               # one completion with no tokens
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return lp, old, ref, adv, mask


@pytest.mark.parametrize("scale,estimator,std", list(itertools.product(
    ["group", "batch", "none"], ["grpo", "rloo"], ["sample", "population"])))
def test_advantages_match_reference(scale, estimator, std):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(5 * 4, generator=g, dtype=D)
    rewards[4:8] = 0.7                                           # one group without signal
    rewards[8:12] = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=D)
    got = compute_advantages(rewards, 4, scale=scale, estimator=estimator, std=std)
    want = ref_advantages(rewards, 4, scale, 1e-4, estimator, std)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[4:8], torch.zeros(4, dtype=D))


@pytest.mark.parametrize("kl_est,agg,ratio_level,beta", list(itertools.product(
    ["k1", "k2", "k3"], ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"],
    ["token", "sequence"], [0.0, 0.04])))
def test_policy_loss_and_grad_match_reference(kl_est, agg, ratio_level, beta):
    lp, old, ref, adv, mask = random_batch(1)
    kw = dict(clip_low=0.2, clip_high=0.28, beta=beta, kl_estimator=kl_est, loss_agg=agg,
              max_length=10, ratio_level=ratio_level)
    lp_a = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp_a, old, ref if beta else None, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, lp_a)

    lp_b = lp.clone().requires_grad_(True)
    want = ref_policy_loss(lp_b, old, ref, adv, mask, 0.2, 0.28, beta, kl_est, agg, 10,
                           ratio_level)
    (want_grad,) = torch.autograd.grad(want, lp_b)

    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    assert grad[~mask].abs().max() == 0                        # padding gets no gradient
    assert metrics["loss"] == pytest.approx(want.item(), rel=1e-10)
    # Left on the device (read back once per step by the update): no per-micro-batch host sync.
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    if beta:
        kls = [float(ref_kl(lp[i, t], ref[i, t], kl_est)) for i in range(6) for t in range(7)
               if mask[i, t]]
        assert metrics["kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-10)
    else:
        assert metrics["kl"] == 0.0


def test_metrics_match_reference():
    lp, old, ref, adv, mask = random_batch(2)
    _, m = policy_loss(lp, old, ref, adv, mask, clip_low=0.2, clip_high=0.28)
    rhos, clipped = [], []
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[i, t]:
                rho = math.exp(float(lp[i, t] - old[i, t]))
                rhos.append(rho)
                clipped.append((adv[i] > 0 and rho > 1.28) or (adv[i] < 0 and rho < 0.8))
    assert m["ratio_mean"] == pytest.approx(sum(rhos) / len(rhos), rel=1e-12)
    assert m["ratio_max"] == pytest.approx(max(rhos), rel=1e-12)
    assert m["clip_fraction"] == pytest.approx(sum(clipped) / len(clipped))
    assert 0 < m["clip_fraction"] < 1


# ---------------------------------------------------------------- hand-worked numbers

def test_advantages_hand_worked():
    a = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=D), 4, std="population")
    s = 0.5 / (0.5 + 1e-4)
    torch.testing.assert_close(a, torch.tensor([s, -s, -s, s], dtype=D), rtol=0, atol=1e-15)
    torch.testing.assert_close(a, torch.tensor([1.0, -1, -1, 1], dtype=D), rtol=0, atol=3e-4)
    # Dr. GRPO: centred, not scaled.
    a = compute_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=D), 4, scale="none")
    torch.testing.assert_close(a, torch.tensor([-2.0, -1, 0, 3], dtype=D))
    # RLOO: baseline is the mean of the others: 3-(1+2)/2, 1-(3+2)/2, 2-(3+1)/2.
    a = compute_advantages(torch.tensor([3.0, 1.0, 2.0], dtype=D), 3, scale="none",
                           estimator="rloo")
    torch.testing.assert_close(a, torch.tensor([1.5, -1.5, 0.0], dtype=D))
    # Batch std: groups [1,0] and [3,3]; population std of [1,0,3,3] is sqrt(1.6875).
    a = compute_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0], dtype=D), 2, scale="batch", std="population")
    s = 0.5 / (math.sqrt(1.6875) + 1e-4)
    torch.testing.assert_close(a, torch.tensor([s, -s, 0.0, 0.0], dtype=D))


@pytest.mark.parametrize("scale,estimator", list(itertools.product(
    ["group", "batch", "none"], ["grpo", "rloo"])))
def test_equal_rewards_give_exact_zeros_float32(scale, estimator):
    rewards = torch.full((8,), 0.1, dtype=torch.float32)       # 0.1 is not exact in binary
    a = compute_advantages(rewards, 8, scale=scale, estimator=estimator)
    assert torch.equal(a, torch.zeros(8))


def test_kl_hand_worked():
    x = torch.tensor([-1.3, -0.2], dtype=D)
    for est in ["k1", "k2", "k3"]:
        assert torch.equal(kl_penalty(x, x, est), torch.zeros(2, dtype=D))
    lp, ref = torch.tensor([0.0], dtype=D), torch.tensor([math.log(2)], dtype=D)
    assert float(kl_penalty(lp, ref, "k3")) == pytest.approx(2 - math.log(2) - 1)
    assert float(kl_penalty(lp, ref, "k1")) == pytest.approx(-math.log(2))
    assert float(kl_penalty(lp, ref, "k2")) == pytest.approx(0.5 * math.log(2) ** 2)


def _one_token(rho, adv, **kw):
    lp = torch.tensor([[math.log(rho)]], dtype=D, requires_grad=True)
    old = torch.zeros(1, 1, dtype=D)
    loss, m = policy_loss(lp, old, None, torch.tensor([adv], dtype=D),
                          torch.ones(1, 1, dtype=torch.bool), beta=0.0, **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), m, grad.item()


def test_clipping_hand_worked():
    loss, m, grad = _one_token(1.5, +1.0)                      # min(1.5, 1.2) -> clipped
    assert loss == pytest.approx(-1.2) and m["clip_fraction"] == 1.0 and grad == 0.0
    loss, m, grad = _one_token(1.5, -1.0)                      # min(-1.5, -1.2) -> unclipped
    assert loss == pytest.approx(1.5) and m["clip_fraction"] == 0.0
    assert grad == pytest.approx(1.5)                          # d(-rho*A)/dlogp = -A*rho
    loss, m, grad = _one_token(0.5, -1.0)                      # min(-0.5, -0.8) -> clipped
    assert loss == pytest.approx(0.8) and m["clip_fraction"] == 1.0 and grad == 0.0
    loss, m, _ = _one_token(1.25, +1.0, clip_high=0.28)        # DAPO clip-higher: inside band
    assert loss == pytest.approx(-1.25) and m["clip_fraction"] == 0.0
    assert m["ratio_mean"] == pytest.approx(1.25) and m["ratio_max"] == pytest.approx(1.25)


def test_aggregations_hand_worked():
    # Two completions, lengths 1 and 3, ratio 1 everywhere: per-token loss is -A.
    lp = torch.zeros(2, 3, dtype=D)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])                # 0/1 mask works like bool
    adv = torch.tensor([3.0, 1.0], dtype=D)
    def f(agg):
        return float(policy_loss(lp, lp, None, adv, mask, beta=0.0, loss_agg=agg, max_length=4)[0])
    assert f("seq-mean-token-mean") == pytest.approx(-(3 + 1) / 2)
    assert f("token-mean") == pytest.approx(-(3 + 1 + 1 + 1) / 4)
    assert f("seq-mean-token-sum-norm") == pytest.approx(-(3 / 4 + 3 / 4) / 2)


def test_token_mean_with_the_whole_batchs_token_count():
    # Rank 0 holds the 1-token completion, rank 1 the 3-token one: each divides its token sum by
    # (4 tokens in all) / (2 ranks), so the average of the two losses is the batch's token mean.
    lp = torch.zeros(1, 3, dtype=D)
    rank0 = policy_loss(lp, lp, None, torch.tensor([3.0], dtype=D), torch.tensor([[1, 0, 0]]), beta=0.0,
                        loss_agg="token-mean", num_tokens=4 / 2)[0]
    rank1 = policy_loss(lp, lp, None, torch.tensor([1.0], dtype=D), torch.tensor([[1, 1, 1]]), beta=0.0,
                        loss_agg="token-mean", num_tokens=4 / 2)[0]
    assert float(rank0 + rank1) / 2 == pytest.approx(-(3 + 1 + 1 + 1) / 4)


def test_overlong_penalty_hand_worked():
    # max 20 tokens, buffer 4: no penalty up to 16, then -0.25 per token, -1 from 20 on
    lengths = torch.tensor([0, 16, 17, 18, 20, 25])
    got = overlong_penalty(lengths, max_length=20, buffer=4, penalty=1.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert overlong_penalty(lengths, 20, 4, penalty=0.5).tolist() == pytest.approx([0, 0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 20, 0)


def test_sequence_ratio_is_geometric_mean():
    lp = torch.tensor([[0.0, 2 * math.log(1.1), 5.0]], dtype=D)
    mask = torch.tensor([[True, True, False]])
    _, m = policy_loss(lp, torch.zeros_like(lp), None, torch.tensor([1.0], dtype=D), mask,
                       beta=0.0, ratio_level="sequence")
    assert m["ratio_mean"] == pytest.approx(1.1) and m["ratio_max"] == pytest.approx(1.1)


def test_empty_rows_and_garbage_padding_stay_finite():
    lp = torch.tensor([[-1.0, -float("inf")], [-float("inf"), float("nan")]], dtype=D,
                      requires_grad=True)
    old = torch.tensor([[-1.2, float("nan")], [0.0, -float("inf")]], dtype=D)
    ref = torch.tensor([[-0.9, float("inf")], [float("nan"), 0.0]], dtype=D)
    mask = torch.tensor([[True, False], [False, False]])
    for agg, level in itertools.product(["seq-mean-token-mean", "token-mean",
                                         "seq-mean-token-sum-norm"], ["token", "sequence"]):
        loss, m = policy_loss(lp, old, ref, torch.tensor([1.0, -1.0], dtype=D), mask,
                              loss_agg=agg, max_length=2, ratio_level=level)
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(math.isfinite(v) for v in m.values())
        assert grad[0, 1] == 0 and (grad[1] == 0).all()
    # The empty row is left out of seq-mean-token-mean: the loss is row 0's alone.
    l_both, _ = policy_loss(lp, old, ref, torch.tensor([1.0, -1.0], dtype=D), mask)
    l_one, _ = policy_loss(lp[:1], old[:1], ref[:1], torch.tensor([1.0], dtype=D), mask[:1])
    assert l_both.item() == l_one.item()
    # Nothing masked at all: loss 0, not NaN.
    loss, m = policy_loss(lp, old, ref, torch.tensor([1.0, -1.0], dtype=D),
                          torch.zeros(2, 2, dtype=torch.bool))
    assert loss.item() == 0.0 and m["ratio_max"] == 0.0


def test_float32_matches_float64():
    lp, old, ref, adv, mask = random_batch(3)
    l64, _ = policy_loss(lp, old, ref, adv, mask)
    l32, _ = policy_loss(lp.float(), old.float(), ref.float(), adv.float(), mask)
    assert l32.dtype == torch.float32
    assert float(l32) == pytest.approx(float(l64), rel=1e-5, abs=1e-6)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert float(masked_mean(x, m)) == 1.5
    assert torch.equal(masked_mean(x, m, dim=1), torch.tensor([1.5, 0.0]))


# ---------------------------------------------------------------- errors

def test_errors():
    r = torch.zeros(6)
    with pytest.raises(ValueError, match="divisible"):
        compute_advantages(r, 4)
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages(r, 1)
    with pytest.raises(ValueError, match="scale"):
        compute_advantages(r, 3, scale="std")
    with pytest.raises(ValueError, match="estimator"):
        compute_advantages(r, 3, estimator="ppo")
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages(r.view(2, 3), 3)
    with pytest.raises(ValueError, match="kl estimator"):
        kl_penalty(r, r, "k4")
    lp, old, ref, adv, mask = random_batch(4)
    with pytest.raises(ValueError, match="loss_agg"):
        policy_loss(lp, old, ref, adv, mask, loss_agg="sum")
    with pytest.raises(ValueError, match="kl estimator"):
        policy_loss(lp, old, ref, adv, mask, kl_estimator="k5")
    with pytest.raises(ValueError, match="ratio_level"):
        policy_loss(lp, old, ref, adv, mask, ratio_level="token-group")
    with pytest.raises(ValueError, match="max_length"):
        policy_loss(lp, old, ref, adv, mask, loss_agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, old, None, adv, mask, beta=0.04)
    with pytest.raises(ValueError, match="shapes"):
        policy_loss(lp, old, ref, adv[:-1], mask)


def test_truncated_is_weights_hand_worked():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.3, 0.3]]))
    sampler = torch.log(torch.tensor([[0.5, 0.05, 0.3], [0.6, 0.3, 0.1]]))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    w, metrics = truncated_is_weights(old, sampler, mask, cap=2.0)
    # ratios pi_old/pi_sampler: 1, 4 -> capped at 2, 3 -> capped at 2; 0.5, 1, (padding -> 1)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 2.0], [0.5, 1.0, 1.0]]))
    assert not w.requires_grad
    assert metrics["is_capped_fraction"] == pytest.approx(2 / 5)
    assert metrics["is_weight_mean"] == pytest.approx((1 + 2 + 2 + 0.5 + 1) / 5)
    gaps = [0, math.log(4), math.log(3), math.log(2), 0]
    assert metrics["sampler_logprob_gap"] == pytest.approx(sum(gaps) / 5, rel=1e-6)


def test_is_weights_scale_each_tokens_surrogate_but_not_the_kl():
    torch.manual_seed(0)
    N, T = 4, 5
    logprobs = (torch.randn(N, T) * 0.1 - 1).requires_grad_()
    old = logprobs.detach() + torch.randn(N, T) * 0.05
    ref = logprobs.detach() + torch.randn(N, T) * 0.05
    A = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.ones(N, T, dtype=torch.bool)
    ones = torch.ones(N, T)
    base, _ = policy_loss(logprobs, old, ref, A, mask, beta=0.0)
    same, _ = policy_loss(logprobs, old, ref, A, mask, beta=0.0, is_weights=ones)
    assert torch.equal(base, same)  # weights of 1 change nothing
    doubled, _ = policy_loss(logprobs, old, ref, A, mask, beta=0.0, is_weights=2 * ones)
    torch.testing.assert_close(doubled, 2 * base)
    # With the KL term on, only the surrogate part doubles.
    with_kl, _ = policy_loss(logprobs, old, ref, A, mask, beta=0.1)
    kl_only = with_kl - base
    with_kl_doubled, _ = policy_loss(logprobs, old, ref, A, mask, beta=0.1, is_weights=2 * ones)
    torch.testing.assert_close(with_kl_doubled, 2 * base + kl_only)
