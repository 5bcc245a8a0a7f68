"""The weight-sync channel's protocol, shared by its sender (learner rank 0) and receivers (vLLM workers).

One process group joins learner rank 0 (group rank 0, the root) and every vLLM worker process
of every generation actor (ranks 1..N; a tensor-parallel engine has one per TP rank). The
weights travel as flat buckets of about `bucket_mb`, one broadcast per bucket: a broadcast per
tensor is far slower (gloo's rate falls with the bucket's size: bench/weight_sync.py --bucket-mb).
The group is NCCL when the learner is on a GPU (buckets live on the GPUs), gloo otherwise. When
every receiver is on the learner's node and the group is gloo, the buckets go through a
shared-memory file instead (written once, read by every engine) and the group carries only
"bucket i is written" (`WeightSpec.shm_path`). Only the small `WeightSpec` travels by RPC; tensors cannot (vLLM's collective_rpc cannot
pickle them).

It imports neither rollout/ nor learner/: both sides use it.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class WeightSpec:
    """What a receiver needs to rebuild the tensors from the broadcast bytes."""

    tensors: Tuple[TensorSpec, ...]
    dtype: str
    bucket_bytes: int
    shm_path: Optional[str] = None
    """Set when every receiver shares the sender's node and the group is gloo: the sender writes
    the buckets once into this shared-memory file and the group carries only a bucket number
    per bucket, "bucket i is written"; every receiver loads from its own mapping of the file."""

    def buckets(self) -> List[List[TensorSpec]]:
        """Tensors grouped in order into buckets of at most bucket_bytes (a larger tensor goes alone)."""
        itemsize = self.itemsize
        buckets: List[List[TensorSpec]] = [[]]
        size = 0
        for spec in self.tensors:
            nbytes = spec.numel * itemsize
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(spec)
            size += nbytes
        return [b for b in buckets if b]

    def to_wire(self) -> dict:
        """Plain types only: vLLM's collective_rpc serialises dataclasses into dicts."""
        return {"tensors": [[t.name, list(t.shape)] for t in self.tensors],
                "dtype": self.dtype, "bucket_bytes": self.bucket_bytes, "shm_path": self.shm_path}

    @classmethod
    def from_wire(cls, wire: dict) -> "WeightSpec":
        return cls(tensors=tuple(TensorSpec(name, tuple(shape)) for name, shape in wire["tensors"]),
                   dtype=wire["dtype"], bucket_bytes=wire["bucket_bytes"], shm_path=wire.get("shm_path"))

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    @property
    def total_bytes(self) -> int:
        return sum(s.numel for s in self.tensors) * self.itemsize


def full_shape(tensor: torch.Tensor) -> Tuple[int, ...]:
    """The unsharded shape: a ZeRO-3 parameter is an empty placeholder holding `ds_shape`."""
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


def make_spec(named_tensors: Sequence[Tuple[str, torch.Tensor]], dtype: str, bucket_mb: float) -> WeightSpec:
    return WeightSpec(
        tensors=tuple(TensorSpec(name, full_shape(t)) for name, t in named_tensors),
        dtype=dtype,
        bucket_bytes=int(bucket_mb * 2**20),
    )


def pack(tensors: Sequence[torch.Tensor], dtype: str) -> torch.Tensor:
    """Flatten tensors into one contiguous buffer of the wire dtype."""
    return torch.cat([t.detach().reshape(-1).to(DTYPES[dtype]) for t in tensors])


def unpack(flat: torch.Tensor, bucket: Sequence[TensorSpec]) -> Iterator[Tuple[str, torch.Tensor]]:
    offset = 0
    for spec in bucket:
        yield spec.name, flat[offset: offset + spec.numel].view(spec.shape)
        offset += spec.numel


def pack_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Write tensors one after another into `flat` (converted to its dtype): one copy, no staging."""
    offset = 0
    for t in tensors:
        n = t.numel()
        flat[offset: offset + n].copy_(t.detach().reshape(-1))
        offset += n


def empty_bucket(bucket: Sequence[TensorSpec], dtype: str, device: str = "cpu") -> torch.Tensor:
    return torch.empty(sum(s.numel for s in bucket), dtype=DTYPES[dtype], device=device)


# ------------------------------------------------------------------ shared memory (one node)

_MAPPINGS: Dict[str, torch.Tensor] = {}
"""This process's mapping of each shared-memory file it uses (one: a new group gets a new file)."""


def shm_mapping(path: str, total_bytes: int) -> torch.Tensor:
    """The shared file at `path` mapped as bytes (created at this size if missing); mapped once per
    process. The mapping outlives the file's name: the sender unlinks it once every receiver has
    mapped it, so nothing is left in /dev/shm however the run ends after that."""
    if path not in _MAPPINGS:
        _MAPPINGS.clear()  # the previous group's file: its bytes go when no tensor maps them
        _MAPPINGS[path] = torch.from_file(path, shared=True, size=max(total_bytes, 1), dtype=torch.uint8)
    return _MAPPINGS[path]


