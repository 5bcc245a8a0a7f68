"""Shared, expensive fixtures: one Ray, one tiny model, one set of actors for the whole session.

vLLM engines take ~20 s each to start on 2 cores, so integration tests share them.
"""
from __future__ import annotations

import pytest

from helpers import small_overrides

TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config, items):
    """Each test is marked with its tier, the folder it lives in (`pytest -m unit`)."""
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


# The modules that use the session's actors (`roles`): one work unit under `--dist loadfile`.
SHARES_ROLES = ("tests/integration/test_system.py", "tests/integration/test_weight_sync.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (what `make test` runs) as pytest-xdist has it, one module per work unit
    so that a module's fixtures start once, except that the modules in SHARES_ROLES are one
    unit: the session's engines, verifiers and learner then start once per suite, not once per
    worker. (xdist's own `loadgroup` cannot do this under pytest 9.2: it renames the tests
    through an attribute pytest no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileSharingRoles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "session roles" if module in SHARES_ROLES else module

    return LoadFileSharingRoles(config, log)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def system_cfg(model_cache, tmp_path_factory):
    from cluster.compose import load_config
    from cluster.preflight import resolve_model

    cfg = load_config(small_overrides(model_cache, str(tmp_path_factory.mktemp("runs"))))
    cfg.model.path = resolve_model(cfg)
    return cfg


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from cluster.preflight import ACTOR_ENV
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


@pytest.fixture(scope="session")
def roles(ray_session, system_cfg, initial_checkpoint):
    from cluster.roles import start_roles

    roles = start_roles(system_cfg)
    roles.learner.call("snapshot_reference")  # saved with it: pi_ref = the initial model
    roles.learner.save_checkpoint(initial_checkpoint)
    yield roles
    roles.shutdown()


@pytest.fixture
def initial_roles(roles, initial_checkpoint):
    """The session's roles with the learner back at its initial weights, optimizer state and
    reference, whichever tests trained it before (the workers get them with the next push).
    For tests that measure learning: from another starting point the same steps learn less."""
    roles.learner.call("load_checkpoint", initial_checkpoint)
    return roles


@pytest.fixture(scope="module")
def learners(ray_session):
    """Learner groups rebuilt in place for each configuration (tests/learner_pool.py), one pool
    per module."""
    from learner_pool import LearnerPool

    pool = LearnerPool()
    yield pool
    pool.shutdown()
