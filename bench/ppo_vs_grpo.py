"""GRPO against PPO with a critic (`algo.adv_estimator=gae`) on the same model, task and pipeline:
peak learner memory, step time and held-out accuracy side by side (the DeepSeekMath paper's claim is
that dropping the critic roughly halves the learner's memory).

    .venv/bin/python bench/ppo_vs_grpo.py [--steps 40] [overrides...]

Each side is a real `grpo train` process with the same overrides, GRPO then PPO, `--pairs`
rounds (3 by default); the table is printed as Markdown, the ratios per round (bench/compare.py)
and every run go to bench/results/ppo_vs_grpo.json. `learner_peak_memory_mb` is the process's
peak RSS per learner rank on CPU (CUDA's allocator peak on GPU); "model state" is a formula, not
a measurement: fp32 weights, gradients and AdamW's two moments of every trained model plus the
frozen reference's weights, per replica before ZeRO sharding.
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
    parser.add_argument("--pairs", type=int, default=3, help="rounds of GRPO then PPO; ratios are per round")
    parser.add_argument("--output", default=None, help="the JSON result (default bench/results/ppo_vs_grpo.json)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from bench import results_io
    from bench.compare import Comparison

    result = results_io.Result("ppo_vs_grpo")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rounds, params = [], None
    for pair in range(args.pairs):
        results = {}
        for label, extra in (("GRPO", []), ("PPO (critic, GAE)", ["algo.adv_estimator=gae"])):
            name = f"{'ppo' if extra else 'grpo'}-{stamp}-{pair}"
            res = run(name, args.output_dir, args.steps, [*extra, *args.overrides])
            params = params or param_count(res["config"])
            rows, summary = res["rows"], res["summary"]
            # A formula, not a measurement: fp32 weights + grads + 2 AdamW moments = 16 B per
            # trained parameter (the critic's as many again); reference: 4 B
            results[label] = {"peak_mb": max(r["learner_peak_memory_mb"] for r in rows),
                              "state_mb_formula": params * (16 * (2 if extra else 1) + 4) / 2**20,
                              "step_s": statistics.mean(r["time_step"] for r in rows),
                              "train_s": statistics.mean(r["time_train"] for r in rows),
                              "before": summary["heldout_accuracy_before"], "after": summary["heldout_accuracy_after"]}
            result.add_run({"pair": pair, "run": label, "run_name": name, **results[label]})
        rounds.append(results)
    print(f"\nmodel: {params / 1e6:.2f} M parameters; {args.steps} steps; overrides: {' '.join(args.overrides) or '(none)'}\n")
    print("| round | | peak learner memory per rank | model state per replica (formula, not measured) | mean step | "
          "mean train phase | held-out before | held-out after |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for pair, results in enumerate(rounds):
        for label, r in results.items():
            print(f"| {pair + 1} | {label} | {r['peak_mb']:,.0f} MB | {r['state_mb_formula']:,.1f} MB | {r['step_s']:.2f} s "
                  f"| {r['train_s']:.2f} s | {r['before']:.1%} | {r['after']:.1%} |")
    summary = {"params": params}
    for key in ("peak_mb", "step_s"):  # less is better: PPO's / GRPO's, above 1 GRPO is ahead
        cmp = Comparison(a=[r["GRPO"][key] for r in rounds], b=[r["PPO (critic, GAE)"][key] for r in rounds],
                         lower_is_better=True, label_a="GRPO", label_b="PPO")
        summary[key] = cmp.summary()
        print(f"{key}: {cmp.sentence()}")
    result.write(summary, path=Path(args.output) if args.output else None)


if __name__ == "__main__":
    main()
