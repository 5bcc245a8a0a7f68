"""The Python entry point: `GRPOTrainer(...).train()` runs the job `grpo train` runs, from a script
or a notebook, with the dataset and the reward functions as Python objects.

A thin shell over the command line's seam: what it is given becomes Hydra overrides, then
`load_config(overrides)` and `train(cfg)` (cluster/cli/), so every check and one-line error of
`grpo train` applies, and the run is the one `grpo train` makes with the same overrides. A
dataset is written once to a JSONL file under trainer.output_dir (`data=jsonl`); a callable
(reward function, tool, agent) travels inside the config, pickled by cloudpickle
(common/plugins.py), to the processes that call it: the verifiers' `python -m reward.scorer`
child, the tool and agent processes, on any node.

    from cluster.trainer import GRPOTrainer

    trainer = GRPOTrainer(train_dataset=[{"prompt": "2+2=", "answer": "4"}, ...],
                          reward_funcs={"math": "math", "short": lambda completions, **_: [...]},
                          trainer={"max_steps": 20}, logger="tensorboard")
    summary = trainer.train()
"""
from __future__ import annotations

import hashlib
import inspect
import json
import re
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from cluster.cli.compose import GROUPS, MAPPING_KEYS, compose_config, load_config
from cluster.cli.exits import guarded
from common.config import TOOLS, Config, ConfigError
from common.plugins import pickled

__all__ = ["GRPOTrainer"]

Rows = Union[Sequence[Mapping[str, Any]], Any]  # a list of dicts, or a `datasets.Dataset`
Named = Union[Sequence[Union[str, Callable[..., Any]]], Mapping[str, Union[str, Callable[..., Any]]]]

# A pickled callable travels in the config; one this large carries more than code (a model, a
# table), which belongs in a file the function opens.
MAX_PICKLED_BYTES = 1 << 20
SECTIONS = tuple(f.name for f in fields(Config))


