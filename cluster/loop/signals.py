"""SIGTERM during a run (`ray job stop`, a scheduler's preemption): the GRPO steps end at the
next step boundary with a checkpoint; before the steps there is nothing to save, and the run
stops at once. A second SIGTERM exits at once (143), which loses at most the checkpoint being
written: the ones already on disk are whole (cluster/loop/checkpoint.py)."""
from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_PREEMPTED = 143  # 128 + SIGTERM: what schedulers expect of a job that ended on their signal


class Preempted(Exception):
    """The run stopped on SIGTERM; the message says where and how to go on."""


_stop_requested = threading.Event()
_steps_running = False


def watch_sigterm() -> None:
    """Install the SIGTERM handler; again after `ray.init`, which replaces it with its own."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)


class steps_running:
    """While the GRPO steps run, SIGTERM only asks them to stop at the next step boundary."""
    def __enter__(self):
        global _steps_running
        watch_sigterm()
        _steps_running = True
        return self

    def __exit__(self, *_):
        global _steps_running
        _steps_running = False


def stop_requested() -> bool:
    return _stop_requested.is_set()


def _terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_PREEMPTED))
    _stop_requested.set()
    if not _steps_running:
        raise Preempted("stopped by SIGTERM before the GRPO steps began; everything the run started "
                        "has been stopped (nothing to save yet: run it again)")
    print("grpo: SIGTERM: stopping after this step, with a checkpoint of it (a second SIGTERM exits at once)",
          file=sys.stderr, flush=True)
