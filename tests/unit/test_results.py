"""Published figures are the files' figures: every marked table in the docs is what bench/render.py
renders from its result file (a table edited by hand fails), every result file in bench/results/
carries its command and the command still parses, and A-vs-B comparisons report per-pair ratios
(bench/compare.py). The pattern is the config reference's freshness test (tests/unit/test_docs.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import compare, render, results_io

ROOT = Path(__file__).resolve().parents[2]
RESULT_FILES = sorted([*results_io.RESULTS.glob("*.json"), *results_io.RESULTS.glob("*.jsonl")])


def test_every_marked_table_is_what_its_file_renders():
    stale = render.stale()
    assert not stale, f"tables differ from their result files: {stale}; regenerate with `{render.REGENERATE}`"


def test_every_table_is_marked_somewhere():
    marked = {m.group("name") for page in render.PAGES for m in render.MARKED.finditer(page.read_text())}
    # memory_scale and largest_model are the memory section's, which renders them as it is rewritten
    assert {"reload_alone"} <= marked <= set(render.TABLES), marked


def test_a_table_edited_by_hand_fails(tmp_path):
    page = tmp_path / "page.md"
    fresh = render.render("reload_alone")
    page.write_text(f"# A page\n\n<!-- table: reload_alone -->\n{fresh}<!-- /table -->\n")
    assert render.stale([page]) == []
    edited = re.sub(r"\| (\d)\.(\d+) s \|", lambda m: f"| {m.group(1)}.{int(m.group(2)) + 1:0{len(m.group(2))}d} s |",
                    fresh, count=1)
    assert edited != fresh
    page.write_text(f"# A page\n\n<!-- table: reload_alone -->\n{edited}<!-- /table -->\n")
    assert render.stale([page]) == [f"{page}: reload_alone"]
    assert render.render_page(page.read_text()) == f"# A page\n\n<!-- table: reload_alone -->\n{fresh}<!-- /table -->\n"


def test_an_unknown_table_name_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- table: nothing_measures_this -->\n| a |\n<!-- /table -->\n")
    assert render.stale([page]) == [f"{page}: nothing_measures_this"]
    with pytest.raises(KeyError, match="nothing_measures_this"):
        render.render_page(page.read_text())


@pytest.mark.parametrize("path", RESULT_FILES, ids=[p.name for p in RESULT_FILES])
def test_every_result_file_has_its_command_and_the_command_still_parses(path):
    assert results_io.problems(path) == [], (
        "write result files with bench/results_io.py's Result (the command, commit, host, load, raw runs and "
        "summary: bench/README.md), and keep the command one its script still accepts")


def test_a_result_file_without_its_command_fails(tmp_path):
    result = results_io.Result("memory_scale", argv=["bench/memory_scale.py", "--table", "x.jsonl"])
    result.add_run({"peak_mb": 1.0})
    written = result.write({"peak_mb": results_io.spread([1.0])}, path=tmp_path / "memory_scale.json")
    assert results_io.problems(written) == []
    record = json.loads(written.read_text())
    assert record["command"] == ["bench/memory_scale.py", "--table", "x.jsonl"]
    assert record["host"]["cores"] >= 1 and record["host"]["memory_gib"] > 0
    assert len(record["loadavg"]["before"]) == 3 and len(record["loadavg"]["after"]) == 3
    assert set(record["commit"]) == {"sha", "dirty"}
    del record["command"]
    written.write_text(json.dumps(record))
    assert results_io.problems(written) == [f"{written.name}: lacks command"]


def test_a_command_its_script_refuses_fails(tmp_path):
    path = tmp_path / "x.jsonl"
    line = {"benchmark": "memory_scale", "commit": {}, "date": {}, "host": {}, "loadavg": {}}
    path.write_text(json.dumps({**line, "command": ["bench/memory_scale.py", "--sweep", "100M", "--no-such-flag"]})
                    + "\n" + json.dumps({**line, "command": ["bench/memory_scale.py", "--layouts", "zero9"]}) + "\n"
                    + json.dumps({**line, "command": ["bench/gone.py"]}) + "\n")
    found = results_io.problems(path)
    assert len(found) == 3, found
    assert "line 1" in found[0] and "unrecognized arguments: --no-such-flag" in found[0]
    assert "line 2" in found[1] and "invalid choice: 'zero9'" in found[1]
    assert "line 3" in found[2] and "bench/gone.py is not a file" in found[2]


def test_the_readme_lists_every_benchmark_and_every_result_file():
    readme = (ROOT / "bench" / "README.md").read_text()
    helpers = {"results_io.py", "compare.py", "render.py", "model_sizes.py"}
    for script in sorted((ROOT / "bench").glob("*.py")):
        if script.name not in helpers:
            assert f"`{script.name}" in readme, f"bench/README.md does not list {script.name}"
    for result in sorted(results_io.RESULTS.iterdir()):
        assert f"results/{result.name}" in readme, f"bench/README.md does not link {result.name}"


def test_spread_reports_the_median_and_the_range():
    assert results_io.spread([3.0, 1.0, 2.0, 10.0]) == {"n": 4, "median": 2.5, "min": 1.0, "max": 10.0, "mean": 4.0}
    assert results_io.spread([])["n"] == 0


def test_a_comparison_alternates_and_reports_the_median_ratio_with_its_range():
    # A's throughput is B's times 0.85, 0.95 and 0.80 in its three pairs; B drifts from run to run
    a_values, b_values, calls = iter([85.0, 114.0, 72.0]), iter([100.0, 120.0, 90.0]), []
    seen = []

    def run_a(i):
        calls.append(("A", i))
        return {"tokens_per_s": next(a_values)}

    def run_b(i):
        calls.append(("B", i))
        return {"tokens_per_s": next(b_values)}

    cmp = compare.alternate(run_a, run_b, value=lambda r: r["tokens_per_s"], target=0.8,
                            on_run=lambda side, i, r: seen.append((side, i, r["tokens_per_s"])))
    assert calls == [("A", 0), ("B", 0), ("A", 1), ("B", 1), ("A", 2), ("B", 2)]
    assert seen[-1] == ("B", 2, 90.0)
    assert cmp.ratios == pytest.approx([0.85, 0.95, 0.80])
    assert (cmp.median, cmp.worst, cmp.best) == pytest.approx((0.85, 0.80, 0.95))
    assert cmp.met is True  # the worst pair reaches 0.80
    summary = cmp.summary()
    assert summary["order"] == ["A", "B"] * 3 and summary["pairs"] == 3 and summary["ratio"] == "A / B"
    assert "0.85x (min 0.80, max 0.95, 3 pairs)" in cmp.sentence()


def test_a_target_is_met_only_when_the_worst_pair_meets_it():
    # the median (0.90) clears 0.85, one pair (0.70) does not: not met
    cmp = compare.Comparison(a=[90.0, 70.0, 95.0], b=[100.0, 100.0, 100.0], target=0.85)
    assert cmp.median == pytest.approx(0.90) and cmp.met is False
    assert "not met (worst pair 0.70)" in cmp.sentence()
    assert compare.Comparison(a=[1.0], b=[1.0]).met is None


def test_for_seconds_the_ratio_is_b_over_a():
    # A takes 2 s where B takes 3, 4 and 2.5 s: A is 1.5x, 2x and 1.25x as fast
    cmp = compare.alternate(lambda i: 2.0, lambda i: [3.0, 4.0, 2.5][i], lower_is_better=True, target=1.2)
    assert cmp.ratios == pytest.approx([1.5, 2.0, 1.25])
    assert cmp.median == pytest.approx(1.5) and cmp.met is True
    assert cmp.summary()["ratio"] == "B / A"


def test_a_comparison_needs_pairs():
    with pytest.raises(ValueError, match="as many A as B"):
        compare.Comparison(a=[1.0, 2.0], b=[1.0])
    with pytest.raises(ValueError, match="at least 1"):
        compare.alternate(lambda i: 1.0, lambda i: 1.0, pairs=0)


def test_the_suite_durations_are_read_from_junit_xml_and_pytest_output(tmp_path):
    from bench import suite_durations

    xml = tmp_path / "junit.xml"
    xml.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="4">'
                   '<testcase classname="tests.unit.test_heap" name="test_a" time="0.5"/>'
                   '<testcase classname="tests.unit.test_results" name="test_b" time="2.25"><failure message="x"/>'
                   '</testcase>'
                   '<testcase classname="tests.e2e.test_agent_runs.TestRuns" name="test_c" time="30.0"/>'
                   '<testcase classname="tests.unit.test_heap" name="test_d" time="0.0"><skipped/></testcase>'
                   '</testsuite></testsuites>')
    log = ("============================= slowest 2 durations =============================\n"
           "30.00s call     tests/e2e/test_agent_runs.py::TestRuns::test_c\n"
           "2.25s call     tests/unit/test_results.py::test_b\n"
           "=========================== short test summary info ============================\n"
           "FAILED tests/unit/test_results.py::test_b\n"
           "============ 1 failed, 2 passed, 1 skipped in 33.10s (0:00:33) ============\n")
    tests = suite_durations.parse_xml(xml)
    assert [t["test"] for t in tests][:2] == ["tests/e2e/test_agent_runs.py::TestRuns::test_c",
                                              "tests/unit/test_results.py::test_b"]
    summary = suite_durations.summarize(tests, suite_durations.parse_log(log), wall=40.0)
    assert summary["pytest_seconds"] == 33.10 and summary["wall_seconds"] == 40.0
    assert summary["outcomes"] == {"passed": 2, "failed": 1, "skipped": 1}
    assert summary["pytest_counts"] == {"failed": 1, "passed": 2, "skipped": 1}
    assert summary["tier_seconds"] == {"e2e": 30.0, "unit": 2.75}
    assert summary["durations_table"] == ["30.00s call     tests/e2e/test_agent_runs.py::TestRuns::test_c",
                                          "2.25s call     tests/unit/test_results.py::test_b"]


def test_two_layouts_are_compared_round_by_round():
    from bench.memory_scale import compare_layouts

    def record(layout, pair, peaks):
        return {"size": "100M", "layout": layout, "pair": pair,
                "ranks": [{"learner_peak_memory_mb": p} for p in peaks]}
    # ZeRO-3 peaks at 80, 90 and 75% of ZeRO-2's in three rounds; a failed run and another size are left out
    records = [record("zero3", 0, [800, 800]), record("zero2", 0, [1000, 1000]),
               record("zero3", 1, [900, 900]), record("zero2", 1, [1000, 1000]),
               record("zero3", 2, [740, 760]), record("zero2", 2, [1000, 1000]),
               {"size": "100M", "layout": "zero3", "pair": 3, "error": ["killed"]},
               {**record("zero2", 0, [1, 1]), "size": "25M"}]
    cmp = compare_layouts(records, "zero3", "zero2", "100M", target=1 / 0.8)
    assert cmp.a == [800, 900, 750] and cmp.b == [1000, 1000, 1000]
    assert cmp.ratios == pytest.approx([1.25, 1 / 0.9, 1 / 0.75])  # zero2 / zero3: above 1 zero3 peaks lower
    assert cmp.met is False  # round 2 (90%) misses the 80% target though the median round meets it


def test_the_default_run_and_suite_tables_render_from_their_files():
    default = {"runs": [{"seed": 0, "warmup_steps": 135, "summary": {"heldout_accuracy_before": 0.545,
                                                                     "heldout_accuracy_after": 0.885,
                                                                     "wall_minutes": 3.14}}]}
    assert render.TABLES["default_run"][1]([default]).splitlines()[-1] == "| 0 | 135 | 54.5% | 88.5% | 3.1 |"
    suite = {"summary": {"tests": 2, "outcomes": {"passed": 1, "failed": 1}, "pytest_seconds": 12.5,
                         "tier_seconds": {"unit": 2.0, "e2e": 10.0}},
             "runs": [{"test": "tests/e2e/test_x.py::test_a", "seconds": 10.0, "outcome": "failed"},
                      {"test": "tests/unit/test_y.py::test_b", "seconds": 2.0, "outcome": "passed"}]}
    table = render.TABLES["suite"][1]([suite])
    assert table.splitlines()[0] == "2 tests (1 failed, 1 passed); pytest's total 12.5 s; by tier: e2e 10 s, unit 2 s."
    assert table.splitlines()[-2] == "| `tests/e2e/test_x.py::test_a` | 10.0 | failed |"
    suite["summary"]["pytest_seconds_runs"] = [
        {"pytest_seconds": 14.0, "date": "d0", "host_probe": None},
        {"pytest_seconds": 12.5, "date": "d1", "host_probe": {"before": "imports 3.50 CPU-s", "after": "x"}}]
    suite["summary"]["pytest_seconds_spread"] = results_io.spread([14.0, 12.5])
    assert render.TABLES["suite"][1]([suite]).splitlines()[0].endswith(
        "unit 2 s. Runs of this commit: 14.0 s (host probe before it: none); 12.5 s (host probe before it: imports "
        "3.50 CPU-s); median 13.2 s.")


def test_earlier_suite_runs_join_only_when_they_measured_the_same_commit(tmp_path):
    from bench.suite_durations import earlier_runs

    def suite_file(name, sha, dirty=False, **summary):
        path = tmp_path / name
        path.write_text(json.dumps({"commit": {"sha": sha, "dirty": dirty}, "date": {"end": f"end-{name}"},
                                    "summary": {"pytest_seconds": 100.0, **summary}}))
        return str(path)

    plain = suite_file("a.json", "abc")
    assert earlier_runs([plain], "abc") == [{"pytest_seconds": 100.0, "date": "end-a.json", "host_probe": None}]
    kept = [{"pytest_seconds": 90.0, "date": "d0", "host_probe": None},
            {"pytest_seconds": 95.0, "date": "d1", "host_probe": None}]
    chained = suite_file("b.json", "abc", pytest_seconds_runs=kept)  # a file that kept earlier runs passes them on
    assert earlier_runs([plain, chained], "abc") == [earlier_runs([plain], "abc")[0], *kept]
    with pytest.raises(ValueError, match="of commit def, not of abc"):
        earlier_runs([suite_file("c.json", "def")], "abc")
    with pytest.raises(ValueError, match="with uncommitted changes"):
        earlier_runs([suite_file("d.json", "abc", dirty=True)], "abc")
    with pytest.raises(ValueError, match="this checkout differs from abc"):
        earlier_runs([plain], "abc", dirty=True)
    assert earlier_runs([], "abc", dirty=True) == []  # a lone run of a dirty tree is still recorded


def test_a_jsonl_line_carries_its_command_and_the_load_around_the_run(tmp_path):
    path = tmp_path / "runs.jsonl"
    for i in range(2):
        results_io.append_jsonl(path, {"size": "25M", "pair": i, "loadavg": ["9.9", "1", "1"]}, "memory_scale",
                                before=[1.0, 2.0, 3.0], argv=["bench/memory_scale.py", "--sweep", "25M", "--pairs", "2"])
    lines = results_io.load(path)
    assert [line["pair"] for line in lines] == [0, 1]
    assert lines[0]["command"] == ["bench/memory_scale.py", "--sweep", "25M", "--pairs", "2"]
    assert lines[0]["loadavg"]["before"] == [1.0, 2.0, 3.0] and len(lines[0]["loadavg"]["after"]) == 3
    assert results_io.problems(path) == []


def test_a_failed_pair_never_meets_a_target():
    # the second pair's B measured nothing (0.0): its ratio is nan, which min() would skip over
    cmp = compare.Comparison(a=[120.0, 130.0, 125.0], b=[100.0, 0.0, 100.0], target=1.1)
    assert cmp.met is False
