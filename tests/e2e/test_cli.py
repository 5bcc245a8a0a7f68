"""Smoke runs of the entry points, as a user types them: `grpo train ...` and `python -m cluster.train`."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers import GRPO, run


def test_cfg_prints_composed_config_and_exits_0():
    result = run(GRPO, "train", "--cfg", "algo.beta=0.1", "logger=none")
    assert result.returncode == 0, result.stderr
    assert "beta: 0.1" in result.stdout
    assert "backends: []" in result.stdout
    same = run(sys.executable, "-m", "cluster.train", "--cfg", "algo.beta=0.1", "logger=none")
    assert same.returncode == 0 and same.stdout == result.stdout


def test_bad_command_line_exits_2_with_one_line():
    result = run(GRPO, "trian")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "trian" in result.stderr


@pytest.mark.parametrize("override, names", [
    ("trainer.max_step=3", ["trainer.max_step", "trainer.max_steps"]),
    ("trainer.max_steps=abc", ["trainer.max_steps"]),
    ("algo.group_size=1", ["algo.group_size"]),
    ("trainer.prompts_per_step=63", ["trainer.prompts_per_step", "learner.num_ranks"]),
    ("model.path=/no/such/model", ["model.path"]),
    ("algo.icepop_low=1.5", ["algo.icepop_low", "algo.icepop_high"]),
    ("logger=comet", ["logger/comet", "tensorboard"]),
    ("logger.mlflow_tracking_uri=mlflow.example:5000", ["logger.mlflow_tracking_uri", "scheme"]),
])
def test_bad_config_exits_2_with_one_line(override, names, tmp_path):
    result = run(GRPO, "train", override, f"trainer.output_dir={tmp_path}")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for name in names:
        assert name in lines[0]
    assert not any(tmp_path.iterdir()), "a bad config must fail before anything is produced"


def test_bad_input_answers_before_ray_or_torch_is_imported(tmp_path):
    """A typo costs the interpreter and the config (~0.4 CPU-s), not Ray's import (~0.4 more) or
    torch's (seconds): `grpo train` and `grpo verify` check their input first."""
    code = ("import sys; from cluster.cli import main; status = main(sys.argv[1:]); "
            "print(status, [m for m in ('ray', 'torch') if m in sys.modules])")
    out = f"trainer.output_dir={tmp_path}"
    for args in (["train", "trainer.max_step=3", out], ["train", "model.path=/no/such/model", out],
                 ["verify", "--verifiers", "math", "--input", str(tmp_path / "none.jsonl"),
                  "--output", str(tmp_path / "out.jsonl")]):
        result = run(sys.executable, "-c", code, *args)
        assert result.stdout.strip() == "2 []", (args, result.stdout, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("case", ["empty dataset", "longer than the model"])
def test_data_and_model_limits_exit_2_before_any_actor(case, tmp_path, model_cache):
    out = tmp_path / "runs"
    if case == "empty dataset":
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        args, names = ["data=jsonl", f"data.path={empty}"], ["empty.jsonl", "empty"]
    else:  # the built-in model has 128 positions
        args, names = ["rollout.max_model_len=4096"], ["rollout.max_model_len", "max_position_embeddings"]
    result = run(GRPO, "train", *args, f"model.cache_dir={model_cache}", f"trainer.output_dir={out}", "logger=none")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(name in lines[0] for name in names), result.stderr
    assert "actors ready" not in result.stdout and not out.exists()


def test_more_resources_than_the_cluster_exits_2(tmp_path, model_cache):
    result = run(GRPO, "train", "rollout.num_workers=9", "ray.num_cpus=2", f"model.cache_dir={model_cache}",
                 f"trainer.output_dir={tmp_path}", "logger=none")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "CPU" in lines[0] and "rollout" in lines[0], result.stderr
    assert "Ray" not in result.stdout, "a local Ray's CPUs are known before it starts"
    assert not any(tmp_path.iterdir())


def test_bad_data_row_exits_2_naming_the_line(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    result = run(GRPO, "train", "data=jsonl", f"data.path={rows}", f"trainer.output_dir={tmp_path / 'runs'}")
    assert result.returncode == 2
    assert "line 2" in result.stderr and "answer" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def _rows(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_verify_scores_a_file_and_keeps_every_field(tmp_path):
    rows = [
        {"prompt": "2+2=", "completion": "<think>2+2</think><answer>4</answer>", "answer": "4", "id": 1},
        {"prompt": "2+2=", "completion": "<answer>5</answer>", "answer": 4, "id": 2},
        {"prompt": "f", "completion": "```python\ndef f():\n    return 1\n```", "answer": "",
         "tests": "assert f() == 1", "id": 3},
        {"prompt": "f", "completion": "```python\nwhile True:\n    pass\n```", "answer": "",
         "tests": "assert f() == 1", "id": 4},
    ]
    out = tmp_path / "scores.jsonl"
    result = run(GRPO, "verify", "--verifiers", "math,format,code", "--input", _rows(tmp_path / "in.jsonl", rows),
                 "--output", str(out), "reward.timeout_s=2", "reward.num_workers=1", "ray.num_cpus=2")
    assert result.returncode == 0, result.stderr
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [s["id"] for s in scored] == [1, 2, 3, 4]
    assert scored[0]["scores"] == {"math": 1.0, "format": 1.0, "code": 0.0}
    assert scored[0]["reward"] == pytest.approx(1.1)  # training weights: math 1, format 0.1, code 1
    assert scored[1]["scores"]["math"] == 0.0 and scored[1]["answer"] == 4
    assert scored[2]["scores"]["code"] == 1.0 and scored[2]["reward"] == pytest.approx(1.0)
    assert scored[3]["timed_out"] == ["code"] and scored[3]["scores"]["code"] == 0.0
    assert all(s["timed_out"] == [] for s in scored[:3])
    summary = result.stdout
    assert "verifier" in summary and "pass rate" in summary
    code_line = next(line for line in summary.splitlines() if line.startswith("code"))
    assert code_line.split()[-1] == "1"  # one timeout
    assert "4 rows" in summary


@pytest.mark.parametrize("rows, args, message", [
    (None, [], "no such file"),
    (['{"prompt": "a", "completion": "b", "answer": "1"}', '{"prompt": "a", '], [], "line 2: malformed JSON"),
    ([{"prompt": "a", "answer": "1"}], [], "line 1: no 'completion' field"),
    ([{"prompt": "a", "completion": "b"}], [], "line 1: no 'answer' field"),
    ([{"prompt": "a", "completion": ["b"], "answer": "1"}], [], "line 1: field 'completion' is a list"),
    ([["a", "b"]], [], "line 1: expected a JSON object"),
    ([{"prompt": "a", "completion": "b", "answer": "1", "reward": 1}], [], "field 'reward' is an output field"),
    ([{"prompt": "a", "completion": "b"}], ["--verifiers", "code"], "no row has a 'tests' field"),
    ([{"prompt": "a", "completion": "b", "answer": "1"}], ["--verifiers", "math,nope"], "unknown verifier 'nope'"),
    ([{"prompt": "a", "completion": "b", "answer": "1"}], ["reward.timeout_s=-1"], "reward.timeout_s"),
    ([], [], "no rows"),
])
def test_verify_bad_input_exits_2_with_one_line(tmp_path, rows, args, message):
    path = str(tmp_path / "missing.jsonl") if rows is None else _rows(tmp_path / "in.jsonl", rows)
    verifiers = [] if "--verifiers" in args else ["--verifiers", "math,format"]
    result = run(GRPO, "verify", *verifiers, "--input", path, "--output", str(tmp_path / "out.jsonl"), *args)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_verify_rejects_a_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "a", "completion": "\xff\xfe", "answer": "1"}\n')
    result = run(GRPO, "verify", "--verifiers", "math", "--input", str(path), "--output", str(tmp_path / "o.jsonl"))
    assert result.returncode == 2 and "line 1: not UTF-8" in result.stderr


@pytest.mark.parametrize("case", ["engines without GPUs", "batch-invariant engines", "a learner without GPUs"])
def test_gpu_layouts_refused_on_a_gpu_cluster_before_any_actor(tmp_path, case):
    """A local Ray with 2 fake GPUs. The default rollout.num_gpus_per_worker=0 would put every
    engine on GPU 0 of each node; VLLM_BATCH_INVARIANT pins NCCL settings the sender does not
    share. Either stops the run with exit 2 and one line, before Ray starts (its GPUs are
    known: ray.num_gpus) and before the model is resolved."""
    args, env, words = [], {}, "the cluster has 2 GPUs but rollout.num_gpus_per_worker=0"
    if case == "batch-invariant engines":
        args, env, words = ["rollout.num_gpus_per_worker=1"], {"VLLM_BATCH_INVARIANT": "1"}, "VLLM_BATCH_INVARIANT=1"
    if case == "a learner without GPUs":  # it would train in fp32 over gloo on CPUs without a word
        args, words = ["rollout.num_gpus_per_worker=1"], "have 2 GPUs but learner.num_gpus_per_rank=0"
    result = run(GRPO, "train", "ray.num_gpus=2", "logger=none", f"trainer.output_dir={tmp_path}",
                 f"model.cache_dir={tmp_path / 'models'}", *args, env=env, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr
    assert "Ray" not in result.stdout
    assert not (tmp_path / "models").exists()  # answered before the built-in model was built


def test_a_joined_gpu_cluster_refuses_a_cpu_learner_before_any_actor(tmp_path, model_cache):
    """Joining a running Ray (ray.address) its GPUs are known only once joined: a real Ray
    head with 2 fake GPUs, and a learner left at num_gpus_per_rank=0 stops the run with exit 2
    and one line naming the key, before any actor starts."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2,
                                                            "object_store_memory": 100 * 2**20})
    try:
        result = run(GRPO, "train", f"ray.address={cluster.address}", "rollout.num_gpus_per_worker=1", "logger=none",
                     f"trainer.output_dir={tmp_path}", f"model.cache_dir={model_cache}", timeout=300)
    finally:
        cluster.shutdown()
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "have 2 GPUs but learner.num_gpus_per_rank=0" in lines[0], result.stderr
    assert "Ray dashboard" in result.stdout and "actors ready" not in result.stdout, result.stdout


def test_ctrl_c_lets_everything_go(tmp_path, model_cache):
    """Ctrl-C in the middle of the GRPO steps of an async run: the run stops with one line, its
    process exits (no thread left running: the async batch thread would keep it alive), and no
    process it started (Ray, the actors, vLLM's engine processes, DeepSpeed; placement groups
    live in Ray's) is left behind."""
    import signal
    import subprocess
    import time

    from helpers import small_overrides

    # One engine and one verifier (each engine costs ~11 CPU-s to start); two learner ranks: their
    # process group is what most needs letting go.
    proc = subprocess.Popen([GRPO, "train", *small_overrides(model_cache, str(tmp_path)), "trainer.max_steps=200",
                             "trainer.mode=async", "rollout.num_workers=1", "reward.num_workers=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:  # bounded by pytest-timeout
            if "held-out greedy accuracy after warm-up" in line:
                break
        time.sleep(5)  # inside the GRPO steps
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # the driver prints every thread's stack
            time.sleep(3)
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate(timeout=60)
            raise AssertionError(f"no exit 300 s after Ctrl-C; the driver's threads:\n{err[-6000:]}") from None
        assert proc.returncode == 130, err[-3000:]
        assert err.strip().splitlines()[-1].startswith("grpo: interrupted"), err[-3000:]
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                os.killpg(proc.pid, 0)  # anything left in the run's process group?
            except ProcessLookupError:
                break
            time.sleep(1)
        else:
            left = subprocess.run(["ps", "-o", "pid,args", "-g", str(proc.pid)], capture_output=True, text=True).stdout
            raise AssertionError(f"processes left after Ctrl-C:\n{left}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("overrides, words", [
    (['data.prompt_template="{question}?"'], ["data.prompt_template", "'question'", "row 1"]),
    (["data.chat_template=maybe"], ["data.chat_template", "maybe"]),
    (["data.eval_split=test"], ["data.eval_split"]),
    (["eval.n=2", "eval.k=[4]"], ["eval.k"]),
    (["rollout.tools=[search]"], ["rollout.tools", "search", "calculator"]),
    (["rollout.tools=[calculator]", "rollout.max_turns=0"], ["rollout.max_turns"]),
    (["+rollout.custom_tools.search=no_such_module:search"], ["rollout.custom_tools.search", "no_such_module"]),
])
def test_bad_prompt_settings_exit_2_before_any_actor(tmp_path, model_cache, overrides, words):
    result = run(GRPO, "train", f"model.cache_dir={model_cache}", f"trainer.output_dir={tmp_path}", "logger=none",
                 *overrides, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), result.stderr
    assert not any(tmp_path.iterdir())
