"""The Python trainer end to end: the worked example (examples/train_from_python.py: a list of
dicts, a lambda reward) trains two steps from a script, logging to TensorBoard and MLflow, and its
run equals `grpo train`'s with the same overrides (the lambda's body there as module:function):
the same metrics for the same seed. The dashboards, read back with their own readers, hold every
metric of metrics.jsonl. One pair of runs serves every test here."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import GRPO, run, small_overrides

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
# Wall-clock timings and memory readings vary between any two runs; everything else must not.
TIMING = ("time_", "learner_seconds", "sync_seconds", "sync_gbps", "sync_load_seconds", "sync_pack_seconds",
          "sync_wait_seconds", "learner_peak_memory_mb", "tokens_per_s", "generate_tokens_per_s", "wall_seconds")
# The example's lambda, as a module a command line names (examples/train_from_python.py: SHORT = 60).
SHORT_REWARD = "def short(completions, **_):\n    return [float(len(c) <= 60) for c in completions]\n"


def _metrics(run_dir: Path) -> list:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]


@pytest.fixture(scope="module")
def runs(model_cache, tmp_path_factory):
    """(the script's run folder, the command line's run folder)."""
    out = tmp_path_factory.mktemp("python-trainer")
    common = [o for o in small_overrides(model_cache, str(out)) if not o.startswith("logger=")]
    # One engine, verifier and learner rank: the two entry points, not the pools, are compared.
    common += [f"trainer.max_steps={STEPS}", "trainer.eval_every=1", "eval.n=2", "rollout.num_workers=1",
               "reward.num_workers=1", "learner.num_ranks=1"]
    script = run(sys.executable, str(ROOT / "examples" / "train_from_python.py"), *common,
                 "trainer.run_name=script", "logger=[tensorboard,mlflow]")
    assert script.returncode == 0, script.stdout[-3000:] + script.stderr[-3000:]
    assert "grpo: warning" not in script.stderr, script.stderr[-3000:]  # every dashboard took every call
    data = OmegaConf.load(out / "script" / "config.yaml").data  # the files the trainer wrote the rows to
    (out / "short_reward.py").write_text(SHORT_REWARD)
    # From the folder that holds the reward's module, as a user runs it (verifiers import from there).
    command = subprocess.run([GRPO, "train", *common, "trainer.run_name=command", "logger=none", "data=jsonl",
                              f"data.path={data.path}", f"data.eval_path={data.eval_path}",
                              "+reward.custom.short=short_reward:short", "reward.verifiers=[math,short]",
                              "+reward.weights.short=0.1"], cwd=out, capture_output=True, text=True, timeout=900)
    assert command.returncode == 0, command.stdout[-3000:] + command.stderr[-3000:]
    return out / "script", out / "command"


def test_the_script_trains_like_grpo_train(runs):
    script, command = runs
    rows = _metrics(script)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all("score/short" in r and "eval/pass@2" in r for r in rows)  # the lambda scored every step
    assert rows == _metrics(command)
    summaries = [json.loads((d / "summary.json").read_text()) for d in runs]
    assert summaries[0]["heldout_accuracy_after"] == summaries[1]["heldout_accuracy_after"]


def test_tensorboard_holds_every_metric(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    script = runs[0]
    events = EventAccumulator(str(script / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    for row in (json.loads(line) for line in (script / "metrics.jsonl").read_text().splitlines()):
        for key, value in row.items():
            if isinstance(value, (int, float)):
                logged = {e.step: e.value for e in events.Scalars(key)}
                assert logged[row["step"]] == pytest.approx(value, rel=1e-6, abs=1e-30), key
    summary = json.loads((script / "summary.json").read_text())
    tags = set(events.Tags()["scalars"])
    assert {f"summary/{k}" for k, v in summary.items() if isinstance(v, (int, float))} <= tags
    assert "config" in events.Tags()["tensors"][0]


def test_mlflow_holds_every_metric_and_the_run_files(runs, monkeypatch):
    from mlflow.tracking import MlflowClient

    from cluster.loop.dashboards import mlflow_key

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when told to
    script = runs[0]
    client = MlflowClient(tracking_uri=(script / "mlruns").as_uri())
    run_id = (script / "mlflow_run_id").read_text()
    for row in (json.loads(line) for line in (script / "metrics.jsonl").read_text().splitlines()):
        for key, value in row.items():
            if isinstance(value, (int, float)):
                history = {m.step: m.value for m in client.get_metric_history(run_id, mlflow_key(key))}
                assert history[row["step"]] == pytest.approx(value, rel=1e-12, abs=1e-300), key
    mlflow_run = client.get_run(run_id)
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["trainer.max_steps"] == str(STEPS)
    assert mlflow_run.data.params["reward.verifiers"] == "['math', 'short']"
    assert {a.path for a in client.list_artifacts(run_id)} == {"config.yaml", "summary.json", "report.png"}
