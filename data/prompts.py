"""How a dataset row becomes the text the model sees, and which tokens end its turn.

Three settings, all under `data.`:
- `prompt_template`: a Python format string over the row's fields (`{question}`, `{prompt}`:
  the prompt field whatever its name; `{{`/`}}` for literal braces). None: the prompt as is.
- `system_prompt`: a system message (with a chat template) or a paragraph before the prompt.
- `chat_template`: `true` applies the tokenizer's chat template (the same `apply_chat_template`
  as `transformers`, with the generation prompt added), `false` never; `auto` applies it when
  the tokenizer has one and the rows are conversational, or the model's name says it is an
  instruct/chat model (`instruct`, `chat`, `-it`), or a system prompt is set.

Conversational rows (a list of `{role, content}` messages in the prompt field) keep their
messages; the template, if any, formats the last user message.

Light: imports `transformers` only to load the tokenizer. Errors are `DataError`s of one line.
"""
from __future__ import annotations

import json
import re
import string
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from common.problem import Problem
from data.datasets import DataError

CHAT_MODEL_NAME = re.compile(r"instruct|chat|-it\b", re.IGNORECASE)
# End-of-turn tokens of the common chat formats (ChatML/Qwen, Llama 3, Gemma, Phi-3).
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def template_fields(template: str) -> List[str]:
    """The field names a format string uses; a malformed template is a DataError."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise DataError(f"data.prompt_template: {exc} (write literal braces as {{{{ and }}}})") from exc
    for name in names:
        if not name.isidentifier():
            raise DataError(f"data.prompt_template: '{{{name}}}' is not a field name (literal braces: {{{{ }}}})")
    return names


def fill(template: Optional[str], prompt: str, fields: Dict[str, Any], where: str, prompt_key: str = "prompt") -> str:
    if template is None:
        return prompt
    values = {**fields, "prompt": prompt, prompt_key: prompt}
    for name in template_fields(template):
        if name not in values:
            known = ", ".join(sorted(values))
            raise DataError(f"data.prompt_template names field '{name}', which {where} lacks (fields: {known})")
    return template.format(**values)


def use_chat_template(setting: str, has_template: bool, conversational: bool, system_prompt: Optional[str],
                      model_name: str) -> bool:
    setting = str(setting).lower()
    if setting == "true":
        if not has_template:
            raise DataError(f"data.chat_template=true, but the tokenizer of {model_name} has no chat template")
        return True
    if setting == "false":
        if conversational:
            raise DataError("data.chat_template=false, but the rows are conversations (a list of messages): "
                            "they need a chat template")
        return False
    if conversational and not has_template:
        raise DataError(f"the rows are conversations (a list of messages), but the tokenizer of {model_name} "
                        "has no chat template")
    return has_template and (conversational or bool(system_prompt) or bool(CHAT_MODEL_NAME.search(model_name)))


def render(problem: Problem, where: str, template: Optional[str], system_prompt: Optional[str], chat: bool,
           tokenizer, prompt_key: str = "prompt", tools: Optional[list] = None) -> str:
    """The text the model sees for one row."""
    messages = _messages(problem, where, template, system_prompt, prompt_key)
    if not chat:
        return "\n\n".join(content for _, content in messages)
    extra = {"tools": tools} if tools else {}  # the template lists them in its system turn
    return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                         add_generation_prompt=True, **extra)


def render_problems(problems: Sequence[Problem], label: str, template: Optional[str],
                    system_prompt: Optional[str], chat: bool, tokenizer, prompt_key: str = "prompt",
                    tools: Optional[list] = None) -> List[Problem]:
    return [replace(p, prompt=render(p, f"{label} row {i}", template, system_prompt, chat, tokenizer, prompt_key,
                                     tools))
            for i, p in enumerate(problems, start=1)]


def stop_token_ids(model_path: str, tokenizer, chat: bool) -> List[int]:
    """Token ids that end a completion: the tokenizer's EOS, the model's own list in
    `generation_config.json` (instruct models list their end-of-turn token there) and, with a
    chat template, the end-of-turn token of its format."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    config = Path(model_path) / "generation_config.json"
    if config.exists():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    if chat:
        vocab = tokenizer.get_vocab()
        ids += [vocab[token] for token in END_OF_TURN if token in vocab]
    return sorted(set(ids))


