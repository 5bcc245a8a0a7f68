"""The PPO baseline on the real learner: a critic with its own DeepSpeed engine learns the returns,
in micro-batches as the policy does."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch

from learner_pool import probe, state_copy
from helpers import varied_groups

MICRO_TOKENS = 30  # several micro-batches of the 16 rows below (2-9 completion tokens each)


def _ppo_steps(learners, cfg, steps: int, micro_tokens: int, ranks: int = 2):
    """Metrics of `steps` PPO steps on one fixed batch, and the policy before and after them
    (`learners`: the module's pool)."""
    vocab = json.loads((Path(cfg.model.path) / "config.json").read_text())["vocab_size"]
    groups = [ray.put(g) for g in varied_groups(vocab, 4)]
    learner_cfg = replace(cfg.learner, num_ranks=ranks, zero_stage=2, minibatches=1, num_cpus_per_rank=0.1,
                          max_tokens_per_microbatch=micro_tokens)
    algo = replace(cfg.algo, adv_estimator="gae", critic_lr=3e-3)
    with learners.learner(cfg.model.path, learner_cfg, algo, 32, cfg.trainer.seed) as learner:
        learner.snapshot_reference()
        before = probe(learner, state_copy)[0]
        history = [learner.train_step(groups, 1.0, 1e-3) for _ in range(steps)]
        after = probe(learner, state_copy)[0]
    return history, before, after


@pytest.fixture(scope="module")
def micro_batched(learners, system_cfg):
    return _ppo_steps(learners, system_cfg, 6, MICRO_TOKENS)


def test_ppo_step_trains_policy_and_critic(micro_batched):
    history, before, after = micro_batched
    assert all(m["micro_batches"] > 1 for m in history)
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


def test_micro_batches_give_the_critic_the_loss_and_step_of_one_batch(micro_batched, learners, system_cfg):
    """The value loss is a token mean over the minibatch: in micro-batches, each weighted by its
    tokens, it is the same number, and so is the critic's step it drives (seen in the next
    step's value loss)."""
    whole, _, _ = _ppo_steps(learners, system_cfg, 2, 0)
    micro = micro_batched[0]
    assert whole[0]["micro_batches"] == 1
    for key in ("value_loss", "value_clip_fraction", "value_mean", "loss"):
        assert micro[0][key] == pytest.approx(whole[0][key], rel=1e-5, abs=1e-7), key
    assert micro[1]["value_loss"] == pytest.approx(whole[1]["value_loss"], rel=1e-4), "the critic's first steps differ"


def test_value_metrics_are_the_whole_batchs_for_any_rank_count(micro_batched, learners, system_cfg):
    """Two ranks hold shares of the batch with unequal token counts: the value model's metrics of
    the first step (before any update) are its token means over the whole batch, as one rank
    computes them (a plain mean of the two ranks' means is not)."""
    one, _, _ = _ppo_steps(learners, system_cfg, 1, MICRO_TOKENS, ranks=1)
    two = micro_batched[0][0]
    for key in ("value_loss", "value_mean"):
        assert two[key] == pytest.approx(one[0][key], rel=1e-5), key
    assert two["loss_tokens"] == one[0]["loss_tokens"]
