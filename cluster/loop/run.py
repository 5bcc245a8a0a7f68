"""One training run as an object: what it holds while it runs, and one `close()` that lets all of
it go on every way out (the last step, an error, Ctrl-C)."""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple, Union

import ray

from cluster.loop.batches import AsyncBatches, Batch, SyncBatches
from cluster.loop.buffer import RolloutBuffer
from cluster.loop.launch import (
    ACTOR_ENV,
    check_resources,
    make_run_dir,
    node_cpus,
    plan_threads,
    run_config,
    run_name,
    say,
    show_prompt,
)
from cluster.loop.metrics import MetricsLogger
from cluster.loop.roles import Roles, start_roles
from cluster.loop.samples import SampleLog
from cluster.loop.signals import watch_sigterm
from common.config import Config
from common.messages import ResolvedInputs
from common.ray_utils import init_ray
from data.datasets import PromptSampler
from learner import memory_plan
from learner.engines import host_optimizer_line


@dataclass
class Run:
    cfg: Config
    """The run's config: the validated one until `start`, then a copy of it with what the run
    resolved filled in (launch.run_config), which the roles get and config.yaml records. The
    validated config itself is never written."""
    inputs: ResolvedInputs
    """The model folder, the stops and the rendered prompts' info (cluster/cli/checks.prepare_prompts)."""
    started: float = field(default_factory=time.time)
    run_dir: Optional[Path] = None
    roles: Optional[Roles] = None
    batches: Optional[Union[SyncBatches, AsyncBatches]] = None
    """The batch source (cluster/loop/batches.py); in async mode it owns a thread."""
    buffer: RolloutBuffer = field(default_factory=RolloutBuffer)
    logger: Optional[MetricsLogger] = None
    """The MetricsLogger (metrics.jsonl, the dashboards of logger.backends, the progress bar)."""
    version: int = 0
    """The policy version the generation workers hold."""
    sampler: Optional[PromptSampler] = None
    """Which training prompts come next (data/datasets.py's PromptSampler)."""
    accuracy_before: float = 0.0
    """Held-out greedy accuracy GRPO started from."""
    samples: Optional[SampleLog] = None
    """The SampleLog (samples.jsonl: which samples each step trained on)."""
    ahead: List[Tuple[int, Batch]] = field(default_factory=list)
    """Async mode, resumed: the (step, Batch) pairs the checkpoint saved as made ahead."""
    learner_restarts: int = 0
    """Times the learner group was rebuilt after losing a rank (cluster/loop/recovery.py)."""
    checkpoint_seconds: List[float] = field(default_factory=list)
    """Seconds of each checkpoint written (the summary reports their count and sum)."""
    def say(self, message: str) -> None:
        say(message, self.started)

    def start(self) -> None:
        """Ray, the run's config, its folder, the actors of every role."""
        cfg = self.cfg
        dashboard = init_ray(cfg.ray.address, cfg.ray.num_cpus, env_vars=ACTOR_ENV, num_gpus=cfg.ray.num_gpus)
        watch_sigterm()  # ray.init put its own SIGTERM handler (a plain exit) in place of ours
        self.say(f"Ray dashboard: {dashboard}" if dashboard else "Ray: a local instance (no dashboard; join a "
                 "cluster with RAY_ADDRESS or ray.address to get one)")
        check_resources(cfg)  # a request the cluster cannot hold would otherwise wait forever
        threads = plan_threads(cfg, node_cpus())
        if threads:
            self.say(threads.line)
        memory = memory_plan.start_line(self.inputs.model_path, cfg.learner, cfg.algo.beta,
                                        on_gpu=cfg.learner.num_gpus_per_rank > 0)
        if memory:
            self.say(memory)
        self.cfg = cfg = run_config(cfg, self.inputs, run_name(cfg), threads)
        offload = host_optimizer_line(cfg.learner, on_gpu=cfg.learner.num_gpus_per_rank > 0)
        if offload:  # before the ranks start: compiling its op holds up their start for minutes
            self.say(offload)
        self.run_dir = make_run_dir(cfg)
        show_prompt(self.run_dir, self.inputs.prompts, self.started)
        self.roles = start_roles(cfg)
        self.say(f"actors ready: {cfg.rollout.num_workers} vLLM workers, {cfg.reward.num_workers} verifiers, "
                 f"{cfg.learner.num_ranks} DeepSpeed ZeRO-{cfg.learner.zero_stage} learner ranks")

    def open_logger(self, first_step: int) -> None:

        cfg = self.cfg
        self.logger = MetricsLogger(self.run_dir, asdict(cfg), cfg.trainer.max_steps, cfg.logger,
                                    cfg.trainer.progress, resume_step=first_step - 1)
        self.samples = SampleLog(self.run_dir, resume_step=first_step - 1)

    def close_logger(self) -> Optional[str]:
        """Finish the logger; returns the wandb run's folder (None without wandb)."""
        logger, self.logger = self.logger, None
        return logger.close() if logger is not None else None

    def stop_batches(self) -> None:
        batches, self.batches = self.batches, None
        if batches is not None:
            batches.close()

    def stop_roles(self) -> None:
        roles, self.roles = self.roles, None
        if roles is not None:
            roles.shutdown()

    def close(self) -> None:
        """The async batch thread, the logger, the actors and placement groups, Ray: whatever
        was started, whichever way the run ends. Safe to call twice. A part that fails to stop
        is reported in one line and the others still stop (raising here would hide the error
        that ended the run)."""
        for stop in (self.stop_batches, self.close_logger, self.stop_roles, ray.shutdown):
            try:
                stop()
            except Exception as error:
                print(f"grpo: warning: {stop.__name__} failed while stopping: {type(error).__name__}: {error}",
                      file=sys.stderr, flush=True)
