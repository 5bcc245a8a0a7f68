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
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402

PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md", ROOT / "docs" / "performance.md",
         ROOT / "docs" / "development.md", ROOT / "bench" / "README.md",
         ROOT / "bench" / "results" / "memory_scale.md"]
MARKED = re.compile(r"^<!-- table: (?P<name>[\w.-]+) -->\n(?P<body>.*?)^<!-- /table -->$", re.S | re.M)
REGENERATE = ".venv/bin/python bench/render.py"


def _memory_scale(records: List[dict]) -> str:
    from bench.memory_scale import table_rows

    return table_rows(records)


def _largest_model(records: List[dict]) -> str:
    """`bench/memory_scale.py --job` runs: what ran and what ran out of memory, the whole job's peak."""
    rows = ["| fine-tuning | ZeRO | parameters | allocator | result | peak, all processes MB | the largest processes "
            "at the peak MB | load before -> after |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
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
                    f"| {result} | {r['peak_pss_mb']:,} | {top} | {_load(load)} |")
    return "\n".join(rows)


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
    """`bench/suite_durations.py`: pytest's total, the outcomes, seconds per tier, the slowest tests."""
    s = records[0]["summary"]
    outcomes = ", ".join(f"{n} {kind}" for kind, n in sorted(s["outcomes"].items()))
    tiers = ", ".join(f"{tier} {sec:,.0f} s" for tier, sec in sorted(s["tier_seconds"].items()))
    rows = [f"{s['tests']} tests ({outcomes}); pytest's total {s['pytest_seconds']} s; by tier: {tiers}.", "",
            "| test | seconds | outcome |", "| --- | --- | --- |"]
    rows += [f"| `{t['test']}` | {t['seconds']:.1f} | {t['outcome']} |" for t in records[0]["runs"][:slowest]]
    return "\n".join(rows)


TABLES: Dict[str, Tuple[str, Callable[[List[dict]], str]]] = {
    "memory_scale": ("memory_scale.jsonl", _memory_scale),
    "largest_model": ("memory_scale_jobs.jsonl", _largest_model),
    "reload_alone": ("weight_sync_reload_alone.json", _reload_alone),
    "default_run": ("default_run.json", _default_run),
    "suite": ("suite.json", _suite),
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
