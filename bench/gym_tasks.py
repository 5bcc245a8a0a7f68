"""The built-in model on reasoning-gym tasks: warm-up, then GRPO; held-out score before and after.

    .venv/bin/python bench/gym_tasks.py [--presets gym_addition gym_chain_sum gym_basic_arithmetic ...]
                                        [--seed 0] [--minutes 10] [overrides...]

Each preset (conf/data/gym_*.yaml) is one real `grpo train data=<preset>` process: the supervised
warm-up on the tasks' bare answers until the probe reaches warmup.target_accuracy, then GRPO
against the task's own score_answer (the `reasoning_gym` verifier). The held-out score is the
mean greedy score on data.heldout_size problems never trained on (the task's partial credit, 1
for a right answer). Each run is appended as one line to bench/results/gym_tasks.jsonl (the
command, commit, host, load average before and after, reasoning-gym's version, the run's
summary, and whether it gained 20 points within `--minutes` of process time); the table prints.
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
RESULT = Path(__file__).resolve().parent / "results" / "gym_tasks.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", default=["gym_addition", "gym_chain_sum", "gym_basic_arithmetic",
                                                         "gym_spell_backward"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="runs/bench")
    parser.add_argument("--minutes", type=float, default=10.0, help="the bar's process minutes")
    parser.add_argument("--no-record", action="store_true", help="print only; leave the result file alone")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from bench import results_io
    from data.reasoning_gym import gym_version

    lines = ["| preset | warm-up steps | probe | held-out before GRPO | after GRPO | gain (points) | process minutes "
             f"| +20 points within {args.minutes:g} min |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for preset in args.presets:
        before_load = results_io.loadavg()
        name = f"{preset}-seed{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        cmd = [GRPO, "train", f"data={preset}", f"trainer.seed={args.seed}", f"trainer.run_name={name}",
               f"trainer.output_dir={args.output_dir}", "logger=none", "trainer.progress=false", *args.overrides]
        started = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        minutes = (time.time() - started) / 60
        print(proc.stdout[-1500:], proc.stderr[-1500:], flush=True)
        proc.check_returncode()
        summary = json.loads((Path(args.output_dir) / name / "summary.json").read_text())
        warm = re.search(r"warm-up: (\d+) supervised steps.*?(?:probe accuracy ([\d.]+)%)?$", proc.stdout, re.M)
        before, after = summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]
        gain = 100 * (after - before)
        met = gain >= 20 and minutes <= args.minutes
        run = {"preset": preset, "seed": args.seed, "run_name": name, "reasoning_gym": gym_version(),
               "warmup_steps": int(warm.group(1)) if warm else 0,
               "warmup_probe": float(warm.group(2)) / 100 if warm and warm.group(2) else None,
               "heldout_before": before, "heldout_after": after, "gain_points": gain,
               "process_minutes": minutes, "gained_20_within_minutes": met, "summary": summary}
        if not args.no_record:
            results_io.append_jsonl(RESULT, run, "gym_tasks", before_load, argv=sys.argv)
        probe = f"{run['warmup_probe']:.1%}" if run["warmup_probe"] is not None else "-"
        lines.append(f"| {preset} | {run['warmup_steps']} | {probe} | {before:.1%} | {after:.1%} | {gain:+.1f} | "
                     f"{minutes:.1f} | {'yes' if met else 'no'} |")
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
