"""Tools, call formats, traces and the loss mask of multi-turn episodes (pure logic, no engine)."""
from __future__ import annotations

import json
import math
import os
import threading
import time

import pytest
import torch

from common.calculator import ToolError, calculator
from common.config import ConfigError, RolloutConfig
from common.prompt_group import PromptGroup
from common.sandbox import SandboxLimits
from common.tool_formats import FormatError, HermesFormat, TagFormat, make_format
from data.datasets import arithmetic_problems
from data.tiny_model import build_tokenizer
from data.traces import calculator_trace, with_tool_traces
from learner.batching import flatten
from learner.grpo import policy_loss
from reward.pool import _fields
from rollout.tools import Lanes, ToolBox


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


def test_a_call_s_time_limit_counts_from_when_it_starts_running(tool_fixtures):
    box = ToolBox([], {"hang": "tool_fixtures:hang"}, timeout_s=0.2, max_chars=20, sandbox=SandboxLimits())
    try:
        call = box.submit("hang", "x")  # the first call also waits for its process to import
        assert _eventually(lambda: call.started is not None)
        assert call.started >= call.submitted and call.deadline == call.started + 0.2
        assert not call.ready(call.started)
        assert call.ready(call.deadline)
        assert _eventually(call.future.done)  # the box ends the hung call itself, at its limit
        assert call.observation(20).timed_out
    finally:
        box.close()


def test_a_hung_custom_tool_costs_one_call_and_its_process_never_a_slot(tool_fixtures):
    box = ToolBox([], {"hang": "tool_fixtures:hang", "echo": "tool_fixtures:echo"}, timeout_s=0.3,
                  max_chars=20, sandbox=SandboxLimits(), lanes=Lanes(custom_slots=1, custom_queue=1))
    try:
        assert box.run("echo", "a").text == "a"
        (proc,) = box.custom.processes
        first = proc.pid
        for _ in range(3):  # one slot: each hang must free it for the next call
            assert box.run("hang", "x").timed_out
        assert box.run("echo", "b").text == "b"
        assert proc.pid != first and not _alive(first) and proc.restarts == 3
    finally:
        box.close()
    assert not _leftovers()


# --------------------------------------------------------------------------- lanes

HUNG = "while True: pass"


def test_hung_sandboxes_never_delay_the_calculator_and_closing_ends_them(tool_fixtures):
    box = ToolBox(["calculator", "python"], {"echo": "tool_fixtures:echo"}, timeout_s=3.0, max_chars=50,
                  sandbox=SandboxLimits(timeout_s=2.75))
    try:
        hung = [box.submit("python", HUNG) for _ in range(16)]  # 8 running, 8 waiting for a slot
        assert _eventually(lambda: sum(c.started is not None for c in hung) == 8)
        assert all(c.deadline == math.inf for c in hung if c.started is None)  # waiting: not timing out
        asked = time.monotonic()
        calc = box.submit("calculator", "6*7")
        assert _eventually(calc.future.done, within=1.0)
        answered = time.monotonic()
        assert calc.observation(50).text == "42" and answered - asked < 1.0
        assert not any(c.future.done() for c in hung)  # every hung program is still running
        assert box.run("echo", "hi").text == "hi"  # custom tools have a lane of their own too
    finally:
        box.close()
    assert all(c.future.done() for c in hung)
    assert not _leftovers()


def test_a_full_sandbox_queue_answers_a_new_call_at_once(tool_fixtures):
    box = ToolBox(["calculator", "python"], {}, timeout_s=3.0, max_chars=50,
                  sandbox=SandboxLimits(timeout_s=2.75), lanes=Lanes(sandbox_slots=2, sandbox_queue=1))
    try:
        hung = [box.submit("python", HUNG) for _ in range(3)]
        full = box.submit("python", "print(1)")
        assert full.ready(full.submitted)
        refused = full.observation(50)
        assert refused.error and not refused.timed_out
        assert refused.text == "error: busy: 3 python sandbox calls are running or waiting; call again later"
        assert box.run("calculator", "1+1").text == "2"
        assert not any(c.future.done() for c in hung)
    finally:
        box.close()
    assert not _leftovers()


