"""Long answers at full speed: sync, async, streaming and streaming + partial rollouts on the
long-tailed task (`data=long_tail`), after the bound this host allows.

    .venv/bin/python bench/long_tail.py [--rounds 3] [--steps 10] [--output-dir runs/bench] [overrides...]

First the bound: one vLLM engine of the built-in model (as a generation worker runs it), 512
requests whose lengths are forced (min_tokens = max_tokens, EOS ignored) to the task's own
answer lengths (its reference scratchpads, tokenized, plus the end token), all in one call,
against the same number of tokens with every request at the mean length: their time ratio is
what a chunk that waits for its longest sample costs here. Beside them, in turn, the same engine
kept full as streaming keeps it (`add_request` as slots free up, `step`), over four calls' worth
of those requests: its tokens/s while the feed lasts against the one call's. Then `grpo train data=long_tail`,
same seed and steps, in each mode, the order alternating each round (at most three rounds).

From each run's metrics.jsonl (steps after the first: the first of the async modes has nothing
made ahead) and summary.json: completion tokens per second end to end (tokens / step time),
generation throughput (tokens sampled per second spent inside engine steps, `time_engine`), the
engines' slot occupancy (tokens / (engine steps x max_num_seqs)), step time by phase, tokens per
policy version lag, and held-out accuracy after the run. Targets (issue 50): streaming + partial's
generation throughput at least sync's x (1 + 0.75 x (bound - 1)); the end-to-end bound from the
phase times is sync's step time over max(generate / bound, train + sync). Writes
bench/results/long_tail.json (bench/results_io.py).
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GRPO = str(Path(sys.executable).parent / "grpo")
MODES = {
    "sync": ["trainer.mode=sync"],
    "async": ["trainer.mode=async"],
    "streaming": ["trainer.mode=async", "rollout.streaming=true"],
    "streaming_partial": ["trainer.mode=async", "rollout.streaming=true", "rollout.partial=true"],
}
PHASES = ("time_step", "time_wait_rollout", "time_generate", "time_reward", "time_train", "time_weight_sync")


def task_lengths(n: int, overrides) -> list:
    """Token lengths of n reference answers of the long-tailed task (+1: the end token), and
    the built-in model's folder."""
    from cluster.cli.checks import resolve_model
    from cluster.cli.compose import load_config
    from data.datasets import load_problems
    from transformers import AutoTokenizer

    cfg = load_config(["data=long_tail", *overrides])
    model = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model)
    train = load_problems(cfg.data, cfg.trainer.seed).train
    lengths = [len(tokenizer(p.solution)["input_ids"]) + 1 for p in train[:n]]
    return lengths, model, [p.prompt for p in train[:n]], cfg


