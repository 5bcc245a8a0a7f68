"""Where each role's actors run: one Ray placement group per role, on the nodes the config names.

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

from collections import defaultdict
from typing import Dict, List, Optional, Sequence

ROLES = ("rollout", "learner", "reward")
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


class PlacementError(RuntimeError):
    pass


class Placement:
    """The placement groups of every role, created and ready before any actor starts."""

    def __init__(self, cfg, timeout_s: float, roles: Sequence[str] = ROLES):
        self.cfg, self.timeout_s, self.groups = cfg, timeout_s, {}
        self._create(roles)

    def _create(self, roles: Sequence[str]) -> None:
        import ray
        from ray.util.placement_group import placement_group

        cfg, timeout_s = self.cfg, self.timeout_s
        for role in roles:
            strategy = getattr(cfg.cluster.strategy, role)
            self.groups[role] = placement_group(bundles(cfg, role), strategy=strategy, name=f"grpo-{role}")
        ready = {self.groups[role].ready(): role for role in roles}
        done, _ = ray.wait(list(ready), num_returns=len(ready), timeout=timeout_s)
        pending = [role for ref, role in ready.items() if ref not in done]
        if pending:
            self.remove()
            raise PlacementError(f"the placement groups of {', '.join(pending)} could not be placed within "
                                 f"cluster.placement_timeout_s={timeout_s:g}s: too strict a cluster.strategy "
                                 "for the nodes, or resources held by another job")

    def options(self, role: str, index: int) -> dict:
        """Actor options that pin actor `index` of `role` to its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.groups[role], placement_group_bundle_index=index,
            placement_group_capture_child_tasks=False)}

    def replace(self, role: str) -> None:
        """A new placement group for `role` in place of its old one (removed first, so that its
        reservation is free again): the learner's, after a rank or its node was lost."""
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.groups.pop(role))
        self._create((role,))

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        groups, self.groups = list(self.groups.values()), {}
        for group in groups:
            remove_placement_group(group)
