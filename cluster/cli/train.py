"""`grpo train` and `python -m cluster.train`: the config composed and checked, the data loaded,
the model folder and the prompts resolved, all before Ray, vLLM or DeepSpeed is imported (bad
input answers at once, with one line and status 2); then the run (cluster/loop/training.py)."""
from __future__ import annotations

import sys
import time
from typing import Dict, List, Optional

from omegaconf import OmegaConf

from cluster.cli.checks import check_inputs, check_local_resources, prepare_prompts, resolve_model
from cluster.cli.compose import compose_config, load_config
from cluster.cli.exits import guarded
from common import heap
from common.config import Config, freeze
from data.datasets import load_problems


def train(cfg: Config) -> Dict[str, object]:
    """The whole job for a validated `cfg`: its inputs checked and resolved here, then the run.
    Returns the run's summary."""
    started = time.time()
    freeze(cfg)  # what the run resolves goes into a copy (cluster/loop/launch.run_config)
    # The imports (torch, transformers) trigger full collections that walk the whole heap again
    # and again (common/heap.py).
    with heap.without_full_collections():
        heldout, train_set = load_problems(cfg.data, cfg.trainer.seed)
        check_inputs(cfg, train_set)
        # Before the model: a layout this machine cannot hold answers in a second, not after
        # the built-in model is built or a hub model downloaded.
        check_local_resources(cfg)
        model_path = resolve_model(cfg)
        heldout, train_set, inputs = prepare_prompts(cfg, model_path, heldout, train_set)
        # The run's modules (Ray, and the roles' callers) only now: every input is known good.
        from cluster.loop.training import run_job
    return run_job(cfg, inputs, train_set, heldout, started)


def command(overrides: List[str], print_config: bool = False) -> int:
    """`grpo train`: compose and check the config, then print it (--cfg) or run the job."""
    cfg = load_config(overrides)  # an impossible setting fails here, before printing or any actor
    if print_config:
        print(OmegaConf.to_yaml(compose_config(overrides)), end="")
        return 0
    train(cfg)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m cluster.train [--cfg] [overrides...]`: the same as `grpo train`."""
    args = list(sys.argv[1:] if argv is None else argv)
    return guarded(lambda: command([a for a in args if a != "--cfg"], print_config="--cfg" in args))