def shm_buckets(spec: WeightSpec) -> List[torch.Tensor]:
    """Each bucket of `spec` as a flat tensor of the wire dtype inside the shared file."""
    mapping = shm_mapping(spec.shm_path, spec.total_bytes)
    views, offset = [], 0
    for bucket in spec.buckets():
        nbytes = sum(t.numel for t in bucket) * spec.itemsize
        views.append(mapping[offset: offset + nbytes].view(DTYPES[spec.dtype]))
        offset += nbytes
    return views


def unlink_shm(path: Optional[str]) -> None:
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@dataclass
class SyncGroup:
    store: object  # the TCPStore must outlive the process group built on it
    group: object
    device: str
    """Where the buckets must live for this group's backend: cuda for NCCL, cpu for gloo."""
    timeout_s: float = 300.0
    """What every wait on this group's collectives may take (`finish`)."""


class SyncWaitError(RuntimeError):
    """A collective of the sync group did not finish within the group's timeout, or failed: the
    group is broken (the channel rebuilds it) and nothing of the bucket may be loaded."""


NCCL_HINT = ("check that every member can reach the others on the interface NCCL picks (NCCL_SOCKET_IFNAME), "
             "InfiniBand (NCCL_IB_DISABLE=1 to rule it out, NCCL_IB_HCA), and NCCL_DEBUG=INFO's log")


def join_group(host: str, port: int, rank: int, world_size: int, timeout_s: float,
               backend: str = "gloo") -> SyncGroup:
    """Join the sync group. Rank 0 hosts the TCPStore rendezvous.

    `wait_for_workers=False` lets the root's store start without blocking until every receiver
    has connected; the join probe (`connect`) then waits for all of them, bounded by timeout_s.
    The group is built directly on its store, apart from the default process group: the
    learner's DeepSpeed group and vLLM's own groups are untouched by it.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        host, port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False,
    )
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # NCCL's watchdog tears the whole process down when a collective outlives the timeout
        # (TORCH_NCCL_ASYNC_ERROR_HANDLING's default): learner rank 0 and its ZeRO shard would go
        # with it. CleanUpOnly (2) aborts this group's communicator and raises in the waiting
        # call instead, as gloo does. Read when the group is built: the learner's own training
        # group keeps its setting.
        with _env("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"):
            group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        sync_group = SyncGroup(store=store, group=group, device=f"cuda:{torch.cuda.current_device()}",
                               timeout_s=timeout_s)
    elif backend == "gloo":
        sync_group = SyncGroup(store=store, group=dist.ProcessGroupGloo(store, rank, world_size, timeout),
                               device="cpu", timeout_s=timeout_s)
    else:
        raise ValueError(f"weight sync backend must be nccl or gloo, got {backend!r}")
    connect(sync_group, f"{backend}, rank {rank} of {world_size}, rendezvous {host}:{port}")
    return sync_group


def _probe_tensor(device: str) -> torch.Tensor:
    return torch.zeros(1, device=device)


def connect(sync_group: SyncGroup, where: str) -> None:
    """Connect the group now, with one one-element broadcast that every member makes at its join.

    A ProcessGroupNCCL made without a device creates its communicator at the first collective:
    without this, a wrong NCCL_SOCKET_IFNAME or an unreachable InfiniBand would first show after
    the first training step, inside a push. NCCL's communicator set-up blocks the calling thread
    and no work handle bounds it, so the probe runs in a thread of its own and the join gives up
    after the group's timeout (the thread is left behind: the run ends on this error)."""
    box: Dict[str, BaseException] = {}

    def probe() -> None:
        try:
            finish(sync_group, start_broadcast(sync_group, _probe_tensor(sync_group.device)), "the join probe")
        except BaseException as error:  # handed to the joining thread below
            box["error"] = error

    thread = threading.Thread(target=probe, name="weight-sync-join-probe", daemon=True)
    thread.start()
    thread.join(sync_group.timeout_s + 1.0)  # the probe's own wait is bounded by the timeout itself
    nccl = sync_group.device.startswith("cuda")
    hint = f"; {NCCL_HINT}" if nccl else ""
    if thread.is_alive():
        raise SyncWaitError(f"joining the weight-sync group ({where}): not connected within "
                            f"{sync_group.timeout_s:g}s{hint}")
    if "error" in box:
        cause = box["error"].__cause__ or box["error"]  # what the collective raised, not finish's wrapper
        raise SyncWaitError(f"joining the weight-sync group ({where}) failed: "
                            f"{str(cause).strip().splitlines()[0][:300]}{hint}") from box["error"]


def finish(sync_group: SyncGroup, work, what: str) -> None:
    """Wait for a collective of the group, at most the group's timeout, and raise if it did not
    complete. On NCCL, `Work.wait()` without a timeout only makes the current CUDA stream wait
    and returns at once, and a collective that then times out aborts the communicator without
    any host call raising: the receiver would load whatever its empty bucket held. Given a
    timeout, the host blocks until the bytes are there and raises otherwise (gloo raises either
    way)."""
    try:
        done = work.wait(datetime.timedelta(seconds=sync_group.timeout_s))
    except RuntimeError as error:  # gloo: "Operation timed out!"; NCCL: DistBackendError
        raise SyncWaitError(f"weight sync: {what} did not complete within sync.timeout_s="
                            f"{sync_group.timeout_s:g}s: {str(error).strip().splitlines()[0][:200]}") from error
    if done is False:
        raise SyncWaitError(f"weight sync: {what} did not complete within sync.timeout_s={sync_group.timeout_s:g}s")


