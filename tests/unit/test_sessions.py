"""How a session plans each turn (rollout/sessions.py), over small templates written here: the
continuation of the stored ids, the renderings it costs, and drift when a template is not
append-only."""
from __future__ import annotations

from rollout.sessions import SessionStore, plan_turn, record_turn

ROLES = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
END, SEP = 9, 8
GEN = ROLES["assistant"]  # the generation prompt opens an assistant turn


def template(drop_past_assistant: bool = False):
    """ids: per message its role, its content as character codes, END, SEP; then GEN. With
    `drop_past_assistant`, assistant turns before the last message render empty (as templates
    that strip earlier reasoning do). Counts its calls."""
    calls = []

    def render(messages, tools, generation):
        calls.append(len(messages))
        ids = []
        for i, m in enumerate(messages):
            text = m.get("content") or ""
            if drop_past_assistant and m["role"] == "assistant" and i < len(messages) - 1:
                text = ""
            ids += [ROLES[m["role"]], *(100 + ord(c) for c in text), END, SEP]
        return ids + ([GEN] if generation else [])

    return render, calls


def sample(session, render, messages, reply: str):
    """One trained turn: plan it, 'sample' `reply` and END as the model's ids, record it."""
    turn = plan_turn(session, messages, None, 1, render)
    sampled = [100 + ord(c) for c in reply] + [END]
    record_turn(session, turn, messages, sampled, [-0.5] * len(sampled), reply, lambda ids: "")
    return turn


def test_an_append_only_template_continues_the_stored_ids_with_one_rendering():
    render, calls = template()
    session = SessionStore().open(max_tokens=100)
    first = [{"role": "user", "content": "hi"}]
    sample(session, render, first, "ok")
    stored = session.prompt_ids + session.ids
    second = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    calls.clear()
    turn = sample(session, render, second, "done")
    assert calls == [3]  # the whole conversation, once
    assert turn.trained and turn.prompt_ids[:len(stored)] == stored
    assert turn.extension == [SEP, ROLES["user"], 100 + ord("g"), 100 + ord("o"), END, SEP, GEN]
    assert session.drift_turns == 0
    assert session.mask == [1, 1, 1] + [0] * len(turn.extension) + [1] * 5


def test_a_template_that_drops_past_turns_is_counted_and_the_stored_ids_win():
    render, _ = template(drop_past_assistant=True)
    session = SessionStore().open(max_tokens=100)
    first = [{"role": "user", "content": "hi"}]
    sample(session, render, first, "ok")
    stored = session.prompt_ids + session.ids
    second = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    turn = sample(session, render, second, "done")
    assert session.drift_turns == 1 and session.drift.turn == 1
    assert turn.prompt_ids[:len(stored)] == stored  # what was sampled, not the emptied turn
    assert turn.extension[-1] == GEN and ROLES["user"] in turn.extension


def test_a_call_off_the_chain_is_served_from_its_own_rendering_and_not_trained():
    render, _ = template()
    session = SessionStore().open(max_tokens=100)
    first = [{"role": "user", "content": "hi"}]
    sample(session, render, first, "ok")
    edited = [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "ok"},
              {"role": "user", "content": "go"}]
    turn = plan_turn(session, edited, None, 1, render)
    assert not turn.trained and turn.prompt_ids == render(edited, None, True)
    assert not plan_turn(session, first, None, 2, render).trained  # n > 1
