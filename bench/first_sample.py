"""The first sampled batch of a fresh vLLM engine against the next ones, with and without
torch.compile in the engine (`rollout/worker.py no_compile`).

    .venv/bin/grpo train trainer.max_steps=0 trainer.run_name=start trainer.output_dir=runs/bench logger=none
    .venv/bin/python bench/first_sample.py runs/bench/start/final_model [--no-compile]

One engine in this process (as the project's CPU workers run it), one thread: a greedy pass over
the 200 held-out prompts (what a run does before its first step), then three batches of the
default job's shape (64 prompts x 8, T=1, 32 tokens, the sampled tokens' log-probs, a seed per
prompt), each timed. The seconds go to bench/results/first_sample.json (first_sample_eager.json
with --no-compile; bench/results_io.py).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", help="a Hugging Face folder")
    parser.add_argument("--no-compile", action="store_true", help="what the project's eager CPU engines do")
    parser.add_argument("--output", default=None, help="the JSON result (default bench/results/first_sample[_eager].json)")
    args = parser.parse_args()
    from bench import results_io

    result = results_io.Result("first_sample_eager" if args.no_compile else "first_sample")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    from common.config import DataConfig
    from data.datasets import load_problems
    from rollout.worker import no_compile

    torch.set_num_threads(1)
    if args.no_compile:
        no_compile()
    heldout, train = load_problems(DataConfig(), 0)
    llm = LLM(args.model, dtype="float32", seed=0, max_model_len=128, enforce_eager=True,
              kv_cache_memory_bytes=2**30, logprobs_mode="processed_logprobs")
    llm.generate([p.prompt for p in heldout], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    rng = random.Random(0)
    times = []
    for i in range(3):
        prompts = [p.prompt for p in train[64 * i: 64 * (i + 1)]]
        params = [SamplingParams(n=8, temperature=1.0, max_tokens=32, logprobs=0, seed=rng.randrange(2**31))
                  for _ in prompts]
        begun = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - begun)
    print(f"{'without' if args.no_compile else 'with'} torch.compile: sampled batches of 64 x 8: "
          + ", ".join(f"{t:.2f} s" for t in times))
    for i, t in enumerate(times):
        result.add_run({"batch": i + 1, "seconds": t, "compile": not args.no_compile})
    result.write({"first_batch_s": times[0], "later_batches_s": results_io.spread(times[1:])},
                 path=Path(args.output) if args.output else None, model=args.model)


if __name__ == "__main__":
    main()
