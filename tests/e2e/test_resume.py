"""Checkpoint and resume, exactly: a run stopped, killed or short of a rank matches a straight run.

Real `grpo train` processes (each its own Ray, vLLM, DeepSpeed), N=4 steps of 8 of the 16
training prompts: a straight run; the same run stopped by SIGTERM after its first step, then
resumed with `trainer.resume=auto` while a learner rank is SIGKILLed mid-update (the resumed
run rebuilds the learner by itself); and the same pair of straight and interrupted runs in
async mode. Every metrics.jsonl line must be equal except wall-clock timings, and so must
samples.jsonl and the final weights.

The faults come from outside, as a cluster loses processes: this test finds a learner rank's
process in the run's own Ray session (its worker logs name each actor process by pid, and a
rank by its repr) and SIGKILLs it, or SIGKILLs the driver; it reads what Ray holds from the
same session's logs.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from cluster.loop.checkpoint import complete_checkpoints
from cluster.loop.samples import read as read_samples
from helpers import small_overrides
from helpers import GRPO, run


STEPS = 4
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


def _logged(metrics: Path) -> list:
    """The steps metrics.jsonl holds now (a line still being written left out)."""
    steps = []
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:
            pass
    return steps


def _wait_for(condition, proc, what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.05)


def _ray_logs(proc) -> Path:
    """The logs folder of the Ray that the `grpo train` process `proc` started: Ray names its
    session folder after the pid of the process that started it."""
    pattern = f"{tempfile.gettempdir()}/ray/session_*_{proc.pid}/logs"
    started = psutil.Process(proc.pid).create_time()

    def sessions():  # an older process of the same pid may have left one
        return [p for p in glob.glob(pattern) if os.path.getmtime(p) >= started - 1]

    _wait_for(sessions, proc, f"the run's Ray session ({pattern})")
    return Path(sessions()[0])


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _actors(logs: Path) -> list:
    """(name, pid) of every actor process of the run's Ray: each worker's log file is named by
    its pid and holds the actor's name (":actor_name:", its repr once it started)."""
    found = []
    for out in logs.glob("worker-*.out"):
        names = re.findall(r"^:actor_name:(.+)$", out.read_text(errors="replace"), re.M)
        if names:
            found.append((names[-1], int(out.stem.rsplit("-", 1)[1])))
    return found


def _kill_rank_mid_update(proc, logs: Path, rank: int = 1) -> None:
    """SIGKILL learner rank `rank`'s process once it runs its next update (Ray titles an actor's
    process by the method it runs), as a lost process ends it."""
    pids: list = []
    _wait_for(lambda: pids.extend(pid for name, pid in _actors(logs)
                                  if name == f"LearnerRank(rank={rank})" and _alive(pid)) or pids,
              proc, f"a live learner rank {rank}")
    victim = psutil.Process(pids[0])
    _wait_for(lambda: (victim.cmdline() or [""])[0].startswith("ray::LearnerRank.train_step"), proc,
              f"an update on learner rank {rank}")
    os.kill(victim.pid, signal.SIGKILL)


def _census(logs: Path) -> dict:
    """What the run's Ray holds, from its session's logs: placement groups by name and state
    (the GCS logs each one's registration, creation and removal) and actors by class and state
    (alive while its process is)."""
    groups: dict = {}
    for line in (logs / "gcs_server.out").read_text(errors="replace").splitlines():
        registered = re.search(r"Registering placement group, placement group id = (\w+), name = ([^,]*),", line)
        created = re.search(r"Successfully created placement group .*, id: (\w+)", line)
        removed = (re.search(r"Placement group of an id, (\w+) is removed successfully", line)
                   or re.search(r"Removed placement group because its job finished\. placement_group_id=(\w+)", line))
        if registered:
            groups[registered[1]] = [registered[2], "PENDING"]
        elif created or removed:
            groups[(created or removed)[1]][1] = "CREATED" if created else "REMOVED"
    actors = [[name.split("(")[0], "ALIVE" if _alive(pid) else "DEAD"] for name, pid in _actors(logs)]
    return {"placement_groups": list(groups.values()), "actors": actors}


