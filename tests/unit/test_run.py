"""A run lets go of everything it started, whichever part fails to stop (pure logic: fakes
stand in for the parts; the real stack's Ctrl-C is tests/e2e/test_cli.py)."""
from common.config import Config
from common.messages import PromptInfo, ResolvedInputs


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
    from cluster.loop.run import Run

    log = []
    run = Run(Config(), ResolvedInputs("model", (), PromptInfo(False, "", (), (), (0, ""))))
    run.batches, run.logger, run.roles = Part(log, "batches", fails=True), Part(log, "logger"), Part(log, "roles")
    run.close()
    assert log == ["batches", "logger", "roles"]
    assert run.batches is None and run.logger is None and run.roles is None
    assert "stop_batches failed while stopping: RuntimeError: batches is stuck" in capsys.readouterr().err
    run.close()  # twice: nothing left to stop
    assert log == ["batches", "logger", "roles"]


def test_threads_follow_the_mode_and_the_cpus():
    from cluster.loop.launch import plan_threads

    cfg = Config()  # 2 learner ranks, 2 engines, sync
    plan = plan_threads(cfg, 16)
    assert (plan.learner, plan.rollout) == (8, 8)  # the phases take turns
    assert plan.line == ("CPU threads: 2 learner ranks x 8, 2 vLLM engines x 8 (sync mode: the phases take turns "
                         "on 16 CPUs per node)")
    cfg = Config()
    cfg.trainer.mode = "async"
    plan = plan_threads(cfg, 16)
    assert (plan.learner, plan.rollout) == (4, 4)  # both at once: no oversubscription
    cfg = Config()
    plan = plan_threads(cfg, 2)
    assert (plan.learner, plan.rollout) == (1, 1)  # never 0
    cfg = Config()
    cfg.learner.num_threads = 3  # set by hand: kept
    plan = plan_threads(cfg, 16)
    assert (plan.learner, plan.rollout) == (3, 8)
    cfg = Config()
    cfg.learner.num_gpus_per_rank, cfg.rollout.num_gpus_per_worker = 1, 1
    assert plan_threads(cfg, 16) is None and cfg.learner.num_threads == 0  # GPUs: nothing to plan


def test_what_a_run_resolves_is_returned_and_the_validated_config_is_left_as_it_is():
    import copy

    from cluster.loop.launch import plan_threads, run_config

    cfg = Config()
    cfg.rollout.stop_token_ids = [7]
    before = copy.deepcopy(cfg)
    inputs = ResolvedInputs("/models/tiny", (2, 7), PromptInfo(True, "hi", (2,), ("</s>",), (1, "train row 1")))
    resolved = run_config(cfg, inputs, "mine", plan_threads(cfg, 16))
    assert cfg == before
    assert (resolved.model.path, resolved.rollout.stop_token_ids, resolved.trainer.run_name) == \
        ("/models/tiny", [2, 7], "mine")
    assert (resolved.learner.num_threads, resolved.rollout.num_threads) == (8, 8)
    assert resolved.algo == cfg.algo and resolved.rollout.max_new_tokens == cfg.rollout.max_new_tokens


def test_device_defaults_are_resolved_into_a_new_config():
    import copy

    from cluster.cli.compose import resolve_auto

    cfg = Config()
    before = copy.deepcopy(cfg)
    resolved = resolve_auto(cfg)
    assert cfg == before and cfg.rollout.dtype == "auto"
    assert (resolved.rollout.dtype, resolved.rollout.enforce_eager) == ("float32", True)  # CPU engines


def test_a_frozen_config_refuses_writes_and_its_copies_do_not():
    import dataclasses
    import pickle

    import pytest

    from common.config import freeze

    cfg = freeze(Config())
    for write in (lambda: setattr(cfg.model, "path", "/elsewhere"), lambda: setattr(cfg.learner.lora, "rank", 8),
                  lambda: setattr(cfg, "model", None)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            write()
    assert cfg.model.path is None and cfg.learner.lora.rank == 0
    with pytest.raises(dataclasses.FrozenInstanceError):  # as an actor receives it
        pickle.loads(pickle.dumps(cfg.rollout)).dtype = "float32"
    copy = dataclasses.replace(cfg.model, path="/elsewhere")
    copy.path = "/there"
    assert copy.path == "/there" and copy == dataclasses.replace(cfg.model, path="/there")
