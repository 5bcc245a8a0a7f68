"""The LLM judge's template and verdict rules, and its bad settings (one line, before any actor)."""
from __future__ import annotations

import json

import pytest

from cluster.cli.compose import ConfigError, load_config
from common.config import JudgeConfig
from reward.verdicts import judge_prompt, parse_verdict, template_problem


@pytest.mark.parametrize("reply,score", [
    ("yes", 1.0), ("Yes.", 1.0), (" NO", 0.0), ("no, yes", 0.0), ("yesterday", None), ("", None), ("maybe", None),
])
def test_yes_no_verdicts(reply, score):
    assert parse_verdict(reply, JudgeConfig()) == score


@pytest.mark.parametrize("reply,score", [("7", 0.7), ("score: 10/10", 1.0), ("-3", 0.0), ("12", 1.0), ("none", None)])
def test_number_verdicts_scale_and_clip(reply, score):
    assert parse_verdict(reply, JudgeConfig(verdict="number", max_score=10)) == score


def test_a_pattern_of_your_own_reads_its_first_group():
    settings = JudgeConfig(verdict="yes_no", verdict_pattern=r"VERDICT:\s*(\w+)")
    assert parse_verdict("I think yes. VERDICT: no", settings) == 0.0
    assert parse_verdict("yes", settings) is None


def test_the_template_is_filled_verbatim():
    text = judge_prompt("Q {prompt} A {completion} R {answer}", "1+1=", "<answer>{2}</answer>", "2")
    assert text == "Q 1+1= A <answer>{2}</answer> R 2"
    assert template_problem(JudgeConfig().template) is None


def judge_overrides(tmp_path, *extra):
    tmp_path.joinpath("config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"],
                                                            "max_position_embeddings": 128}))
    return ["reward.verifiers=[judge]", "+reward.weights.judge=1.0", f"reward.judge.path={tmp_path}", *extra]


@pytest.mark.parametrize("extra,words", [
    (['reward.judge.template="Is {answer} right?"'], "has no {completion}"),
    (['reward.judge.template="{completion} {question}"'], "'{question}' is not a field the judge fills"),
    (["reward.judge.verdict_pattern='(yes'"], "reward.judge.verdict_pattern does not compile"),
    (["reward.judge.verdict_pattern=yes"], "needs a group"),
    (["reward.judge.verdict=maybe"], "reward.judge.verdict must be one of yes_no, number"),
    (["reward.judge.max_model_len=256"], "exceeds the judge's max_position_embeddings=128"),
])
def test_bad_judge_settings_are_one_line(tmp_path, extra, words):
    with pytest.raises(ConfigError) as error:
        load_config(judge_overrides(tmp_path, *extra))
    assert words in str(error.value) and "\n" not in str(error.value)


def test_a_judge_needs_a_model_folder(tmp_path):
    with pytest.raises(ConfigError, match="reward.judge.path is required"):
        load_config(["reward.verifiers=[judge]", "+reward.weights.judge=1.0"])
    with pytest.raises(ConfigError, match="has no config.json"):
        load_config(["reward.verifiers=[judge]", "+reward.weights.judge=1.0", f"reward.judge.path={tmp_path}/x"])
    assert load_config(judge_overrides(tmp_path)).reward.judge.verdict == "yes_no"
