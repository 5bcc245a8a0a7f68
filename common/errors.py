"""The two kinds of error a `grpo` command reports in one line (cluster/cli/exits.py), as bases
that each part's own errors derive from: the command line then needs none of the parts'
modules (nor Ray, nor torch) to tell which status an error ends with."""
from __future__ import annotations


class BadInput(ValueError):
    """The user's input (config, data, a request) cannot run: one line, exit status 2."""


class RunFailed(RuntimeError):
    """The run failed for a reason it can name (a lost learner rank, an engine that did not
    start, a weight push that timed out, a checkpoint that cannot be written): one line,
    exit status 1."""
