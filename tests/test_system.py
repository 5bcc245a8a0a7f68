"""Integration tests on the real stack: Ray actors, vLLM (CPU build), DeepSpeed ZeRO-2 over gloo."""
from __future__ import annotations

import ray
import torch

from cluster.batches import SyncBatches
from cluster.buffer import RolloutBuffer
from cluster.prompt_group import PromptGroup
from cluster.train import evaluate, grpo_step, warm_up
from rollout.datasets import PromptSampler, load_problems
from rollout.pool import as_batch

REQUIRED_KEYS = {
    "step", "policy_version", "reward_mean", "reward_std", "accuracy", "kl", "clip_fraction",
    "response_length_mean", "time_generate", "time_reward", "time_train", "time_weight_sync",
    "time_step", "sync_bytes", "sync_seconds", "sync_gbps",
}


def test_warmup_then_grpo_steps_advance_versions_and_change_weights(roles, system_cfg):
    heldout, train_set = load_problems(system_cfg.data, system_cfg.trainer.seed)
    warmed = warm_up(roles, system_cfg, train_set)
    # One push per warm-up probe (every check_every steps), each reported by every worker.
    assert warmed == system_cfg.warmup.steps // system_cfg.warmup.check_every
    assert roles.rollout.versions() == [warmed, warmed]
    version = warmed
    accuracy = evaluate(roles, heldout[:8])
    assert 0.0 <= accuracy <= 1.0

    before = roles.learner.call("state_copy")
    batches, buffer = SyncBatches(roles, PromptSampler(train_set, 0), system_cfg), RolloutBuffer()
    rows = []
    for step in (1, 2):
        row = grpo_step(step, version, roles, batches, buffer, system_cfg)
        version = row["policy_version"]
        rows.append(row)
    after = roles.learner.call("state_copy")

    assert [r["policy_version"] for r in rows] == [warmed + 1, warmed + 2]
    assert roles.rollout.versions() == [warmed + 2, warmed + 2]
    assert len(buffer) == 0
    for row in rows:
        assert REQUIRED_KEYS <= set(row), REQUIRED_KEYS - set(row)
        assert row["sync_bytes"] > 0
    # Every rank holds the same, changed weights (data parallel: same update everywhere).
    changed = [name for name in before[0] if not torch.equal(before[0][name], after[0][name])]
    assert changed, "no learner parameter changed after two GRPO steps"
    for name in after[0]:
        torch.testing.assert_close(after[0][name], after[1][name], rtol=0, atol=0)


def test_generation_workers_return_refs_not_payloads(roles, system_cfg):
    train_set = load_problems(system_cfg.data, system_cfg.trainer.seed).train
    refs, gen = roles.rollout.generate(as_batch(train_set[:3]), 2, greedy=False, seed=5)
    assert gen["completions"] == 6 and gen["per_item/policy_version"] == [roles.channel.version] * 3
    assert all(isinstance(r, ray.ObjectRef) for r in refs)
    scored, stats = roles.verifiers.score(refs)
    assert all(isinstance(r, ray.ObjectRef) for r in scored)
    assert stats["completions"] == 6
    groups = ray.get(scored)
    assert all(isinstance(g, PromptGroup) and len(g.rewards) == 2 for g in groups)
    assert [g.prompt for g in groups] == [p.prompt for p in train_set[:3]]
