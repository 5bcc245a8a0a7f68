"""PPO maths for the critic baseline (learner/ppo.py): hand-worked numbers and a float64 loop."""
import pytest
import torch

from learner.ppo import gae, token_rewards, value_loss, whiten

D = torch.float64


def close(got, want):
    torch.testing.assert_close(got, torch.tensor(want, dtype=D), rtol=0, atol=1e-9)


def test_token_rewards_put_the_score_on_the_last_token_and_kl_everywhere():
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.4, 9.0, 9.0], [9.0, 9.0, 9.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    got = token_rewards(torch.tensor([1.0, 2.0, 5.0], dtype=D), kl, mask, beta=0.5)
    close(got, [[-0.05, -0.1 + 1.0, 0.0], [-0.2 + 2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_gae_hand_worked():
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=D)
    v = torch.tensor([[0.5, 0.25, 0.75]], dtype=D)
    adv, ret = gae(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.75, 0.25]])
    close(ret, [[1.0, 1.0, 1.0]])
    # lam = 0: one-step TD errors
    adv, _ = gae(r, v, torch.ones(1, 3), gamma=1.0, lam=0.0)
    close(adv, [[0.25 - 0.5, 0.75 - 0.25, 1.0 - 0.75]])


def _reference_gae(r, v, mask, gamma, lam):
    out = torch.zeros_like(v)
    for i in range(v.shape[0]):
        idx = [t for t in range(v.shape[1]) if mask[i, t]]
        running = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            nxt = float(v[i, idx[k + 1]]) if k + 1 < len(idx) else 0.0
            delta = float(r[i, t]) + gamma * nxt - float(v[i, t])
            running = delta + gamma * lam * running
            out[i, t] = running
    return out


def test_gae_matches_a_plain_loop_with_padding():
    g = torch.Generator().manual_seed(3)
    r, v = torch.randn(4, 7, generator=g, dtype=D), torch.randn(4, 7, generator=g, dtype=D)
    mask = torch.tensor([[1] * 7, [1] * 3 + [0] * 4, [0] * 7, [1] * 5 + [0] * 2])
    adv, ret = gae(r, v, mask, gamma=0.99, lam=0.9)
    torch.testing.assert_close(adv, _reference_gae(r, v, mask, 0.99, 0.9))
    torch.testing.assert_close(ret, (adv + v) * mask)


def test_whiten_over_the_mask():
    a = torch.tensor([[1.0, 3.0, 100.0]], dtype=D)
    w = whiten(a, torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(w, torch.tensor([[-1.0, 1.0, 0.0]], dtype=D), rtol=0, atol=1e-6)


def test_value_loss_hand_worked_and_gradient():
    values = torch.tensor([[1.0, 0.6]], dtype=D, requires_grad=True)
    old = torch.tensor([[0.5, 0.5]], dtype=D)
    returns = torch.tensor([[2.0, 0.0]], dtype=D)
    loss, m = value_loss(values, old, returns, torch.ones(1, 2), clip=0.2)
    # token 0: V_clip = 0.7, errors 1.0 vs 1.69 -> 1.69; token 1: V_clip = 0.6, both 0.36
    assert float(loss.detach()) == pytest.approx(0.5 * (1.69 + 0.36) / 2)
    assert m["value_clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    # the clipped branch has no gradient through V; the other gives (V - R) / 2 tokens
    close(values.grad, [[0.0, 0.6 / 2]])
