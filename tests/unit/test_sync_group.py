"""The sync group's NCCL branch (common/weight_sync.py), its arguments checked without a GPU: a
stand-in ProcessGroupNCCL records what it is given (tests/integration/test_weight_sync.py runs
the waits' timeouts on gloo)."""
from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch
import torch.distributed as dist

from common import weight_sync
from common.ray_utils import free_port


class _Work:
    def __init__(self, behaviour):
        self.behaviour, self.timeouts = behaviour, []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        if self.behaviour == "raise":
            raise RuntimeError("NCCL error: unhandled system error (socket connect failed)\nlast error: ...")
        if self.behaviour == "hang":
            threading.Event().wait(5)
        return True


def _fake_nccl(monkeypatch, behaviour="ok"):
    made = {}

    class Options:
        _timeout = None

    class FakeNCCL:
        def __init__(self, store, rank, world_size, options):
            made.update(rank=rank, world_size=world_size, timeout=options._timeout,
                        handling=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), store=store)

        def broadcast(self, tensors, opts):
            made.setdefault("broadcasts", []).append((tensors[0].numel(), opts.rootRank))
            made["work"] = _Work(behaviour)
            return made["work"]

    FakeNCCL.Options = Options
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(weight_sync, "_probe_tensor", lambda device: torch.zeros(1))  # no GPU here
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    return made


def test_an_nccl_group_gets_the_timeout_cleanup_only_handling_and_connects_at_join(monkeypatch):
    made = _fake_nccl(monkeypatch)
    group = weight_sync.join_group("127.0.0.1", free_port(), 0, 1, 7.0, "nccl")
    assert (made["rank"], made["world_size"]) == (0, 1)
    assert made["timeout"] == datetime.timedelta(seconds=7)
    assert made["handling"] == "2" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ  # for this group only
    assert group.device == "cuda:3" and group.timeout_s == 7.0 and group.store is made["store"]
    # the join probe: one one-element broadcast from rank 0, waited for with the group's timeout
    assert made["broadcasts"] == [(1, 0)] and made["work"].timeouts == [datetime.timedelta(seconds=7)]
    weight_sync.broadcast(group, torch.zeros(4))
    assert made["work"].timeouts == [datetime.timedelta(seconds=7)]


def test_a_join_probe_that_fails_names_the_member_and_the_nccl_variables(monkeypatch):
    _fake_nccl(monkeypatch, "raise")
    port = free_port()
    with pytest.raises(weight_sync.SyncWaitError) as raised:
        weight_sync.join_group("127.0.0.1", port, 0, 1, 7.0, "nccl")
    message = str(raised.value)
    assert "\n" not in message and f"nccl, rank 0 of 1, rendezvous 127.0.0.1:{port}" in message
    assert "socket connect failed" in message and "NCCL_SOCKET_IFNAME" in message and "NCCL_IB_DISABLE" in message


def test_a_join_probe_that_never_returns_is_given_up_after_the_timeout(monkeypatch):
    _fake_nccl(monkeypatch, "hang")  # NCCL's communicator set-up blocks the calling thread
    with pytest.raises(weight_sync.SyncWaitError, match=r"not connected within 0.2s; .*NCCL_SOCKET_IFNAME"):
        weight_sync.join_group("127.0.0.1", free_port(), 0, 1, 0.2, "nccl")


def test_a_wait_that_reports_not_done_raises():
    class NotDone:
        def wait(self, timeout=None):
            return False

    group = weight_sync.SyncGroup(store=None, group=None, device="cpu", timeout_s=1.0)
    with pytest.raises(weight_sync.SyncWaitError, match="bucket 2 of 3 did not complete within sync.timeout_s=1s"):
        weight_sync.finish(group, NotDone(), "bucket 2 of 3")
