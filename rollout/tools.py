"""The tools a model may call between turns of an episode, and the box that runs the calls.

Built in:
- `calculator`: exact arithmetic on integers, decimals and fractions (`+ - * / // % **`,
  parentheses, unary minus), never `eval`ed (common/calculator.py: the warm-up traces call it too).
- `python`: runs the code in the same sandbox as the `code` verifier (no network, no home, no
  secrets, CPU/memory/process/file limits, killed at `rollout.tool_timeout_s`) and returns what
  it printed, cut to `rollout.tool_max_output_chars`.

Your own: `+rollout.custom_tools.NAME=module:function`, called with the call's arguments
(`function(text)` for the tag format, `function(**arguments)` for JSON calls) and returning
text. It runs in a child process of the generation actor (`rollout/tool_process.py`), kept warm
between calls: a call past `rollout.tool_timeout_s` kills that process (an error observation,
counted) and a fresh one imports the module again, so a tool that hangs costs one call, never
a slot. Module state (a loaded index) lives as long as the process; the arguments and the
result cross a pipe, so they must pickle (text and JSON values do).

Each kind of call has its own lane (`Lanes`): the python tool's sandboxes, the custom tools'
processes, the calculator's threads. A call's time limit counts from when it starts running,
and a lane with every slot busy and its queue full answers a new call at once with a `busy`
error, so hung programs of some episodes never time out the calls of others.

Every call returns an `Observation`; a tool that raises, hangs or floods gives an error text,
never an exception: one bad call costs its own episode a turn, never the batch.
"""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

from common.calculator import ToolError, calculator
from common.plugins import load_function
from common.sandbox import SandboxLimits, run_python
from common.sandbox import kill as kill_sandbox
from rollout.tool_process import ToolProcess, ToolProcessError, ToolRaised

Arguments = Union[str, Mapping[str, Any]]


@dataclass(frozen=True)
class Observation:
    text: str
    error: bool = False
    """The call could not run (malformed, unknown tool, raised, timed out)."""
    timed_out: bool = False
    seconds: float = 0.0
    """How long the tool ran (a call that timed out: until it was given up)."""


# --------------------------------------------------------------------------- python


class _Sandboxes:
    """The python tool's sandboxes that are running, so that closing the box ends them."""

    def __init__(self):
        self.running, self.closed, self.lock = set(), False, threading.Lock()

    def started(self, proc) -> None:
        with self.lock:
            self.running.add(proc)
            closed = self.closed
        if closed:
            kill_sandbox(proc)

    def ended(self, proc) -> None:
        with self.lock:
            self.running.discard(proc)

    def close(self) -> None:
        with self.lock:
            self.closed, running = True, list(self.running)
        for proc in running:
            kill_sandbox(proc)


def python_tool(limits: SandboxLimits, max_chars: int,
                sandboxes: Optional[_Sandboxes] = None) -> Callable[[Arguments], str]:
    def run(code: Arguments) -> str:
        if isinstance(code, Mapping):
            code = code.get("code", "")
        mine = []

        def started(proc) -> None:
            mine.append(proc)
            sandboxes.started(proc)

        result = run_python(str(code), "", limits, capture_chars=max_chars,
                            on_start=started if sandboxes is not None else None)
        for proc in mine:
            sandboxes.ended(proc)
        if result.timed_out:
            raise ToolError(f"timed out after {limits.timeout_s:g} s")
        if not result.passed and not result.output:
            raise ToolError(result.error)
        return result.output
    return run


# --------------------------------------------------------------------------- the box


@dataclass(frozen=True)
class Lanes:
    """How many calls of each kind run at once, and how many more may wait for a free slot.
    A call beyond both is answered at once with an error observation (the model may call again
    next turn) rather than waiting behind calls that may all hang to their limit."""
    sandbox_slots: int = 8
    sandbox_queue: int = 8
    custom_slots: int = 4
    """Child processes for custom tools (each started at its first call, then kept)."""
    custom_queue: int = 8
    inline_slots: int = 2
    """Threads for the calculator: bounded by its size limits, so its queue is not."""


