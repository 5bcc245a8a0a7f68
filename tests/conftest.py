"""Shared, expensive fixtures: one Ray and one tiny model per session, one set of actors for
the tests that use them.

vLLM engines take ~20 s each to start on 2 cores, so integration tests share them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

# `make test` runs two workers, each starting engines and learner ranks that plan their threads
# for the whole machine, so the suite keeps more OpenMP threads busy than there are cores.
# OpenMP's default has a thread that finished its share spin for a while before it sleeps: with
# the cores oversubscribed that spinning takes them from the other worker's processes. PASSIVE
# makes waiting threads sleep at once. It changes no result, only who waits how: two small runs
# at once (`grpo train`, 1 engine, 2 ranks, 4 steps each) took less CPU time and wall time with
# it than without (bench/cpu_floor.py processes, around each pair). Set
# before anything loads OpenMP; every process the suite starts inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402  (after the variable: helpers imports Ray)

from helpers import small_overrides  # noqa: E402

TIERS = ("unit", "integration", "e2e")


# The modules that use the session's shared actors: the learner pool (`learners`), the reference
# engines (`fresh_engines`) and the roles (`roles`). Under `--dist loadfile` they are one work
# unit, in this order, so that each of the three starts once per suite: a shared fixture is shut
# down once no later test of its unit asks for it (pytest_runtest_teardown).
SHARES_ACTORS = ("tests/integration/test_learner_equivalence.py", "tests/integration/test_ppo_learner.py",
                 "tests/integration/test_tensor_parallel.py", "tests/integration/test_lora.py",
                 "tests/integration/test_weight_sync.py", "tests/integration/test_system.py",
                 "tests/integration/test_streaming.py")
ROOT = Path(__file__).resolve().parents[1]
# The last full run's seconds per test file (bench/suite_durations.py writes it).
DURATIONS = ROOT / "bench" / "results" / "suite.json"


def pytest_collection_modifyitems(config, items):
    """Each test is marked with its tier, the folder it lives in (`pytest -m unit`), and the
    work units (modules, SHARES_ACTORS as one) are ordered longest first by the last full run's
    seconds, so that under `-n 2` no worker is left alone with a long unit at the end; within
    SHARES_ACTORS, in its order."""
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
    seconds = unit_seconds(DURATIONS)
    items.sort(key=lambda item: (-seconds.get(work_unit(_module(item)), float("inf")), _shared_order(_module(item))))
    later, unit = frozenset(), None
    for item in reversed(items):
        if (this := work_unit(_module(item))) != unit:
            later, unit = frozenset(), this
        item.stash[LATER] = later
        later = later | SHARED.intersection(item.fixturenames)


# The fixtures of the shared actors, and (in each test's stash) those that a later test of the
# test's work unit asks for.
SHARED = frozenset({"learners", "fresh_engines", "roles"})
LATER = pytest.StashKey[frozenset]()


def _shared_order(module: str) -> int:
    return SHARES_ACTORS.index(module) if module in SHARES_ACTORS else 0


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def work_unit(module: str) -> str:
    return "shared actors" if module in SHARES_ACTORS else module


def unit_seconds(path: Path) -> dict:
    """Seconds per work unit in a suite.json (empty when there is none: the order is then
    pytest's); a module the file does not name sorts first (its length is unknown)."""
    try:
        files = json.loads(path.read_text())["summary"]["file_seconds"]
    except (OSError, KeyError, ValueError):
        return {}
    units: dict = {}
    for module, value in files.items():
        units[work_unit(module)] = units.get(work_unit(module), 0.0) + value
    return units


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (what `make test` runs) as pytest-xdist has it, one module per work unit
    so that a module's fixtures start once, except that the modules in SHARES_ACTORS are one
    unit: the session's learner pool, reference engines and roles then start once per suite,
    not once per worker or module. (xdist's own `loadgroup` cannot do this under pytest 9.2:
    it renames the tests through an attribute pytest no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    # The units in collection order (longest first: pytest_collection_modifyitems), not
    # xdist's default of the most tests first, which put the longest units last.
    config.option.loadscopereorder = False

    class LoadFileSharingRoles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(super()._split_scope(nodeid))

    return LoadFileSharingRoles(config, log)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def system_cfg(model_cache, tmp_path_factory):
    from cluster.cli.compose import load_config
    from cluster.cli.checks import resolve_model

    cfg = load_config(small_overrides(model_cache, str(tmp_path_factory.mktemp("runs"))))
    cfg.model.path = resolve_model(cfg)
    return cfg


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from cluster.loop.launch import ACTOR_ENV
    from common.ray_utils import start_local_ray

    # More logical CPUs than cores: the actors mostly take turns, and tests add a few of their own.
    # A local Ray: each xdist worker starts one of its own instead of joining the other's.
    start_local_ray(num_cpus=8, env_vars=ACTOR_ENV)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def initial_checkpoint(tmp_path_factory):
    """Where `roles` saves its learner before any test trains it."""
    return str(tmp_path_factory.mktemp("initial_policy"))


class SessionRoles:
    """The session's roles, started when a test first asks for them and shut down as soon as
    no later test of the work unit (nor the next test this worker runs) uses them
    (pytest_runtest_teardown below), not at the session's end: idle, two engines, two learner
    ranks and two verifiers still use a ninth to a seventh of a core (3.3-4.3 CPU-s per 30 s,
    bench/idle_costs.py roles; an engine's gloo transport threads wake every 10 ms, each Ray
    worker polls) for the rest of the suite. Under `make test` their tests run
    as one block (SHARES_ACTORS), so they start once; a run that interleaves other modules
    between them starts them again. A start that failed is not tried again: every later test
    that asks gets its error."""

    def __init__(self, cfg, checkpoint: str):
        self.cfg, self.checkpoint, self.current, self.error = cfg, checkpoint, None, None

    def get(self):
        if self.error is not None:
            raise RuntimeError("the session's roles failed to start (see the first test that asked)") from self.error
        if self.current is None:
            from cluster.loop.roles import start_roles

            roles = None
            try:
                roles = start_roles(self.cfg)
                roles.learner.snapshot_reference()  # saved with it: pi_ref = the initial model
                roles.learner.save_checkpoint(self.checkpoint)
            except BaseException as error:
                self.error = error
                if roles is not None:
                    roles.shutdown()
                raise
            self.current = roles
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current, roles = None, self.current
            roles.shutdown()


# The session's shared actors, by the fixture a test asks for them with, and what shuts them
# down: the teardown hook below does once no later test of the unit asks for that fixture (see
# SessionRoles). Each starts again when a later test asks.
_shared: dict = {}


@pytest.fixture(scope="session")
def session_roles(ray_session, system_cfg, initial_checkpoint):
    holder = SessionRoles(system_cfg, initial_checkpoint)
    _shared["roles"] = holder.close
    yield holder
    holder.close()


@pytest.fixture
def roles(session_roles):
    return session_roles.get()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test's own fixtures are torn down: shut each of the session's shared actors down
    when neither the next test nor a later one of this test's work unit uses them (see
    SessionRoles)."""
    try:
        return (yield)
    finally:
        for fixture, close in _shared.items():
            if nextitem is None or (fixture not in nextitem.fixturenames and fixture not in item.stash.get(LATER, ())):
                close()


@pytest.fixture
def initial_roles(roles, initial_checkpoint):
    """The session's roles with the learner back at its initial weights, optimizer state and
    reference, whichever tests trained it before (the workers get them with the next push).
    For tests that measure learning: from another starting point the same steps learn less."""
    roles.learner.load_checkpoint(initial_checkpoint)
    return roles


@pytest.fixture(scope="session")
def warmed_policies():
    """The learner checkpoints `warmed` saved, by warm-up: (folder, policy version)."""
    return {}


@pytest.fixture
def warmed(initial_roles, warmed_policies, tmp_path_factory):
    """`warm(cfg, train) -> version`: the session's roles after `cluster.loop.phases.warm_up`
    of `train` under `cfg` from the initial weights. The first test to ask runs it and
    checkpoints the learner; a later test with the same warm-up resumes from that checkpoint
    (its weights, optimizer state and reference, pushed to the workers), the state the same
    warm-up reaches again, without its hundreds of supervised steps and probes."""
    from cluster.loop.phases import warm_up

    def warm(cfg, train) -> int:
        key = (repr(cfg.warmup), cfg.trainer.seed, tuple(p.prompt for p in train))
        if key in warmed_policies:
            folder, version = warmed_policies[key]
            initial_roles.learner.load_checkpoint(folder)
            initial_roles.channel.refresh_spec()
            initial_roles.channel.push(version)
            return version
        version = warm_up(initial_roles, cfg, train)
        folder = str(tmp_path_factory.mktemp("warmed_policy"))
        initial_roles.learner.save_checkpoint(folder)
        warmed_policies[key] = folder, version
        return version

    return warm


@pytest.fixture(scope="session")
def learners(ray_session):
    """Learner groups rebuilt in place for each configuration (tests/learner_pool.py), shared
    by the modules of SHARES_ACTORS that run one after another."""
    from learner_pool import LearnerPool

    pool = LearnerPool()
    _shared["learners"] = pool.shutdown
    yield pool
    pool.shutdown()


@pytest.fixture(scope="session")
def fresh_engines(ray_session):
    """Engines built from saved weights for comparisons, rebuilt in one process
    (tests/reference_engine.py), shared like `learners`."""
    from reference_engine import ReferenceEngines

    engines = ReferenceEngines()
    _shared["fresh_engines"] = engines.shutdown
    yield engines
    engines.shutdown()
