"""What one GPU can show about the GPU path, and nothing more; exit status 1 when any of it is wrong.

Run on a GPU machine: `python bench/gpu_check.py [--output bench/results/gpu_check.json]`. It
builds a random-weight model with Qwen2.5-0.5B's width, depth, MLP and 151,936-token vocabulary
(the built-in byte tokenizer; the extra vocabulary rows are never sampled), then, each stage in
its own process:

- `logprobs`: the learner's own call, `token_logprobs(model, ids, attention, with_entropy=True,
  targets=mask)` on the model in bf16 with gradient checkpointing (the learner's GPU default),
  then the backward, against a float32 log-softmax of the same model's full logits: the largest
  differences of log-probs, entropies and parameter gradients, and the peak memory the call adds
  against learner/memory_plan.py's micro-batch terms.
- `learner`: the real `LearnerRank` in bf16 under ZeRO-2 and ZeRO-3, one GRPO step on the
  README recipe's batch per rank with a micro-batch budget, then on half that batch with the
  same budget, then on half without a budget: peak GPU memory against the plan, micro-batch
  counts that follow the budget. Then the product's push path, `WeightSender.join` (the join
  probe that connects the group) and `WeightSender.push` over a world-size-1 NCCL group (gloo
  on the CPU): gathering and packing every bucket, timed on the GPU's own clock.

Every figure that can be wrong has a limit (`LIMITS`, each derived below from the numerics or
the plan); a figure past its limit, a stage that runs out of memory or fails, ends the script
with exit status 1 after every stage has printed. It prints what it checks (CHECKED) before it
starts and what it cannot (NOT_CHECKED) at the end; `--list` prints both and exits. A
broadcast's bandwidth needs two GPUs (a group of world size 1 moves no bytes, and NCCL refuses
two ranks on one GPU: the wait-timeout path is tested on gloo, tests/integration/
test_weight_sync.py), and vLLM's CUDA build is not on that machine. `--dry-run` runs the same
code on the CPU at toy sizes: it measures nothing (memory limits are not applied there), but the
test suite runs it (tests/integration/test_gpu_check.py), with `--inject` setting a figure past
its limit to see the script fail, so the script cannot rot.
"""
from __future__ import annotations

import argparse
import json
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
    "logprobs: the learner's token_logprobs call at the vocabulary (bf16, checkpointed) against a float32 "
    "log-softmax: log-probs, entropies, parameter gradients, peak memory against the plan",
    "learner: one LearnerRank in bf16 under ZeRO-2 and ZeRO-3, GRPO steps whose peak memory must stay within the "
    "plan and follow learner.max_tokens_per_microbatch, not the batch",
    "push: WeightSender.join with its join probe over a world-size-1 NCCL group, and WeightSender.push "
    "(gathering and packing every bucket), timed with CUDA events",
]
NOT_CHECKED = [
    "NCCL broadcast bandwidth: needs two GPUs (world size 1 moves nothing; two ranks on one GPU are refused)",
    "a sync wait that times out on NCCL (needs two ranks; the same finish() path is tested on gloo)",
    "vLLM on CUDA (engines, tensor parallelism, CUDA graphs, Model Runner V2's seeded sampling, the receiving "
    "side of the sync and its partial-load check)",
    "an engine core child process (vLLM's GPU layout) outliving its actor when the actor dies",
    "anything across GPUs or nodes (multi-rank ZeRO over NCCL, placement of roles on GPUs)",
]

