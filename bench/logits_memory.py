"""Memory of the log-prob stage at a real vocabulary (Qwen2.5's 151,936 tokens), against
learner/memory_plan.py.

Two measurements, each in a fresh process (the kernel's peak resident memory, VmHWM, reset just
before; the rise is the peak less the resident memory at that moment):
- `logprobs`: learner/logprobs.py's `token_logprobs` with entropy on `--rows` x 512 tokens, every
  position a target, then the backward of a weighted sum of the chosen log-probs: the rise in
  logits-sized copies (float32 here: tokens x vocabulary x 4 bytes);
- `step`: a learner step (learner/actor.py's LearnerRank, DeepSpeed ZeRO-2 on the CPU, one rank,
  beta > 0 so the reference forward runs too) of the built-in model with
  `model.vocab_size=151936`, rows of 512 tokens (8 of prompt), at each micro-batch budget
  (`--budgets`, `learner.max_tokens_per_microbatch`); the first step (the optimizer's state) is
  not measured. Its rise against learner/memory_plan.py's `micro_batch_bytes` for the budget
  (activations, logits, log-prob working memory); the rest is the step's other working memory
  (gradients of the embedding, the optimizer's step, the allocator).

    .venv/bin/python bench/logits_memory.py --label after

Writes (merging by label, so the `before` run of an older commit stays beside the `after` one)
bench/results/logits_memory.json. Memory figures are not disturbed by other jobs on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 151936
SEQ = 512
PROMPT = 8
RESULT = ROOT / "bench" / "results" / "logits_memory.json"


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith(field + ":")).split()[1]) * 1024  # kB


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS (Linux >= 4.0)


def _model_cfg(cache: str, hidden: int, layers: int):
    from common.config import ModelConfig

    return ModelConfig(cache_dir=cache, hidden_size=hidden, num_layers=layers, num_heads=2,
                       intermediate_size=2 * hidden, max_position_embeddings=SEQ, vocab_size=VOCAB)


def measure_logprobs(cache: str, rows: int, hidden: int, layers: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from data.tiny_model import build_tiny_model
    from learner.logprobs import token_logprobs

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(_model_cfg(cache, hidden, layers)),
                                                 dtype=torch.float32)
    torch.manual_seed(0)
    ids = torch.randint(2, VOCAB, (rows, SEQ))
    attention = torch.ones_like(ids)
    targets = torch.ones((rows, SEQ - 1), dtype=torch.bool)
    weights = torch.randn(rows, SEQ - 1)
    out = []
    for _ in range(2):  # the first call's one-time allocations (threads, caches) are not measured
        _reset_peak()
        before = _status_bytes("VmRSS")
        chosen, ent = token_logprobs(model, ids, attention, 1.0, with_entropy=True, targets=targets)
        (chosen * weights).sum().backward()
        out.append(_status_bytes("VmHWM") - before)
        del chosen, ent
        model.zero_grad(set_to_none=True)
    logits = rows * (SEQ - 1) * VOCAB * 4
    return {"rows": rows, "tokens": rows * SEQ, "rise_bytes": out[-1], "logits_bytes": logits,
            "copies": out[-1] / logits}


def measure_step(cache: str, budget: int, rows: int, hidden: int, layers: int, steps: int) -> dict:
    import torch

    from common.config import AlgoConfig, LearnerConfig
    from data.tiny_model import build_tiny_model
    from learner.actor import LearnerRank
    from learner.memory_plan import ModelShape

    torch.set_num_threads(1)
    path = build_tiny_model(_model_cfg(cache, hidden, layers))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = LearnerConfig(num_ranks=1, minibatches=1, max_tokens_per_microbatch=budget)
    rank = LearnerRank(0, 1, "127.0.0.1", port, path, cfg, AlgoConfig(), SEQ, 0)
    rank.snapshot_reference()
    rises, micro = [], 0
    for step in range(steps + 1):
        groups = _groups(rows, step)
        _reset_peak()
        before = _status_bytes("VmRSS")
        metrics = rank.train_on(groups, temperature=1.0, lr=1e-4)
        if step:  # the first step allocates the optimizer's state
            rises.append(_status_bytes("VmHWM") - before)
        micro = int(metrics["micro_batches"])
    shape = ModelShape.from_folder(path)
    plan = {"activations": budget * shape.activation_bytes_per_token(4, False),
            "logits": shape.logits_bytes(budget, 4), "working": shape.logprob_working_bytes(budget, 4)}
    plan["total"] = sum(plan.values())
    rise = max(rises)
    return {"budget": budget, "rows": rows, "micro_batches": micro, "rise_bytes": rises, "plan_bytes": plan,
            "logits_copies": rise / plan["logits"], "rise_over_plan": rise / plan["total"]}


def _groups(rows: int, seed: int):
    from common.prompt_group import PromptGroup

    rng = random.Random(seed)
    G = 2
    return [PromptGroup(index=i, prompt="", answer="", prompt_ids=[rng.randrange(2, 258) for _ in range(PROMPT)],
                        completions=[""] * G, policy_version=0, finish_reasons=["length"] * G,
                        completion_ids=[[rng.randrange(2, VOCAB) for _ in range(SEQ - PROMPT)] for _ in range(G)],
                        rewards=[float(j) for j in range(G)]) for i in range(rows // G)]


def _child(argv) -> None:
    kind, cache, *rest = argv
    args = [int(a) for a in rest]
    result = measure_logprobs(cache, *args) if kind == "logprobs" else measure_step(cache, *args)
    print(json.dumps(result), flush=True)


def _run_child(*args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, "--child", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=1200)
    if proc.returncode:
        raise SystemExit(f"child {args} failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "learner"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return head + (" (learner/ modified)" if dirty else "")


def table(result: dict) -> str:
    """The runs of a result file, one row per measurement: the rise in logits-sized copies and
    against learner/memory_plan.py."""
    lines = ["| run | commit | measurement | logits (float32) | peak rise | logits copies | rise / plan |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for run in result["runs"]:
        label = run["label"]
        commit = run["commit"][:10] + (" + changes" if "modified" in run["commit"] else "")
        commit += f" ({run['note']})" if run.get("note") else ""
        lp = run["logprobs"]
        lines.append(f"| {label} | {commit} | `token_logprobs` + backward, {lp['rows']} x {SEQ} tokens "
                     f"| {lp['logits_bytes'] / 2**20:,.0f} MiB | {lp['rise_bytes'] / 2**20:,.0f} MiB | {lp['copies']:.2f} | |")
        for step in run["steps"]:
            rise = max(step["rise_bytes"])
            lines.append(f"| {label} | {commit} | learner step, budget {step['budget']:,} tokens "
                         f"({step['micro_batches']} micro-batches) | {step['plan_bytes']['logits'] / 2**20:,.0f} MiB "
                         f"| {rise / 2**20:,.0f} MiB | {step['logits_copies']:.2f} | {step['rise_over_plan']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    if argv is None and sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", help="the run's name in the result file (before, after)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--rows", type=int, default=4, help="rows of 512 tokens: of the log-prob stage and a step")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="measured steps after the first")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "grpo" / "bench-models"))
    parser.add_argument("--output", default=str(RESULT))
    parser.add_argument("--table", action="store_true", help="print the result file's runs as a Markdown table")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.output).read_text())))
        return
    if not args.label:
        parser.error("--label is required to measure")
    from bench.results_io import Result

    out = Path(args.output)
    # One current file holds every label's latest run (`before` may be of an older commit): each
    # run carries its own command, commit, date and load.
    kept = [r for r in json.loads(out.read_text())["runs"] if r["label"] != args.label] if out.exists() else []
    result = Result("logits_memory")
    run = {"label": args.label, "command": result.record["command"], "commit": _commit(),
           "date": result.record["date"]["start"], "loadavg_before": result.record["loadavg"]["before"],
           "vocab_size": VOCAB, "seq": SEQ, "hidden": args.hidden, "layers": args.layers,
           "logprobs": _run_child("logprobs", args.cache, args.rows, args.hidden, args.layers),
           "steps": [_run_child("step", args.cache, b, args.rows, args.hidden, args.layers, args.steps)
                     for b in args.budgets]}
    run["loadavg_after"] = list(os.getloadavg())
    for previous in kept:
        result.add_run(previous)
    result.add_run(run)
    summary = {r["label"]: {"logprob_copies": round(r["logprobs"]["copies"], 2),
                            **{f"step_{s['budget']}_copies": round(s["logits_copies"], 2) for s in r["steps"]},
                            **{f"step_{s['budget']}_over_plan": round(s["rise_over_plan"], 2) for s in r["steps"]}}
               for r in result.record["runs"]}
    result.write(summary, path=out)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
