"""What the config asks of a cluster, checked without Ray: where each role's actors run and what
they need (cluster/loop/placement.py makes the placement groups from it).

`cluster.nodes.<role>` names a custom node resource (given to nodes with
`ray start --resources='{"gen": 1}'`); every actor of that role needs a sliver of it, so the role
runs only on those nodes. Roles that name the same resource share those nodes; a role with none
runs anywhere. `cluster.strategy.<role>` is the placement group's strategy (PACK: as few nodes as
possible, SPREAD: as many, STRICT_*: or fail). Each actor is pinned to its own bundle (its CPUs
and GPUs), so a restarted actor comes back into the same reservation.

Before any actor starts, `check` compares every role's demand with the nodes that can hold it
and names what is missing, instead of leaving a placement group pending forever.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Dict, List, Optional, Sequence

from common.config import Config, ConfigError

ROLES = ("rollout", "learner", "reward")
EVAL_ROLES = ("rollout", "reward")
"""The roles `grpo eval` starts: no learner."""
LABEL_SHARE = 0.001
"""How much of its node resource each actor takes: any positive amount pins it; small enough
that a node labelled with 1 holds a thousand actors."""


def role_demand(cfg, role: str) -> Dict[str, object]:
    """(count, CPUs per actor, GPUs per actor, node resource) of one role."""
    if role == "rollout":
        count, cpus, gpus = cfg.rollout.num_workers, cfg.rollout.num_cpus_per_worker, cfg.rollout.num_gpus_per_worker
    elif role == "learner":
        count, cpus, gpus = cfg.learner.num_ranks, cfg.learner.num_cpus_per_rank, cfg.learner.num_gpus_per_rank
    else:
        count, cpus, gpus = cfg.reward.num_workers, cfg.reward.num_cpus_per_worker, 0.0
    return {"count": count, "CPU": cpus, "GPU": gpus, "label": getattr(cfg.cluster.nodes, role)}


def bundles(cfg, role: str) -> List[Dict[str, float]]:
    d = role_demand(cfg, role)
    bundle = {"CPU": d["CPU"]}
    if d["GPU"]:
        bundle["GPU"] = d["GPU"]
    if d["label"]:
        bundle[d["label"]] = LABEL_SHARE
    return [dict(bundle) for _ in range(d["count"])]


def check(cfg, nodes: List[dict], roles: Sequence[str] = ROLES) -> List[str]:
    """What the cluster (`ray.nodes()`) lacks for the config's `roles`, one phrase per shortfall."""
    alive = [n["Resources"] for n in nodes if n.get("Alive", True)]
    by_label: Dict[Optional[str], List[str]] = defaultdict(list)
    for role in roles:
        by_label[role_demand(cfg, role)["label"]].append(role)
    missing = []
    for label, sharing in by_label.items():
        if label is None:
            continue
        where = [r for r in alive if r.get(label, 0) > 0]
        if not where:
            missing.append(f"a node with resource '{label}' (cluster.nodes.{sharing[0]}); start one with "
                           f"ray start --resources='{{\"{label}\": 1}}'")
            continue
        for kind in ("CPU", "GPU"):
            demand = sum(role_demand(cfg, r)["count"] * role_demand(cfg, r)[kind] for r in sharing)
            have = sum(r.get(kind, 0.0) for r in where)
            if demand > have + 1e-9:
                missing.append(f"{demand:g} {kind} for {'/'.join(sharing)} on the nodes with '{label}' (they have {have:g})")
    for kind in ("CPU", "GPU"):
        demand = sum(role_demand(cfg, r)["count"] * role_demand(cfg, r)[kind] for r in roles)
        have = sum(r.get(kind, 0.0) for r in alive)
        if demand > have + 1e-9:
            missing.append(f"{demand:g} {kind} in all (the cluster has {have:g})")
    return missing + _too_big_for_any_node(cfg, alive, roles)


def _too_big_for_any_node(cfg, alive: List[dict], roles: Sequence[str]) -> List[str]:
    """An actor's bundle is never split between nodes: totals can suffice while no single node
    holds one actor (a 4-GPU tensor-parallel engine on nodes of 2 GPUs)."""
    missing = []
    for role in roles:
        d = role_demand(cfg, role)
        where = [r for r in alive if d["label"] is None or r.get(d["label"], 0) > 0]
        if not d["count"] or not where:
            continue  # no such node at all: named above
        for kind in ("CPU", "GPU"):
            largest = max(r.get(kind, 0.0) for r in where)
            if largest and d[kind] > largest + 1e-9:  # none of it at all: the totals say so
                on = f"with '{d['label']}' " if d["label"] else ""
                missing.append(f"{d[kind]:g} {kind} on one node for each {role} actor "
                               f"(the largest node {on}has {largest:g})")
    return missing


def check_gpu_layout(cfg: Config, cluster_gpus: float, learner_gpus: Optional[float] = None) -> None:
    """No two roles on one GPU by accident (NCCL refuses two ranks on one GPU, and a second vLLM
    engine on a GPU fails its free-memory check), and no role left on CPUs by accident.

    `learner_gpus`: the GPUs of the nodes the learner may use (`cluster.nodes.learner`; all of
    the cluster's when None). A learner left at `num_gpus_per_rank=0` where its nodes have GPUs
    would train in fp32 over gloo on CPUs without a word; one placed on CPU-only nodes on
    purpose (a label no GPU node carries) is let be."""
    tp = cfg.rollout.tensor_parallel_size
    learner_gpus = cluster_gpus if learner_gpus is None else learner_gpus
    if cluster_gpus > 0 and os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
        raise ConfigError("VLLM_BATCH_INVARIANT=1 is not supported on GPUs: it pins NCCL settings inside the "
                          "engines that the learner's weight-sync sender does not share; unset it")
    if cluster_gpus > 0 and cfg.rollout.num_gpus_per_worker == 0:
        raise ConfigError(f"the cluster has {cluster_gpus:g} GPUs but rollout.num_gpus_per_worker=0: every vLLM "
                          f"engine would see all of them and use GPU 0; set rollout.num_gpus_per_worker={tp}")
    if learner_gpus > 0 and cfg.learner.num_gpus_per_rank == 0:
        raise ConfigError(f"the learner's nodes have {learner_gpus:g} GPUs but learner.num_gpus_per_rank=0: it would "
                          "train on CPUs in fp32 over gloo; set learner.num_gpus_per_rank=1 (or name CPU-only nodes "
                          "in cluster.nodes.learner)")


def check_nodes(cfg: Config, nodes, cluster_gpus: float, roles) -> None:
    check_gpu_layout(cfg, cluster_gpus, learner_gpus(cfg, nodes, cluster_gpus) if "learner" in roles else 0.0)
    missing = check(cfg, nodes, roles)
    if missing:
        raise ConfigError(
            f"the actors need {'; '.join(missing)}: lower rollout/learner/reward num_workers, num_ranks "
            "or their num_cpus_*/num_gpus_*, add nodes (or raise ray.num_cpus locally)")


def learner_gpus(cfg: Config, nodes, cluster_gpus: float) -> float:
    """GPUs on the nodes the learner may run on: those with its `cluster.nodes.learner` resource,
    or the whole cluster's when it names none."""
    label = cfg.cluster.nodes.learner
    if not label:
        return cluster_gpus
    return sum(n["Resources"].get("GPU", 0.0) for n in nodes
               if n.get("Alive", True) and n["Resources"].get(label, 0) > 0)
