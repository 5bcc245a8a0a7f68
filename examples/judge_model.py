"""A judge you can make here: the built-in model fine-tuned to answer "yes" or "no" to the judge
template (`reward.judge.template`) about the built-in task's completions, then served as the
`judge` verifier and compared with the `math` verifier.

    .venv/bin/python examples/judge_model.py --policy runs/reward_model_example/policy/final_model \
        [--out runs/judge_example] [--steps 300]

The examples' policy (examples/reward_model.py step 1) samples its own completions; each is
labelled by `math`, rendered into the judge template and the model is trained (supervised, on the
reply tokens only) to answer "yes" for right ones and "no" for wrong ones. Then one judge engine
judges held-out completions: agreement with `math`, unparseable replies, completions judged per
second; written to bench/results/judge_example.json. `judge_from` is also what the tests build
their judge with.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import List, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def judge_from(policy_dir: str, out_dir: str, rows: Sequence[Tuple[str, str, str, bool]], template: str,
               steps: int, batch_size: int = 32, lr: float = 3e-3, seed: int = 0) -> List[float]:
    """Fine-tune the causal LM at `policy_dir` to reply "yes"/"no" (then EOS) to `template` filled
    with each (prompt, completion, answer, right) row; saved to `out_dir`. Returns the losses.
    Each batch is half right rows, half wrong ones (where both exist): a half-trained policy's
    samples are mostly wrong, and on them "always no" is already a low loss."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reward.verdicts import judge_prompt

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    examples = []
    for prompt, completion, answer, right in rows:
        context = tokenizer(judge_prompt(template, prompt, completion, answer), add_special_tokens=False)["input_ids"]
        reply = tokenizer("yes" if right else "no", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((context, reply))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    right_rows = [i for i, row in enumerate(rows) if row[3]]
    wrong_rows = [i for i, row in enumerate(rows) if not row[3]]
    losses = []
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        picked = [pool[int(torch.randint(len(pool), (1,), generator=generator))]
                  for pool in (right_rows, wrong_rows) * (batch_size // 2)] if right_rows and wrong_rows else \
            torch.randint(len(examples), (batch_size,), generator=generator).tolist()
        seqs = [examples[i][0] + examples[i][1] for i in picked]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), pad)
        labels = torch.full((len(seqs), width), -100)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, i in enumerate(picked):
            context, reply = examples[i]
            n = len(context) + len(reply)
            ids[row, :n] = torch.tensor(context + reply)
            labels[row, len(context):n] = torch.tensor(reply)
            mask[row, :n] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", required=True, help="a policy folder (examples/reward_model.py's)")
    parser.add_argument("--out", default="runs/judge_example")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    from bench import results_io

    result = results_io.Result("judge_example")
    from common.config import DataConfig, JudgeConfig
    from data.datasets import load_problems
    from examples.reward_model import sample
    from reward.verifiers import math_score

    heldout, train = load_problems(DataConfig(), args.seed)
    answers = {p.prompt: p.answer for p in heldout + train}
    pairs = sample(args.policy, [p.prompt for p in train[:1000]], 4, 32, args.seed)
    rows = [(p, c, answers[p], math_score(c, answers[p]) == 1.0) for p, c in pairs]
    losses = judge_from(args.policy, args.out, rows, JudgeConfig().template, args.steps, seed=args.seed)
    print(f"judge saved to {args.out}; loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    held = sample(args.policy, [p.prompt for p in heldout], 4, 32, args.seed + 1)
    figures = judge_heldout(args.out, held, answers)
    figures.update({"judge_train_rows": len(rows), "judge_steps": args.steps, "judge_first_loss": losses[0],
                    "judge_last_loss": losses[-1]})
    print(json.dumps(figures, indent=1), flush=True)
    if not args.no_record:
        result.add_run({"seed": args.seed, "policy": args.policy, "judge": args.out})
        result.write(summary=figures)


def judge_heldout(judge_dir: str, pairs, answers) -> dict:
    """The judge on held-out (prompt, completion) pairs through one judge engine (a Ray actor, a
    vLLM engine): agreement of its verdicts with `math`, unparseable replies, judged per second."""
    import ray

    from common.config import JudgeConfig, RewardConfig
    from common.messages import ScoringRequest
    from common.ray_utils import start_local_ray
    from reward.judge import JudgePool
    from reward.model_scorer import ModelBackedScorer
    from reward.scorer import VerifierScorer
    from reward.verifiers import math_score

    settings = RewardConfig(verifiers=["judge"], weights={"judge": 1.0}, num_workers=1,
                            judge=JudgeConfig(path=judge_dir, num_cpus_per_worker=1.0))
    requests = [ScoringRequest(p, c, answers[p]) for p, c in pairs]
    start_local_ray(num_cpus=2)
    try:
        pool = JudgePool(settings.judge)
        pool.ready()
        scorer = ModelBackedScorer(VerifierScorer, {"judge": pool.workers}, settings)
        scorer.score(requests[:64])  # the engine's first batch pays its warm-up
        started = time.perf_counter()
        outcomes = scorer.score(requests)
        seconds = time.perf_counter() - started
        pool.shutdown()
    finally:
        ray.shutdown()
    right = [math_score(r.completion, r.answer) for r in requests]
    agree = sum(o.scores["judge"] == y for o, y in zip(outcomes, right)) / len(outcomes)
    yes_on_right = [o.scores["judge"] for o, y in zip(outcomes, right) if y == 1.0]
    no_on_wrong = [1.0 - o.scores["judge"] for o, y in zip(outcomes, right) if y != 1.0]
    return {"heldout_completions": len(outcomes), "heldout_right_fraction": sum(right) / len(right),
            "judge_agreement_with_math_heldout": agree,
            "judge_right_called_right_heldout": sum(yes_on_right) / max(len(yes_on_right), 1),
            "judge_wrong_called_wrong_heldout": sum(no_on_wrong) / max(len(no_on_wrong), 1),
            "judge_unparseable": sum(o.counts.get("judge_unparseable", 0.0) for o in outcomes),
            "judged_per_s_one_engine": len(outcomes) / seconds}


if __name__ == "__main__":
    main()
