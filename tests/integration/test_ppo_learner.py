"""The PPO baseline on the real learner: a critic with its own DeepSpeed engine learns the returns."""
from __future__ import annotations

import math

from dataclasses import replace

import ray
import torch

from learner.group import LearnerGroup
from helpers import varied_groups


def test_ppo_step_trains_policy_and_critic(ray_session, system_cfg):
    import json
    from pathlib import Path

    vocab = json.loads((Path(system_cfg.model.path) / "config.json").read_text())["vocab_size"]
    groups = [ray.put(g) for g in varied_groups(vocab, 4)]
    learner_cfg = replace(system_cfg.learner, num_ranks=2, zero_stage=2, minibatches=1, num_cpus_per_rank=0.1)
    algo = replace(system_cfg.algo, adv_estimator="gae", critic_lr=3e-3)
    learner = LearnerGroup(system_cfg.model.path, learner_cfg, algo, 32, system_cfg.trainer.seed)
    try:
        learner.call("snapshot_reference")
        before = learner.call("state_copy")[0]
        history = [learner.train_step(groups, 1.0, 1e-3) for _ in range(6)]
        after = learner.call("state_copy")[0]
    finally:
        learner.shutdown()
    for metrics in history:
        for key in ("value_loss", "value_clip_fraction", "value_mean", "kl", "loss", "learner_peak_memory_mb"):
            assert key in metrics and math.isfinite(metrics[key]), key  # present, a finite number
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the policy moved
    # the critic fits the returns of a fixed batch: its loss falls
    assert history[-1]["value_loss"] < history[0]["value_loss"]
    # the per-token KL reward (k1: log pi_old - log pi_ref) is 0 until the policy moves; on these
    # random token ids, which the policy did not sample, its sign can be either
    # pi_ref is a copy of the first policy: the same forward in another allocation, equal to rounding
    assert abs(history[0]["kl"]) <= 1e-6 and abs(history[-1]["kl"]) > 1e-4
