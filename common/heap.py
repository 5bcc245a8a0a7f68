"""The Python heap of a long-lived process: what its garbage collector need not walk again.

An actor's start imports its stack (torch, vLLM or DeepSpeed and transformers: hundreds of
thousands of tracked objects) and builds its engine. Each of Python's automatic full collections
walks every tracked object, and heavy imports trigger them again and again, several times per
process (vLLM's own in an engine's start included; bench/end_to_end.py's start-up). Young collections are
cheap and still run throughout, so short-lived garbage is freed as usual.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
from typing import Callable, Iterator

_UNFREEZE_AT_EXIT = False


def freeze_heap() -> None:
    """Collect once, then move every object still alive into the collector's permanent
    generation, which later full collections skip (vLLM's `freeze_gc_heap` does the same once
    its engine is up). What is frozen is still freed by reference counting; a reference cycle
    made among frozen objects later is not, until the heap is unfrozen. At exit the heap is
    unfrozen, so that the interpreter's last collection sees everything (extension modules such
    as triton's report every object still alive then as a leak)."""
    global _UNFREEZE_AT_EXIT
    if not _UNFREEZE_AT_EXIT:
        atexit.register(gc.unfreeze)
        _UNFREEZE_AT_EXIT = True
    gc.collect()  # the start's cyclic garbage (on a GPU it may hold device memory) is not frozen
    gc.freeze()


@contextlib.contextmanager
def without_full_collections() -> Iterator[None]:
    """For a process's start: within, no automatic full collections (young ones still run); on
    success, one collection and the heap frozen; the collector's thresholds restored either way."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, 10**9)
    try:
        yield
        freeze_heap()
    finally:
        gc.set_threshold(young, middle, full)


def started_without_full_collections(init: Callable) -> Callable:
    """An actor's `__init__` run within `without_full_collections()`: its imports and the engine
    it builds trigger full collections that walk the whole imported stack again and again."""
    @functools.wraps(init)
    def start(*args, **kwargs) -> None:
        with without_full_collections():
            init(*args, **kwargs)
    return start
