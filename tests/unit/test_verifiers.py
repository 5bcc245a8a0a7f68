"""Verifiers in reward/verifiers.py: answer extraction, math equality, R1 format, weighting."""
import threading

import pytest

from common.config import RewardConfig
from reward.registry import build_verifiers, check_settings, combine
from reward.verifiers import extract_answer, format_score, math_score

GOOD = "<think>7+5+0=12,4+8+1=13</think><answer>132</answer>"


def r1(answer, think="reasoning"):
    return f"<think>{think}</think><answer>{answer}</answer>"


# ---------------------------------------------------------------- extract_answer

def test_extract_answer_tag_and_last_one_wins():
    assert extract_answer(GOOD) == "132"
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_answer("<answer></answer>") == ""


def test_extract_answer_boxed_balanced_and_last():
    assert extract_answer(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_answer(r"\boxed{1} or rather \boxed{2}") == "2"
    # a truncated (unclosed) last box is skipped, the earlier complete one is used
    assert extract_answer(r"\boxed{3/4} and \boxed{5") == "3/4"
    # escaped braces are not grouping
    assert extract_answer(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"


def test_extract_answer_tag_beats_boxed_and_missing_is_none():
    assert extract_answer(r"\boxed{7}<answer>8</answer>") == "8"
    assert extract_answer(r"<answer>8") is None  # unclosed tag, no box
    assert extract_answer("the answer is 132") is None
    assert extract_answer("") is None


# ---------------------------------------------------------------- math_score

def test_math_correct_and_incorrect_arithmetic():
    assert math_score(GOOD, "132") == 1.0
    assert math_score(r1("133"), "132") == 0.0
    assert math_score(r1(" 132 "), "132") == 1.0
    assert math_score(r1("-2.5"), "-5/2") == 1.0


def test_math_answer_in_boxed():
    assert math_score(r"Adding the digits gives \boxed{132}.", "132") == 1.0
    assert math_score(r"\boxed{131}", "132") == 0.0


@pytest.mark.parametrize("pred, gold", [
    ("3/4", "0.75"),
    ("0.75", "3/4"),
    (r"\frac{1}{2}", "0.5"),
    ("0.5", r"\frac{1}{2}"),
    (r"\frac12", "0.5"),
    ("1,234", "1234"),
    ("1234", "1,234"),
    ("1 234", "1234"),        # math_verify alone reads $1 234$ as 1 + 234 = 235
    (r"1{,}234", "1234"),
    ("2.50", "2.5"),
    (r"\$18", "18"),
    ("18 dollars", "18"),     # unit words are dropped (math_verify alone: 18*d*o*l*l*a*r*s)
    ("x = 18", "18"),         # math_verify compares the right-hand side of an equation
    (r"10^{1}", "10"),
])
def test_math_equivalent_forms(pred, gold):
    assert math_score(r1(pred), gold) == 1.0


@pytest.mark.parametrize("pred, gold", [
    (r"10^{3}", "10"),        # raw (unwrapped) math_verify parsing would read this as 10
    ("1e3", "1000"),          # read as 1*e*3, not scientific notation
    ("0.76", "3/4"),
    ("7+5+0=12,4+8+1=13", "13"),  # the scratchpad is not an answer
    ("2 pi", "2"),
])
def test_math_not_equivalent(pred, gold):
    assert math_score(r1(pred), gold) == 0.0


def test_math_missing_or_empty_answer_is_zero():
    assert math_score("<think>7+5=12</think>132", "132") == 0.0
    assert math_score("the answer is 132", "132") == 0.0
    assert math_score(r1(""), "132") == 0.0
    assert math_score(r1("132"), "") == 0.0
    assert math_score(r1("}{"), "132") == 0.0


def test_math_garbage_never_raises():
    for junk in ["\\frac{", "$$$", "\\boxed{", "{{{{", "\\sqrt[", "1/0", "\\\\"]:
        assert math_score(r1(junk), "1") in (0.0, 1.0)
    assert math_score(r1("132"), "not a number") == 0.0


def test_math_from_a_thread_does_not_raise():
    out = []
    t = threading.Thread(target=lambda: out.append(math_score(GOOD, "132", timeout_s=5)))
    t.start()
    t.join(60)
    assert out == [1.0]


# ---------------------------------------------------------------- format_score

def test_format_good_layouts():
    assert format_score(GOOD) == 1.0
    assert format_score("  \n" + GOOD + "\n") == 1.0
    assert format_score("<think>a</think>\n<answer>b</answer>") == 1.0


@pytest.mark.parametrize("completion", [
    "<answer>132</answer>",                                         # missing think
    "<think>x</think><answer>1</answer><answer>2</answer>",         # two answers
    "<think>x</think><answer>1</answer> trailing text",             # text outside
    "preamble <think>x</think><answer>1</answer>",                  # text outside
    "<think>x</think> between <answer>1</answer>",                  # text between blocks
    "<think>x <answer>1</answer></think><answer>1</answer>",        # nested tag
    "<think>x <Answer>9</Answer></think><answer>1</answer>",        # other tag spelling
    "<answer>1</answer><think>x</think>",                           # wrong order
    "<think>x</think><answer> </answer>",                           # blank answer
    "<think>x</think><answer>1",                                    # truncated
    "the sum is 7+5 so answer 132 think answer 132 </think",        # answer in nonsense
])
def test_format_bad_layouts(completion):
    assert format_score(completion) == 0.0


def test_format_custom_pattern():
    pat = r"<answer>\d+</answer>"
    assert format_score("<answer>132</answer>", pat) == 1.0
    assert format_score(GOOD, pat) == 0.0


# ---------------------------------------------------------------- robustness

def test_huge_completion_returns():
    big = "<think>" + "7+5=12," * 150_000 + "</think><answer>" + "1" * 1_000_000 + "</answer>"
    assert len(big) > 1_000_000
    assert math_score(big, "1") == 0.0                    # over-long answer: not parsed
    assert format_score(big) == 1.0
    tags = "<think>" * 200_000 + r"\boxed{" * 100_000
    assert math_score(tags, "1") == 0.0
    assert format_score(tags) == 0.0
    assert extract_answer("{" * 500_000 + r"\boxed{1}" + "}" * 500_000) == "1"


def score_completion(completion, answer, verifiers, weights, **settings):
    calls = build_verifiers(RewardConfig(verifiers=verifiers, weights=weights, **settings))
    scores = {name: call("prompt", completion, answer, {}) for name, call in calls.items()}
    return combine(scores, weights), scores


def test_empty_completion_scores_zero_everywhere():
    assert math_score("", "132") == 0.0
    assert format_score("") == 0.0
    reward, scores = score_completion("", "132", ["math", "format"], {"math": 1.0, "format": 0.1})
    assert reward == 0.0 and scores == {"math": 0.0, "format": 0.0}


# ---------------------------------------------------------------- registry and weighting

def test_score_completion_weighting():
    w = {"math": 1.0, "format": 0.1}
    reward, scores = score_completion(GOOD, "132", ["math", "format"], w)
    assert scores == {"math": 1.0, "format": 1.0}
    assert reward == pytest.approx(1.1)
    reward, scores = score_completion(GOOD, "131", ["math", "format"], w)
    assert scores == {"math": 0.0, "format": 1.0}
    assert reward == pytest.approx(0.1)
    reward, scores = score_completion(r"\boxed{132}", "132", ["math", "format"], w)
    assert reward == pytest.approx(1.0)
    # weights of unselected verifiers are ignored; a name listed twice counts once
    reward, scores = score_completion(GOOD, "132", ["format", "format"], {"format": 0.5, "math": 9})
    assert scores == {"format": 1.0} and reward == pytest.approx(0.5)


def test_format_pattern_replaces_the_r1_layout():
    reward, scores = score_completion("Answer: 4", "4", ["format"], {"format": 1.0},
                                      format_pattern=r"Answer: \d+")
    assert scores == {"format": 1.0}
    assert score_completion(GOOD, "4", ["format"], {"format": 1.0}, format_pattern=r"Answer: \d+")[0] == 0.0


def _check(**kw):
    base = dict(verifiers=["math", "format"], weights={"math": 1.0, "format": 0.1})
    check_settings(RewardConfig(**{**base, **kw}))


def test_unknown_verifier_missing_weight_and_bad_settings_are_one_line_errors():
    with pytest.raises(ValueError, match=r"unknown verifier 'nope'.*math, format, code.*reward.custom.nope"):
        _check(verifiers=["math", "nope"], weights={"math": 1.0, "nope": 1.0})
    with pytest.raises(ValueError, match=r"no weight for verifier 'format'.*\+reward.weights.format=1.0"):
        _check(weights={"math": 1.0})
    with pytest.raises(ValueError, match="reward.format_pattern is not a valid regular expression"):
        _check(format_pattern="(unclosed")
    with pytest.raises(ValueError, match="reward.language: unknown language or script 'klingon'"):
        _check(language="klingon")
    with pytest.raises(ValueError, match="reward.timeout_s must be positive"):
        _check(timeout_s=0)
    with pytest.raises(ValueError, match="reward.length_budget"):
        _check(verifiers=["length"], weights={"length": 1.0}, length_budget=0)


def test_custom_verifier_by_import_path(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(prompts, completions, answer, **fields):\n"
        "    return [1.0 if len(c) < 10 and fields['level'][0] == 'easy' else 0.0 for c in completions]\n"
        "def nothing(prompts, completions, **kw):\n"
        "    return [None for _ in completions]\n")
    custom = {"brevity": "my_rewards:brevity", "nothing": "my_rewards:nothing"}
    settings = RewardConfig(verifiers=["brevity", "nothing"], weights={"brevity": 2.0, "nothing": 1.0}, custom=custom)
    check_settings(settings, [str(tmp_path)])
    calls = build_verifiers(settings, [str(tmp_path)])
    assert calls["brevity"]("p", "short", "a", {"level": "easy"}) == 1.0
    assert calls["brevity"]("p", "a longer completion", "a", {"level": "easy"}) == 0.0
    assert calls["nothing"]("p", "x", "a", {}) == 0.0  # None: not applicable, counts 0
    for path, message in [("my_rewards", "not of the form module:function"),
                          ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
                          ("my_rewards:missing", "'my_rewards' has no function 'missing'")]:
        bad = RewardConfig(verifiers=["x"], weights={"x": 1.0}, custom={"x": path})
        with pytest.raises(ValueError, match=f"reward.custom.x: .*{message}"):
            check_settings(bad, [str(tmp_path)])
    shadow = RewardConfig(verifiers=["math"], weights={"math": 1.0}, custom={"math": "my_rewards:brevity"})
    with pytest.raises(ValueError, match="built-in"):
        check_settings(shadow, [str(tmp_path)])


@pytest.mark.parametrize("gold,pred", [("7", "007"), ("-0", "0"), ("+5", "5"), ("132", "133"), ("-12", "12"),
                                       ("1" * 50, "1" * 50), ("1" * 50, "1" * 49 + "2"), ("0", "00")])
def test_plain_integers_get_math_verify_s_verdict_without_it(gold, pred):
    import math_verify

    from reward.verifiers import _equal, _parse

    expected = bool(math_verify.verify(_parse(gold, None), _parse(pred, None)))
    assert _equal.__wrapped__(gold, pred, None) == expected  # uncached: the integer comparison itself
