"""What processes the test suite keeps alive cost while they wait, and what a second engine costs.

    .venv/bin/python bench/idle_costs.py roles [--seconds 30]   # the tests' shared actors, idle
    .venv/bin/python bench/idle_costs.py rebuild                 # two engines in one process

`roles` starts the tests' shared actors (two vLLM engines, two learner ranks, two verifiers,
`tests/helpers.py`'s small config) on a local Ray, waits 5 s, then prints every process's CPU
seconds over `--seconds` idle seconds. `rebuild` builds a GenerationWorker for the built-in model
in this process, then a second one after vLLM's `cleanup_dist_env_and_memory` (what
tests/reference_engine.py does), and prints the CPU seconds of each and whether their greedy
outputs agree.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]


def _config(cache: str):
    from cluster.cli.compose import load_config
    from cluster.cli.checks import resolve_model
    from helpers import small_overrides

    cfg = load_config(small_overrides(cache, "runs/bench/idle"))
    cfg.model.path = resolve_model(cfg)
    return cfg


def roles(seconds: float, cache: str) -> None:
    import cpu_floor
    from cluster.loop.launch import ACTOR_ENV
    from cluster.loop.roles import start_roles
    from common.ray_utils import start_local_ray

    cfg = _config(cache)
    start_local_ray(num_cpus=8, env_vars=ACTOR_ENV)  # as the tests' ray_session
    started = start_roles(cfg)
    try:
        time.sleep(5)
        before = cpu_floor.process_cpu()
        time.sleep(seconds)
        after = cpu_floor.process_cpu()
    finally:
        started.shutdown()
    rows = sorted(((cpu - before[key][2], cpu_floor.kind(cmd or name))
                   for key, (cmd, name, cpu) in after.items() if key in before), reverse=True)
    for used, kind in rows:
        if used >= 0.05:
            print(f"{used:6.2f}  {kind}")
    print(f"all processes: {sum(u for u, _ in rows):.2f} CPU-s in {seconds:.0f} idle seconds")


def rebuild(cache: str) -> None:
    from common.messages import GenerationRequest
    from rollout.worker import GenerationWorker

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    cfg = _config(cache)
    outputs, costs, worker = [], [], None
    for attempt in range(2):
        if attempt:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            del worker
            cleanup_dist_env_and_memory()
        start = cpu()
        worker = GenerationWorker(cfg.model.path, cfg.rollout, 123)
        group, _ = worker.generate(GenerationRequest(0, "12+34=", "46", {}, 0), n=1, greedy=True)
        costs.append(cpu() - start)
        outputs.append(group.completion_ids)
    print(f"first engine {costs[0]:.2f} CPU-s, second engine {costs[1]:.2f} CPU-s, "
          f"same greedy output: {outputs[0] == outputs[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-cache", default="runs/bench/models")
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("roles").add_argument("--seconds", type=float, default=30.0)
    sub.add_parser("rebuild")
    args = parser.parse_args()
    if args.what == "roles":
        roles(args.seconds, args.model_cache)
    else:
        rebuild(args.model_cache)


if __name__ == "__main__":
    main()
