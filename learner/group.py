"""The learner's ranks as one group: start them together, call every rank, shard the groups."""
from __future__ import annotations

from typing import Dict, List, Sequence

import ray

from common.config import AlgoConfig, LearnerConfig
from common.ray_utils import free_port, node_ip
from learner.actor import LearnerRank
from learner.metrics import combine_metrics


class LearnerError(RuntimeError):
    """A learner rank died: the update cannot continue (its shard of the state is gone)."""


def _get(refs, method: str):
    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as error:
        raise LearnerError(f"a learner rank died during {method} ({type(error).__name__})") from error
    except ray.exceptions.RayTaskError:
        # A rank whose peer died mid-collective fails itself (gloo: the connection closed), and
        # that error can arrive before the dead rank's: the death is the cause to report.
        died = _dead_rank(refs)
        if died is None:
            raise
        raise LearnerError(f"a learner rank died during {method} ({type(died).__name__})") from died


def _dead_rank(refs, wait_s: float = 10.0):
    """The RayActorError of a rank that died, if one did (a dead actor's call fails within
    moments; the wait is bounded for ranks still stuck in a collective)."""
    ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    for ref in refs:
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as error:
            return error
        except Exception:  # a rank that failed but lives, or is still waiting
            continue
    return None


def _rendezvous_address():
    return node_ip(), free_port()


def _rendezvous(rank0_options: dict):
    """Where rank 0 will host torch.distributed's rendezvous: its node's address and a free port.
    On a one-node cluster that is the driver's node, known here. On several nodes a zero-CPU
    probe placed where rank 0 will be (`rank0_options`: its bundle) asks that node; the probe
    is a task, and a task needs a Ray worker process started for it (seconds on the start-up's
    critical path, before any actor is created)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if len(alive) == 1 and alive[0].get("NodeManagerAddress") == node_ip():
        return _rendezvous_address()
    probe = ray.remote(num_cpus=0)(_rendezvous_address).options(**rank0_options)
    return ray.get(probe.remote())


class LearnerGroup:
    def __init__(self, model_path: str, cfg: LearnerConfig, algo: AlgoConfig, max_new_tokens: int, seed: int,
                 placement=None, rank_class: type = LearnerRank):
        """`cfg.num_ranks` ranks; `placement(i)`: Ray actor options for rank i (its placement
        group bundle); `max_new_tokens`: the rollout's longest completion; `rank_class`: the
        ranks' actor class, a LearnerRank (tests use one that can start over in its process)."""
        actor = ray.remote(num_cpus=cfg.num_cpus_per_rank, num_gpus=cfg.num_gpus_per_rank)(rank_class)
        world = cfg.num_ranks
        options = [placement(i) if placement else {} for i in range(world)]
        master_addr, master_port = _rendezvous(options[0])
        self.ranks = [
            actor.options(**options[rank]).remote(rank, world, master_addr, master_port, model_path, cfg, algo,
                                                  max_new_tokens, seed)
            for rank in range(world)
        ]
        self.rank0 = self.ranks[0]

    def call(self, method: str, *args) -> list:
        """Call `method` on every rank at once (collectives need all of them) and wait."""
        return _get([getattr(r, method).remote(*args) for r in self.ranks], method)

    def warmup(self, steps: int, batch_size: int, lr: float, seed: int) -> List[float]:
        return self.call("warmup", steps, batch_size, lr, seed)[0]

    def train_step(self, group_refs: Sequence[ray.ObjectRef], temperature: float, lr: float) -> Dict[str, float]:
        """Each rank gets an equal, contiguous share of whole groups; their metrics are combined
        as the whole batch's (learner/metrics.py: token means weighted by each rank's tokens)."""
        per_rank, rest = divmod(len(group_refs), len(self.ranks))
        if rest or not per_rank:
            raise ValueError(f"{len(group_refs)} prompt groups cannot be split evenly over {len(self.ranks)} ranks")
        shards = [list(group_refs[i * per_rank:(i + 1) * per_rank]) for i in range(len(self.ranks))]
        results = _get([r.train_step.remote(shard, temperature, lr) for r, shard in zip(self.ranks, shards)], "train_step")
        # Each rank's own peak of the step besides the largest (ranks differ: ZeRO's partitions, rank 0's sync).
        peaks = {f"learner_peak_memory_mb/rank{i}": r["learner_peak_memory_mb"] for i, r in enumerate(results)}
        return {**combine_metrics(results), **peaks}

    def save_checkpoint(self, folder: str) -> None:
        """Every rank writes its part of the checkpoint (DeepSpeed saving is collective)."""
        self.call("save_checkpoint", folder)

    def save_pretrained(self, folder: str, part: str = "merged") -> str:
        return self.call("save_pretrained", folder, part)[0]

    def shutdown(self) -> None:
        for r in self.ranks:
            ray.kill(r)