def bound(repeats: int, overrides) -> dict:
    """The tail's cost on one engine, in four arms run in turn `repeats` times: the task's forced
    lengths in one call (the engine queues what its batch cannot hold, then drains to the
    longest) against the same tokens at the mean length, and each of them kept full as streaming
    keeps an engine over four calls' worth of requests. `bound` is the first pair's time ratio;
    `kept_full_over_tail` what keeping the batch full gains over the one call, the same lengths."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    lengths, model, prompts, cfg = task_lengths(512, overrides)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=cfg.rollout.max_model_len,
              kv_cache_memory_bytes=int(cfg.rollout.kv_cache_gib * 2**30), enable_chunked_prefill=False,
              max_num_batched_tokens=max(cfg.rollout.max_model_len, 8192), seed=0)
    tokenizer = llm.get_tokenizer()
    prompt_lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    mean = round(sum(lengths) / len(lengths))
    slots = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    arms = {"tail, one call": (lengths, None), "mean, one call": ([mean] * len(lengths), None),
            "tail, kept full": (lengths * STREAMED_CALLS, slots),
            "mean, kept full": ([mean] * len(lengths) * STREAMED_CALLS, slots)}
    for per_request, cap in arms.values():  # warm every shape the arms will run once, untimed
        drive(llm, prompts, prompt_lengths, per_request[:len(lengths)], cap)
    runs = {arm: [] for arm in arms}
    for _ in range(repeats):
        for arm, (per_request, cap) in arms.items():
            runs[arm].append(drive(llm, prompts, prompt_lengths, per_request, cap))
    ordered = sorted(lengths)
    tail = [r["seconds"] for r in runs["tail, one call"]]
    flat = [r["seconds"] for r in runs["mean, one call"]]
    return {"requests": len(lengths), "median": statistics.median(lengths), "p90": ordered[int(0.9 * len(ordered))],
            "max": ordered[-1], "mean": mean, "max_num_seqs": slots, "tail_seconds": tail, "mean_seconds": flat,
            "bound": statistics.median(tail) / statistics.median(flat), "arms": runs,
            # Pairs in turn, so each shares the host's speed of the moment.
            "kept_full_over_tail": [k["full_tokens_per_s"] / t["tokens_per_s"]
                                    for k, t in zip(runs["tail, kept full"], runs["tail, one call"])],
            "mean_kept_full_over_tail_kept_full": [m["full_tokens_per_s"] / k["full_tokens_per_s"]
                                                   for m, k in zip(runs["mean, kept full"], runs["tail, kept full"])]}


STREAMED_CALLS = 4
"""The kept-full arms stream this many calls' worth of requests."""


