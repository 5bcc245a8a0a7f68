"""The weight-sync channel, exactly: after a push, each of two generation workers holds what a
fresh vLLM engine loaded from the learner's saved weights holds (same greedy outputs, same
prompt log-probs, same parameters), for a model with tied embeddings and one without, from
ZeRO-2 and from ZeRO-3 learners. Real Ray, vLLM (CPU build), DeepSpeed over gloo."""
from __future__ import annotations

import copy
import os
import threading
from dataclasses import replace

import pytest
import ray
import torch

from cluster.loop.sync_channel import WeightSyncChannel, WeightSyncError
from common import weight_sync
from common.ray_utils import free_port
from helpers import engine_state, seeded, warmed_learner
from rollout.pool import RolloutPool


def _gloo_pair(timeout_s: float):
    """A sync group of two members in this process (gloo, one thread each to join)."""
    port, groups = free_port(), {}

    def join(rank):
        groups[rank] = weight_sync.join_group("127.0.0.1", port, rank, 2, timeout_s, "gloo")

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return groups[0], groups[1]


def test_a_receiver_raises_on_a_bucket_that_never_comes_and_loads_only_whole_ones():
    sender, receiver = _gloo_pair(timeout_s=2.0)
    spec = weight_sync.WeightSpec(tensors=(weight_sync.TensorSpec("a", (1000,)), weight_sync.TensorSpec("b", (1000,))),
                                  dtype="float32", bucket_bytes=4000)
    assert len(spec.buckets()) == 2
    loaded, errors = [], []

    def receive():
        try:
            for bucket, flat in weight_sync.received_buckets(receiver, spec, {}):
                loaded.append((bucket[0].name, flat.clone()))
        except weight_sync.SyncWaitError as error:
            errors.append(error)

    thread = threading.Thread(target=receive)
    thread.start()
    weight_sync.broadcast(sender, torch.full((1000,), 7.0))  # the first bucket only: the sender then stops
    thread.join(30)
    assert [name for name, _ in loaded] == ["a"] and torch.equal(loaded[0][1], torch.full((1000,), 7.0))
    assert len(errors) == 1 and "bucket 2 of 2 did not complete within sync.timeout_s=2s" in str(errors[0])


def test_a_sender_whose_receiver_takes_nothing_raises_within_the_timeout():
    sender, _receiver = _gloo_pair(timeout_s=1.0)
    # 32 MB: far more than the sockets' buffers hold, so the send needs the receiver.
    with pytest.raises(weight_sync.SyncWaitError, match="a broadcast did not complete within sync.timeout_s=1s"):
        weight_sync.broadcast(sender, torch.ones(8_000_000))


def _cfg(system_cfg, tied: bool):
    from cluster.cli.checks import resolve_model

    cfg = copy.deepcopy(system_cfg)
    cfg.model.tie_word_embeddings = tied
    cfg.model.path = None
    cfg.model.path = resolve_model(cfg)
    return cfg


@pytest.fixture(scope="module")
def untied_workers(ray_session, system_cfg):
    cfg = _cfg(system_cfg, tied=False)
    pool = RolloutPool(cfg.model.path, replace(cfg.rollout, num_workers=2, num_cpus_per_worker=0.5), 0)
    yield cfg, pool
    pool.shutdown()


@pytest.fixture(params=["tied", "untied"])
def model_and_workers(request, roles, system_cfg):
    """The tied model is the built-in one: its two workers are the session's (given back their
    own weight-sync group after the test); the untied model gets two workers of its own."""
    if request.param == "untied":
        yield request.getfixturevalue("untied_workers")
        return
    yield system_cfg, roles.rollout
    roles.channel.recover()  # re-join the session's learner and push its weights back


@pytest.mark.parametrize("zero_stage,transport", [(2, "broadcast"), (3, "shm")])
def test_synced_workers_equal_a_fresh_engine_from_saved_weights(model_and_workers, learners, fresh_engines,
                                                               zero_stage, transport, tmp_path):
    cfg, pool = model_and_workers
    with warmed_learner(learners, cfg, zero_stage) as learner:
        # Small buckets: several broadcasts (or shared-file buckets), and under ZeRO-3 several gathers.
        channel = WeightSyncChannel(learner, pool, cfg.rollout.dtype, bucket_mb=0.25, timeout_s=120,
                                    transport=transport)
        shm_path = channel.spec["shm_path"]
        assert (shm_path is not None) == (transport == "shm")
        metrics = channel.push(7)
        assert pool.versions() == [7, 7]
        assert shm_path is None or not os.path.exists(shm_path), "the shared file outlived the first push"
        channel.push(8)  # later pushes reuse the mappings, with the file's name gone
        assert pool.versions() == [8, 8]
        folder = learner.save_pretrained(str(tmp_path / "saved"))
    expected = engine_state(fresh_engines.engine(folder, cfg.rollout, 123))
    for worker in pool.workers:
        got = engine_state(worker)
        assert got[0] == expected[0], "greedy outputs differ from a fresh engine's"
        assert got[1] == expected[1], "prompt log-probs differ from a fresh engine's"
        assert got[2] == expected[2], "parameters differ from a fresh engine's"
    model_mb = metrics["sync_bytes"] / 2**20
    if zero_stage == 3:
        # Gathered one bucket at a time: never the whole model at once (let alone two copies).
        assert metrics["sync_gathered_max_mb"] < model_mb / 2, metrics
    assert metrics["sync_bytes"] > 0 and metrics["sync_gbps"] > 0


