"""Warm-up targets that use a tool: the model's turns are trained on, the tool's result is not.

A trace is a tuple of (text, trained) segments. The learner tokenizes each segment on its own,
as an episode does (a model turn's ids, then the observation's ids), and leaves the untrained
ones out of the loss: the warm-up teaches the model to call the tool and read its result, never
to write the result itself.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List, Sequence, Tuple

from rollout.datasets import Problem
from rollout.tools import calculator

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
