"""A real learner step (DeepSpeed on the CPU) at Qwen2.5's 151,936-token vocabulary: its memory
follows the micro-batch token budget, not the batch (learner/logprobs.py, every forward micro-batched);
and the C allocator settings a learner rank's process starts with."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from helpers import EnvProbe

SCENARIO = str(Path(__file__).with_name("memory_scenario.py"))


def test_a_learner_step_at_a_real_vocabulary_stays_within_the_token_budget(tmp_path):
    """151,936-token vocabulary, 700-token rows, budget 700 tokens (one row per micro-batch).
    What a micro-batch may hold at once: its logits, their gradient and float32 chunks, under
    3 x budget x vocab x 4 bytes (1.28 GB); the full batch's logits alone would be 4 x 425 MB,
    with a float32 log-softmax 3 more copies. Twice the rows must not raise the peak: holding the
    logits of more than one micro-batch at once would add at least 425 MB a row (850 MB for the
    2 more rows), while the peak of steps of one size varies by about 110 MB from step to
    step (897-1006 MiB over 7 steps of one process), so the allowance is half a row's logits."""
    budget, vocab = 700, 151936
    # the first step (its one-time allocations) is not measured
    proc = subprocess.run([sys.executable, SCENARIO, str(tmp_path), str(budget), "2", "2", "4"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    bound = 3 * budget * vocab * 4
    small, large = out["2"], out["4"]
    assert large["micro_batches"] == 4 and small["micro_batches"] == 2
    assert small["rise_bytes"] <= bound and large["rise_bytes"] <= bound, out
    assert large["rise_bytes"] <= small["rise_bytes"] + budget * vocab * 4 / 2, out


def test_log_probs_at_a_real_vocabulary_hold_one_copy_of_the_logits(tmp_path):
    """learner/logprobs.py's forward and backward on 2 x 512 tokens at 151,936 entries (one
    float32 copy of the logits: 622 MB, well above the process's noise): the logits exist once
    (the backward writes their gradient over them), the rest is float32 chunks and the head's
    weight gradient. The peak rise must stay at most 2.2 logits-sized copies (3.1 before the
    one-pass computation: the strided slice's copy, entropy's copy, a separate gradient) and
    within learner/memory_plan.py's terms for the micro-batch plus 15%."""
    proc = subprocess.run([sys.executable, SCENARIO, str(tmp_path), "logprobs", "2"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rise_bytes"] <= 2.2 * out["logits_bytes"], out
    assert out["rise_bytes"] <= 1.15 * out["plan_bytes"], out


@pytest.mark.parametrize("zero_stage, returned", [(3, True), (2, False)])
def test_zero3_ranks_on_cpus_start_with_freed_memory_returned(ray_session, zero_stage, returned):
    """Ray starts each rank's process with learner/peak_memory.py's glibc settings under ZeRO-3,
    merged with the variables of the job and of the rank's own options, and without them under
    ZeRO-2."""
    from common.config import AlgoConfig, LearnerConfig
    from learner.group import LearnerGroup
    from learner.peak_memory import RETURN_FREED_MEMORY

    job_env = dict(ray.get_runtime_context().runtime_env.get("env_vars") or {})
    placed = {"PLACED": "1"}
    cfg = LearnerConfig(num_ranks=2, zero_stage=zero_stage, num_cpus_per_rank=0)
    group = LearnerGroup("no model", cfg, AlgoConfig(), 8, 0, rank_class=EnvProbe,
                         placement=lambda i: {"runtime_env": {"env_vars": placed}})
    try:
        envs = ray.get([rank.__ray_call__.remote(lambda probe: probe.env) for rank in group.ranks])
    finally:
        for rank in group.ranks:
            ray.kill(rank)
    for env in envs:
        assert job_env.items() <= env.items() and placed.items() <= env.items()
        assert (RETURN_FREED_MEMORY.items() <= env.items()) == returned
        assert returned or not RETURN_FREED_MEMORY.keys() & env.keys()
