"""Prompt datasets: the built-in addition task, local JSONL/Parquet files and `datasets` sets.

Every source ends as two lists of `Problem` (held-out, train) whose held-out rows are never
trained on, and `PromptSampler` walks the train list endlessly, reshuffled every epoch, with a
state that a checkpoint can save and resume exactly.

Light on purpose: no torch, Ray or vLLM; `datasets` and `pyarrow` are imported only by the
sources that need them. Every data problem is a `DataError` with one line naming the
file, line/row and field to fix.
"""
from __future__ import annotations

import json
import os
import random
import re
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

from common.answers import extract_answer
from common.config import DIGIT_DISTRIBUTIONS
from data.errors import DataError  # defined beside this module, so that the other sources share it
from data.scratchpads import solve_addition  # shared with data/reasoning_gym.py
from common.problem import Problem
from common.seeds import epoch_seed

if TYPE_CHECKING:
    from common.config import DataConfig

__all__ = [
    "DataError",
    "solve_addition",
    "arithmetic_problems",
    "load_problems",
    "load_eval_problems",
    "PromptSampler",
]

# Pair spaces up to this size are enumerated and shuffled (2-digit operands: 90 * 90 = 8100);
# larger ones are sampled without repeats.
_ENUMERATE_MAX_PAIRS = 10_000
# "1,234" / "-12,345.5": a plain number written with thousands separators.
_THOUSANDS_NUMBER = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


class Splits(NamedTuple):
    """A dataset's two disjoint parts; unpacks as (heldout, train)."""

    heldout: List[Problem]
    train: List[Problem]


def _one_line(text: Any) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return " ".join(lines)


# --------------------------------------------------------------------------- arithmetic


def _addition_problem(a: int, b: int) -> Problem:
    return Problem(prompt=f"{a}+{b}=", answer=str(a + b), solution=solve_addition(a, b))


def _multiplication_problem(a: int, b: int) -> Problem:
    """`a*b=`; its warm-up target is the bare answer (data/traces.py replaces it with a
    calculator call when the run has the tool). `expression` is what a tool would compute."""
    return Problem(prompt=f"{a}*{b}=", answer=str(a * b), solution=f"<think></think><answer>{a * b}</answer>",
                   fields={"expression": f"{a}*{b}"})


OPS = {"add": _addition_problem, "mul": _multiplication_problem}


def _check_room(weights: List[float], min_digits: int, wanted: int) -> None:
    """Refuse a draw that would need more than half of some digit count's distinct problems
    (the sampling without repeats would slow to a crawl, or never end)."""
    for k, weight in enumerate(weights):
        digits = min_digits + k
        lo, hi = _operand_range(digits)
        # pairs whose longer operand has exactly `digits` digits
        room = (hi + 1 - _operand_range(min_digits)[0]) ** 2 - (lo - _operand_range(min_digits)[0]) ** 2
        if weight * wanted > room / 2:
            raise DataError(f"data.heldout_size + data.num_train = {wanted} asks for about {weight * wanted:.0f} "
                            f"problems of {digits} digits, more than half of the {room} there are: lower "
                            f"data.num_train, or raise data.min_digits or data.digit_decay")


def _operand_range(digits: int) -> Tuple[int, int]:
    """Inclusive bounds of the numbers with exactly `digits` digits (1 digit: 0-9)."""
    return (0 if digits == 1 else 10 ** (digits - 1)), 10 ** digits - 1


def digit_count_weights(min_digits: int, max_digits: int, distribution: str = "uniform",
                        decay: float = 0.5) -> List[float]:
    """The probability of each digit count min..max of a problem's longer operand: equal
    (`uniform`), or falling by `decay` per digit (`geometric`, truncated at max_digits: most
    problems short, a few long, so the scratchpad's length has a long tail)."""
    if distribution not in DIGIT_DISTRIBUTIONS:
        raise DataError(f"data.digit_distribution must be one of {', '.join(DIGIT_DISTRIBUTIONS)} "
                        f"(got '{distribution}')")
    if distribution == "geometric" and not 0 < decay < 1:
        raise DataError(f"data.digit_decay must be between 0 and 1, both excluded (got {decay})")
    raw = [1.0 if distribution == "uniform" else decay ** k for k in range(max_digits - min_digits + 1)]
    return [w / sum(raw) for w in raw]


