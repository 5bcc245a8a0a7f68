"""ZeRO-Offload's set-up (learner/engines.py): which configs offload the optimizer, and the start
line that says on how many threads it steps and whether its op must be compiled first
(tests/integration/test_learner_equivalence.py trains with it)."""
from __future__ import annotations

import os
from pathlib import Path

from common.config import LearnerConfig
from learner import engines


def _offload(device):
    return {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": device}}}


def test_only_cpu_and_nvme_offload_the_optimizer():
    assert engines.offloads_optimizer(_offload("cpu")) and engines.offloads_optimizer(_offload("nvme"))
    assert not engines.offloads_optimizer(_offload("none")) and not engines.offloads_optimizer({"zero_optimization": {}})


def test_the_start_line_gives_the_threads_and_says_when_the_op_compiles_and_a_lock_is_held(monkeypatch, tmp_path):
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = LearnerConfig(num_threads=3, deepspeed=_offload("cpu"))
    assert engines.host_optimizer_line(LearnerConfig(num_threads=3), on_gpu=False) is None  # nothing offloaded
    line = engines.prepare_host_optimizer(cfg, on_gpu=False)
    assert os.environ["OMP_NUM_THREADS"] == "3"  # the op's own OpenMP runtime reads it when it loads
    assert "DeepSpeed's CPU Adam, 3 threads" in line and "compiling its op first" in line and "lock" not in line
    folder = Path(_get_build_directory("cpu_adam", verbose=False))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lock").touch()  # what a build killed midway leaves behind
    assert f"its lock file {folder / 'lock'} is held" in engines.prepare_host_optimizer(cfg, on_gpu=False)
    (folder / "cpu_adam.so").touch()
    assert "its op is built" in engines.prepare_host_optimizer(cfg, on_gpu=False)


def test_a_gpu_rank_outside_ray_steps_on_its_reserved_cpus():
    assert engines.host_optimizer_threads(LearnerConfig(num_cpus_per_rank=6), on_gpu=True) == 6
    assert engines.host_optimizer_threads(LearnerConfig(num_cpus_per_rank=0.25), on_gpu=True) == 1