def load_tokenizer(model_path: str, built_in: bool):
    """The model's tokenizer. The built-in model's folder is this project's own (its builder made
    it for this config), written by `save_pretrained`, which records the tokenizer's class in
    tokenizer_config.json: that class is imported directly instead of through AutoTokenizer
    (several times dearer in a fresh process: its module imports transformers' model registry, and with it
    torch, torch._dynamo and torch.distributed.tensor), which the driver would pay before Ray
    starts. Any other folder, or one whose class transformers does not export, goes through
    AutoTokenizer and all its rules (remote code, per-model overrides)."""
    if built_in:
        import transformers

        name = json.loads((Path(model_path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if cls is not None:
            return cls.from_pretrained(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def prepare(data_cfg, model_path: str, model_name: str, splits: Dict[str, Sequence[Problem]], rollout_cfg=None,
            built_in: bool = False) -> Tuple[Dict[str, List[Problem]], Dict[str, Any]]:
    """Render every split; returns the rendered splits and what a run prints and saves: the
    first training row as the model sees it, whether the chat template was used, the stops.
    With tools (`rollout_cfg.episodes`) the tool format is checked against the tokenizer, a
    chat template lists the tools, and warm-up targets become tool-using traces. `built_in`: the
    folder is the built-in model's (see load_tokenizer)."""
    tokenizer = load_tokenizer(model_path, built_in)
    if rollout_cfg is not None and rollout_cfg.agent is not None:
        return prepare_for_agent(data_cfg, model_path, model_name, splits, rollout_cfg, tokenizer)
    conversational = any(p.messages is not None for rows in splits.values() for p in rows)
    chat = use_chat_template(data_cfg.chat_template, bool(getattr(tokenizer, "chat_template", None)),
                             conversational, data_cfg.system_prompt, model_name)
    fmt, schemas = _tool_setup(rollout_cfg, tokenizer, chat)
    rendered = {name: render_problems(rows, name, data_cfg.prompt_template, data_cfg.system_prompt, chat, tokenizer,
                                      data_cfg.prompt_key, schemas)
                for name, rows in splits.items()}
    if fmt is not None:
        from data.traces import with_tool_traces

        rendered = {name: with_tool_traces(rows, fmt, rollout_cfg.tools) for name, rows in rendered.items()}
    first = next((rows[0].prompt for rows in rendered.values() if rows), "")
    stops = stop_token_ids(model_path, tokenizer, chat)
    longest = max(((len(tokenizer(p.prompt)["input_ids"]), f"{name} row {i}")
                   for name, rows in rendered.items() for i, p in enumerate(rows, start=1)), default=(0, ""))
    vocab = tokenizer.get_vocab()
    turn_end = [vocab[t] for t in END_OF_TURN if t in vocab][:1] if chat else []
    return rendered, {"chat_template": chat, "first_prompt": first, "stop_token_ids": stops,
                      "turn_end_ids": turn_end or None,
                      "stop_tokens": tokenizer.convert_ids_to_tokens(stops), "longest_prompt": longest,
                      "tools": _tools_note(rollout_cfg, fmt)}


def prepare_for_agent(data_cfg, model_path: str, model_name: str, splits: Dict[str, Sequence[Problem]],
                      rollout_cfg, tokenizer) -> Tuple[Dict[str, List[Problem]], Dict[str, Any]]:
    """`prepare` for an agent run. The agent gets each row's conversation (row field `messages`:
    the system prompt and the prompt template applied; `prompt` is its last user message) and the
    endpoint renders what the agent sends with the chat template, so the model needs one. The
    warm-up trains after that same rendering, with the tools the agent function lists in its
    `tools` attribute (what it sends as `tools=`); with the calculator among them, the built-in
    multiplication rows get warm-up traces that call it in the template's format."""
    from common.plugins import load_function
    from data.traces import agent_calculator_trace

    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"rollout.agent: the tokenizer of {model_name} has no chat template, which the endpoint "
                        "renders the agent's messages with")
    tools = list(getattr(load_function(rollout_cfg.agent, [str(Path.cwd())]), "tools", None) or [])
    calculator = any(t.get("function", {}).get("name") == "calculator" for t in tools if isinstance(t, dict))
    rendered: Dict[str, List[Problem]] = {}
    for name, rows in splits.items():
        out = []
        for i, p in enumerate(rows, start=1):
            messages = [{"role": r, "content": c} for r, c in _messages(
                p, f"{name} row {i}", data_cfg.prompt_template, data_cfg.system_prompt, data_cfg.prompt_key)]
            shown = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True)
            solution = p.solution
            if calculator and p.fields.get("expression"):
                solution = agent_calculator_trace(tokenizer, messages, tools, p.fields["expression"], p.answer,
                                                  END_OF_TURN)
            user = next(m["content"] for m in reversed(messages) if m["role"] == "user")
            out.append(replace(p, prompt=user, solution=solution, warmup_prompt=shown,
                               fields={**p.fields, "messages": messages}))
        rendered[name] = out
    stops = stop_token_ids(model_path, tokenizer, True)
    vocab = tokenizer.get_vocab()
    longest = max(((len(tokenizer(p.warmup_prompt)["input_ids"]), f"{name} row {i}")
                   for name, rows in rendered.items() for i, p in enumerate(rows, start=1)), default=(0, ""))
    first = next((rows[0].warmup_prompt for rows in rendered.values() if rows), "")
    turn_end = [vocab[t] for t in END_OF_TURN if t in vocab][:1]
    note = f"agent: {rollout_cfg.agent}" + (f", tools {', '.join(_tool_names(tools))}" if tools else "")
    return rendered, {"chat_template": True, "first_prompt": first, "stop_token_ids": stops,
                      "turn_end_ids": turn_end or None, "stop_tokens": tokenizer.convert_ids_to_tokens(stops),
                      "longest_prompt": longest, "tools": note}


def _messages(problem: Problem, where: str, template: Optional[str], system_prompt: Optional[str],
              prompt_key: str) -> List[Tuple[str, str]]:
    """A row's (role, content) messages: the prompt template on the last user message, the
    system prompt first."""
    if problem.messages is not None:
        messages = list(problem.messages)
        last_user = max(i for i, (role, _) in enumerate(messages) if role == "user")
        messages[last_user] = ("user", fill(template, messages[last_user][1], problem.fields, where, prompt_key))
    else:
        messages = [("user", fill(template, problem.prompt, problem.fields, where, prompt_key))]
    if system_prompt and not any(role == "system" for role, _ in messages):
        messages.insert(0, ("system", system_prompt))
    return messages


def _tool_names(tools: List[dict]) -> List[str]:
    return [str(t.get("function", {}).get("name", "?")) for t in tools if isinstance(t, dict)]


def _tools_note(rollout_cfg, fmt) -> Optional[str]:
    """How episodes run, for the start of the run's output (None without tools)."""
    if fmt is None:
        return None
    names = ", ".join(list(rollout_cfg.tools) + list(rollout_cfg.custom_tools))
    example = fmt.call_text("NAME", "ARGUMENTS" if fmt.name == "tag" else {"...": "..."})
    return (f"tools: {names}; a call is written {example}; up to {rollout_cfg.max_turns} turns and "
            f"{rollout_cfg.completion_budget} tokens per episode")


def _tool_setup(rollout_cfg, tokenizer, chat: bool):
    """The tool format for this tokenizer (a DataError if it cannot express it) and, for the
    hermes format under a chat template, the tools' schemas for the template."""
    if rollout_cfg is None or not rollout_cfg.episodes:
        return None, None
    from common.tool_formats import FormatError, make_format, tool_schemas

    try:
        fmt = make_format(rollout_cfg.tool_format, tokenizer)
    except FormatError as error:
        raise DataError(str(error)) from None
    if fmt.name != "hermes" or not chat:
        return fmt, None
    from common.plugins import load_function

    docs = {name: (load_function(path, [str(Path.cwd())]).__doc__ or "").strip()
            for name, path in rollout_cfg.custom_tools.items()}
    return fmt, tool_schemas(list(rollout_cfg.tools) + list(rollout_cfg.custom_tools), docs)
