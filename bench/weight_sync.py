"""Weight-sync bandwidth and fixed cost, and generation throughput in the system vs standalone vLLM.

    .venv/bin/python bench/weight_sync.py [--sizes 10M 100M 500M] [--pushes 5]
    .venv/bin/python bench/weight_sync.py --reload-alone [--sizes 10M 100M 500M] [--threads 1 2] [--linear onednn torch]

Part 1, for each model size: one DeepSpeed learner rank (ZeRO-2) and two vLLM generation actors,
joined by the real sync channel (`sync.bucket_mb`, gloo on this CPU machine). Each push is timed
end to end (driver's view: until both workers report the new version, loading included), and
the learner's side alone (pack + broadcast: `sync_gbps`; its `sync_pack_seconds` and the
receivers' `sync_wait_seconds` are the product's own metrics, measured after the work completed:
CUDA events for packing, host waits that block until each bucket is whole). Next to it, in the same process, a
plain memory copy of the same number of bytes (torch `copy_`), the ceiling of any transfer on
one machine. The fixed cost per sync is the intercept of a least-squares line through the
end-to-end times against bytes.

Part 1b (`--reload-alone`): vLLM's reload alone, the floor under any transport. One engine in a
process of its own (`--threads` torch threads: 1 is what each of two pool workers gets on two
cores) reloads the model from tensors already in its memory, as the sync's receiver does (the
layerwise reload); timed with its oneDNN weight packing apart, next to a memory copy of the same
bytes in the same process. `--linear torch` runs the same engine with vLLM's plain-torch
linear layers instead of oneDNN's packed ones (their weights stay ordinary tensors, so a load can
copy straight into them: also timed, as `direct`), and each run measures the engine's generation
rate (fixed-length sampled completions), the price of that layout.

Part 2: completion tokens/s of the rollout pool (two workers, chunks to whichever is free) on
the built-in model, next to one standalone vLLM engine (a plain `vllm.LLM` in its own process)
given the same prompts, sampling settings and seeds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def memcpy_gbps(num_bytes: int, repeats: int = 5) -> float:
    import torch

    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


def count_params(folder: str) -> int:
    """Parameters stored in the model folder (a tied head is stored once)."""
    from safetensors import safe_open

    total = 0
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


def receive_raw(worker, wire_spec: dict) -> dict:
    """On a generation worker (through `__ray_call__`): a plain broadcast of the sync's bytes,
    dropped on arrival."""
    return max(worker.llm.collective_rpc("receive_raw", args=(wire_spec,)), key=lambda t: t["load_s"])


def broadcast_raw(rank, wire_spec: dict) -> None:
    """On a learner rank (through `__ray_call__`): rank 0 broadcasts buckets of the sync's sizes
    with nothing packed, a plain broadcast of the same bytes over the same group, the yardstick
    of the sync's rate."""
    from common import weight_sync

    group = rank.sender.sync_group
    spec = weight_sync.WeightSpec.from_wire(wire_spec)
    for bucket in spec.buckets():
        weight_sync.broadcast(group, weight_sync.empty_bucket(bucket, spec.dtype, group.device))
    weight_sync.settle(group)


def sync_size(size: str, cache: str, pushes: int, bucket_mb: float, transport: str) -> dict:
    import ray

    from bench.model_sizes import build
    from cluster.cli.compose import load_config
    from cluster.loop.sync_channel import WeightSyncChannel
    from learner.group import LearnerGroup
    from rollout.pool import RolloutPool

    cfg = load_config([])
    model = build(size, cache)
    learner_cfg = replace(cfg.learner, num_ranks=1, zero_stage=2)
    # beta=0: no frozen reference copy, which the sync never reads (2 GB less at 500M).
    algo = replace(cfg.algo, beta=0.0)
    rollout_cfg = replace(cfg.rollout, max_model_len=256, kv_cache_gib=1, num_workers=2, num_cpus_per_worker=0.5)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # broadcast_raw runs on the ranks
    learner = LearnerGroup(model, learner_cfg, algo, cfg.rollout.max_new_tokens, 0)
    pool = RolloutPool(model, rollout_cfg, 0)
    try:
        channel = WeightSyncChannel(learner, pool, cfg.rollout.dtype, bucket_mb, timeout_s=600, transport=transport)
        channel.push(1)  # warm: first broadcasts, first reload
        walls, learner_side, packs, loads, waits, raws = [], [], [], [], [], []
        for version in range(2, pushes + 2):
            start = time.perf_counter()
            metrics = channel.push(version)
            walls.append(time.perf_counter() - start)
            learner_side.append(metrics["sync_seconds"])
            packs.append(metrics["sync_pack_seconds"])
            loads.append(metrics["sync_load_seconds"])
            waits.append(metrics["sync_wait_seconds"])
            # The yardstick, same run, same processes, same group: the same buckets broadcast and
            # dropped on arrival (no packing, no loading into vLLM).
            start = time.perf_counter()
            receives = [w.__ray_call__.remote(receive_raw, channel.spec) for w in pool.workers]
            ray.get([r.__ray_call__.remote(broadcast_raw, channel.spec) for r in learner.ranks] + receives)
            raws.append(time.perf_counter() - start)
        num_bytes = metrics["sync_bytes"]
    finally:
        learner.shutdown()
        pool.shutdown()
    params = count_params(model)
    return {
        "size": size, "transport": transport, "params_m": params / 1e6, "bytes": num_bytes,
        "push_s": statistics.median(walls), "learner_s": statistics.median(learner_side),
        "push_gbps": num_bytes / statistics.median(walls) / 1e9,
        "learner_gbps": num_bytes / statistics.median(learner_side) / 1e9,
        "memcpy_gbps": memcpy_gbps(num_bytes),
        "pack_s": statistics.median(packs), "receive_s": statistics.median(loads),
        "receive_wait_s": statistics.median(waits), "raw_broadcast_s": statistics.median(raws),
        "of_raw_broadcast": statistics.median(raws) / statistics.median(walls),
    }


