"""How a tool call looks in the model's text, and how its result is written back (`rollout.tool_format`).

- `tag` (for the built-in model and base models): the model writes
  `<tool>calculator: 123*456</tool>` and reads `<result>56088</result>`.
- `hermes` (for instruct models whose chat template knows tools, as Qwen2.5's does): the model
  writes `<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>`;
  the result goes back as a message in the `tool` role, rendered by the tokenizer's own chat
  template (its end of turn, the tool turn, and the start of the next assistant turn).

Generation stops at the call's closing tag (a stop string, so any tokenizer works); the text of
the model's turn is parsed only to find the call. What the learner trains on are the token ids
the sampler produced, never this text tokenized again.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

FORMATS = ("tag", "hermes")

TOOL_SCHEMAS: Dict[str, Dict[str, Any]] = {
    "calculator": {"description": "Exact arithmetic on integers and fractions: + - * / // % ** and parentheses.",
                   "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                  "required": ["expression"]}},
    "python": {"description": "Runs Python 3 code in a sandbox and returns what it prints.",
               "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}},
}


class FormatError(ValueError):
    """The tokenizer cannot express this tool format; one line."""


@dataclass(frozen=True)
class ParsedCall:
    name: Optional[str]
    arguments: Union[str, Mapping[str, Any]]
    error: Optional[str] = None
    """Why the call is malformed (then it is not run; the model sees this as the observation)."""


class TagFormat:
    name = "tag"
    open, close = "<tool>", "</tool>"
    result_open, result_close = "<result>", "</result>"

    def __init__(self, tokenizer=None):
        self.stop = [self.close]

    def parse(self, turn: str) -> ParsedCall:
        """The call that ends `turn` (the text of a model turn stopped at `</tool>`)."""
        body = turn[: turn.rfind(self.close)] if self.close in turn else turn
        start = body.rfind(self.open)
        if start < 0:
            return ParsedCall(None, "", f"no {self.open} before {self.close}")
        name, sep, arguments = body[start + len(self.open):].partition(":")
        if not sep or not name.strip():
            return ParsedCall(None, "", f"write {self.open}NAME: ARGUMENTS{self.close}")
        return ParsedCall(name.strip(), arguments.strip())

    def call_text(self, name: str, arguments: str) -> str:
        return f"{self.open}{name}: {arguments}{self.close}"

    def observation_text(self, text: str) -> str:
        return f"{self.result_open}{text}{self.result_close}"


class HermesFormat:
    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"

    def __init__(self, tokenizer):
        self.stop = [self.close]
        self.before, self.after = _tool_turn(tokenizer)

    def parse(self, turn: str) -> ParsedCall:
        body = turn[: turn.rfind(self.close)] if self.close in turn else turn
        start = body.rfind(self.open)
        if start < 0:
            return ParsedCall(None, {}, f"no {self.open} before {self.close}")
        try:
            call = json.loads(body[start + len(self.open):])
        except ValueError as exc:
            return ParsedCall(None, {}, f"the call is not JSON ({exc})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ParsedCall(None, {}, 'write {"name": NAME, "arguments": {...}}')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return ParsedCall(None, {}, "the arguments are not a JSON object")
        if not isinstance(arguments, dict):
            return ParsedCall(None, {}, "the arguments are not a JSON object")
        return ParsedCall(call["name"], arguments)

    def call_text(self, name: str, arguments: Mapping[str, Any]) -> str:
        return f"{self.open}\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n{self.close}"

    def observation_text(self, text: str) -> str:
        return self.before + text + self.after


_MARK, _RESULT = "ASSISTANT-TEXT-7f3a", "TOOL-RESULT-7f3a"


def _tool_turn(tokenizer) -> Tuple[str, str]:
    """The text the chat template puts between an assistant turn's last character and a tool
    result (`before`), and after the result up to the next assistant turn (`after`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise FormatError("rollout.tool_format=hermes needs a tokenizer with a chat template; use tool_format=tag")
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
    try:
        text = tokenizer.apply_chat_template(messages + [{"role": "tool", "content": _RESULT}], tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:
        raise FormatError(f"rollout.tool_format=hermes: the chat template cannot render a tool message "
                          f"({type(exc).__name__}: {str(exc)[:120]}); use tool_format=tag") from None
    if _MARK not in text or _RESULT not in text or text.index(_RESULT) < text.index(_MARK):
        raise FormatError("rollout.tool_format=hermes: the chat template drops tool messages; use tool_format=tag")
    between = text[text.index(_MARK) + len(_MARK):]
    before, _, after = between.partition(_RESULT)
    return before, after


def make_format(name: str, tokenizer):
    if name == "tag":
        fmt = TagFormat(tokenizer)
    elif name == "hermes":
        fmt = HermesFormat(tokenizer)
    else:
        raise FormatError(f"rollout.tool_format must be one of {', '.join(FORMATS)} (got '{name}')")
    if tokenizer is not None:
        check_expressible(fmt, tokenizer)
    return fmt


def check_expressible(fmt, tokenizer) -> None:
    """The call and the observation survive tokenize -> decode (a tokenizer without these
    characters would turn them into unknown tokens and the model could never write a call)."""
    sample = fmt.call_text("calculator", "1+2" if fmt.name == "tag" else {"expression": "1+2"})
    for text in (sample, fmt.observation_text("3")):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        back = tokenizer.decode(ids, skip_special_tokens=False)
        if back != text:
            raise FormatError(f"rollout.tool_format={fmt.name}: the tokenizer cannot express {text!r} "
                              f"(it comes back as {back!r})")


def tool_schemas(names: List[str], custom_docs: Mapping[str, str]) -> List[Dict[str, Any]]:
    """The tools as the `tools=` argument of a chat template (JSON schema per function)."""
    out = []
    for name in names:
        schema = TOOL_SCHEMAS.get(name) or {"description": custom_docs.get(name, ""),
                                             "parameters": {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": {"name": name, **schema}})
    return out
