"""rollout.seeded_sampling=false on the real stack (vLLM's CPU build): requests without seeds
of their own, the engine's sampler seeded once per call (the GPU layout's default, where
per-request seeds put vLLM's sampler on its one-request-at-a-time path). The seeded default
is tested with the session's workers (test_system.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import ray

from helpers import seeded
from data.datasets import load_problems
from rollout.pool import RolloutPool


@pytest.fixture(scope="module")
def unseeded_worker(ray_session, system_cfg):
    pool = RolloutPool(system_cfg.model.path, replace(system_cfg.rollout, num_workers=1, seeded_sampling=False), 0)
    yield pool.workers[0]
    pool.shutdown()


def test_unseeded_sampling_generates_and_repeats_a_call_on_one_engine(unseeded_worker, system_cfg):
    train_set = load_problems(system_cfg.data, system_cfg.trainer.seed).train
    batch = [(i, p.prompt, p.solution, {}) for i, p in enumerate(train_set[:6])]
    seeds = [101 + i for i in range(len(batch))]

    def draw(prompt_seeds):
        return ray.get(unseeded_worker.generate.remote(*seeded(batch, prompt_seeds), n=4, greedy=False))[:-1]

    groups = draw(seeds)
    assert [g.group_size for g in groups] == [4] * len(batch)
    assert all(ids for g in groups for ids in g.completion_ids)
    assert all(len(lp) == len(ids) for g in groups for lp, ids in zip(g.sampler_logprobs, g.completion_ids))
    first = [g.completion_ids for g in groups]
    # The requests carried no seeds; the engine's sampler was seeded from the call's seeds.
    assert [g.completion_ids for g in draw(seeds)] == first
    assert [g.completion_ids for g in draw([s + 1 for s in seeds])] != first

    def request_seeds(worker, prompt_seeds):  # runs in the actor (Ray pickles it by value)
        return [p.seed for p in (worker.sampling_params(4, False, s) for s in worker._request_seeds(prompt_seeds, False))]

    assert ray.get(unseeded_worker.__ray_call__.remote(request_seeds, seeds)) == [None] * len(seeds)
