"""The README's first-real-run recipe, end to end on the CPU: a GSM8K-like JSONL of word problems
(written here, `#### N` answers), the built-in model's chat template, a prompt template and a
system prompt, a separate test file with pass@k/maj@k, then `grpo eval` of the saved model."""
from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from helpers import GRPO

TEMPLATE = "{question} Answer in <answer></answer>."
SYSTEM = "You add numbers."


def word_problems(n: int, seed: int) -> list:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        name, thing = rng.choice(["Ann", "Bo", "Cy", "Di"]), rng.choice(["apples", "pens", "cards", "coins"])
        rows.append({"question": f"{name} has {a} {thing} and gets {b} more. How many {thing} now?",
                     "answer": f"{name} has {a}+{b}={a + b} {thing}.\n#### {a + b}",
                     "solution": f"<think>{a}+{b}={a + b}</think><answer>{a + b}</answer>"})
    return rows


def _write(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([GRPO, *args], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, model_cache):
    tmp = tmp_path_factory.mktemp("first_run")
    train_rows, test_rows = word_problems(200, 0), word_problems(24, 1)
    prompt = ["data=jsonl", f"data.path={_write(tmp / 'train.jsonl', train_rows)}", "data.prompt_key=question",
              f"data.eval_path={_write(tmp / 'test.jsonl', test_rows)}", f'data.prompt_template="{TEMPLATE}"',
              f'data.system_prompt="{SYSTEM}"', "model.max_position_embeddings=256", "rollout.max_model_len=256",
              "rollout.max_new_tokens=48", "eval.n=4", "rollout.kv_cache_gib=0.25", "logger=none",
              # One engine, one verifier and one learner rank: the recipe, not the pools, is tested
              # here (the pools are the session roles' tests); each engine costs ~11 CPU-s to start.
              "rollout.num_workers=1", "reward.num_workers=1", "learner.num_ranks=1",
              "trainer.progress=false", f"model.cache_dir={model_cache}"]
    train = _run("train", *prompt, "data.chat_template=true", f"trainer.output_dir={tmp}/runs", "trainer.run_name=r",
                 "trainer.prompts_per_step=8", "algo.group_size=4", "warmup.steps=40", "warmup.batch_size=32",
                 "trainer.max_steps=2", "trainer.eval_every=2")
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    run = tmp / "runs" / "r"
    # grpo eval reads only the evaluation file; chat_template=auto applies the template (a system prompt is set)
    evaluated = _run("eval", str(run / "final_model"), *[a for a in prompt if not a.startswith(("data=", "data.path"))],
                     f"trainer.output_dir={tmp}/evals", "trainer.run_name=e")
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    return {"run": run, "train": train, "eval_dir": tmp / "evals" / "e", "eval": evaluated, "rows": train_rows,
            "test_rows": test_rows}


def _expected_prompt(question: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{TEMPLATE.format(question=question)}"
            "<|im_end|>\n<|im_start|>assistant\n")


def test_the_model_sees_the_rendered_chat_prompt(recipe):
    expected = _expected_prompt(recipe["rows"][0]["question"])
    assert (recipe["run"] / "prompt_example.txt").read_text() == expected
    assert expected in recipe["train"].stdout
    assert "a completion stops at </s>, <|im_end|>" in recipe["train"].stdout
    assert (recipe["eval_dir"] / "prompt_example.txt").read_text() == _expected_prompt(recipe["test_rows"][0]["question"])


def test_training_reports_pass_and_maj_at_k(recipe):
    summary = json.loads((recipe["run"] / "summary.json").read_text())
    for key in ("heldout_accuracy_before", "heldout_accuracy_after", "eval/greedy", "eval/pass@1", "eval/pass@4",
                "eval/maj@1", "eval/maj@4", "eval/mean_length", "eval/truncated_fraction"):
        assert key in summary, key
    assert summary["heldout_size"] == 24  # the test file, not rows held out of training
    assert summary["eval/pass@1"] <= summary["eval/pass@4"]
    assert summary["eval/maj@1"] == pytest.approx(summary["eval/pass@1"])
    logged = [json.loads(line) for line in (recipe["run"] / "metrics.jsonl").read_text().splitlines()]
    # The last step's evaluation (eval_every=2, two steps) is of the final weights: its greedy
    # accuracy is the summary's, and pass@k does not fall as k grows
    assert logged[-1]["step"] == 2
    assert logged[-1]["heldout_accuracy"] == pytest.approx(summary["heldout_accuracy_after"])
    assert logged[-1]["eval/pass@1"] <= logged[-1]["eval/pass@4"]


def test_eval_records_verifier_scores_and_stops(recipe):
    from cluster.loop.evaluation import pass_at_k
    from data.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    for folder in (recipe["run"], recipe["eval_dir"]):
        records = [json.loads(line) for line in (folder / "eval.jsonl").read_text().splitlines()]
        assert len(records) == 24
        golds = {r["question"]: r["answer"].split("####")[1].strip() for r in recipe["test_rows"]}
        ended_turns = 0
        for record in records:
            samples = record["samples"]
            assert len(samples) == 4 and record["answer"] in golds.values()
            correct = [s["correct"] for s in samples]
            assert record["pass@1"] == pytest.approx(sum(correct) / 4)
            assert record["pass@4"] == pytest.approx(pass_at_k(4, sum(correct), 4))
            for s in samples:
                # the math verifier's verdict is the gold answer's, read from the completion
                assert s["correct"] == (s["answer"] is not None and s["answer"].strip() == record["answer"])
                assert "<|im_end|>" not in s["completion"]  # special: never in the text
                if s["finish"] == "stop":
                    assert s["last_token_id"] in stops
                    ended_turns += s["last_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        # the warm-up's targets end with the chat format's end of turn, so its samples do too
        assert ended_turns > 0
    summary = json.loads((recipe["eval_dir"] / "eval_summary.json").read_text())
    assert {"eval/greedy", "eval/pass@1", "eval/pass@4", "eval/maj@4"} <= set(summary) and summary["prompts"] == 24
    assert "eval/pass@4" in recipe["eval"].stdout
