"""A rank's peak memory within one step: CUDA's allocator peak on GPU, the process's peak RSS on CPU."""
from __future__ import annotations

import torch


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
