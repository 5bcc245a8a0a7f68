"""data=reasoning_gym and the reasoning_gym verifier: the task's own score, the splits, the mix,
bad input."""
from __future__ import annotations

import json
import sys
from collections import Counter

import pytest

pytest.importorskip("reasoning_gym")

from common.config import DataConfig, RewardConfig  # noqa: E402
from data.datasets import DataError, load_problems  # noqa: E402
from data.reasoning_gym import gym_version  # noqa: E402
from reward.gym import gym_score, task_dataset  # noqa: E402

CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def gym_cfg(**kw):
    return DataConfig(**{"source": "reasoning_gym", "num_train": 300, "heldout_size": 50, **kw})


def completions(answer):
    """Correct, wrong, malformed (no tags, unclosed tag, empty answer, huge, binary noise)."""
    return {
        "correct": f"<think>ok</think><answer>{answer}</answer>",
        "wrong": "<think></think><answer>not it</answer>",
        "no tags": str(answer),
        "unclosed": f"<think></think><answer>{answer}",
        "empty answer": "<think></think><answer></answer>",
        "huge": "<answer>" + "9" * 50_000 + "</answer>",
        "noise": "\x00\ufffd<answer>\x01</answer>",
    }


@pytest.mark.parametrize("task,config", [("chain_sum", CHAIN_SUM), ("spell_backward", {"max_word_len": 5}),
                                         ("countdown", {})])
def test_the_verifier_gives_the_tasks_own_score(task, config):
    """For every kind of completion, the verifier's score (floor 0) is the task's own
    score_answer on the answer the verifier extracts, None scoring 0 without asking the task."""
    from reward.gym import answer_of

    _, train = load_problems(gym_cfg(task=task, task_config=config, num_train=5, heldout_size=1), 3)
    for problem in train[:5]:
        dataset = task_dataset(task, problem.fields["task_config"])
        entry = {"question": problem.prompt, "answer": problem.answer, "metadata": problem.fields["metadata"]}
        for kind, completion in completions(problem.answer).items():
            extracted = answer_of(completion)
            expected = 0.0 if extracted is None or len(extracted) > 10_000 else dataset.score_answer(extracted, entry)
            assert gym_score(completion, problem.answer, problem.fields) == expected, (task, kind)
        assert gym_score(completions(problem.answer)["correct"], problem.answer, problem.fields) == 1.0


def test_the_floor_zeroes_token_credit_for_wrong_answers():
    """countdown gives 0.05 to a wrong expression and 0.01 to none: under the default floor both
    count 0, so an all-wrong group is uniform; a right answer keeps 1."""
    _, train = load_problems(gym_cfg(task="countdown", num_train=2, heldout_size=1), 0)
    problem = train[0]
    wrong = "<think></think><answer>1+1</answer>"
    dataset = task_dataset("countdown", {})
    entry = {"answer": problem.answer, "metadata": problem.fields["metadata"]}
    assert 0 < dataset.score_answer("1+1", entry) < 0.1
    assert gym_score(wrong, problem.answer, problem.fields, floor=0.0) == dataset.score_answer("1+1", entry)
    assert gym_score(wrong, problem.answer, problem.fields, floor=RewardConfig().gym_score_floor) == 0.0
    right = f"<answer>{problem.answer}</answer>"
    assert gym_score(right, problem.answer, problem.fields, floor=0.1) == 1.0


def test_whole_completion_extraction():
    _, train = load_problems(gym_cfg(task="chain_sum", task_config=CHAIN_SUM), 0)
    p = train[0]
    assert gym_score(f"  {p.answer}\n", p.answer, p.fields, extract="whole") == 1.0
    assert gym_score(f"  {p.answer}\n", p.answer, p.fields, extract="answer") == 0.0
    assert gym_score("   ", p.answer, p.fields, extract="whole") == 0.0


def test_splits_are_disjoint_and_repeat_with_the_seed():
    cfg = gym_cfg(task="chain_sum", task_config=CHAIN_SUM)
    heldout, train = load_problems(cfg, 5)
    assert (len(heldout), len(train)) == (50, 300)
    questions = [p.prompt for p in heldout + train]
    assert len(set(questions)) == len(questions)  # deduplicated, so held-out never trains
    again = load_problems(cfg, 5)
    assert (again.heldout, again.train) == (heldout, train)
    other = load_problems(cfg, 6)
    assert [p.prompt for p in other.heldout] != [p.prompt for p in heldout]


