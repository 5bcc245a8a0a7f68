"""Step time and learning of `trainer.mode=async` next to `sync`, on the same job.

    .venv/bin/python bench/async_vs_sync.py [--output-dir runs/bench] [overrides...]

Runs `grpo train` once per mode (the default job unless overridden) and tabulates from each
run's metrics.jsonl: mean step time, the mean time of rollout (generate + score) and of the
learner's side (train + weight sync), what a perfect overlap would give (their max) and no
overlap (their sum), staleness, the truncated importance weights, and held-out accuracy.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

GRPO = str(Path(sys.executable).parent / "grpo")


def summarize(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    steady = rows[1:] or rows  # the first step of async mode has nothing generated ahead

    def mean(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in steady)

    rollout = mean("time_generate") + mean("time_reward")
    learner = mean("time_train") + mean("time_weight_sync")
    return {
        "step_s": mean("time_step"), "rollout_s": rollout, "learner_s": learner,
        "max_s": max(rollout, learner), "sum_s": rollout + learner,
        "staleness_mean": mean("staleness_mean"), "dropped_stale": sum(r.get("dropped_stale", 0) for r in rows),
        "is_weight_mean": mean("is_weight_mean"), "is_capped_fraction": mean("is_capped_fraction"),
        "before": summary["heldout_accuracy_before"], "after": summary["heldout_accuracy_after"],
        "minutes": summary["wall_minutes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", default="runs/bench")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results = {}
    for mode in ("sync", "async"):
        name = f"{mode}-{stamp}"
        subprocess.run([GRPO, "train", f"trainer.mode={mode}", f"trainer.run_name={name}",
                        f"trainer.output_dir={args.output_dir}", "trainer.progress=false", *args.overrides],
                       check=True)
        results[mode] = summarize(Path(args.output_dir) / name)
    lines = ["| mode | step time | rollout (generate + score) | learner (train + sync) | max of the two | "
             "sum of the two | staleness, mean | dropped stale | IS weight, mean | IS capped | held-out before -> after | "
             "job minutes |", "| --- |" + " --- |" * 11]
    for mode, r in results.items():
        lines.append(
            f"| {mode} | {r['step_s']:.2f} s | {r['rollout_s']:.2f} s | {r['learner_s']:.2f} s | {r['max_s']:.2f} s | "
            f"{r['sum_s']:.2f} s | {r['staleness_mean']:.2f} | {r['dropped_stale']:.0f} | {r['is_weight_mean']:.3f} | "
            f"{r['is_capped_fraction']:.2%} | {r['before']:.1%} -> {r['after']:.1%} | {r['minutes']:.1f} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.output_dir) / "bench_async_vs_sync.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"command: {' '.join(sys.argv)}\n\n{table}\n\n{json.dumps(results, indent=2)}\n")


if __name__ == "__main__":
    main()