def arithmetic_problems(seed: int, heldout_size: int, num_train: int, min_digits: int,
                        max_digits: int, op: str = "add", digit_distribution: str = "uniform",
                        digit_decay: float = 0.5) -> Splits:
    """(held-out, train) problems `a+b=` (or `a*b=` with op="mul") whose operands have min..max digits.

    Deterministic in `seed`; no (a, b) pair is in both lists. Small pair spaces (2-digit
    operands: 8100 pairs) are enumerated, shuffled, the first `heldout_size` held out and the
    rest (or its first `num_train`, when > 0) trained on. Larger spaces are sampled without
    repeats (each operand's digit count uniform in min..max, then the operand uniform), and
    need `num_train` > 0. With `digit_distribution="geometric"` a problem's digit count d is
    drawn by `digit_count_weights` instead, one operand gets d digits and the other a count
    uniform in min..d (which operand is the longer is a coin toss).
    """
    if min_digits < 1 or max_digits < min_digits:
        raise DataError(f"data.min_digits={min_digits}, data.max_digits={max_digits}: "
                        f"need 1 <= min_digits <= max_digits")
    if heldout_size < 0:
        raise DataError(f"data.heldout_size must be at least 0 (got {heldout_size})")
    if num_train < 0:
        raise DataError(f"data.num_train must be at least 0 (got {num_train})")
    low, high = _operand_range(min_digits)[0], _operand_range(max_digits)[1]
    space = (high - low + 1) ** 2
    rng = random.Random(seed)

    if space <= _ENUMERATE_MAX_PAIRS:
        pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
        rng.shuffle(pairs)
        heldout_pairs = pairs[:heldout_size]
        rest = pairs[heldout_size:]
        train_pairs = rest[:num_train] if num_train else rest
        if not train_pairs:
            raise DataError(f"data.heldout_size={heldout_size} leaves no training problems "
                            f"out of the {space} with {min_digits}-{max_digits} digit operands")
    else:
        if num_train == 0:
            raise DataError(f"data.num_train must be set (> 0) with operands of up to "
                            f"{max_digits} digits: {space} problems are too many to use all")
        wanted = heldout_size + num_train
        if wanted > space // 2:
            raise DataError(f"data.heldout_size + data.num_train = {wanted} is more than half of "
                            f"the {space} problems with {min_digits}-{max_digits} digit operands")
        digit_counts = range(min_digits, max_digits + 1)

        def operand(digits: Optional[int] = None) -> int:
            lo, hi = _operand_range(rng.choice(digit_counts) if digits is None else digits)
            return rng.randint(lo, hi)

        if digit_distribution == "uniform":
            def draw() -> Tuple[int, int]:
                return operand(), operand()
        else:
            weights = digit_count_weights(min_digits, max_digits, digit_distribution, digit_decay)
            _check_room(weights, min_digits, wanted)

            def draw() -> Tuple[int, int]:
                longer = rng.choices(digit_counts, weights)[0]
                pair = (operand(longer), operand(rng.randint(min_digits, longer)))
                return pair if rng.random() < 0.5 else pair[::-1]

        seen = set()
        ordered: List[Tuple[int, int]] = []
        while len(ordered) < wanted:
            pair = draw()
            if pair not in seen:
                seen.add(pair)
                ordered.append(pair)
        heldout_pairs, train_pairs = ordered[:heldout_size], ordered[heldout_size:]

    make = OPS[op]
    return Splits([make(a, b) for a, b in heldout_pairs], [make(a, b) for a, b in train_pairs])


# --------------------------------------------------------------------------- files and datasets