class _Lane:
    """One kind of call (sandboxed, custom, in-process) with threads and a bound of its own, so
    that hung calls of one kind never delay the calls of another."""

    def __init__(self, label: str, slots: int, queue: Optional[int]):
        self.label = label
        self.capacity = None if queue is None else slots + queue
        self.pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix=f"tool-{label.split()[0]}")
        self.in_flight, self.lock = 0, threading.Lock()

    def submit(self, fn: Callable, *args) -> Optional[Future]:
        """The call's future, or None when the lane is full."""
        with self.lock:
            if self.capacity is not None and self.in_flight >= self.capacity:
                return None
            self.in_flight += 1
        future = self.pool.submit(fn, *args)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, _future: Future) -> None:
        with self.lock:
            self.in_flight -= 1


Runner = Callable[[Arguments, Callable[[], None]], Tuple[str, int]]
"""A tool as the box runs it: (arguments, start) -> (text cut to max_chars, characters cut);
it calls start() when the tool itself begins (after any wait for its process)."""


def _in_thread(fn: Callable[[Arguments], str], max_chars: int) -> Runner:
    def run(arguments: Arguments, start: Callable[[], None]) -> Tuple[str, int]:
        start()
        text = fn(arguments)
        return text[:max_chars], max(len(text) - max_chars, 0)
    return run


class _CustomProcesses:
    """One ToolProcess per thread of the custom lane: a hung call kills only its own."""

    def __init__(self, custom: Mapping[str, str], search_path: Sequence[str], timeout_s: float, max_chars: int):
        self.custom, self.search_path = dict(custom), list(search_path)
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self.local, self.processes, self.lock, self.closed = threading.local(), [], threading.Lock(), False

    def runner(self, name: str) -> Runner:
        def run(arguments: Arguments, start: Callable[[], None]) -> Tuple[str, int]:
            try:
                return self._process().call(name, arguments, self.timeout_s, self.max_chars, start)
            except (ToolProcessError, ToolRaised) as exc:
                raise ToolError(str(exc)) from None
        return run

    def _process(self) -> ToolProcess:
        proc = getattr(self.local, "proc", None)
        if proc is None:
            with self.lock:
                if self.closed:
                    raise ToolProcessError("the tool box is closed")
                proc = ToolProcess(self.custom, self.search_path)
                self.processes.append(proc)
            self.local.proc = proc
        return proc

    def close(self) -> None:
        with self.lock:
            self.closed = True
        for proc in self.processes:
            proc.close()


