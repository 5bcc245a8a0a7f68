"""A run lets go of everything it started, whichever part fails to stop (pure logic: fakes
stand in for the parts; the real stack's Ctrl-C is tests/e2e/test_cli.py)."""
from common.config import Config


class Part:
    def __init__(self, log, name, fails=False):
        self.log, self.name, self.fails = log, name, fails

    def _stop(self):
        self.log.append(self.name)
        if self.fails:
            raise RuntimeError(f"{self.name} is stuck")
        return None

    close = shutdown = _stop


def test_close_stops_every_part_even_when_one_fails(capsys):
    from cluster.run import Run

    log = []
    run = Run(Config())
    run.batches, run.logger, run.roles = Part(log, "batches", fails=True), Part(log, "logger"), Part(log, "roles")
    run.close()
    assert log == ["batches", "logger", "roles"]
    assert run.batches is None and run.logger is None and run.roles is None
    assert "stop_batches failed while stopping: RuntimeError: batches is stuck" in capsys.readouterr().err
    run.close()  # twice: nothing left to stop
    assert log == ["batches", "logger", "roles"]
