"""Waiting for a restarted actor on a real Ray (common/dispatch.py `call_when_up`): one that never
answers, or that dies at every start, ends the run in one line naming it."""
import pytest
import ray

from common.dispatch import call_when_up
from common.errors import RunFailed
from helpers import Broken, Silent


def test_an_actor_that_never_answers_ends_the_run_in_one_line(ray_session):
    actor = ray.remote(num_cpus=0)(Silent).remote()
    try:
        with pytest.raises(RunFailed, match=r"^generation worker 1 did not come back within 3 s of its restart$"):
            call_when_up(actor.ready, 3, what="generation worker 1")
    finally:
        ray.kill(actor)


def test_an_actor_that_dies_at_its_start_is_named_with_its_cause(ray_session):
    actor = ray.remote(num_cpus=0)(Broken).remote()
    with pytest.raises(RunFailed, match=r"^generation worker 0 did not come back after its restart: "
                                        r"its start failed: .*OSError: disk full"):
        call_when_up(actor.ready, 60, what="generation worker 0")