class ToolBox:
    """The enabled tools, each kind on a lane of its own beside the engine (the python tool's
    sandboxes, custom tools' processes, the calculator's threads). `submit` never blocks;
    `collect` turns a finished (or overdue) call into its Observation."""

    def __init__(self, names: Sequence[str], custom: Mapping[str, str], timeout_s: float, max_chars: int,
                 sandbox: SandboxLimits, lanes: Lanes = Lanes(), search_path: Sequence[str] = ()):
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self.sandboxes = _Sandboxes()
        self.lanes = [_Lane("calculator", lanes.inline_slots, None),
                      _Lane("python sandbox", lanes.sandbox_slots, lanes.sandbox_queue),
                      _Lane("custom tool", lanes.custom_slots, lanes.custom_queue)]
        inline, sandboxed, own = self.lanes
        self.tools: Dict[str, Tuple[_Lane, Runner]] = {}
        for name in names:
            if name == "calculator":
                self.tools[name] = (inline, _in_thread(calculator, max_chars))
            elif name == "python":
                self.tools[name] = (sandboxed, _in_thread(python_tool(sandbox, max_chars, self.sandboxes), max_chars))
        for path in custom.values():
            load_function(path, search_path)  # a bad name fails here, before any process starts
        self.custom = _CustomProcesses(custom, search_path, timeout_s, max_chars) if custom else None
        for name in custom:
            self.tools[name] = (own, self.custom.runner(name))

    @property
    def names(self) -> list:
        return sorted(self.tools)

    def submit(self, name: Optional[str], arguments: Arguments) -> "Call":
        if name not in self.tools:
            return self.malformed(f"unknown tool {name!r} (tools: {', '.join(self.names)})")
        lane, runner = self.tools[name]
        call = Call(self.timeout_s)
        call.future = lane.submit(_timed, call, runner, arguments)
        if call.future is None:
            call.fail(f"busy: {lane.capacity} {lane.label} calls are running or waiting; call again later")
        return call

    def malformed(self, error: str) -> "Call":
        """A call that could not be parsed: its observation is the error, at once."""
        call = Call(self.timeout_s)
        call.fail(error)
        return call

    def run(self, name: Optional[str], arguments: Arguments) -> Observation:
        """One call, waited for (tests and the warm-up's traces)."""
        call = self.submit(name, arguments)
        while not call.ready(time.monotonic()):
            wait([call.future], timeout=0.05)
        return call.observation(self.max_chars, force=True)

    def close(self) -> None:
        """Cancel the calls that wait, end the ones that run (sandboxes and custom processes
        are killed), and join every thread."""
        for lane in self.lanes:
            lane.pool.shutdown(wait=False, cancel_futures=True)
        self.sandboxes.close()
        if self.custom is not None:
            self.custom.close()
        for lane in self.lanes:
            lane.pool.shutdown(wait=True)


def _timed(call: "Call", runner: Runner, arguments: Arguments):
    """The tool's result and the seconds it ran (not counting its wait for a free slot)."""
    try:
        text, dropped = runner(arguments, call.start)
        return text, dropped, time.monotonic() - (call.started or time.monotonic())
    except Exception as exc:
        exc.seconds = time.monotonic() - call.started if call.started is not None else 0.0
        raise


class Call:
    """One tool call in flight. Its time limit counts from when the tool starts running, not
    from when it was submitted: a call that waits for a free slot is never timed out unseen."""

    def __init__(self, timeout_s: float):
        self.timeout_s, self.future, self.error = timeout_s, None, None
        self.submitted = time.monotonic()
        self.started: Optional[float] = None

    def start(self) -> None:
        self.started = time.monotonic()

    def fail(self, error: str) -> None:
        self.error, self.started = error, time.monotonic()

    @property
    def deadline(self) -> float:
        return math.inf if self.started is None else self.started + self.timeout_s

    def ready(self, now: float) -> bool:
        return self.future is None or self.future.done() or now >= self.deadline

    def observation(self, max_chars: int, force: bool = False) -> Observation:
        if self.future is None:
            return Observation(f"error: {self.error}", error=True)
        if not self.future.done():
            if not force and time.monotonic() < self.deadline:
                raise RuntimeError("observation() of a call still within its time")
            self.future.cancel()
            seconds = time.monotonic() - self.started if self.started is not None else 0.0
            return Observation(f"error: timed out after {self.timeout_s:g} s", error=True,
                               timed_out=True, seconds=seconds)
        try:
            text, dropped, seconds = self.future.result()
        except CancelledError:
            return Observation("error: the tool box closed before the call ran", error=True)
        except ToolError as exc:
            timed_out = str(exc).startswith("timed out")
            return Observation(f"error: {exc}", error=True, timed_out=timed_out, seconds=getattr(exc, "seconds", 0.0))
        except Exception as exc:  # a tool that raises: the model sees the error, the batch goes on
            return Observation(f"error: {type(exc).__name__}: {str(exc)[:200]}", error=True,
                               seconds=getattr(exc, "seconds", 0.0))
        if dropped:
            text += f"\n[... {dropped} more characters]"
        return Observation(text, seconds=seconds)