# Limits, and where each comes from. A log-prob is a float32 log-softmax of the same logits in
# both computations, differing only in summation order: a few float32 ulps of its size, which is
# at most max|z| + ln V; 2**-16 of that allows 256 ulps. An entropy is at most ln V and sums V
# terms: 2**-14 of ln V. A parameter gradient: both logits gradients are rounded once to the
# model's dtype and then go through the same kernels, so they differ by about one ulp of that
# dtype relative to the largest element; 4 eps allows a few. Memory (GPU only, where the
# allocator counts exactly): the log-prob call adds what learner/memory_plan.py counts for its
# micro-batch (activations, logits, log-prob working memory) plus the model's own gradients,
# within the 15% the plan claims where the logits dominate; a learner step's peak stays within
# 1.5 x the plan's state plus micro-batch, the rest being what the plan leaves out (DeepSpeed's
# buckets, the allocator's slack, ZeRO-3's gathered blocks).
LIMITS = {
    "logprobs.max_abs_diff_logprob": lambda r: 2.0 ** -16 * (r["max_abs_logit"] + r["log_vocab"]),
    "logprobs.max_abs_diff_entropy": lambda r: 2.0 ** -14 * r["log_vocab"],
    "logprobs.max_rel_diff_grad": lambda r: 4 * r["dtype_eps"],
    "logprobs.peak_over_plan": lambda r: 1.15 if r["on_gpu"] else None,
    "learner.peak_over_plan": lambda r: 1.5 if r["on_gpu"] else None,
}


def checks(stage: str, result: dict) -> list:
    """(figure, value, limit) for each limited figure of a stage's result (run by run for the
    learner), with a limit of None where it does not apply (memory on the CPU)."""
    out = []
    records = result.get("runs", [result]) if stage == "learner" else [result]
    for record in records:
        for key, limit in LIMITS.items():
            name = key.split(".", 1)[1]
            if key.startswith(stage + ".") and name in record:
                out.append((f"{stage}.{name}" + (f" ({record['run']})" if "run" in record else ""),
                            record[name], limit({**result, **record})))
    return out


def failures(results: dict) -> list:
    """One line for each stage that failed or ran out of memory and each figure past its limit."""
    lines = []
    for key, result in results.items():
        stage = "learner" if key.startswith("zero") else key
        if "failed" in result:
            lines.append(f"{key}: {result['failed']}")
        for run in result.get("runs", []):
            if "error" in run:
                lines.append(f"{key} {run['run']}: {run['error']}")
        for figure, value, limit in checks(stage, result):
            if limit is not None and not value <= limit:
                lines.append(f"{key}: {figure} = {value:.3g} is past its limit {limit:.3g}")
        for name in result.get("behaviour_failed", []):
            lines.append(f"{key}: {name}")
    return lines


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


def _memory(gpu: bool):
    """(reset, rise in bytes since the reset) of the device's memory: CUDA's allocator on a GPU, the
    process's peak RSS on the CPU (learner/peak_memory.py)."""
    import torch

    from learner.peak_memory import peak_memory_mb, reset_peak_memory

    state = {}

    def reset():
        if gpu:
            torch.cuda.empty_cache()
        reset_peak_memory(gpu)
        state["held"] = torch.cuda.memory_allocated() if gpu else _rss_bytes()

    def rise() -> float:
        return peak_memory_mb(gpu) * 2**20 - state["held"]

    return reset, rise


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) * 1024


