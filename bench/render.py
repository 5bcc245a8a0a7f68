"""The docs' tables of measured figures, rendered from the result files in bench/results/.

    .venv/bin/python bench/render.py            # rewrite every marked table in the pages below
    .venv/bin/python bench/render.py --check    # exit 1 when a page's table is not its file's

A page marks a table with `<!-- table: NAME -->` and `<!-- /table -->` lines; what lies between
is TABLES[NAME] rendered from its file, never typed (tests/unit/test_results.py fails when the
two differ, so an edited table or a changed file without a re-render shows). A new table: a
function from the file's records to markdown, an entry in TABLES, the markers on the page.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402

PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md", ROOT / "docs" / "performance.md",
         ROOT / "docs" / "development.md", ROOT / "docs" / "learner.md", ROOT / "bench" / "README.md",
         ROOT / "bench" / "results" / "memory_scale.md"]
MARKED = re.compile(r"^<!-- table: (?P<name>[\w.-]+) -->\n(?P<body>.*?)^<!-- /table -->$", re.S | re.M)
REGENERATE = ".venv/bin/python bench/render.py"


def _memory_scale(records: List[dict]) -> str:
    from bench.memory_scale import table_rows

    return table_rows(records)


def _largest_model(records: List[dict]) -> str:
    """`bench/memory_scale.py --job` runs: what ran and what ran out of memory, the whole job's peak."""
    rows = ["| fine-tuning | ZeRO | parameters | allocator | commit | result | peak, all processes MB | the largest "
            "processes at the peak MB | load before -> after |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        overrides = dict(o.split("=", 1) for o in r["overrides"] if "=" in o)
        lora = overrides.get("learner.lora.rank")
        estimate = r["estimate"][0] if r.get("estimate") else ""
        params = re.search(r"estimate, ([\d.,]+ M) parameters", estimate)
        allocator = ("glibc's defaults" if overrides.get("learner.return_freed_memory") == "false" else
                     f"as run, with {r['env']}" if r.get("env") else "as `grpo train` set it at the commit")
        result = "ran, exit 0" if r["rc"] == 0 else f"failed, exit {r['rc']}: {_why(r)}"
        top = ", ".join(f"{name.split(' ', 1)[1].strip().split('.')[0]} {mb:,}"
                        for name, mb in list(r["at_peak_mb"].items())[:3])
        load = r.get("loadavg", {})
        rows.append(f"| {'LoRA r' + lora if lora else 'full'} | {overrides.get('learner.zero_stage', '2')} "
                    f"| {params.group(1) if params else '?'} (L {overrides.get('model.num_layers')}) | {allocator} "
                    f"| {_commit(r)} | {result} | {r['peak_pss_mb']:,} | {top} | {_load(load)} |")
    # The largest model each layout ran (exit 0) and the smallest that failed, as run on this machine.
    layouts: Dict[str, Dict[str, list]] = {}
    for r in records:
        overrides = dict(o.split("=", 1) for o in r["overrides"] if "=" in o)
        lora = overrides.get("learner.lora.rank")
        name = f"{'LoRA r' + lora if lora else 'full fine-tuning'}, ZeRO-{overrides.get('learner.zero_stage', '2')}"
        params = re.search(r"estimate, ([\d.,]+) M parameters", r["estimate"][0] if r.get("estimate") else "")
        if params:
            size = float(params.group(1).replace(",", ""))
            layouts.setdefault(name, {"ran": [], "failed": []})["ran" if r["rc"] == 0 else "failed"].append(size)
    lines = []
    for name, x in layouts.items():
        ran = max(x["ran"], default=None)
        failed = min((f for f in x["failed"] if ran is None or f > ran), default=None)
        lines.append(f"{name}: " + (f"the largest that ran {ran:,.1f} M" if ran else "none ran")
                     + (f", the smallest larger one failed at {failed:,.1f} M" if failed else ""))
    base = max(layouts.get("full fine-tuning, ZeRO-2", {}).get("ran", []), default=None)
    if base:
        lines = [line + (f" ({max(layouts[n]['ran']) / base:.1f}x full ZeRO-2's)" if layouts[n]["ran"] and
                         not n.startswith("full fine-tuning, ZeRO-2") else "")
                 for line, n in zip(lines, layouts)]
    return "\n".join(rows + [""] + [f"- {line}" for line in lines])


def _commit(record: dict) -> str:
    """The commit a run measured, or where a line written before the script recorded it was kept."""
    c = record.get("commit") or {}
    if c.get("sha"):
        return c["sha"][:7] + (" + changes" if c.get("dirty") else "")
    return f"before {c['recorded_in'][:7]}" if c.get("recorded_in") else "?"


def _why(record: dict) -> str:
    tail = " ".join(record.get("tail", []))
    if "out of memory" in tail or "OOM" in tail or "killed" in tail:
        return "out of memory (Ray's monitor or the kernel killed a process)"
    return (record.get("tail") or ["?"])[-1][:80].replace("|", "/")


def _load(load) -> str:
    if isinstance(load, dict):
        before, after = load.get("before"), load.get("after")
        return f"{before[0] if before else '?'} -> {after[0] if after else '?'}"
    return f"? -> {load[0]}" if load else "?"


def _reload_alone(records: List[dict]) -> str:
    """`bench/weight_sync.py --reload-alone`: the same reload path for both layouts, the direct
    copy beside it (plain layers only), and generation speed."""
    rows = ["| model | engine threads | linear layers | reload (vLLM's layerwise path) | direct copy into the "
            "parameters | memory copy, same bytes | generation tokens/s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in records[0]["runs"]:
        linear = "oneDNN, packed (vLLM's default)" if r["linear"] == "onednn" else "torch, plain"
        direct = f"{r['direct_s']:.3f} s" if r.get("direct_s") is not None else "-"
        rows.append(f"| {r['size']} | {r['threads']} | {linear} | {r['reload_s']:.3f} s | {direct} "
                    f"| {r['memcpy_s']:.3f} s | {r['gen_tokens_per_s']:,.0f} |")
    return "\n".join(rows)


def _default_run(records: List[dict]) -> str:
    """`bench/default_run.py --record`: per seed, the warm-up, held-out accuracy before and after
    GRPO, and the minutes."""
    rows = ["| seed | warm-up steps | held-out after warm-up | after GRPO | job minutes |",
            "| --- | --- | --- | --- | --- |"]
    for r in records[0]["runs"]:
        s = r["summary"]
        rows.append(f"| {r['seed']} | {r['warmup_steps']} | {s['heldout_accuracy_before']:.1%} "
                    f"| {s['heldout_accuracy_after']:.1%} | {s['wall_minutes']:.1f} |")
    return "\n".join(rows)


def _suite(records: List[dict], slowest: int = 15) -> str:
    """`bench/suite_durations.py`: pytest's total, the outcomes, seconds per tier, the totals of the
    commit's runs kept with `--earlier` and their median, the slowest tests."""
    s = records[0]["summary"]
    outcomes = ", ".join(f"{n} {kind}" for kind, n in sorted(s["outcomes"].items()))
    tiers = ", ".join(f"{tier} {sec:,.0f} s" for tier, sec in sorted(s["tier_seconds"].items()))
    runs = s.get("pytest_seconds_runs") or []
    over = ""
    if len(runs) > 1:  # the budget is a median of runs: each run of this commit, with its host probe
        each = "; ".join(f"{r['pytest_seconds']:,.1f} s (host probe before it: "
                         f"{r['host_probe']['before'] if r.get('host_probe') else 'none'})" for r in runs)
        over = f" Runs of this commit: {each}; median {s['pytest_seconds_spread']['median']:,.1f} s."
    rows = [f"{s['tests']} tests ({outcomes}); pytest's total {s['pytest_seconds']} s; by tier: {tiers}.{over}", "",
            "| test | seconds | outcome |", "| --- | --- | --- |"]
    rows += [f"| `{t['test']}` | {t['seconds']:.1f} | {t['outcome']} |" for t in records[0]["runs"][:slowest]]
    return "\n".join(rows)


def _spread(s: dict, fmt: str = "{:.2f}") -> str:
    """A results_io.spread as 'median (min-max)', or the one value."""
    if s["n"] == 1:
        return fmt.format(s["median"])
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def _logits_memory(records: List[dict]) -> str:
    from bench.logits_memory import table

    return table(records[0])


def _memory_plan(records: List[dict]) -> str:
    """`bench/plan_tables.py`: learner/memory_plan.py's per-GPU table for each model (computed)."""
    out = []
    for run in records[0]["runs"]:
        out += [f"{run['model']}: {run['parameters'] / 1e9:.2f} B parameters, {run['dtype']}, "
                f"{'AdamW' if run['optimizer'] == 'adamw' else run['optimizer']}, {run['gpus']} x {run['gpu_gb']:.0f} GB, "
                f"micro-batch {run['tokens']:,} tokens (GB per GPU)", "",
                "| layout | parameters | gradients | optimizer | reference | model state | activations | logits | left "
                "| fits | largest micro-batch (tokens) |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in run["rows"]:
            optimizer = f"{r['optimizer_gb']:.1f}" + (f" (+{r['offloaded_gb']:.1f} on host)" if r["offloaded_gb"] else "")
            out.append(f"| {r['layout']} | {r['parameters_gb']:.1f} | {r['gradients_gb']:.1f} | {optimizer} "
                       f"| {r['reference_gb']:.1f} | {r['model_state_gb']:.1f} | {r['activations_gb']:.1f} "
                       f"| {r['logits_gb']:.1f} | {r['left_gb']:.1f} | {'yes' if r['fits'] else 'no'} "
                       f"| {r['largest_micro_batch_tokens']:,} |")
        out.append("")
    return "\n".join(out[:-1])


def _end_to_end(records: List[dict]) -> str:
    """`bench/end_to_end.py`: one run's throughput, per-phase medians and shares of step time."""
    run = records[0]["runs"][0]
    phases = ("time_generate", "time_reward", "time_train", "time_weight_sync")
    names = {"time_step": "whole step", "time_generate": "generation", "time_reward": "scoring",
             "time_train": "learner update", "time_weight_sync": "weight sync"}
    rows = [f"{run['steps']} steps; {run['completions_per_s']:.0f} completions/s, {run['tokens_per_s']:,.0f} completion "
            f"tokens/s over steps 2 and on (evaluations included); first step {run['first_step_s']:.1f} s; held-out "
            f"{run['before']:.1%} -> {run['after']:.1%}"
            + (f", {run['bar']:.0%} first reached at step {run['reached'][0]} ({run['reached'][1]:.0f} s after the "
               f"first step began)" if run.get("reached") else f", never at {run['bar']:.0%}")
            + f"; the job {run['job_minutes']:.1f} minutes.", "",
            "| phase | median seconds a step | share of step time |", "| --- | --- | --- |"]
    rows.append(f"| {names['time_step']} | {run['median_s']['time_step']:.2f} | 100% |")
    for phase in phases:
        rows.append(f"| {names[phase]} | {run['median_s'][phase]:.2f} | {run['shares'][phase]:.1%} |")
    rows.append(f"| held-out evaluations | | {run['eval_share']:.1%} |")
    rows.append(f"| none of these (driver, Ray calls, buffer) | | {run['overhead_share']:.1%} |")
    return "\n".join(rows)


def _checkpoint_cost(records: List[dict]) -> str:
    """`bench/checkpoint_cost.py`: a save against a step, per model size."""
    rows = ["| model | saves | seconds a save (mean) | step (median) | save / step | checkpoint on disk |",
            "| --- | --- | --- | --- | --- | --- |"]
    names = {"default": "the built-in job (20 steps)", "100M": "12 blocks, 768 wide, MLP 3072 (3 steps of 16 prompts)"}
    for r in records[0]["runs"]:
        rows.append(f"| {names.get(r['size'], r['size'])} | {r['checkpoints']} | {r['seconds_per_save']:.2f} s "
                    f"| {r['step_seconds_median']:.2f} s | {r['save_over_step']:.2f} | {r['checkpoint_mb']:,.0f} MB |")
    return "\n".join(rows)


def _chaos(records: List[dict]) -> str:
    """`bench/chaos.py`: per mode, the kills, what was logged and whether the run equals the straight one."""
    rows = ["| mode | kills (step: what) | survived | each step logged once | final weights equal | samples.jsonl "
            "equal | same prompts and samples | in-run recovery s | new driver resumed after s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    yes = {True: "yes", False: "no"}
    for r in records[0]["runs"]:
        steps = r["steps_logged"]
        once = steps == sorted(set(steps))
        kills = ", ".join(f"{k['step']}: {k['kind']}" for k in r["kills"])
        back = "; ".join(f"{kind} {', '.join('no line' if s is None else f'{s:.1f}' for s in secs)}"
                         for kind, secs in sorted(r["in_run_seconds"].items()))
        resumed = "; ".join(f"{x['kind']} {x['seconds']}" for x in r["resume_seconds"])
        rows.append(f"| {r['mode']} | {kills} | {len(r['kills'])} of {len(r['kills'])} (exit 0) | {yes[once]} "
                    f"({len(steps)} steps) | {yes[r['same_weights']]} | {yes[r['same_samples']]} "
                    f"| {yes[r['same_prompts']]} | {back or '-'} | {resumed or '-'} |")
    return "\n".join(rows)


def _agent_throughput(records: List[dict]) -> str:
    """`bench/agent_throughput.py`: each agent's rate over the loop's, per round, and its CPU a request."""
    rec = records[0]
    s = rec["summary"]
    agents = [name for name in ("agent", "async agent") if name in s]
    depth = f" (+{s['extra_layers']} layers)" if s["extra_layers"] else ""
    rows = [f"| agent{depth} | per round, agent / loop | median (min-max) | agent processes' CPU ms a request "
            "(median) | the endpoint's CPU ms a request beyond the loop's (median) | an endpoint that cost nothing "
            "would reach |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name in agents:
        c = s[name]["comparison"]
        rows.append(f"| {name} | {', '.join(f'{x:.2f}' for x in c['ratios'])} | {c['median']:.2f} ({c['min']:.2f}-"
                    f"{c['max']:.2f}) | {s[name]['client_ms_per_request']['median']:.2f} "
                    f"| {s[name]['server_ms_per_request']['median']:.2f} "
                    f"| {s[name]['ceiling_free_endpoint']['median']:.2f} |")
    rows += ["", f"The loop: {_spread(s['loop_tokens_per_s'], '{:,.0f}')} sampled tokens/s (median of the rounds, "
                 f"min-max)."]
    return "\n".join(rows)


def _long_tail(records: List[dict]) -> str:
    """`bench/long_tail.py`: the bound, then each mode's medians over the rounds."""
    rec = records[0]
    s, probe = rec["summary"], rec["bound_probe"]
    names = {"sync": "sync", "async": "async (chunks)", "streaming": "streaming",
             "streaming_partial": "streaming + partial rollouts"}
    runs: Dict[str, List[dict]] = {}
    for r in rec["runs"]:
        runs.setdefault(r["mode"], []).append(r)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    rows = ["| mode | rounds | completion tokens/s end to end | x sync | tokens/s in engine steps | x sync | slot "
            "occupancy | step s | generate s (streaming: first prompt issued to last group scored) | train s | staleness | "
            "k3 mismatch | held-out after |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, label in names.items():
        if mode not in runs:
            continue
        rows.append(f"| {label} | {len(runs[mode])} | {med(mode, 'tokens_per_s'):,.0f} "
                    f"| {med(mode, 'tokens_per_s') / med('sync', 'tokens_per_s'):.2f} "
                    f"| {med(mode, 'generation_tokens_per_s'):,.0f} "
                    f"| {med(mode, 'generation_tokens_per_s') / med('sync', 'generation_tokens_per_s'):.2f} "
                    f"| {med(mode, 'slot_occupancy'):.2f} | {med(mode, 'time_step'):.2f} | {med(mode, 'time_generate'):.2f} "
                    f"| {med(mode, 'time_train'):.2f} | {med(mode, 'staleness_mean'):.2f} | {med(mode, 'mismatch_k3'):.4f} "
                    f"| {med(mode, 'heldout_after'):.1%} |")
    rows += ["", f"The bound in this run: one engine, {probe['requests']} requests of the task's lengths (median "
                 f"{probe['median']:.0f}, p90 {probe['p90']}, max {probe['max']} tokens) in one call took "
                 f"{s['bound']:.2f}x the time of the same tokens at the mean length; the target factor "
                 f"1 + 0.75 x (bound - 1) = {s.get('target_factor', 1 + 0.75 * (s['bound'] - 1)):.2f}."]
    if "generation_ratio_per_round" in s:
        rows[-1] += (f" In the runs, streaming + partial's tokens/s in engine steps over sync's, per round: "
                     f"{', '.join(f'{x:.2f}x' for x in s['generation_ratio_per_round'])} "
                     f"({'met' if s['generation_target_met'] else 'not met'}); the end-to-end bound from sync's phase "
                     f"times: {s['end_to_end_bound']:.2f}x.")
    return "\n".join(rows)


def _long_tail_task(records: List[dict]) -> str:
    """`bench/long_tail_task.py --result`: lengths, held-out accuracy by digits and the learner's view."""
    s = records[0]["summary"]["this_run"]
    means, models = s["step_means"], records[0]["runs"][0]["models"]
    rows = ["| completion tokens, one step's batch sampled | median | p90 | max | max / median | longest / shortest "
            "within each batch of trainer.prompts_per_step prompts |", "| --- | --- | --- | --- | --- | --- |"]
    for key, label in (("after_warmup", "after the warm-up"), ("after_grpo", "after GRPO")):
        x = models[key]["lengths"]
        rows.append(f"| {label} | {x['median']:.0f} | {x['p90']:.0f} | {x['max']} | {x['max_over_median']:.1f} "
                    f"| {', '.join(f'{b:.1f}' for b in x['batch_max_over_min'])} |")
    curve = ", ".join(f"step {step}: {acc:.1%}" for step, acc in s["heldout_curve"])
    rows += ["", f"Held-out accuracy {s['heldout_before']:.1%} after the warm-up, {s['heldout_after']:.1%} after GRPO "
                 f"({curve}).", "", "| digits | 2 | 3 | 4 | 5 | 6 | 7 | 8 and more |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for when in ("before", "after"):
        by = s[f"heldout_by_digits_{when}"]
        cells = []
        for d in range(2, 8):
            x = by.get(str(d), {"right": 0, "of": 0})
            cells.append(f"{x['right']} of {x['of']}")
        rest = [v for k, v in by.items() if int(k) >= 8]
        cells.append(f"{sum(x['right'] for x in rest)} of {sum(x['of'] for x in rest)}")
        rows.append(f"| right, {'after the warm-up' if when == 'before' else 'after GRPO'} | {' | '.join(cells)} |")
    rows += ["", f"Per step, means over the run: padded share of the learner's tokens {means['padded_fraction']:.1%} "
                 f"({means['micro_batches']:.1f} micro-batches), sampler/learner mismatch: mean |delta log p| "
                 f"{means['sampler_logprob_gap']:.1e}, k3 {means['mismatch_k3']:.1e}, chi-squared "
                 f"{means['mismatch_chi2']:.1e}; completions cut at the cap {means['truncated_fraction']:.2%}."]
    return "\n".join(rows)


def _zero_layouts(records: List[dict]) -> str:
    """`bench/memory_scale.py --sweep 100M --layouts zero2 zero3 --pairs 3`: ZeRO-3's peak per
    rank over ZeRO-2's, pair by pair, for each allocator setting and step size (no step seconds:
    the tests of the round's changes shared the host with some of these runs)."""

    groups: Dict[tuple, Dict[str, List[dict]]] = {}
    for r in records:
        if "error" in r:
            continue
        key = (r["setting"].get("allocator", "product"), r["setting"]["prompts"], r["setting"]["group"], r["setting"]["completion"])
        groups.setdefault(key, {}).setdefault(r["layout"], []).append(r)
    allocators = {"release": "freed memory returned (both)", "glibc": "glibc's defaults (both)",
                  "product": "as `grpo train` sets it", "thresholds": "the thresholds alone (both)"}

    def peak(r: dict) -> float:
        return sum(k["learner_peak_memory_mb"] for k in r["ranks"]) / len(r["ranks"])

    def ranks_gap(runs: List[dict]) -> float:
        return max(max(k["learner_peak_memory_mb"] for k in r["ranks"]) - min(k["learner_peak_memory_mb"]
                                                                              for k in r["ranks"]) for r in runs)

    rows = ["| step | allocator | ZeRO-2 peak per rank MB, each run | ZeRO-3, each run | ZeRO-3 / ZeRO-2 per pair "
            "| median (min-max) | widest gap between a run's two ranks MB, ZeRO-2 and ZeRO-3 |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for (allocator, prompts, group, completion), layouts in groups.items():
        two, three = layouts.get("zero2", []), layouts.get("zero3", [])
        ratios = [peak(b) / peak(a) for a, b in zip(two, three)]
        if not ratios:
            continue
        rows.append(f"| {prompts} prompts x {group} x {completion} tokens | {allocators.get(allocator, allocator)} "
                    f"| {', '.join(f'{peak(r):,.0f}' for r in two)} | {', '.join(f'{peak(r):,.0f}' for r in three)} "
                    f"| {', '.join(f'{x:.1%}' for x in ratios)} | {statistics.median(ratios):.1%} ({min(ratios):.1%}-"
                    f"{max(ratios):.1%}) | {ranks_gap(two):,.0f}, {ranks_gap(three):,.0f} |")
    return "\n".join(rows)


def _packing(records: List[dict]) -> str:
    """`bench/packing.py --result`: padded against packed micro-batches, per budget, in turn."""
    s = records[0]["summary"]
    rows = ["| `max_tokens_per_microbatch` | padded share: padded, packed | micro-batches: padded, packed | seconds: "
            "padded, packed | packed / padded seconds per round, median (min-max) |",
            "| --- | --- | --- | --- | --- |"]
    for budget, x in s.items():
        ratio = x["packed_over_padded_seconds"]
        rows.append(f"| {int(budget):,} | {x['padded_fraction_padded']['median']:.1%}, "
                    f"{x['padded_fraction_packed']['median']:.1%} | {x['micro_batches_padded']['median']:.0f}, "
                    f"{x['micro_batches_packed']['median']:.0f} | {x['seconds_padded']['median']:.3f}, "
                    f"{x['seconds_packed']['median']:.3f} | {_spread(ratio)} |")
    return "\n".join(rows)


def _hostile_inputs(records: List[dict]) -> str:
    """`bench/hostile_inputs.py`: every hostile case's seconds against the bound."""
    s = records[0]["summary"]
    slowest = max(records[0]["runs"], key=lambda r: r["seconds"])
    return (f"{s['within_bound']} of {s['cases']} hostile cases came back within the bound of `timeout_s + 1 s` = "
            f"{s['bound_s']:g} s (`reward.timeout_s={s['timeout_s']:g}`); seconds per case "
            f"{_spread(s['seconds'])} (median, min-max); the slowest: `{slowest['case']}` ({slowest['verifier']}), "
            f"{slowest['seconds']:.2f} s.")


def _verifier_throughput(records: List[dict]) -> str:
    """`bench/verifier_throughput.py`: completions scored per second, the best of the timed calls."""
    rows = ["| verifier | completions | in-process /s | pool, 1 worker /s | pool, 2 workers /s |",
            "| --- | --- | --- | --- | --- |"]
    for run in records[0]["runs"]:
        best = records[0]["summary"][run["verifier"]]["completions_per_s_best"]
        rows.append(f"| {run['verifier']} | {run['completions']:,} | {best['in-process']:,.0f} "
                    f"| {best['pool, 1 worker']:,.0f} | {best['pool, 2 workers']:,.0f} |")
    return "\n".join(rows)


def _long_tail_bound(records: List[dict]) -> str:
    """`bench/long_tail.py --bound-only`: one engine, four arms in turn, and what they say."""
    rec = records[0]
    probe, s = rec["bound_probe"], rec["summary"]
    rows = ["| arm | tokens/s, each round | median | engine steps | tokens a step | mean context a token "
            "attends over |", "| --- | --- | --- | --- | --- | --- |"]
    for arm, runs in probe["arms"].items():
        rates = [r["tokens_per_s"] for r in runs]
        rows.append(f"| {arm} | {', '.join(f'{x:,.0f}' for x in rates)} | {statistics.median(rates):,.0f} "
                    f"| {statistics.median(r['steps'] for r in runs):,.0f} "
                    f"| {statistics.median(r['tokens_per_step'] for r in runs):.0f} "
                    f"| {statistics.median(r['mean_context'] for r in runs):.0f} |")
    kept = probe["kept_full_over_tail"]
    ctx = probe["mean_kept_full_over_tail_kept_full"]
    rows += ["", f"{probe['requests']} requests a call, the task's lengths forced (median {probe['median']:.0f}, p90 "
                 f"{probe['p90']}, max {probe['max']} tokens; mean {probe['mean']}), max_num_seqs {probe['max_num_seqs']}; "
                 f"kept full: {rec['bound_probe']['arms']['tail, kept full'][0]['requests']} requests. The bound (one "
                 f"call of the task's lengths against one of the mean length, seconds): {s['bound']:.2f}x; the target "
                 f"factor 1 + 0.75 x (bound - 1) = {s['target_factor']:.2f}. Kept full while the feed lasts, over the one "
                 f"call, the same lengths, per round: {', '.join(f'{x:.2f}x' for x in kept)} "
                 f"({'met' if s['kept_full_target_met'] else 'not met'}). The mean length kept full over the task's "
                 f"lengths kept full, per round: {', '.join(f'{x:.2f}x' for x in ctx)}."]
    return "\n".join(rows)


TABLES: Dict[str, Tuple[str, Callable[[List[dict]], str]]] = {
    "memory_scale": ("memory_scale.jsonl", _memory_scale),
    "largest_model": ("memory_scale_jobs.jsonl", _largest_model),
    "reload_alone": ("weight_sync_reload_alone.json", _reload_alone),
    "default_run": ("default_run.json", _default_run),
    "suite": ("suite.json", _suite),
    "logits_memory": ("logits_memory.json", _logits_memory),
    "memory_plan": ("memory_plan.json", _memory_plan),
    "end_to_end": ("end_to_end.json", _end_to_end),
    "checkpoint_cost": ("checkpoint_cost.json", _checkpoint_cost),
    "chaos": ("chaos.json", _chaos),
    "agent_throughput": ("agent_throughput.json", _agent_throughput),
    "agent_run": ("agent_run.json", _default_run),
    "long_tail": ("long_tail.json", _long_tail),
    "long_tail_task": ("long_tail_task.json", _long_tail_task),
    "long_tail_bound": ("long_tail_bound.json", _long_tail_bound),
    "zero_layouts": ("zero_layouts.jsonl", _zero_layouts),
    "packing": ("packing.json", _packing),
    "hostile_inputs": ("hostile_inputs.json", _hostile_inputs),
    "verifier_throughput": ("verifier_throughput.json", _verifier_throughput),
}


def render(name: str) -> str:
    file, fn = TABLES[name]
    return fn(results_io.load(results_io.RESULTS / file)).rstrip("\n") + "\n"


def render_page(text: str) -> str:
    """The page with every marked table rendered afresh (an unknown name is an error)."""
    def one(m: re.Match) -> str:
        if m.group("name") not in TABLES:
            raise KeyError(f"no table named {m.group('name')!r} (bench/render.py TABLES)")
        return f"<!-- table: {m.group('name')} -->\n{render(m.group('name'))}<!-- /table -->"
    return MARKED.sub(one, text)


def stale(pages=None) -> List[str]:
    """Each marked table that differs from what its file renders, as 'page: table'."""
    found = []
    for page in pages or PAGES:
        text = page.read_text()
        for m in MARKED.finditer(text):
            if m.group("name") not in TABLES or m.group("body") != render(m.group("name")):
                shown = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
                found.append(f"{shown}: {m.group('name')}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    args = parser.parse_args()
    if args.check:
        found = stale()
        for line in found:
            print(f"stale: {line} (regenerate with `{REGENERATE}`)")
        sys.exit(1 if found else 0)
    for page in PAGES:
        text = page.read_text()
        fresh = render_page(text)
        if fresh != text:
            page.write_text(fresh)
            print(f"rendered {page.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
