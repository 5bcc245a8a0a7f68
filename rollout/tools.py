"""The tools a model may call between turns of an episode, and the box that runs the calls.

Built in:
- `calculator`: exact arithmetic on integers, decimals and fractions (`+ - * / // % **`,
  parentheses, unary minus). The expression is parsed into a syntax tree and each node is
  computed with `fractions.Fraction`: nothing is ever `eval`ed, and sizes are bounded (input
  length, exponents, result digits), so a call can neither run code nor run long.
- `python`: runs the code in the same sandbox as the `code` verifier (no network, no home, no
  secrets, CPU/memory/process/file limits, killed at `rollout.tool_timeout_s`) and returns what
  it printed, cut to `rollout.tool_max_output_chars`.

Your own: `+rollout.custom_tools.NAME=module:function`, called with the call's arguments
(`function(text)` for the tag format, `function(**arguments)` for JSON calls) and returning
text. It runs in a thread of the generation actor: its time limit ends the wait (an error
observation, counted), not the function, so a custom tool that can hang should bound itself.

Every call returns an `Observation`; a tool that raises, hangs or floods gives an error text,
never an exception: one bad call costs its own episode a turn, never the batch.
"""
from __future__ import annotations

import ast
import operator
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

from common.plugins import load_function
from common.sandbox import SandboxLimits, run_python

BUILTIN_TOOLS = ("calculator", "python")

Arguments = Union[str, Mapping[str, Any]]


@dataclass(frozen=True)
class Observation:
    text: str
    error: bool = False
    """The call could not run (malformed, unknown tool, raised, timed out)."""
    timed_out: bool = False
    seconds: float = 0.0
    """How long the tool ran (a call that timed out: until it was given up)."""


class ToolError(Exception):
    """A call that cannot be carried out; its message becomes the observation."""


# --------------------------------------------------------------------------- calculator

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 256
MAX_RESULT_DIGITS = 400

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: None}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: Arguments) -> str:
    """The exact value of an arithmetic expression: an integer (`56088`) or a fraction in lowest
    terms (`-7/3`). `^` is read as a power and `×`, `÷` as `*`, `/`; thousands separators go."""
    if isinstance(expression, Mapping):
        expression = expression.get("expression", "")
    text = str(expression).strip().replace("^", "**").replace("×", "*").replace("÷", "/").replace(",", "")
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {text[:40]!r}") from None
    value = _value(tree.body)
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            result = _power(left, right)
        else:
            if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
                raise ToolError("division by zero")
            result = Fraction(_BINARY[type(node.op)](left, right))
        if max(len(str(abs(result.numerator))), len(str(result.denominator))) > MAX_RESULT_DIGITS:
            raise ToolError(f"result longer than {MAX_RESULT_DIGITS} digits")
        return result
    raise ToolError(f"not arithmetic: {type(node).__name__}")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ToolError("only whole-number exponents are exact")
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"exponent beyond {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise ToolError("division by zero")
    bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
    if bits * abs(int(exponent)) > MAX_RESULT_DIGITS * 3.33:
        raise ToolError(f"result longer than {MAX_RESULT_DIGITS} digits")
    return base ** int(exponent)


# --------------------------------------------------------------------------- python


def python_tool(limits: SandboxLimits, max_chars: int) -> Callable[[Arguments], str]:
    def run(code: Arguments) -> str:
        if isinstance(code, Mapping):
            code = code.get("code", "")
        result = run_python(str(code), "", limits, capture_chars=max_chars)
        if result.timed_out:
            raise ToolError(f"timed out after {limits.timeout_s:g} s")
        if not result.passed and not result.output:
            raise ToolError(result.error)
        return result.output
    return run


# --------------------------------------------------------------------------- the box


def _call_custom(fn: Callable[..., Any]) -> Callable[[Arguments], str]:
    def call(arguments: Arguments) -> str:
        out = fn(**arguments) if isinstance(arguments, Mapping) else fn(arguments)
        return "" if out is None else str(out)
    return call


class ToolBox:
    """The enabled tools, run on a small thread pool beside the engine. `submit` never blocks;
    `collect` turns a finished (or overdue) call into its Observation."""

    def __init__(self, names: Sequence[str], custom: Mapping[str, str], timeout_s: float, max_chars: int,
                 sandbox: SandboxLimits, threads: int = 8, search_path: Sequence[str] = ()):
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self.tools: Dict[str, Callable[[Arguments], str]] = {}
        for name in names:
            if name == "calculator":
                self.tools[name] = calculator
            elif name == "python":
                self.tools[name] = python_tool(sandbox, max_chars)
        for name, path in custom.items():
            self.tools[name] = _call_custom(load_function(path, search_path))
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tool")

    @property
    def names(self) -> list:
        return sorted(self.tools)

    def submit(self, name: Optional[str], arguments: Arguments) -> "Call":
        if name not in self.tools:
            known = ", ".join(self.names)
            return Call(None, time.monotonic(), self.timeout_s, f"unknown tool {name!r} (tools: {known})")
        return Call(self.pool.submit(_timed, self.tools[name], arguments), time.monotonic(), self.timeout_s)

    def malformed(self, error: str) -> "Call":
        """A call that could not be parsed: its observation is the error, at once."""
        return Call(None, time.monotonic(), self.timeout_s, error)

    def run(self, name: Optional[str], arguments: Arguments) -> Observation:
        """One call, waited for (tests and the warm-up's traces)."""
        call = self.submit(name, arguments)
        if call.future is not None:
            try:
                call.future.result(timeout=self.timeout_s)
            except Exception:
                pass
        return call.observation(self.max_chars, force=True)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _timed(tool: Callable[[Arguments], str], arguments: Arguments):
    """The tool's result and the seconds it ran (not counting the wait for a free thread)."""
    started = time.monotonic()
    try:
        return tool(arguments), time.monotonic() - started
    except Exception as exc:
        exc.seconds = time.monotonic() - started
        raise


class Call:
    """One tool call in flight."""

    def __init__(self, future: Optional[Future], started: float, timeout_s: float, error: Optional[str] = None):
        self.future, self.started, self.deadline, self.error = future, started, started + timeout_s, error

    def ready(self, now: float) -> bool:
        return self.future is None or self.future.done() or now >= self.deadline

    def observation(self, max_chars: int, force: bool = False) -> Observation:
        seconds = time.monotonic() - self.started
        if self.future is None:
            return Observation(f"error: {self.error}", error=True)
        if not self.future.done():
            if not force and time.monotonic() < self.deadline:
                raise RuntimeError("observation() of a call still within its time")
            self.future.cancel()
            return Observation(f"error: timed out after {self.deadline - self.started:g} s", error=True,
                               timed_out=True, seconds=seconds)
        try:
            text, seconds = self.future.result()
        except ToolError as exc:
            timed_out = str(exc).startswith("timed out")
            return Observation(f"error: {exc}", error=True, timed_out=timed_out, seconds=getattr(exc, "seconds", 0.0))
        except Exception as exc:  # a tool that raises: the model sees the error, the batch goes on
            return Observation(f"error: {type(exc).__name__}: {str(exc)[:200]}", error=True,
                               seconds=getattr(exc, "seconds", 0.0))
        if len(text) > max_chars:
            text = text[:max_chars] + f"\n[... {len(text) - max_chars} more characters]"
        return Observation(text, seconds=seconds)
