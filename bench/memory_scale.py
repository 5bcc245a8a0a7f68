"""Peak memory of one learner rank for a GRPO step, by ZeRO stage and gradient checkpointing.

The ranks run as plain processes (no Ray, no engine: learner/actor.py's LearnerRank needs
neither), on a built-in Qwen2-shaped model of the size given, on random prompt groups of a fixed
shape. Each rank reports, as JSON lines on stdout:
- `learner_peak_memory_mb`: the step's metric, the process's peak RSS during the step (VmHWM
  reset at its start): everything resident plus the step's working memory;
- `baseline_mb`: its RSS after the imports (torch, DeepSpeed, transformers, peft), before any
  model (what the model adds is above it);
- `step_rise_mb`: how far the peak rose above the RSS just before the measured step (the
  kernel's peak, VmHWM, reset first), the step's own working memory: activations, logits,
  gradients, optimizer state first touched;
- `step_seconds`: each step's seconds (`step_s`: the last's);
- `phases_mb`: for the engines' start, the reference's snapshot and each step, the peak RSS
  during it (reset at its start) and the RSS after it.

    python bench/memory_scale.py --hidden 768 --layers 8 --heads 12 --inter 3072 --zero 3

`step_rise_mb` and `step_s` are the last step's; the first allocates the optimizer's state.
`--lora 16` trains rank-16 adapters on every linear projection (the `zero3+lora` layout with
`--zero 3`); `tensor_mb` (parameters, the trained ones' gradients, optimizer state, reference)
and `push_mb` against `full_push_mb` say what LoRA saves. `formula` is learner/memory_plan.py's
estimate of the same parts. `--sweep 25M 100M ...` runs each size in each layout (`--layouts`),
one JSON line per run (appended to `--output`); `--allocator` sets the ranks' C allocator
(ALLOCATORS).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS (Linux >= 4.0)


def _groups(args, rank: int):
    from common.prompt_group import PromptGroup

    rng = random.Random(rank)
    G, per_rank = args.group, args.prompts // args.ranks
    return [PromptGroup(index=i, prompt="", answer="", prompt_ids=[rng.randrange(3, 250) for _ in range(args.prompt_len)],
                        completions=[""] * G, policy_version=0, finish_reasons=["stop"] * G,
                        completion_ids=[[rng.randrange(3, 250) for _ in range(args.completion)] for _ in range(G)],
                        rewards=[float(j % 2) for j in range(G)]) for i in range(per_rank)]


def _rank(rank: int, port: int, path: str, args, out) -> None:
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"  # as the rank sets it before its own import
    # The libraries the rank loads are part of the baseline, not of the model.
    import deepspeed  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    from transformers import Qwen2ForCausalLM  # noqa: F401

    from common.config import AlgoConfig, LearnerConfig, LoraConfig
    from learner.actor import LearnerRank

    baseline = _status_mb("VmRSS")
    cfg = LearnerConfig(num_ranks=args.ranks, zero_stage=args.zero, minibatches=1, num_threads=args.threads,
                        max_tokens_per_microbatch=args.budget, gradient_checkpointing=args.checkpointing,
                        lora=LoraConfig(rank=args.lora), deepspeed=json.loads(args.deepspeed))
    phases = {}  # phase -> [peak, resident after] in MB (the peak reset before each phase)
    # As a run without warm-up: the adapters' engine straight away (--full-first: the whole
    # model's engine first, as a warm-up leaves it, then the adapters' at the snapshot).
    learner = LearnerRank(rank, args.ranks, "127.0.0.1", port, path, cfg, AlgoConfig(group_size=args.group),
                          args.completion, 0, adapters_from_start=bool(args.lora) and not args.full_first)
    phases["engines"] = [_status_mb("VmHWM"), _status_mb("VmRSS")]
    _reset_peak()
    learner.snapshot_reference()
    phases["reference"] = [_status_mb("VmHWM"), _status_mb("VmRSS")]
    groups = _groups(args, rank)
    seconds = []
    for step in range(args.steps):
        _reset_peak()
        before, start = _status_mb("VmRSS"), time.perf_counter()
        metrics = learner.train_on(groups, temperature=1.0, lr=1e-5)
        seconds.append(time.perf_counter() - start)
        phases[f"step{step + 1}"] = [_status_mb("VmHWM"), _status_mb("VmRSS")]
    out.put({"rank": rank, "learner_peak_memory_mb": metrics["learner_peak_memory_mb"], "baseline_mb": baseline,
             "step_rise_mb": phases[f"step{args.steps}"][0] - before, "step_s": seconds[-1],
             "step_seconds": [round(t, 3) for t in seconds],
             "micro_batches": metrics["micro_batches"], "loss": metrics["loss"],
             "phases_mb": {k: [round(v) for v in pair] for k, pair in phases.items()}, **_tensors(learner)})


def _numel_bytes(tensors) -> int:
    return sum((t.ds_tensor if hasattr(t, "ds_tensor") else t).numel() * t.element_size() for t in tensors)


def _tensors(learner) -> dict:
    """What this rank's tensors hold (its partitions under ZeRO-3), by the formula's parts:
    parameters, the gradients of the trained ones (their float32 size, counted: DeepSpeed frees
    them after the step), the optimizer (moments, and the float32 master copy DeepSpeed's ZeRO
    optimizers keep apart from the model's parameters), the reference; and what a push sends
    (`push_mb`; `full_push_mb`: every weight)."""
    import torch

    from common.weight_sync import WeightSpec

    policy = learner.policy
    params = list(policy.module.parameters())
    # ZeRO-2 keeps 1/R of each gradient (ZeRO-3's partitions are 1/R already).
    shards = policy.cfg.num_ranks if policy.cfg.zero_stage == 2 else 1
    trained = sum((p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() * 4 for p in params if p.requires_grad)
    trained /= shards
    inner = getattr(policy.optimizer, "optimizer", policy.optimizer)
    own = {(p.ds_tensor if hasattr(p, "ds_tensor") else p).untyped_storage().data_ptr() for p in params}
    master = [t for g in inner.param_groups for t in g["params"] if t.untyped_storage().data_ptr() not in own]
    moments = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    ref = policy.ref_model
    ref_bytes = 0 if ref is None or getattr(ref, "engine", None) is policy.engine else _numel_bytes(
        list(getattr(ref, "module", ref).parameters()))
    spec = WeightSpec.from_wire(learner.weight_spec("float32", 64))
    base = learner.weight_spec("float32", 64, "base")
    full = WeightSpec.from_wire(base).total_bytes if base else spec.total_bytes
    parts = {"params_mb": _numel_bytes(params), "gradients_mb": trained,
             "optimizer_state_mb": _numel_bytes(master) + _numel_bytes(moments), "reference_mb": ref_bytes}
    parts = {k: v / 2**20 for k, v in parts.items()}
    return {**parts, "tensor_mb": sum(parts.values()), "push_mb": spec.total_bytes / 2**20,
            "full_push_mb": full / 2**20}


def _formula(path: str, args) -> dict:
    """learner/memory_plan.py's bytes per rank for this run's layout (float32 on CPUs), in MB."""
    from learner.memory_plan import Layout, ModelShape, per_rank

    shape = ModelShape.from_folder(path)
    layout = Layout(zero_stage=args.zero, ranks=args.ranks, dtype_bytes=4, lora_rank=args.lora,
                    checkpointed=args.checkpointing)
    b = per_rank(shape, layout)
    tokens = (args.prompt_len + args.completion) * args.group * args.prompts // args.ranks
    act = min(tokens, args.budget or tokens) * shape.activation_bytes_per_token(4, args.checkpointing)
    return {"params": shape.parameters(), "parameters_mb": b.parameters / 2**20, "gradients_mb": b.gradients / 2**20,
            "optimizer_mb": b.optimizer / 2**20, "reference_mb": b.reference / 2**20, "total_mb": b.total / 2**20,
            "activations_mb": act / 2**20}


SIZES = {"25M": (512, 6, 8, 2048), "100M": (1024, 6, 16, 4096), "300M": (1024, 18, 16, 4096),
         "1B": (2048, 15, 16, 8192)}
"""--sweep's sizes: hidden, layers, heads, MLP width (float32, the built-in vocabulary of a few hundred)."""
LAYOUTS = {"zero2": ["--zero", "2"], "zero3": ["--zero", "3"], "zero3+gc": ["--zero", "3", "--checkpointing"],
           "zero3+lora": ["--zero", "3", "--lora", "16"]}
ALLOCATORS = ("product", "glibc", "release", "thresholds")
"""--allocator: the ranks' C allocator settings as `grpo train` starts them (learner/peak_memory.py's
allocator_env for this layout: ZeRO-3 on CPU returns freed memory), glibc's defaults, freed
memory returned (RETURN_FREED_MEMORY) whatever the layout, or its two thresholds without huge
pages (the rows marked `malloc`, as earlier runs set them)."""


def run_once(args) -> dict:
    """One run: the model built (once), the ranks started, their reports gathered."""
    import os

    from common.config import ModelConfig
    from data.tiny_model import build_tiny_model

    path = build_tiny_model(ModelConfig(cache_dir=args.cache, hidden_size=args.hidden, num_layers=args.layers,
                                        num_heads=args.heads, intermediate_size=args.inter,
                                        max_position_embeddings=max(256, args.prompt_len + args.completion + 1)))
    from common.config import LearnerConfig
    from learner.peak_memory import RETURN_FREED_MEMORY, allocator_env

    for name in RETURN_FREED_MEMORY:
        os.environ.pop(name, None)
    cfg = LearnerConfig(num_ranks=args.ranks, zero_stage=args.zero,
                        return_freed_memory={"product": None, "glibc": False}.get(args.allocator, True))
    args.allocator_env = allocator_env(cfg)
    if args.allocator == "thresholds":
        args.allocator_env.pop("GLIBC_TUNABLES", None)
        args.malloc = True  # the rows' label
    os.environ.update(args.allocator_env)  # read by glibc when each spawned rank starts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, path, args, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = sorted((out.get() for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    config = json.loads((Path(path) / "config.json").read_text())
    setting = {k: v for k, v in vars(args).items() if k not in ("cache", "sweep", "output", "table", "layouts")}
    return {"setting": setting, "model": {k: config[k] for k in ("hidden_size", "num_hidden_layers",
                                                                  "intermediate_size", "vocab_size")},
            "formula": _formula(path, args), "ranks": results, "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


def sweep(args) -> None:
    """Every size x layout of --sweep, each in its own processes, one JSON line each in --output."""
    import subprocess

    from bench import results_io

    passed = [a for a in sys.argv[1:] if a not in args.sweep and a not in ("--sweep",)]
    for size in args.sweep:
        hidden, layers, heads, inter = SIZES[size]
        # --pairs N: the layouts in turn, N rounds (A B A B ...), so that a ratio of two layouts
        # is taken per round (bench/compare.py) and the host's drift cannot decide it
        for pair in range(args.pairs):
            for name in args.layouts:
                cmd = [sys.executable, __file__, *passed, "--hidden", str(hidden), "--layers", str(layers), "--heads",
                       str(heads), "--inter", str(inter), *LAYOUTS[name]]
                before = results_io.loadavg()
                proc = subprocess.run(cmd, capture_output=True, text=True)
                line = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else None
                result = json.loads(line) if line else {"error": proc.stderr.strip().splitlines()[-3:]}
                result.update(size=size, layout=name, pair=pair)
                print(json.dumps(result), flush=True)
                if args.output:
                    results_io.append_jsonl(Path(args.output), result, "memory_scale", before)


def step_seconds(ranks: list) -> float:
    """The median step's seconds after the first (which allocates the optimizer's state); rows
    of earlier runs have the last step's only."""
    import statistics

    if "step_seconds" not in ranks[0]:
        return sum(r["step_s"] for r in ranks) / len(ranks)
    return statistics.median(t for r in ranks for t in r["step_seconds"][1:] or r["step_seconds"])


def table(path: str) -> str:
    """The markdown table of a --sweep's JSON lines: per run the mean over its ranks."""
    from bench import results_io

    return table_rows(results_io.load(Path(path)))


def compare_layouts(records: list, a: str, b: str, size: str, target: float = None):
    """Layout a's peak per rank against layout b's, pair by pair (`--pairs`): less is better, so
    the ratio is b / a and above 1 a peaks lower (bench/compare.py)."""
    from bench.compare import Comparison

    def peaks(layout):
        return {r.get("pair", 0): sum(k["learner_peak_memory_mb"] for k in r["ranks"]) / len(r["ranks"])
                for r in records if r.get("size") == size and r.get("layout") == layout and "error" not in r}
    pa, pb = peaks(a), peaks(b)
    pairs = sorted(set(pa) & set(pb))
    return Comparison(a=[pa[i] for i in pairs], b=[pb[i] for i in pairs], lower_is_better=True, target=target,
                      label_a=a, label_b=b)


def table_rows(records: list) -> str:
    """The markdown table of a --sweep's records: per run the mean over its ranks."""
    head = ("| size | layout | completion tokens | peak per rank MB | above baseline MB | formula: state + activations MB "
            "| above / formula | tensors counted MB | formula state MB | step rise MB | step s | push MB | load |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = [head]
    for run in records:
        if "error" in run:
            rows.append(f"| {run['size']} | {run['layout']} | failed: {' '.join(run['error'])[-200:]} |")
            continue
        f, ranks = run["formula"], run["ranks"]

        def mean(key, ranks=ranks):
            return sum(r[key] for r in ranks) / len(ranks)
        above = mean("learner_peak_memory_mb") - mean("baseline_mb")
        paper = f["total_mb"] + f["activations_mb"]
        layout = run["layout"] + (" (malloc)" if run["setting"].get("malloc") else
                                  " (freed memory returned)" if run["setting"].get("allocator_env") else "")
        if run["setting"].get("full_first"):
            layout += ", full engine first"
        if run["setting"].get("deepspeed", "{}") != "{}":
            layout += f", learner.deepspeed={run['setting']['deepspeed']}"
        rows.append(f"| {run['size']} ({f['params'] / 1e6:.1f} M) | {layout} | {run['setting']['completion']} "
                    f"| {mean('learner_peak_memory_mb'):,.0f} | {above:,.0f} | {f['total_mb']:,.0f} + "
                    f"{f['activations_mb']:,.0f} | {above / paper:.2f} | {mean('tensor_mb'):,.0f} | {f['total_mb']:,.0f} "
                    f"| {mean('step_rise_mb'):,.0f} | {step_seconds(ranks):.1f} | {mean('push_mb'):,.1f} "
                    f"of {mean('full_push_mb'):,.1f} | {_load(run['loadavg'])} |")
    return "\n".join(rows)


def _load(load) -> str:
    """The 1-minute load: the run's own (older rows) or before -> after it (results_io's)."""
    if isinstance(load, dict):
        before, after = load.get("before"), load.get("after")
        return f"{before[0]} -> {after[0]}" if before else str(after[0])
    return str(load[0])


def _anon_mb(pid: int) -> float:
    """A process's anonymous resident memory (RssAnon): what the kernel cannot drop under
    pressure, unlike the pages of a memory-mapped checkpoint, which PSS counts too."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


def job(overrides) -> dict:
    """A real `grpo train` with these overrides, its whole process tree's memory (the sum of
    each process's PSS, shared pages split between their sharers) sampled every 0.5 s: the
    peak, by process name at that moment, the peak of the summed anonymous memory, and the
    run's start-of-run estimate line."""
    import subprocess

    import psutil

    cmd = [sys.executable, "-m", "cluster.train", *overrides]
    start, peak, parts, peak_anon = time.time(), 0.0, {}, 0.0
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        now = {}
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        anon = 0.0
        for p in tree:
            try:
                name = " ".join(p.cmdline()[:2])[-60:]
                now[f"{p.pid} {name}"] = p.memory_full_info().pss / 2**20
                anon += _anon_mb(p.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
                pass
        peak_anon = max(peak_anon, anon)
        if sum(now.values()) > peak:
            peak, parts = sum(now.values()), now
        time.sleep(0.5)
    reader.join(timeout=10)
    estimate = [ln.strip() for ln in lines if "learner memory per rank" in ln]
    return {"overrides": overrides, "rc": proc.returncode, "wall_s": round(time.time() - start, 1),
            "peak_pss_mb": round(peak), "peak_anon_mb": round(peak_anon), "at_peak_mb": {k: round(v) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
                                                      if v > 50},
            "estimate": estimate, "tail": [ln.rstrip() for ln in lines[-8:]],
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 768), ("layers", 8), ("heads", 12), ("inter", 3072), ("ranks", 2), ("zero", 2),
                          ("prompts", 4), ("group", 2), ("prompt-len", 16), ("completion", 32), ("budget", 4096),
                          ("steps", 2), ("threads", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--checkpointing", action="store_true", help="learner.gradient_checkpointing=true")
    parser.add_argument("--lora", type=int, default=0, help="learner.lora.rank (0: full fine-tuning)")
    parser.add_argument("--full-first", action="store_true",
                        help="with --lora: build the whole model's engine first, as after a warm-up")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="product",
                        help="the ranks' C allocator settings: as grpo train sets them, glibc's, freed memory "
                             "returned, or its thresholds alone")
    parser.add_argument("--deepspeed", default="{}", help="learner.deepspeed (JSON), merged over the generated config")
    parser.add_argument("--sweep", nargs="*", choices=list(SIZES), default=[],
                        help="run each of these sizes in each --layouts (other flags apply to every run)")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--output", help="--sweep, --job: append each run's JSON line (with its command, commit, "
                        "host and load: bench/results_io.py) to this file")
    parser.add_argument("--pairs", type=int, default=1,
                        help="--sweep: run the layouts in turn this many rounds (A B A B ...) for per-round ratios")
    parser.add_argument("--job", nargs=argparse.REMAINDER,
                        help="run `grpo train` with the overrides that follow and report its processes' peak memory")
    parser.add_argument("--table", help="print the markdown table of this --output file, run nothing")
    parser.add_argument("--cache", default="~/.cache/grpo/models")
    args = parser.parse_args()
    if args.job is not None:
        from bench import results_io

        before = results_io.loadavg()
        record = job(args.job)
        print(json.dumps(record), flush=True)
        if args.output:
            results_io.append_jsonl(Path(args.output), record, "memory_scale_jobs", before)
    elif args.table:
        print(table(args.table))
    elif args.sweep:
        sweep(args)
    else:
        print(json.dumps(run_once(args)), flush=True)


if __name__ == "__main__":
    main()
