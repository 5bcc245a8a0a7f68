"""The A-vs-B benchmarks run their sides in turn and write one result file with per-pair ratios
(bench/compare.py, bench/results_io.py). What each side measures needs Ray, vLLM or a training
run; here each side's run is replaced by a synthetic one of known figures, so that the order of
the runs, the pairing and the written summary are checked in a second."""
from __future__ import annotations

import json
import sys

import pytest

from bench import agent_throughput, async_vs_sync, end_to_end, ppo_vs_grpo, results_io, vs_trl, weight_sync


def _argv(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", list(argv))


def test_agent_throughput_runs_rounds_and_reports_each_agents_ratio_per_round(monkeypatch, tmp_path):
    order, loop_rates = [], iter([1000.0, 800.0, 1200.0])
    agent_rates = {"agent": iter([400.0, 360.0, 300.0]), "async agent": iter([300.0, 320.0, 480.0])}

    def train(out, name, *overrides):
        order.append(name)
        return tmp_path / name

    def rates(run_dir):
        kind = run_dir.name.rsplit("-", 1)[0].replace("-", " ")
        tokens = next(loop_rates) if kind == "loop" else next(agent_rates[kind])
        return {"tokens_per_s": tokens, "requests": 0.0 if kind == "loop" else 100.0, "generate_s": 1.0,
                "sampled_tokens_per_step": 6900.0, "turns_mean": 1.9, "engine_steps": 107.0,
                "first_generate_s": 1.0, "steps": 5,
                "cpu_s_per_step": {"generation workers": 2.0 if kind == "loop" else 2.3,
                                   "agent processes": 0.0 if kind == "loop" else 1.0, "learner ranks": 1.0}}

    monkeypatch.setattr(agent_throughput, "train", train)
    monkeypatch.setattr(agent_throughput, "rates", rates)
    output = tmp_path / "agent_throughput.json"
    _argv(monkeypatch, "bench/agent_throughput.py", "--model", str(tmp_path), "--output", str(output))
    agent_throughput.main()
    # the order turns every other round: neither side always runs last
    assert order == ["agent-0", "async-agent-0", "loop-0", "loop-1", "async-agent-1", "agent-1",
                     "agent-2", "async-agent-2", "loop-2"]
    record = json.loads(output.read_text())
    assert results_io.problems(output, check_command=False) == []
    assert record["command"][:1] == ["bench/agent_throughput.py"] and len(record["runs"]) == 9
    agent = record["summary"]["agent"]["comparison"]
    assert agent["ratios"] == pytest.approx([0.40, 0.45, 0.25])
    assert (agent["median"], agent["min"], agent["max"]) == pytest.approx((0.40, 0.25, 0.45))
    assert record["summary"]["async agent"]["comparison"]["ratios"] == pytest.approx([0.30, 0.40, 0.40])
    assert record["summary"]["agent"]["ceiling_free_endpoint"]["median"] == pytest.approx(2.0 / 3.0)
    assert record["summary"]["agent"]["server_ms_per_request"]["median"] == pytest.approx(3.0)


def test_async_vs_sync_alternates_the_modes_and_reports_the_speed_up_per_round(monkeypatch, tmp_path):
    modes, steps = [], {"sync": iter([5.0, 6.0, 5.5]), "async": iter([4.0, 5.0, 5.5])}

    real_run = async_vs_sync.subprocess.run

    def run(cmd, **kwargs):
        if cmd[0] != async_vs_sync.GRPO:
            return real_run(cmd, **kwargs)  # git, for the result's commit
        modes.append(next(a for a in cmd if a.startswith("trainer.mode=")).split("=")[1])

    def summarize(run_dir):
        mode = run_dir.name.split("-")[0]
        return {"step_s": next(steps[mode]), "rollout_s": 3.0, "learner_s": 2.0, "max_s": 3.0, "sum_s": 5.0,
                "staleness_mean": 0.0, "dropped_stale": 0, "is_weight_mean": 1.0, "is_capped_fraction": 0.0,
                "before": 0.6, "after": 0.9, "minutes": 3.0}

    monkeypatch.setattr(async_vs_sync.subprocess, "run", run)
    monkeypatch.setattr(async_vs_sync, "summarize", summarize)
    output = tmp_path / "async_vs_sync.json"
    _argv(monkeypatch, "bench/async_vs_sync.py", "--output-dir", str(tmp_path), "--output", str(output))
    async_vs_sync.main()
    assert modes == ["sync", "async"] * 3
    summary = json.loads(output.read_text())["summary"]
    assert summary["step_s_speedup"]["ratios"] == pytest.approx([1.25, 1.2, 1.0])  # sync / async seconds
    assert summary["step_s_speedup"]["min"] == pytest.approx(1.0)
    assert summary["sync_step_s"]["median"] == pytest.approx(5.5)


def test_vs_trl_pairs_each_seed_and_three_seeds_by_default(monkeypatch, tmp_path):
    calls = []
    ours = iter([{"step_s": 1.30, "after": 0.77}, {"step_s": 1.40, "after": 0.75}, {"step_s": 1.20, "after": 0.80}])
    trl = iter([{"step_s": 1.30, "after": 0.78}, {"step_s": 1.33, "after": 0.80}, {"step_s": 1.26, "after": 0.79}])
    common = {"tokens_per_s": 9000.0, "startup_s": 30.0, "process_s": 60.0, "before": 0.6}

    def run_ours(start, steps, out, overrides):
        calls.append(("ours", overrides[0]))
        return {**common, **next(ours)}

    def run_trl(start, steps, out, seed, settings):
        calls.append(("trl", f"trainer.seed={seed}"))
        return {**common, **next(trl)}

    monkeypatch.setattr(vs_trl, "start_model", lambda out, overrides, warmup: "start")
    monkeypatch.setattr(vs_trl, "run_ours", run_ours)
    monkeypatch.setattr(vs_trl, "run_trl", run_trl)
    monkeypatch.setattr(results_io, "RESULTS", tmp_path)
    _argv(monkeypatch, "bench/vs_trl.py", "--output-dir", str(tmp_path), "--seed", "4")
    vs_trl.main()
    assert calls == [("ours", "trainer.seed=4"), ("trl", "trainer.seed=4"), ("ours", "trainer.seed=5"),
                     ("trl", "trainer.seed=5"), ("ours", "trainer.seed=6"), ("trl", "trainer.seed=6")]
    summary = json.loads((tmp_path / "vs_trl.json").read_text())["summary"]
    assert summary["step_speed_ratio"]["ratios"] == pytest.approx([1.0, 0.95, 1.05])  # TRL's seconds / ours
    assert summary["step_speed_ratio"]["median"] == pytest.approx(1.0)
    assert summary["after_trl"]["median"] == pytest.approx(0.79)


def test_the_reload_alone_result_compares_both_layouts_through_the_same_path(monkeypatch, tmp_path):
    def reload_alone(size, cache, repeats, threads, linear, gen_prompts, gen_tokens):
        slow = linear == "onednn"
        return {"size": size, "threads": threads, "linear": linear, "bytes": 2**20, "reload_s": 0.3 if slow else 0.2,
                "packing_s": 0.1 if slow else 0.0, "direct_s": None if slow else 0.05, "memcpy_s": 0.04,
                "reload_gbps": 1.0, "memcpy_gbps": 10.0, "gen_tokens_per_s": 200.0 if slow else 150.0}

    monkeypatch.setattr(weight_sync, "reload_alone", reload_alone)
    output = tmp_path / "reload.json"
    _argv(monkeypatch, "bench/weight_sync.py", "--reload-alone", "--sizes", "100M", "--threads", "1",
          "--linear", "onednn", "torch", "--output", str(output))
    assert weight_sync.main() == 0
    record = json.loads(output.read_text())
    assert [r["linear"] for r in record["runs"]] == ["onednn", "torch"]
    assert record["summary"]["100M, 1 thread"] == pytest.approx({"reload_onednn_over_torch": 1.5,
                                                                 "generation_torch_over_onednn": 0.75})


def test_end_to_end_reports_per_phase_medians(tmp_path):
    rows = [{"step": s, "wall_seconds": 10.0 * s, "time_step": t, "time_generate": g, "time_reward": 0.1,
             "time_train": 1.0, "time_weight_sync": 0.05, "completions": 512, "completion_tokens": 5000}
            for s, t, g in ((1, 4.0, 3.0), (2, 2.0, 0.5), (3, 2.2, 0.7), (4, 2.1, 0.6))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"heldout_accuracy_before": 0.5,
                                                       "heldout_accuracy_after": 0.9, "wall_minutes": 2.0}))
    report = end_to_end.report(tmp_path, 0.9)
    assert report["first_step_s"] == 4.0
    assert report["median_s"]["time_step"] == pytest.approx(2.1)  # steps 2-4: the first left out
    assert report["median_s"]["time_generate"] == pytest.approx(0.6)


