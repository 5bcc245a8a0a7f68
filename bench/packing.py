"""The learner's padding on the long-tailed task, and packed against padded micro-batches.

    .venv/bin/python bench/packing.py [--rounds 5] [--budget 4096] [--threads 2] [--result]

One process, no Ray: the built-in model of `data=long_tail` (its config, random weights: the
cost does not depend on them) and minibatches of that task's lengths (one learner rank's share
of a default step: 16 prompts x 8 completions, each completion its warm-up target's length plus
or minus 3 tokens). For each budget of `learner.max_tokens_per_microbatch`, rounds alternate the
padded path (rows sorted by length, each micro-batch padded to its longest row) and the packed
one (`learner.pack_sequences`): the share of computed positions that is padding, the micro-batches,
and the seconds of the log-prob forward and backward over the minibatch. Writes
bench/results/packing.json with --result. Times need an otherwise idle machine: the load
average before and after is recorded beside them.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULT = ROOT / "bench" / "results" / "packing.json"


def minibatch(rng, lengths_pool, prompts: int = 16, group: int = 8):
    return [max(4, n + rng.randint(-3, 3)) for n in rng.sample(lengths_pool, prompts) for _ in range(group)]


def measure(model, micro, lengths, vocab: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=g)
    attention = torch.zeros_like(ids)
    targets = torch.zeros(len(lengths), width - 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        attention[i, :n] = 1
        targets[i, min(10, n - 2):n - 1] = True
    plan = micro.plan(torch.arange(len(lengths)), attention, targets)
    started = time.perf_counter()
    computed, loss = 0, 0.0
    for m in plan:
        T = m.length if len(plan) > 1 else width
        mask = targets[m.rows, :T - 1]
        logprobs = micro.logprobs(model, ids[m.rows, :T], attention[m.rows, :T], 1.0, targets=mask,
                                  first=m.first_target)
        part = (logprobs * mask).sum() / targets.sum()
        part.backward()
        loss += float(part.detach())
        computed += m.packed_positions if micro.pack else len(m.rows) * T
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return {"seconds": seconds, "micro_batches": len(plan), "padded_fraction": 1 - sum(lengths) / computed,
            "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budgets", type=int, nargs="+", default=[4096, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result", action="store_true", help=f"write {RESULT.relative_to(ROOT)}")
    args = parser.parse_args()
    from bench.results_io import Result, spread

    record = Result("packing")

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cluster.cli.compose import load_config
    from data.datasets import load_problems
    from data.tiny_model import build_tiny_model
    from learner import batching

    batching.global_max = lambda value, device: value  # one process: no other rank to agree with
    torch.set_num_threads(args.threads)
    cfg = load_config(["data=long_tail"])
    path = build_tiny_model(cfg.model, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    _, train = load_problems(cfg.data, args.seed)
    pool = [len(tokenizer(p.prompt)["input_ids"]) + len(tokenizer(p.solution, add_special_tokens=False)["input_ids"])
            + 1 for p in train[:2000]]
    rng = random.Random(args.seed)
    runs = []
    for budget in args.budgets:
        for round_ in range(args.rounds):
            lengths = minibatch(rng, pool)
            order = (False, True) if round_ % 2 == 0 else (True, False)  # alternate which goes first
            for pack in order:
                micro = batching.MicroBatcher(budget, "cpu", pack)
                runs.append({"budget": budget, "round": round_, "packed": pack, "threads": args.threads,
                             **measure(model, micro, lengths, len(tokenizer), args.seed + round_)})
                record.add_run(runs[-1])
                print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for budget in args.budgets:
        padded = [r for r in runs if r["budget"] == budget and not r["packed"]]
        packed = [r for r in runs if r["budget"] == budget and r["packed"]]
        summary[str(budget)] = {
            **{f"{key}_{name}": spread(r[key] for r in mine) for key in ("seconds", "micro_batches", "padded_fraction")
               for name, mine in (("padded", padded), ("packed", packed))},
            # Each round's pair ran on the same minibatch, one after the other.
            "packed_over_padded_seconds": spread(b["seconds"] / a["seconds"] for a, b in zip(padded, packed))}
    print(json.dumps(summary, indent=1))
    if args.result:
        record.write(summary, RESULT)


if __name__ == "__main__":
    main()