def drive(llm, prompts, prompt_lengths, lengths, cap) -> dict:
    """Requests of the forced `lengths` through the engine as `GenerationWorker` drives it
    (`add_request`, `step`): all at once (`cap` None: one call, vLLM queues what its batch cannot
    hold), or fed as requests finish, never more than `cap` (max_num_seqs) in the engine, so the
    batch stays full while the feed lasts (a streamed run's steady state, where the next step's
    prompts fill what this one's tail leaves). Reports tokens/s over the whole drive and while
    the feed lasted, engine steps, tokens a step, and the mean context a sampled token attends
    over (its prompt and the tokens before it)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    feed = list(enumerate(lengths))
    admitted, context = {}, 0.0
    full_tokens = full_s = tokens = steps = 0.0
    started = time.perf_counter()
    while feed or engine.has_unfinished_requests():
        while feed and (cap is None or engine.get_num_unfinished_requests() < cap):
            i, k = feed.pop(0)
            engine.add_request(f"drive-{i}", prompts[i % len(prompts)],
                               SamplingParams(max_tokens=k, min_tokens=k, ignore_eos=True, temperature=1.0, seed=i))
            admitted[f"drive-{i}"] = [prompt_lengths[i % len(prompts)], k]
        full = bool(feed)
        step_started = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - step_started
        # Every running request sampled one token (no chunked prefill, no speculation); the ones
        # vLLM holds waiting for a slot (one call past max_num_seqs) sampled none.
        running = [r for r in admitted.values() if r[1] > 0][:engine.vllm_config.scheduler_config.max_num_seqs]
        for r in running:
            context += r[0]
            r[0] += 1
            r[1] -= 1
        for out in outputs:
            if out.finished:
                admitted.pop(out.request_id, None)
        tokens += len(running)
        steps += 1
        if full:
            full_tokens += len(running)
            full_s += seconds
    seconds = time.perf_counter() - started
    return {"requests": len(lengths), "tokens": tokens, "seconds": seconds, "steps": steps,
            "tokens_per_s": tokens / seconds, "tokens_per_step": tokens / steps,
            "full_tokens_per_s": full_tokens / full_s if full_s else None,
            "mean_context": context / max(tokens, 1.0)}


def summarize(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    steady = rows[1:] or rows

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in steady)

    lags = {}
    for row in steady:
        for key, value in row.items():
            if key.startswith("tokens_lag_"):
                lags[key] = lags.get(key, 0.0) + value
    tokens = total("completion_tokens")

    def whole(key: str) -> float:
        # Over the whole run: a streamed step's engine steps are what the engines did while the
        # step before it trained, not the steps of its own groups.
        return sum(r.get(key, 0.0) for r in rows)

    return {
        "steps": len(rows), "completion_tokens": tokens,
        "tokens_per_s": tokens / max(total("time_step"), 1e-9),
        "generation_tokens_per_s": whole("sampled_tokens") / max(whole("time_engine"), 1e-9),
        "slot_occupancy": whole("sampled_tokens") / max(whole("engine_slots"), 1e-9),
        **{phase: total(phase) / len(steady) for phase in PHASES},
        "staleness_mean": statistics.mean(r.get("staleness_mean", 0.0) for r in steady),
        # The sampler/trainer mismatch: what a sample that spans a push (KV kept) adds to the rest.
        **{key: statistics.mean(r[key] for r in steady) for key in ("sampler_logprob_gap", "mismatch_k3",
                                                                     "multi_version_groups") if key in steady[0]},
        "dropped_stale": sum(r.get("dropped_stale", 0.0) for r in rows),
        "tokens_by_lag": lags,
        "heldout_before": summary["heldout_accuracy_before"], "heldout_after": summary["heldout_accuracy_after"],
        "heldout_size": summary["heldout_size"], "minutes": summary["wall_minutes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the four modes (order alternating), 1-3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bound-repeats", type=int, default=3, help="rounds of the bound's four arms, in turn")
    parser.add_argument("--bound-only", action="store_true",
                        help="measure the bound alone and write bench/results/long_tail_bound.json")
    parser.add_argument("--output-dir", default="runs/bench")
    parser.add_argument("--output", default=None, help="the JSON result (default bench/results/long_tail.json)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if not 1 <= args.rounds <= 3:
        parser.error("--rounds must be 1, 2 or 3")
    from bench import results_io

    if args.bound_only:
        probe = bound(args.bound_repeats, args.overrides)
        print_bound(probe)
        factor = 1 + 0.75 * (probe["bound"] - 1)
        results_io.Result("long_tail_bound").write(
            {"bound": probe["bound"], "target_factor": factor,
             "kept_full_over_tail": results_io.spread(probe["kept_full_over_tail"]),
             "kept_full_target_met": min(probe["kept_full_over_tail"]) >= factor,
             "mean_kept_full_over_tail_kept_full": results_io.spread(probe["mean_kept_full_over_tail_kept_full"])},
            path=Path(args.output) if args.output else None, bound_probe=probe)
        return
    result = results_io.Result("long_tail")
    # A run cut short (a time limit's SIGTERM) still writes what it measured, marked incomplete.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    probe, runs = None, {mode: [] for mode in MODES}
    try:
        probe = bound(args.bound_repeats, args.overrides)
        measure(args, result, probe, runs)
    except BaseException:
        result.write({"complete": False, "bound": probe and probe["bound"]},
                     path=Path(args.output) if args.output else None, bound_probe=probe)
        raise


def print_bound(probe: dict) -> None:
    print(f"bound on this host: {probe['bound']:.2f}x (forced task lengths, median {probe['median']}, p90 "
          f"{probe['p90']}, max {probe['max']}, in one call, against the same tokens at the mean {probe['mean']}); "
          f"kept full: {', '.join(f'{r:.2f}x' for r in probe['kept_full_over_tail'])} the one call's tokens/s",
          flush=True)
    for arm, runs in probe.get("arms", {}).items():
        print(f"  {arm}: " + "; ".join(f"{r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_step']:.0f} a step, mean "
                                       f"context {r['mean_context']:.0f})" for r in runs), flush=True)


def measure(args, result, probe: dict, runs: dict) -> None:
    """The four modes in alternating order, then the summary and the result file."""
    from bench import results_io
    from bench.compare import Comparison

    print_bound(probe)
    stamp, order = time.strftime("%Y%m%d-%H%M%S"), list(MODES)
    for round_ in range(args.rounds):
        for mode in (order if round_ % 2 == 0 else order[::-1]):
            name = f"long-tail-{mode}-{stamp}-{round_}"
            subprocess.run([GRPO, "train", "data=long_tail", *MODES[mode], f"trainer.run_name={name}",
                            f"trainer.max_steps={args.steps}", f"trainer.output_dir={args.output_dir}",
                            "trainer.progress=false", "trainer.save_every=0", "trainer.eval_every=0",
                            # Two steps ahead: the next step's prompts fill the engines while this
                            # one's tail finishes (streaming); the same budget for today's async.
                            "trainer.async_lookahead=2", "algo.max_staleness=2", *args.overrides], check=True)
            figures = summarize(Path(args.output_dir) / name)
            runs[mode].append(figures)
            result.add_run({"round": round_, "mode": mode, **figures})
            print(f"round {round_ + 1} {mode}: {figures['tokens_per_s']:.0f} tokens/s end to end, "
                  f"{figures['generation_tokens_per_s']:.0f} in engine steps, occupancy {figures['slot_occupancy']:.2f}, "
                  f"step {figures['time_step']:.2f} s, held-out {figures['heldout_after']:.1%}", flush=True)

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    sync_gen = median("sync", "generation_tokens_per_s")
    factor = 1 + 0.75 * (probe["bound"] - 1)
    target = sync_gen * factor
    # A target is met when the worst pair (one round's two runs) meets it.
    generation = Comparison(a=[r["generation_tokens_per_s"] for r in runs["streaming_partial"]],
                            b=[r["generation_tokens_per_s"] for r in runs["sync"]], target=factor,
                            label_a="streaming + partial", label_b="sync")
    pairs = generation.ratios
    # End to end: generation at most `bound` times faster and overlapped with the learner's side.
    learner_s = median("sync", "time_train") + median("sync", "time_weight_sync")
    e2e_bound = median("sync", "time_step") / max(median("sync", "time_generate") / probe["bound"], learner_s)
    summary = {
        "complete": True,
        "bound": probe["bound"],
        "generation_target_tokens_per_s": target,
        "target_factor": factor,
        "generation_ratio_per_round": pairs,
        "generation_target_met": generation.met,
        # The same target for the engine alone, kept full as streaming keeps it, against one call
        # that waits for its longest request: what the mechanism gives without a learner beside it.
        "kept_full_over_tail": results_io.spread(probe["kept_full_over_tail"]),
        "kept_full_target_met": min(probe["kept_full_over_tail"]) >= factor,
        "end_to_end_bound": e2e_bound,
        **{f"{mode}_{key}": results_io.spread(r[key] for r in runs[mode]) for mode in MODES
           for key in ("tokens_per_s", "generation_tokens_per_s", "slot_occupancy", "time_step", "heldout_after",
                       "sampler_logprob_gap") if all(key in r for r in runs[mode])},
    }
    for mode in MODES:
        print(f"{mode}: generation {median(mode, 'generation_tokens_per_s'):.0f} tokens/s "
              f"({median(mode, 'generation_tokens_per_s') / sync_gen:.2f}x sync), end to end "
              f"{median(mode, 'tokens_per_s'):.0f} tokens/s ({median(mode, 'tokens_per_s') / median('sync', 'tokens_per_s'):.2f}x)")
    print(f"target for streaming + partial: {factor:.2f}x sync's tokens/s in engine steps, per round "
          f"{', '.join(f'{r:.2f}x' for r in pairs)} ({'met' if summary['generation_target_met'] else 'not met'}); "
          f"the engine kept full against one call: {', '.join(f'{r:.2f}x' for r in probe['kept_full_over_tail'])} "
          f"({'met' if summary['kept_full_target_met'] else 'not met'}); end-to-end bound from sync's phases "
          f"{e2e_bound:.2f}x")
    result.write(summary, path=Path(args.output) if args.output else None, bound_probe=probe)


if __name__ == "__main__":
    main()