class GRPOTrainer:
    """A GRPO run, configured from Python; `train()` runs it and returns the run's summary (the
    dict of summary.json, with `run_dir`).

    model: None (the config's: the built-in tiny model), "tiny", or a Hugging Face model folder or
        hub id (`model=hf model.path=...`; give its learning rate, e.g. learner={"lr": 1e-6}).
    train_dataset, eval_dataset: a list of dicts or a `datasets.Dataset`, with the columns that
        data.prompt_key and data.answer_key name ("prompt", "answer"); a `solution` column feeds
        the supervised warm-up. None: the config's data (the built-in task).
    reward_funcs: verifiers by name ("math", "format", "module:function") or callables, as a list
        (a callable is named after itself, a lambda `reward_<i>`) or a dict name -> verifier. A
        callable takes keyword lists `prompts`, `completions`, `answer` and the row's other
        columns (`**kwargs` takes them all) and returns one float per completion.
    reward_weights: a weight per reward function (list, in order, or dict by name); default 1.0.
    tools: built-in tool names ("calculator", "python") or callables (dict name -> callable).
    agent: an agent function (rollout.agent), given an `openai.OpenAI` client per episode.
    **overrides: config overrides by section or group: trainer={"max_steps": 20},
        logger="tensorboard", logger=["wandb", "mlflow"], or dotted keys through **{"algo.beta": 0.0}.
    config: more overrides, applied after those: a dict (nested sections or dotted keys) or a list
        of `key=value` strings as `grpo train` takes them (a script's sys.argv[1:]).
    """

    def __init__(self, model: Optional[str] = None, train_dataset: Optional[Rows] = None,
                 eval_dataset: Optional[Rows] = None, reward_funcs: Optional[Named] = None,
                 reward_weights: Optional[Union[Sequence[float], Mapping[str, float]]] = None,
                 tools: Optional[Named] = None, agent: Optional[Callable[..., Any]] = None,
                 config: Optional[Union[Mapping[str, Any], Sequence[str]]] = None, **overrides: Any):
        self.model, self.train_dataset, self.eval_dataset = model, train_dataset, eval_dataset
        self.reward_funcs, self.reward_weights, self.tools, self.agent = reward_funcs, reward_weights, tools, agent
        self.user_overrides = _as_overrides(overrides) + _as_overrides(config)
        self._config: Optional[Config] = None
        self._overrides: Optional[List[str]] = None

    # ---- what `grpo train` would be given ------------------------------------------------------
    def overrides(self) -> List[str]:
        """The overrides `grpo train` would take for this run (the dataset written to its file,
        callables pickled into the values). Raises ConfigError (one line) for bad input."""
        if self._overrides is None:
            self._overrides = self._build()
        return list(self._overrides)

    def config(self) -> Config:
        """The run's validated config, as `grpo train` composes it from `overrides()`."""
        if self._config is None:
            self._config = load_config(self.overrides())
        return self._config

    def train(self) -> Dict[str, object]:
        """Run the job; returns its summary. Bad input raises ConfigError (a one-line message)
        before anything starts; `main()` turns it into grpo's exit status 2 instead."""
        from cluster.cli.train import train

        return train(self.config())

    def main(self) -> int:
        """`train()` with `grpo train`'s exit statuses and one-line errors: for a script's
        `sys.exit(trainer.main())` (bad input: one line on stderr, status 2)."""
        return guarded(lambda: (self.train(), 0)[1])

    # ---- building the overrides ----------------------------------------------------------------
    def _build(self) -> List[str]:
        overrides = list(self.user_overrides)
        if self.model is not None:
            overrides += ["model=tiny"] if self.model == "tiny" else ["model=hf", f"model.path={_value(str(self.model))}"]
        composed = compose_config(overrides)  # the columns the rows must have; where their files go
        data, output_dir = composed.data, Path(composed.trainer.output_dir).expanduser()
        columns: List[str] = []
        if self.train_dataset is not None:
            rows = _rows(self.train_dataset, "train_dataset", data.prompt_key, data.answer_key)
            columns = sorted({k for row in rows for k in row})
            overrides += ["data=jsonl", f"data.path={_value(_write_rows(rows, output_dir, 'train'))}"]
        if self.eval_dataset is not None:
            rows = _rows(self.eval_dataset, "eval_dataset", data.prompt_key, data.answer_key)
            overrides += [f"data.eval_path={_value(_write_rows(rows, output_dir, 'eval'))}"]
        fields_passed = [c for c in columns if c not in (data.prompt_key, data.answer_key, "solution")]
        if self.reward_funcs is not None:
            overrides += self._rewards(fields_passed)
        if self.tools is not None:
            overrides += self._tools()
        if self.agent is not None:
            overrides += [f"rollout.agent={_value(_ship(self.agent, 'agent', 'agent processes'))}"]
        return overrides

    def _rewards(self, fields_passed: List[str]) -> List[str]:
        named = _named(self.reward_funcs, "reward_funcs", "reward")
        if not named:
            raise ConfigError("reward_funcs is empty: give at least one reward function or verifier name")
        out, names = [], list(named)
        for index, (name, fn) in enumerate(named.items()):
            where = f"reward_funcs[{index}] ({name})"
            if callable(fn):
                _check_reward_signature(fn, where, fields_passed)
                fn = _ship(fn, where, "verifier processes")
            if fn != name:  # a built-in verifier is named by itself; anything else is reward.custom
                out.append(f"++reward.custom.{name}={_value(fn)}")
        weights = self.reward_weights
        if weights is None:
            weights = {name: 1.0 for name in names}
        elif not isinstance(weights, Mapping):
            weights = list(weights)
            if len(weights) != len(names):
                raise ConfigError(f"reward_weights has {len(weights)} weights for {len(names)} reward_funcs")
            weights = dict(zip(names, weights))
        out.append(f"reward.verifiers={_value(names)}")
        # Key by key: a whole mapping would be merged into the default one, which refuses new keys.
        out += [f"++reward.weights.{name}={_value(float(weight))}" for name, weight in weights.items()]
        return out

    def _tools(self) -> List[str]:
        named = _named(self.tools, "tools", "tool")
        built_in, out = [], []
        for name, fn in named.items():
            if isinstance(fn, str) and fn in TOOLS:
                built_in.append(fn)
            else:
                spec = _ship(fn, f"tools ({name})", "tool processes") if callable(fn) else fn
                out.append(f"++rollout.custom_tools.{name}={_value(spec)}")
        return [f"rollout.tools={_value(built_in)}"] + out


# ---- helpers ---------------------------------------------------------------------------------------


def _named(items: Named, what: str, prefix: str) -> Dict[str, Union[str, Callable[..., Any]]]:
    """name -> item: a dict as it is; in a list a string names itself (its function's name for
    module:function), a callable is named after itself, a lambda `<prefix>_<i>`."""
    if isinstance(items, Mapping):
        named = {str(k): v for k, v in items.items()}
    elif isinstance(items, (str, bytes)) or callable(items):
        raise ConfigError(f"{what} must be a list or a dict (got one {type(items).__name__}); wrap it in [...]")
    else:
        named = {}
        for index, item in enumerate(items):
            if isinstance(item, str):
                name = item.rpartition(":")[2]
            else:
                name = getattr(item, "__name__", "")
                if not name.isidentifier() or name == "<lambda>":
                    name = f"{prefix}_{index}"
            if name in named:
                name = f"{name}_{index}"
            named[name] = item
    for name, item in named.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"{what}: '{name}' is not a usable name (letters, digits and _)")
        if not (isinstance(item, str) or callable(item)):
            raise ConfigError(f"{what} ({name}): expected a name or a callable, got {type(item).__name__}")
    return named


