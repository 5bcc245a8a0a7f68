"""`grpo submit` / `grpo jobs` against a real Ray head started here (`ray start --head`), with
token authentication on and the dashboard on 127.0.0.1: a few-step job runs to SUCCEEDED and
writes every artifact (metrics with every key a user watches, report, model, offline wandb run);
another is stopped while running and leaves no actor behind; without the token the head refuses."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from common.ray_utils import free_port
from helpers import small_overrides


BIN = Path(sys.executable).parent
GRPO, RAY = str(BIN / "grpo"), str(BIN / "ray")


@pytest.fixture(scope="module")
def head():
    """A Ray head of its own (not the tests' shared local Ray), stopped by its process group
    (`ray stop` would stop every Ray on the machine)."""
    token = secrets.token_hex(32)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
           # The cluster's environment is this one: its `python` has the package.
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    # Short: Ray's sockets live under it and AF_UNIX paths stop at 107 bytes (pytest-xdist's
    # base temp, /tmp/pytest-of-USER/pytest-N/popen-gwK/..., plus Ray's session folder is longer).
    temp = Path(tempfile.mkdtemp(prefix="rayhead-", dir="/tmp"))
    # Every port of its own: the defaults (client server 10001, dashboard agent 52365, ...)
    # are taken when another Ray runs on the machine (the other test worker's).
    ports = {name: free_port() for name in (
        "port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
        "node-manager-port", "object-manager-port")}
    log = temp / "ray_start.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--dashboard-host=127.0.0.1", "--num-cpus=8", f"--temp-dir={temp}",
             "--disable-usage-stats", *(f"--{name}={port}" for name, port in ports.items())],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{ports['dashboard-port']}"
    # Until the dashboard answers (pytest's timeout bounds the wait).
    while subprocess.run([GRPO, "jobs", "status", "probe", "--address", address], env=env,
                         capture_output=True, text=True).stderr.find("Failed to connect") >= 0:
        assert proc.poll() is None, f"ray start --head exited {proc.returncode}: {log.read_text()[-3000:]}"
        time.sleep(2)
    yield address, env
    # SIGTERM to `ray start` alone: it drains the node and stops its processes (about 3 s).
    # Sent to the whole group it also hits the GCS, which `ray start` then waits 30 s for.
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
    except ProcessLookupError:
        pass
    shutil.rmtree(temp, ignore_errors=True)


def _job_overrides(model_cache: str, out: Path, steps: int) -> list:
    return [*small_overrides(model_cache, str(out)), f"trainer.max_steps={steps}", "warmup.steps=0",
            "rollout.num_workers=1", "reward.num_workers=1", "learner.num_ranks=1", "trainer.run_name=job"]


def _alive_actors(address: str, env: dict, ray_job_id: str) -> list:
    out = subprocess.run([RAY, "list", "actors", "--address", address, "--format", "json", "--filter", "state=ALIVE",
                          "--limit", "1000"], env=env, capture_output=True, text=True, check=True).stdout.strip()
    actors = json.loads(out) if out.startswith("[") else []  # "No resource in the cluster" when none
    return [a for a in actors if a.get("job_id") == ray_job_id]


def test_submitted_job_succeeds_and_writes_every_artifact(head, model_cache, tmp_path):
    address, env = head
    result = subprocess.run([GRPO, "submit", "--address", address, *_job_overrides(model_cache, tmp_path, 2),
                             "logger=wandb"], env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.splitlines()[0].startswith("submitted job ")
    assert "SUCCEEDED" in result.stdout.splitlines()[-1]
    assert "held-out greedy accuracy" in result.stdout  # the job's own output came back through its logs
    run_dir = tmp_path / "job"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward_mean", "accuracy", "kl", "clip_fraction", "entropy", "ratio_mean", "advantage_abs_mean",
                "response_length_mean", "truncated_fraction", "lr", "grad_norm", "time_generate", "time_reward",
                "time_train", "time_weight_sync", "time_step", "tokens_per_s", "sync_gbps", "buffer_groups",
                "staleness_max", "actor_restarts", "reward_timeouts", "score/math", "score/format"):
        assert all(key in r for r in rows), key
    for name in ("config.yaml", "summary.json", "report.png", "final_model/config.json", "wandb_id"):
        assert (run_dir / name).exists(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    shares = summary["heldout_accuracy_after"] * summary["heldout_size"]
    assert shares == pytest.approx(round(shares)) and summary["policy_version"] == 2  # a share of the problems
    resolved = (run_dir / "config.yaml").read_text()
    assert "max_steps: 2" in resolved and model_cache in resolved  # overrides and the built model path
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run"


def test_stopped_job_ends_and_leaves_no_actors(head, model_cache, tmp_path):
    from ray.job_submission import JobSubmissionClient

    address, env = head
    job_id = f"grpo-stop-{secrets.token_hex(3)}"
    submitted = subprocess.run([GRPO, "submit", "--address", address, "--no-follow", "--job-id", job_id,
                                *_job_overrides(model_cache, tmp_path, 1000)], env=env, capture_output=True, text=True,
                               timeout=300)
    assert submitted.returncode == 0 and job_id in submitted.stdout, submitted.stderr
    jobs = JobSubmissionClient(address, headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"})
    # Until the job runs with actors of its own (pytest's timeout bounds the waits).
    while not jobs.get_job_info(job_id).job_id or not _alive_actors(address, env, jobs.get_job_info(job_id).job_id):
        assert str(jobs.get_job_status(job_id)) in ("PENDING", "RUNNING"), jobs.get_job_logs(job_id)[-3000:]
        time.sleep(1)
    ray_job_id = jobs.get_job_info(job_id).job_id  # running, with actors of its own
    stopped = subprocess.run([GRPO, "jobs", "stop", job_id, "--address", address], env=env,
                             capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0 and "STOPPED" in stopped.stdout, stopped.stdout + stopped.stderr
    while _alive_actors(address, env, ray_job_id):  # the job's actors go with it
        time.sleep(1)
    status = subprocess.run([GRPO, "jobs", "status", job_id, "--address", address], env=env,
                            capture_output=True, text=True)
    assert "STOPPED" in status.stdout


def test_without_the_token_the_head_refuses_with_one_line(head, model_cache, tmp_path):
    address, env = head
    no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    no_token["RAY_AUTH_MODE"] = "token"
    no_token["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either
    result = subprocess.run([GRPO, "submit", "--address", address, "--no-follow",
                             *_job_overrides(model_cache, tmp_path, 1)], env=no_token, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
