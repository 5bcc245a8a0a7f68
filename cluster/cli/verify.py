"""`grpo verify`: score a file of completions with the same verifier pool that training uses.

Input: JSON lines ``{"prompt", "completion", "answer", ...}`` (plus ``tests`` for `code`, any
other field for custom verifiers; `task`, `task_config` and `metadata` for `reasoning_gym`). An episode with tools may come as ``"transcript": [{"role":
"assistant" | "tool", "content"}, ...]`` instead of a completion: it is scored as training
scores it (the assistant's turns as the completion, the whole episode as the `transcript` field). Output: the same lines, each with ``scores`` (verifier ->
float), ``reward`` (the weighted sum) and ``timed_out`` (verifier names). Every row is checked
before Ray starts; the output is written to a temporary file and renamed, so a failed run never
leaves half a file where the user expects a whole one.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Sequence

from cluster.cli.compose import ConfigError, load_config
from common.messages import ScoringRequest

_RESULT_KEYS = ("scores", "reward", "timed_out")


class VerifyInputError(ValueError):
    """A missing or malformed input file or row; the message is one line."""


def _text(row: Dict[str, Any], key: str, where: str, required: bool) -> None:
    if key not in row or row[key] is None:
        if required:
            raise VerifyInputError(f"{where}: no '{key}' field")
        return
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise VerifyInputError(f"{where}: field '{key}' is a {type(value).__name__}, not a string")


def read_rows(path: str, verifiers: Sequence[str]) -> List[Dict[str, Any]]:
    """Every row of `path`, checked: an object with a string `completion` and `prompt`, an
    `answer` when `math` scores; with `code`, `tests` on at least one row (rows without them
    score 0 there: a file may mix maths and code)."""
    if not os.path.isfile(path):
        raise VerifyInputError(f"--input: no such file '{path}'")
    rows = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path} line {number}"
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise VerifyInputError(f"{where}: not UTF-8 text (byte {exc.start})") from None
            except json.JSONDecodeError as exc:
                raise VerifyInputError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise VerifyInputError(f"{where}: expected a JSON object, got {type(row).__name__}")
            clash = [k for k in _RESULT_KEYS if k in row]
            if clash:
                raise VerifyInputError(f"{where}: field '{clash[0]}' is an output field "
                                       f"(is this already a scored file?)")
            if isinstance(row.get("transcript"), list):
                row = _from_transcript(row, where)
            _text(row, "completion", where, required=True)
            _text(row, "prompt", where, required=True)
            _text(row, "answer", where, required="math" in verifiers or "reasoning_gym" in verifiers)
            if "reasoning_gym" in verifiers:
                _gym_fields(row, where)
            _text(row, "tests", where, required=False)
            rows.append(row)
    if not rows:
        raise VerifyInputError(f"{path}: no rows")
    if "reasoning_gym" in verifiers:
        from reward.gym import check_task

        for task in sorted({str(row["task"]) for row in rows}):
            try:
                check_task(task)
            except ValueError as exc:
                raise VerifyInputError(f"{path}: field 'task': {exc}") from None
    if "code" in verifiers and not any(row.get("tests") for row in rows):
        raise VerifyInputError(f"{path}: no row has a 'tests' field, which the code verifier runs")
    return rows


def _gym_fields(row: Dict[str, Any], where: str) -> None:
    """A row scored by a reasoning-gym task names the task (as `grpo train` puts it in each row's
    fields: `task`, optional `task_config` and `metadata` objects)."""
    _text(row, "task", where, required=True)
    for key in ("task_config", "metadata"):
        if row.get(key) is not None and not isinstance(row[key], dict):
            raise VerifyInputError(f"{where}: field '{key}' is a {type(row[key]).__name__}, not an object")


def _from_transcript(row: Dict[str, Any], where: str) -> Dict[str, Any]:
    """A row that holds an episode as a list of `{"role", "content"}` messages (assistant turns
    and tool results): scored as training scores it, the assistant's text as the completion
    and the whole episode, joined, as the `transcript` field."""
    messages = row["transcript"]
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
                or message.get("role") not in ("assistant", "tool"):
            raise VerifyInputError(f"{where}: transcript message {i} must be "
                                   '{"role": "assistant" or "tool", "content": "..."}')
    if "completion" in row:
        raise VerifyInputError(f"{where}: give a 'completion' or a transcript of messages, not both")
    return {**row, "completion": "".join(m["content"] for m in messages if m["role"] == "assistant"),
            "transcript": "".join(m["content"] for m in messages)}


def _request(row: Dict[str, Any]) -> ScoringRequest:
    fields = {k: v for k, v in row.items() if k not in ("prompt", "completion", "answer")}
    answer = row.get("answer")
    return ScoringRequest(str(row["prompt"]), str(row["completion"]), "" if answer is None else str(answer), fields)


def _summary_table(stats: Dict[str, float], names: Sequence[str], seconds: float) -> str:
    from reward.pool import summarize  # the pool's module imports Ray: only once the rows are good

    n = int(stats["completions"])
    means = summarize(stats, names)
    lines = [f"{'verifier':<12} {'mean score':>10} {'pass rate':>10} {'timeouts':>9}"]
    for name in names:
        lines.append(f"{name:<12} {means[f'score/{name}']:>10.3f} {means[f'pass/{name}']:>10.1%} "
                     f"{int(means[f'reward_timeouts/{name}']):>9d}")
    lines.append(f"{n} rows in {seconds:.1f} s ({n / max(seconds, 1e-9):.1f} rows/s); "
                 f"reward mean {means['reward_mean']:.3f}, std {means['reward_std']:.3f}; "
                 f"errors {int(means['reward_errors'])}")
    return "\n".join(lines)


def verify(verifiers: Sequence[str], input_path: str, output_path: str,
           overrides: Sequence[str] = ()) -> Dict[str, float]:
    """Score `input_path` into `output_path`; prints the per-verifier summary, returns the stats."""

    names = list(dict.fromkeys(v.strip() for v in verifiers if v.strip()))
    if not names:
        raise ConfigError("--verifiers is empty: name at least one (e.g. math,format)")
    # Verifiers named here without a weight count 1.0 (training asks for every weight).
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    weights = [f"+reward.weights.{n}=1.0" for n in dict.fromkeys(names)
               if n not in ("math", "format") and f"reward.weights.{n}" not in given]
    cfg = load_config([f"reward.verifiers=[{','.join(names)}]", *weights, *overrides])
    rows = read_rows(input_path, names)
    out_dir = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(out_dir):
        raise VerifyInputError(f"--output: no such folder '{out_dir}'")
    import ray  # only now: bad input answers before Ray is imported

    from common.ray_utils import init_ray
    from cluster.loop.roles import start_verifiers

    init_ray(cfg.ray.address, cfg.ray.num_cpus)
    try:
        pool = start_verifiers(cfg)
        pool.ready()
        start = time.perf_counter()
        outcomes, stats = pool.score_items([_request(row) for row in rows])
        seconds = time.perf_counter() - start
        pool.shutdown()
    finally:
        ray.shutdown()
    tmp = f"{output_path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        for row, outcome in zip(rows, outcomes):
            scored = {**row, "scores": outcome.scores, "reward": outcome.reward,
                      "timed_out": outcome.timed_out}
            handle.write(json.dumps(scored) + "\n")
    os.replace(tmp, output_path)
    print(_summary_table(stats, cfg.reward.verifiers, seconds), flush=True)
    return stats
