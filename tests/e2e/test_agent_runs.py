"""Runs with your own agent as a user starts them: the worked example (examples/calculator_agent.py)
through the generation workers' endpoint, and a model it cannot work with."""
from __future__ import annotations

import json

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


def test_a_short_async_run_with_the_example_agent_records_its_sessions(tmp_path, model_cache):
    """`grpo train data=mul_agent` for two async steps: every sample an agent episode through
    the endpoint, its stats in metrics.jsonl, each group tagged with the policy that made it."""
    overrides = small_overrides(model_cache, str(tmp_path)) + [
        "data=mul_agent", "trainer.run_name=agent", "trainer.eval_every=0", "warmup.steps=0",
        "trainer.mode=async", "rollout.agent_concurrency=8", "rollout.num_workers=1", "reward.num_workers=1"]
    result = run(GRPO, "train", *overrides, "trainer.max_steps=2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "agent" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["completions"] == 8 * 4 and row["agent_requests"] >= row["completions"]
        assert row["agent_errors"] == 0 and row["agent_timeouts"] == 0 and row["agent_rejected"] == 0
        assert row["turns_mean"] >= 1 and row["completion_tokens"] > 0
        assert row["staleness_max"] <= 1
