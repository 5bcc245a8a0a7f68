"""The placement groups of every role, created and ready before any actor starts (what each
role asks for: cluster/layout.py)."""
from __future__ import annotations

from typing import Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.layout import ROLES, bundles


class PlacementError(RuntimeError):
    pass


class Placement:
    """The placement groups of every role, created and ready before any actor starts."""
    def __init__(self, cfg, timeout_s: float, roles: Sequence[str] = ROLES):
        self.cfg, self.timeout_s, self.groups = cfg, timeout_s, {}
        self._create(roles)

    def _create(self, roles: Sequence[str]) -> None:
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
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.groups[role], placement_group_bundle_index=index,
            placement_group_capture_child_tasks=False)}

    def replace(self, role: str) -> None:
        """A new placement group for `role` in place of its old one (removed first, so that its
        reservation is free again): the learner's, after a rank or its node was lost."""
        remove_placement_group(self.groups.pop(role))
        self._create((role,))

    def remove(self) -> None:
        groups, self.groups = list(self.groups.values()), {}
        for group in groups:
            remove_placement_group(group)
