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


def test_threads_follow_the_mode_and_the_cpus():
    from cluster.preflight import plan_threads

    cfg = Config()  # 2 learner ranks, 2 engines, sync
    line = plan_threads(cfg, 16)
    assert (cfg.learner.num_threads, cfg.rollout.num_threads) == (8, 8)  # the phases take turns
    assert line == ("CPU threads: 2 learner ranks x 8, 2 vLLM engines x 8 (sync mode: the phases take turns "
                    "on 16 CPUs per node)")
    cfg = Config()
    cfg.trainer.mode = "async"
    plan_threads(cfg, 16)
    assert (cfg.learner.num_threads, cfg.rollout.num_threads) == (4, 4)  # both at once: no oversubscription
    cfg = Config()
    plan_threads(cfg, 2)
    assert (cfg.learner.num_threads, cfg.rollout.num_threads) == (1, 1)  # never 0
    cfg = Config()
    cfg.learner.num_threads = 3  # set by hand: kept
    plan_threads(cfg, 16)
    assert (cfg.learner.num_threads, cfg.rollout.num_threads) == (3, 8)
    cfg = Config()
    cfg.learner.num_gpus_per_rank, cfg.rollout.num_gpus_per_worker = 1, 1
    assert plan_threads(cfg, 16) is None and cfg.learner.num_threads == 0  # GPUs: nothing to plan
