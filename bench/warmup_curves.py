"""The supervised warm-up's learning curve for each seed, in one process (no Ray, no vLLM).

    .venv/bin/python bench/warmup_curves.py --seeds 0 1 2 3 4 --lr 3e-3 [--schedule constant|warmup-cosine]

The built-in model and task of each seed, trained as the learner's warm-up trains them (AdamW,
batch 64, loss on the target tokens, targets ending with EOS), with greedy accuracy on the
held-out problems every --every steps (HF generate, this project's math verifier). Prints
one row per seed: the accuracy at each checkpoint. Used to choose the warm-up's defaults.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def curve(seed: int, lr: float, steps: int, every: int, schedule: str, batch: int, probe: int, cache: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.config import DataConfig, ModelConfig
    from data.datasets import load_problems
    from data.tiny_model import build_tiny_model
    from learner.batching import pad
    from learner.logprobs import token_logprobs
    from reward.verifiers import math_score

    torch.manual_seed(seed)
    path = build_tiny_model(ModelConfig(cache_dir=cache), seed)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    heldout, train = load_problems(DataConfig(), seed)
    examples = [(tok(p.prompt)["input_ids"], tok(p.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
                for p in train]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    points = []
    for step in range(1, steps + 1):
        if schedule == "warmup-cosine":
            warm = max(steps // 10, 1)
            scale = step / warm if step <= warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / (steps - warm)))
            for g in opt.param_groups:
                g["lr"] = lr * max(scale, 0.05)
        rows = rng.sample(range(len(examples)), batch)
        ids, att, mask = pad([examples[i][0] + examples[i][1] for i in rows], [len(examples[i][0]) for i in rows],
                             tok.pad_token_id or 0, "cpu")
        loss = -(token_logprobs(model, ids, att) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % every == 0:
            points.append((step, greedy(model, tok, heldout[:probe], math_score), float(loss.detach())))
    return points


def greedy(model, tok, problems, score) -> float:
    import torch

    tok.padding_side = "left"
    with torch.no_grad():
        enc = tok([p.prompt for p in problems], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(score(t, p.answer) for t, p in zip(texts, problems)) / len(problems)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--probe", type=int, default=100)
    parser.add_argument("--schedule", choices=["constant", "warmup-cosine"], default="constant")
    parser.add_argument("--cache", default="~/.cache/grpo/models")
    parser.add_argument("--output", default=None, help="the JSON result (default bench/results/warmup_curves.json)")
    args = parser.parse_args()
    import torch

    from bench import results_io

    result = results_io.Result("warmup_curves")

    torch.set_num_threads(1)
    print(f"lr {args.lr}, {args.schedule}, batch {args.batch}: held-out greedy accuracy (first {args.probe}) by step")
    for seed in args.seeds:
        started = time.time()
        points = curve(seed, args.lr, args.steps, args.every, args.schedule, args.batch, args.probe, args.cache)
        cells = " ".join(f"{s}:{a:.0%}" for s, a, _ in points)
        print(f"seed {seed}: {cells}  (loss {points[-1][2]:.3f}, {time.time() - started:.0f} s)", flush=True)
        result.add_run({"seed": seed, "lr": args.lr, "schedule": args.schedule,
                        "points": [{"step": s, "accuracy": a, "loss": loss} for s, a, loss in points]})
    # the first probed step at or above 50% per seed: where the warm-up's probe would stop it
    passed = [next((p["step"] for p in run["points"] if p["accuracy"] >= 0.5), None) for run in result.record["runs"]]
    result.write({"first_step_at_50_percent": passed}, path=Path(args.output) if args.output else None)


if __name__ == "__main__":
    main()
