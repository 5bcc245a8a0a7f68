"""Runs with tools as a user starts them: a format the tokenizer cannot express, and a tool run
that composes with async mode, DAPO's dynamic sampling, checkpoints and resume (bad tool settings:
tests/e2e/test_cli.py)."""
from __future__ import annotations

import json

from helpers import GRPO, copy_without_chat_template, run, small_overrides


def test_a_tool_format_the_tokenizer_cannot_express_exits_2(tmp_path, system_cfg):
    """hermes results go back through the chat template: a model without one cannot use it."""
    model = tmp_path / "no-template"
    copy_without_chat_template(system_cfg.model.path, model)
    out = tmp_path / "runs"
    result = run(GRPO, "train", "model=hf", f"model.path={model}", f"trainer.output_dir={out}", "logger=none",
                 "rollout.tools=[calculator]", "rollout.tool_format=hermes", timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "rollout.tool_format=hermes" in lines[0] and "chat template" in lines[0]
    assert not out.exists()


def test_a_tool_run_composes_with_async_dynamic_sampling_and_resume(tmp_path, model_cache):
    """Episodes in async batches, with dynamic sampling, checkpointed every step; the run then
    continues from its checkpoint (the batch generated ahead is thrown away and made again,
    never half-trained)."""
    overrides = small_overrides(model_cache, str(tmp_path)) + [
        "data=mul", "rollout.tools=[calculator]", "trainer.mode=async", "algo.dynamic_sampling=true",
        "trainer.save_every=1", "trainer.run_name=tools", "trainer.eval_every=0", "warmup.steps=30",
        # One engine, one verifier and one learner rank: what is tested is one actor's episodes,
        # not the pools' or the ranks' (the suite is CPU-bound, and each engine and rank costs
        # ~10 CPU-s of imports per run).
        "rollout.num_workers=1", "reward.num_workers=1", "learner.num_ranks=1"]
    first = run(GRPO, "train", *overrides, "trainer.max_steps=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = run(GRPO, "train", *overrides, "trainer.max_steps=3", "trainer.resume=auto")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout
    rows = [json.loads(line) for line in (tmp_path / "tools" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["turns_mean"] >= 1 and row["tool_calls_mean"] > 0
        assert 0 < row["observation_token_fraction"] < 1
        assert "sampling_rounds" in row and row["staleness_max"] <= 1


def test_a_tool_run_streams_by_the_episode_and_trains_each_sample_once(tmp_path, model_cache):
    """rollout.streaming with real tool episodes: a worker runs the taken prompts' episodes in one
    call and takes the next when it ends, two steps ahead of the learner; every step trains its
    own prompts' episodes, each sample once, and the episodes call the tool."""
    from cluster.loop.samples import read

    overrides = small_overrides(model_cache, str(tmp_path)) + [
        "data=mul", "rollout.tools=[calculator]", "trainer.mode=async", "rollout.streaming=true",
        "trainer.async_lookahead=2", "algo.max_staleness=2", "trainer.run_name=streamed", "trainer.eval_every=0",
        "warmup.steps=30", "rollout.num_workers=1", "reward.num_workers=1", "learner.num_ranks=1", "trainer.max_steps=3"]
    result = run(GRPO, "train", *overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "streamed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:  # each step's own groups' episodes (as a chunked step reports them)
        assert row["turns_mean"] >= 1 and row["tool_calls_mean"] > 0 and row["staleness_max"] <= 2
    # the engines' steps are those since the last step was handed out: a step made while the one
    # before it trained has none of its own
    assert sum(r["engine_steps"] for r in rows) > 0
    samples = read(tmp_path / "streamed")
    assert len(samples) == 3 * 8 * 4  # steps x prompts x group size
    assert len({(prompt, sample) for _, prompt, sample, _ in samples}) == len(samples)
    assert sorted({step for step, *_ in samples}) == [1, 2, 3]
