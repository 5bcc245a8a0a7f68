"""Run the built-in job (the `make demo` default) for one or more seeds; tabulate before/after/minutes.

    .venv/bin/python bench/default_run.py --seeds 0 1 [extra overrides...]
    .venv/bin/python bench/default_run.py --name tools --minutes 10 data=mul 'rollout.tools=[calculator]'

Each run is a real `grpo train` process; the table is printed as Markdown and saved next to the
runs as `bench_default_run.md`. With `--record`, every run's summary and the table's figures also
go to the benchmark's one current result file, bench/results/<name>_run.json (default_run.json),
with the command, commit, host and load average (bench/results_io.py).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `from bench import results_io` as a script

GRPO = str(Path(sys.executable).parent / "grpo")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--output-dir", default="runs/bench")
    parser.add_argument("--name", default="default", help="run name prefix and table file suffix")
    parser.add_argument("--minutes", type=float, default=6.0, help="the bar's process minutes")
    parser.add_argument("--record", action="store_true",
                        help="also write the result file bench/results/<name>_run.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from bench import results_io

    result = results_io.Result(f"{args.name}_run")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for seed in args.seeds:
        name = f"{args.name}-seed{seed}-{stamp}"
        cmd = [GRPO, "train", f"trainer.seed={seed}", f"trainer.run_name={name}",
               f"trainer.output_dir={args.output_dir}", *args.overrides]
        started = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout[-1500:], proc.stderr[-1500:], flush=True)
        proc.check_returncode()
        wall = (time.time() - started) / 60
        summary = json.loads((Path(args.output_dir) / name / "summary.json").read_text())
        warm = re.search(r"warm-up: (\d+) supervised steps.*?(?:probe accuracy ([\d.]+)%)?$", proc.stdout, re.M)
        rows.append((seed, warm.group(1) if warm else "0", summary["heldout_accuracy_before"],
                     summary["heldout_accuracy_after"], summary["wall_minutes"], wall))
        result.add_run({"seed": seed, "run_name": name, "warmup_steps": int(rows[-1][1]),
                        "process_minutes": wall, "summary": summary})
    lines = ["| seed | warm-up steps | held-out before GRPO | after GRPO | gain (points) | job minutes | "
             f"process minutes | +20 points to 80% within {args.minutes:g} min |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    met = 0
    for seed, warm, before, after, minutes, wall in rows:
        # In points, rounded: accuracies are shares of the held-out problems (0.87 - 0.67 < 0.2 in floats).
        ok = round(100 * (after - before), 6) >= 20 and round(100 * after, 6) >= 80 and wall <= args.minutes
        met += ok
        lines.append(f"| {seed} | {warm} | {before:.1%} | {after:.1%} | {100 * (after - before):+.1f} | {minutes:.1f} | "
                     f"{wall:.1f} | {'yes' if ok else 'no'} |")
    lines.append(f"\n{met} of {len(rows)} seeds met the bar.")
    table = "\n".join(lines)
    print(table)
    out = Path(args.output_dir) / ("bench_default_run.md" if args.name == "default" else f"bench_{args.name}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"command: {' '.join(sys.argv)}\n\n{table}\n")
    if args.record:
        result.write(overrides=args.overrides, summary={
            "seeds_meeting_the_bar": met, "seeds": len(rows),
            "heldout_before": results_io.spread(r[2] for r in rows),
            "heldout_after": results_io.spread(r[3] for r in rows),
            "gain_points": results_io.spread(100 * (r[3] - r[2]) for r in rows),
            "job_minutes": results_io.spread(r[4] for r in rows)})


if __name__ == "__main__":
    main()
