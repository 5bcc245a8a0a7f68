"""reasoning-gym tasks as a user runs them: a 2-step `grpo train` on a weighted mix of two tasks
(per-task score columns), `grpo eval` of its model and `grpo verify` on rows it could have
written; a task reasoning-gym does not have exits 2 before any actor."""
from __future__ import annotations

import json

import pytest

from helpers import GRPO, run, small_overrides

pytest.importorskip("reasoning_gym")

MIX = ["data=reasoning_gym", "+data.tasks.chain_sum=1", "+data.tasks.spell_backward=1",
       "+data.task_config.chain_sum.max_terms=2", "+data.task_config.chain_sum.max_digits=1",
       "+data.task_config.spell_backward.max_word_len=4", "data.num_train=200"]


def test_an_unknown_task_exits_2_before_any_actor(tmp_path, model_cache):
    out = tmp_path / "runs"
    result = run(GRPO, "train", "data=reasoning_gym", "data.task=chain_sun", f"trainer.output_dir={out}",
                 f"model.cache_dir={model_cache}", "logger=none", timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no task 'chain_sun'" in lines[0] and "chain_sum" in lines[0]
    assert not out.exists()


def test_a_gym_mix_trains_evaluates_and_verifies(tmp_path, model_cache):
    overrides = small_overrides(model_cache, str(tmp_path)) + MIX + [
        "trainer.run_name=gym", "trainer.max_steps=2", "trainer.eval_every=0", "warmup.steps=10",
        "rollout.num_workers=1", "reward.num_workers=1", "learner.num_ranks=1"]
    trained = run(GRPO, "train", *overrides)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "gym" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 0.0 <= row["score/reasoning_gym"] <= 1.0 and row["reward_errors"] == 0
        # every batch of 8 prompts drawn 1:1 from two tasks holds both (chance 2 / 2^8 otherwise,
        # and the draw is seeded), each with a column of its own
        assert {"task_score/chain_sum", "task_score/spell_backward"} <= set(row)

    keep = [a for a in overrides if a.startswith(("model.cache_dir", "data", "+data", "rollout.", "reward.",
                                                  "logger"))]
    evaluated = run(GRPO, "eval", str(tmp_path / "gym" / "final_model"), *keep,
                    f"trainer.output_dir={tmp_path / 'evals'}", "trainer.run_name=e", "data.heldout_size=8")
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    summary = json.loads((tmp_path / "evals" / "e" / "eval_summary.json").read_text())
    assert summary["prompts"] == 8 and 0.0 <= summary["eval/greedy"] <= 1.0

    # grpo verify: a right, a wrong and a malformed answer to one row of each task
    from common.config import DataConfig
    from data.datasets import load_problems

    _, train = load_problems(DataConfig(source="reasoning_gym", tasks={"chain_sum": 1.0, "spell_backward": 1.0},
                                        task_config={"chain_sum": {"max_terms": 2, "max_digits": 1}},
                                        num_train=20, heldout_size=1), 0)
    picked = [next(p for p in train if p.fields["task"] == task) for task in ("chain_sum", "spell_backward")]
    lines = []
    for p in picked:
        for completion in (p.solution, "<think></think><answer>zzz</answer>", "no answer at all"):
            lines.append({"prompt": p.prompt, "completion": completion, "answer": p.answer, **p.fields})
    source, scored = tmp_path / "rows.jsonl", tmp_path / "scored.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in lines))
    verified = run(GRPO, "verify", "--verifiers", "reasoning_gym", "--input", str(source), "--output", str(scored),
                   "reward.num_workers=1", timeout=300)
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-3000:]
    scores = [json.loads(line)["scores"]["reasoning_gym"] for line in scored.read_text().splitlines()]
    assert scores == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