STANDALONE = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(model=args["model"], dtype="float32", max_model_len=128, enforce_eager=True, seed=0)
params = [SamplingParams(n=args["n"], temperature=1.0, max_tokens=args["max_tokens"], seed=s) for s in args["seeds"]]
llm.generate(args["prompts"][:4], params[:4], use_tqdm=False)  # warm
start = time.perf_counter()
outs = llm.generate(args["prompts"], params, use_tqdm=False)
seconds = time.perf_counter() - start
tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
print("RESULT " + json.dumps({"tokens": tokens, "seconds": seconds}))
"""


RELOAD = r"""
import json, os, statistics, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine's worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
import torch
args = json.loads(sys.argv[1])
sys.path.insert(0, args["root"])
from bench.weight_sync import memcpy_gbps
torch.set_num_threads(args["threads"])  # before the engine starts: vLLM refuses it afterwards
from pathlib import Path
from safetensors.torch import load_file
from vllm import LLM, SamplingParams, _custom_ops as ops
if args["linear"] == "torch":
    ops._supports_onednn = False  # vLLM's dispatch then keeps each weight and calls torch's linear
weights = {}
for f in sorted(Path(args["model"]).glob("*.safetensors")):
    weights.update(load_file(str(f)))
if "lm_head.weight" not in weights:  # a tied head is sent too, as the sync does
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
llm = LLM(model=args["model"], dtype="float32", max_model_len=max(128, 16 + args["gen_tokens"]), enforce_eager=True,
          seed=0)
worker = llm.llm_engine.model_executor.driver_worker.worker
packing = [0.0]
create = ops.create_onednn_mm
def timed_create(*a, **k):
    start = time.perf_counter()
    try:
        return create(*a, **k)
    finally:
        packing[0] += time.perf_counter() - start
ops.create_onednn_mm = timed_create
walls, packs = [], []
for i in range(args["repeats"] + 1):  # the first is a warm one
    packing[0] = 0.0
    start = time.perf_counter()
    worker.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
    if i:
        walls.append(time.perf_counter() - start)
        packs.append(packing[0])
direct = []
if args["linear"] == "torch":  # unpacked weights: the model's own loaders copy into them in place
    model = worker.model_runner.get_model()
    for i in range(args["repeats"] + 1):
        start = time.perf_counter()
        with torch.no_grad():
            model.load_weights(iter(weights.items()))
        if i:
            direct.append(time.perf_counter() - start)
# Generation: the same engine, fixed-length sampled completions (a batch of 8 per prompt).
n, length = 8, args["gen_tokens"]
prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 200 for j in range(16)]} for i in range(args["gen_prompts"])]
sampling = [SamplingParams(n=n, temperature=1.0, max_tokens=length, min_tokens=length, ignore_eos=True, seed=i)
            for i in range(len(prompts))]
gens = []
if prompts:  # --gen-prompts 0: no generation
    llm.generate(prompts[:2], sampling[:2], use_tqdm=False)  # warm
    for _ in range(args["repeats"]):
        start = time.perf_counter()
        llm.generate(prompts, sampling, use_tqdm=False)
        gens.append(time.perf_counter() - start)
num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
print("RESULT " + json.dumps({"bytes": num_bytes, "reload_s": statistics.median(walls),
                              "packing_s": statistics.median(packs),
                              "direct_s": statistics.median(direct) if direct else None,
                              "gen_tokens_per_s": len(prompts) * n * length / statistics.median(gens) if gens else None,
                              "memcpy_s": num_bytes / memcpy_gbps(num_bytes) / 1e9}))  # same threads
