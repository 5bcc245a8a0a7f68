"""GRPO from a Python script: the dataset a list of dicts, a reward a lambda, the settings keyword
arguments. It runs the job `grpo train` runs (cluster/trainer.py; docs/python.md).

    .venv/bin/python examples/train_from_python.py                      # 50 steps of the built-in task
    .venv/bin/python examples/train_from_python.py trainer.max_steps=2  # any `grpo train` override

The rows are the built-in addition task's (with a `solution` for the supervised warm-up); the
reward adds to the `math` verifier a small bonus for answers kept short, as a lambda: the
trainer pickles it (cloudpickle) into the config that the verifier processes load.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project, when run from a checkout

from cluster.trainer import GRPOTrainer  # noqa: E402
from data.datasets import arithmetic_problems  # noqa: E402

SHORT = 60
"""Characters a completion may take for the brevity bonus."""


def addition_rows(seed: int = 0, heldout: int = 200):
    """(train, held-out) rows as plain dicts: `prompt`, `answer`, `solution`."""
    splits = arithmetic_problems(seed, heldout, num_train=0, min_digits=2, max_digits=2)
    return [[{"prompt": p.prompt, "answer": p.answer, "solution": p.solution} for p in problems]
            for problems in (splits.train, splits.heldout)]


def make_trainer(overrides=()) -> GRPOTrainer:
    train_rows, heldout_rows = addition_rows()
    return GRPOTrainer(
        train_dataset=train_rows,
        eval_dataset=heldout_rows,
        reward_funcs={"math": "math",
                      "short": lambda completions, **_: [float(len(c) <= SHORT) for c in completions]},
        reward_weights={"math": 1.0, "short": 0.1},
        logger=["tensorboard"],
        config=list(overrides),  # applied after the keyword arguments: the command line's win
    )


if __name__ == "__main__":
    sys.exit(make_trainer(sys.argv[1:]).main())  # bad input: one line and status 2, as `grpo train`
