"""The GPU path of the learner and the sender side of the weight sync, on one GPU, without Ray.

Run on a GPU machine (the device check): `python bench/gpu_check.py [--size 500M]`. For ZeRO-2
and ZeRO-3 (each in its own process) it builds the real `LearnerRank` in bf16 over NCCL, runs
two GRPO updates on synthetic prompt groups (with sampler log-probs, so the truncated importance
weights are exercised), then packs and broadcasts the weights over an NCCL sync group, bucket by
bucket (ZeRO-3 gathers bucket by bucket). A second process on the same GPU tries to join the
sync group as a receiver: NCCL refuses two ranks on one GPU, which is reported, not hidden.
Prints one JSON line per stage and a table.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic_groups(num_prompts: int, group_size: int, vocab: int, max_new: int, seed: int):
    from cluster.prompt_group import PromptGroup

    rng = random.Random(seed)
    groups = []
    for i in range(num_prompts):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randrange(16, 48))]
        completions = [[rng.randrange(2, vocab) for _ in range(rng.randrange(8, max_new))] for _ in range(group_size)]
        groups.append(PromptGroup(
            index=i, prompt="", answer="", prompt_ids=prompt, completions=[""] * group_size,
            completion_ids=completions, finish_reasons=["stop"] * group_size, policy_version=0,
            sampler_logprobs=[[-rng.uniform(4.0, 7.0) for _ in c] for c in completions],
            rewards=[float(rng.random() < 0.5) for _ in range(group_size)]))
    return groups


def learner_stage(model_path: str, zero_stage: int, bucket_mb: float) -> dict:
    import torch

    from cluster.config import AlgoConfig, LearnerConfig
    from dataclasses import asdict
    from learner.actor import LearnerRank

    port = free_port()
    gpu = torch.cuda.is_available()  # without one (a dry run of this script) gloo on the CPU
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    learner_cfg = {**asdict(LearnerConfig()), "num_gpus_per_rank": 1, "zero_stage": zero_stage,
                   "num_ranks": 1, "lr": 1e-5}
    algo = {**asdict(AlgoConfig()), "max_length": 256}
    started = time.perf_counter()
    rank = LearnerRank(0, 1, "127.0.0.1", free_port(), model_path, learner_cfg, algo, seed=0)
    rank.snapshot_reference()  # the frozen reference of the KL term
    setup_s = time.perf_counter() - started
    params = sum(getattr(p, "ds_numel", p.numel()) for p in rank.engine.module.parameters())
    groups = synthetic_groups(16, 8, 256, 256, seed=zero_stage)
    steps = []
    for i in range(3):
        sync()
        metrics = rank.train_on(groups, temperature=1.0, lr=1e-5)
        steps.append(metrics)
    backend = "nccl" if gpu else "gloo"
    rank.init_weight_sync("127.0.0.1", port, 1, 60.0, backend)
    spec = rank.weight_spec("bfloat16", bucket_mb)
    syncs = []
    for _ in range(3):
        sync()
        syncs.append(rank.broadcast_weights(spec))
    last = steps[-1]
    return {
        "zero_stage": zero_stage, "params_m": params / 1e6, "dtype": str(rank.dtype), "backend": backend,
        "device": torch.cuda.get_device_name(0) if gpu else "cpu", "setup_s": setup_s,
        "loss": last["loss"], "grad_norm": last["grad_norm"], "kl": last["kl"],
        "is_weight_mean": last.get("is_weight_mean"), "is_capped_fraction": last.get("is_capped_fraction"),
        "learner_seconds": [round(s["learner_seconds"], 3) for s in steps],
        "peak_memory_mb": last["learner_peak_memory_mb"],
        "sync_bytes": syncs[-1]["sync_bytes"], "sync_seconds": [round(s["sync_seconds"], 4) for s in syncs],
        "sync_gbps": syncs[-1]["sync_gbps"], "sync_gathered_max_mb": syncs[-1]["sync_gathered_max_mb"],
        "finite": all(map(lambda s: s["loss"] == s["loss"] and s["grad_norm"] == s["grad_norm"], steps)),
    }


def _receiver(port: int, queue) -> None:
    try:
        import torch

        from cluster import weight_sync

        torch.cuda.set_device(0)
        group = weight_sync.join_group("127.0.0.1", port, 1, 2, 20.0, "nccl")
        flat = torch.empty(1 << 20, dtype=torch.bfloat16, device=group.device)
        weight_sync.broadcast(group, flat)
        queue.put({"received_sum": float(flat.float().sum())})
    except Exception as error:  # reported: the point is to see what NCCL says
        queue.put({"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"})


def two_ranks_one_gpu() -> dict:
    """A root and a receiver on the same GPU, as a colocated deployment would try."""
    import torch

    from cluster import weight_sync

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    child = ctx.Process(target=_receiver, args=(port, queue))
    child.start()
    out = {}
    try:
        torch.cuda.set_device(0)
        group = weight_sync.join_group("127.0.0.1", port, 0, 2, 20.0, "nccl")
        flat = torch.ones(1 << 20, dtype=torch.bfloat16, device=group.device)
        weight_sync.broadcast(group, flat)
        out["root"] = "sent"
    except Exception as error:
        out["root_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    child.join(60)
    out.update(queue.get(timeout=5) if not queue.empty() else {"receiver": "no answer"})
    if child.is_alive():
        child.kill()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="500M")
    parser.add_argument("--stage", type=int, default=None, help="internal: run one learner stage")
    parser.add_argument("--model", default=None)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--cache", default="/tmp/grpo-models")
    args = parser.parse_args()
    if args.stage is not None:
        print("RESULT " + json.dumps(learner_stage(args.model, args.stage, args.bucket_mb)), flush=True)
        return 0
    from bench.model_sizes import build

    started = time.perf_counter()
    model = build(args.size, args.cache)
    print(f"model built in {time.perf_counter() - started:.1f}s: {model}", flush=True)
    results = []
    for stage in (2, 3):
        proc = subprocess.run([sys.executable, __file__, "--stage", str(stage), "--model", model,
                               "--bucket-mb", str(args.bucket_mb)], capture_output=True, text=True,
                              timeout=400, cwd=str(ROOT))
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"ZeRO-{stage} FAILED (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
            continue
        result = json.loads(lines[-1][7:])
        results.append(result)
        print(json.dumps(result), flush=True)
    import torch

    if torch.cuda.is_available():
        print(json.dumps({"two_ranks_one_gpu": two_ranks_one_gpu()}), flush=True)
    print("\n| ZeRO | params | step s (3) | peak MB | sync GB/s | gathered max MB | loss | grad norm |")
    for r in results:
        print(f"| {r['zero_stage']} | {r['params_m']:.0f}M | {r['learner_seconds']} | {r['peak_memory_mb']:.0f} | "
              f"{r['sync_gbps']:.1f} | {r['sync_gathered_max_mb']:.0f} | {r['loss']:.4f} | {r['grad_norm']:.3f} |")
    return 0 if len(results) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
