"""The driver's one line per actor restart, and the cause read out of Ray's error."""
from __future__ import annotations

from common.messages import RestartEvent
from common.ray_utils import death_cause

KILLED = """The actor died unexpectedly before finishing this task.
	class_name: GenerationWorker
	actor_id: 5e1
	pid: 9686
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of file. There are some potential root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage. (2) ray stop --force is called. (3) The worker is crashed unexpectedly due to SIGSEGV or other unexpected errors."""

# Ray 2.60's words for the same SIGKILL, as raised (the OOM killer named before any "root causes").
KILLED_260 = """The actor died unexpectedly before finishing this task.
	class_name: A
	pid: 3191
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error. If the process was killed by the kernel OOM killer (verifiable by checking for OOM in dmesg of the OOMing node), consider enabling resource isolation via --enable-resource-isolation to prevent node deaths by resource contention and significant loss of progress by uninformed kernel OOM killing."""

OOM = """The actor died unexpectedly. Task was killed due to the node running low on memory.
Memory on the node was 23.1GB / 24GB (0.96), which exceeds the memory usage threshold. Ray killed this worker because the memory monitor found the node low on memory."""


def test_a_plain_kill_is_not_reported_as_out_of_memory():
    assert death_cause(RuntimeError(KILLED)) == "its process ended without a word (a kill signal or a crash)"
    assert death_cause(RuntimeError(KILLED_260)) == "its process ended without a word (a kill signal or a crash)"
    assert death_cause(RuntimeError(OOM)) == "out of memory (Ray's memory monitor killed it)"
    assert death_cause(ValueError("something else")) == "ValueError"
    import ray

    init_failed = ray.exceptions.RayActorError(error_msg="The actor died because of an error raised in its creation "
                                               "task, Traceback (most recent call last):\n  File x\nOSError: disk full\n",
                                               actor_init_failed=True)
    assert death_cause(init_failed) == "its start failed: OSError: disk full"


def test_one_line_names_the_role_the_step_the_cause_and_the_recovery_time():
    event = RestartEvent("generation worker", "out of memory", 1, 41.73, "the weight push")
    assert event.line(7) == ("step 7: generation worker 1 died during the weight push: out of memory; "
                                      "back in 41.7 s")
    verifier = RestartEvent("verifier", "restarted by Ray, its call re-run")
    assert verifier.line(3) == "step 3: verifier died: restarted by Ray, its call re-run"


def test_an_actor_found_unreachable_is_described_not_named_by_class():
    import ray

    error = ray.exceptions.ActorUnavailableError("The actor 5e1 is unavailable: connection refused", b"\x00" * 16)
    assert death_cause(error) == "its process stopped answering (killed or crashed)"


class _OneFileLearner:
    def save_checkpoint(self, folder):
        import os

        os.makedirs(os.path.join(folder, "learner"))
        with open(os.path.join(folder, "learner", "state.pt"), "wb") as f:
            f.write(b"state")


def _run_after_losses(tmp_path, max_restarts: int, restarts: int):
    from types import SimpleNamespace

    from cluster.loop.checkpoint import save_checkpoint
    from common.messages import TrainerState

    save_checkpoint(tmp_path, 2, _OneFileLearner(), TrainerState(2), 0)
    trainer = SimpleNamespace(max_restarts=max_restarts, run_name="mine")
    return SimpleNamespace(cfg=SimpleNamespace(trainer=trainer), run_dir=tmp_path, learner_restarts=restarts)


def test_with_no_restarts_allowed_a_lost_rank_stops_the_run_with_the_resume_line(tmp_path):
    import pytest

    from cluster.loop.recovery import recover_learner
    from learner.group import LearnerError

    lost = LearnerError("a learner rank died during train_step (ActorDiedError)")
    with pytest.raises(LearnerError) as stopped:
        recover_learner(_run_after_losses(tmp_path, 0, 0), 3, lost)
    assert str(stopped.value) == (
        f"a learner rank died during train_step (ActorDiedError) at step 3; the run stopped. Its last checkpoint "
        f"is {tmp_path / 'checkpoints' / 'step-000002'}: continue with the same overrides plus "
        f"trainer.run_name=mine trainer.resume=auto")
    with pytest.raises(LearnerError, match=r"the run stopped \(after 3 recoveries, trainer.max_restarts=3\)\. "):
        recover_learner(_run_after_losses(tmp_path, 3, 3), 3, lost)


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    """A rendezvous port the kernel could give an outgoing connection in the meantime is one a
    learner rank then failed to bind (EADDRINUSE)."""
    import socket

    from common.ray_utils import LOWEST_PORT, _ephemeral_ports, free_port

    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(LOWEST_PORT <= p < _ephemeral_ports()[0] for p in ports), ports
    with socket.socket() as s:
        s.bind(("", ports[0]))

