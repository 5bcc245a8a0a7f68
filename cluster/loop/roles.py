"""The three roles and the channel between them, started together and stopped together."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Type

from cluster.loop.batches import generation_requests
from cluster.loop.placement import Placement
from cluster.loop.sync_channel import WeightSyncChannel
from common.backends import GenerationBackend, Scorer
from common.config import Config, RewardConfig
from learner.group import LearnerGroup
from reward.pool import VerifierPool
from reward.judge import JudgePool
from reward.model_scorer import ModelBackedScorer
from reward.reward_model import RewardModelPool
from reward.scorer import VerifierScorer
from rollout.pool import RolloutPool
from rollout.worker import GenerationWorker

BACKENDS: Dict[str, Type[GenerationBackend]] = {"vllm": GenerationWorker}
"""The generation backends by `rollout.backend`: a second one is a class and an entry here."""
SCORERS: Dict[str, Callable[[RewardConfig, Sequence[str]], Scorer]] = {"verifiers": VerifierScorer}
"""What scores completions in a verifier actor, by `reward.scorer`."""


@dataclass
class Roles:
    rollout: RolloutPool
    verifiers: VerifierPool
    learner: LearnerGroup
    channel: WeightSyncChannel
    placement: Optional[Placement] = None

    def shutdown(self) -> None:
        """Every role's actors and the placement groups, whichever of them still answer."""
        for part in (self.rollout, self.verifiers, self.learner):
            try:
                part.shutdown()
            except Exception:  # a dead actor or a lost node: the others still go
                pass
        if self.placement is not None:
            try:
                self.placement.remove()
            except Exception:
                pass

    def restart_learner(self, cfg: Config) -> None:
        """A lost learner rank (or node): the whole group goes (its other ranks hold shards of
        a state that cannot continue without the lost one), its placement group is made again,
        new ranks start in it and the weight-sync channel joins the new rank 0. The caller
        loads a checkpoint into them and pushes it."""
        try:
            self.learner.shutdown()
        except Exception:  # ranks already gone
            pass
        self.placement.replace("learner")
        self.learner = start_learner(cfg, self.placement)
        self.channel.repoint(self.learner)


def start_learner(cfg: Config, placement):
    # With LoRA and no warm-up nothing trains the whole model: the ranks build only the
    # adapters' engine (no full optimizer state at any point). A warm-up that finds no solved
    # rows to train on leaves the full engine built and unused until the snapshot: correct, not lean.
    return LearnerGroup(cfg.model.path, cfg.learner, cfg.algo, cfg.rollout.completion_budget, cfg.trainer.seed,
                        placement=lambda i: placement.options("learner", i),
                        adapters_from_start=bool(cfg.learner.lora.rank) and cfg.warmup.steps == 0)


def start_roles(cfg: Config) -> Roles:
    """Each role in its own placement group, on the nodes `cluster.nodes` names; each actor gets
    its config section as the typed dataclass."""
    placement = Placement(cfg, cfg.cluster.placement_timeout_s)
    # The learner starts first: its DeepSpeed set-up overlaps the (slower) vLLM engine start-up.
    learner = start_learner(cfg, placement)
    verifiers = start_verifiers(cfg, placement)
    rollout = start_rollout(cfg, placement)
    channel = WeightSyncChannel(learner, rollout, cfg.rollout.dtype, cfg.sync.bucket_mb, cfg.sync.timeout_s,
                                cfg.sync.transport)
    rollout.recover = channel.recover
    return Roles(rollout=rollout, verifiers=verifiers, learner=learner, channel=channel, placement=placement)


def start_rollout(cfg: Config, placement: Optional[Placement] = None) -> RolloutPool:
    """The generation pool of `rollout.backend`, in its placement group when given."""
    return RolloutPool(cfg.model.path, cfg.rollout, cfg.trainer.seed, backend=BACKENDS[cfg.rollout.backend],
                       placement=(lambda i: placement.options("rollout", i)) if placement else None)


def start_verifiers(cfg: Config, placement: Optional[Placement] = None) -> VerifierPool:
    """The verifier pool, each actor scoring with `reward.scorer`, in its placement group when given.
    With a model verifier (reward_model, judge) its model actors start first, as a pool of their
    own (Ray resources of `reward.model` / `reward.judge`), and each verifier actor's scorer calls them."""
    make_scorer = SCORERS[cfg.reward.scorer]
    model_pools = {}
    if "reward_model" in cfg.reward.verifiers:
        model_pools["reward_model"] = RewardModelPool(cfg.reward.model)
    if "judge" in cfg.reward.verifiers:
        model_pools["judge"] = JudgePool(cfg.reward.judge)
    if model_pools:
        make_scorer = functools.partial(ModelBackedScorer, make_scorer,
                                        {name: pool.workers for name, pool in model_pools.items()})
    pool = VerifierPool(cfg.reward, make_scorer=make_scorer,
                        placement=(lambda i: placement.options("reward", i)) if placement else None)
    pool.model_pools.extend(model_pools.values())
    return pool


def evaluate(roles: Roles, problems) -> float:
    """Greedy accuracy on `problems` through the vLLM actors and the verifier pool."""
    generated = roles.rollout.generate(generation_requests(list(enumerate(problems)), 0), 1, greedy=True)
    _, stats = roles.verifiers.score(generated.refs)
    key = "score_sum/math" if "score_sum/math" in stats else next(k for k in stats if k.startswith("score_sum/"))
    return stats[key] / max(stats["completions"], 1)