def logprobs_stage(model_path: str, shape: dict) -> dict:
    """The learner's token_logprobs call (with entropy, targets from the first completion token)
    and its backward, against a float32 log-softmax of the same model's full logits."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    from learner import engines
    from learner.logprobs import token_logprobs
    from learner.memory_plan import ModelShape

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    model = engines.prepare_for_training(model, checkpointed=gpu)  # the learner's GPU default
    rows, prompt, length = shape["positions"] // shape["seq_len"], shape["prompt_len"], shape["seq_len"]
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(2, vocab, (rows, length), device=device)
    attention = torch.ones_like(ids)
    mask = torch.zeros((rows, length - 1), dtype=torch.bool, device=device)
    mask[:, prompt - 1:] = True
    weights = torch.randn(rows, length - 1, device=device) * mask
    params = [p for p in model.parameters() if p.requires_grad]
    reset, rise = _memory(gpu)

    reset()
    start = _clock(torch.cuda.synchronize if gpu else (lambda: None))
    chosen, ent = token_logprobs(model, ids, attention, 1.0, with_entropy=True, targets=mask, first=prompt - 1)
    grads = torch.autograd.grad((chosen * weights).sum(), params)
    seconds = _clock(torch.cuda.synchronize if gpu else (lambda: None)) - start
    peak = rise()
    chosen, ent = chosen.detach()[mask].float(), ent[mask].float()

    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1].float()
    log_p = torch.log_softmax(logits, dim=-1)
    want = log_p.gather(-1, ids[:, 1:, None]).squeeze(-1)
    want_ent = -(log_p.exp() * log_p).sum(-1).detach()[mask]
    want_grads = torch.autograd.grad((want * weights).sum(), params)
    max_logit = float(logits.detach().abs().max())
    del logits, log_p
    grad_scale = max(float(g.float().abs().max()) for g in want_grads)
    grad_diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads, want_grads))

    plan_shape = ModelShape.from_folder(model_path)
    kept = rows * (length - prompt + 1)  # positions the head runs over (learner/logprobs.py)
    dtype_bytes = 2 if gpu else 4
    plan = {"activations": rows * length * plan_shape.activation_bytes_per_token(dtype_bytes, gpu),
            "logits": plan_shape.logits_bytes(kept, dtype_bytes),
            "working": plan_shape.logprob_working_bytes(kept, dtype_bytes),
            "model_gradients": sum(p.numel() for p in params) * dtype_bytes}
    plan_total = sum(plan.values())
    return {"on_gpu": gpu, "rows": rows, "tokens": rows * length, "logit_positions": kept, "vocab": vocab,
            "dtype": str(dtype), "seconds": round(seconds, 4), "peak_rise_gb": round(peak / 1e9, 3),
            "plan_gb": {k: round(v / 1e9, 3) for k, v in plan.items()},
            "logits_copies": round(peak / plan["logits"], 2), "peak_over_plan": round(peak / plan_total, 3),
            "max_abs_logit": max_logit, "log_vocab": math.log(vocab), "dtype_eps": torch.finfo(dtype).eps,
            "max_abs_diff_logprob": float((chosen - want.detach()[mask]).abs().max()),
            "max_abs_diff_entropy": float((ent - want_ent).abs().max()),
            "max_rel_diff_grad": grad_diff / grad_scale}


def learner_stage(model_path: str, zero_stage: int, vocab: int, shape: dict) -> dict:
    import torch
    from common.config import LearnerConfig
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
    out = {"zero_stage": zero_stage, "on_gpu": gpu, "setup_s": round(time.perf_counter() - started, 1), "dtype": str(rank.policy.dtype),
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
    out.update(_plan(model_path, learner_cfg, gpu, out["runs"]))
    out["behaviour_failed"] = _budget_behaviour(out["runs"])
    out["push"] = push_stage(rank)
    return out


def _plan(model_path: str, learner_cfg, gpu: bool, runs: list) -> dict:
    """Each run's peak against learner/memory_plan.py: the rank's state plus its micro-batch's
    activations, logits and log-prob working memory."""
    from learner.memory_plan import ModelShape, layout_of, per_rank

    from common.config import AlgoConfig

    shape = ModelShape.from_folder(model_path)
    layout = layout_of(learner_cfg, AlgoConfig().beta, gpu)
    state = per_rank(shape, layout).total
    for run in runs:
        tokens = run["budget"] or run["tokens"]
        plan = state + shape.micro_batch_bytes(tokens, layout.dtype_bytes, layout.checkpointed)
        run["plan_gb"] = round(plan / 1e9, 2)
        if "peak_memory_gb" in run:
            run["peak_over_plan"] = round(run["peak_memory_gb"] * 2**30 / plan, 3)
    return {"state_plan_gb": round(state / 1e9, 2)}


def _budget_behaviour(runs: list) -> list:
    """What the micro-batch budget must do, as failed statements (none when it does it)."""
    counts = {r["run"]: r.get("micro_batches") for r in runs}
    failed = []
    full, half, whole = (counts.get(k) for k in ("full batch, budget", "half batch, budget", "half batch, no budget"))
    if full is not None and half is not None and not full > half > 1:
        failed.append(f"the budget must cut the batch by its size: {full} and {half} micro-batches")
    if whole is not None and whole != 1:
        failed.append(f"without a budget the half batch must be one micro-batch, not {whole}")
    return failed


def push_stage(rank) -> dict:
    """The product's push path on one rank: WeightSender.join (its join probe connects the
    group: NCCL on a GPU, world size 1) and WeightSender.push, twice (the first allocates)."""
    from common.ray_utils import free_port

    host, _, backend = rank.sender.sync_address()
    started = time.perf_counter()
    rank.sender.join("127.0.0.1", free_port(), 1, 60.0, backend)
    out = {"backend": backend, "join_s": round(time.perf_counter() - started, 3)}
    spec = rank.sender.weight_spec("bfloat16", 64)
    pushes = [rank.sender.push(spec) for _ in range(2)]
    rank.sender.leave()
    out.update(bytes=pushes[-1]["sync_bytes"], seconds=[round(p["sync_seconds"], 4) for p in pushes],
               pack_seconds=[round(p["sync_pack_seconds"], 4) for p in pushes],
               gathered_max_mb=round(pushes[-1]["sync_gathered_max_mb"], 1))
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


def inject(results: dict, assignments) -> None:
    """`--inject logprobs.max_abs_diff_logprob=1`: a figure set by hand before the limits are
    applied (the suite's check that a figure past its limit fails the script); a learner figure
    goes into every run of both ZeRO stages."""
    for assignment in assignments:
        key, value = assignment.split("=", 1)
        stage, name = key.split(".", 1)
        targets = [results[k] for k in results if k.startswith("zero")] if stage == "learner" else [results[stage]]
        for result in targets:
            for record in result.get("runs", [result]) if stage == "learner" else [result]:
                record[name] = float(value)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU: checks the script, measures nothing")
    parser.add_argument("--list", action="store_true", help="print what the script checks and what it cannot")
    parser.add_argument("--stage", default=None, help="internal: run one stage in this process")
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--cache", default="/tmp/grpo-models")
    parser.add_argument("--inject", action="append", default=[], metavar="STAGE.FIGURE=VALUE",
                        help="set a figure before the limits apply (tests the script's failure path)")
    parser.add_argument("--output", default=None, help="write every stage's result and the verdict here (JSON)")
    parser.add_argument("--recheck", default=None, metavar="OUTPUT",
                        help="apply the limits (and --inject) to a run's --output again, running nothing")
    args = parser.parse_args()
    if args.recheck:
        results = json.loads(Path(args.recheck).read_text())["results"]
        inject(results, args.inject)
        failed = failures(results)
        print("FAILED:\n" + "\n".join(f"- {line}" for line in failed) if failed else "PASSED: every figure within its limit")
        return 1 if failed else 0
    shape = dict(DRY, prompts=4, prompt_len=20, completion_len=40, budget=400, positions=256, seq_len=64) \
        if args.dry_run else \
        dict(REAL, prompts=16, prompt_len=200, completion_len=560, budget=16384, positions=16384, seq_len=768, runs=1)
    if args.stage == "logprobs":
        print("RESULT " + json.dumps(logprobs_stage(args.model, shape)), flush=True)
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
    results = {"logprobs": run_stage(["--stage", "logprobs", "--model", model, *dry], 300)}
    print(json.dumps(results["logprobs"]), flush=True)
    for zero in (2, 3):
        results[f"zero{zero}"] = run_stage(["--stage", "learner", "--zero", str(zero), "--model", model, *dry],
                                           240 if zero == 2 else 150)
        print(json.dumps(results[f"zero{zero}"]), flush=True)
    inject(results, args.inject)
    print("\nNot checked on one GPU:\n" + "\n".join(f"- {line}" for line in NOT_CHECKED))
    failed = failures(results)
    print("\n" + ("FAILED:\n" + "\n".join(f"- {line}" for line in failed) if failed else "PASSED: every figure within its limit"),
          flush=True)
    if args.output:
        from bench.results_io import Result

        record = Result("gpu_check")
        record.add_run(results)
        record.write({"failed": failed, "passed": not failed}, path=Path(args.output), results=results,
                     dry_run=args.dry_run)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
