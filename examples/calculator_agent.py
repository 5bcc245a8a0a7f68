"""An agent for the built-in multiplication task, written only against the `openai` client.

It offers the model a calculator as a JSON function tool (`tools=[{"type": "function", ...}]`),
runs every call the model makes (`tool_calls` in the reply), sends each result back as a
`role: tool` message and returns the model's last reply, which the verifiers score:

    grpo train data=mul_agent        # conf/data/mul_agent.yaml names this agent

The trainer gives it an `openai.OpenAI` already pointed at its own session of a generation
worker's endpoint; nothing here knows about the trainer. `run.tools` tells the trainer which
tools the agent offers, so that the supervised warm-up renders its prompts exactly as the
endpoint renders this agent's requests (docs/tools.md, "Your own agent").
"""
from __future__ import annotations

import ast
import json
import operator

TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Exact integer arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]
MAX_CALLS = 3
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """`+ - *` of integers and parentheses, parsed into a syntax tree (never `eval`ed)."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if max(abs(left), abs(right)) > 10 ** 100:
                raise ValueError("numbers too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError("only + - * of integers")

    if len(expression) > 200:
        return "error: expression too long"
    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError) as exc:
        return f"error: {exc}"


def _result(call) -> str:
    if call.function.name != "calculator":
        return f"error: no tool named {call.function.name!r}"
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError:
        return "error: the arguments are not JSON"
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    return calculator(expression) if isinstance(expression, str) else "error: no expression"


def _answered(messages: list, message) -> list:
    """The conversation with the model's reply (its tool calls) and each call's result."""
    calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for c in message.tool_calls]
    return messages + [{"role": "assistant", "content": message.content, "tool_calls": calls}] + [
        {"role": "tool", "tool_call_id": c.id, "content": _result(c)} for c in message.tool_calls]


def run(client, row, index):
    """One episode: ask, answer each tool call, until the model replies without one."""
    messages = list(row.get("messages") or [{"role": "user", "content": row["prompt"]}])
    for _ in range(MAX_CALLS + 1):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=48)
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content
        messages = _answered(messages, message)
    return None  # still calling after MAX_CALLS: the verifiers read the transcript


async def run_async(client, row, index):
    """`run` for an `openai.AsyncOpenAI` client: the trainer runs several such episodes at once in
    each agent process (rollout.agent_episodes_per_process)."""
    messages = list(row.get("messages") or [{"role": "user", "content": row["prompt"]}])
    for _ in range(MAX_CALLS + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=48)
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content
        messages = _answered(messages, message)
    return None


run.tools = run_async.tools = TOOLS
