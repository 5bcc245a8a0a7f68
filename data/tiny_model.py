"""The built-in model: a small Qwen2 causal LM with a character-level tokenizer.

It is saved as an ordinary Hugging Face folder, so `transformers` (the learner) and vLLM (the
rollout) load it exactly like any hub model. It is built once per architecture and reused: the
folder name carries a hash of everything that shapes it.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

# A byte-level tokenizer with no merges: every byte is one token, as in Qwen2's own byte-level
# BPE with an empty merge list. `transformers` always loads a qwen2 model's tokenizer as
# Qwen2Tokenizer, so the built-in one *is* a Qwen2Tokenizer and loads the same everywhere.
# The R1 layout tags are single tokens: it keeps completions short for a tiny model, and they are
# ordinary (not "special") tokens so that vLLM's detokenizer keeps them in the text.
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
# The tag format's tool call and result (common/tool_formats.py), single tokens for the same
# reason; only in the model built for runs with tools in that format (adding them to every
# build changed what the default job learns: the default model stays as it was).
TOOL_TAGS = ["<tool>", "</tool>", "<result>", "</result>"]
SPECIALS = ["<pad>", "</s>"]
# A ChatML-like chat format, so that the chat path (apply_chat_template, an end-of-turn token that
# stops generation) runs for real on the built-in model. `<|im_end|>` is special: the detokenizer
# drops it from the text, as with Qwen's own.
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '" + TURN_START + "' + message['role'] + '\n' + message['content'] + '" + TURN_END + "\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '" + TURN_START + "assistant\n' }}{%- endif %}"
)
# The model built for agent runs (rollout.agent) also speaks Qwen2.5's tool-calling format: the
# tools listed in the system turn inside <tools></tools> (one JSON schema a line, without Qwen's
# paragraph of instructions, which a byte-level model would pay for in every prompt), calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call> in the assistant's turn, results as
# <tool_response>...</tool_response> in a user turn. Its tags are single ordinary tokens, as the
# R1 tags are. Without tools and tool messages it renders exactly as CHAT_TEMPLATE.
CHAT_TOOL_TAGS = ["<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# The fixed text of a call and of the turn headers, single ordinary tokens too: byte by byte, the
# call's JSON and the assistant header put a prompt's operand 76 tokens before the place where the
# model copies it into the call, and the built-in model then miscopies every operand; with these,
# about 20, as in the tag format (bench/results/agent_task.md). The pieces cover the worked
# example's calculator call; other names and values stay bytes. The text is unchanged (the
# tokens decode to it), so vLLM's Hermes parser and the template's tojson read and write the same.
CHAT_TOOL_PIECES = ['\n{"name": "', '", "arguments": {"', '": "', '"}}\n', "calculator", "expression",
                    "system\n", "user\n", "assistant\n"]
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '" + TURN_START + "system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n' }}{%- endif %}"
    "{{- '<tools>' }}{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>" + TURN_END + "\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '" + TURN_START + "user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '" + TURN_END + "\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '" + TURN_START + "assistant\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\n' }}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '" + TURN_END + "\n' }}"
    "{%- else %}"
    "{{- '" + TURN_START + "' + message['role'] + '\n' + message['content'] + '" + TURN_END + "\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '" + TURN_START + "assistant\n' }}{%- endif %}"
)


def build_tokenizer(tool_tags: bool = False, chat_tools: bool = False):
    from tokenizers import AddedToken, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIALS + alphabet)}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token="<pad>", eos_token="</s>", pad_token="<pad>",
        model_max_length=4096,
    )
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in _tags(tool_tags, chat_tools)])
    tokenizer.add_special_tokens({"additional_special_tokens": [
        AddedToken(t, special=True, normalized=False) for t in (TURN_START, TURN_END)]})
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE if chat_tools else CHAT_TEMPLATE
    return tokenizer


def _tags(tool_tags: bool, chat_tools: bool) -> list:
    return TAGS + (TOOL_TAGS if tool_tags else []) + (CHAT_TOOL_TAGS + CHAT_TOOL_PIECES if chat_tools else [])


def variant(rollout_cfg) -> dict:
    """Which built-in model a run uses (the keywords of tiny_model_dir and build_tiny_model): the
    tag tool format's tags as tokens for tag-format episodes, the chat template with tools for
    agents (rollout.agent)."""
    return {"tool_tags": bool(rollout_cfg.episodes and rollout_cfg.tool_format == "tag"),
            "chat_tools": rollout_cfg.agent is not None}


def _vocab_size(tokenizer) -> int:
    return (len(tokenizer) + 15) // 16 * 16  # padded for friendlier kernels; extra rows unused


def tiny_model_dir(model_cfg, seed: int, tool_tags: bool = False, chat_tools: bool = False) -> Path:
    spec = {
        "hidden_size": model_cfg.hidden_size, "num_layers": model_cfg.num_layers,
        "num_heads": model_cfg.num_heads, "intermediate_size": model_cfg.intermediate_size,
        "max_position_embeddings": model_cfg.max_position_embeddings,
        "tie_word_embeddings": model_cfg.tie_word_embeddings, "tags": _tags(tool_tags, chat_tools), "seed": seed,
        "chat": TOOL_CHAT_TEMPLATE if chat_tools else CHAT_TEMPLATE,
    }
    if model_cfg.vocab_size:  # only when set: folders built before the option keep their names
        spec["vocab_size"] = model_cfg.vocab_size
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return Path(os.path.expanduser(model_cfg.cache_dir)) / f"tiny-qwen2-{digest}"


def build_tiny_model(model_cfg, seed: int = 0, tool_tags: bool = False, chat_tools: bool = False) -> str:
    """Build (once) and return the folder of the built-in model (`tool_tags`: the tag tool
    format's tags as tokens; `chat_tools`: the variant for agents, CHAT_TOOL_TAGS and its template)."""
    folder = tiny_model_dir(model_cfg, seed, tool_tags, chat_tools)
    if (folder / "config.json").exists():
        return str(folder)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a one-time build needs no progress bar in the CLI's output

    tokenizer = build_tokenizer(tool_tags, chat_tools)
    config = Qwen2Config(
        vocab_size=max(model_cfg.vocab_size, _vocab_size(tokenizer)),
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        num_key_value_heads=model_cfg.num_heads,
        max_position_embeddings=model_cfg.max_position_embeddings,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        rope_theta=10000.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # Generation stops at the end of a chat turn as well as at EOS (vLLM reads this list).
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(TURN_END)]
    # Build in a temporary folder and rename: two processes building at once never see half a model.
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process won the race; its folder is as good as ours
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)
