"""One current result file per benchmark in bench/results/, written by the script that measured it.

    from bench.results_io import Result
    result = Result("weight_sync")          # records the command, commit, date, host, load before
    result.add_run({...})                   # every raw run, as measured
    result.write(summary={...})             # load after; bench/results/weight_sync.json

A result file (JSON) holds: `benchmark`, `command` (the script's path from the repository root
and its arguments, exactly as run), `commit` (`sha`, `dirty`), `date` (start and end, UTC),
`host` (cores, memory, CPU model), `loadavg` (`before` and `after`), `runs` (every raw run) and
`summary` (the figures the docs show, each with its spread: `spread()`). A JSONL result file
(`append_jsonl`) holds one such record per line, each line its own run with its own command.
`problems()` says what a file lacks and whether its command still parses; tests/unit/test_results.py
runs it over bench/results/, and bench/render.py renders the docs' tables from these files.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import runpy
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
REQUIRED = ("benchmark", "command", "commit", "date", "host", "loadavg", "runs", "summary")


def loadavg() -> List[float]:
    """The 1, 5 and 15 minute load averages (a timing taken under load says little)."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def host() -> Dict[str, Any]:
    """What the figures were measured on: cores (all, and the ones this process may use), memory,
    CPU model, machine, Python, and the GPU's name where torch sees one (only if already imported)."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory_gib = None
    with contextlib.suppress(OSError, StopIteration, ValueError):
        line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal:"))
        memory_gib = round(int(line.split()[1]) / 2**20, 1)
    info = {"cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)), "memory_gib": memory_gib,
            "cpu_model": model or platform.processor(), "machine": platform.machine(),
            "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def commit() -> Dict[str, Any]:
    """The checkout's commit and whether tracked files differ from it (a dirty run's code is not
    that commit's)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        return {"sha": git("rev-parse", "HEAD") or None,
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}


def command(argv: Optional[List[str]] = None) -> List[str]:
    """The command as run: the script's path from the repository root (so it runs from any
    clone), then its arguments unchanged."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    with contextlib.suppress(ValueError):
        argv[0] = str(script.relative_to(ROOT))
    return argv


def spread(values: Iterable[float]) -> Dict[str, Any]:
    """A figure with its spread: median, min, max, mean and the count of runs behind it."""
    values = [float(v) for v in values]
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None, "mean": None}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values),
            "mean": statistics.fmean(values)}


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Result:
    """A benchmark's current result, begun when the benchmark starts (the load before it) and
    written when it ends (the load after it)."""

    def __init__(self, benchmark: str, argv: Optional[List[str]] = None):
        self.record: Dict[str, Any] = {
            "benchmark": benchmark, "command": command(argv), "commit": commit(),
            "date": {"start": now(), "end": None}, "host": host(),
            "loadavg": {"before": loadavg(), "after": None}, "runs": [], "summary": {}}

    def add_run(self, run: Dict[str, Any]) -> None:
        self.record["runs"].append(run)

    def write(self, summary: Dict[str, Any], path: Optional[Path] = None, **extra: Any) -> Path:
        """Write the file (bench/results/<benchmark>.json unless `path`), replacing the earlier one."""
        self.record.update(extra)
        self.record["summary"] = summary
        self.record["date"]["end"] = now()
        self.record["loadavg"]["after"] = loadavg()
        path = Path(path) if path else RESULTS / f"{self.record['benchmark']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.record, indent=1) + "\n")
        print(f"load average before {self.record['loadavg']['before']}, after {self.record['loadavg']['after']}; "
              f"wrote {path}", file=sys.stderr, flush=True)
        return path


def append_jsonl(path: Path, run: Dict[str, Any], benchmark: str, before: List[float],
                 argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Append one run to a JSONL result file, with everything a JSON result file records
    (`runs` holds this run alone, `summary` is empty: the renderer computes it from the lines)."""
    meta = {"benchmark": benchmark, "command": command(argv), "commit": commit(), "date": {"end": now()},
            "host": host(), "loadavg": {"before": before, "after": loadavg()}}
    record = {**meta, **{key: value for key, value in run.items() if key not in meta}}  # a run's own load: at its end
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def load(path: Path) -> List[Dict[str, Any]]:
    """The records of a result file: one for JSON, one per line for JSONL."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return [json.loads(text)]


class _Parsed(Exception):
    """The script's argument parser accepted the command (raised instead of running it)."""


def command_error(argv: List[str]) -> Optional[str]:
    """None when the script named by argv[0] exists and its argparse accepts argv[1:]; else why not.

    The script runs as __main__ up to its outermost parse_args/parse_known_args, which parses
    for real and then stops it: nothing it would measure runs (scripts parse before they work)."""
    if not argv or not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return f"the command is not a list of arguments: {argv!r}"
    script = ROOT / argv[0]
    if not script.is_file():
        return f"{argv[0]} is not a file in the repository"
    known, depth = argparse.ArgumentParser.parse_known_args, [0]

    def parse_known_args(self, args=None, namespace=None):
        depth[0] += 1
        try:
            result = known(self, args, namespace)
        finally:
            depth[0] -= 1
        if depth[0]:
            return result  # a subcommand's parser, called by its parent's
        raise _Parsed

    def parse_args(self, args=None, namespace=None):
        depth[0] += 1
        try:
            _, extras = known(self, args, namespace)
        finally:
            depth[0] -= 1
        if extras:
            self.error("unrecognized arguments: " + " ".join(extras))
        raise _Parsed

    saved_argv, saved_path, err = sys.argv[:], sys.path[:], io.StringIO()
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.parent))
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse_known_args), \
                mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), \
                contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(script), run_name="__main__")
    except _Parsed:
        return None
    except SystemExit as e:
        said = (err.getvalue().strip().splitlines() or [f"exit status {e.code}"])[-1]
        return f"{argv[0]} refuses {' '.join(argv[1:])!r}: {said}"
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return f"{argv[0]} ran to its end without parsing its arguments"


def problems(path: Path, check_command: bool = True) -> List[str]:
    """What a result file lacks: a required field, a command that its script no longer accepts."""
    found = []
    try:
        records = load(path)
    except (OSError, ValueError) as e:
        return [f"{path.name}: not readable as JSON: {e}"]
    checked = set()
    for i, record in enumerate(records):
        where = f"{path.name}" + (f" line {i + 1}" if path.suffix == ".jsonl" else "")
        missing = [key for key in REQUIRED if key not in record and not (key in ("runs", "summary")
                                                                         and path.suffix == ".jsonl")]
        if missing:
            found.append(f"{where}: lacks {', '.join(missing)}")
        cmd = record.get("command")
        if check_command and cmd and json.dumps(cmd) not in checked:
            checked.add(json.dumps(cmd))
            error = command_error(cmd)
            if error:
                found.append(f"{where}: {error}")
    return found