def _as_text(value: Any) -> Optional[str]:
    """A row value as text, or None when it is not a string/number."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    return None


def clean_answer(answer: str) -> str:
    """Gold answer text: a GSM8K `...#### 42` keeps only `42`; a MATH-style solution keeps the
    content of its last `\\boxed{...}`; thousands commas go."""
    if "\\boxed{" in answer and "####" not in answer:
        boxed = extract_answer(answer)
        if boxed:
            answer = boxed
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip()
        return _THOUSANDS_COMMA.sub("", answer)
    answer = answer.strip()
    if _THOUSANDS_NUMBER.match(answer):
        answer = answer.replace(",", "")
    return answer


ROLES = ("system", "user", "assistant", "tool")


def parse_messages(value: Any, where: str) -> Tuple[Tuple[str, str], ...]:
    """A conversation as (role, content) pairs: a non-empty list of {"role", "content"} objects
    with known roles and text contents, at least one from the user."""
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: a conversation must be a non-empty list of {{role, content}} messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"} or "role" not in message:
            raise DataError(f"{where}: message {i} must be an object with 'role' and 'content' (got {_one_line(message)[:80]})")
        role, content = message["role"], message.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: message {i} has role '{role}'; roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {i} ({role}) has no text 'content'")
        messages.append((role, content))
    if not any(role == "user" for role, _ in messages):
        raise DataError(f"{where}: the conversation has no user message")
    return tuple(messages)


def _row_problem(row: Any, where: str, prompt_key: str, answer_key: str) -> Problem:
    """One row (a mapping) as a Problem; `where` names it, e.g. "data.path x.jsonl line 3"."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with '{prompt_key}' and "
                        f"'{answer_key}' fields (got {type(row).__name__})")
    values = {}
    messages = None
    if isinstance(row.get(prompt_key), (list, tuple)):  # conversational: [{"role", "content"}, ...]
        messages = parse_messages(row[prompt_key], f"{where}: field '{prompt_key}'")
        values[prompt_key] = next(content for role, content in reversed(messages) if role == "user")
    for key in (prompt_key, answer_key):
        if key in values:
            continue
        if key not in row or row[key] is None:
            raise DataError(f"{where}: no '{key}' field")
        text = _as_text(row[key])
        if text is None:
            raise DataError(f"{where}: field '{key}' is a {type(row[key]).__name__}, "
                            f"not a string or number")
        values[key] = text
    answer = clean_answer(values[answer_key])
    if not values[prompt_key].strip():
        raise DataError(f"{where}: field '{prompt_key}' is empty")
    if not answer:
        raise DataError(f"{where}: field '{answer_key}' is empty")
    solution = None
    if row.get("solution") is not None:
        solution = _as_text(row["solution"])
        if solution is None:
            raise DataError(f"{where}: field 'solution' is a {type(row['solution']).__name__}, "
                            f"not a string")
    extra = {k: v for k, v in row.items() if k not in (prompt_key, answer_key, "solution")}
    return Problem(prompt=values[prompt_key], answer=answer, solution=solution, fields=extra, messages=messages)


def _read_jsonl(path: str, label: str) -> Iterable[Tuple[str, Any]]:
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise DataError(f"{label}: cannot open ({_one_line(exc.strerror or exc)})") from exc
    with handle:
        try:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{label} line {number}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from exc
                yield where, row
        except UnicodeDecodeError as exc:
            raise DataError(f"{label}: not UTF-8 text ({_one_line(exc)})") from exc


def _read_parquet(path: str, label: str) -> Iterable[Tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    except Exception as exc:
        raise DataError(f"{label}: cannot read Parquet ({_one_line(exc)})") from exc
    for number, row in enumerate(rows, start=1):
        yield f"{label} row {number}", row


def _load_hf_rows(data_cfg, split: str, key: str = "data.split") -> Tuple[str, Iterable[Tuple[str, Any]]]:
    try:
        import datasets
    except ImportError as exc:
        raise DataError("data.source=hf needs the `datasets` package (pip install datasets)") from exc
    if data_cfg.path:
        path = os.path.expanduser(str(data_cfg.path))
        label = f"data.path {data_cfg.path}"
        if not os.path.exists(path):
            raise DataError(f"data.path: no such folder '{data_cfg.path}'")
        try:
            loaded = datasets.load_from_disk(path)
        except Exception as exc:
            raise DataError(f"{label}: cannot load a saved dataset ({_one_line(exc)})") from exc
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"{key} '{split}' is not in {data_cfg.path} "
                                f"(splits: {', '.join(sorted(loaded))})")
            loaded = loaded[split]
    elif data_cfg.name:
        label = f"data.name {data_cfg.name}"
        try:
            loaded = datasets.load_dataset(data_cfg.name, data_cfg.config_name, split=split)
        except Exception as exc:
            raise DataError(f"{label} (config {data_cfg.config_name}, split {split}): "
                            f"cannot load ({_one_line(exc)})") from exc
    else:
        raise DataError("data.name (or data.path of a saved dataset) is required with data=hf")
    if not isinstance(loaded, datasets.Dataset):
        raise DataError(f"{label}: expected one split, got a {type(loaded).__name__} "
                        f"(set data.split)")
    columns = set(loaded.column_names)
    for key in (data_cfg.prompt_key, data_cfg.answer_key):
        if len(loaded) and key not in columns:
            raise DataError(f"{label}: no '{key}' field (columns: {', '.join(sorted(columns))})")
    return label, ((f"{label} row {i}", row) for i, row in enumerate(loaded, start=1))


