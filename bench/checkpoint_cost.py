"""What a checkpoint costs against a step: `grpo train` with a save after every step.

    .venv/bin/python bench/checkpoint_cost.py [--sizes default 100M] [--output-dir runs/bench] [overrides...]

For each size, one `grpo train` run with `trainer.save_every=1` (so that there are many saves to
time): `default` is the built-in job for 20 steps; `100M` a 12-layer, 768-wide model (about
100 M parameters) without warm-up for 3 steps of 16 prompts. From the run's summary.json and
metrics.jsonl: the saves (with trainer.max_restarts > 0, the default, one more follows the
warm-up) and their mean seconds, the median step (`time_step`, steps after the first), their
ratio (what `trainer.save_every=1` adds to a step; at the default save_every=10 a tenth of it),
and the size of the last checkpoint on disk. Writes bench/results/checkpoint_cost.json
(bench/results_io.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.results_io
GRPO = str(Path(sys.executable).parent / "grpo")
SIZES = {
    "default": ["trainer.max_steps=20"],
    "100M": ["model.hidden_size=768", "model.num_layers=12", "model.num_heads=12", "model.intermediate_size=3072",
             "warmup.steps=0", "trainer.prompts_per_step=16", "trainer.max_steps=3", "trainer.eval_every=0",
             "data.heldout_size=16"],
}


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [r["time_step"] for r in rows[1:] or rows]
    saves = sorted(p for p in (run_dir / "checkpoints").iterdir() if p.is_dir() and p.name.startswith("step-"))
    per_save = summary["checkpoint_seconds"] / max(summary["checkpoints"], 1)
    step = statistics.median(steps)
    return {"steps": len(rows), "checkpoints": summary["checkpoints"],
            "checkpoint_seconds": summary["checkpoint_seconds"], "seconds_per_save": per_save,
            "step_seconds_median": step, "save_over_step": per_save / step,
            "checkpoint_mb": folder_bytes(saves[-1]) / 2**20 if saves else None,
            "heldout_after": summary["heldout_accuracy_after"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--output-dir", default="runs/bench")
    parser.add_argument("--output", default=None, help="the JSON result (default bench/results/checkpoint_cost.json)")
    parser.add_argument("overrides", nargs="*", help="more grpo train overrides (every run)")
    args = parser.parse_args()
    from bench import results_io

    result = results_io.Result("checkpoint_cost")
    stamp, summary = time.strftime("%Y%m%d-%H%M%S"), {}
    for size in args.sizes:
        name = f"checkpoint-cost-{size}-{stamp}"
        subprocess.run([GRPO, "train", *SIZES[size], "trainer.save_every=1", "logger=none", "trainer.progress=false", f"trainer.run_name={name}",
                        f"trainer.output_dir={args.output_dir}", *args.overrides], check=True)
        figures = measure(Path(args.output_dir) / name)
        result.add_run({"size": size, "overrides": SIZES[size], **figures})
        summary[size] = figures
        print(f"{size}: {figures['checkpoints']} saves of {figures['seconds_per_save']:.2f} s against a "
              f"{figures['step_seconds_median']:.2f} s step ({figures['save_over_step']:.2f}x), "
              f"{figures['checkpoint_mb']:.0f} MB on disk", flush=True)
    result.write(summary, path=Path(args.output) if args.output else None)


if __name__ == "__main__":
    main()
