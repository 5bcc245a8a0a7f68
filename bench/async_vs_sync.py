"""Step time and learning of `trainer.mode=async` next to `sync`, on the same job.

    .venv/bin/python bench/async_vs_sync.py [--output-dir runs/bench] [overrides...]

Runs `grpo train` in each mode, sync then async, `--pairs` rounds (3 by default; the default job
unless overridden), and tabulates from each run's metrics.jsonl: mean step time, the mean time of rollout (generate + score) and of the
learner's side (train + weight sync), what a perfect overlap would give (their max) and no
overlap (their sum), staleness, the truncated importance weights, and held-out accuracy; then
async's speed-up over sync per round, as the median with its range (bench/compare.py). The runs
and the summary go to bench/results/async_vs_sync.json (bench/results_io.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.results_io, bench.compare
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
    parser.add_argument("--pairs", type=int, default=3, help="rounds of sync then async")
    parser.add_argument("--output", default=None, help="the JSON result (default bench/results/async_vs_sync.json)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from bench import results_io
    from bench.compare import Comparison

    result = results_io.Result("async_vs_sync")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rounds = []
    for pair in range(args.pairs):
        results = {}
        for mode in ("sync", "async"):
            name = f"{mode}-{stamp}-{pair}"
            subprocess.run([GRPO, "train", f"trainer.mode={mode}", f"trainer.run_name={name}",
                            f"trainer.output_dir={args.output_dir}", "trainer.progress=false", *args.overrides],
                           check=True)
            results[mode] = summarize(Path(args.output_dir) / name)
            result.add_run({"pair": pair, "mode": mode, **results[mode]})
        rounds.append(results)
    lines = ["| round | mode | step time | rollout (generate + score) | learner (train + sync) | max of the two | "
             "sum of the two | staleness, mean | dropped stale | IS weight, mean | IS capped | held-out before -> after | "
             "job minutes |", "| --- | --- |" + " --- |" * 11]
    for pair, results in enumerate(rounds):
        for mode, r in results.items():
            lines.append(
                f"| {pair + 1} | {mode} | {r['step_s']:.2f} s | {r['rollout_s']:.2f} s | {r['learner_s']:.2f} s | {r['max_s']:.2f} s | "
                f"{r['sum_s']:.2f} s | {r['staleness_mean']:.2f} | {r['dropped_stale']:.0f} | "
                f"{r['is_weight_mean']:.3f} | {r['is_capped_fraction']:.2%} | {r['before']:.1%} -> {r['after']:.1%} "
                f"| {r['minutes']:.1f} |")
    cmp = Comparison(a=[r["async"]["step_s"] for r in rounds], b=[r["sync"]["step_s"] for r in rounds],
                     lower_is_better=True, label_a="async", label_b="sync")
    print("\n".join(lines))
    print(f"step time, speed-up: {cmp.sentence()}")
    summary = {"step_s_speedup": cmp.summary(),
               **{f"{mode}_{key}": results_io.spread(r[mode][key] for r in rounds)
                  for mode in ("sync", "async") for key in ("step_s", "rollout_s", "learner_s", "after")}}
    result.write(summary, path=Path(args.output) if args.output else None)


if __name__ == "__main__":
    main()
