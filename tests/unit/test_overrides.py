"""Overrides the Hydra grammar cannot read: one line that names the key and shows the quoting
that works, exit status 2 (cluster/cli/compose.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli.compose import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(list(overrides))
    message = str(info.value)
    assert message and "\n" not in message, f"not one line: {message!r}"
    return message


def test_a_value_the_shell_unquoted_names_its_key_and_the_quoting_that_works():
    # What `grpo train data.system_prompt="Answer in <answer></answer>."` reaches the program as.
    message = error_of("trainer.max_steps=3", "data.system_prompt=Answer in <answer></answer>.")
    assert message.startswith("data.system_prompt:")
    assert "'data.system_prompt=\"Answer in <answer></answer>.\"'" in message
    assert "LexerNoViableAltException" not in message


def test_the_quoting_it_shows_is_read_as_the_value():
    cfg = load_config(['data.system_prompt="Answer in <answer></answer>."',
                       'data.prompt_template="{question} Put your final answer within \\boxed{{}}."'])
    assert cfg.data.system_prompt == "Answer in <answer></answer>."
    assert cfg.data.prompt_template == "{question} Put your final answer within \\boxed{{}}."


def test_a_value_with_double_quotes_is_shown_in_single_ones():
    message = error_of('+reward.custom.x=say "hi" <now>')
    assert message.startswith("reward.custom.x:") and "\"reward.custom.x='say \"hi\" <now>'\"" in message


def test_a_value_split_into_words_names_the_key_before_it():
    message = error_of("data.system_prompt=Answer", "in", "tags.")
    assert "'in' is not an override" in message and "data.system_prompt" in message


def test_the_cli_exits_2_with_the_line_before_heavy_imports():
    code = ("import sys; from cluster.cli import main; status = main(sys.argv[1:]); "
            "print(status, [m for m in ('ray', 'torch') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code, "train", "data.system_prompt=Answer in <answer></answer>."],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "2 []", result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo: error: data.system_prompt:"), result.stderr
    assert "'data.system_prompt=\"Answer in <answer></answer>.\"'" in lines[0]
