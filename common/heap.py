"""The Python heap of a long-lived process: what its garbage collector need not walk again.

An actor's start imports its stack (torch, vLLM or DeepSpeed and transformers: 0.4-0.7 million
tracked objects) and builds its engine. Python's automatic full collections walk every tracked
object, and during such a start they run again and again (seven of them while a learner rank
imports DeepSpeed and transformers and loads its model, 0.6-0.9 s); vLLM's engine runs five
more itself. Young collections still run throughout, so short-lived garbage is freed as usual.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
from typing import Iterator

_UNFREEZE_AT_EXIT = False


def freeze_heap() -> None:
    """Move every object alive now into the collector's permanent generation: later full
    collections skip it. These objects live as long as the process (modules, the model, the
    engine); they are still freed by reference counting, and only a cycle among them would stay.
    vLLM freezes its own heap the same way once its engine is up (`freeze_gc_heap`). At exit the
    heap is unfrozen, so that the interpreter's last collection sees everything (extension
    modules such as triton's report every object still alive then as a leak)."""
    global _UNFREEZE_AT_EXIT
    if not _UNFREEZE_AT_EXIT:
        atexit.register(gc.unfreeze)
        _UNFREEZE_AT_EXIT = True
    gc.freeze()


@contextlib.contextmanager
def quiet_start() -> Iterator[None]:
    """Within: no automatic full collections (young ones still run). On leaving: what the start
    built is frozen, and the collector's thresholds are as they were."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, 10**9)
    try:
        yield
    finally:
        freeze_heap()
        gc.set_threshold(young, middle, full)