VICTIM = "model.layers.0.mlp.down_proj.weight"


def test_a_push_that_misses_a_parameter_fails_and_the_workers_keep_their_version(untied_workers, learners):
    """vLLM only logs "Following weights were not loaded" and would report the new version with
    one layer at its old weights. A push whose names miss one of the engine's parameters (the
    learner's spec without it), or send it under a name vLLM's loader drops without a word (a
    `.bias` the layer does not have), fails with an error naming it, and no worker reports the
    version. Every bucket was still received: the next whole push goes through."""
    cfg, pool = untied_workers
    with warmed_learner(learners, cfg, 2) as learner:
        channel = WeightSyncChannel(learner, pool, cfg.rollout.dtype, bucket_mb=1, timeout_s=120,
                                    transport="broadcast")
        channel.push(1)
        whole = copy.deepcopy(channel.spec)
        channel.spec["tensors"] = [t for t in whole["tensors"] if t[0] != VICTIM]
        with pytest.raises(WeightSyncError, match=f"loaded .* parameters; not loaded.*{VICTIM}"):
            channel.push(2)
        assert pool.versions() == [1, 1]
        renamed = copy.deepcopy(whole)
        renamed["tensors"] = [[VICTIM.replace(".weight", ".bias") if n == VICTIM else n, shape]
                              for n, shape in whole["tensors"]]
        sends = learner.send_weights(whole)
        receives = [w.receive_weights.remote(renamed, 3) for w in pool.workers]
        ray.get(sends, timeout=120)
        for ref in receives:
            with pytest.raises(ray.exceptions.RayTaskError, match=f"PartialLoadError.*not loaded.*{VICTIM}"):
                ray.get(ref, timeout=120)
        assert pool.versions() == [1, 1]
        channel.spec = whole
        channel.push(4)
        assert pool.versions() == [4, 4]


def test_a_push_waits_for_the_workers_generation_calls_outside_the_sync_timeout(untied_workers, learners):
    """Async mode pushes while the workers generate the next batch: each receive runs only after
    its worker's current call, so the push must start the group (and its timeout) only then.
    Each worker here is busy for far longer than the group's 1 s timeout."""
    cfg, pool = untied_workers
    with warmed_learner(learners, cfg, 2) as learner:
        # broadcast: the sender blocks on receivers that are not there yet (shm would buffer it)
        channel = WeightSyncChannel(learner, pool, cfg.rollout.dtype, bucket_mb=1, timeout_s=1,
                                    transport="broadcast")
        channel.push(1)
        prompts = [(i, f"{i}+{i}=", "", {}) for i in range(64)]
        busy = [w.generate.options(num_returns=len(prompts) + 1).remote(
            *seeded(prompts, range(len(prompts))), n=16, greedy=False) for w in pool.workers]
        ray.wait([refs[-1] for refs in busy], timeout=0.5)  # both calls under way
        channel.push(2)
        assert pool.versions() == [2, 2]
        for refs in busy:  # made before the push, entirely with the weights of version 1
            assert ray.get(refs[-1]).stats["completion_tokens"] > 0
            assert {g.policy_version for g in ray.get(refs[:-1])} == {1}


def test_a_sync_to_a_dead_worker_ends_in_an_error_not_a_hang(untied_workers, learners):
    """Last in this module: it kills one of the untied pool's workers for good (no second pool:
    two test workers' engines already fill most of this machine's memory)."""
    cfg, pool = untied_workers
    with warmed_learner(learners, cfg, 2) as learner:
        channel = WeightSyncChannel(learner, pool, cfg.rollout.dtype, bucket_mb=1, timeout_s=30)
        channel.push(1)
        ray.kill(pool.workers[0])  # no_restart: it stays dead
        # Bounded by sync.timeout_s: an error that names the sync, not a hang.
        with pytest.raises(WeightSyncError, match="weight sync to version 2"):
            channel.push(2)
