"""The rollout buffer: prompt groups waiting for the learner, held as ObjectRefs only.

The payloads stay in the Ray object store, written by the workers that made them; the driver
moves references, never the groups themselves.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, List, Sequence, Tuple

import ray


class RolloutBuffer:
    def __init__(self) -> None:
        self._items: Deque[Tuple[ray.ObjectRef, int]] = deque()

    def put(self, group_refs: Sequence[ray.ObjectRef], policy_version: int) -> None:
        for ref in group_refs:
            if not isinstance(ref, ray.ObjectRef):
                raise TypeError(f"the rollout buffer holds ObjectRefs only, got {type(ref).__name__}")
            self._items.append((ref, policy_version))

    def take(self, n: int) -> List[ray.ObjectRef]:
        """The n oldest groups, in the order they were put."""
        if n > len(self._items):
            raise ValueError(f"asked for {n} prompt groups, the buffer holds {len(self._items)}")
        return [self._items.popleft()[0] for _ in range(n)]

    def __len__(self) -> int:
        return len(self._items)
