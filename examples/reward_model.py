"""A reward model you can make here, then GRPO against it alone.

    .venv/bin/python examples/reward_model.py [--out runs/reward_model_example] [--seed 0] [--grpo-steps 50]

1. The policy: `grpo train trainer.max_steps=0`, the built-in job's supervised warm-up alone
   (stopped at about half right, as the built-in job stops it).
2. Its own samples: 4 completions per training prompt at temperature 1, each labelled right or
   wrong by the `math` verifier; the same for the held-out prompts, never trained on.
3. The reward model: the policy with a one-logit classification head
   (`AutoModelForSequenceClassification`, `num_labels=1`), fine-tuned on prompt + completion with
   a logistic loss: its logit says "right".
4. Held-out: how often the reward model's verdict (logit > 0) agrees with `math`, and completions
   it scores per second in one reward-model actor.
5. GRPO from the same policy against the reward model alone (`reward.verifiers=[reward_model,
   math]` with math's weight 0: math is only measured), held-out `math` accuracy before and after,
   and the trained policy's greedy completions of a few held-out prompts (what it learned the
   reward model likes, when the reward model is hacked).

Writes bench/results/reward_model_example.json (command, commit, host, load, every figure).
`classifier_from` is also what the tests build their reward model with.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GRPO = str(Path(sys.executable).parent / "grpo")


def classifier_from(policy_dir: str, out_dir: str, seed: int = 0) -> str:
    """A one-logit sequence classifier with the policy's body and a fresh head (seeded), saved
    with the policy's tokenizer and a pad token id (batched scoring pads)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1, pad_token_id=pad,
                                                               dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def sample(policy_dir: str, prompts: Sequence[str], n: int, max_new_tokens: int, seed: int,
           chunk: int = 256) -> List[Tuple[str, str]]:
    """(prompt, completion) pairs: n samples per prompt at temperature 1, as the rollout draws them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    texts = [p for p in prompts for _ in range(n)]
    pairs = []
    for i in range(0, len(texts), chunk):
        batch = tokenizer(texts[i:i + chunk], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        for prompt, row in zip(texts[i:i + chunk], out[:, batch["input_ids"].shape[1]:]):
            pairs.append((prompt, tokenizer.decode(row, skip_special_tokens=True)))
    return pairs


def greedy(policy_dir: str, prompts: Sequence[str], max_new_tokens: int = 40) -> List[str]:
    """Greedy completions: what a policy trained against the reward model writes (and so what it
    learned the reward model likes)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    batch = tokenizer(list(prompts), return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return [tokenizer.decode(row, skip_special_tokens=True) for row in out[:, batch["input_ids"].shape[1]:]]


def fine_tune(model_dir: str, texts: Sequence[str], labels: Sequence[float], epochs: int, lr: float,
              batch_size: int, seed: int) -> List[float]:
    """Logistic regression of the labels on the classifier's logit, every parameter trained, the
    right samples weighted by wrong/right (a policy after its warm-up samples mostly wrong
    answers at temperature 1: unweighted, "always wrong" is already a good fit); saved in place.
    Returns the mean loss of each epoch."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    target = torch.tensor(labels, dtype=torch.float32)
    right = float(target.sum())
    pos_weight = torch.tensor((len(labels) - right) / max(right, 1.0))
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(texts)).tolist()
        total = 0.0
        for i in range(0, len(order), batch_size):
            rows = order[i:i + batch_size]
            batch = tokenizer([texts[j] for j in rows], return_tensors="pt", padding=True)
            logits = model(**batch).logits[:, 0]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target[rows], pos_weight=pos_weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(rows)
        losses.append(total / len(order))
    model.save_pretrained(model_dir)
    return losses


def pool_scores(model_dir: str, texts: Sequence[str]) -> Tuple[List[float], float]:
    """Logits of `texts` from one reward-model actor on a local Ray, and its completions per
    second (after a first call that loads the model)."""
    import ray

    from common.config import RewardModelConfig
    from common.ray_utils import start_local_ray
    from reward.reward_model import RewardModelPool

    start_local_ray(num_cpus=2)
    try:
        pool = RewardModelPool(RewardModelConfig(path=model_dir, num_workers=1, num_cpus_per_worker=1.0))
        pool.ready()
        ray.get(pool.workers[0].score.remote(list(texts[:64])))
        started = time.perf_counter()
        scores = ray.get(pool.workers[0].score.remote(list(texts)))
        per_s = len(texts) / (time.perf_counter() - started)
        pool.shutdown()
    finally:
        ray.shutdown()
    return scores, per_s


def grpo(out: Path, name: str, *overrides: str) -> dict:
    cmd = [GRPO, "train", f"trainer.output_dir={out}", f"trainer.run_name={name}", "logger=none",
           "trainer.progress=false", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(proc.stdout[-2000:], proc.stderr[-2000:], flush=True)
    proc.check_returncode()
    return json.loads((out / name / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/reward_model_example")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-prompts", type=int, default=1500)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--grpo-steps", type=int, default=50)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    from bench import results_io
    from common.config import DataConfig
    from data.datasets import load_problems
    from reward.reward_model import model_text
    from reward.verifiers import math_score

    result = results_io.Result("reward_model_example")
    out = Path(args.out).resolve()
    started = time.time()
    seed = [f"trainer.seed={args.seed}"]
    grpo(out, "policy", *seed, "trainer.max_steps=0")
    policy = str(out / "policy" / "final_model")

    heldout, train = load_problems(DataConfig(), args.seed)
    answers = {p.prompt: p.answer for p in heldout + train}
    pairs = sample(policy, [p.prompt for p in train[:args.train_prompts]], args.samples, 32, args.seed)
    texts = [model_text(p, c) for p, c in pairs]
    labels = [math_score(c, answers[p]) for p, c in pairs]
    held_pairs = sample(policy, [p.prompt for p in heldout], args.samples, 32, args.seed + 1)
    held_texts = [model_text(p, c) for p, c in held_pairs]
    held_labels = [math_score(c, answers[p]) for p, c in held_pairs]

    reward_model = classifier_from(policy, str(out / "reward_model"), args.seed)
    losses = fine_tune(reward_model, texts, labels, args.epochs, 1e-3, 64, args.seed)
    logits, per_s = pool_scores(reward_model, held_texts)
    verdicts = [(s > 0, y > 0.5) for s, y in zip(logits, held_labels)]
    agreement = sum(v == y for v, y in verdicts) / len(verdicts)
    right_called_right = sum(v for v, y in verdicts if y) / max(sum(y for _, y in verdicts), 1)
    wrong_called_wrong = sum(not v for v, y in verdicts if not y) / max(sum(not y for _, y in verdicts), 1)
    rm_minutes = (time.time() - started) / 60

    summary = grpo(out, "grpo-vs-reward-model", *seed, "model=hf", f"model.path={policy}", "warmup.steps=0",
                   "learner.lr=7e-4", f"trainer.max_steps={args.grpo_steps}", "reward.verifiers=[reward_model,math]",
                   "+reward.weights.reward_model=1.0", "reward.weights.math=0.0",
                   f"reward.model.path={reward_model}", "reward.model.normalize=sigmoid")
    trained = str(out / "grpo-vs-reward-model" / "final_model")
    shown = [p.prompt for p in heldout[:8]]
    figures = {
        "greedy_after_grpo_examples": dict(zip(shown, greedy(trained, shown))),
        "train_samples": len(labels), "train_right_fraction": sum(labels) / len(labels),
        "heldout_samples": len(held_labels), "heldout_right_fraction": sum(held_labels) / len(held_labels),
        "reward_model_epoch_losses": losses,
        "reward_model_agreement_with_math_heldout": agreement,
        "reward_model_right_called_right_heldout": right_called_right,
        "reward_model_wrong_called_wrong_heldout": wrong_called_wrong,
        "reward_model_completions_per_s_one_actor": per_s,
        "minutes_policy_samples_and_reward_model": rm_minutes,
        "grpo_steps": args.grpo_steps,
        "heldout_math_accuracy_before_grpo": summary["heldout_accuracy_before"],
        "heldout_math_accuracy_after_grpo": summary["heldout_accuracy_after"],
        "gain_points": 100 * (summary["heldout_accuracy_after"] - summary["heldout_accuracy_before"]),
        "grpo_wall_minutes": summary.get("wall_minutes"),
    }
    print(json.dumps(figures, indent=1), flush=True)
    result.add_run({"seed": args.seed, "out": str(out), "grpo_summary": summary})
    if not args.no_record:
        result.write(summary=figures)


if __name__ == "__main__":
    main()
