"""What the learner reports as a step's entropy, against the token mean it stands for.

    .venv/bin/grpo train trainer.max_steps=0 trainer.run_name=start trainer.output_dir=runs/bench logger=none
    .venv/bin/python bench/token_means.py runs/bench/start/final_model   # the default job's post-warm-up policy

Samples the default job's first batch shape (64 prompts x 8, T=1, 32 tokens) from the model with
vLLM, lays it out as the learner does (learner/batching.py: 2 ranks, 2 minibatches each, micro-
batches of rows sorted by length within learner.max_tokens_per_microbatch), computes the policy's
entropy at every completion token (learner/logprobs.py), and prints three numbers: the token
mean over the batch; a plain mean over the micro-batches (how the metric added up before
learner/metrics.py); and what learner/metrics.py's combination gives. The three go to
bench/results/token_means.json (bench/results_io.py).
"""
from __future__ import annotations

import argparse
import random
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", help="a Hugging Face folder")
    parser.add_argument("--budget", type=int, default=4096, help="learner.max_tokens_per_microbatch")
    parser.add_argument("--output", default=None, help="the JSON result (default bench/results/token_means.json)")
    args = parser.parse_args()
    from bench import results_io

    result = results_io.Result("token_means")

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from common.config import DataConfig
    from learner import batching
    from learner.logprobs import token_logprobs
    from learner.metrics import combine_metrics
    from data.datasets import load_problems

    batching.global_max = lambda value, device: value  # one process plays every rank
    prompts = [p.prompt for p in load_problems(DataConfig(), 0).train[:64]]
    rng = random.Random(0)
    llm = LLM(args.model, dtype="float32", seed=0, max_model_len=128, enforce_eager=True)
    outs = llm.generate(prompts, [SamplingParams(n=8, temperature=1.0, max_tokens=32, seed=rng.randrange(2**31))
                                  for _ in prompts], use_tqdm=False)
    groups = [types.SimpleNamespace(prompt_ids=list(o.prompt_token_ids), completion_ids=[list(c.token_ids) for c in o.outputs],
                                    finish_reasons=[c.finish_reason for c in o.outputs], rewards=[0.0] * 8,
                                    group_size=8) for o in outs]
    batch = batching.flatten(groups, 0, "cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    with torch.no_grad():
        _, entropy = token_logprobs(model, batch.ids, batch.attention, 1.0, with_entropy=True, targets=batch.mask)
    mask = batch.mask
    plain, parts = [], []
    for rank in torch.arange(len(batch)).chunk(2):
        for minibatch in rank.chunk(2):
            micros = batching.MicroBatcher(args.budget, "cpu").plan(minibatch, batch.attention, mask)
            means = [float(entropy[m.rows][mask[m.rows]].mean()) for m in micros]
            plain.append(sum(means) / len(means))
            parts.append({"entropy": float(entropy[minibatch][mask[minibatch]].mean()),
                          "loss_tokens": float(mask[minibatch].sum())})
            print(f"micro-batches of {[len(m.rows) for m in micros]} rows: entropy {[round(x, 3) for x in means]}")
            result.add_run({"micro_batch_rows": [len(m.rows) for m in micros], "micro_batch_entropy": means})
    print(f"token mean over the batch: {float(entropy[mask].mean()):.4f} nats/token")
    print(f"plain mean over the micro-batches: {sum(plain) / len(plain):.4f}")
    print(f"learner/metrics.py: {combine_metrics(parts)['entropy']:.4f}")
    result.write({"token_mean": float(entropy[mask].mean()), "plain_mean_of_micro_batches": sum(plain) / len(plain),
                  "learner_metrics": combine_metrics(parts)["entropy"]},
                 path=Path(args.output) if args.output else None, model=args.model)


if __name__ == "__main__":
    main()
