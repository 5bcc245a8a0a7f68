"""vLLM worker extension: the receiving end of the weight-sync channel.

vLLM mixes this class into each of its workers (`worker_extension_cls`), so `self` is the worker
(one per tensor-parallel rank) and its methods are reached through `LLM.collective_rpc`; besides
the weights it seeds the sampler of unseeded requests (`reseed`). Tensors
cannot travel through that RPC, so only the small spec comes by RPC and the bytes come by
broadcast from learner rank 0.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Iterator, Tuple

import torch

from common import weight_sync


class WeightReceiver:
    def init_weight_sync(self, host: str, port: int, base_rank: int, world_size: int, timeout_s: float,
                         backend: str) -> None:
        """Join the sync group as rank `base_rank` + this worker's tensor-parallel rank."""
        self._sync_group = weight_sync.join_group(host, port, base_rank + self.rank, world_size, timeout_s,
                                                  backend)

    def receive_weights(self, wire_spec: dict) -> dict:
        """Load the broadcast weights through vLLM's layerwise reload, bucket by bucket.

        The buckets are received lazily, as the loader asks for the next tensor: the engine
        never stages a second full copy of the model. Loading must go through the reload
        lifecycle: vLLM post-processes layers after the first load, and a plain
        `model.load_weights` on a running CPU engine fails. Every parameter of the engine must
        then have been loaded, or PartialLoadError: the actor does not report the new version.
        """
        spec = weight_sync.WeightSpec.from_wire(wire_spec)
        start = time.perf_counter()
        timings: dict = {}
        if wire_spec.get("adapter_config") is not None:
            return self._receive_adapter(spec, wire_spec, start, timings)
        model = self.model_runner.get_model()
        # An engine serving LoRA wraps its linear layers: their weights are `base_layer`'s.
        expected = [name.replace(".base_layer.", ".") for name, _ in model.named_parameters()]
        with recorded_loads(model) as loaded:
            # The worker's own reload_weights (not its model runner's): it sets vLLM's config
            # context that the layerwise reload reads.
            self.reload_weights(weights_iterator=self._receive(spec, timings), is_checkpoint_format=True)
        weight_sync.settle(self._sync_group)
        # Every bucket was received whatever the check finds: the group stays in step for the next push.
        weight_sync.check_loaded(expected, loaded.get("names"))
        return {"load_s": time.perf_counter() - start, "wait_s": timings.get("wait_s", 0.0)}

    def _receive_adapter(self, spec: weight_sync.WeightSpec, wire_spec: dict, start: float, timings: dict) -> dict:
        """LoRA adapters: received whole and written by the first tensor-parallel rank as a peft
        adapter folder in `adapter_dir` (node-local tmpfs), which the engine then loads as a new
        LoRA version on the next generate call."""
        tensors = {name: t.clone() for name, t in self._receive(spec, timings)}
        weight_sync.settle(self._sync_group)
        if self.rank == 0:
            write_adapter(wire_spec["adapter_dir"], tensors, wire_spec["adapter_config"])
        return {"load_s": time.perf_counter() - start, "wait_s": timings.get("wait_s", 0.0)}

    def _receive(self, spec: weight_sync.WeightSpec, timings: dict) -> Iterator[Tuple[str, "object"]]:
        for bucket, flat in weight_sync.received_buckets(self._sync_group, spec, timings):
            yield from weight_sync.unpack(flat, bucket)

    def receive_raw(self, wire_spec: dict) -> dict:
        """The same buckets as `receive_weights`, received and dropped: a plain broadcast of the
        same bytes over the same group, the yardstick of the sync's rate (bench/weight_sync.py)."""
        spec = weight_sync.WeightSpec.from_wire(wire_spec)
        start = time.perf_counter()
        for bucket in spec.buckets():
            weight_sync.broadcast(self._sync_group, weight_sync.empty_bucket(bucket, spec.dtype,
                                                                              self._sync_group.device))
        weight_sync.settle(self._sync_group)
        return {"load_s": time.perf_counter() - start}

    def reseed(self, seed: int) -> None:
        """Seed this worker process's default generators, which vLLM's sampler draws from for
        requests without a seed of their own (rollout.seeded_sampling=false): torch's (CPU and
        every GPU) for the V1 model runner; numpy's global one for Model Runner V2 (vLLM's
        default on GPUs), which draws each unseeded request's seed from it as the request is
        added (its sampling states) and samples from that seed alone."""
        import numpy

        torch.manual_seed(seed)
        numpy.random.seed(seed % 2**32)

    def weights_checksum(self) -> dict:
        """Sum of each parameter by name, for tests that compare engines."""
        model = self.model_runner.get_model()
        return {name: float(p.detach().double().sum()) for name, p in model.named_parameters()}


@contextlib.contextmanager
def recorded_loads(model):
    """Within the block, what `model.load_weights` reports it loaded lands in the yielded
    dict's "names" (vLLM's reload computes that set, only to log a warning). The model's own
    method is shadowed on the instance for the block and restored after it."""
    record: dict = {}
    own = model.__dict__.get("load_weights")
    original = model.load_weights

    def load_weights(weights):
        names = original(weights)
        record["names"] = None if names is None else set(names)
        return names

    model.load_weights = load_weights
    try:
        yield record
    finally:
        if own is None:
            del model.load_weights
        else:
            model.load_weights = own


def write_adapter(folder: str, tensors: dict, config: dict) -> None:
    """A peft adapter folder: adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
