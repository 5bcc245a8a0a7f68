"""Runs with your own agent as a user starts them: the worked example (examples/calculator_agent.py)
through the generation workers' endpoint, and a model it cannot work with."""
from __future__ import annotations

import json
import shutil

import pytest

from cluster.loop.samples import read as read_samples
from helpers import GRPO, copy_without_chat_template, run, small_overrides

AGENT = "rollout.agent=examples.calculator_agent:run"


def test_an_agent_with_a_model_without_a_chat_template_exits_2(tmp_path, system_cfg):
    """The endpoint renders the agent's messages with the chat template: none, no run."""
    model = tmp_path / "no-template"
    copy_without_chat_template(system_cfg.model.path, model)
    out = tmp_path / "runs"
    result = run(GRPO, "train", "model=hf", f"model.path={model}", f"trainer.output_dir={out}", "logger=none", AGENT,
                 timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "rollout.agent" in lines[0] and "no chat template" in lines[0], result.stderr
    assert not out.exists()


@pytest.fixture(scope="module")
def agent_run(model_cache, tmp_path_factory):
    """`grpo train data=mul_agent` for two async steps with DAPO's dynamic sampling and a
    checkpoint after each step; then the same run resumed from its first checkpoint, when the
    second step's sessions had been started by the first run (in flight, or done ahead)."""
    out = tmp_path_factory.mktemp("agent")
    overrides = small_overrides(model_cache, str(out)) + [
        "data=mul_agent", "trainer.run_name=agent", "trainer.eval_every=0", "warmup.steps=0",
        "trainer.mode=async", "rollout.agent_concurrency=8", "rollout.num_workers=1", "reward.num_workers=1",
        "learner.num_ranks=1", "algo.dynamic_sampling=true", "algo.max_sampling_rounds=2", "trainer.save_every=1",
        "trainer.max_steps=2"]
    straight = run(GRPO, "train", *overrides)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    run_dir = out / "agent"
    (out / "straight").mkdir()
    for name in ("samples.jsonl", "metrics.jsonl"):
        shutil.copy(run_dir / name, out / "straight" / name)
    first = run_dir / "checkpoints" / "step-000001"
    resumed = run(GRPO, "train", *overrides, f"trainer.resume={first}")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return out, run_dir, overrides


def test_a_short_async_run_with_the_example_agent_records_its_sessions(agent_run):
    """Every sample an agent episode through the endpoint, its stats in metrics.jsonl, each group
    tagged with the policy that made it; dynamic sampling draws again with the agent."""
    out, _, _ = agent_run
    rows = [json.loads(line) for line in (out / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # The untrained model scores 0 everywhere: no group is informative, so every step draws
        # its second round and fills the batch with the groups it would have dropped.
        assert row["sampling_rounds"] == 2 and row["dynamic_filled"] == 8
        assert row["completions"] == 2 * 8 * 4 and row["agent_requests"] >= row["completions"]
        assert row["agent_errors"] == 0 and row["agent_timeouts"] == 0 and row["agent_rejected"] == 0
        assert row["turns_mean"] >= 1 and row["completion_tokens"] > 0
        # tool output is part of the stored sequence, never all of it (every episode samples),
        # and there is none without a call
        assert row["tool_calls_mean"] >= 0.0 and 0.0 <= row["observation_token_fraction"] < 1.0
        assert row["observation_token_fraction"] == 0.0 or row["tool_calls_mean"] > 0.0
        assert row["staleness_max"] <= 1


def test_a_resumed_agent_run_trains_each_sample_once(agent_run):
    """Sessions started before the checkpoint are made again by the resumed run, never half
    used: samples.jsonl holds each step's samples once, the same ones the straight run trained."""
    out, run_dir, _ = agent_run
    samples = read_samples(run_dir)
    assert [s[0] for s in samples] == sorted(s[0] for s in samples)
    assert {s[0] for s in samples} == {1, 2}
    assert len(samples) == len(set(samples)) == 2 * 8 * 4
    assert samples == read_samples(out / "straight")
    assert (run_dir / "final_model" / "config.json").exists()


def test_grpo_eval_with_the_agent_scores_each_episode(agent_run):
    """`grpo eval` of the trained model with the agent: each held-out row an episode through the
    endpoint (greedy, then eval.n samples), scored on the agent's answer."""
    out, run_dir, overrides = agent_run
    keep = [a for a in overrides if a.startswith(("model.cache_dir", "data=", "rollout.", "reward.", "logger"))]
    result = run(GRPO, "eval", str(run_dir / "final_model"), *keep, f"trainer.output_dir={out / 'evals'}",
                 "trainer.run_name=e", "data.heldout_size=8", "eval.n=2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "evals" / "e" / "eval_summary.json").read_text())
    assert summary["prompts"] == 8
    assert summary["eval/agent_requests"] >= 8 * (1 + 2)
    assert summary["eval/agent_errors"] == 0 and summary["eval/agent_timeouts"] == 0
    records = [json.loads(line) for line in (out / "evals" / "e" / "eval.jsonl").read_text().splitlines()]
    assert len(records) == 8 and all(len(r["samples"]) == 2 for r in records)
    # The summary's figures are the episodes' own scores: greedy the mean of the greedy episodes'
    # scores, pass@2 the share of prompts with a correct answer among their two samples, pass@1
    # the share of correct samples.
    assert summary["eval/greedy"] == pytest.approx(sum(r["greedy_score"] for r in records) / 8)
    assert summary["eval/pass@2"] == pytest.approx(sum(any(s["correct"] for s in r["samples"]) for r in records) / 8)
    assert summary["eval/pass@1"] == pytest.approx(sum(s["correct"] for r in records for s in r["samples"]) / 16)