"""


def reload_alone(size: str, cache: str, repeats: int, threads: int, linear: str, gen_prompts: int,
                 gen_tokens: int) -> dict:
    from bench.model_sizes import build

    payload = json.dumps({"model": build(size, cache), "repeats": repeats, "threads": threads, "root": str(ROOT),
                          "linear": linear, "gen_prompts": gen_prompts, "gen_tokens": gen_tokens})
    out = subprocess.run([sys.executable, "-c", RELOAD, payload], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the reload child failed ({size}, {threads} threads, {linear}):\n{out.stderr[-3000:]}")
    result = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    return {"size": size, "threads": threads, "linear": linear, **result,
            "reload_gbps": result["bytes"] / result["reload_s"] / 1e9,
            "memcpy_gbps": result["bytes"] / result["memcpy_s"] / 1e9}


def generation(cache: str, num_prompts: int, repeats: int, chunks_per_worker: int) -> dict:
    from cluster.loop.batches import generation_requests
    from cluster.cli.compose import load_config
    from cluster.cli.checks import resolve_model
    from data.datasets import load_problems
    from rollout.pool import RolloutPool

    cfg = load_config([f"model.cache_dir={cache}", f"rollout.chunks_per_worker={chunks_per_worker}"])
    model = resolve_model(cfg)
    train = load_problems(cfg.data, 0).train[:num_prompts]
    batch = list(enumerate(train))
    n, seed = cfg.algo.group_size, 12345
    pool = RolloutPool(model, replace(cfg.rollout, num_cpus_per_worker=0.5), 0)
    try:
        requests = generation_requests(batch, seed)
        pool.generate(requests[:4], n, greedy=False)  # warm
        system = []
        for _ in range(repeats):
            start = time.perf_counter()
            generated = pool.generate(requests, n, greedy=False)
            system.append((generated.stats["completion_tokens"], time.perf_counter() - start))
    finally:
        pool.shutdown()
    seeds = [r.seed for r in requests]  # the pool's per-prompt seeds
    payload = json.dumps({"model": model, "prompts": [p.prompt for _, p in batch], "n": n,
                          "max_tokens": cfg.rollout.max_new_tokens, "seeds": seeds})
    standalone = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", STANDALONE, payload], capture_output=True, text=True, check=True)
        result = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        standalone.append((result["tokens"], result["seconds"]))
    return {
        "prompts": num_prompts, "completions": num_prompts * n,
        "system_tokens_per_s": statistics.median(t / s for t, s in system),
        "standalone_tokens_per_s": statistics.median(t / s for t, s in standalone),
        "system_tokens": system[0][0], "standalone_tokens": standalone[0][0],
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=["10M", "100M", "500M"])
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--transport", nargs="+", default=["auto"], choices=["auto", "broadcast", "shm"],
                        help="sync.transport; two of them: compared in turn, --pairs rounds (bench/compare.py)")
    parser.add_argument("--pairs", type=int, default=1, help="rounds of the --transport values in turn (A B A B ...)")
    parser.add_argument("--skip-generation", action="store_true", help="part 1 only")
    parser.add_argument("--cache", default=str(Path("~/.cache/grpo/models").expanduser()))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks-per-worker", type=int, default=1, help="rollout.chunks_per_worker of the pool")
    parser.add_argument("--output", default=None,
                        help="JSON result (default bench/results/weight_sync.json, weight_sync_reload_alone.json)")
    parser.add_argument("--reload-alone", action="store_true",
                        help="only vLLM's reload in one engine (part 1b), per size and thread count")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="the engine's threads (--reload-alone)")
    parser.add_argument("--linear", nargs="+", default=["onednn"], choices=["onednn", "torch"],
                        help="vLLM's CPU linear layers (--reload-alone): oneDNN's packed weights (vLLM's "
                             "default) or plain torch.nn.functional.linear")
    parser.add_argument("--gen-prompts", type=int, default=16, help="prompts (x8 completions) of --reload-alone's "
                                                                   "generation rate; 0: none")
    parser.add_argument("--gen-tokens", type=int, default=32, help="tokens per completion, same")
    args = parser.parse_args()
    from bench import results_io

    result = results_io.Result("weight_sync_reload_alone" if args.reload_alone else "weight_sync")
    if args.output is None:
        args.output = str(results_io.RESULTS / f"{result.record['benchmark']}.json")
    if args.reload_alone:
        return report_reloads(args, result)
    import ray

    from cluster.loop.launch import ACTOR_ENV

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": ACTOR_ENV})
    rows = []
    for size in args.sizes:
        for pair in range(args.pairs):
            for transport in args.transport:
                rows.append({**sync_size(size, args.cache, args.pushes, args.bucket_mb, transport), "pair": pair})
                print(json.dumps(rows[-1]), flush=True)
    gen = None if args.skip_generation else generation(args.cache, args.prompts, args.repeats, args.chunks_per_worker)
    print(json.dumps(gen), flush=True)
    ray.shutdown()

    fixed = None
    if len(args.sizes) >= 2 and len(args.transport) == 1:  # least squares: push_s = fixed + bytes / bandwidth
        xs, ys = [r["bytes"] for r in rows], [r["push_s"] for r in rows]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        fixed = my - slope * mx
    lines = ["| model | params | bytes (fp32) | push, end to end | push GB/s | plain gloo broadcast, same bytes "
             "and group | push / plain broadcast rate | learner side (pack + broadcast) | memcpy GB/s, same bytes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['params_m']:.1f} M | {r['bytes'] / 2**20:.0f} MiB | {r['push_s']:.3f} s | "
                     f"{r['push_gbps']:.2f} | {r['raw_broadcast_s']:.3f} s | {r['of_raw_broadcast']:.0%} | "
                     f"{r['learner_s']:.3f} s (pack {r['pack_s']:.3f} s) | {r['memcpy_gbps']:.2f} |")
    if fixed is not None:
        lines.append(f"\nfixed cost per sync (intercept of push time against bytes): {fixed * 1000:.0f} ms")
    lines += [] if gen is None else ["", "| generation, built-in model | completions | tokens/s |", "| --- | --- | --- |",
              f"| rollout pool, 2 workers, chunks_per_worker={args.chunks_per_worker} | {gen['completions']} | "
              f"{gen['system_tokens_per_s']:.0f} |",
              f"| one standalone vLLM engine, same prompts and seeds | {gen['completions']} | "
              f"{gen['standalone_tokens_per_s']:.0f} |"]
    summary = {"fixed_s": fixed, "generation": gen, "push_s": {}}
    for size in args.sizes:
        for transport in args.transport:
            summary["push_s"][f"{size} {transport}"] = results_io.spread(
                r["push_s"] for r in rows if r["size"] == size and r["transport"] == transport)
        if len(args.transport) == 2:
            from bench.compare import Comparison

            a, b = ([r["push_s"] for r in rows if r["size"] == size and r["transport"] == t] for t in args.transport)
            cmp = Comparison(a=a, b=b, lower_is_better=True, label_a=args.transport[0], label_b=args.transport[1])
            summary.setdefault("comparison", {})[size] = cmp.summary()
            lines.append(f"\n{size}: {cmp.sentence()} (push seconds, {args.transport[1]} / {args.transport[0]})")
    table = "\n".join(lines)
    print(table)
    for run in rows:
        result.add_run(run)
    result.write(summary, path=Path(args.output))
    return 0


def report_reloads(args, result) -> int:
    rows = []
    for size in args.sizes:
        for threads in args.threads:
            for linear in args.linear:
                rows.append(reload_alone(size, args.cache, args.repeats, threads, linear, args.gen_prompts,
                                         args.gen_tokens))
                print(json.dumps(rows[-1]), flush=True)
    lines = ["| model | bytes (fp32) | engine threads | linear layers | reload (median) | reload GB/s | of it oneDNN "
             "packing | direct load | memcpy, same bytes | fastest load rate / memcpy rate | generation tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        fastest = min(t for t in (r["reload_s"], r["direct_s"]) if t is not None)
        direct = "-" if r["direct_s"] is None else f"{r['direct_s']:.3f} s"
        lines.append(f"| {r['size']} | {r['bytes'] / 2**20:.0f} MiB | {r['threads']} | {r['linear']} | "
                     f"{r['reload_s']:.3f} s | {r['reload_gbps']:.2f} | {r['packing_s']:.3f} s | {direct} | "
                     f"{r['memcpy_s']:.3f} s | {r['memcpy_s'] / fastest:.0%} | "
                     f"{'-' if r['gen_tokens_per_s'] is None else round(r['gen_tokens_per_s'])} |")
    print("\n".join(lines))
    for run in rows:
        result.add_run(run)
    runs = {(r["size"], r["threads"], r["linear"]): r for r in rows}
    # the same reload path for both layouts (the direct copy is the plain layers' alone)
    summary = {f"{size}, {t} thread{'s' if t > 1 else ''}": {
        "reload_onednn_over_torch": runs[(size, t, "onednn")]["reload_s"] / runs[(size, t, "torch")]["reload_s"],
        "generation_torch_over_onednn": (runs[(size, t, "torch")]["gen_tokens_per_s"]
                                         / runs[(size, t, "onednn")]["gen_tokens_per_s"])}
        for size in args.sizes for t in args.threads
        if (size, t, "onednn") in runs and (size, t, "torch") in runs
        and runs[(size, t, "onednn")]["gen_tokens_per_s"] and runs[(size, t, "torch")]["gen_tokens_per_s"]}
    result.write(summary, path=Path(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
