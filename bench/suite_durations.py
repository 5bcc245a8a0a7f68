"""The test suite's durations, kept where the next change can read them: bench/results/suite.json.

    .venv/bin/python bench/suite_durations.py -- -n 2 tests          # runs pytest with these arguments
    .venv/bin/python bench/suite_durations.py --from-xml junit.xml --log pytest.log   # a run already made
    .venv/bin/python bench/suite_durations.py --earlier other-clone/bench/results/suite.json -- -n 2 tests

Runs pytest with `--junitxml` and `--durations` (unless given), and writes with bench/results_io.py:
`runs`, every test with its seconds and outcome, the slowest first (from the JUnit XML:
setup, call and teardown together, as pytest's XML counts them); `summary`: pytest's own total
seconds (its last line), the wall seconds of the whole command, pass/fail/skip/error counts, the
seconds per tier (tests/unit, tests/integration, tests/e2e) and per file, and the `--durations`
table as pytest printed it; around a run it makes, bench/cpu_floor.py's host probe before and
after (this host's speed drifts: two totals compare only beside their probes). `--earlier` takes
the suite.json of an earlier run of the same commit (another fresh clone, say) and keeps its total
beside this run's, with their median: the suite's budget is a median of runs. Exits with pytest's
status; 2 when an earlier file is of other code.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# pytest's last line, with its rules (the default) or without (-q): "1 failed, 17 passed in 2.00s"
TOTAL = re.compile(r"^=*\s*(?P<counts>\d+ \w+(?:, \d+ \w+)*|no tests ran) in (?P<seconds>[\d.]+)s(?: \([\d:]+\))?\s*=*$")


def node_id(classname: str, name: str) -> str:
    """pytest's node id from JUnit's dotted classname: the longest prefix that is a test file
    is the path, the rest a class."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (ROOT / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return "::".join([classname.replace(".", "/") + ".py", name])


def parse_xml(path: Path) -> list:
    """Every test case of a JUnit XML file: node id, seconds, outcome; the slowest first."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if case.find(child) is not None:
                outcome = name
                break
        tests.append({"test": node_id(case.get("classname", ""), case.get("name", "")),
                      "seconds": float(case.get("time", 0.0)), "outcome": outcome})
    return sorted(tests, key=lambda t: -t["seconds"])


def parse_log(text: str) -> dict:
    """From pytest's terminal output: the `--durations` table's lines and the final line's
    counts and total seconds."""
    lines = text.splitlines()
    table, inside = [], False
    for line in lines:
        if "slowest" in line and "durations" in line and line.startswith("="):
            inside = True
            continue
        if inside:
            if line.startswith("=") or line.startswith("-" * 10):
                break
            if line.strip():
                table.append(line.rstrip())
    counts, seconds = {}, None
    for line in reversed(lines):
        m = TOTAL.match(line.strip())
        if m:
            seconds = float(m.group("seconds"))
            for part in m.group("counts").split(", "):
                number, _, kind = part.partition(" ")
                if number.isdigit():
                    counts[kind] = int(number)
            break
    return {"durations_table": table, "pytest_counts": counts, "pytest_seconds": seconds}


def summarize(tests: list, log: dict, wall: float = None) -> dict:
    tiers, files = collections.Counter(), collections.Counter()
    for t in tests:
        path = t["test"].split("::")[0]
        files[path] += t["seconds"]
        parts = path.split("/")
        tiers[parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"] += t["seconds"]
    return {"pytest_seconds": log["pytest_seconds"], "wall_seconds": wall,
            "test_seconds_sum": sum(t["seconds"] for t in tests), "tests": len(tests),
            "outcomes": dict(collections.Counter(t["outcome"] for t in tests)),
            "pytest_counts": log["pytest_counts"], "tier_seconds": dict(tiers),
            "file_seconds": dict(files.most_common()), "durations_table": log["durations_table"]}


def earlier_runs(paths: list, sha: str, dirty: bool = False) -> list:
    """The pytest totals that earlier suite.json files hold (each file's own, and those it kept
    from still earlier runs), oldest first; ValueError for a file of another commit or of
    uncommitted changes, whose total measured other code, and for any when this checkout has
    uncommitted changes."""
    if paths and dirty:
        raise ValueError(f"this checkout differs from {sha}: its run shares a median with no other")
    runs = []
    for path in paths:
        record = json.loads(Path(path).read_text())
        if record["commit"]["sha"] != sha or record["commit"]["dirty"]:
            state = "with uncommitted changes" if record["commit"]["dirty"] else f"of commit {record['commit']['sha']}"
            raise ValueError(f"--earlier {path} is a run {state}, not of {sha}: "
                             "only runs of the same code share a median")
        runs += record["summary"].get("pytest_seconds_runs") or [this_run(record["summary"], record["date"]["end"])]
    return runs


def this_run(summary: dict, date: str) -> dict:
    return {"pytest_seconds": summary["pytest_seconds"], "date": date, "host_probe": summary.get("host_probe")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-xml", default=None, help="a JUnit XML file of a run already made (runs nothing)")
    parser.add_argument("--log", default=None, help="with --from-xml: that run's terminal output")
    parser.add_argument("--durations", type=int, default=50, help="pytest --durations, unless the arguments set it")
    parser.add_argument("--output", default=None, help="default bench/results/suite.json")
    parser.add_argument("--earlier", action="append", default=[], metavar="SUITE_JSON",
                        help="the suite.json of an earlier run of the same commit: its total is kept beside this "
                             "run's, with their median (repeatable)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments")
    args = parser.parse_args()
    from bench import results_io

    result = results_io.Result("suite")
    try:
        earlier = earlier_runs(args.earlier, result.record["commit"]["sha"], bool(result.record["commit"]["dirty"]))
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"suite_durations: {error}", file=sys.stderr)
        return 2
    pytest_args = [a for a in args.pytest_args if a != "--"] if args.pytest_args[:1] == ["--"] else args.pytest_args
    wall, status, probe = None, 0, None
    if args.from_xml:
        xml, text = Path(args.from_xml), Path(args.log).read_text() if args.log else ""
    else:
        xml = Path(tempfile.mkdtemp(prefix="suite-")) / "junit.xml"
        extra = [] if any(a.startswith("--durations") for a in pytest_args) else [f"--durations={args.durations}"]
        cmd = [sys.executable, "-m", "pytest", f"--junitxml={xml}", *extra, *pytest_args]
        from bench.cpu_floor import host_probe

        probe = {"before": host_probe()}
        start, out = time.monotonic(), []
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:  # shown as it comes and kept for the table
            sys.stdout.write(line)
            out.append(line)
        status = proc.wait()
        wall, text = time.monotonic() - start, "".join(out)
        probe["after"] = host_probe()
    tests = parse_xml(xml)
    for t in tests:
        result.add_run(t)
    summary = summarize(tests, parse_log(text), wall)
    summary["host_probe"] = probe
    summary["pytest_seconds_runs"] = earlier + [this_run(summary, results_io.now())]
    summary["pytest_seconds_spread"] = results_io.spread(r["pytest_seconds"] for r in summary["pytest_seconds_runs"])
    result.write(summary, path=Path(args.output) if args.output else None)
    print(f"{summary['tests']} tests, {summary['outcomes']}; pytest's total {summary['pytest_seconds']} s, "
          f"the command {wall and round(wall)} s", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
