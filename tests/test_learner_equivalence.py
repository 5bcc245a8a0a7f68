"""DeepSpeed for real: one GRPO optimizer step on the same batch gives the same parameters
(within fp32 rounding) for 1 vs 2 data-parallel ranks and for ZeRO stages 0, 1, 2 and 3."""
from __future__ import annotations

import random
from dataclasses import asdict

import pytest
import ray
import torch

from cluster.prompt_group import PromptGroup
from learner.group import LearnerGroup


G = 4


def _batch(vocab: int, num_groups: int = 4):
    """Prompt groups with varied lengths, rewards and finish reasons, fixed by a seed."""
    rng = random.Random(7)
    groups = []
    for i in range(num_groups):
        completions = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))] for _ in range(G)]
        groups.append(PromptGroup(
            index=i, prompt=f"q{i}", answer="0", prompt_ids=[rng.randrange(3, vocab) for _ in range(5)],
            completions=["x"] * G, completion_ids=completions,
            finish_reasons=[rng.choice(["stop", "length"]) for _ in range(G)], policy_version=0,
            rewards=[float(rng.random() < 0.5) + 0.1 * rng.random() for _ in range(G)]))
    return groups


def _one_step(cfg, num_ranks: int, zero_stage: int, groups, micro_tokens: int = 0, **algo):
    learner_cfg = {**asdict(cfg.learner), "num_ranks": num_ranks, "zero_stage": zero_stage,
                   "minibatches": 1, "num_cpus_per_rank": 0.1, "max_tokens_per_microbatch": micro_tokens}
    algo_cfg = {**asdict(cfg.algo), "max_length": cfg.rollout.max_new_tokens, **algo}
    learner = LearnerGroup(cfg.model.path, learner_cfg, algo_cfg, cfg.trainer.seed)
    try:
        learner.call("snapshot_reference")
        before = learner.call("state_copy")[0]  # a collective under ZeRO-3: every rank joins
        metrics = learner.train_step([ray.put(g) for g in groups], 1.0, LR)
        states = learner.call("state_copy")
    finally:
        learner.shutdown()
    for other in states[1:]:  # every rank holds the same full model after the step
        assert all(torch.equal(states[0][k], other[k]) for k in states[0])
    return before, states[0], metrics


@pytest.fixture(scope="module")
def batch(system_cfg):
    import json
    from pathlib import Path

    vocab = json.loads((Path(system_cfg.model.path) / "config.json").read_text())["vocab_size"]
    return _batch(vocab)


@pytest.fixture(scope="module")
def reference(ray_session, system_cfg, batch):
    return _one_step(system_cfg, 1, 2, batch)


LR = 1e-3


def _assert_close(a, b):
    # Adam's first step moves each weight by lr * g / (|g| + eps): for a gradient near eps, the
    # last bits that a different reduction order changes become a visible share of lr. 1% of
    # one step is far below any real difference (a wrong shard or a lost rank moves whole steps).
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=LR * 1e-2, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("num_ranks, zero_stage, micro_tokens", [
    (2, 2, 0), (2, 3, 0), (2, 0, 0), (2, 1, 0),
    (1, 2, 30), (2, 2, 30), (2, 3, 30),  # micro-batches of at most 30 padded tokens, accumulated
])
def test_same_step_for_any_rank_count_zero_stage_and_micro_batching(system_cfg, batch, reference, num_ranks,
                                                                     zero_stage, micro_tokens):
    before, after, metrics = reference
    assert any(not torch.equal(before[k], after[k]) for k in before), "the step changed nothing"
    _, other, other_metrics = _one_step(system_cfg, num_ranks, zero_stage, batch, micro_tokens)
    _assert_close(after, other)
    assert other_metrics["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
    assert other_metrics["micro_batches"] > 1 if micro_tokens else other_metrics["micro_batches"] == 1


def test_dapo_token_mean_is_normalised_over_the_whole_batch(ray_session, system_cfg, batch):
    # The two ranks hold different numbers of tokens: dividing each rank's sum by its own count
    # would weight tokens differently than one rank does; the global count makes them agree.
    dapo = dict(loss_agg="token-mean", mask_truncated=True, overlong_buffer=4, overlong_penalty=0.5,
                clip_high=0.28, beta=0.0, max_length=10)  # completions of 2-9 tokens: 7-9 are penalised
    _, one, one_metrics = _one_step(system_cfg, 1, 2, batch, **dapo)
    _, two, two_metrics = _one_step(system_cfg, 2, 2, batch, **dapo)
    _assert_close(one, two)
    _, micro, _ = _one_step(system_cfg, 2, 2, batch, micro_tokens=30, **dapo)
    _assert_close(one, micro)
    assert one_metrics["overlong_penalty_mean"] == pytest.approx(two_metrics["overlong_penalty_mean"])
    assert one_metrics["overlong_penalty_mean"] < 0  # some completions reach the buffer
