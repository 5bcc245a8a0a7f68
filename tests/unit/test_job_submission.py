"""`grpo submit` against a head whose job agent is still starting (pure logic: the client's
answers are scripted; tests/e2e/test_jobs.py submits to a real head)."""
from __future__ import annotations

import pytest

from cluster.cli.jobs import AGENT_NOT_READY, submit_when_ready

NOT_READY = RuntimeError(f"Request failed with status code 500: {AGENT_NOT_READY}, please try again later..")


class ScriptedJobs:
    """Answers submit_job from a script: an exception is raised, anything else returned."""

    def __init__(self, *answers):
        self.answers, self.requests = list(answers), []

    def submit_job(self, **request):
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_starting_job_agent_is_waited_for_and_the_job_submitted_once(capsys):
    jobs = ScriptedJobs(NOT_READY, NOT_READY, "raysubmit_1")
    assert submit_when_ready(jobs, {"entrypoint": "python -m cluster.train"}, poll_s=0) == "raysubmit_1"
    assert jobs.requests == [{"entrypoint": "python -m cluster.train"}] * 3
    assert capsys.readouterr().err.count("job agent is still starting") == 1


def test_other_errors_and_an_agent_that_never_starts_are_raised():
    refused = RuntimeError("Request failed with status code 400: bad runtime_env.")
    with pytest.raises(RuntimeError, match="400"):
        submit_when_ready(ScriptedJobs(refused, "never"), {}, poll_s=0)
    with pytest.raises(RuntimeError, match=AGENT_NOT_READY):
        submit_when_ready(ScriptedJobs(*[NOT_READY] * 50), {}, timeout_s=0.05, poll_s=0.01)


@pytest.mark.parametrize("overrides, grace", [([], "600"), (["trainer.stop_grace_s=1800"], "1800")])
def test_submit_gives_the_job_a_stop_grace_that_fits_a_step_and_a_checkpoint(monkeypatch, overrides, grace):
    import cluster.cli.jobs as jobs

    scripted = ScriptedJobs("raysubmit_1")
    monkeypatch.setattr(jobs, "client", lambda address: scripted)
    assert jobs.submit(None, overrides, follow=False) == 0
    (request,) = scripted.requests
    assert request["runtime_env"]["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == grace


def test_the_job_gets_the_shells_settings_it_needs_and_no_others():
    """Keys, caches and the allocator setting that the largest CPU runs need travel with the
    job; the rest of the submitting shell does not."""
    from cluster.cli.jobs import runtime_env

    shell = {"WANDB_API_KEY": "k", "MLFLOW_TRACKING_TOKEN": "t", "HF_HOME": "/h", "MALLOC_MMAP_THRESHOLD_": "1048576",
             "MALLOC_TRIM_THRESHOLD_": "0", "HOME": "/root", "AWS_SECRET_ACCESS_KEY": "s"}
    assert runtime_env(shell)["env_vars"] == {k: v for k, v in shell.items() if k not in ("HOME", "AWS_SECRET_ACCESS_KEY")}
