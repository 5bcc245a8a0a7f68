"""Prompt datasets: the addition task, JSONL/Parquet/`datasets` loading and the prompt sampler."""
from __future__ import annotations

import json
import random
import re

import pytest

from common.problem import Problem
from data.datasets import (
    DataError,
    PromptSampler,
    arithmetic_problems,
    load_problems,
    solve_addition,
)


def data_cfg(**kw):
    """The real schema's data section (a file source unless told otherwise)."""
    from common.config import DataConfig

    return DataConfig(**{"source": "jsonl", **kw})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def answer_of(completion):
    return re.fullmatch(r"<think>[^<]*</think><answer>(\d+)</answer>", completion).group(1)


# ------------------------------------------------------------------ solve_addition


def test_solve_addition_examples():
    assert solve_addition(47, 85) == "<think>7+5+0=12,4+8+1=13</think><answer>132</answer>"
    assert solve_addition(12, 34) == "<think>2+4+0=6,1+3+0=4</think><answer>46</answer>"
    assert solve_addition(99, 99) == "<think>9+9+0=18,9+9+1=19</think><answer>198</answer>"
    assert solve_addition(10, 10) == "<think>0+0+0=0,1+1+0=2</think><answer>20</answer>"


def test_solve_addition_pads_shorter_operand():
    assert solve_addition(5, 123) == "<think>5+3+0=8,0+2+0=2,0+1+0=1</think><answer>128</answer>"
    thought = solve_addition(12345, 67890).split("</think>")[0]
    assert thought.count("=") == 5


def test_solve_addition_answer_is_sum_for_random_pairs():
    rng = random.Random(0)
    for _ in range(2000):
        a, b = rng.randint(0, 10 ** rng.randint(1, 9)), rng.randint(0, 10 ** rng.randint(1, 9))
        completion = solve_addition(a, b)
        assert int(answer_of(completion)) == a + b
        steps = completion[len("<think>"):completion.index("</think>")].split(",")
        assert len(steps) == max(len(str(a)), len(str(b)))
        for step in steps:  # every digit sum is right
            lhs, rhs = step.split("=")
            assert sum(map(int, lhs.split("+"))) == int(rhs)


# ------------------------------------------------------------------ arithmetic_problems


def test_two_digit_heldout_and_train_disjoint_and_deterministic():
    heldout, train = arithmetic_problems(seed=3, heldout_size=200, num_train=0, min_digits=2,
                                         max_digits=2)
    assert len(heldout) == 200 and len(train) == 8100 - 200
    assert not {p.prompt for p in heldout} & {p.prompt for p in train}
    assert len({p.prompt for p in train}) == len(train)
    again = arithmetic_problems(seed=3, heldout_size=200, num_train=0, min_digits=2, max_digits=2)
    assert again == (heldout, train)
    other = arithmetic_problems(seed=4, heldout_size=200, num_train=0, min_digits=2, max_digits=2)
    assert other[0] != heldout
    # num_train takes the first problems of the same rest
    _, first = arithmetic_problems(seed=3, heldout_size=200, num_train=50, min_digits=2,
                                   max_digits=2)
    assert first == train[:50]


def test_problem_fields():
    heldout, train = arithmetic_problems(seed=0, heldout_size=20, num_train=100, min_digits=2,
                                         max_digits=2)
    for p in heldout + train:
        a, b = map(int, p.prompt[:-1].split("+"))
        assert p.prompt == f"{a}+{b}="
        assert p.answer == str(a + b)
        assert p.solution == solve_addition(a, b)


@pytest.mark.parametrize("lo,hi", [(2, 2), (3, 3), (2, 4), (5, 6)])
def test_digit_bounds_respected(lo, hi):
    heldout, train = arithmetic_problems(seed=1, heldout_size=30, num_train=300, min_digits=lo,
                                         max_digits=hi)
    assert len(heldout) == 30 and len(train) == 300
    pairs = [tuple(p.prompt[:-1].split("+")) for p in heldout + train]
    assert len(set(pairs)) == len(pairs)  # no repeats, so held-out never in train
    for a, b in pairs:
        assert lo <= len(a) <= hi and lo <= len(b) <= hi
        assert not a.startswith("0") and not b.startswith("0")
    if lo != hi:
        assert len({len(a) for a, _ in pairs}) > 1
    assert arithmetic_problems(1, 30, 300, lo, hi) == (heldout, train)


