"""A generation actor whose vLLM engine died exits (Ray then restarts it with a fresh engine);
any other error is raised as before (rollout/worker.py). It raises vLLM's own EngineDeadError,
whose import loads the whole of vLLM: that makes it an integration test."""
from __future__ import annotations

import pytest
from vllm.v1.engine.exceptions import EngineDeadError

from rollout import worker


class Exited(Exception):
    pass


class FakeWorker:
    def __init__(self, error):
        self.error = error

    @worker.exits_if_engine_died
    def generate(self, n: int):
        if self.error is not None:
            raise self.error
        return n


def test_a_dead_engine_makes_the_actor_exit_and_other_errors_are_raised(monkeypatch):
    statuses = []

    def fake_exit(status):
        statuses.append(status)
        raise Exited()

    monkeypatch.setattr(worker.os, "_exit", fake_exit)
    assert FakeWorker(None).generate(3) == 3
    with pytest.raises(Exited):
        FakeWorker(EngineDeadError()).generate(1)
    wrapped = RuntimeError("collective_rpc failed")
    wrapped.__cause__ = EngineDeadError()
    with pytest.raises(Exited):
        FakeWorker(wrapped).generate(1)
    assert statuses == [worker.EXIT_ENGINE_DEAD] * 2
    with pytest.raises(ValueError, match="bad prompt"):
        FakeWorker(ValueError("bad prompt")).generate(1)
    assert len(statuses) == 2
