"""The quiet start of an actor's heap: no automatic full collections within, frozen after."""
from __future__ import annotations

import gc

from common import heap


def test_a_quiet_start_holds_full_collections_then_freezes_what_it_built_and_restores_the_thresholds():
    before = gc.get_threshold()
    gc.unfreeze()
    try:
        with heap.quiet_start():
            young, middle, full = gc.get_threshold()
            assert (young, middle) == before[:2] and full > 10**6  # young collections still run
            built = [[i] for i in range(1000)]  # tracked objects made during the start
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() >= len(built)
    finally:
        gc.unfreeze()


def test_a_failing_start_still_restores_the_thresholds():
    before = gc.get_threshold()
    try:
        with heap.quiet_start():
            raise RuntimeError("the engine did not start")
    except RuntimeError:
        pass
    finally:
        gc.unfreeze()
    assert gc.get_threshold() == before
