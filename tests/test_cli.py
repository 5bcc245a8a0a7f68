"""Smoke runs of the entry points, as a user types them: `grpo train ...` and `python -m cluster.train`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import small_overrides

GRPO = str(Path(sys.executable).parent / "grpo")


def run(*args: str, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_cfg_prints_composed_config_and_exits_0():
    result = run(GRPO, "train", "--cfg", "algo.beta=0.1", "logger=none")
    assert result.returncode == 0, result.stderr
    assert "beta: 0.1" in result.stdout
    assert "backend: none" in result.stdout
    same = run(sys.executable, "-m", "cluster.train", "--cfg", "algo.beta=0.1", "logger=none")
    assert same.returncode == 0 and same.stdout == result.stdout


def test_bad_command_line_exits_2_with_one_line():
    result = run(GRPO, "trian")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "trian" in result.stderr


@pytest.mark.parametrize("override, names", [
    ("trainer.max_step=3", ["trainer.max_step", "trainer.max_steps"]),
    ("trainer.max_steps=abc", ["trainer.max_steps"]),
    ("algo.group_size=1", ["algo.group_size"]),
    ("trainer.prompts_per_step=63", ["trainer.prompts_per_step", "learner.num_ranks"]),
    ("model.path=/no/such/model", ["model.path"]),
])
def test_bad_config_exits_2_with_one_line(override, names, tmp_path):
    result = run(GRPO, "train", override, f"trainer.output_dir={tmp_path}")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for name in names:
        assert name in lines[0]
    assert not any(tmp_path.iterdir()), "a bad config must fail before anything is produced"


def test_more_resources_than_the_cluster_exits_2(tmp_path, model_cache):
    result = run(GRPO, "train", "rollout.num_workers=9", "ray.num_cpus=2", f"model.cache_dir={model_cache}",
                 f"trainer.output_dir={tmp_path}", "logger=none")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "CPU" in lines[0] and "rollout" in lines[0], result.stderr
    assert not any(tmp_path.iterdir())


def test_bad_data_row_exits_2_naming_the_line(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    result = run(GRPO, "train", "data=jsonl", f"data.path={rows}", f"trainer.output_dir={tmp_path / 'runs'}")
    assert result.returncode == 2
    assert "line 2" in result.stderr and "answer" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_few_step_run_writes_every_artifact(model_cache, tmp_path):
    """The default job's code path end to end, with a tiny budget and wandb offline."""
    args = small_overrides(model_cache, str(tmp_path)) + [
        "logger=wandb", "trainer.max_steps=2", "trainer.run_name=smoke",
    ]
    result = run(GRPO, "train", *args, env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "smoke"
    assert "held-out greedy accuracy" in result.stdout and str(run_dir) in result.stdout

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    warmed = 20 // 10  # warm-up pushes: one per probe, every warmup.check_every steps
    assert [r["policy_version"] for r in rows] == [warmed + 1, warmed + 2]
    for row in rows:
        for key in ("reward_mean", "reward_std", "accuracy", "kl", "clip_fraction",
                    "response_length_mean", "time_generate", "time_reward", "time_train",
                    "time_weight_sync", "time_step"):
            assert isinstance(row[key], float), key

    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("heldout_accuracy_before", "heldout_accuracy_after"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["wall_minutes"] > 0
    assert (run_dir / "report.png").stat().st_size > 10_000
    resolved = (run_dir / "config.yaml").read_text()
    assert "max_steps: 2" in resolved and model_cache in resolved  # overrides and the built model path
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run was written"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final_model")
    ids = tokenizer("12+34=", return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape[-1] == model.config.vocab_size
