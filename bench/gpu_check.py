"""What one GPU can show about the GPU path, and nothing more.

Run on a GPU machine: `python bench/gpu_check.py`. It builds a random-weight model with
Qwen2.5-0.5B's width, depth, MLP and 151,936-token vocabulary (the built-in byte tokenizer; the
extra vocabulary rows are never sampled), then, each stage in its own process:

- `logprobs`: per-token log-probs and entropy of 16,384 positions at the real vocabulary, the
  chunked computation the learner uses against a full float32 log-softmax: peak extra memory,
  time (CUDA-synchronised), and the largest difference of values and gradients.
- `learner`: the real `LearnerRank` in bf16 under ZeRO-2 and ZeRO-3, one GRPO step on the
  README recipe's batch per rank (128 completions of about 700 tokens) with a micro-batch
  budget, then on half that batch with the same budget, then on half without a budget: peak
  GPU memory must follow the budget, not the batch. Then packing the weights into bf16 buckets
  on the GPU, timed with a synchronize before the clock is read.
- `nccl`: two processes on the one GPU try to form the NCCL weight-sync group.

It prints what it checks (CHECKED) before it starts and what it cannot (NOT_CHECKED) at the end;
`--list` prints both and exits. A broadcast's bandwidth needs two GPUs (a sync group of world
size 1 moves no bytes, and NCCL refuses two ranks on one GPU), and vLLM's CUDA build is not on
that machine. `--dry-run` runs the same code on the CPU at toy sizes: it measures nothing, but
the test suite runs it (tests/integration/test_gpu_check.py), so the script cannot rot.
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

# Qwen2.5-0.5B's shape (its 2 key-value heads aside: the built-in builder uses full attention heads).
REAL = dict(hidden_size=896, num_layers=24, num_heads=14, intermediate_size=4864, vocab_size=151936,
            max_position_embeddings=1024)
DRY = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, vocab_size=4096,
           max_position_embeddings=1024)
CHECKED = [
    "logprobs: chunked log-probs and entropy at the vocabulary against a full float32 log-softmax "
    "(values, gradients, peak extra memory)",
    "learner: one LearnerRank in bf16 under ZeRO-2 and ZeRO-3, GRPO steps whose peak memory must follow "
    "learner.max_tokens_per_microbatch, not the batch",
    "learner: packing the weights into bf16 buckets on the GPU (rank 0's side of every push)",
    "nccl: whether two processes on one GPU can form the NCCL weight-sync group",
]
NOT_CHECKED = [
    "NCCL broadcast bandwidth: needs two GPUs (world size 1 moves nothing; two ranks on one GPU are refused)",
    "vLLM on CUDA (engines, tensor parallelism, CUDA graphs, the receiving side of the sync and its "
    "partial-load check)",
    "the GPU sampler's cost of per-request seeds, and rollout.seeded_sampling=false's repeatability on GPUs",
    "an engine core child process (vLLM's GPU layout) outliving its actor when the actor dies",
    "the NCCL sync group's timeout while a receiver is still generating (async mode)",
    "anything across GPUs or nodes (multi-rank ZeRO over NCCL, placement of roles on GPUs)",
]


def coverage() -> str:
    """What this script checks and what it cannot, as printed."""
    return ("Checked on one GPU:\n" + "\n".join(f"- {line}" for line in CHECKED)
            + "\n\nNot checked on one GPU:\n" + "\n".join(f"- {line}" for line in NOT_CHECKED))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic_groups(num_prompts: int, group_size: int, vocab: int, prompt_len: int, completion_len: int,
                     seed: int):
    from common.prompt_group import PromptGroup

    rng = random.Random(seed)
    groups = []
    for i in range(num_prompts):
        prompt = [rng.randrange(2, 258) for _ in range(prompt_len)]
        completions = [[rng.randrange(2, vocab) for _ in range(rng.randrange(completion_len * 3 // 4, completion_len))]
                       for _ in range(group_size)]
        groups.append(PromptGroup(
            index=i, prompt="", answer="", prompt_ids=prompt, completions=[""] * group_size,
            completion_ids=completions, finish_reasons=["stop"] * group_size, policy_version=0,
            sampler_logprobs=[[-rng.uniform(9.0, 13.0) for _ in c] for c in completions],
            rewards=[float(rng.random() < 0.5) for _ in range(group_size)]))
    return groups


def _clock(sync):
    sync()
    return time.perf_counter()


def logprobs_stage(vocab: int, positions: int) -> dict:
    """Chunked against full log-softmax, forward and backward, at the real vocabulary."""
    import torch

    from learner.logprobs import chosen_logprobs, entropy

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    torch.manual_seed(0)
    base = (torch.randn(positions, vocab, device=device) * 3).to(torch.bfloat16 if gpu else torch.float32)
    targets = torch.randint(0, vocab, (positions,), device=device)
    weights = torch.randn(positions, device=device)
    out = {"positions": positions, "vocab": vocab, "logits_gb": base.numel() * base.element_size() / 1e9}
    results = {}
    for name in ("full", "chunked"):
        logits = base.clone().requires_grad_(True)
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated() if gpu else 0
        start = _clock(sync)
        if name == "full":
            log_p = torch.log_softmax(logits.float(), dim=-1)
            values = log_p.gather(-1, targets[:, None]).squeeze(-1)
            ent = -(log_p.exp() * log_p).sum(-1).detach()
        else:
            values = chosen_logprobs(logits, targets)
            ent = entropy(logits.detach())
        (values * weights).sum().backward()
        seconds = _clock(sync) - start
        extra = (torch.cuda.max_memory_allocated() - held) / 1e9 if gpu else float("nan")
        results[name] = (values.detach().float(), ent.float(), logits.grad.float())
        out[f"{name}_seconds"] = round(seconds, 4)
        out[f"{name}_peak_extra_gb"] = round(extra, 2)
        del logits, values, ent
    (fv, fe, fg), (cv, ce, cg) = results["full"], results["chunked"]
    out["max_abs_diff_logprob"] = float((fv - cv).abs().max())
    out["max_abs_diff_entropy"] = float((fe - ce).abs().max())
    out["max_abs_diff_grad"] = float((fg - cg).abs().max())
    return out


def learner_stage(model_path: str, zero_stage: int, vocab: int, shape: dict) -> dict:
    import torch
    from common import weight_sync
    from common.config import LearnerConfig
    from learner import engines
    from learner.actor import LearnerRank

    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    from common.config import AlgoConfig

    learner_cfg = LearnerConfig(num_gpus_per_rank=1, zero_stage=zero_stage, num_ranks=1, lr=1e-6,
                                max_tokens_per_microbatch=shape["budget"])
    started = time.perf_counter()
    rank = LearnerRank(0, 1, "127.0.0.1", free_port(), model_path, learner_cfg, AlgoConfig(), shape["completion_len"],
                       seed=0)
    rank.snapshot_reference()  # beta > 0: the frozen reference's forward is part of the step
    out = {"zero_stage": zero_stage, "setup_s": round(time.perf_counter() - started, 1), "dtype": str(rank.policy.dtype),
           "device": torch.cuda.get_device_name(0) if gpu else "cpu",
           "params_m": sum(getattr(p, "ds_numel", p.numel()) for p in rank.policy.module.parameters()) / 1e6}
    G = 8
    runs = [("full batch, budget", shape["prompts"], shape["budget"]),
            ("half batch, budget", shape["prompts"] // 2, shape["budget"]),
            ("half batch, no budget", shape["prompts"] // 2, 0)][:shape.get("runs", 3) if zero_stage == 3 else 3]
    out["runs"] = []
    for i, (name, prompts, budget) in enumerate(runs):
        rank.micro.budget = budget  # the token budget of this run's micro-batches
        groups = synthetic_groups(prompts, G, vocab, shape["prompt_len"], shape["completion_len"], seed=i)
        tokens = sum(len(g.prompt_ids) + len(c) for g in groups for c in g.completion_ids)
        run = {"run": name, "rows": prompts * G, "tokens": tokens, "budget": budget}
        try:
            if gpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            seconds = []
            for _ in range(2):  # the first step includes allocator and kernel warm-up
                start = _clock(sync)
                metrics = rank.train_on(groups, temperature=1.0, lr=1e-6)
                seconds.append(round(_clock(sync) - start, 3))
            run.update(step_seconds=seconds, peak_memory_gb=round(metrics["learner_peak_memory_mb"] / 1024, 2),
                       micro_batches=metrics["micro_batches"], loss=metrics["loss"], kl=metrics["kl"],
                       grad_norm=metrics["grad_norm"], tokens_per_s=round(tokens / seconds[-1]))
        except torch.OutOfMemoryError as error:
            run["error"] = f"out of memory: {str(error).splitlines()[0][:200]}"
        out["runs"].append(run)
    # Packing the weights into bf16 buckets on the GPU (what rank 0 does before each broadcast).
    spec = weight_sync.make_spec(list(rank.policy.sync_tensors().items()), "bfloat16", 64)
    named = rank.policy.sync_tensors()
    packs = []
    for _ in range(3):
        start = _clock(sync)
        for bucket in spec.buckets():
            tensors = [named[t.name] for t in bucket]
            with engines.gathered(tensors, rank.cfg.zero_stage):
                flat = weight_sync.pack(tensors, "bfloat16")
        packs.append(_clock(sync) - start)
    del flat
    out["pack_bytes"] = spec.total_bytes
    out["pack_seconds"] = [round(s, 4) for s in packs]
    out["pack_gbps"] = round(spec.total_bytes / min(packs) / 1e9, 1)
    return out


def _receiver(port: int, queue) -> None:
    try:
        import torch

        from common import weight_sync

        torch.cuda.set_device(0)
        group = weight_sync.join_group("127.0.0.1", port, 1, 2, 20.0, "nccl")
        flat = torch.empty(1 << 20, dtype=torch.bfloat16, device=group.device)
        weight_sync.broadcast(group, flat)
        torch.cuda.synchronize()
        queue.put({"received_sum": float(flat.float().sum())})
    except Exception as error:  # reported: the point is to see what NCCL says
        queue.put({"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"})


def nccl_stage() -> dict:
    """A root and a receiver on the same GPU, as a colocated deployment would try."""
    import torch

    from common import weight_sync

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
        torch.cuda.synchronize()
        out["root"] = "sent"
    except Exception as error:
        out["root_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    child.join(60)
    out.update(queue.get(timeout=5) if not queue.empty() else {"receiver": "no answer"})
    if child.is_alive():
        child.kill()
    return out


def build_model(shape: dict, cache: str) -> str:
    from common.config import ModelConfig
    from data.tiny_model import build_tiny_model

    fields = {k: shape[k] for k in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size",
                                    "max_position_embeddings")}
    return build_tiny_model(ModelConfig(name="tiny", cache_dir=cache, tie_word_embeddings=True, **fields), seed=0)


def run_stage(args: list, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"stage": args, "failed": f"exit {proc.returncode}", "stderr": proc.stderr[-2500:]}
    return json.loads(lines[-1][7:])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU: checks the script, measures nothing")
    parser.add_argument("--list", action="store_true", help="print what the script checks and what it cannot")
    parser.add_argument("--stage", default=None, help="internal: run one stage in this process")
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--cache", default="/tmp/grpo-models")
    args = parser.parse_args()
    shape = dict(DRY, prompts=4, prompt_len=20, completion_len=40, budget=400, positions=256) if args.dry_run else \
        dict(REAL, prompts=16, prompt_len=200, completion_len=560, budget=16384, positions=16384, runs=1)
    if args.stage == "logprobs":
        print("RESULT " + json.dumps(logprobs_stage(shape["vocab_size"], shape["positions"])), flush=True)
        return 0
    if args.stage == "learner":
        print("RESULT " + json.dumps(learner_stage(args.model, args.zero, shape["vocab_size"], shape)), flush=True)
        return 0
    if args.list:
        print(coverage())
        return 0
    print("Checked on one GPU:\n" + "\n".join(f"- {line}" for line in CHECKED) + "\n", flush=True)
    if args.dry_run:
        print("--dry-run: toy sizes on the CPU; the figures below check the script, they measure nothing\n",
              flush=True)
    dry = ["--dry-run"] if args.dry_run else []
    started = time.perf_counter()
    model = build_model(shape, args.cache)
    print(json.dumps({"model": model, "build_s": round(time.perf_counter() - started, 1)}), flush=True)
    results = {"logprobs": run_stage(["--stage", "logprobs", *dry], 120)}
    print(json.dumps(results["logprobs"]), flush=True)
    for zero in (2, 3):
        results[f"zero{zero}"] = run_stage(["--stage", "learner", "--zero", str(zero), "--model", model, *dry],
                                           240 if zero == 2 else 150)
        print(json.dumps(results[f"zero{zero}"]), flush=True)
    import torch

    if torch.cuda.is_available():
        results["nccl_two_ranks_one_gpu"] = nccl_stage()
        print(json.dumps({"nccl_two_ranks_one_gpu": results["nccl_two_ranks_one_gpu"]}), flush=True)
    print("\nNot checked on one GPU:\n" + "\n".join(f"- {line}" for line in NOT_CHECKED))
    failed = [k for k, v in results.items() if isinstance(v, dict) and "failed" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