def _check_reward_signature(fn: Callable[..., Any], where: str, fields_passed: List[str]) -> None:
    """The verifiers call fn(prompts=[...], completions=[...], answer=[...], **other_columns)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the call itself will tell
    keywords = ["prompts", "completions", "answer", *fields_passed]
    try:
        signature.bind(**{k: [] for k in keywords})
    except TypeError as exc:
        raise ConfigError(f"{where}: cannot be called as fn({', '.join(k + '=[...]' for k in keywords)}) ({exc}); a "
                          "reward function takes those keyword lists (or **kwargs) and returns a list of floats") \
            from None


def _ship(fn: Any, where: str, destination: str) -> str:
    """`fn` as a config value the processes that call it load (common/plugins.pickled)."""
    if isinstance(fn, str):
        return fn
    try:
        spec = pickled(fn)
    except Exception as exc:  # cloudpickle raises many types (TypeError, PicklingError, ...)
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(f"{where}: cannot be pickled to send it to the {destination} ({type(exc).__name__}: "
                          f"{first}); define it without such objects in its closure, or name it as "
                          "module:function") from None
    if len(spec) > MAX_PICKLED_BYTES:
        raise ConfigError(f"{where}: pickles to {len(spec) / 2**20:.1f} MiB, which would travel in the config; keep "
                          "large objects in a file the function opens, or name it as module:function")
    return spec


def _rows(dataset: Rows, what: str, prompt_key: str, answer_key: str) -> List[Dict[str, Any]]:
    """A list of dicts, or a `datasets.Dataset` (anything with to_list), as rows that have the
    prompt and answer columns."""
    if hasattr(dataset, "to_list") and hasattr(dataset, "column_names"):
        rows = dataset.to_list()
    elif isinstance(dataset, (list, tuple)):
        rows = list(dataset)
    else:
        raise ConfigError(f"{what} must be a list of dicts or a datasets.Dataset (got {type(dataset).__name__})")
    if not rows:
        raise ConfigError(f"{what} is empty")
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ConfigError(f"{what}[{index}] is a {type(row).__name__}, not a dict")
        for key, setting in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
            if key not in row:
                raise ConfigError(f"{what} has no '{key}' column (data.{setting}) in row {index}; its columns: "
                                  f"{', '.join(map(str, row)) or 'none'}")
    return [dict(row) for row in rows]


def _write_rows(rows: List[Dict[str, Any]], output_dir: Path, kind: str) -> str:
    """The rows as JSONL in <output_dir>/inputs/, named by their content (a resumed or repeated
    run finds the same file)."""
    try:
        text = "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{kind}_dataset: a row is not JSON data ({exc})") from None
    path = output_dir / "inputs" / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
    return str(path.absolute())


def _as_overrides(config: Optional[Union[Mapping[str, Any], Sequence[str]]]) -> List[str]:
    """Overrides from a list of `key=value` strings, or a dict of sections, groups or dotted keys."""
    if config is None:
        return []
    if isinstance(config, str):
        raise ConfigError(f"config must be a dict or a list of key=value strings (got the string '{config}')")
    if not isinstance(config, Mapping):
        return [str(item) for item in config]
    out = []
    for key, value in config.items():
        if key in GROUPS and isinstance(value, (str, list, tuple)):
            out.append(f"{key}={_value(value, bare=True)}")
        elif key in SECTIONS and not isinstance(value, Mapping):
            raise ConfigError(f"{key}: give the section's keys as a dict ({key}={{...}}) or dotted ('{key}.x': ...)")
        else:
            out += _leaves(str(key), value)
    return out


def _leaves(key: str, value: Any) -> List[str]:
    if isinstance(value, Mapping) and value:
        return [o for k, v in value.items() for o in _leaves(f"{key}.{k}", v)]
    prefix = "++" if key.startswith(MAPPING_KEYS) else ""
    return [f"{prefix}{key}={_value(value)}"]


def _value(value: Any, bare: bool = False) -> str:
    """A Python value in Hydra's override grammar (strings quoted, so any text survives)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        if bare and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            return value  # a group's option
        # Hydra reads a backslash as an escape only before a quote or at the end of the value.
        escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
        return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped) + "'"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{_value(str(k), bare=True)}:{_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v, bare) for v in value) + "]"
    raise ConfigError(f"cannot pass a {type(value).__name__} as a config value ({value!r})")
