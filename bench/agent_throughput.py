"""Completion tokens/s of an agent through the endpoint against the built-in episode loop.

    .venv/bin/python bench/agent_throughput.py [--steps 6] [--warmup-steps 300 | --model DIR] [--output-dir runs/bench] \
        [overrides...]

On the multiplication task with the model for agents: one `grpo train data=mul_agent` run
whose supervised warm-up teaches the model the calculator's call (its final_model is then the
model of both measured runs, so both start from the same weights and make real calls), then,
from that model with no warm-up, `--steps` GRPO steps each of

- `agent`: every sample an episode of examples/calculator_agent.py (offering the loop's own
  schema of the calculator: same_schema_agent), which talks to its
  session of a generation worker's OpenAI-compatible endpoint with the `openai` client;
- `loop`: the built-in episode loop doing the same calls in the same format
  (`rollout.tool_format=hermes`, the calculator as a tool in the chat template's tools section).

Reported from each run's metrics.jsonl over the steps after the first: sampled completion tokens
per second of generation (tool results excluded: the episode loop counts them in
completion_tokens and reports their share), turns per episode, and the agent's ratio to the loop.
The two runs' samples differ (the agent's tool description is its own, and a call's result is
read by the agent's parser or the loop's), so the turns per episode are printed beside the rates.
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
COMMON = ["data=mul_agent", "trainer.progress=false", "logger=none", "trainer.eval_every=0", "trainer.save_every=0",
          "trainer.max_restarts=0", "data.heldout_size=8"]  # the held-out accuracy is not what is measured


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (other jobs on the machine change every figure)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def train(out: Path, name: str, *overrides: str) -> Path:
    subprocess.run([GRPO, "train", *COMMON, f"trainer.output_dir={out}", f"trainer.run_name={name}", *overrides],
                   check=True)
    return out / name


def rates(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows  # the first step pays the engines' first requests

    def sampled(row: dict) -> float:
        return row["completion_tokens"] * (1.0 - row.get("observation_token_fraction", 0.0))

    per_step = [sampled(r) / r["time_generate"] for r in steady]
    return {"tokens_per_s": statistics.median(per_step), "turns_mean": statistics.mean(r["turns_mean"] for r in steady),
            "sampled_tokens_per_step": statistics.mean(sampled(r) for r in steady),
            "generate_s": statistics.median(r["time_generate"] for r in steady), "steps": len(steady)}


def same_schema_agent(client, row, index):
    """examples/calculator_agent.py offering the calculator with the episode loop's own schema
    (common/tool_formats.py), so that both runs' prompts render the same tools section and the
    model makes the same kind of calls in both (bench/results/agent_throughput.md: with the
    example's own description the two runs' calls per episode differed)."""
    from common.tool_formats import tool_schemas
    from examples import calculator_agent

    calculator_agent.TOOLS = tool_schemas(["calculator"], {})
    return calculator_agent.run(client, row, index)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--output-dir", default="runs/bench")
    parser.add_argument("--model", default=None,
                        help="a model for agents already trained (a run's final_model): no warm-up run")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    parser.add_argument("overrides", nargs="*", help="more grpo train overrides (every run)")
    args = parser.parse_args()
    out = Path(args.output_dir) / f"agent-throughput-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.model is None:
        warm = train(out, "warm", f"warmup.steps={args.warmup_steps}", "trainer.max_steps=0", *args.overrides)
        args.model = str(warm / "final_model")
    model = ["model=hf", f"model.path={args.model}", "warmup.steps=0", f"trainer.max_steps={args.steps}"]
    results = {}
    runs = {"agent": ["rollout.agent=bench.agent_throughput:same_schema_agent"],
            # The chat template as the endpoint renders every request (`auto` leaves a base
            # model's plain rows as they are: the loop's model then ends each episode at once).
            "loop": ["rollout.agent=null", "rollout.tools=[calculator]", "rollout.tool_format=hermes",
                     "data.chat_template=true"]}
    for name, extra in runs.items():
        before = load_average()
        results[name] = rates(train(out, name, *model, *extra, *args.overrides))
        results[name]["load_average"] = f"{before} -> {load_average()}"
    results["ratio"] = results["agent"]["tokens_per_s"] / results["loop"]["tokens_per_s"]
    lines = ["| | sampled tokens/s (median step) | generate seconds (median) | sampled tokens a step | turns "
             "per episode | load average (before -> after) |", "| --- | --- | --- | --- | --- | --- |"]
    for name in ("agent", "loop"):
        r = results[name]
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {r['generate_s']:.2f} | {r['sampled_tokens_per_step']:.0f} "
                     f"| {r['turns_mean']:.2f} | {r['load_average']} |")
    print("\n".join(lines))
    print(f"agent / loop: {results['ratio']:.2f}")
    if args.output:
        Path(args.output).write_text(json.dumps({"command": sys.argv, **results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
