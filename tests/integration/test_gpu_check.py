"""bench/gpu_check.py --dry-run, as a user runs it: the GPU check's code (the real LearnerRank
under ZeRO-2 and ZeRO-3 over gloo, the chunked log-probs, the bucket packing) at toy sizes on
the CPU, so that the script a GPU session runs cannot rot between GPU sessions."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = str(Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py")


def test_the_gpu_check_dry_run_runs_every_stage_and_says_what_it_cannot_check(tmp_path):
    result = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--cache", str(tmp_path)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stages = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert not [s for s in stages if "failed" in s], result.stdout[-3000:]
    logprobs = next(s for s in stages if "max_abs_diff_logprob" in s)
    assert logprobs["max_abs_diff_logprob"] < 1e-4 and logprobs["max_abs_diff_grad"] < 1e-4
    learners = {s["zero_stage"]: s for s in stages if "zero_stage" in s}
    assert set(learners) == {2, 3}
    for stage in learners.values():
        runs = {r["run"]: r for r in stage["runs"]}
        assert not [r for r in runs.values() if "error" in r], runs
        # The token budget cuts the batch into micro-batches; without one the half batch is one.
        assert runs["full batch, budget"]["micro_batches"] > runs["half batch, budget"]["micro_batches"] > 1
        assert runs["half batch, no budget"]["micro_batches"] == 1
        assert stage["pack_bytes"] > 0
    assert "Checked on one GPU:" in result.stdout and "Not checked on one GPU:" in result.stdout
    assert "needs two GPUs" in result.stdout


def test_the_gpu_check_lists_what_it_covers_without_running():
    result = subprocess.run([sys.executable, SCRIPT, "--list"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    checked, not_checked = result.stdout.split("Not checked on one GPU:")
    assert checked.count("\n- ") >= 3 and not_checked.count("\n- ") >= 3