@contextlib.contextmanager
def _env(name: str, value: str):
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


class PushClock:
    """Seconds of a push from its start. With NCCL the bytes move on the GPU's streams, so the
    clock is a pair of CUDA events recorded on the current stream (behind every broadcast, which
    `finish` waited for), read once the end event completed; otherwise the host's clock."""

    def __init__(self, sync_group: Optional[SyncGroup]):
        self.cuda = sync_group is not None and sync_group.device.startswith("cuda")
        self.started = time.perf_counter()
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record()

    def seconds(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.started
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self.start_event.elapsed_time(end) / 1000.0


class SpanTimer:
    """Seconds spent in spans of work (`with timer.span(): ...`), added up. On a GPU the work is
    asynchronous (the host's clock would time kernel launches): each span is a pair of CUDA
    events on the current stream, read by `seconds()` once the last has completed."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.host_s = 0.0
        self.events: List[tuple] = []

    @contextlib.contextmanager
    def span(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((start, end))
            return
        started = time.perf_counter()
        yield
        self.host_s += time.perf_counter() - started

    def seconds(self) -> float:
        if self.events:
            self.events[-1][1].synchronize()
        return self.host_s + sum(start.elapsed_time(end) for start, end in self.events) / 1000.0


def start_broadcast(sync_group: SyncGroup, tensor: torch.Tensor):
    """Start a broadcast from rank 0 (the learner) in place; returns its work handle, for
    `finish`. The tensor must stay alive until then."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return sync_group.group.broadcast([tensor], opts)


def broadcast(sync_group: SyncGroup, tensor: torch.Tensor) -> None:
    """Broadcast from rank 0 (the learner) in place; raises on the group's timeout."""
    finish(sync_group, start_broadcast(sync_group, tensor), "a broadcast")


def received_buckets(sync_group: SyncGroup, spec: WeightSpec, timings: Dict[str, float]) -> Iterator[
        Tuple[List[TensorSpec], torch.Tensor]]:
    """Each bucket of `spec` as it arrives, the next one already on its way while the caller
    loads this one (the sender packs bucket i+1 while bucket i is on the wire, and a receiver
    loads bucket i while bucket i+1 arrives). `timings["wait_s"]` adds up the time spent waiting
    for bytes (the rest of the caller's time is its own loading): `finish` blocks the host until
    a bucket is whole, on NCCL too, so this is the bytes' time, not a kernel launch's. A bucket
    that did not arrive whole raises before it is handed over."""
    buckets = spec.buckets()
    views = shm_buckets(spec) if spec.shm_path else None

    def begin(bucket):
        if views is not None:  # only "bucket i is written" travels; the bytes are in the file
            note = torch.zeros(1, dtype=torch.int64)
            return note, start_broadcast(sync_group, note)
        flat = empty_bucket(bucket, spec.dtype, sync_group.device)
        return flat, start_broadcast(sync_group, flat)

    ahead = begin(buckets[0]) if buckets else None
    for i, bucket in enumerate(buckets):
        flat, work = ahead
        started = time.perf_counter()
        finish(sync_group, work, f"bucket {i + 1} of {len(buckets)}")
        timings["wait_s"] = timings.get("wait_s", 0.0) + time.perf_counter() - started
        ahead = begin(buckets[i + 1]) if i + 1 < len(buckets) else None
        if views is not None:
            if int(flat[0]) != i:
                raise RuntimeError(f"weight sync: bucket {int(flat[0])} announced where {i} was expected")
            flat = views[i]
        yield bucket, flat


class PartialLoadError(RuntimeError):
    """A push left some of an engine's parameters at their old values."""


def check_loaded(expected: Sequence[str], loaded: Optional[Sequence[str]]) -> None:
    """Raise PartialLoadError when a push did not load every parameter the engine has.

    `expected`: the engine's parameter names before the push; `loaded`: what its model's
    `load_weights` reported loading (None: the model reports nothing, so nothing can be told).
    vLLM itself only logs a warning ("Following weights were not loaded") that never reaches
    the driver, and the engine would then sample from a policy half old, half new."""
    if loaded is None:
        return
    missing = sorted(set(expected) - set(loaded))
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise PartialLoadError(
            f"the weight push loaded {len(expected) - len(missing)} of the engine's {len(expected)} parameters; "
            f"not loaded, left at their old values: {shown} (the learner's names miss these)")


def settle(sync_group: SyncGroup) -> None:
    """Wait until every broadcast issued on this group has really moved its bytes. On NCCL,
    `Work.wait()` only orders the GPU stream and returns before any byte moved: a clock read
    without this measures queueing. Gloo's broadcast is already done when wait() returns."""
    if sync_group.device.startswith("cuda"):
        torch.cuda.synchronize(sync_group.device)