def _split_heldout(problems: List[Problem], heldout_size: int,
                   seed: int) -> Splits:
    """Seeded shuffle; held-out = first min(heldout_size, n // 5) (at least 1 when n >= 2)."""
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    count = min(max(heldout_size, 0), len(problems) // 5)
    if len(problems) >= 2:
        count = max(count, 1)
    shuffled = [problems[i] for i in order]
    return Splits(shuffled[:count], shuffled[count:])


def _file_rows(path_setting: str, key: str) -> Tuple[str, Iterable[Tuple[str, Any]]]:
    path = os.path.expanduser(str(path_setting))
    label = f"{key} {path_setting}"
    if not os.path.isfile(path):
        raise DataError(f"{key}: no such file '{path_setting}'")
    return label, (_read_parquet if path.lower().endswith(".parquet") else _read_jsonl)(path, label)


def _problems(data_cfg, label: str, rows: Iterable[Tuple[str, Any]]) -> List[Problem]:
    problems = [_row_problem(row, where, data_cfg.prompt_key, data_cfg.answer_key) for where, row in rows]
    if not problems:
        raise DataError(f"{label}: the dataset is empty")
    return problems


def _eval_problems(data_cfg) -> Optional[List[Problem]]:
    """The separate evaluation set (data.eval_path or data.eval_split), if one is named."""
    if data_cfg.eval_path:
        return _problems(data_cfg, *_file_rows(data_cfg.eval_path, "data.eval_path"))
    if data_cfg.eval_split:
        return _problems(data_cfg, *_load_hf_rows(data_cfg, data_cfg.eval_split, "data.eval_split"))
    return None


def load_eval_problems(data_cfg: "DataConfig", seed: int) -> List[Problem]:
    """The evaluation set alone: the one data.eval_path/eval_split names (the training data is
    not read), else the rows held out of the training data."""
    evaluation = _eval_problems(data_cfg)
    return evaluation if evaluation is not None else load_problems(data_cfg, seed).heldout


def load_problems(data_cfg: "DataConfig", seed: int) -> Splits:
    """(evaluation, train) problems of the configured source (`data.source`): the evaluation
    set that data.eval_path/eval_split names, or rows held out of the training data."""
    source = data_cfg.source
    evaluation = _eval_problems(data_cfg)
    if source == "arithmetic":
        heldout, train = arithmetic_problems(seed, 0 if evaluation else data_cfg.heldout_size, data_cfg.num_train,
                                             data_cfg.min_digits, data_cfg.max_digits, data_cfg.op,
                                             data_cfg.digit_distribution, data_cfg.digit_decay)
        return Splits(evaluation or heldout, train)
    if source == "reasoning_gym":
        from data.reasoning_gym import gym_problems  # reasoning-gym's import: only when asked for

        heldout, train = gym_problems(data_cfg, seed, 0 if evaluation else data_cfg.heldout_size)
        return Splits(evaluation or heldout, train)
    if source == "jsonl":
        if not data_cfg.path:
            raise DataError("data.path is required with data=jsonl (a .jsonl or .parquet file)")
        label, rows = _file_rows(data_cfg.path, "data.path")
    elif source == "hf":
        label, rows = _load_hf_rows(data_cfg, data_cfg.split)
    else:
        raise DataError(f"data.source must be one of arithmetic, jsonl, hf, reasoning_gym (got '{source}')")
    problems = _problems(data_cfg, label, rows)
    if evaluation is not None:
        return Splits(evaluation, problems)
    return _split_heldout(problems, data_cfg.heldout_size, seed)


# --------------------------------------------------------------------------- sampling


class PromptSampler:
    """Endless sampler over the train problems, reshuffled each epoch with Random(seed + epoch).

    `next_batch(n)` crosses epoch boundaries seamlessly; `state_dict()` /
    `load_state_dict()` save and restore the position so the sequence continues identically.
    """

    def __init__(self, problems: List[Problem], seed: int):
        if not problems:
            raise DataError("no training problems to sample prompts from")
        self.problems = list(problems)
        self.seed = int(seed)
        self._epoch = 0
        self._position = 0
        self._order: Optional[List[int]] = None

    def _epoch_order(self) -> List[int]:
        if self._order is None:
            order = list(range(len(self.problems)))
            random.Random(epoch_seed(self.seed, self._epoch)).shuffle(order)
            self._order = order
        return self._order

    def next_batch(self, n: int) -> List[Tuple[int, Problem]]:
        """The next `n` (index into problems, problem) pairs."""
        if n < 0:
            raise ValueError(f"batch size must be at least 0 (got {n})")
        batch: List[Tuple[int, Problem]] = []
        while len(batch) < n:
            order = self._epoch_order()
            take = order[self._position:self._position + n - len(batch)]
            batch.extend((i, self.problems[i]) for i in take)
            self._position += len(take)
            if self._position >= len(order):
                self._epoch += 1
                self._position = 0
                self._order = None
        return batch

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.problems):
            raise ValueError(f"sampler state {state} does not fit {len(self.problems)} problems")
        if position == len(self.problems):
            epoch, position = epoch + 1, 0
        self._epoch, self._position, self._order = epoch, position, None