def test_geometric_digit_counts_have_a_long_tail():
    """data.digit_distribution=geometric: the longer operand's digit count d falls by digit_decay
    per digit; the other has min..d digits; every problem distinct, the draw reproducible."""
    from data.datasets import digit_count_weights

    weights = digit_count_weights(2, 16, "geometric", 0.7)
    assert sum(weights) == pytest.approx(1.0)
    assert weights[1] / weights[0] == pytest.approx(0.7) and weights[-1] / weights[-2] == pytest.approx(0.7)
    assert digit_count_weights(2, 5) == pytest.approx([0.25] * 4)
    heldout, train = arithmetic_problems(3, 200, 5000, 2, 16, "add", "geometric", 0.7)
    pairs = [tuple(p.prompt[:-1].split("+")) for p in heldout + train]
    assert len(set(pairs)) == len(pairs) == 5200
    longer = [max(len(a), len(b)) for a, b in pairs]
    assert all(2 <= min(len(a), len(b)) <= d <= 16 for (a, b), d in zip(pairs, longer))
    counts = [longer.count(d) / len(longer) for d in range(2, 17)]
    # Each share within 4 standard errors of its weight (binomial, n = 5200).
    for share, weight in zip(counts, weights):
        assert abs(share - weight) <= 4 * (weight * (1 - weight) / len(longer)) ** 0.5 + 1e-9
    assert sorted(longer)[len(longer) // 2] <= 4 and max(longer) >= 14  # most short, a few long
    assert arithmetic_problems(3, 200, 5000, 2, 16, "add", "geometric", 0.7) == (heldout, train)


def test_geometric_draw_that_would_exhaust_a_digit_count_is_refused():
    with pytest.raises(DataError, match="more than half of the 8100"):
        arithmetic_problems(0, 200, 20000, 2, 16, "add", "geometric", 0.5)
    with pytest.raises(DataError, match="data.digit_decay"):
        arithmetic_problems(0, 200, 1000, 2, 16, "add", "geometric", 1.0)


def test_arithmetic_bad_arguments():
    with pytest.raises(DataError):
        arithmetic_problems(0, 10, 10, 3, 2)
    with pytest.raises(DataError, match="num_train"):
        arithmetic_problems(0, 10, 0, 3, 3)  # too many to take "all the rest"
    with pytest.raises(DataError, match="heldout_size"):
        arithmetic_problems(0, 8100, 0, 2, 2)


def test_load_problems_arithmetic():
    cfg = data_cfg(source="arithmetic", heldout_size=10, num_train=40)
    heldout, train = load_problems(cfg, seed=5)
    assert (heldout, train) == arithmetic_problems(5, 10, 40, 2, 2)


# ------------------------------------------------------------------ jsonl / parquet


def test_jsonl_loading_and_split(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": i, "extra": [1]} for i in range(50)]
    rows[7]["solution"] = "<think>x</think><answer>7</answer>"
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:20]) + "\n\n   \n"
                    + "\n".join(json.dumps(r) for r in rows[20:]) + "\n")
    heldout, train = load_problems(data_cfg(path=str(path), heldout_size=4), seed=0)
    assert len(heldout) == 4 and len(train) == 46
    by_prompt = {p.prompt: p for p in heldout + train}
    assert set(by_prompt) == {f"q{i}" for i in range(50)}
    assert by_prompt["q3"] == Problem("q3", "3", None, fields={"extra": [1]})  # other columns ride along
    assert by_prompt["q7"].solution == "<think>x</think><answer>7</answer>"
    assert load_problems(data_cfg(path=str(path), heldout_size=4), seed=0) == (heldout, train)
    assert load_problems(data_cfg(path=str(path), heldout_size=4), seed=1) != (heldout, train)