def test_an_episode_s_calculator_answers_while_sixteen_episodes_hang_in_the_sandbox():
    """The episode loop with the real box and real sandboxes; the engine is scripted (which
    turn ends when) so that the calculator call comes after the 16 hung ones."""
    from rollout.episodes import Episode, Limits, run_episodes

    box = ToolBox(["calculator", "python"], {}, timeout_s=3.0, max_chars=50, sandbox=SandboxLimits(timeout_s=2.75))
    engine = ScriptedEngine({i: "<tool>python: " + HUNG for i in range(16)} | {16: "<tool>calculator: 123*456"},
                            late={16})
    episodes = [Episode(prompt_ids=[1], seed=i) for i in range(17)]
    try:
        stats = run_episodes(engine, build_tokenizer(), episodes, lambda ep, turn, room: None, box, TagFormat(),
                             Limits(max_turns=2, max_new_tokens=8, max_episode_tokens=200, max_model_len=256),
                             greedy=True)
    finally:
        box.close()
    calc = episodes[16]
    assert calc.transcript[1] == "<result>56088</result>" and calc.errors == 0
    # its answer came within a second of its call, before any hung call's (their limits: 3 s)
    assert engine.second_turn[16] - engine.first_turn_end[16] < 1.0
    assert engine.second_turn[16] < min(engine.second_turn[i] for i in range(16))
    assert all(ep.timeouts == 1 for ep in episodes[:16]) and stats["tool_timeouts"] == 16
    assert not _leftovers()


class _Sample:
    def __init__(self, text):
        self.text, self.token_ids, self.logprobs = text, [7] * 3, None
        self.finish_reason, self.stop_reason = ("stop", "</tool>") if "<tool>" in text else ("stop", None)


class _Output:
    def __init__(self, request_id, text):
        self.request_id, self.finished, self.outputs = request_id, True, [_Sample(text)]


class ScriptedEngine:
    """Each episode's first turn ends with its scripted call (those in `late` one step after
    the others); a second turn ends the episode. Records when each turn ended and began."""

    def __init__(self, calls, late):
        self.calls, self.late, self.pending, self.steps = calls, late, [], 0
        self.first_turn_end, self.second_turn = {}, {}

    def add_request(self, request_id, prompt, params):
        episode, turn = (int(x) for x in request_id.split("-")[1:])
        if turn == 1:
            self.second_turn[episode] = time.monotonic()
        self.pending.append((request_id, episode, turn))

    def step(self):
        self.steps += 1
        out, keep = [], []
        for request_id, episode, turn in self.pending:
            if turn == 0 and episode in self.late and self.steps == 1:
                keep.append((request_id, episode, turn))
                continue
            if turn == 0:
                self.first_turn_end[episode] = time.monotonic()
            out.append(_Output(request_id, self.calls[episode] if turn == 0 else "done"))
        self.pending = keep
        return out


def _eventually(condition, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _leftovers() -> list:
    """Tool threads still alive, and sandbox or tool processes descending from this process."""
    threads = [t.name for t in threading.enumerate() if t.name.startswith("tool-")]
    procs = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if (b"unshare" in cmdline or b"rollout.tool_process" in cmdline) and parent == os.getpid():
            procs.append(int(pid))
    return threads + procs


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
    from cluster.cli.verify import VerifyInputError, _request, read_rows

    episode = [{"role": "assistant", "content": "<think><tool>calculator: 2*3</tool>"},
               {"role": "tool", "content": "<result>6</result>"},
               {"role": "assistant", "content": "</think><answer>6</answer>"}]
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "2*3=", "answer": "6", "transcript": episode}) + "\n")
    (row,) = read_rows(str(path), ["math"])
    request = _request(row)
    assert request.completion == "<think><tool>calculator: 2*3</tool></think><answer>6</answer>"
    assert request.fields["transcript"] == "<think><tool>calculator: 2*3</tool><result>6</result></think><answer>6</answer>"
    path.write_text(json.dumps({"prompt": "p", "answer": "6", "transcript": [{"role": "user", "content": "x"}]}))
    with pytest.raises(VerifyInputError, match="line 1: transcript message 0 must be"):
        read_rows(str(path), ["math"])