def test_ppo_vs_grpo_runs_rounds_and_labels_the_state_as_a_formula(monkeypatch, tmp_path):
    peaks = iter([900.0, 945.0, 880.0, 950.0, 910.0, 930.0])
    order = []

    def run(name, out, steps, extra):
        order.append(name.split("-")[0])
        return {"rows": [{"learner_peak_memory_mb": next(peaks), "time_step": 3.0, "time_train": 1.5}],
                "summary": {"heldout_accuracy_before": 0.6, "heldout_accuracy_after": 0.87}, "config": {}}

    monkeypatch.setattr(ppo_vs_grpo, "run", run)
    monkeypatch.setattr(ppo_vs_grpo, "param_count", lambda config: 2**20)
    output = tmp_path / "ppo.json"
    _argv(monkeypatch, "bench/ppo_vs_grpo.py", "--output", str(output))
    ppo_vs_grpo.main()
    assert order == ["grpo", "ppo"] * 3
    record = json.loads(output.read_text())
    assert [r["state_mb_formula"] for r in record["runs"][:2]] == [20.0, 36.0]
    assert record["summary"]["peak_mb"]["ratios"] == pytest.approx([1.05, 950 / 880, 930 / 910])


def test_verifier_throughput_keeps_every_timed_call(monkeypatch, tmp_path):
    import ray

    import reward.pool
    from bench import verifier_throughput

    class Pool:  # the pool's scoring is tested with Ray in tests/integration; here only what is recorded
        def __init__(self, cfg):
            pass

        def ready(self):
            pass

        def score_items(self, items):
            return [1.0] * len(items)

        def shutdown(self):
            pass

    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(reward.pool, "VerifierPool", Pool)
    output = tmp_path / "verifiers.json"
    _argv(monkeypatch, "bench/verifier_throughput.py", "--math", "8", "--code", "1", "--repeats", "1",
          "--output", str(output))
    verifier_throughput.main()
    record = json.loads(output.read_text())
    math = record["runs"][0]
    assert math["verifier"] == "math" and math["completions"] == 8
    assert {kind: len(times) for kind, times in math["seconds"].items()} == {
        "in-process": 1, "pool, 1 workers": 1, "pool, 2 workers": 1}
    rates = record["summary"]["math"]["completions_per_s"]["in-process"]
    assert rates["n"] == 1 and rates["max"] == pytest.approx(record["summary"]["math"]["completions_per_s_best"]["in-process"])


def test_warmup_curves_records_every_point_and_where_each_seed_passes_half(monkeypatch, tmp_path):
    from bench import warmup_curves

    curves = {0: [(100, 0.2, 1.0), (200, 0.55, 0.5)], 1: [(100, 0.5, 0.9), (200, 0.9, 0.2)], 2: [(100, 0.1, 2.0)]}
    monkeypatch.setattr(warmup_curves, "curve", lambda seed, *args: curves[seed])
    import torch

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this process's threads stay as they are
    output = tmp_path / "warmup.json"
    _argv(monkeypatch, "bench/warmup_curves.py", "--seeds", "0", "1", "2", "--output", str(output))
    warmup_curves.main()
    record = json.loads(output.read_text())
    assert record["summary"]["first_step_at_50_percent"] == [200, 100, None]
    assert record["runs"][0]["points"][1] == {"step": 200, "accuracy": 0.55, "loss": 0.5}
