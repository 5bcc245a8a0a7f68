"""Tools, call formats, traces and the loss mask of multi-turn episodes (pure logic, no engine)."""
from __future__ import annotations

import json
import time

import pytest
import torch

from common.config import ConfigError, RolloutConfig
from common.prompt_group import PromptGroup
from common.sandbox import SandboxLimits
from learner.batching import flatten
from learner.grpo import policy_loss
from learner.tiny_model import build_tokenizer
from reward.pool import _fields
from rollout.tool_formats import FormatError, HermesFormat, TagFormat, make_format
from rollout.tools import ToolBox, ToolError, calculator
from rollout.traces import calculator_trace, with_tool_traces
from rollout.datasets import arithmetic_problems


# --------------------------------------------------------------------------- calculator

@pytest.mark.parametrize("expression, value", [
    ("123*456", "56088"), ("1234 * 5678", "7006652"), ("1/3+1/6", "1/2"), ("-7/3", "-7/3"),
    ("1.5*2", "3"), ("0.1+0.2", "3/10"), ("2^10", "1024"), ("2**-2", "1/4"), ("(2+3)*(4-1)", "15"),
    ("10//3", "3"), ("7%3", "1"), ("1,234*2", "2468"), ("3×4÷6", "2"),
])
def test_calculator_is_exact(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('id')", "not arithmetic"), ("a+1", "not arithmetic"), ("(1).__class__", "not arithmetic"),
    ("[1]*9", "not arithmetic"), ("1/0", "division by zero"), ("0**-1", "division by zero"),
    ("9**9**9", "exponent"), ("2**0.5", "whole-number"), ("10**200*10**200*10**200", "digits"),
    ("1+" * 120 + "1", "longer than"), ("", "empty"), ("1+", "cannot parse"), ("True+1", "not arithmetic"),
])
def test_calculator_refuses_what_it_cannot_compute_exactly_or_quickly(expression, why):
    with pytest.raises(ToolError, match=why):
        calculator(expression)


def test_calculator_takes_json_arguments():
    assert calculator({"expression": "6*7"}) == "42"


# --------------------------------------------------------------------------- formats

def test_tag_format_parses_a_call_and_reports_a_malformed_one():
    fmt = TagFormat()
    call = fmt.parse("<think><tool>calculator: 123*456</tool>")
    assert (call.name, call.arguments, call.error) == ("calculator", "123*456", None)
    assert fmt.parse("<tool>python: print(1)\nprint(2)</tool>").arguments == "print(1)\nprint(2)"
    assert fmt.parse("<tool>calculator 1+2</tool>").error == "write <tool>NAME: ARGUMENTS</tool>"
    assert fmt.parse("1+2</tool>").error.startswith("no <tool>")
    assert fmt.observation_text("56088") == "<result>56088</result>"


def test_hermes_format_parses_json_calls_and_renders_results_with_the_chat_template():
    fmt = HermesFormat(build_tokenizer())
    call = fmt.parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>')
    assert (call.name, call.arguments) == ("calculator", {"expression": "2*3"})
    as_string = fmt.parse('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert as_string.arguments == {"code": "print(1)"}
    assert "not JSON" in fmt.parse("<tool_call>{name: calculator}</tool_call>").error
    assert fmt.parse('<tool_call>{"arguments": {}}</tool_call>').error.startswith("write")
    assert fmt.parse('<tool_call>{"name": "x", "arguments": [1]}</tool_call>').error == "the arguments are not a JSON object"
    # The built-in model's ChatML template: end the assistant turn, a tool turn, a new assistant turn.
    assert fmt.observation_text("6") == "<|im_end|>\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n"


def test_a_tool_format_the_tokenizer_cannot_express_is_refused():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(FormatError, match="chat template"):
        make_format("hermes", tokenizer)

    class Lossy:  # a tokenizer that maps angle brackets to an unknown token
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [0 if ch in "<>" else ord(ch) for ch in text]}

        def decode(self, ids, skip_special_tokens=False):
            return "".join("?" if i == 0 else chr(i) for i in ids)

    with pytest.raises(FormatError, match="cannot express"):
        make_format("tag", Lossy())


def test_the_built_in_tokenizer_writes_tool_tags_as_single_tokens():
    tokenizer = build_tokenizer(tool_tags=True)
    for tag in ("<tool>", "</tool>", "<result>", "</result>"):
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1


