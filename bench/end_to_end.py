"""The default job, end to end, from one run: throughput, where a step's time goes, time to the bar.

    .venv/bin/python bench/end_to_end.py [--bar 0.9] [--output-dir runs/bench] [overrides...]
    .venv/bin/python bench/end_to_end.py --from-run runs/bench/<name>   # a run already made

Runs `grpo train` (the built-in job unless overridden; held-out accuracy every 10 steps) and
reports from its metrics.jsonl and summary.json: completions/s and completion tokens/s over the
GRPO steps, the share of step time in each phase, the overhead (step time spent in none of
generation, scoring, training or weight sync: the driver, Ray calls, the buffer), and the time
from the first GRPO step to the first held-out evaluation at or above the bar; and per phase the
median seconds a step over steps 2 and on (the first pays the engines' first requests). The run
and its figures go to bench/results/end_to_end.json (bench/results_io.py).
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
PHASES = ("time_generate", "time_reward", "time_train", "time_weight_sync")


def report(run_dir: Path, bar: float) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    # Wall time between the end of step 1 and of the last step: everything a step costs,
    # evaluations and checkpoints included (the first step's start-up is left out).
    timed = rows[1:]
    wall = rows[-1]["wall_seconds"] - rows[0]["wall_seconds"]
    phases = {p: sum(r.get(p, 0.0) for r in timed) for p in PHASES}
    evaluation = sum(r.get("time_eval", 0.0) for r in timed)
    elapsed, reached = 0.0, None
    for r in rows:
        elapsed = r["wall_seconds"] - rows[0]["wall_seconds"] + rows[0]["time_step"]
        if reached is None and r.get("heldout_accuracy") is not None and r["heldout_accuracy"] >= bar:
            reached = (r["step"], elapsed)
    return {
        "steps": len(rows), "step_s": wall / len(timed),
        "completions_per_s": sum(r["completions"] for r in timed) / wall,
        "tokens_per_s": sum(r["completion_tokens"] for r in timed) / wall,
        "shares": {p: phases[p] / wall for p in PHASES},
        "median_s": {p: statistics.median(r.get(p, 0.0) for r in timed) for p in ("time_step", *PHASES)},
        "first_step_s": rows[0]["time_step"],
        "eval_share": evaluation / wall,
        "overhead_share": max(wall - sum(phases.values()) - evaluation, 0.0) / wall,
        "bar": bar, "reached": reached,
        "before": summary["heldout_accuracy_before"], "after": summary["heldout_accuracy_after"],
        "job_minutes": summary["wall_minutes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bar", type=float, default=0.9, help="held-out greedy accuracy to reach")
    parser.add_argument("--output-dir", default="runs/bench")
    parser.add_argument("--from-run", default=None, help="report on this run folder instead of running")
    parser.add_argument("--output", default=None, help="the JSON result (default bench/results/end_to_end.json)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from bench import results_io

    result = results_io.Result("end_to_end")
    if args.from_run:
        run_dir = Path(args.from_run)
    else:
        name = time.strftime("e2e-%Y%m%d-%H%M%S")
        subprocess.run([GRPO, "train", f"trainer.run_name={name}", f"trainer.output_dir={args.output_dir}",
                        "trainer.eval_every=10", "trainer.progress=false", *args.overrides], check=True)
        run_dir = Path(args.output_dir) / name
    r = report(run_dir, args.bar)
    reached = (f"step {r['reached'][0]}, {r['reached'][1] / 60:.1f} min of GRPO steps" if r["reached"]
               else f"not reached in {r['steps']} steps")
    lines = [
        "| measure | value |", "| --- | --- |",
        f"| GRPO steps | {r['steps']} ({r['step_s']:.2f} s each on average, wall clock) |",
        f"| completions/s | {r['completions_per_s']:.1f} |",
        f"| completion tokens/s | {r['tokens_per_s']:.0f} |",
        *[f"| median seconds a step, steps 2-{r['steps']}: {p[5:].replace('_', ' ')} | {s:.3f} s |"
          for p, s in r["median_s"].items()],
        f"| first GRPO step | {r['first_step_s']:.2f} s |",
        *[f"| share of step time: {p[5:].replace('_', ' ')} | {share:.1%} |" for p, share in r["shares"].items()],
        f"| share of step time: held-out evaluation (every 10 steps) | {r['eval_share']:.1%} |",
        f"| share of step time: overhead (none of the above) | {r['overhead_share']:.1%} |",
        f"| held-out greedy accuracy | {r['before']:.1%} -> {r['after']:.1%} |",
        f"| time to {r['bar']:.0%} held-out accuracy | {reached} |",
        f"| whole job (start-up, warm-up, evaluations included) | {r['job_minutes']:.1f} min |",
    ]
    table = "\n".join(lines)
    print(table)
    out = run_dir.parent / "bench_end_to_end.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"command: {' '.join(sys.argv)}\n\n{table}\n\n{json.dumps(r, indent=2)}\n")
    result.add_run({"run_dir": str(run_dir), **r})
    result.write(r, path=Path(args.output) if args.output else None)


if __name__ == "__main__":
    main()