def test_heldout_size_capped_at_a_fifth(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": f"q{i}", "answer": "1"} for i in range(10)])
    heldout, train = load_problems(data_cfg(path=str(path), heldout_size=200), seed=0)
    assert len(heldout) == 2 and len(train) == 8
    path = write_jsonl(tmp_path / "r2.jsonl", [{"prompt": f"q{i}", "answer": "1"} for i in range(3)])
    heldout, train = load_problems(data_cfg(path=str(path), heldout_size=200), seed=0)
    assert len(heldout) == 1 and len(train) == 2


def test_custom_keys(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl",
                       [{"question": f"q{i}", "gold": f"{i}"} for i in range(10)])
    cfg = data_cfg(path=str(path), prompt_key="question", answer_key="gold")
    heldout, train = load_problems(cfg, seed=0)
    assert sorted(p.answer for p in heldout + train) == sorted(str(i) for i in range(10))


def test_gsm8k_answers(tmp_path):
    rows = [
        {"prompt": "a", "answer": "Some steps.\n2 + 40 = 42\n#### 42"},
        {"prompt": "b", "answer": "So it costs 1,600 dollars.\n####  1,600 "},
        {"prompt": "c", "answer": "#### -3"},
        {"prompt": "d", "answer": " 1,234,567 "},
        {"prompt": "e", "answer": "(1, 2)"},
    ]
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    heldout, train = load_problems(data_cfg(path=str(path)), seed=0)
    answers = {p.prompt: p.answer for p in heldout + train}
    assert answers == {"a": "42", "b": "1600", "c": "-3", "d": "1234567", "e": "(1, 2)"}


def test_parquet_loading(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"q{i}", "answer": f"x #### {i},000"} for i in range(20)]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    heldout, train = load_problems(data_cfg(path=str(path), heldout_size=3), seed=0)
    assert len(heldout) == 3 and len(train) == 17
    assert {p.answer for p in heldout + train} == {f"{i}000" for i in range(20)}


def test_parquet_missing_field_names_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"},
                                         {"prompt": "b", "answer": None}]), path)
    with pytest.raises(DataError, match=r"row 2: no 'answer' field"):
        load_problems(data_cfg(path=str(path)), seed=0)


def one_line_error(cfg):
    with pytest.raises(DataError) as info:
        load_problems(cfg, seed=0)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_field_names_field_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"}\n')
    message = one_line_error(data_cfg(path=str(path)))
    assert "rows.jsonl line 3: no 'answer' field" in message
    path.write_text('{"answer": "1"}\n')
    message = one_line_error(data_cfg(path=str(path)))
    assert "line 1: no 'prompt' field" in message


def test_malformed_json_line_number(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    message = one_line_error(data_cfg(path=str(path)))
    assert "rows.jsonl line 2" in message and "malformed JSON" in message


def test_bad_values_and_rows(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "a", "answer": {"x": 1}}])
    assert "line 1: field 'answer'" in one_line_error(data_cfg(path=str(path)))
    path = write_jsonl(tmp_path / "rows.jsonl", [["a", "1"]])
    assert "line 1" in one_line_error(data_cfg(path=str(path)))


def test_empty_file_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n \n")
    message = one_line_error(data_cfg(path=str(path)))
    assert "empty.jsonl" in message and "empty" in message


def test_missing_file_error(tmp_path):
    message = one_line_error(data_cfg(path=str(tmp_path / "nope.jsonl")))
    assert "data.path" in message and "nope.jsonl" in message


# ------------------------------------------------------------------ hf (local save_to_disk)


def test_hf_from_saved_dataset(tmp_path):
    import datasets

    rows = [{"question": f"q{i}", "answer": f"steps\n#### {i}", "solution": f"s{i}"}
            for i in range(25)]
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    cfg = data_cfg(source="hf", path=str(folder), prompt_key="question", heldout_size=2)
    heldout, train = load_problems(cfg, seed=0)
    assert len(heldout) == 2 and len(train) == 23
    problems = {p.prompt: p for p in heldout + train}
    assert problems["q4"] == Problem("q4", "4", "s4")


