"""The configuration reference page, generated from the typed schema (common/config.py) and the
config groups in conf/: every key with its type, default, allowed values and docstring.

    python -m common.config_reference            # rewrites docs/reference/config.md
    python -m common.config_reference --check    # exit 1 if the page is stale

The docstrings are the string literals under each field of a section (read with `ast`: Python
keeps no attribute docstrings at run time). A unit test (tests/unit/test_docs.py) fails when the
committed page differs from a fresh generation, so a new key reaches the page with its docstring.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import sys
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import yaml

from common import config as schema

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "config.md"
CONF = ROOT / "conf"
REGENERATE = "python -m common.config_reference"

# Defaults that are decided at start from the device or the machine, not fixed in the schema.
DEVICE_DEPENDENT = {
    "rollout.dtype": "`auto`: `float32` when the generation workers have no GPU (faster than bfloat16 on "
                     "vLLM's CPU build), `bfloat16` when `rollout.num_gpus_per_worker` > 0.",
    "rollout.enforce_eager": "unset: eager (no CUDA graphs) on CPUs, CUDA graphs on GPUs.",
    "rollout.num_threads": "`0`: torch threads per engine set at start from the node's CPUs and the mode "
                           "(printed at start: `CPU threads: ...`).",
    "learner.num_threads": "`0`: torch threads per rank set at start from the node's CPUs (sync mode: the "
                           "phases take turns and share every CPU; async mode: ranks and engines split them).",
    "learner.backend": "`auto`: NCCL when the learner ranks have GPUs, gloo without.",
    "sync.transport": "`auto`: `shm` when the learner is on CPUs and every engine is on learner rank 0's node "
                      "with room in /dev/shm for two copies of the model, `broadcast` otherwise (NCCL on GPUs).",
    "data.chat_template": "`auto`: the tokenizer's chat template when it has one and the rows are "
                          "conversations, a system prompt is set, or the model's name says instruct/chat/-it.",
    "learner.num_gpus_per_rank": "the learner trains in bf16 when its ranks have GPUs, in fp32 on CPUs.",
}


def field_docs(cls: type) -> Dict[str, str]:
    """Each field's docstring: the string literal right after its annotated assignment."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _default(f) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None  # type: ignore[misc]


def _value(value: Any) -> str:
    if value is None:
        return "unset"
    if value == "???":
        return "required"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)) and not value:
        return "[]" if isinstance(value, list) else "{}"
    return str(value)


def rows(cls: type = schema.Config, prefix: str = "") -> Iterator[Tuple[str, str, str, str, str]]:
    """(key, type, default, allowed values, docstring) for every leaf key, sections in order."""
    docs = field_docs(cls)
    for f in fields(cls):
        default, key = _default(f), f"{prefix}{f.name}"
        if is_dataclass(default):
            yield from rows(type(default), key + ".")
            continue
        choices = f.metadata.get("choices")
        allowed = ", ".join(f"`{_value(c)}`" for c in choices) if choices else ""
        yield key, str(f.type), _value(default), allowed, docs.get(f.name, "")


def _cell(text: str) -> str:
    """Text for a table cell: pipes escaped, and angle brackets outside code spans (else Markdown
    reads `<hub name>` as an HTML tag and drops it)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;") for i, p in enumerate(parts))


def section_table(section: str, entries: List[Tuple[str, str, str, str, str]]) -> List[str]:
    cls = type(getattr(schema.Config(), section))
    doc = (cls.__dict__.get("__doc__") or "").split("\n\n")[0]
    lines = [f"## `{section}`", ""]
    if doc and not doc.startswith(cls.__name__ + "("):  # a dataclass's generated signature is no docstring
        lines += [" ".join(doc.split()), ""]
    lines += ["| key and type | default | what it does |", "| --- | --- | --- |"]
    for key, kind, default, allowed, text in entries:
        note = f" **Allowed:** {allowed}." if allowed else ""
        note += f" **Device-dependent:** {DEVICE_DEPENDENT[key]}" if key in DEVICE_DEPENDENT else ""
        lines.append(f"| `{key}`<br>`{_cell(kind)}` | `{_cell(default)}` | {_cell(text + note)} |")
    return lines + [""]


def _flatten(node: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


def group_rows() -> Iterator[Tuple[str, str, str]]:
    """(group=option, what its comment says, the keys it sets) for every file under conf/<group>/."""
    for folder in sorted(p for p in CONF.iterdir() if p.is_dir()):
        for path in sorted(folder.glob("*.yaml")):
            text = path.read_text()
            comment = " ".join(line.lstrip("# ").strip() for line in text.splitlines()
                               if line.startswith("#") and "@package" not in line)
            package = "" if "@package _global_" in text else folder.name + "."
            sets = ", ".join(f"`{package}{key}={_value(value)}`" for key, value in _flatten(yaml.safe_load(text) or {}))
            yield f"{folder.name}={path.stem}", comment, sets


def _defaults_list() -> List[str]:
    defaults = yaml.safe_load((CONF / "config.yaml").read_text()).get("defaults", [])
    return [f"`{k}={v}`" for item in defaults if isinstance(item, dict) for k, v in item.items()]


def render() -> str:
    """The whole page, as committed in docs/reference/config.md."""
    lines = ["# Configuration reference", "",
             f"<!-- Generated by `{REGENERATE}` from common/config.py and conf/; do not edit by hand. -->", "",
             "Every key of the typed schema (`common/config.py`), with its type, default, allowed values and "
             "docstring. Set any of them on the command line (`grpo train section.key=value`); "
             "`grpo train --cfg` prints the composed config. How overrides, groups and quoting work: "
             "[Configuration](../configuration.md).", "",
             "## Config groups and presets", "",
             f"A group option sets several keys at once (`grpo train data=mul`). The default run composes "
             f"{', '.join(_defaults_list())}.", "",
             "| option | what it is | keys it sets |", "| --- | --- | --- |"]
    lines += [f"| `{name}` | {_cell(comment)} | {_cell(sets)} |" for name, comment, sets in group_rows()]
    lines += ["", "## Defaults that depend on the device", "",
              "These defaults are placeholders resolved when a run starts, from the cluster it finds:", ""]
    lines += [f"- `{key}`: {text}" for key, text in DEVICE_DEPENDENT.items()]
    lines.append("")
    sections: Dict[str, list] = {}
    for row in rows():
        sections.setdefault(row[0].split(".")[0], []).append(row)
    for section, entries in sections.items():
        lines += section_table(section, entries)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/reference/config.md from the config schema.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page is stale")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        stale = not PAGE.is_file() or PAGE.read_text() != page
        if stale:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `{REGENERATE}`", file=sys.stderr)
        return int(stale)
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
