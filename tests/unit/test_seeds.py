"""The run's seeds, pinned: every formula as runs checkpointed before it moved into one module
derived it (a change here changes every seeded run's samples)."""
from __future__ import annotations

import subprocess
import sys

from common import seeds


def test_each_seed_is_the_formula_runs_were_made_with():
    for run_seed, step, round_ in [(0, 1, 0), (3, 17, 2), (12345, 999, 1)]:
        assert seeds.round_seed(run_seed, step, round_) == run_seed * 1_000_003 + step + round_ * 1_000_000_007
        assert seeds.regenerated_seed(run_seed, step) == run_seed * 1_000_003 + step + 7_777_777
        assert seeds.warmup_seed(run_seed, step) == run_seed + step
    assert seeds.engine_seed(5, 2) == 7 and seeds.epoch_seed(1, 4) == 5
    assert seeds.prompt_seed(1_000_004, 7) == hash((1_000_004, 7)) % 2**31
    assert seeds.call_seed([1, 2, 3]) == hash((1, 2, 3)) % 2**31
    assert seeds.sample_seed(123, 4) == 123 * 1009 + 4
    assert seeds.turn_seed(2**31 - 1, 2) == (2**31 - 1 + 2 * 7919) % 2**31


def test_seeds_are_the_same_in_every_process():
    """str hashing is salted per process; the seeds hash only ints, so a worker on another node
    derives the same ones."""
    code = "from common import seeds; print(seeds.prompt_seed(1_000_004, 7), seeds.call_seed([9, 8]))"
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={"PYTHONHASHSEED": str(salt), "PYTHONPATH": "."}).stdout for salt in (1, 2)}
    assert outputs == {f"{seeds.prompt_seed(1_000_004, 7)} {seeds.call_seed([9, 8])}\n"}
