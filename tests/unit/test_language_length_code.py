"""The language, length and code verifiers' pure parts (the sandbox itself: test_sandbox.py)."""
import pytest

from reward.code import extract_program
from reward.language import language_score, length_penalty, script_of


def test_language_share_of_letters_in_the_expected_script():
    assert language_score("<think>the sum is</think><answer>12</answer>", "en") == 1.0
    assert language_score("<think>和是</think><answer>12</answer>", "zh") == 1.0
    assert language_score("<think>和是</think><answer>12</answer>", "en") == 0.0
    mixed = language_score("abcd 和是", "latin")
    assert mixed == pytest.approx(4 / 6)
    # LaTeX commands, tags and fenced code are not prose; digits alone are language-neutral
    assert language_score(r"<think>\frac{1}{2} 计算</think>", "han") == 1.0
    assert language_score("```python\nprint('hello')\n```答案", "zh") == 1.0
    assert language_score("<answer>42</answer>", "ru") == 1.0
    assert language_score("", "en") == 0.0
    assert language_score("привет", "ru") == 1.0 and language_score("привет", "latin") == 0.0


def test_language_names_and_codes():
    assert script_of("ZH") == "han" and script_of("cyrillic") == "cyrillic" and script_of("ja") == "japanese"
    with pytest.raises(ValueError, match="unknown language or script 'xx'"):
        script_of("xx")


def test_length_penalty_is_zero_within_budget_then_linear_to_minus_one():
    assert length_penalty("a" * 100, 100) == 0.0
    assert length_penalty("a" * 150, 100) == pytest.approx(-0.5)
    assert length_penalty("a" * 200, 100) == pytest.approx(-1.0)
    assert length_penalty("a" * 10_000, 100) == -1.0
    assert length_penalty("", 100) == 0.0
    with pytest.raises(ValueError):
        length_penalty("a", 0)


def test_extract_program_prefers_the_last_fenced_block_in_the_answer():
    c = "<think>```python\nbad()\n```</think><answer>```python\ndef f():\n    return 1\n```</answer>"
    assert extract_program(c) == "def f():\n    return 1\n"
    assert extract_program("text\n```py\nx = 1\n```\nmore\n```\ny = 2\n```") == "y = 2\n"
    assert extract_program("<answer>def g(): return 2</answer>") == "def g(): return 2"
    assert extract_program("no code here") is None
    assert extract_program("") is None