# --------------------------------------------------------------------------- the box

@pytest.fixture
def tool_fixtures(tmp_path, monkeypatch):
    (tmp_path / "tool_fixtures.py").write_text(
        "import time\n"
        "def echo(text):\n    return text\n"
        "def boom(text):\n    raise RuntimeError('tool broke')\n"
        "def hang(text):\n    time.sleep(30)\n"
        "def flood(text):\n    return 'x' * 10**6\n"
        "def keywords(city, days=1):\n    return f'{city}:{days}'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_bad_calls_become_error_observations_never_exceptions(tool_fixtures):
    box = ToolBox(["calculator"], {n: f"tool_fixtures:{n}" for n in ("echo", "boom", "hang", "flood", "keywords")},
                  timeout_s=0.5, max_chars=20, sandbox=SandboxLimits(timeout_s=0.3))
    try:
        assert box.run("calculator", "6*7").text == "42"
        assert box.run("echo", "hi").text == "hi"
        assert box.run("keywords", {"city": "Paris", "days": 2}).text == "Paris:2"
        unknown = box.run("search", "x")
        assert unknown.error and "unknown tool 'search'" in unknown.text
        broke = box.run("boom", "x")
        assert broke.error and "RuntimeError: tool broke" in broke.text
        wrong = box.run("calculator", "import os")
        assert wrong.error and wrong.text.startswith("error: cannot parse")
        hung = box.run("hang", "x")
        assert hung.error and hung.timed_out
        flood = box.run("flood", "x")
        assert flood.text.startswith("x" * 20) and flood.text.endswith("[... 999980 more characters]")
    finally:
        box.close()


def test_a_pending_call_is_ready_at_its_deadline_and_then_reads_as_a_timeout(tool_fixtures):
    box = ToolBox([], {"hang": "tool_fixtures:hang"}, timeout_s=0.2, max_chars=20, sandbox=SandboxLimits())
    try:
        call = box.submit("hang", "x")
        assert not call.ready(call.started)
        assert call.ready(call.deadline)
        time.sleep(0.25)
        assert call.observation(20).timed_out
    finally:
        box.close()


# --------------------------------------------------------------------------- config

@pytest.mark.parametrize("settings, message", [
    ({"tools": ["search"]}, "unknown tool 'search'"),
    ({"tools": ["calculator"], "max_turns": 0}, "rollout.max_turns must be at least 1"),
    ({"custom_tools": {"python": "m:f"}}, "is a built-in tool"),
    ({"tools": ["python"], "tool_timeout_s": 0}, "tool_timeout_s must be above 0"),
    ({"tool_format": "xml"}, "rollout.tool_format must be one of tag, hermes"),
])
def test_bad_tool_settings_are_one_line_config_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        RolloutConfig(**settings).check()


def test_an_episode_budget_bounds_the_learner_s_completion_length():
    assert RolloutConfig().completion_budget == 32
    assert RolloutConfig(tools=["calculator"]).completion_budget == 127  # 4 turns x 32, within 128
    assert RolloutConfig(tools=["calculator"], max_episode_tokens=80).completion_budget == 80


# --------------------------------------------------------------------------- traces and data

def test_the_mul_task_warms_up_on_calculator_traces_only_when_the_run_has_the_calculator():
    heldout, train = arithmetic_problems(0, 4, 8, 3, 4, op="mul")
    a, b = map(int, train[0].prompt[:-1].split("*"))
    assert train[0].answer == str(a * b) and train[0].fields["expression"] == f"{a}*{b}"
    assert train[0].solution == f"<think></think><answer>{a * b}</answer>"
    traced = with_tool_traces(train, TagFormat(), ["calculator"])[0].solution
    assert traced == calculator_trace(TagFormat(), f"{a}*{b}", str(a * b))
    assert [trained for _, trained in traced] == [True, False, True]
    assert traced[1][0] == f"<result>{a * b}</result>"
    assert with_tool_traces(train, TagFormat(), ["python"])[0].solution == train[0].solution


# --------------------------------------------------------------------------- what the learner trains on

def _episode_group():
    """One prompt, two episodes: model tokens (1) and a tool result (0) in between."""
    masks = [[1, 1, 1, 0, 0, 0, 1, 1], [1, 1, 0, 0, 1]]
    ids = [[10, 11, 12, 20, 21, 22, 13, 14], [15, 16, 23, 24, 17]]
    logprobs = [[-0.5, -0.4, -0.3, 0.0, 0.0, 0.0, -0.2, -0.1], [-0.6, -0.7, 0.0, 0.0, -0.8]]
    return PromptGroup(index=0, prompt="p", answer="1", prompt_ids=[5, 6, 7], completions=["a", "b"],
                       completion_ids=ids, finish_reasons=["stop", "stop"], policy_version=0,
                       sampler_logprobs=logprobs, rewards=[1.0, 0.0], loss_masks=masks,
                       transcripts=["a<result>x</result>", "b<result>y</result>"])


def test_tool_results_are_not_targets_and_the_sampler_log_probs_line_up():
    batch = flatten([_episode_group()], pad_id=0, device="cpu")
    # targets are shifted by one: completion token k of a row is target position 3 - 1 + k
    assert batch.mask[0].tolist() == [False, False, True, True, True, False, False, False, True, True]
    assert batch.mask[1].tolist() == [False, False, True, True, False, False, True, False, False, False]
    assert batch.sampler_logprobs[0, 2:5].tolist() == pytest.approx([-0.5, -0.4, -0.3])
    assert batch.ids[0, 3:].tolist() == [10, 11, 12, 20, 21, 22, 13, 14]  # every id as sampled/observed


def test_the_gradient_ignores_tool_results_exactly():
    """The loss of a batch with tool results has the gradient of the same loss summed over the
    model's own tokens only, picked by position (no mask): observations add nothing."""
    torch.manual_seed(0)
    batch = flatten([_episode_group()], pad_id=0, device="cpu")
    logits = torch.randn(batch.ids.shape[0], batch.ids.shape[1] - 1, 30, requires_grad=True)
    targets = batch.ids[:, 1:]
    logprobs = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    old, ref = logprobs.detach() + 0.05, logprobs.detach() - 0.1
    advantages = torch.tensor([0.7, -0.7])
    loss, _ = policy_loss(logprobs, old, ref, advantages, batch.mask, beta=0.04)
    (with_mask,) = torch.autograd.grad(loss, logits, retain_graph=True)

    own = {0: [2, 3, 4, 8, 9], 1: [2, 3, 6]}  # the model's tokens of each row, as target positions
    by_hand = 0.0
    for row, positions in own.items():
        lp = logprobs[row, positions]
        ratio = torch.exp(lp - old[row, positions])
        surrogate = torch.min(ratio * advantages[row], ratio.clamp(0.8, 1.2) * advantages[row])
        log_r = ref[row, positions] - lp
        kl = torch.exp(log_r) - log_r - 1
        by_hand = by_hand + (-surrogate + 0.04 * kl).mean()
    (picked,) = torch.autograd.grad(by_hand / len(own), logits)
    assert torch.allclose(with_mask, picked, atol=1e-6)
    observation_positions = [(0, 5), (0, 6), (0, 7), (1, 4), (1, 5)]
    assert all(with_mask[r, t].abs().max() == 0 for r, t in observation_positions)


def test_verifiers_see_the_model_s_text_and_the_transcript_as_a_field():
    group = _episode_group()
    group.fields = {"tests": "t"}
    assert _fields(group) == [{"tests": "t", "transcript": "a<result>x</result>"},
                              {"tests": "t", "transcript": "b<result>y</result>"}]
    group.transcripts = None
    assert _fields(group) == [{"tests": "t"}] * 2


def test_grpo_verify_scores_a_transcript_row_as_training_does(tmp_path):
    from cluster.verify import VerifyInputError, _item, read_rows

    episode = [{"role": "assistant", "content": "<think><tool>calculator: 2*3</tool>"},
               {"role": "tool", "content": "<result>6</result>"},
               {"role": "assistant", "content": "</think><answer>6</answer>"}]
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "2*3=", "answer": "6", "transcript": episode}) + "\n")
    (row,) = read_rows(str(path), ["math"])
    prompt, completion, answer, fields = _item(row)
    assert completion == "<think><tool>calculator: 2*3</tool></think><answer>6</answer>"
    assert fields["transcript"] == "<think><tool>calculator: 2*3</tool><result>6</result></think><answer>6</answer>"
    path.write_text(json.dumps({"prompt": "p", "answer": "6", "transcript": [{"role": "user", "content": "x"}]}))
    with pytest.raises(VerifyInputError, match="line 1: transcript message 0 must be"):
        read_rows(str(path), ["math"])
