"""The long-tailed built-in task (`data=long_tail`): how long its answers are, and whether GRPO
still gains on it after the warm-up.

    .venv/bin/python bench/long_tail_task.py [--seed 0] [--steps 40] [--output-dir runs/bench] [overrides...]
    .venv/bin/python bench/long_tail_task.py --from-run runs/bench/<name>   # a run already made
    .venv/bin/python bench/long_tail_task.py --result --compare runs/bench/<an earlier variant's run>

Runs `grpo train data=long_tail` for `--steps` GRPO steps (every checkpoint kept, held-out
accuracy every 10 steps), then exports two of its checkpoints as Hugging Face folders: step 0
(the model right after the warm-up, before any GRPO step) and the last. With each it samples
`--prompts` training prompts x group_size completions at the rollout's temperature (one step's
batch, as the generation workers would) and reports the completion lengths in tokens: median,
p90, max, max/median, and per batch of trainer.prompts_per_step prompts the longest over the
shortest; and it decodes the held-out problems greedily for the accuracy per digit count. The
run's own held-out accuracy before and after GRPO (summary.json) and its curve are reported
beside them. Each --compare run folder (a variant of the preset, e.g. another warm-up target) is
measured the same way and recorded beside it. With --result, writes bench/results/long_tail_task.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GRPO = str(Path(sys.executable).parent / "grpo")
RESULT = ROOT / "bench" / "results" / "long_tail_task.json"
MEANS = ("padded_fraction", "micro_batches", "sampler_logprob_gap", "mismatch_k3", "mismatch_chi2",
         "masked_fraction_mis", "masked_fraction_icepop", "masked_fraction_seq_mask", "is_capped_fraction",
         "truncated_fraction", "kl", "time_train", "time_generate")


def quantile(values, q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def length_summary(lengths, batch_rows: int) -> dict:
    """Median, p90, max and max/median of completion lengths; the longest over the shortest
    within each batch of `batch_rows` completions (in sampling order)."""
    median = statistics.median(lengths)
    spreads = [max(lengths[i:i + batch_rows]) / max(min(lengths[i:i + batch_rows]), 1)
               for i in range(0, len(lengths) - batch_rows + 1, batch_rows)]
    return {"n": len(lengths), "median": median, "p90": quantile(lengths, 0.9), "max": max(lengths),
            "mean": sum(lengths) / len(lengths), "max_over_median": max(lengths) / median,
            "batch_max_over_min": spreads}


def sample_lengths(model_dir: str, prompts, group_size: int, max_new_tokens: int, temperature: float,
                   seed: int, chunk: int = 64):
    """Token lengths of `group_size` sampled completions per prompt (EOS counted, as the rollout
    counts it), with transformers' `generate`: the same distribution as the engines sample."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lengths = []
    texts = [p for p in prompts for _ in range(group_size)]
    for i in range(0, len(texts), chunk):
        batch = tokenizer(texts[i:i + chunk], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                                 max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        for row in out[:, batch["input_ids"].shape[1]:].tolist():
            n = len(row)
            if tokenizer.eos_token_id in row:
                n = row.index(tokenizer.eos_token_id) + 1
            lengths.append(n)
    return lengths


def greedy_accuracy(model_dir: str, problems, max_new_tokens: int, chunk: int = 100) -> dict:
    """Greedy held-out accuracy, overall and by the longer operand's digit count."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.answers import extract_answer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    by_digits: dict = {}
    for i in range(0, len(problems), chunk):
        rows = problems[i:i + chunk]
        batch = tokenizer([p.prompt for p in rows], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for p, row in zip(rows, out[:, batch["input_ids"].shape[1]:]):
            text = tokenizer.decode(row, skip_special_tokens=True)
            digits = max(len(x) for x in p.prompt.rstrip("=").split("+"))
            right, total = by_digits.get(digits, (0, 0))
            by_digits[digits] = (right + (extract_answer(text) == p.answer), total + 1)
    right = sum(r for r, _ in by_digits.values())
    return {"accuracy": right / len(problems),
            "by_digits": {str(d): {"right": r, "of": n} for d, (r, n) in sorted(by_digits.items())}}


def measure(run_dir: Path, prompts: int, seed: int) -> dict:
    from cluster.loop.checkpoint import export_checkpoint
    from common.config import DataConfig
    from data.datasets import load_problems

    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else None
    if config is None:
        import yaml

        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    data = DataConfig(**{k: v for k, v in config["data"].items()})
    rollout, trainer, algo = config["rollout"], config["trainer"], config["algo"]
    heldout, train = load_problems(data, trainer["seed"])
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    first, last = checkpoints[0], checkpoints[-1]
    out = {}
    for label, ckpt in (("after_warmup", first), ("after_grpo", last)):
        folder = str(run_dir / f"export-{ckpt.name}")
        if not Path(folder, "config.json").exists():
            export_checkpoint(str(ckpt), folder)
        lengths = sample_lengths(folder, [p.prompt for p in train[:prompts]], algo["group_size"],
                                 rollout["max_new_tokens"], rollout["temperature"], seed)
        out[label] = {"checkpoint": ckpt.name,
                      "lengths": length_summary(lengths, trainer["prompts_per_step"] * algo["group_size"]),
                      "heldout_greedy": greedy_accuracy(folder, heldout, rollout["max_new_tokens"])}
    targets = [len(t) for t in _target_lengths(folder, train[:prompts])]
    out["warmup_targets"] = length_summary(targets, trainer["prompts_per_step"])
    return out


def _target_lengths(model_dir: str, problems):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(p.solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for p in problems]


def run_summary(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "heldout_before": summary["heldout_accuracy_before"], "heldout_after": summary["heldout_accuracy_after"],
        "heldout_curve": [(r["step"], r["heldout_accuracy"]) for r in rows if r.get("heldout_accuracy") is not None],
        "reward_mean_curve": [(r["step"], r.get("reward_mean")) for r in rows],
        "response_length_mean_curve": [(r["step"], r.get("response_length_mean")) for r in rows],
        "median_step_s": statistics.median(r["time_step"] for r in rows[1:]) if len(rows) > 1 else None,
        # The learner's share of padding and the sampler/learner mismatch, mean over the steps.
        "step_means": {key: statistics.mean(r[key] for r in rows) for key in MEANS if all(key in r for r in rows)},
        "job_minutes": summary.get("wall_minutes"),
    }


def run_entry(run_dir: Path, prompts: int, seed: int) -> dict:
    """Everything measured of one run: what its config set, its own log, and the two models."""
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return {"run": str(run_dir), "warmup_target_accuracy": config["warmup"]["target_accuracy"],
            "max_steps": config["trainer"]["max_steps"], "lr": config["learner"]["lr"],
            "run_summary": run_summary(run_dir), "models": measure(run_dir, prompts, seed)}


def summarize(entry: dict) -> dict:
    """The figures the docs quote, of one run."""
    warm, after = entry["models"]["after_warmup"], entry["models"]["after_grpo"]
    lengths = warm["lengths"]
    return {"warmup_lengths": {k: lengths[k] for k in ("median", "p90", "max", "max_over_median")},
            "heldout_before": entry["run_summary"]["heldout_before"],
            "heldout_after": entry["run_summary"]["heldout_after"],
            "heldout_curve": entry["run_summary"]["heldout_curve"],
            "heldout_by_digits_before": warm["heldout_greedy"]["by_digits"],
            "heldout_by_digits_after": after["heldout_greedy"]["by_digits"],
            "step_means": entry["run_summary"]["step_means"]}


def main() -> None:
    from bench.results_io import Result

    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompts", type=int, default=256, help="training prompts sampled per model")
    parser.add_argument("--output-dir", default="runs/bench")
    parser.add_argument("--from-run", default=None, help="measure this run folder instead of running")
    parser.add_argument("--compare", action="append", default=[],
                        help="an earlier run folder (another variant) measured and recorded beside it")
    parser.add_argument("--result", action="store_true", help=f"write {RESULT.relative_to(ROOT)}")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    result = Result("long_tail_task")
    if args.from_run:
        run_dir = Path(args.from_run)
    else:
        name = f"long-tail-seed{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = Path(args.output_dir) / name
        cmd = [GRPO, "train", "data=long_tail", f"trainer.seed={args.seed}", f"trainer.max_steps={args.steps}",
               "trainer.eval_every=10", "trainer.keep_checkpoints=0", "trainer.progress=false",
               f"trainer.run_name={name}", f"trainer.output_dir={args.output_dir}", *args.overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout[-2000:], proc.stderr[-2000:], flush=True)
        proc.check_returncode()
    main_entry = {"variant": "this run", **run_entry(run_dir, args.prompts, args.seed)}
    result.add_run(main_entry)
    for other in args.compare:
        result.add_run({"variant": "compared", **run_entry(Path(other), args.prompts, args.seed)})
    summary = {"this_run": summarize(main_entry),
               "compared": [summarize(r) | {"warmup_target_accuracy": r["warmup_target_accuracy"],
                                            "max_steps": r["max_steps"]} for r in result.record["runs"][1:]]}
    print(json.dumps(summary, indent=1))
    if args.result:
        result.write(summary, RESULT)


if __name__ == "__main__":
    main()
