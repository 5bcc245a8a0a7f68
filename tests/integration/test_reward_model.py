"""The reward_model verifier on a real Ray: its own pool of model actors, scores equal to a plain
transformers forward, combined with a rule verifier by weight, a killed actor replaced and its
batch scored again."""
from __future__ import annotations

import os
import signal
import threading

import pytest
import ray

from common.config import RewardConfig, RewardModelConfig
from common.messages import ScoringRequest
from examples.reward_model import classifier_from
from reward.reward_model import model_text

# Logits of one text alone and inside a padded batch differ only by float32 rounding of matrix
# products of other shapes (128-wide, 2 layers: relative error ~1e-6 of values of order 1).
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reward_model(system_cfg, tmp_path_factory):
    return classifier_from(system_cfg.model.path, str(tmp_path_factory.mktemp("reward_model")), seed=3)


def plain_forward(model_dir, texts):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(**tokenizer(t, return_tensors="pt")).logits[0, 0]) for t in texts]


def requests(n=12):
    """Completions of varied lengths (padding inside a batch), right and wrong."""
    out = []
    for i in range(n):
        a, b = 10 + i, 30 + 7 * i
        answer = a + b if i % 2 else a + b + 1
        out.append(ScoringRequest(f"{a}+{b}=", f"<think>{'x' * i}</think><answer>{answer}</answer>", str(a + b)))
    return out


def start(cfg, settings):
    """The verifier pool as a run starts it (its model actors first)."""
    from dataclasses import replace

    from cluster.loop.roles import start_verifiers

    pool = start_verifiers(replace(cfg, reward=settings))
    pool.ready()
    return pool


def test_scores_equal_a_plain_forward_and_combine_with_math(ray_session, system_cfg, reward_model):
    settings = RewardConfig(verifiers=["math", "reward_model"], weights={"math": 1.0, "reward_model": 0.5},
                            num_workers=1, model=RewardModelConfig(path=reward_model, batch_size=5, num_workers=2))
    pool = start(system_cfg, settings)
    try:
        items = requests()
        outcomes, stats = pool.score_items(items)
    finally:
        pool.shutdown()
    expected = plain_forward(reward_model, [model_text(r.prompt, r.completion) for r in items])
    for outcome, logit, i in zip(outcomes, expected, range(len(items))):
        assert outcome.scores["reward_model"] == pytest.approx(logit, abs=TOLERANCE)
        assert outcome.scores["math"] == float(i % 2)
        assert outcome.reward == pytest.approx(outcome.scores["math"] + 0.5 * logit, abs=TOLERANCE)
        assert outcome.timed_out == [] and outcome.errors == []
    assert stats["completions"] == len(items)


def test_a_killed_model_actor_is_replaced_and_its_batch_scored_again(ray_session, system_cfg, reward_model):
    # One forward per text: the actor's share takes long enough for the kill to land inside it.
    settings = RewardConfig(verifiers=["reward_model"], weights={"reward_model": 1.0}, num_workers=1,
                            model=RewardModelConfig(path=reward_model, batch_size=1, normalize="sigmoid",
                                                    num_workers=1))
    pool = start(system_cfg, settings)
    try:
        victim = pool.model_pools[0].workers[0]
        first_pid = ray.get(victim.pid.remote())
        items = requests(12) * 100
        killer = threading.Timer(0.5, lambda: os.kill(first_pid, signal.SIGKILL))
        killer.start()
        outcomes, _ = pool.score_items(items)
        killer.join()
        assert ray.get(victim.pid.remote()) != first_pid
    finally:
        pool.shutdown()
    import math

    expected = [1 / (1 + math.exp(-x)) for x in plain_forward(reward_model, [model_text(r.prompt, r.completion)
                                                                             for r in items[:12]])] * 100
    assert [o.scores["reward_model"] for o in outcomes] == pytest.approx(expected, abs=TOLERANCE)
    assert all(not o.timed_out for o in outcomes)
