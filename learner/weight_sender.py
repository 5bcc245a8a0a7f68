"""The weight-sync channel's sender, on the learner's ranks (the mirror of
rollout/weight_receiver.py): the push's spec, the sync group that rank 0 joins as its root, and
the push itself (every rank joins ZeRO-3's gathers, rank 0 packs and sends), through staging
buffers or a shared-memory file. The handshake and versioning are cluster/loop/sync_channel.py's.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch

from common import weight_sync
from common.ray_utils import free_port, node_ip
from learner import engines
from learner.policy import PolicyModel


class WeightSender:
    def __init__(self, policy: PolicyModel, rank: int):
        self.policy, self.rank = policy, rank
        self.sync_group = None
        self._send_buffers: Optional[List[torch.Tensor]] = None  # see _staging

    def weight_spec(self, dtype: str, bucket_mb: float, part: str = "policy") -> Optional[dict]:
        """The push's spec; `base`: None unless the push sends adapters on a base other than the
        engines' initial weights (they then need the base once, before the first adapters and
        after an engine's restart). An adapter spec carries the adapter's peft config
        (`adapter_config`), which the engines serve it by."""
        adapters = self.policy.pushes_adapters
        if part == "base" and (not adapters or self.policy.base_is_initial):
            # Adapters from the start: the base is what every engine loaded, and the push of
            # it, whole through a shared file, was what ran a 1.6 B model out of memory.
            return None
        # ZeRO-3 placeholders carry their full shape (ds_shape): no gather needed to describe them.
        wire = weight_sync.make_spec(list(self.policy.sync_tensors(part).items()), dtype, bucket_mb).to_wire()
        wire["part"] = part
        if part == "policy" and adapters:
            wire["adapter_config"] = self.policy.adapter_config()
        return wire

    def sync_address(self) -> tuple:
        """Where the sync group's rendezvous (hosted by this rank) will listen, and its backend:
        NCCL when the learner is on a GPU."""
        return node_ip(), free_port(), "nccl" if self.policy.on_gpu else "gloo"

    def join(self, host: str, port: int, world_size: int, timeout_s: float, backend: str) -> None:
        self.sync_group = None  # the old group's connections close first
        self.sync_group = weight_sync.join_group(host, port, 0, world_size, timeout_s, backend)

    def leave(self) -> None:
        """Drop the sync group: its connections close, so a receiver still waiting in a broadcast
        that will not come (a peer died mid-push) fails now instead of at the group's timeout."""
        self.sync_group = None

    def push(self, wire_spec: dict) -> Dict[str, float]:
        """Rank 0 packs the weights into buckets and broadcasts each once to every worker.

        Under ZeRO-3 each bucket's parameters are gathered just for that bucket and released
        after it (every rank joins each gather, only rank 0 sends): the sync never holds the
        whole model twice. `sync_gathered_max_mb` reports the most that was gathered at once.
        """
        spec = weight_sync.WeightSpec.from_wire(wire_spec)
        part = wire_spec.get("part", "policy")
        named = self.policy.sync_tensors(part)
        # The merged push: each adapted weight is sent as W + scale B A, computed per bucket.
        pairs = self.policy.merged_pairs(part)
        clock = weight_sync.PushClock(self.sync_group if self.rank == 0 else None)
        gathered_max = 0
        packing = weight_sync.SpanTimer(self.sync_group.device if self.rank == 0 else "cpu")
        # Shared memory: the buckets are written into the file and only their numbers travel.
        views = weight_sync.shm_buckets(spec) if spec.shm_path and self.rank == 0 else None
        in_flight = None  # (tensor, work) of the broadcast on the wire while the next is packed
        buckets = spec.buckets()
        for i, bucket in enumerate(buckets):
            tensors = [named[t.name] for t in bucket]
            extra = [p for t in bucket if t.name in pairs for p in pairs[t.name][:2]]
            with engines.gathered(tensors + extra, self.policy.cfg.zero_stage):
                gathered_max = max(gathered_max, self.policy.gathered_bytes())
                if self.rank == 0:
                    flat = views[i] if views is not None else self._staging(spec, bucket, i % 2)
                    with packing.span():
                        tensors = [engines.merged(w, pairs[t.name]) if t.name in pairs else w
                                   for t, w in zip(bucket, tensors)]
                        weight_sync.pack_into(tensors, flat)
            if self.rank == 0:
                if in_flight is not None:
                    weight_sync.finish(self.sync_group, in_flight[1], f"bucket {i} of {len(buckets)}")
                if views is not None:
                    flat = torch.tensor([i], dtype=torch.int64)  # "bucket i is written"
                in_flight = (flat, weight_sync.start_broadcast(self.sync_group, flat))
        if in_flight is not None:
            weight_sync.finish(self.sync_group, in_flight[1], "the last bucket")
        if self.rank == 0:
            weight_sync.settle(self.sync_group)
        seconds = clock.seconds()
        return {"sync_bytes": spec.total_bytes, "sync_seconds": seconds,
                "sync_gbps": spec.total_bytes / max(seconds, 1e-9) / 1e9,
                "sync_pack_seconds": packing.seconds(), "sync_gathered_max_mb": gathered_max / 2**20}

    def _staging(self, spec: weight_sync.WeightSpec, bucket, slot: int) -> "torch.Tensor":
        """One of two send buffers, kept from push to push: on CPUs a fresh 64 MB buffer per bucket
        costs its page faults every time (bench/weight_sync.py: most of a push's packing was
        faulting in new pages). Two, because one may still be on the wire while the next is packed;
        a slot is reused only after its broadcast finished. On GPUs the caching allocator reuses
        memory already."""
        if self.sync_group.device != "cpu":
            return weight_sync.empty_bucket(bucket, spec.dtype, self.sync_group.device)
        numel = sum(t.numel for t in bucket)
        buffers = self._send_buffers
        if buffers is None or buffers[0].dtype != weight_sync.DTYPES[spec.dtype] or buffers[0].numel() < numel:
            size = max(numel, spec.bucket_bytes // spec.itemsize)
            buffers = self._send_buffers = [torch.empty(size, dtype=weight_sync.DTYPES[spec.dtype]) for _ in range(2)]
        return buffers[slot][:numel]


def shm_free_bytes() -> int:
    """Free bytes of /dev/shm on this node (0 without one): a container's default 64 MB cannot
    hold a model, and writing past a tmpfs's end kills the writer (SIGBUS)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize
