"""The judge verifier on real vLLM engines: a judge made here (the built-in model fine-tuned to reply
yes or no) returns parsed verdicts, greedy and so repeatable; a rule that cannot read its replies
counts them unparseable; a killed judge engine is replaced and its batch judged again.

One engine of its own (a third beside the session's two): kept to one module and few calls."""
from __future__ import annotations

import dataclasses
import os
import signal
import threading

import pytest
import ray

from common.config import JudgeConfig, RewardConfig
from common.messages import ScoringRequest
from examples.judge_model import judge_from
from reward.judge import JudgePool
from reward.model_scorer import ModelBackedScorer
from reward.scorer import VerifierScorer


def rows(n):
    out = []
    for i in range(n):
        a, b = 10 + i, 40 + 3 * i
        right = i % 2 == 0
        out.append((f"{a}+{b}=", f"<think></think><answer>{a + b if right else a + b + 1}</answer>", str(a + b), right))
    return out


@pytest.fixture(scope="module")
def judge(ray_session, system_cfg, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("judge"))
    judge_from(system_cfg.model.path, folder, rows(64), JudgeConfig().template, steps=60)
    settings = JudgeConfig(path=folder, max_new_tokens=4, kv_cache_gib=0.25, timeout_s=300)
    pool = JudgePool(settings)
    pool.ready()
    yield settings, pool
    pool.shutdown()


def scorer(settings, pool, **judge):
    reward = RewardConfig(verifiers=["judge", "math"], weights={"judge": 1.0, "math": 0.0}, timeout_s=5.0,
                          judge=dataclasses.replace(settings, **judge))
    return ModelBackedScorer(VerifierScorer, {"judge": pool.workers}, reward)


def requests(n):
    return [ScoringRequest(p, c, a) for p, c, a, _ in rows(n)]


def test_verdicts_are_parsed_and_repeat(judge):
    settings, pool = judge
    items = requests(16)
    first = scorer(settings, pool).score(items)
    assert all(o.scores["judge"] in (0.0, 1.0) for o in first)
    assert sum(o.counts.get("judge_unparseable", 0.0) for o in first) == 0
    assert [o.reward for o in first] == [o.scores["judge"] for o in first]  # math weighs 0
    again = scorer(settings, pool).score(items)
    assert [o.scores for o in again] == [o.scores for o in first]  # greedy: the same verdicts


def test_unreadable_verdicts_are_scored_as_configured_and_counted(judge):
    settings, pool = judge
    outcomes = scorer(settings, pool, verdict="number", unparseable_score=0.25).score(requests(8))
    assert [o.scores["judge"] for o in outcomes] == [0.25] * 8  # a yes/no judge writes no number
    assert sum(o.counts["judge_unparseable"] for o in outcomes) == 8


def test_a_killed_judge_engine_is_replaced_and_its_batch_judged_again(judge):
    settings, pool = judge
    items = requests(16)
    before = [o.scores["judge"] for o in scorer(settings, pool).score(items)]
    victim_pid = ray.get(pool.workers[0].pid.remote())
    many = items * 150  # long enough for the kill to land inside the call
    killer = threading.Timer(0.3, lambda: os.kill(victim_pid, signal.SIGKILL))
    killer.start()
    outcomes = scorer(settings, pool).score(many)
    killer.join()
    assert ray.get(pool.workers[0].pid.remote()) != victim_pid
    assert [o.scores["judge"] for o in outcomes] == before * 150
    assert not any(o.timed_out for o in outcomes)
