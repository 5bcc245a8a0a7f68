"""`grpo submit` and `grpo jobs`: the training job as a Ray job, through Ray's Job Submission SDK.

The config is composed and checked here first, so a bad override fails on the user's machine
with exit status 2 instead of as a failed job on the cluster. The job's runtime environment
uploads this repository (without virtualenvs, runs, caches) as its working directory and
forwards the submitting shell's `WANDB_*`, `MLFLOW_*`, `HF_*`, `VLLM_*`, `NCCL_*` and `GRPO_*` variables.
Ray's token authentication (on by default on Ray 2.60 heads) is the SDK's: it reads the token
from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token when RAY_AUTH_MODE=token.
"""
from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from cluster.cli.compose import load_config

ROOT = Path(__file__).resolve().parents[2]
EXCLUDES = [".venv", ".git", "runs", "wandb", "outputs", ".whl", ".pytest_cache", "__pycache__", "*.pyc",
            "*.egg-info", "docs"]
"""Never uploaded with the working directory: environments, run outputs, caches."""
FORWARDED_ENV = ("WANDB_", "MLFLOW_", "HF_", "HUGGING_FACE_", "VLLM_", "NCCL_", "GRPO_", "MALLOC_")
"""Environment variables (by prefix) that the job gets from the submitting shell."""
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def default_address() -> str:
    return os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_DASHBOARD_ADDRESS") or "http://127.0.0.1:8265"


def client(address: Optional[str]):
    from ray.job_submission import JobSubmissionClient  # Ray's import only for a command that needs it

    return JobSubmissionClient(address or default_address())


def runtime_env(env: Optional[Dict[str, str]] = None, stop_grace_s: Optional[int] = None) -> dict:
    """The job's runtime env. `stop_grace_s` becomes RAY_JOB_STOP_WAIT_TIME_S, which Ray's job
    supervisor (it runs with the job's env_vars) waits between SIGTERM and SIGKILL on stop."""
    source = os.environ if env is None else env
    env_vars = {k: v for k, v in source.items() if k.startswith(FORWARDED_ENV)}
    if stop_grace_s is not None:
        env_vars["RAY_JOB_STOP_WAIT_TIME_S"] = str(int(stop_grace_s))
    return {"working_dir": str(ROOT), "excludes": EXCLUDES, "env_vars": env_vars}


def entrypoint(overrides: List[str]) -> str:
    # The job's own interpreter (the cluster's environment) runs the driver; it joins the
    # cluster through RAY_ADDRESS, which Ray sets for every job.
    return " ".join(["python", "-m", "cluster.train", *map(shlex.quote, overrides)])


def submit(address: Optional[str], overrides: List[str], follow: bool = True,
           submission_id: Optional[str] = None) -> int:
    """Submit the training job; print its id; follow its logs to the end (exit 0 if it
    succeeded, 1 if not). The config is checked before anything is sent."""
    cfg = load_config(overrides)  # raises ConfigError (exit 2) before anything reaches the cluster
    jobs = client(address)
    env = runtime_env(stop_grace_s=cfg.trainer.stop_grace_s)
    job_id = submit_when_ready(jobs, dict(entrypoint=entrypoint(overrides), runtime_env=env,
                                          submission_id=submission_id, metadata={"tool": "grpo"}))
    print(f"submitted job {job_id} to {address or default_address()}", flush=True)
    print(f"  follow: grpo jobs logs {job_id} --follow    stop: grpo jobs stop {job_id}", flush=True)
    if not follow:
        return 0
    return follow_logs(jobs, job_id)


AGENT_NOT_READY = "No available agent to submit job"
"""What a head answers (HTTP 500) while its job agent is still starting: just after `ray start`."""


def submit_when_ready(jobs, request: dict, timeout_s: float = 120.0, poll_s: float = 2.0) -> str:
    """`jobs.submit_job(**request)`, tried again while the head says its job agent is not up
    yet (nothing was submitted then), up to `timeout_s`; any other error is raised at once."""
    deadline = time.monotonic() + timeout_s
    waiting = False
    while True:
        try:
            return jobs.submit_job(**request)
        except RuntimeError as error:
            if AGENT_NOT_READY not in str(error) or time.monotonic() >= deadline:
                raise
            if not waiting:
                print("the head's job agent is still starting; waiting for it", file=sys.stderr, flush=True)
                waiting = True
            time.sleep(poll_s)


def follow_logs(jobs, job_id: str) -> int:
    async def tail() -> None:
        async for lines in jobs.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    asyncio.run(tail())
    status = wait(jobs, job_id)
    print(f"job {job_id}: {status}", flush=True)
    return 0 if status == "SUCCEEDED" else 1


def wait(jobs, job_id: str, timeout_s: float = 60.0) -> str:
    """The job's status once terminal (the log stream can end a moment before the status)."""
    deadline = time.monotonic() + timeout_s
    status = str(jobs.get_job_status(job_id))
    while status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.5)
        status = str(jobs.get_job_status(job_id))
    return status


def jobs_command(action: str, job_id: str, address: Optional[str], follow: bool = False) -> int:
    jobs = client(address)
    if action == "status":
        info = jobs.get_job_info(job_id)
        print(f"{job_id}: {info.status}" + (f" ({info.message})" if info.message else ""))
        return 0
    if action == "logs":
        if follow:
            return follow_logs(jobs, job_id)
        print(jobs.get_job_logs(job_id), end="")
        return 0
    if action == "stop":
        jobs.stop_job(job_id)
        status = wait(jobs, job_id)
        print(f"{job_id}: {status}")
        return 0 if status in TERMINAL else 1
    raise ValueError(action)
