"""`grpo submit` / `grpo jobs` against a real Ray head started here (`ray start --head`), with
token authentication on and the dashboard on 127.0.0.1: one few-step job runs to SUCCEEDED and
writes its metrics; another is stopped while running and leaves no actor behind; without the
token the head refuses."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.ray_utils import free_port
from tests.conftest import small_overrides

BIN = Path(sys.executable).parent
GRPO, RAY = str(BIN / "grpo"), str(BIN / "ray")


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A Ray head of its own (not the tests' shared local Ray), stopped by its process group
    (`ray stop` would stop every Ray on the machine)."""
    token = secrets.token_hex(32)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
           # The cluster's environment is this one: its `python` has the package.
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    gcs, dashboard = free_port(), free_port()
    temp = tmp_path_factory.mktemp("rayhead")
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={gcs}", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard}", "--num-cpus=8", f"--temp-dir={temp}", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.monotonic() + 120
    while subprocess.run([GRPO, "jobs", "status", "probe", "--address", address], env=env,
                         capture_output=True, text=True).stderr.find("Failed to connect") >= 0:
        assert proc.poll() is None and time.monotonic() < deadline, "the Ray head did not come up"
        time.sleep(2)
    yield address, env
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _job_overrides(model_cache: str, out: Path, steps: int) -> list:
    return [*small_overrides(model_cache, str(out)), f"trainer.max_steps={steps}", "warmup.steps=0",
            "rollout.num_workers=1", "reward.num_workers=1", "learner.num_ranks=1", "trainer.run_name=job"]


def _alive_actors(address: str, env: dict, ray_job_id: str) -> list:
    out = subprocess.run([RAY, "list", "actors", "--address", address.replace("http://", ""), "--format", "json",
                          "--filter", "state=ALIVE", "--limit", "1000"], env=env, capture_output=True, text=True,
                         check=True)
    return [a for a in json.loads(out.stdout) if a.get("job_id") == ray_job_id]


def test_submitted_job_succeeds_and_a_stopped_job_leaves_no_actors(head, model_cache, tmp_path):
    from ray.job_submission import JobSubmissionClient

    address, env = head
    # The long job goes first and runs beside the short one (the head has room for both).
    long_id = f"grpo-stop-{secrets.token_hex(3)}"
    submitted = subprocess.run([GRPO, "submit", "--address", address, "--no-follow", "--job-id", long_id,
                                *_job_overrides(model_cache, tmp_path / "long", 1000)],
                               env=env, capture_output=True, text=True, timeout=300)
    assert submitted.returncode == 0, submitted.stderr
    assert long_id in submitted.stdout

    short = subprocess.run([GRPO, "submit", "--address", address, *_job_overrides(model_cache, tmp_path / "short", 2)],
                           env=env, capture_output=True, text=True, timeout=1200)
    assert short.returncode == 0, short.stdout[-3000:] + short.stderr[-3000:]
    assert "SUCCEEDED" in short.stdout.splitlines()[-1]
    rows = [json.loads(line) for line in (tmp_path / "short" / "job" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "held-out greedy accuracy" in short.stdout  # the job's own output came back through the logs

    jobs = JobSubmissionClient(address, headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"})
    ray_job_id = jobs.get_job_info(long_id).job_id
    deadline = time.monotonic() + 600
    while not (tmp_path / "long" / "job" / "metrics.jsonl").exists():  # running: actors up, steps logged
        assert str(jobs.get_job_status(long_id)) in ("PENDING", "RUNNING") and time.monotonic() < deadline
        time.sleep(2)
    assert _alive_actors(address, env, ray_job_id), "the running job should own actors"
    stopped = subprocess.run([GRPO, "jobs", "stop", long_id, "--address", address], env=env,
                             capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0 and "STOPPED" in stopped.stdout, stopped.stdout + stopped.stderr
    while _alive_actors(address, env, ray_job_id):
        assert time.monotonic() < deadline, "actors outlived their stopped job"
        time.sleep(2)
    status = subprocess.run([GRPO, "jobs", "status", long_id, "--address", address], env=env,
                            capture_output=True, text=True)
    assert "STOPPED" in status.stdout


def test_without_the_token_the_head_refuses_with_one_line(head, model_cache, tmp_path):
    address, env = head
    no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    no_token["RAY_AUTH_MODE"] = "token"
    no_token["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either
    result = subprocess.run([GRPO, "submit", "--address", address, "--no-follow",
                             *_job_overrides(model_cache, tmp_path, 1)], env=no_token, capture_output=True, text=True)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
