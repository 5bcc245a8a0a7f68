"""A process's start without full garbage collections (common/heap.py)."""
from __future__ import annotations

import gc

import pytest

from common import heap


def test_within_no_full_collection_runs_young_ones_do_and_after_the_heap_is_frozen_and_thresholds_restored():
    before = gc.get_threshold()
    generations = []

    def seen(phase, info):
        if phase == "start":
            generations.append(info["generation"])

    gc.unfreeze()
    gc.callbacks.append(seen)
    try:
        with heap.without_full_collections():
            assert gc.get_threshold()[:2] == before[:2]
            built = [[i] for i in range(300_000)]  # enough allocations for many young collections
            inside = list(generations)
        assert inside and 2 not in inside, inside  # young collections ran, no full one
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() >= len(built)
    finally:
        gc.callbacks.remove(seen)
        gc.unfreeze()


def test_a_failing_start_restores_the_thresholds_and_freezes_nothing():
    before = gc.get_threshold()
    gc.unfreeze()
    with pytest.raises(RuntimeError, match="the engine did not start"):
        with heap.without_full_collections():
            raise RuntimeError("the engine did not start")
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
