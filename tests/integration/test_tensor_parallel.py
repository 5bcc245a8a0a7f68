"""Tensor parallelism on vLLM's CPU build: an engine of 2 TP ranks (processes inside its Ray actor,
vLLM's `mp` executor) starts, both ranks join the weight-sync group, and after a push the engine
holds exactly what a fresh TP-2 engine loaded from the saved weights holds. In the layout GPUs
use (the engine core in a process of its own) a killed engine leaves no process behind. An engine
that cannot start says why in one line."""
from __future__ import annotations

import copy
import signal
import time
from dataclasses import replace

import psutil
import ray

from cluster.loop.sync_channel import WeightSyncChannel
from helpers import GRPO, compiled_graphs, engine_state, greedy_ids, run, small_overrides, warmed_learner
from rollout.pool import RolloutPool
from rollout.worker import GenerationWorker, cpu_thread_binding


def test_cpu_thread_binding_splits_the_cpus_between_ranks():
    assert cpu_thread_binding([0, 1], 2) == "0|1"
    assert cpu_thread_binding([0, 1, 2, 3, 4], 2) == "0,1,2|3,4"
    assert cpu_thread_binding([3], 2) == "3|3"


def test_a_tp2_engine_syncs_exactly(learners, system_cfg, tmp_path):
    cfg = copy.deepcopy(system_cfg)
    cfg.rollout.tensor_parallel_size = 2
    pool = RolloutPool(cfg.model.path, replace(cfg.rollout, num_workers=1, num_cpus_per_worker=0.5), 0)
    try:
        with warmed_learner(learners, cfg, 2) as learner:
            assert pool.sync_ranks == 2
            channel = WeightSyncChannel(learner, pool, cfg.rollout.dtype, bucket_mb=0.25, timeout_s=120)
            channel.push(3)
            assert pool.versions() == [3]
            synced = engine_state(pool.workers[0])
            # Prompt log-probs went through vLLM's sampler helper in both rank processes: nothing
            # was compiled there either (rollout/worker.py no_compile reaches the ranks).
            count = compiled_graphs()
            graphs = ray.get(pool.workers[0].__ray_call__.remote(lambda w: w.llm.collective_rpc(count)))
            assert graphs == [0, 0], graphs
            folder = learner.save_pretrained(str(tmp_path / "saved"))
    finally:
        pool.shutdown()  # one TP-2 engine at a time: this machine's memory
    assert len(synced[2]) == 2, "both tensor-parallel ranks report their shard"
    fresh = ray.remote(num_cpus=0.5)(GenerationWorker).remote(folder, cfg.rollout, 123)
    try:
        expected = engine_state(fresh)
    finally:
        ray.kill(fresh)
    assert synced[0] == expected[0], "greedy outputs differ from a fresh TP-2 engine's"
    assert synced[1] == expected[1], "prompt log-probs differ from a fresh TP-2 engine's"
    assert synced[2] == expected[2], "a rank's parameters differ from a fresh TP-2 engine's"


def test_a_killed_engine_leaves_no_process_and_its_restart_syncs(learners, system_cfg):
    """The layout GPUs use, on CPU: vLLM's engine core in a child process of the actor and its
    worker below it (a grandchild, as tensor-parallel ranks are), neither of which watches the actor. SIGKILLed, the actor takes every engine
    process with it (common/reaper.py); the restarted actor is re-synced and takes the next push."""
    cfg = copy.deepcopy(system_cfg)
    cfg.rollout.engine_core = "process"
    pool = RolloutPool(cfg.model.path, replace(cfg.rollout, num_workers=1, num_cpus_per_worker=0.5), 0)
    try:
        with warmed_learner(learners, cfg, 2) as learner:
            channel = WeightSyncChannel(learner, pool, cfg.rollout.dtype, bucket_mb=0.25, timeout_s=120)
            pool.recover = channel.recover
            channel.push(1)
            before = greedy_ids(pool.workers[0])
            actor = psutil.Process(ray.get(pool.workers[0].pid.remote()))
            # The engine core is a child of the actor and its worker a grandchild, besides
            # multiprocessing's resource trackers and the reaper. Found by where they are, not by
            # the titles vLLM gives them (`VLLM::EngineCore`, `VLLM::Worker`): two suite runs on 2
            # busy cores read a worker untitled (`python ... spawn_main`) after it had served.
            deadline = time.monotonic() + 30
            while True:
                descendants = actor.children(recursive=True)
                engine = [(p, _parent(p)) for p in descendants
                          if not any(other in _cmdline(p) for other in ("resource_tracker", "common.reaper"))]
                children = {p.pid for p, parent in engine if parent == actor.pid}
                found = bool(children) and any(parent in children for _, parent in engine)
                if found or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert found, [(p.pid, parent, _cmdline(p)[-80:]) for p, parent in engine]
            # SIGKILL, as the OOM killer or a crash ends it: `ray.kill` would go through the
            # worker's own exit, which kills its direct children itself.
            actor.send_signal(signal.SIGKILL)
            _, alive = psutil.wait_procs([actor, *descendants], timeout=60)
            assert not alive, [(p.pid, p.name()) for p in alive]
            pool._restarted(0)  # what a generate call does when its worker died
            assert pool.versions() == [1]
            assert greedy_ids(pool.workers[0]) == before, "the restarted engine lacks the pushed weights"
            channel.push(2)
            assert pool.versions() == [2]
    finally:
        pool.shutdown()


def _cmdline(process) -> str:
    try:
        return f"{process.name()} {' '.join(process.cmdline())}"
    except psutil.NoSuchProcess:
        return ""


def _parent(process) -> int:
    try:
        return process.ppid()
    except psutil.NoSuchProcess:
        return -1


def test_an_engine_that_cannot_start_names_its_root_cause(tmp_path, model_cache):
    # A KV cache too small for one block: vLLM's engine core fails in its child process, where
    # the driver would otherwise see only "Engine core initialization failed. See root cause above".
    # One learner rank and one verifier: the other roles only compete with the engine's start here.
    result = run(GRPO, "train", *small_overrides(model_cache, str(tmp_path)), "rollout.kv_cache_gib=0.00001",
                 "rollout.num_workers=1", "learner.num_ranks=1", "reward.num_workers=1", "trainer.max_steps=1",
                 timeout=600)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert "the vLLM engine did not start: ValueError: No available memory for the cache blocks" in lines[0], lines[0]
