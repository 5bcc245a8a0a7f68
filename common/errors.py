"""The two kinds of error a `grpo` command reports in one line (cluster/cli/exits.py), as bases
that each part's own errors derive from: the command line then needs none of the parts'
modules (nor Ray, nor torch) to tell which status an error ends with."""
from __future__ import annotations


def one_line(exc: BaseException) -> str:
    """An exception as one short line for a report: its type and the first line of its text."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


class BadInput(ValueError):
    """The user's input (config, data, a request) cannot run: one line, exit status 2."""


class RunFailed(RuntimeError):
    """The run failed for a reason it can name (a lost learner rank, an engine that did not
    start, a weight push that timed out, a checkpoint that cannot be written): one line,
    exit status 1."""