def test_hf_dataset_dict_split(tmp_path):
    import datasets

    make = lambda tag: datasets.Dataset.from_list(  # noqa: E731
        [{"prompt": f"{tag}{i}", "answer": str(i)} for i in range(10)])
    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": make("tr"), "test": make("te")}).save_to_disk(str(folder))
    heldout, train = load_problems(data_cfg(source="hf", path=str(folder), split="test"), seed=0)
    assert all(p.prompt.startswith("te") for p in heldout + train)
    message = one_line_error(data_cfg(source="hf", path=str(folder), split="validation"))
    assert "data.split" in message and "validation" in message


def test_hf_missing_column(tmp_path):
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_list([{"prompt": "a", "gold": "1"}]).save_to_disk(str(folder))
    message = one_line_error(data_cfg(source="hf", path=str(folder)))
    assert "no 'answer' field" in message


# ------------------------------------------------------------------ PromptSampler


def make_problems(n):
    return [Problem(f"p{i}", str(i)) for i in range(n)]


def test_sampler_covers_each_index_once_per_epoch():
    problems = make_problems(13)
    sampler = PromptSampler(problems, seed=7)
    drawn = []
    for size in [5, 1, 7, 4, 9, 0, 13, 3, 10, 13]:  # 65 = 5 epochs, crossing boundaries
        drawn.extend(sampler.next_batch(size))
    assert len(drawn) == 65
    epochs = [drawn[i:i + 13] for i in range(0, 65, 13)]
    for epoch in epochs:
        assert sorted(i for i, _ in epoch) == list(range(13))
        assert all(problems[i] is p for i, p in epoch)
    assert len({tuple(i for i, _ in e) for e in epochs}) > 1  # reshuffled each epoch
    assert sampler.state_dict() == {"epoch": 5, "position": 0}


def test_sampler_deterministic_in_seed():
    a = [i for i, _ in PromptSampler(make_problems(20), seed=1).next_batch(50)]
    b = [i for i, _ in PromptSampler(make_problems(20), seed=1).next_batch(50)]
    c = [i for i, _ in PromptSampler(make_problems(20), seed=2).next_batch(50)]
    assert a == b and a != c


@pytest.mark.parametrize("first", [0, 3, 10, 11, 22])  # 11 and 22 end exactly at an epoch
def test_sampler_resume_identical(first):
    problems = make_problems(11)
    reference = PromptSampler(problems, seed=3)
    reference.next_batch(first)
    state = reference.state_dict()
    assert set(state) == {"epoch", "position"}
    expected = [reference.next_batch(n) for n in (4, 11, 7)]

    resumed = PromptSampler(problems, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [resumed.next_batch(n) for n in (4, 11, 7)] == expected


def test_sampler_resume_from_unnormalised_boundary_state():
    problems = make_problems(6)
    reference = PromptSampler(problems, seed=0)
    reference.next_batch(6)
    resumed = PromptSampler(problems, seed=0)
    resumed.load_state_dict({"epoch": 0, "position": 6})
    assert resumed.next_batch(8) == reference.next_batch(8)


def test_sampler_rejects_empty():
    with pytest.raises(DataError):
        PromptSampler([], seed=0)


def test_hf_by_name_goes_through_load_dataset(tmp_path, monkeypatch):
    """`data.name` reaches datasets.load_dataset; here a local data folder, as no hub is reachable."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tmp_path / "gsm8k_like"
    folder.mkdir()
    rows = [{"question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(20)]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = data_cfg(source="hf", name=str(folder), split="train", prompt_key="question", heldout_size=4)
    heldout, train = load_problems(cfg, seed=0)
    assert len(heldout) == 4 and len(train) == 16
    assert {p.answer for p in heldout + train} == {str(i + 1) for i in range(20)}