def _watched(args: list, faults) -> tuple:
    """`grpo train args` while `faults(proc, stdout_lines)` acts on it from outside; its output
    captured as `run` captures it, and what `faults` returned."""
    proc = subprocess.Popen([GRPO, "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list = []
    err: list = []
    readers = [threading.Thread(target=sink.extend, args=(stream,), daemon=True)
               for stream, sink in ((proc.stdout, out), (proc.stderr, err))]
    for reader in readers:
        reader.start()
    try:
        found = faults(proc, out)
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    for reader in readers:
        reader.join(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(out), "".join(err)), found


@pytest.fixture(scope="module")
def runs(model_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    straight = run(GRPO, "train", *_args(model_cache, out, "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    return out, straight


def _assert_same_weights(run_a, run_b):
    a, b = _weights(run_a / "final_model"), _weights(run_b / "final_model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _assert_each_sample_once(run_dir, steps):
    samples = read_samples(run_dir)
    assert [s[0] for s in samples] == sorted(s[0] for s in samples)  # step by step
    assert {s[0] for s in samples} == set(range(1, steps + 1))
    assert len(samples) == len(set(samples)) == steps * 8 * 4  # 8 prompts x 4 samples a step


def test_only_the_newest_complete_checkpoints_are_kept_and_no_tmp_is_left(runs):
    out, _ = runs
    assert [p.name for p in complete_checkpoints(out / "straight")] == ["step-000003", "step-000004"]
    assert not list((out / "straight" / "checkpoints").glob(".tmp-*"))


def test_export_writes_a_folder_transformers_and_vllm_load_with_the_trained_weights(runs, tmp_path, ray_session,
                                                                                   system_cfg):
    out, _ = runs
    target = tmp_path / "exported"
    result = run(GRPO, "export", str(out / "straight" / "checkpoints" / f"step-{STEPS:06d}"), str(target))
    assert result.returncode == 0, result.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target)
    AutoTokenizer.from_pretrained(target)
    final = _weights(out / "straight" / "final_model")
    exported = model.state_dict()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    # vLLM loads it too, and generates from it

    import ray

    from common.messages import GenerationRequest
    from rollout.worker import GenerationWorker

    engine = ray.remote(num_cpus=0.1)(GenerationWorker).remote(str(target), system_cfg.rollout, 0)
    try:
        group, _report = ray.get(engine.generate.remote(GenerationRequest(0, "12+34=", "46", {}, 0), n=1, greedy=True))
        assert len(group.completion_ids[0]) > 0
    finally:
        ray.kill(engine)
    again = run(GRPO, "export", str(out / "straight" / "checkpoints" / f"step-{STEPS:06d}"), str(target))
    assert again.returncode == 2 and "not empty" in again.stderr
    half = tmp_path / ".tmp-step-000003"  # a checkpoint still being written
    (half / "learner").mkdir(parents=True)
    bad = run(GRPO, "export", str(half), str(tmp_path / "x"))
    assert bad.returncode == 2 and "not a complete checkpoint" in bad.stderr


# --------------------------------------------------------------------------- preemption, then a lost rank

@pytest.fixture(scope="module")
def preempted(runs, model_cache):
    """The straight run's settings without scheduled checkpoints (trainer.save_every=0), sent
    SIGTERM once its first step is logged; then `trainer.resume=auto` of it, past a planted
    half-written checkpoint and one without its trainer state, whose last learner rank is
    SIGKILLed during the last step's update (trainer.max_restarts at its default): the resumed
    run rebuilds the learner by itself from the SIGTERM checkpoint."""
    out = runs[0]
    args = [a for a in _args(model_cache, out, "preempted") if not a.startswith("trainer.save_every=")]
    args += ["trainer.save_every=0"]
    run_dir = out / "preempted"
    metrics = run_dir / "metrics.jsonl"
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
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    stopped.step = int(stopped.stderr.split("stopped by SIGTERM after step ")[1].split(",")[0])
    assert 1 <= stopped.step < STEPS, stopped.step
    # A half-written checkpoint and one without its trainer state must never be picked.
    checkpoints = run_dir / "checkpoints"
    (checkpoints / f".tmp-step-{stopped.step + 1:06d}" / "learner").mkdir(parents=True)
    shutil.copytree(checkpoints / f"step-{stopped.step:06d}", checkpoints / "step-000005")
    (checkpoints / "step-000005" / "trainer_state.json").unlink()

    def faults(proc, stdout):
        """Learner rank 1 lost during the last step's update; what Ray holds once the run has
        rebuilt its learner and trained a step with it."""
        logs = _ray_logs(proc)
        _wait_for(lambda: (_logged(metrics) or [0])[-1] >= STEPS - 1, proc, f"step {STEPS - 1} logged")
        _kill_rank_mid_update(proc, logs)
        _wait_for(lambda: any("learner rank" in line and " died " in line for line in stdout), proc,
                  "the learner's rebuild")
        _wait_for(lambda: (_logged(metrics) or [0])[-1] > stopped.step, proc, "a step of the rebuilt learner")
        return _census(logs)

    resumed, census = _watched([*args, "trainer.resume=auto"], faults)
    return run_dir, stopped, resumed, census


def test_sigterm_ends_the_step_checkpoints_it_and_exits_143_with_the_resume_line(preempted):
    run_dir, stopped, _, _ = preempted
    line = stopped.stderr.strip().splitlines()[-1]
    assert line == (f"grpo: stopped by SIGTERM after step {stopped.step}, checkpointed; everything the run started "
                    f"has been stopped. Its last checkpoint is "
                    f"{run_dir / 'checkpoints' / f'step-{stopped.step:06d}'}: continue with the same overrides "
                    f"plus trainer.run_name=preempted trainer.resume=auto")
    assert "Traceback" not in stopped.stderr
    assert stopped.logged == list(range(1, stopped.step + 1))  # it stopped at the step it checkpointed


def test_the_resumed_run_matches_the_straight_run_line_for_line(runs, preempted):
    out, _ = runs
    run_dir, stopped, resumed, _ = preempted
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{stopped.step:06d}'} (step {stopped.step}," \
        in resumed.stdout
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, STEPS + 1))  # each step once, none lost
    assert _metrics(run_dir) == _metrics(out / "straight")
    assert json.loads((run_dir / "summary.json").read_text())["heldout_accuracy_after"] == \
        json.loads((out / "straight" / "summary.json").read_text())["heldout_accuracy_after"]
    _assert_each_sample_once(run_dir, STEPS)
    assert read_samples(run_dir) == read_samples(out / "straight")  # exactly once, same order
    _assert_same_weights(out / "straight", run_dir)


def test_a_learner_rank_lost_mid_update_is_rebuilt_by_the_run_itself(preempted):
    run_dir, stopped, resumed, _ = preempted
    lines = [line for line in resumed.stdout.splitlines() if "learner rank" in line and " died " in line]
    assert len(lines) == 1, resumed.stdout[-3000:]
    assert f"step {STEPS}: learner rank 1 died" in lines[0] and "back in" in lines[0], lines[0]
    assert f"rebuilt from step-{stopped.step:06d}, going on from step {stopped.step + 1}" in lines[0], lines[0]
    assert json.loads((run_dir / "summary.json").read_text())["learner_restarts"] == 1


def test_a_rebuilt_learner_leaves_no_placement_group_or_rank_behind(preempted):
    census = preempted[3]
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
    metrics = out / "resumed" / "metrics.jsonl"

    def faults(proc, _stdout):
        """Learner rank 1 lost during step 3's update; the driver SIGKILLed (as a lost head node)
        once the rebuilt learner's step 3 is logged."""
        logs = _ray_logs(proc)
        _wait_for(lambda: 2 in _logged(metrics), proc, "step 2 logged")
        _kill_rank_mid_update(proc, logs)
        _wait_for(lambda: 3 in _logged(metrics), proc, "step 3 logged")
        proc.send_signal(signal.SIGKILL)

    killed, _ = _watched(args("resumed"), faults)
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


# --------------------------------------------------------------------------- streaming + partial resume

def test_streaming_partial_samples_stay_exactly_once_after_a_driver_sigkill(runs, model_cache, tmp_path):
    """Streaming with partial rollouts, two steps issued ahead and checkpoints every 2 steps: the
    driver SIGKILLed (as a lost head node) once step 3 is logged, while the engines carry the
    next steps' requests, then `trainer.resume=auto`. Streaming runs are not bit-exact repeats
    (how far a request got at a push depends on timing), but every sample is trained once:
    steps 1-2 as logged before the kill, 3-4 again from the checkpoint's saved batches: the same
    prompts and samples, step for step, as the straight sync run draws."""
    def args(*extra):
        return [a for a in _args(model_cache, tmp_path, "streamed") if not a.startswith("trainer.save_every=")] + [
            "trainer.mode=async", "rollout.streaming=true", "rollout.partial=true", "trainer.async_lookahead=2",
            "algo.max_staleness=2", "trainer.save_every=2",
            # One learner rank: what is compared with the straight run is which prompts and
            # samples each step trains, not the weights (ranks are the two tests above).
            "learner.num_ranks=1", *extra]

    metrics = tmp_path / "streamed" / "metrics.jsonl"

    def faults(proc, _stdout):
        _wait_for(lambda: 3 in _logged(metrics), proc, "step 3 logged")
        proc.send_signal(signal.SIGKILL)

    killed, _ = _watched(args(), faults)
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-3000:])
    resumed = run(GRPO, "train", *args("trainer.resume=auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'streamed' / 'checkpoints' / 'step-000002'}" in resumed.stdout
    assert [r["step"] for r in _metrics(tmp_path / "streamed")] == list(range(1, STEPS + 1))
    _assert_each_sample_once(tmp_path / "streamed", STEPS)
    assert [s[:3] for s in read_samples(tmp_path / "streamed")] == [s[:3] for s in read_samples(runs[0] / "straight")]
    rows = _metrics(tmp_path / "streamed")
    assert all(r["staleness_max"] <= 2 and 0 < r.get("slot_occupancy", 1) <= 1 for r in rows)
    assert sum(r["engine_steps"] for r in rows) > 0
