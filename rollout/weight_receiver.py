"""vLLM worker extension: the receiving end of the weight-sync channel.

vLLM mixes this class into each of its workers (`worker_extension_cls`), so `self` is the worker
and its methods are reached through `LLM.collective_rpc`. Tensors cannot travel through that RPC,
so only the small spec comes by RPC and the bytes come by broadcast from learner rank 0.
"""
from __future__ import annotations

import time

from cluster import weight_sync


class WeightReceiver:
    def init_weight_sync(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        self._sync_group = weight_sync.join_group(host, port, rank, world_size, timeout_s)

    def receive_weights(self, wire_spec: dict) -> dict:
        """Receive every bucket, then load them all through vLLM's layerwise reload.

        Loading must go through the reload lifecycle: vLLM post-processes layers after the
        first load, and a plain `model.load_weights` on a running CPU engine fails.
        """
        spec = weight_sync.WeightSpec.from_wire(wire_spec)
        start = time.perf_counter()
        received = []
        for bucket in spec.buckets():
            flat = weight_sync.empty_bucket(bucket, spec.dtype)
            weight_sync.broadcast(self._sync_group, flat)
            received.extend(weight_sync.unpack(flat, bucket))
        transfer_s = time.perf_counter() - start
        self.model_runner.reload_weights(weights_iterator=iter(received), is_checkpoint_format=True)
        return {"transfer_s": transfer_s, "load_s": time.perf_counter() - start - transfer_s}

    def weights_checksum(self) -> float:
        """Sum of every parameter, for tests that compare engines."""
        model = self.model_runner.get_model()
        return float(sum(p.detach().double().sum() for p in model.parameters()))
