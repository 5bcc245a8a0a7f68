"""bench/gpu_check.py --dry-run, as a user runs it: the GPU check's code (the learner's log-prob
call at a toy vocabulary against a float32 log-softmax, the real LearnerRank under ZeRO-2 and
ZeRO-3 over gloo, the WeightSender's join probe and push) at toy sizes on the CPU, so that the
script a GPU session runs cannot rot between GPU sessions; and its limits, which must fail the
script when a figure passes them (a synthetic figure, `--inject`) or a stage runs out of memory."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu_check")
    output = folder / "gpu_check.json"
    result = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--cache", str(folder), "--output", str(output)],
                            capture_output=True, text=True, timeout=600)
    return result, output


def test_the_gpu_check_dry_run_runs_every_stage_within_its_limits(dry_run):
    result, output = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PASSED: every figure within its limit" in result.stdout
    results = json.loads(output.read_text())["results"]
    assert not [k for k, s in results.items() if "failed" in s], result.stdout[-3000:]
    logprobs = results["logprobs"]
    assert logprobs["max_abs_diff_logprob"] <= 2.0 ** -16 * (logprobs["max_abs_logit"] + logprobs["log_vocab"])
    assert logprobs["logit_positions"] < logprobs["tokens"]  # the head skipped the prompts
    assert {results["zero2"]["zero_stage"], results["zero3"]["zero_stage"]} == {2, 3}
    for key in ("zero2", "zero3"):
        stage = results[key]
        runs = {r["run"]: r for r in stage["runs"]}
        assert not [r for r in runs.values() if "error" in r], runs
        # The token budget cuts the batch into micro-batches; without one the half batch is one.
        assert runs["full batch, budget"]["micro_batches"] > runs["half batch, budget"]["micro_batches"] > 1
        assert runs["half batch, no budget"]["micro_batches"] == 1 and not stage["behaviour_failed"]
        assert stage["push"]["backend"] == "gloo" and stage["push"]["bytes"] > 0  # the sender's own path
    assert "Checked on one GPU:" in result.stdout and "Not checked on one GPU:" in result.stdout
    assert "needs two GPUs" in result.stdout


@pytest.mark.parametrize("figure", ["logprobs.max_abs_diff_logprob=1", "logprobs.max_rel_diff_grad=0.5"])
def test_a_figure_past_its_limit_fails_the_check(dry_run, figure):
    _, output = dry_run
    result = subprocess.run([sys.executable, SCRIPT, "--recheck", str(output), "--inject", figure],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and f"{figure.split('=')[0]} = " in result.stdout and "past its limit" in result.stdout
    clean = subprocess.run([sys.executable, SCRIPT, "--recheck", str(output)], capture_output=True, text=True,
                           timeout=120)
    assert clean.returncode == 0, clean.stdout


def test_memory_past_the_plan_on_a_gpu_and_an_out_of_memory_run_fail_the_check(dry_run, tmp_path):
    _, output = dry_run
    saved = json.loads(output.read_text())
    saved["results"]["zero2"]["on_gpu"] = True  # memory limits apply on GPUs only
    path = tmp_path / "on_gpu.json"
    path.write_text(json.dumps(saved))
    result = subprocess.run([sys.executable, SCRIPT, "--recheck", str(path), "--inject", "learner.peak_over_plan=1.6"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "learner.peak_over_plan (full batch, budget) = 1.6" in result.stdout
    saved["results"]["zero3"]["runs"][0]["error"] = "out of memory: CUDA out of memory. Tried to allocate 4.98 GiB"
    path.write_text(json.dumps(saved))
    result = subprocess.run([sys.executable, SCRIPT, "--recheck", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "zero3 full batch, budget: out of memory" in result.stdout


def test_the_gpu_check_lists_what_it_covers_without_running():
    result = subprocess.run([sys.executable, SCRIPT, "--list"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    checked, not_checked = result.stdout.split("Not checked on one GPU:")
    assert checked.count("\n- ") >= 3 and not_checked.count("\n- ") >= 3
