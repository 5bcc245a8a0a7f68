"""Agents through the OpenAI-compatible endpoint of a real generation worker (vLLM CPU build),
with the real `openai` package as their client, in processes of their own.

What is checked: the ids a session trains on are exactly the prompt the sampler saw and the ids
it sampled, turn after turn; a chat template that is not append-only is detected and the stored
ids win; hostile agents (raise, hang, no key, another session's URL, huge requests) end only
their own episode and are counted.
"""
from __future__ import annotations

import os
import textwrap
from dataclasses import replace

import pytest

from helpers import EngineTap, release_in_process_engine, seeded

SPEC = [{"type": "function", "function": {"name": "calc", "description": "integer arithmetic", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CALL = {"name": "calc", "arguments": {"expression": "12+34"}}
TOOL_PROMPT = "12+34="


def calling_model(model_cfg, folder) -> tuple:
    """The built-in model for agents (its chat template speaks Qwen2.5's tool-calling format),
    taught by 150 supervised steps (seconds) to answer TOOL_PROMPT with SPEC's tools by a call,
    and the call's result by the answer: a model that emits a tool call, which a randomly
    initialised one never does. Returns its folder and the conversation it was taught, as the
    template renders it: the first prompt's ids, the call's turn, the second prompt (the first,
    the call, the tool's result), the whole episode."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from data.tiny_model import TURN_END, build_tiny_model

    base = build_tiny_model(replace(model_cfg, max_position_embeddings=512), chat_tools=True)
    tokenizer = AutoTokenizer.from_pretrained(base)
    render = lambda messages, generation: list(tokenizer.apply_chat_template(  # noqa: E731
        messages, tools=SPEC, tokenize=True, add_generation_prompt=generation, return_dict=False))
    user = [{"role": "user", "content": TOOL_PROMPT}]
    called = user + [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]}]
    answered = called + [{"role": "tool", "content": "46"}]
    first, call = render(user, True), render(called, False)
    second = render(answered, True)
    end = tokenizer.convert_tokens_to_ids(TURN_END)  # the model's turn ends there: what it samples last
    call_turn = call[len(first):call.index(end, len(first)) + 1]
    episode = second + tokenizer("46", add_special_tokens=False)["input_ids"] + [end]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    examples = [(first + call_turn, len(first)), (episode, len(second))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small: more threads only contend, on a busy machine most
    for _ in range(150):
        loss = 0.0
        for ids, start in examples:
            x = torch.tensor([ids])
            labels = x.clone()
            labels[0, :start] = -100
            loss = loss + model(input_ids=x, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder), first, call_turn, second, episode


AGENTS = textwrap.dedent('''
    import json, time, urllib.request

    def chat(client, row, index):
        """Two turns: ask, then send the reply back with a follow-up question."""
        messages = [{"role": "user", "content": row["prompt"]}]
        first = client.chat.completions.create(model="m", messages=messages, max_tokens=6)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "again:"}]
        second = client.chat.completions.create(model="m", messages=messages, max_tokens=6)
        return second.choices[0].message.content

    async def chat_async(client, row, index):
        messages = [{"role": "user", "content": row["prompt"]}]
        reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=5)
        side = await client.chat.completions.create(model="m", messages=messages, max_tokens=3, n=2)
        assert len(side.choices) == 2
        return reply.choices[0].message.content

    SPEC = %s

    def tools(client, row, index):
        """A function tool: read tool_calls, run them, send each result back as a tool message."""
        messages = [{"role": "user", "content": row["prompt"]}]
        first = client.chat.completions.create(model="m", messages=messages, tools=SPEC, max_tokens=60)
        message = first.choices[0].message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in message.tool_calls or []]
        messages += [{"role": "assistant", "content": message.content, "tool_calls": calls}]
        results = [str(sum(int(x) for x in json.loads(c["function"]["arguments"])["expression"].split("+")))
                   for c in calls]
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, results)]
        second = client.chat.completions.create(model="m", messages=messages, tools=SPEC, max_tokens=8)
        return json.dumps({"finish": first.choices[0].finish_reason, "calls": [c["function"] for c in calls],
                           "final": second.choices[0].message.content})

    def raises(client, row, index):
        raise RuntimeError("the agent's own bug")

    def hangs(client, row, index):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        while True:
            pass

    def hostile(client, row, index):
        """Every misuse an agent can make of the endpoint; what each got back, as JSON."""
        base, key = str(client.base_url).rstrip("/"), client.api_key
        def post(url, body, headers):
            request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **headers})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status
            except urllib.error.HTTPError as error:
                return error.code
            except urllib.error.URLError as error:  # answered 413 and closed before the body was all sent
                if isinstance(error.reason, (BrokenPipeError, ConnectionResetError)):
                    return 413
                raise
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}).encode()
        auth = {"Authorization": "Bearer " + key}
        other = base.rsplit("/s/", 1)[0] + "/s/not-a-session/v1"
        codes = {
            "no_key": post(base + "/chat/completions", body, {}),
            "wrong_key": post(base + "/chat/completions", body, {"Authorization": "Bearer nope"}),
            "other_session": post(other + "/chat/completions", body, auth),
            "too_big": post(base + "/chat/completions", b"{" + b" " * (3 * 1024 * 1024) + b"}", auth),
            "not_json": post(base + "/chat/completions", b"{oops", auth),
            "bad_field": post(base + "/chat/completions", json.dumps({"messages": 3}).encode(), auth),
        }
        huge = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2="}],
                                              max_tokens=1_000_000)
        codes["huge_tokens"] = len(huge.choices[0].message.content) >= 0
        return json.dumps(codes)
''' % repr(SPEC))


@pytest.fixture(scope="module")
def taught(system_cfg, tmp_path_factory):
    return calling_model(system_cfg.model, tmp_path_factory.mktemp("calling") / "model")


@pytest.fixture(scope="module")
def worker(system_cfg, taught, tmp_path_factory):
    """One engine for the module, serving the model that calls tools (the other agents' sessions
    need no particular model: they check what was sampled, whatever it is)."""
    from rollout.worker import GenerationWorker

    folder = tmp_path_factory.mktemp("agents")
    (folder / "test_agents_plugin.py").write_text(AGENTS)
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        # Room for the tools section (each byte a token) and a call's turn.
        cfg = replace(system_cfg.rollout, agent="test_agents_plugin:chat", agent_concurrency=4, agent_timeout_s=20.0,
                      max_new_tokens=64, max_turns=3, max_model_len=512, kv_cache_gib=0.25, enforce_eager=True,
                      dtype="float32", endpoint_max_request_kb=1024)
        worker = GenerationWorker(taught[0], cfg, seed=0)
    finally:
        os.chdir(cwd)
    tap = EngineTap(worker.llm.llm_engine)
    worker.llm.llm_engine = tap
    yield worker, tap
    worker.agents.close()
    worker.endpoint.close()
    release_in_process_engine(worker)


def use_agent(worker, name: str, timeout_s: float = 20.0):
    from rollout.agents import AgentPool

    worker.agents.close()
    worker.agents = AgentPool(f"test_agents_plugin:{name}", 4, timeout_s, search_path=worker.agents.search_path)


def chains(tap, before: set):
    """The requests since `before`, grouped into each session's chain by prompt prefix."""
    new = [r for r in tap.prompts if r not in before]
    return [(tap.prompts[r], tap.sampled[r]) for r in new]


def test_trained_ids_are_exactly_the_sampled_ids_of_every_turn(worker):
    worker, tap = worker
    use_agent(worker, "chat")
    before = set(tap.prompts)
    rows = [(0, "12+34=", "46", {}), (1, "7*8=", "56", {})]
    *groups, report = worker.generate(*seeded(rows, [3, 4]), n=2, greedy=False)
    stats = report.stats
    assert stats["agent_errors"] == 0 and stats["agent_timeouts"] == 0, report.records.get("first_agent_error")
    assert stats["turns"] == 8 and stats["off_chain_calls"] == 0
    # A step samples at most one token of each request, and a session's turns follow one another.
    longest = max(sum(m) for g in groups for m in g.loss_masks)
    assert longest <= stats["engine_steps"] <= sum(sum(m) for g in groups for m in g.loss_masks)
    requests = chains(tap, before)
    assert len(requests) == 8
    for group in groups:
        for ids, mask, logprobs in zip(group.completion_ids, group.loss_masks, group.sampler_logprobs):
            sequence = group.prompt_ids + ids
            # The last request of the chain saw everything before its sample: the session's ids
            # are that prompt followed by exactly what was sampled for it.
            last = [(p, s) for p, s in requests if sequence[:len(p)] == p and len(p) > len(group.prompt_ids) + 1]
            assert last, "no turn of this session continued from its stored ids"
            # Two sessions of one prompt whose first turns came out alike send the same second
            # request: the session's ids must be one of those requests' prompt and sample.
            longest = max(len(p) for p, _ in last)
            matches = [s for p, s in last if len(p) == longest and sequence == p + s[0]]
            assert matches, "the session's ids are not a request's prompt followed by its sample"
            sampled = matches[0]
            # Every token with mask 1 was sampled, in order: the first turn's, then the second's.
            first = [(p, s) for p, s in requests if p == group.prompt_ids]
            trained = [t for t, m in zip(ids, mask) if m]
            assert any(trained == s[0] + sampled[0] for _, s in first)
            assert len(logprobs) == len(ids) and all(lp <= 0 for lp in logprobs)
            assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)


def test_a_template_that_is_not_append_only_is_detected_and_the_stored_ids_win(worker, taught):
    from transformers import AutoTokenizer

    worker, tap = worker
    use_agent(worker, "chat")
    # vLLM's tokenizer renders with deep copies of itself (a thread-safe pool), which a template
    # set on it never reaches: the endpoint renders with a tokenizer of the same folder instead.
    tokenizer = AutoTokenizer.from_pretrained(taught[0])
    # Drops earlier assistant turns' text, as templates that strip past reasoning do.
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "message['content']", "(('[past]' if message['role'] == 'assistant' and not loop.last else message['content']))")
    served = worker.endpoint.tokenizer
    worker.endpoint.tokenizer = tokenizer
    try:
        before = set(tap.prompts)
        *groups, report = worker.generate(*seeded([(0, "12+34=", "46", {})], [5]), n=2, greedy=False)
        stats = report.stats
    finally:
        worker.endpoint.tokenizer = served
    assert stats["template_drift"] == 2
    assert report.records["first_drift"]["turn"] == 1
    requests = chains(tap, before)
    for ids in groups[0].completion_ids:
        sequence = groups[0].prompt_ids + ids
        assert any(sequence == p + s[0] for p, s in requests)  # still one unbroken sampled chain
        assert "[past]" not in tokenizer.decode(sequence)


def test_async_agents_and_side_calls_are_served_but_not_trained(worker):
    worker, tap = worker
    use_agent(worker, "chat_async")
    *groups, report = worker.generate(*seeded([(0, "5+5=", "10", {})], [7]), n=3, greedy=False)
    stats = report.stats
    assert stats["agent_errors"] == 0
    assert stats["off_chain_calls"] == 3 and stats["turns"] == 3
    assert all(sum(m) == len(ids) for ids, m in zip(groups[0].completion_ids, groups[0].loss_masks))


def test_a_tool_call_round_trips_and_its_result_is_an_observation_of_the_session(worker, taught):
    """The model calls the tool; the reply carries it parsed (`tool_calls`, JSON arguments); the
    agent sends the result back as a `role: tool` message, and the next turn continues the
    session's stored ids with the template's rendering of that message, masked out of the loss."""
    import json

    worker, tap = worker
    _, first, call_turn, second, episode = taught
    use_agent(worker, "tools")
    before = set(tap.prompts)
    *groups, report = worker.generate(*seeded([(0, TOOL_PROMPT, "46", {})], [2]), n=2, greedy=True)
    stats = report.stats
    assert stats["agent_errors"] == 0 and stats["agent_timeouts"] == 0, report.records.get("first_agent_error")
    for completion in groups[0].completions:
        reply = json.loads(completion)
        assert reply["finish"] == "tool_calls"
        assert [c["name"] for c in reply["calls"]] == [CALL["name"]]
        assert json.loads(reply["calls"][0]["arguments"]) == CALL["arguments"]
        assert reply["final"] == "46"
    assert stats["turns"] == 4 and stats["tool_calls"] == 2
    assert stats["off_chain_calls"] == 0 and stats["template_drift"] == 0
    # The second turn's request is the stored ids (the prompt, the call as sampled) and the
    # template's rendering of the tool message only.
    requests = chains(tap, before)
    assert sorted(p for p, _ in requests) == sorted([first, first, second, second])
    assert all(s[0] == (call_turn if p == first else episode[len(second):]) for p, s in requests)
    observation = second[len(first) + len(call_turn):]
    assert "<tool_response>\n46\n</tool_response>" in worker.tokenizer.decode(observation)
    group = groups[0]
    assert group.prompt_ids == first
    answer = len(episode) - len(second)
    for ids, mask in zip(group.completion_ids, group.loss_masks):
        # The learner's sequence: the call as sampled, the tool's result (mask 0: no loss on
        # what the model did not write), the answer as sampled.
        assert first + ids == episode
        assert mask == [1] * len(call_turn) + [0] * len(observation) + [1] * answer
    assert stats["observation_tokens"] == 2 * len(observation)
    assert stats["completion_tokens"] == 2 * len(episode[len(first):])


def test_hostile_agents_end_only_their_own_episode(worker):
    import json

    worker, _ = worker
    use_agent(worker, "raises")
    *groups, report = worker.generate(*seeded([(0, "1+2=", "3", {})], [1]), n=2, greedy=False)
    stats = report.stats
    assert stats["agent_errors"] == 2 and groups[0].finish_reasons == ["error", "error"]
    assert all(sum(m) == 0 for m in groups[0].loss_masks)

    use_agent(worker, "hangs", timeout_s=3.0)
    *groups, report = worker.generate(*seeded([(0, "1+2=", "3", {})], [1]), n=2, greedy=False)
    stats = report.stats
    assert stats["agent_timeouts"] == 2

    use_agent(worker, "hostile")
    *groups, report = worker.generate(*seeded([(0, "1+2=", "3", {})], [1]), n=1, greedy=False)
    stats = report.stats
    assert stats["agent_errors"] == 0, report.records.get("first_agent_error")
    codes = json.loads(groups[0].completions[0])
    assert codes == {"no_key": 401, "wrong_key": 401, "other_session": 404, "too_big": 413, "not_json": 400,
                     "bad_field": 400, "huge_tokens": True}
    assert stats["agent_rejected"] == 6
    # The worker still serves a well-behaved agent afterwards.
    use_agent(worker, "chat")
    *groups, report = worker.generate(*seeded([(0, "1+2=", "3", {})], [1]), n=2, greedy=False)
    stats = report.stats
    assert stats["agent_errors"] == 0 and stats["turns"] == 4

