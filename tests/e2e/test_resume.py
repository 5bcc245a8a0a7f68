"""Checkpoint and resume, exactly: a run killed after k steps and resumed matches a straight run.

Three real `grpo train` processes (each its own Ray, vLLM, DeepSpeed): straight to N=4 steps;
the same run, checkpointed, loses a learner rank (killed) right after step 2 (which ends an epoch
of the 16 training prompts, 8 per step): it stops with a message that says how to go on; then
`trainer.resume=auto` continues it to 4. Every metrics.jsonl line must be equal except
wall-clock timings, and so must the final weights.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time

import pytest
import torch

from cluster.checkpoint import complete_checkpoints
from cluster.samples import read as read_samples
from helpers import small_overrides
from helpers import GRPO, run


STEPS = 4
KILL_AFTER = 2  # 16 training prompts, 8 per step: step 2 ends the first epoch
# Wall-clock timings and memory readings vary between any two runs; everything else must not.
TIMING = ("time_", "learner_seconds", "sync_seconds", "sync_gbps", "sync_load_seconds", "sync_pack_seconds",
          "sync_wait_seconds", "learner_peak_memory_mb",
          "tokens_per_s", "generate_tokens_per_s", "wall_seconds")


def _args(model_cache, out, name, *extra):
    return small_overrides(model_cache, str(out)) + [
        f"trainer.run_name={name}", f"trainer.max_steps={STEPS}", "trainer.save_every=1",
        "trainer.keep_checkpoints=2", "data.num_train=16", "warmup.batch_size=16", "trainer.eval_every=2",
        "rollout.num_workers=1", "reward.num_workers=1",
        # A verifier timeout depends on the machine's load, not on the run: at 5 s one slow answer
        # of the barely trained model timed out in one run of a busy suite and not in the other.
        "reward.timeout_s=60", *extra]


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(model_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    straight = run(GRPO, "train", *_args(model_cache, out, "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]

    # trainer.max_restarts=0: the run stops at the loss instead of rebuilding the learner itself.
    killed = run(GRPO, "train", *_args(model_cache, out, "resumed", "trainer.max_restarts=0"),
                 env={"GRPO_FAULT": f"learner@{KILL_AFTER}"})
    assert killed.returncode == 1, (killed.returncode, killed.stderr[-3000:])
    checkpoints = out / "resumed" / "checkpoints"
    message = killed.stderr.strip().splitlines()[-1]
    assert "learner rank died" in message and f"step {KILL_AFTER + 1}" in message, message
    assert "trainer.resume=auto" in message and str(checkpoints / f"step-{KILL_AFTER:06d}") in message, message
    assert [p.name for p in complete_checkpoints(out / "resumed")] == ["step-000001", "step-000002"]
    assert len(_metrics(out / "resumed")) == KILL_AFTER
    # A half-written checkpoint and one without its trainer state must never be picked.
    (checkpoints / ".tmp-step-000003" / "learner").mkdir(parents=True)
    shutil.copytree(checkpoints / f"step-{KILL_AFTER:06d}", checkpoints / "step-000005")
    (checkpoints / "step-000005" / "trainer_state.json").unlink()

    resumed = run(GRPO, "train", *_args(model_cache, out, "resumed", "trainer.resume=auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return out, killed, resumed


def test_resumed_run_matches_the_straight_run_line_for_line(runs):
    out, _, resumed = runs
    assert f"resumed from {out / 'resumed' / 'checkpoints' / f'step-{KILL_AFTER:06d}'}" in resumed.stdout
    straight, again = _metrics(out / "straight"), _metrics(out / "resumed")
    assert [r["step"] for r in again] == list(range(1, STEPS + 1))
    assert again == straight
    assert json.loads((out / "resumed" / "summary.json").read_text())["heldout_accuracy_after"] == \
        json.loads((out / "straight" / "summary.json").read_text())["heldout_accuracy_after"]
    _assert_same_weights(out / "straight", out / "resumed")
    assert read_samples(out / "resumed") == read_samples(out / "straight")  # exactly once, same order


def _assert_same_weights(run_a, run_b):
    a, b = _weights(run_a / "final_model"), _weights(run_b / "final_model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _assert_each_sample_once(run_dir, steps):
    samples = read_samples(run_dir)
    assert [s[0] for s in samples] == sorted(s[0] for s in samples)  # step by step
    assert {s[0] for s in samples} == set(range(1, steps + 1))
    assert len(samples) == len(set(samples)) == steps * 8 * 4  # 8 prompts x 4 samples a step


def test_only_the_newest_complete_checkpoints_are_kept_and_no_tmp_is_left(runs):
    out, _, _ = runs
    assert [p.name for p in complete_checkpoints(out / "resumed")] == ["step-000003", "step-000004"]
    assert not list((out / "resumed" / "checkpoints").glob(".tmp-*"))


def test_export_writes_a_folder_transformers_and_vllm_load_with_the_trained_weights(runs, tmp_path, ray_session,
                                                                                   system_cfg):
    out, _, _ = runs
    target = tmp_path / "exported"
    result = run(GRPO, "export", str(out / "resumed" / "checkpoints" / f"step-{STEPS:06d}"), str(target))
    assert result.returncode == 0, result.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target)
    AutoTokenizer.from_pretrained(target)
    final = _weights(out / "resumed" / "final_model")
    exported = model.state_dict()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    # vLLM loads it too, and generates from it

    import ray

    from rollout.worker import GenerationWorker

    engine = ray.remote(num_cpus=0.1)(GenerationWorker).remote(str(target), system_cfg.rollout, 0)
    try:
        group, _stats = ray.get(engine.generate.remote((0, "12+34=", "46", {}), n=1, greedy=True, seeds=[0]))
        assert len(group.completion_ids[0]) > 0
    finally:
        ray.kill(engine)
    again = run(GRPO, "export", str(out / "resumed" / "checkpoints" / f"step-{STEPS:06d}"), str(target))
    assert again.returncode == 2 and "not empty" in again.stderr
    bad = run(GRPO, "export", str(out / "resumed" / "checkpoints" / ".tmp-step-000003"), str(tmp_path / "x"))
    assert bad.returncode == 2 and "not a complete checkpoint" in bad.stderr


# --------------------------------------------------------------------------- preemption

PREEMPT_STEPS = 6


@pytest.fixture(scope="module")
def preempted(model_cache, tmp_path_factory):
    """A run without scheduled checkpoints (trainer.save_every=0) that gets SIGTERM once its
    first step is logged, then `trainer.resume=auto` of it."""
    out = tmp_path_factory.mktemp("preempt")
    args = [a for a in _args(model_cache, out, "preempted") if not a.startswith(("trainer.save_every=",
                                                                                  "trainer.max_steps="))]
    args += ["trainer.save_every=0", f"trainer.max_steps={PREEMPT_STEPS}"]
    metrics = out / "preempted" / "metrics.jsonl"
    proc = subprocess.Popen([GRPO, "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline and not (
                metrics.exists() and metrics.read_text().count("\n") >= 1):
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    stopped.logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    resumed = run(GRPO, "train", *args, "trainer.resume=auto")
    return out / "preempted", stopped, resumed


def test_sigterm_ends_the_step_checkpoints_it_and_exits_143_with_the_resume_line(preempted):
    run_dir, stopped, _ = preempted
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The resumed run rewrote metrics.jsonl: the stopped run's steps are what the resume line names.
    line = stopped.stderr.strip().splitlines()[-1]
    step = int(line.split("stopped by SIGTERM after step ")[1].split(",")[0])
    assert 1 <= step < PREEMPT_STEPS
    assert line == (f"grpo: stopped by SIGTERM after step {step}, checkpointed; everything the run started has "
                    f"been stopped. Its last checkpoint is {run_dir / 'checkpoints' / f'step-{step:06d}'}: "
                    f"continue with the same overrides plus trainer.run_name=preempted trainer.resume=auto")
    assert "Traceback" not in stopped.stderr
    assert stopped.logged == list(range(1, step + 1))  # it stopped at the step it checkpointed
    assert logged == list(range(1, PREEMPT_STEPS + 1))


def test_resume_after_sigterm_continues_with_no_step_logged_twice(preempted):
    run_dir, stopped, resumed = preempted
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    step = int(stopped.stderr.split("stopped by SIGTERM after step ")[1].split(",")[0])
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{step:06d}'} (step {step}," in resumed.stdout
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, PREEMPT_STEPS + 1))  # each step once, none lost
    _assert_each_sample_once(run_dir, PREEMPT_STEPS)


# --------------------------------------------------------------------------- learner recovery

LOST_IN = 3  # the update of step 3: the newest checkpoint is step 2's


@pytest.fixture(scope="module")
def recovered(runs, model_cache):
    """The straight run's settings with its last learner rank SIGKILLed during step 3's update
    (trainer.max_restarts at its default): the run rebuilds the learner by itself."""
    out = runs[0]
    census = out / "census.json"
    result = run(GRPO, "train", *_args(model_cache, out, "recovered"),
                 env={"GRPO_FAULT": f"learner-update@{LOST_IN},census@{STEPS}", "GRPO_CENSUS_FILE": str(census)})
    return out, result, json.loads(census.read_text())


def test_a_learner_rank_lost_mid_update_is_rebuilt_and_the_run_equals_the_straight_one(recovered):
    out, result, _ = recovered
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "learner rank" in line and " died " in line]
    assert len(lines) == 1, result.stdout[-3000:]
    assert f"step {LOST_IN}: learner rank 1 died" in lines[0] and "back in" in lines[0], lines[0]
    assert f"rebuilt from step-{LOST_IN - 1:06d}, going on from step {LOST_IN}" in lines[0], lines[0]
    assert [r["step"] for r in _metrics(out / "recovered")] == list(range(1, STEPS + 1))
    assert _metrics(out / "recovered") == _metrics(out / "straight")
    assert read_samples(out / "recovered") == read_samples(out / "straight")
    _assert_same_weights(out / "straight", out / "recovered")
    assert json.loads((out / "recovered" / "summary.json").read_text())["learner_restarts"] == 1


def test_a_rebuilt_learner_leaves_no_placement_group_or_rank_behind(recovered):
    _, _, census = recovered
    learner_groups = [state for name, state in census["placement_groups"] if name == "grpo-learner"]
    assert sorted(learner_groups) == ["CREATED", "REMOVED"]
    assert all(state in ("CREATED", "REMOVED") for _, state in census["placement_groups"])
    assert sorted(state for name, state in census["actors"] if name == "LearnerRank") == \
        ["ALIVE", "ALIVE", "DEAD", "DEAD"]


# --------------------------------------------------------------------------- async resume

@pytest.fixture(scope="module")
def async_runs(model_cache, tmp_path_factory):
    """Async mode, checkpointed every 2 steps: straight, and a run whose learner loses a rank
    during step 3's update (rebuilt from step 2, with step 3's batch made ahead by the weights
    of step 1) and whose driver is then SIGKILLed after step 3, resumed with trainer.resume=auto."""
    out = tmp_path_factory.mktemp("async")

    def args(name, *extra):
        return [a for a in _args(model_cache, out, name) if not a.startswith("trainer.save_every=")] + [
            "trainer.mode=async", "trainer.save_every=2", *extra]

    straight = run(GRPO, "train", *args("straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = run(GRPO, "train", *args("resumed"), env={"GRPO_FAULT": "learner-update@3,driver@3"})
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-3000:])
    resumed = run(GRPO, "train", *args("resumed", "trainer.resume=auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return out, killed, resumed


def test_async_resume_trains_the_saved_ahead_batch_sample_for_sample(async_runs):
    out, killed, resumed = async_runs
    assert "step 3: learner rank 1 died" in killed.stdout, killed.stdout[-3000:]
    assert f"resumed from {out / 'resumed' / 'checkpoints' / 'step-000002'}" in resumed.stdout
    straight = read_samples(out / "straight")
    # Step 3 trains what the weights before step 2's update made, one version older than the
    # checkpoint of step 2 holds: a resume that made it again would train other samples.
    version_after = {row["step"]: row["policy_version"] for row in _metrics(out / "straight")}
    assert {s[3] for s in straight if s[0] == 3} == {version_after[3] - 2}
    assert read_samples(out / "resumed") == straight
    assert _metrics(out / "resumed") == _metrics(out / "straight")
    _assert_same_weights(out / "straight", out / "resumed")
