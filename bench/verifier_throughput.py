"""Completions verified per second by the verifier pool, for `math` and `code`, with 1 and 2 pool
workers, next to the same verifier called in-process (no Ray, no scorer process).

    .venv/bin/python bench/verifier_throughput.py [--math 4000] [--code 200] [--repeats 3]

Prints a Markdown table (best of `--repeats` timed calls per row, after one warm-up call); every
timed call's seconds and the rates go to bench/results/verifier_throughput.json (bench/results_io.py).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import RewardConfig  # noqa: E402
from common.messages import ScoringRequest  # noqa: E402
from reward.registry import build_verifiers  # noqa: E402


def math_items(n: int, rng: random.Random):
    items = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        guess = a + b + rng.choice([0, 0, 1, -1, 10])  # mostly right, some wrong
        items.append(ScoringRequest(f"{a}+{b}=", f"<think>{a}+{b}</think><answer>{guess}</answer>", str(a + b), {}))
    return items


def code_items(n: int, rng: random.Random):
    items = []
    for _ in range(n):
        k = rng.randint(1, 9)
        body = f"return x + {k}" if rng.random() < 0.7 else "return x"
        completion = f"<think>add</think><answer>```python\ndef add(x):\n    {body}\n```</answer>"
        tests = f"assert add(1) == {1 + k}\nassert add(-{k}) == 0"
        items.append(ScoringRequest(f"add {k}", completion, "", {"tests": tests}))
    return items


def timed(repeats: int, fn) -> list:
    """Seconds of each of `repeats` calls after a warm-up one (imports, the first sandbox)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best_of(repeats: int, fn) -> float:
    return min(timed(repeats, fn))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--math", type=int, default=4000)
    parser.add_argument("--code", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=None, help="the JSON result (default bench/results/verifier_throughput.json)")
    args = parser.parse_args()
    import os

    from bench import results_io

    result = results_io.Result("verifier_throughput")

    import ray

    from reward.pool import VerifierPool

    rng = random.Random(0)
    workloads = {"math": math_items(args.math, rng), "code": code_items(args.code, rng)}
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    rows = []
    for name, items in workloads.items():
        settings = RewardConfig(verifiers=[name], weights={name: 1.0}, timeout_s=10.0)
        call = build_verifiers(settings)[name]
        seconds = {"in-process": timed(args.repeats, lambda call=call, items=items:
                                       [call(r.prompt, r.completion, r.answer, r.fields) for r in items])}
        inproc = min(seconds["in-process"])
        rates = {}
        for workers in (1, 2):
            pool = VerifierPool(RewardConfig(verifiers=[name], weights={name: 1.0}, timeout_s=10.0,
                                             num_workers=workers, num_cpus_per_worker=0.5))
            pool.ready()
            seconds[f"pool, {workers} workers"] = timed(args.repeats, lambda pool=pool, items=items: pool.score_items(items))
            rates[workers] = len(items) / min(seconds[f"pool, {workers} workers"])
            pool.shutdown()
        rows.append((name, len(items), len(items) / inproc, rates[1], rates[2]))
        result.add_run({"verifier": name, "completions": len(items), "seconds": seconds})
    ray.shutdown()
    print(f"machine: {os.cpu_count()} cores; best of {args.repeats} timed calls after one warm-up\n")
    print("| verifier | completions | in-process /s | pool, 1 worker /s | pool, 2 workers /s | "
          "2 vs 1 workers | pool overhead (1 worker vs in-process) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, n, inproc, one, two in rows:
        print(f"| {name} | {n} | {inproc:,.0f} | {one:,.0f} | {two:,.0f} | {two / one:.2f}x | "
              f"{(inproc / one - 1) * 100:+.0f}% time |")
    result.write({name: {"completions_per_s_best": {"in-process": inproc, "pool, 1 worker": one, "pool, 2 workers": two},
                         "completions_per_s": {kind: results_io.spread(n / t for t in times)
                                               for kind, times in run["seconds"].items()}}
                  for (name, n, inproc, one, two), run in zip(rows, result.record["runs"])},
                 path=Path(args.output) if args.output else None)


if __name__ == "__main__":
    main()
