"""The learner's ranks as one group: start them together, call every rank, shard the groups.

The driver reaches the ranks only through this class's methods."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import ray

from common.config import AlgoConfig, LearnerConfig
from common.errors import RunFailed
from common.ray_utils import actor_index, death_cause, first_death, free_port, node_ip
from learner.actor import LearnerRank
from learner.metrics import combine_metrics, version_token_metrics
from learner.peak_memory import allocator_env


class LearnerError(RunFailed):
    """A learner rank died: the update cannot continue (its shard of the state is gone)."""


DEATH_WAIT_S = 10.0
"""How long a failed call waits for its group's other calls before asking which rank died
(ranks still stuck in a collective never answer)."""

def _get(refs, method: str):
    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as error:
        raise LearnerError(f"a learner rank died during {method}: {death_cause(error)}") from error
    except ray.exceptions.RayTaskError:
        # A rank whose peer died mid-collective fails itself (gloo: the connection closed), and
        # that error can arrive before the dead rank's: the death is the cause to report.
        died = first_death(refs, DEATH_WAIT_S)
        if died is None:
            raise
        raise LearnerError(f"a learner rank died during {method}: {death_cause(died)}") from died


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


def _with_env(options: dict, env: Dict[str, str]) -> dict:
    """Actor `options` whose process also starts with `env` (Ray merges a runtime_env's
    variables into the job's)."""
    if not env:
        return options
    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env}
    return {**options, "runtime_env": runtime_env}


class LearnerGroup:
    def __init__(self, model_path: str, cfg: LearnerConfig, algo: AlgoConfig, max_new_tokens: int, seed: int,
                 placement=None, rank_class: type = LearnerRank, adapters_from_start: bool = False):
        """`cfg.num_ranks` ranks; `placement(i)`: Ray actor options for rank i (its placement
        group bundle); `max_new_tokens`: the rollout's longest completion; `rank_class`: the
        ranks' actor class, a LearnerRank (tests use one that can start over in its process);
        `adapters_from_start`: with LoRA, no warm-up trains the whole model first."""
        actor = ray.remote(num_cpus=cfg.num_cpus_per_rank, num_gpus=cfg.num_gpus_per_rank)(rank_class)
        world = cfg.num_ranks
        options = [placement(i) if placement else {} for i in range(world)]
        master_addr, master_port = _rendezvous(options[0])
        env = allocator_env(cfg)
        self.ranks = [
            actor.options(**_with_env(options[rank], env)).remote(
                rank, world, master_addr, master_port, model_path, cfg, algo, max_new_tokens, seed, adapters_from_start)
            for rank in range(world)
        ]

    def load_warmup(self, examples, end_ids: Optional[List[int]] = None) -> int:
        """Every rank tokenises the warm-up's (prompt, target) pairs (`examples`: a list, or
        its ObjectRef); returns how many."""
        return _get([r.load_warmup.remote(examples, end_ids) for r in self.ranks], "load_warmup")[0]

    def warmup(self, steps: int, batch_size: int, lr: float, seed: int) -> List[float]:
        return _get([r.warmup.remote(steps, batch_size, lr, seed) for r in self.ranks], "warmup")[0]

    def snapshot_reference(self) -> None:
        """pi_ref is the policy now (with LoRA: adapters are trained from here on)."""
        _get([r.snapshot_reference.remote() for r in self.ranks], "snapshot_reference")

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
        results, versions = version_token_metrics(results)
        return {**combine_metrics(results), **peaks, **versions}

    def save_checkpoint(self, folder: str) -> None:
        """Every rank writes its part of the checkpoint (DeepSpeed saving is collective)."""
        _get([r.save_checkpoint.remote(folder) for r in self.ranks], "save_checkpoint")

    def load_checkpoint(self, folder: str) -> None:
        _get([r.load_checkpoint.remote(folder) for r in self.ranks], "load_checkpoint")

    def save_pretrained(self, folder: str, part: str = "merged") -> str:
        return _get([r.save_pretrained.remote(folder, part) for r in self.ranks], "save_pretrained")[0]

    # ---- the weight-sync sender (learner/weight_sender.py); rank 0 is the group's root -------
    def weight_spec(self, dtype: str, bucket_mb: float, part: str = "policy") -> Optional[dict]:
        """What a push sends (None: `base` of a policy that pushes no adapters). Every rank
        joins: under ZeRO-3 reading the full shapes is a collective gather."""
        return _get([r.weight_spec.remote(dtype, bucket_mb, part) for r in self.ranks], "weight_spec")[0]

    def sync_address(self) -> Tuple[str, int, str]:
        """(host, port, backend) of the sync group's rendezvous, hosted by rank 0."""
        return ray.get(self.ranks[0].sync_address.remote())

    def join_weight_sync(self, host: str, port: int, world_size: int, timeout_s: float,
                         backend: str) -> ray.ObjectRef:
        """Rank 0 joins the sync group as its root; the caller waits for the returned call
        together with the receivers' joins (the group forms once every member joined)."""
        return self.ranks[0].init_weight_sync.remote(host, port, world_size, timeout_s, backend)

    def leave_weight_sync(self) -> None:
        ray.get(self.ranks[0].leave_weight_sync.remote())

    def send_weights(self, spec: dict) -> List[ray.ObjectRef]:
        """Every rank's part of one push (ZeRO-3's gathers; rank 0 sends), its metrics first;
        the caller waits for them together with the receives."""
        return [r.broadcast_weights.remote(spec) for r in self.ranks]

    def shm_free_bytes(self) -> int:
        """Free bytes of /dev/shm on rank 0's node."""
        return ray.get(self.ranks[0].shm_free_bytes.remote())

    def unlink_sync_file(self, path: str) -> None:
        ray.get(self.ranks[0].unlink_sync_file.remote(path))

    def rank_index(self, cause: Optional[BaseException]) -> int:
        """The index of the rank `cause` (a RayActorError) names; -1 when it names none."""
        return actor_index(self.ranks, cause)

    def shutdown(self) -> None:
        for r in self.ranks:
            ray.kill(r)
