"""Whole-model weights as sharded safetensors, written a block at a time and read a tensor at a
time: Hugging Face's layout (`model-00001-of-00003.safetensors`, or `model.safetensors` alone,
and `model.safetensors.index.json`, which `from_pretrained` and vLLM load), so an export or a checkpoint's frozen weights never need
the whole model in memory at once (learner/engines.py's `state_blocks` feeds the writer one
gathered transformer block at a time under ZeRO-3).

Tied weights (an output head that is the embedding) are written once: the index's `aliases` maps
the other names to the written one; Hugging Face's loader ties them again by itself, and
`StateFiles` answers the other names too.
"""
from __future__ import annotations

import json
import os
import weakref
from collections.abc import Mapping
from typing import Dict, Iterator, List

import torch

INDEX = "model.safetensors.index.json"
SHARD_BYTES = 1 << 30
"""A shard's size: what the writer holds at most beyond the block it was given."""


def _shard_name(i: int, count: int) -> str:
    # One shard is named as transformers names a model that needs no more.
    return "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"


class ShardWriter:
    """Tensors in, shards out: a shard is written as soon as it reaches `shard_bytes`, so what is
    held is one shard's tensors at most. `close` names the shards and writes the index."""

    def __init__(self, folder: str, shard_bytes: int = SHARD_BYTES):
        self.folder, self.shard_bytes = folder, shard_bytes
        os.makedirs(folder, exist_ok=True)
        self._pending: Dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: List[List[str]] = []  # the names in each shard written so far
        self._names: set = set()  # every name given, written or aliased
        self.aliases: Dict[str, str] = {}
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"{name} written twice")
        self._names.add(name)
        self._pending[name] = tensor.detach().contiguous()
        self._pending_bytes += tensor.numel() * tensor.element_size()
        if self._pending_bytes >= self.shard_bytes:
            self._flush()

    def alias(self, name: str, target: str) -> None:
        if name in self._names:
            raise ValueError(f"{name} written twice")
        self._names.add(name)
        self.aliases[name] = target

    def _flush(self) -> None:
        if not self._pending:
            return
        from safetensors.torch import save_file

        # The final names need the count: a shard is written under a temporary one until then.
        save_file(self._pending, os.path.join(self.folder, f".shard-{len(self._written):05d}.safetensors"),
                  metadata={"format": "pt"})  # transformers refuses safetensors without it
        self._written.append(list(self._pending))
        self.total_bytes += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        self._flush()
        count, weight_map = len(self._written), {}
        for i, names in enumerate(self._written):
            final = _shard_name(i, count)
            os.replace(os.path.join(self.folder, f".shard-{i:05d}.safetensors"), os.path.join(self.folder, final))
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map, "aliases": self.aliases}
        with open(os.path.join(self.folder, INDEX), "w") as f:
            json.dump(index, f, indent=1)


def write(folder: str, blocks: Iterator[Dict[str, torch.Tensor]], shard_bytes: int = SHARD_BYTES) -> None:
    """Every block's tensors into `folder`; a tensor that is one already written (the same
    memory: a tied weight) becomes an alias of it."""
    writer, seen = ShardWriter(folder, shard_bytes), {}
    for block in blocks:
        for name, tensor in block.items():
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
            # Only while the first tensor lives: a freed one's address may be reused.
            if key in seen and seen[key][1]() is not None:
                writer.alias(name, seen[key][0])
            else:
                seen[key] = (name, weakref.ref(tensor))
                writer.add(name, tensor)
    writer.close()


class StateFiles(Mapping):
    """A folder written by `write` as a read-only state dict: each tensor is read from its
    memory-mapped file when asked for, so a ZeRO-3 rank that copies its partition out of each
    holds one whole tensor at most."""

    def __init__(self, folder: str):
        self.folder = folder
        with open(os.path.join(folder, INDEX)) as f:
            index = json.load(f)
        self._files, self._aliases = dict(index["weight_map"]), dict(index.get("aliases", {}))
        self._open: Dict[str, object] = {}

    def _handle(self, file: str):
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = safe_open(os.path.join(self.folder, file), framework="pt")
        return self._open[file]

    def __getitem__(self, name: str) -> torch.Tensor:
        target = self._aliases.get(name, name)
        if target not in self._files:
            raise KeyError(name)
        return self._handle(self._files[target]).get_tensor(target)

    def __iter__(self):
        yield from self._files
        yield from self._aliases

    def __len__(self) -> int:
        return len(self._files) + len(self._aliases)


def exists(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, INDEX))


def saved(folder: str, name: str):
    """A checkpoint's `name`/ folder of whole weights as a `StateFiles`; checkpoints of earlier
    versions hold `name`.pt instead (memory-mapped, so under ZeRO-3 a rank reads only its
    partitions' pages). None if it has neither."""
    path = os.path.join(folder, name)
    if exists(path):
        return StateFiles(path)
    if os.path.exists(f"{path}.pt"):
        return torch.load(f"{path}.pt", map_location="cpu", mmap=True)
    return None
