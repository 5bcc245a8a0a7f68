"""Time each hostile input of tests/hostile_cases.py through a real verifier pool, one call each,
against the bound the pool promises: `reward.timeout_s` + 1 s.

    .venv/bin/python bench/hostile_inputs.py [--timeout-s 2]

Prints a Markdown table: case, attacked verifier, score, timed out, seconds, within the bound;
every case and the summary go to bench/results/hostile_inputs.json (bench/results_io.py).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from hostile_cases import BUILTIN, CUSTOM, CUSTOM_SEARCH_PATH, cases  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout-s", type=float, default=2.0)
    parser.add_argument("--output", default=None, help="the JSON result (default bench/results/hostile_inputs.json)")
    args = parser.parse_args()
    import ray

    from bench import results_io

    from reward.pool import VerifierPool
    from common.config import RewardConfig
    from common.messages import ScoringRequest

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    one = dict(timeout_s=args.timeout_s, num_workers=1, num_cpus_per_worker=0.5)
    pools = {"builtin": VerifierPool(RewardConfig(**BUILTIN, **one)),
             "custom": VerifierPool(RewardConfig(**CUSTOM, **one), search_path=CUSTOM_SEARCH_PATH)}
    for pool in pools.values():
        pool.ready()
    bound = args.timeout_s + 1.0
    lines = ["| case | verifier | score | timed out | seconds | within timeout_s + 1 s |",
             "| --- | --- | --- | --- | --- | --- |"]
    worst = 0.0
    result = results_io.Result("hostile_inputs")
    for case in cases(server.getsockname()[1], uuid.uuid4().hex[:12]):
        pool = pools[case.pool]
        pool.score_items([ScoringRequest("p", *case.control)])  # the process is warm and ready before timing
        start = time.perf_counter()
        (outcome,), _ = pool.score_items([ScoringRequest("p", case.completion, case.answer, case.fields)])
        seconds = time.perf_counter() - start
        worst = max(worst, seconds)
        timed_out = case.verifier in outcome.timed_out
        lines.append(f"| {case.name} | {case.verifier} | {outcome.scores[case.verifier]:g} | "
                     f"{'yes' if timed_out else 'no'} | {seconds:.2f} | {'yes' if seconds <= bound else 'NO'} |")
        result.add_run({"case": case.name, "verifier": case.verifier, "score": outcome.scores[case.verifier],
                        "timed_out": timed_out, "seconds": seconds, "within_bound": seconds <= bound})
    ray.shutdown()
    runs = result.record["runs"]
    result.write({"timeout_s": args.timeout_s, "bound_s": bound, "cases": len(runs),
                  "within_bound": sum(r["within_bound"] for r in runs), "seconds": results_io.spread(
                      r["seconds"] for r in runs)}, path=Path(args.output) if args.output else None)
    print(f"reward.timeout_s = {args.timeout_s:g}; bound {bound:g} s; slowest case {worst:.2f} s\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