def test_rows_carry_what_scoring_needs():
    heldout, _ = load_problems(gym_cfg(task="chain_sum", task_config=CHAIN_SUM), 0)
    p = heldout[0]
    assert p.fields["task"] == "chain_sum" and p.fields["task_config"] == CHAIN_SUM
    assert p.fields["metadata"]["source_dataset"] == "chain_sum"
    assert p.solution == f"<think></think><answer>{p.answer}</answer>"
    assert gym_score(p.solution, p.answer, p.fields) == 1.0


def test_a_small_question_space_is_deduplicated_not_padded():
    """Two one-digit terms with + and -: at most 200 distinct questions; the train list is what
    is left after the held-out ones, no question twice."""
    cfg = gym_cfg(task="chain_sum", task_config={**CHAIN_SUM, "max_digits": 1}, num_train=1000)
    heldout, train = load_problems(cfg, 0)
    questions = [p.prompt for p in heldout + train]
    assert len(set(questions)) == len(questions) <= 200


def test_composite_weights_are_honoured():
    """1:3 weights over 2000 rows: spell_backward's count is binomial(2000, 0.75), std 19.4;
    5 standard deviations (97) cannot fail by chance (and the draw is seeded)."""
    cfg = gym_cfg(tasks={"chain_sum": 1.0, "spell_backward": 3.0}, task_config={"chain_sum": CHAIN_SUM},
                  num_train=2000)
    heldout, train = load_problems(cfg, 0)
    counts = Counter(p.fields["task"] for p in train)
    assert abs(counts["spell_backward"] - 1500) < 97
    assert counts["chain_sum"] + counts["spell_backward"] == 2000
    chain = next(p for p in train if p.fields["task"] == "chain_sum")
    assert chain.fields["task_config"] == CHAIN_SUM  # each row scores with its own task's config
    assert gym_score(chain.solution, chain.answer, chain.fields) == 1.0


@pytest.mark.parametrize("kw,words", [
    ({"task": "chain_sun"}, ["no task 'chain_sun'", "nearest: chain_sum"]),
    ({"task": "chain_sum", "task_config": {"max_term": 2}}, ["takes no key 'max_term'", "did you mean 'max_terms'"]),
    ({"task": "chain_sum", "task_config": {"min_terms": 5, "max_terms": 2}}, ["max_terms must be >= min_terms"]),
    ({"task": "chain_sum", "task_config": {"seed": 3}}, ["'seed' is set by the run"]),
    ({"tasks": {"chain_sum": 1.0, "spel_backward": 1.0}}, ["data.tasks.spel_backward", "nearest: spell_backward"]),
    ({"tasks": {"chain_sum": 0.0}}, ["weights must be positive"]),
    ({"tasks": {"chain_sum": 1.0}, "task_config": {"spell_backward": {}}}, ["maps each task"]),
])
def test_bad_tasks_are_one_line(kw, words):
    with pytest.raises(DataError) as error:
        load_problems(gym_cfg(**kw), 0)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize("overrides,words", [
    (["data=reasoning_gym"], "data.task is required"),
    (["data=gym_chain_sum", "+data.tasks.spell_backward=1"], "not both"),
    (["data=gym_chain_sum", "reward.gym_score_floor=2"], "reward.gym_score_floor"),
    (["data=gym_chain_sum", "reward.gym_extract=last"], "reward.gym_extract must be one of answer, whole"),
])
def test_bad_settings_are_config_errors(overrides, words):
    from cluster.cli.compose import ConfigError, load_config

    with pytest.raises(ConfigError, match=words):
        load_config(overrides)


