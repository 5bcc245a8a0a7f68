"""Build DeepSpeed's CPU Adam op (ZeRO-Offload's optimizer) now, not in a run's first step.

    python -m learner.build_ops

DeepSpeed compiles the op on first use, once per machine, into torch's extensions folder: minutes
on a few cores, which a run with an offloaded optimizer would otherwise spend before its first
step on every node that has not built it. `make test` runs this before the tests. Prints what it
found or built; exits 0 when the op loads.
"""
from __future__ import annotations

import sys
import time


def main() -> int:
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get("cpu_adam"):
        print("DeepSpeed's CPU Adam: prebuilt in the installed package")
        return 0
    from deepspeed.ops.op_builder import CPUAdamBuilder

    started = time.monotonic()
    CPUAdamBuilder().load(verbose=False)
    print(f"DeepSpeed's CPU Adam: built or found in torch's extensions folder ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
