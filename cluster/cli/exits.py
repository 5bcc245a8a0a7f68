"""How a `grpo` command ends: exit statuses, one-line errors, Ctrl-C, SIGTERM.

Bad input (config, data, requests) is status 2 with one line, before any actor starts where
possible; a run that failed and says why is status 1; Ctrl-C is 130 once everything the run
started has been stopped.

SIGTERM is 143, after a checkpoint when the GRPO steps had begun (cluster/loop/signals.py).
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
from typing import Callable, Optional

from cluster.loop.signals import EXIT_PREEMPTED, Preempted, watch_sigterm
from common.errors import BadInput, RunFailed

EXIT_RUN_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # what a shell reports for a command stopped by Ctrl-C


def fail(message: str) -> int:
    print(f"grpo: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def guarded(command: Callable[[], int]) -> int:
    """Run `command` with the errors it may raise turned into statuses and one line each."""
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where every thread is
    signal.signal(signal.SIGINT, _interrupt)
    watch_sigterm()
    try:
        return command()
    except KeyboardInterrupt:  # the run has already let its actors and Ray go (cluster/loop/run.py)
        print("grpo: interrupted; everything the run started has been stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Preempted as stopped:
        print(f"grpo: {stopped}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    except Exception as exc:
        status = _status(exc)
        if status is None:
            raise
        return status


def _status(exc: Exception) -> Optional[int]:
    """The exit status of an error a command reports in one line; None for any other (a bug:
    its traceback is shown)."""
    if isinstance(exc, BadInput):
        return fail(str(exc))
    if isinstance(exc, RunFailed):  # the run failed, and says why
        print(f"grpo: error: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return None


def _interrupt(signum, frame) -> None:
    """The first Ctrl-C stops the run cleanly (KeyboardInterrupt, then its clean-up); a second
    one while that clean-up runs exits at once."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(EXIT_INTERRUPTED))
    raise KeyboardInterrupt
