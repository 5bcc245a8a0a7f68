"""Batches saved ahead of the learner in a checkpoint (async mode) still load after the classes
they were pickled with moved: a checkpoint of an earlier version resumes."""
import dataclasses
import pickle
import sys
import types

from cluster.loop.batches import Batch, unpickle
from common.problem import Problem


def _pickled_under(names: dict, obj) -> bytes:
    """`obj` pickled while each class in `names` claims the old module name it maps to."""
    saved = {cls: cls.__module__ for cls in names}
    try:
        for cls, module in names.items():
            sys.modules[module] = types.SimpleNamespace(**{cls.__name__: cls})
            cls.__module__ = module
        return pickle.dumps(obj)
    finally:
        for cls, module in saved.items():
            sys.modules.pop(names[cls], None)
            cls.__module__ = module


def test_batches_pickled_under_the_old_module_names_load_as_today_s_classes():
    problem = Problem("2+2=", "4", fields={"k": 1})
    batch = Batch(refs=[b"group"], items=[(7, problem)], versions=[3], reward_stats={}, metrics={"m": 1.0},
                  times={})
    data = _pickled_under({Batch: "cluster.batches", Problem: "rollout.datasets"}, [(5, batch)])
    assert b"cluster.batches" in data and b"rollout.datasets" in data
    [(step, loaded)] = unpickle(data)
    assert step == 5 and type(loaded) is Batch and type(loaded.items[0][1]) is Problem
    assert dataclasses.asdict(loaded) == dataclasses.asdict(batch)
