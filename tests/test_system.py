"""Integration tests on the real stack: Ray actors, vLLM (CPU build), DeepSpeed ZeRO-2 over gloo."""
from __future__ import annotations

import pytest
import ray
import torch

from cluster.buffer import RolloutBuffer
from cluster.prompt_group import PromptGroup
from cluster.train import evaluate, grpo_step, warm_up
from rollout.datasets import PromptSampler, load_problems
from rollout.pool import as_batch
from rollout.worker import GenerationWorker

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
    sampler, buffer = PromptSampler(train_set, 0), RolloutBuffer()
    rows = []
    for step in (1, 2):
        row = grpo_step(step, version, roles, sampler, buffer, system_cfg)
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


def test_synced_worker_matches_fresh_engine_from_saved_weights(roles, system_cfg, tmp_path):
    """After a push, a worker's greedy output equals a fresh vLLM engine loaded from the learner's save."""
    version = roles.channel.version + 1
    roles.channel.push(version)
    folder = roles.learner.save_pretrained(str(tmp_path / "saved"))

    fresh = ray.remote(num_cpus=0.5)(GenerationWorker).remote(folder, _rollout_cfg(system_cfg), 123)
    prompts = [(i, f"{a}+{b}=", str(a + b), {}) for i, (a, b) in enumerate([(47, 85), (12, 34), (99, 99), (50, 7)])]
    seeds = [0] * len(prompts)
    synced_refs = ray.get(roles.rollout.workers[0].generate.remote(prompts, 1, True, seeds))
    fresh_refs = ray.get(fresh.generate.remote(prompts, 1, True, seeds))
    synced, reference = ray.get(synced_refs), ray.get(fresh_refs)
    assert [g.completion_ids for g in synced] == [g.completion_ids for g in reference]
    assert [g.completions for g in synced] == [g.completions for g in reference]
    assert all(g.policy_version == version for g in synced)
    assert ray.get(roles.rollout.workers[1].weights_checksum.remote()) == ray.get(fresh.weights_checksum.remote())
    ray.kill(fresh)


def test_generation_workers_return_refs_not_payloads(roles, system_cfg):
    train_set = load_problems(system_cfg.data, system_cfg.trainer.seed).train
    refs = roles.rollout.generate(as_batch(train_set[:3]), 2, greedy=False, seed=5)
    assert all(isinstance(r, ray.ObjectRef) for r in refs)
    scored, stats = roles.verifiers.score(refs)
    assert all(isinstance(r, ray.ObjectRef) for r in scored)
    assert stats["completions"] == 6
    groups = ray.get(scored)
    assert all(isinstance(g, PromptGroup) and len(g.rewards) == 2 for g in groups)
    assert [g.prompt for g in groups] == [p.prompt for p in train_set[:3]]


def _rollout_cfg(cfg) -> dict:
    from dataclasses import asdict

    return asdict(cfg.rollout)


def test_buffer_holds_refs_only_and_keeps_order(ray_session):
    buffer = RolloutBuffer()
    refs = [ray.put(f"group {i}") for i in range(3)]
    buffer.put(refs, policy_version=3)
    with pytest.raises(TypeError, match="ObjectRef"):
        buffer.put(["a payload, not a reference"], policy_version=3)
    with pytest.raises(ValueError):
        buffer.take(4)
    assert buffer.take(2) == refs[:2] and len(buffer) == 1


def test_dynamic_sampling_drops_groups_without_signal(roles, system_cfg):
    import copy

    from cluster.train import Timer, collect_groups
    from rollout.datasets import PromptSampler

    cfg = copy.deepcopy(system_cfg)
    cfg.algo.dynamic_sampling, cfg.algo.max_sampling_rounds = True, 3
    sampler = PromptSampler(load_problems(cfg.data, cfg.trainer.seed).train, seed=11)
    refs, stats, sampling = collect_groups(1, roles, sampler, cfg, Timer())
    size, G = cfg.trainer.prompts_per_step, cfg.algo.group_size
    groups = ray.get(refs)
    assert len(groups) == size
    filled, dropped = int(sampling["dynamic_filled"]), int(sampling["dynamic_dropped"])
    # informative groups first; groups without signal only to fill what 3 rounds could not
    assert [len(set(g.rewards)) > 1 for g in groups] == [True] * (size - filled) + [False] * filled
    assert 1 <= sampling["sampling_rounds"] <= 3
    assert stats["completions"] == G * (size + dropped)  # every generated group was scored once
    assert len({g.index for g in groups}) == size  # no prompt twice in one batch
