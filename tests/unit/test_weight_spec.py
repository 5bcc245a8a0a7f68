"""The weight-sync protocol's pure parts (common/weight_sync.py): buckets, the wire form, packing."""
from __future__ import annotations

import torch

from common import weight_sync
from common.weight_sync import TensorSpec, WeightSpec


def test_tensors_go_in_order_into_buckets_and_a_large_one_alone():
    spec = WeightSpec(tensors=(TensorSpec("a", (2, 3)), TensorSpec("b", (4,)), TensorSpec("c", (40,)),
                               TensorSpec("d", (1,))), dtype="float32", bucket_bytes=48)
    assert [[t.name for t in b] for b in spec.buckets()] == [["a", "b"], ["c"], ["d"]]
    assert spec.total_bytes == (6 + 4 + 40 + 1) * 4
    assert WeightSpec(spec.tensors, "bfloat16", 48).total_bytes == (6 + 4 + 40 + 1) * 2
    assert WeightSpec.from_wire(spec.to_wire()) == spec


def test_pack_then_unpack_gives_the_tensors_back():
    tensors = [torch.arange(6.0).reshape(2, 3), torch.tensor([7.0, 8.0])]
    bucket = [TensorSpec("x", (2, 3)), TensorSpec("y", (2,))]
    flat = weight_sync.pack(tensors, "bfloat16")
    assert flat.dtype == torch.bfloat16
    into = weight_sync.empty_bucket(bucket, "float32")
    weight_sync.pack_into(tensors, into)
    for packed in (flat, into):
        out = dict(weight_sync.unpack(packed, bucket))
        assert torch.equal(out["x"].float(), tensors[0]) and torch.equal(out["y"].float(), tensors[1])


def test_a_push_that_left_a_parameter_unloaded_is_an_error_naming_it():
    import pytest

    names = [f"layer{i}.weight" for i in range(5)]
    weight_sync.check_loaded(names, set(names))
    weight_sync.check_loaded(names, set(names) | {"extra"})  # an alias vLLM reports as loaded too
    weight_sync.check_loaded(names, None)  # a model whose loader reports nothing: nothing to tell
    with pytest.raises(weight_sync.PartialLoadError, match=r"loaded 4 of the engine's 5 parameters.*layer3.weight"):
        weight_sync.check_loaded(names, set(names) - {"layer3.weight"})
    with pytest.raises(weight_sync.PartialLoadError, match=r"layer0.weight, layer1.weight, layer2.weight and 2 more"):
        weight_sync.check_loaded(names, set())