def test_presets_fit_the_built_in_model():
    """Every gym preset: the longest question (one token per byte) plus max_new_tokens fits
    rollout.max_model_len, and the warm-up target fits max_new_tokens."""
    from cluster.cli.compose import CONF_DIR, load_config

    presets = sorted(p.stem for p in (CONF_DIR / "data").glob("gym_*.yaml"))
    assert len(presets) >= 3
    for preset in presets:
        cfg = load_config([f"data={preset}", "data.num_train=500"])
        heldout, train = load_problems(cfg.data, 0)
        longest = max(len(p.prompt.encode()) for p in heldout + train)
        assert longest + cfg.rollout.max_new_tokens <= cfg.rollout.max_model_len <= cfg.model.max_position_embeddings
        assert max(len(p.solution.encode()) for p in train) <= cfg.rollout.max_new_tokens, preset


def test_without_reasoning_gym_one_line_says_how_to_install(monkeypatch):
    from reward.registry import check_settings

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if not installed
    with pytest.raises(DataError, match=r"pip install -e '\.\[gym\]'"):
        load_problems(gym_cfg(task="chain_sum"), 0)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="reasoning-gym"):
        check_settings(RewardConfig(verifiers=["reasoning_gym"], weights={"reasoning_gym": 1.0}))


def test_version_comes_from_the_package_metadata():
    from importlib.metadata import version

    assert gym_version() == version("reasoning-gym")


def test_registry_builds_the_verifier():
    from reward.registry import build_verifiers

    settings = RewardConfig(verifiers=["reasoning_gym"], weights={"reasoning_gym": 1.0})
    call = build_verifiers(settings)["reasoning_gym"]
    _, train = load_problems(gym_cfg(task="chain_sum", task_config=CHAIN_SUM), 0)
    p = train[0]
    assert call(p.prompt, p.solution, p.answer, p.fields) == 1.0
    assert call(p.prompt, "<answer>x</answer>", p.answer, p.fields) == 0.0
    assert call(p.prompt, p.solution, p.answer, {}) == 0.0  # a row that is not a gym row


def test_mixed_tasks_get_a_score_column_each():
    from common.messages import Outcome
    from reward.pool import _add_outcome, _add_task_score, empty_stats, summarize

    stats = empty_stats(["reasoning_gym"])
    for task, score in [("chain_sum", 1.0), ("chain_sum", 0.0), ("spell_backward", 1.0)]:
        outcome = Outcome(scores={"reasoning_gym": score}, reward=score)
        _add_outcome(stats, outcome)
        _add_task_score(stats, {"task": task}, outcome)
    out = summarize(stats, ["reasoning_gym"])
    assert out["task_score/chain_sum"] == 0.5 and out["task_score/spell_backward"] == 1.0
    assert out["score/reasoning_gym"] == pytest.approx(2 / 3)


def test_verify_reads_gym_rows_and_refuses_unknown_tasks(tmp_path):
    from cluster.cli.verify import VerifyInputError, read_rows

    path = tmp_path / "rows.jsonl"
    row = {"prompt": "q", "completion": "<answer>3</answer>", "answer": "3", "task": "chain_sum",
           "metadata": {"source_dataset": "chain_sum"}}
    path.write_text(json.dumps(row) + "\n")
    assert read_rows(str(path), ["reasoning_gym"])[0]["task"] == "chain_sum"
    path.write_text(json.dumps({**row, "task": "chain_sun"}) + "\n")
    with pytest.raises(VerifyInputError, match="nearest: chain_sum"):
        read_rows(str(path), ["reasoning_gym"])
    path.write_text(json.dumps({k: v for k, v in row.items() if k != "task"}) + "\n")
    with pytest.raises(VerifyInputError, match="no 'task' field"):
        read_rows(str(path), ["reasoning_gym"])


def test_two_term_sums_warm_up_on_the_scratchpad():
    from data.reasoning_gym import warmup_target
    from data.scratchpads import solve_addition

    assert warmup_target({"expression": "47 + 85"}, "132") == solve_addition(47, 85)
    assert warmup_target({"expression": "47 - 85"}, "-38") == "<think></think><answer>-38</answer>"
    assert warmup_target({}, "x") == "<think></think><answer>x</answer>"
    heldout, _ = load_problems(gym_cfg(task="basic_arithmetic", task_config={
        "min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["+"],
        "allow_parentheses": False, "allow_negation": False}), 0)
    assert all(p.solution.startswith("<think>") and "+0=" in p.solution or "+1=" in p.solution for p in heldout)
    assert all(gym_score(p.solution, p.answer, p.fields) == 1.0 for p in heldout)
