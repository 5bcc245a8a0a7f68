"""Warm-up targets that use a tool: the model's turns are trained on, the tool's result is not.

A trace is a tuple of (text, trained) segments. The learner tokenizes each segment on its own,
as an episode does (a model turn's ids, then the observation's ids), and leaves the untrained
ones out of the loss: the warm-up teaches the model to call the tool and read its result, never
to write the result itself.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List, Sequence, Tuple

from common.calculator import calculator
from common.problem import Problem

Trace = Tuple[Tuple[str, bool], ...]


def calculator_trace(fmt, expression: str, answer: str) -> Trace:
    """`<think>` + a calculator call, its result, `</think><answer>...</answer>`."""
    arguments = expression if fmt.name == "tag" else {"expression": expression}
    return (("<think>" + fmt.call_text("calculator", arguments), True),
            (fmt.observation_text(calculator(expression)), False),
            (f"</think><answer>{answer}</answer>", True))


def with_tool_traces(problems: Sequence[Problem], fmt, tools: Sequence[str]) -> List[Problem]:
    """Rows that name an `expression` (the built-in multiplication task) get a calculator trace
    as their warm-up target when the run has the calculator; other rows are unchanged."""
    if "calculator" not in tools:
        return list(problems)
    return [replace(p, solution=calculator_trace(fmt, p.fields["expression"], p.answer))
            if p.fields.get("expression") else p for p in problems]


def agent_calculator_trace(tokenizer, messages: List[dict], tools: List[dict], expression: str, answer: str,
                           turn_ends: Sequence[str] = ()) -> Trace:
    """The same episode as an agent writes it through the endpoint, in the chat template's own
    tool-calling format: the assistant's turn with a calculator call (trained, up to and with its
    end-of-turn token, the first of `turn_ends` found), the template's tool turn with the result
    and the next assistant header (not trained: the endpoint appends it), then `<answer>...</answer>` (trained). Each piece is
    cut from the template's renderings of the growing conversation, so it is exactly what the
    endpoint puts in the session (rollout/sessions.py)."""
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                             "arguments": {"expression": expression}}}]}
    result = {"role": "tool", "content": calculator(expression)}

    def text(conversation: List[dict], generation: bool) -> str:
        return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                             add_generation_prompt=generation)

    prompt, called, answered = text(messages, True), text(messages + [call], False), text(messages + [call, result],
                                                                                         True)
    if not (called.startswith(prompt) and answered.startswith(called[:len(prompt)])):
        raise ValueError("the chat template does not render a tool call after the prompt it rendered")
    turn = called[len(prompt):]
    ends = [token for token in turn_ends if token in turn]
    if ends:
        turn = turn[:turn.rfind(ends[0]) + len(ends[0])]
    if not answered.startswith(prompt + turn):
        raise ValueError("the chat template renders a tool result that changes the call before it")
    return ((turn, True), (answered[len(prompt) + len(turn):], False), (f"<answer>{answer}</answer>", True))
