"""GRPO against PPO with a critic (`algo.adv_estimator=gae`) on the same model, task and pipeline:
peak learner memory, step time and held-out accuracy side by side (the DeepSeekMath paper's claim is
that dropping the critic roughly halves the learner's memory).

    .venv/bin/python bench/ppo_vs_grpo.py [--steps 40] [overrides...]

Each side is a real `grpo train` process with the same overrides; the table is printed as
Markdown. `learner_peak_memory_mb` is the process's peak RSS per learner rank on CPU (CUDA's
allocator peak on GPU); "model state" counts fp32 weights, gradients and AdamW's two moments of
every trained model plus the frozen reference's weights, per replica before ZeRO sharding.
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


def run(name: str, out: str, steps: int, extra: list) -> dict:
    cmd = [GRPO, "train", f"trainer.run_name={name}", f"trainer.output_dir={out}", f"trainer.max_steps={steps}",
           "logger=none", "trainer.progress=false", *extra]
    subprocess.run(cmd, check=True)
    run_dir = Path(out) / name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "final_model" / "config.json").read_text())
    return {"rows": rows, "summary": summary, "config": config}


def param_count(config: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output-dir", default="runs/bench")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results = {}
    for label, extra in (("GRPO", []), ("PPO (critic, GAE)", ["algo.adv_estimator=gae"])):
        name = f"{'ppo' if extra else 'grpo'}-{stamp}"
        results[label] = run(name, args.output_dir, args.steps, [*extra, *args.overrides])
    params = param_count(results["GRPO"]["config"])
    print(f"\nmodel: {params / 1e6:.2f} M parameters; {args.steps} steps; overrides: {' '.join(args.overrides) or '(none)'}\n")
    print("| | peak learner memory per rank | model state per replica | mean step | mean train phase | "
          "held-out before | held-out after |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, res in results.items():
        rows, summary = res["rows"], res["summary"]
        critic = label != "GRPO"
        # fp32 weights + grads + 2 AdamW moments = 16 B per trained parameter; reference: 4 B
        state_mb = params * (16 * (2 if critic else 1) + 4) / 2**20
        print(f"| {label} | {max(r['learner_peak_memory_mb'] for r in rows):,.0f} MB | {state_mb:,.1f} MB | "
              f"{statistics.mean(r['time_step'] for r in rows):.2f} s | "
              f"{statistics.mean(r['time_train'] for r in rows):.2f} s | "
              f"{summary['heldout_accuracy_before']:.1%} | {summary['heldout_accuracy_after']:.1%} |")


if __name__ == "__main__":
    main()
