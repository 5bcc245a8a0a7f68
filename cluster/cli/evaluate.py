"""`grpo eval MODEL_DIR [overrides]`: the config and the evaluation data checked and the prompts
rendered before Ray is imported; then the evaluation job (cluster/loop/eval_job.py)."""
from __future__ import annotations

import os
import time
from typing import Sequence

from cluster.cli.checks import check_local_resources, prepare_prompts, resolve_model
from cluster.cli.compose import load_config
from cluster.cli.exits import fail
from cluster.layout import EVAL_ROLES
from common.config import freeze
from data.datasets import load_eval_problems


def command(model_dir: str, overrides: Sequence[str]) -> int:
    """`grpo eval MODEL_DIR [overrides]`."""
    if not os.path.isdir(model_dir):
        return fail(f"eval: no such model folder '{model_dir}'")
    cfg = load_config(["model=hf", f"model.path={os.path.abspath(model_dir)}", *overrides])
    started = time.time()
    freeze(cfg)  # what the job resolves goes into a copy (cluster/loop/launch.run_config)
    problems = load_eval_problems(cfg.data, cfg.trainer.seed)
    check_local_resources(cfg, EVAL_ROLES)
    problems, _, inputs = prepare_prompts(cfg, resolve_model(cfg), problems, [])
    # The job's modules (Ray, the pools) only now: every input is known good.
    from cluster.loop.eval_job import evaluate_model

    evaluate_model(cfg, inputs, problems, started)
    return 0
