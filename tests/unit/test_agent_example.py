"""The worked agent example's pieces that are pure logic: the built-in model's tool-calling chat
template, warm-up traces that are exactly what the endpoint stores for the same episode, the
agent's prompts and its calculator, and the records an agent run's stats carry."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from common.config import DataConfig
from common.dispatch import Dispatched
from common.messages import ChunkReport
from data.tiny_model import CHAT_TOOL_PIECES, CHAT_TOOL_TAGS, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(chat_tools=True)


def _agent():
    from examples import calculator_agent

    return calculator_agent


def test_the_agent_model_lists_tools_and_writes_calls_and_results_in_qwen_style(tokenizer):
    tools = _agent().TOOLS
    user = [{"role": "user", "content": "12*34="}]
    prompt = tokenizer.apply_chat_template(user, tools=tools, tokenize=False, add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\n<tools>\n" + json.dumps(tools[0]) + "\n</tools><|im_end|>\n"
                      "<|im_start|>user\n12*34=<|im_end|>\n<|im_start|>assistant\n")
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12*34"}'}}]}
    text = tokenizer.apply_chat_template(user + [call, {"role": "tool", "content": "408"}], tools=tools,
                                         tokenize=False, add_generation_prompt=True)
    assert text[len(prompt):] == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n'
                                  "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n408\n"
                                  "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    for tag in CHAT_TOOL_TAGS + CHAT_TOOL_PIECES:
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1, tag
    # The call's fixed text is a few tokens (the operand stays near the place it is copied to),
    # and they decode to the very text vLLM's Hermes parser reads.
    turn = text[len(prompt):text.index("<|im_end|>", len(prompt))]
    ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
    assert len(ids) == len("12*34") + 8 and tokenizer.decode(ids) == turn
    # Without tools the agent model's template renders as the default model's.
    plain = [{"role": "system", "content": "s"}, *user, {"role": "assistant", "content": "a"}]
    assert tokenizer.apply_chat_template(plain, tokenize=False) == build_tokenizer().apply_chat_template(
        plain, tokenize=False)


def test_warm_up_traces_are_the_ids_the_endpoint_stores_for_the_same_episode(tokenizer):
    """The warm-up's trace of a calculator episode, tokenized piece by piece as the learner does,
    is the session the endpoint builds when the model samples the trained pieces and the agent
    sends the call back with its result: same ids, same mask, no drift."""
    from rollout.endpoint import _for_template
    from rollout.sessions import SessionStore, plan_turn, record_turn
    from data.traces import agent_calculator_trace

    agent, user = _agent(), [{"role": "user", "content": "8253*2020="}]
    trace = agent_calculator_trace(tokenizer, user, agent.TOOLS, "8253*2020", "16671060", ["<|im_end|>"])
    pieces = [tokenizer(text, add_special_tokens=False)["input_ids"] for text, _ in trace]
    assert [trained for _, trained in trace] == [True, False, True]
    assert "16671060" in trace[1][0] and trace[2][0] == "<answer>16671060</answer>"

    def render(messages, tools, generation):
        return tokenizer.apply_chat_template(_for_template(messages), tools=tools, tokenize=True,
                                             add_generation_prompt=generation, return_dict=False)

    session = SessionStore().open(max_tokens=200)
    first = plan_turn(session, user, agent.TOOLS, 1, render)
    decode = lambda ids: tokenizer.decode(ids)  # noqa: E731
    record_turn(session, first, user, pieces[0], [0.0] * len(pieces[0]), trace[0][0], decode)
    call = {"id": "call-1", "type": "function",
            "function": {"name": "calculator", "arguments": agent.json.dumps({"expression": "8253*2020"})}}
    assert agent._result(SimpleNamespace(**{"function": SimpleNamespace(**call["function"])})) == "16671060"
    messages = user + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call-1", "content": "16671060"}]
    second = plan_turn(session, messages, agent.TOOLS, 1, render)
    assert second.trained and second.extension == pieces[1] and session.drift_turns == 0
    record_turn(session, second, messages, pieces[2], [0.0] * len(pieces[2]), trace[2][0], decode)
    assert session.prompt_ids == tokenizer(tokenizer.apply_chat_template(
        user, tools=agent.TOOLS, tokenize=False, add_generation_prompt=True))["input_ids"]
    assert session.ids == pieces[0] + pieces[1] + pieces[2]
    assert session.mask == [1] * len(pieces[0]) + [0] * len(pieces[1]) + [1] * len(pieces[2])


def test_an_agent_run_gives_the_agent_the_conversation_and_warms_up_on_its_rendering(tmp_path, monkeypatch):
    from data.datasets import DataError, arithmetic_problems
    from data.prompts import prepare

    build_tokenizer(chat_tools=True).save_pretrained(tmp_path / "model")
    rollout = SimpleNamespace(agent="examples.calculator_agent:run", episodes=False)
    heldout, train = arithmetic_problems(0, 2, 4, 3, 4, op="mul")
    rendered, info = prepare(DataConfig(system_prompt="Multiply."), str(tmp_path / "model"), "tiny",
                             {"train": train}, rollout)
    row = rendered["train"][0]
    messages = [{"role": "system", "content": "Multiply."}, {"role": "user", "content": train[0].prompt}]
    assert row.prompt == train[0].prompt and row.fields["messages"] == messages
    assert row.warmup_prompt == info["first_prompt"] == build_tokenizer(chat_tools=True).apply_chat_template(
        messages, tools=_agent().TOOLS, tokenize=False, add_generation_prompt=True)
    assert row.solution[0][0].startswith("<tool_call>") and row.solution[2] == (f"<answer>{row.answer}</answer>",
                                                                                 True)
    assert info["turn_end_ids"] and "calculator" in info["tools"]

    bare = build_tokenizer()
    bare.chat_template = None
    bare.save_pretrained(tmp_path / "bare")
    with pytest.raises(DataError, match="rollout.agent: the tokenizer of bare has no chat template"):
        prepare(DataConfig(), str(tmp_path / "bare"), "bare", {"train": train}, rollout)


def test_the_example_calculator_is_exact_and_runs_nothing_else():
    calculator = _agent().calculator
    assert calculator("8253*2020") == "16671060" and calculator("-(12-30)*3") == "54"
    for bad in ("__import__('os')", "2**10", "1/3", "x", "9" * 300):
        assert calculator(bad).startswith("error:"), bad


def test_records_in_chunk_stats_are_kept_not_summed(tmp_path, capsys):
    from cluster.loop.batches import DRIFT_FILE, keep_agent_records

    total = Dispatched.empty(2)
    total.add(ChunkReport({"turns": 2.0}, records={"first_agent_error": "ValueError: a"}), [0])
    total.add(ChunkReport({"turns": 3.0}, records={"first_agent_error": "ValueError: b", "first_drift": {"turn": 1}}),
              [1])
    assert total.stats == {"turns": 5.0}
    assert total.records == {"first_agent_error": "ValueError: a", "first_drift": {"turn": 1}}

    cfg = SimpleNamespace(trainer=SimpleNamespace(output_dir=str(tmp_path), run_name="run"))
    (tmp_path / "run").mkdir()
    keep_agent_records(cfg, 3, {**total.stats, "agent_errors": 1.0}, total.records)
    keep_agent_records(cfg, 4, {}, {"first_drift": {"turn": 2}})
    assert json.loads((tmp_path / "run" / DRIFT_FILE).read_text()) == {"step": 3, "turn": 1}  # the first kept
    assert "step 3: 1 agent episodes failed (scored 0); the first: ValueError: a" in capsys.readouterr().out


def test_the_async_agent_sends_what_the_sync_one_does():
    """run and run_async, against clients that reply with a calculator call and then the answer,
    send the same conversations and return the same answer."""
    import asyncio

    agent = _agent()

    def replies():
        call = SimpleNamespace(id="c0", function=SimpleNamespace(name="calculator", arguments='{"expression": "12*34"}'))
        yield SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=None, tool_calls=[call]))])
        yield SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="408", tool_calls=None))])

    def client(sent, asynchronous):
        script = replies()

        def create(**request):
            sent.append(json.loads(json.dumps(request["messages"])))
            return next(script)

        async def acreate(**request):
            return create(**request)
        return SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=acreate if asynchronous else create)))

    row = {"prompt": "12*34="}
    sync_sent, async_sent = [], []
    assert agent.run(client(sync_sent, False), row, 0) == "408"
    assert asyncio.run(agent.run_async(client(async_sent, True), row, 0)) == "408"
    assert sync_sent == async_sent and len(sync_sent) == 2
    assert sync_sent[1][-1] == {"role": "tool", "tool_call_id": "c0", "content": "408"}
