"""A rank's peak memory within one step: CUDA's allocator peak on GPU, the process's peak RSS on
CPU; and the C allocator's settings that keep a CPU rank's peak down."""
from __future__ import annotations

import os
from typing import Dict

import torch

from common.config import LearnerConfig

RETURN_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "0",
                       "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
"""glibc's settings for `learner.return_freed_memory`: blocks of 1 MiB and more are mapped on
their own and unmapped when freed, the heap's free top is returned at once, and mapped blocks use
transparent huge pages (where the kernel's THP mode is `madvise`: without them, faulting the
fresh mappings in 4 KiB at a time cost step time, bench/memory_scale.py)."""


def allocator_env(cfg: LearnerConfig) -> Dict[str, str]:
    """The environment a learner rank starts with for `learner.return_freed_memory` (glibc reads
    it once, at the process's start). A variable the driver's environment already sets wins
    (its GLIBC_TUNABLES gets the huge pages added, unless it sets them itself).

    ZeRO-3 gathers each block's parameters and frees them again, twice a step; glibc keeps
    what is freed for reuse (its threshold for mapping a block on its own rises to 32 MiB with
    each such free), the kept blocks fragment, and a rank's resident memory grows step after
    step (bench/memory_scale.py, ZeRO-3 with and without these settings)."""
    on = cfg.return_freed_memory
    if on is None:
        on = cfg.zero_stage == 3 and cfg.num_gpus_per_rank == 0
    if not on:
        return {}
    env = {k: v for k, v in RETURN_FREED_MEMORY.items() if k not in os.environ}
    tunables = os.environ.get("GLIBC_TUNABLES")
    if tunables is not None and "glibc.malloc.hugetlb" not in tunables:  # the user's, and huge pages
        env["GLIBC_TUNABLES"] = f"{tunables}:{RETURN_FREED_MEMORY['GLIBC_TUNABLES']}"
    return env


def reset_peak_memory(on_gpu: bool) -> None:
    """The peak counter back to what is in use now, so that each step reports its own peak:
    CUDA's allocator peak on GPU; on CPU the kernel's VmHWM (`ru_maxrss` cannot be reset),
    reset by writing 5 to /proc/self/clear_refs (Linux 4.0 on; elsewhere the peak since start)."""
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_mb(on_gpu: bool) -> float:
    """This rank's peak memory since `reset_peak_memory`: CUDA's allocator peak on GPU, the
    process's peak RSS (VmHWM) on CPU."""
    if on_gpu:
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024  # kB
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
