"""The weight-sync channel's handshake and versioning (the bytes move in learner/ and rollout/).

Invariant: generation for policy version v starts only after every worker reports v. A sync
that does not finish within `sync.timeout_s` raises instead of hanging the run.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Dict

import ray

from common import weight_sync
from common.dispatch import call_when_up
from common.errors import RunFailed
from common.messages import RestartEvent
from common.ray_utils import death_cause, first_death

DEATH_WAIT_S = 10.0
JOIN_SLACK_S = 10.0


class WeightSyncError(RunFailed):
    pass


class WeightSyncChannel:
    def __init__(self, learner, rollout, dtype: str, bucket_mb: float, timeout_s: float, transport: str = "auto"):
        self.learner, self.rollout, self.timeout_s, self.transport = learner, rollout, timeout_s, transport
        # Held from the learner's update until its push: a worker re-joining in between gets
        # the weights of the version it is told (see `recover`).
        self.lock = threading.RLock()
        self.dtype, self.bucket_mb = dtype, bucket_mb
        self.base_spec, self._base_due = None, False
        self.refresh_spec(join=False)
        self.version = 0
        self._join()

    def refresh_spec(self, join: bool = True) -> None:
        """Ask the learner what a push sends (again after it changed: LoRA's adapters from the
        reference's snapshot or a resume on). When the push sends adapters, the engines get the
        base once first (`base_spec`, on the next push), as after a worker's restart."""
        spec = self.learner.weight_spec(self.dtype, self.bucket_mb)
        self.base_spec = self.learner.weight_spec(self.dtype, self.bucket_mb, "base")
        unchanged = self.base_spec is None and getattr(self, "spec", None) is not None and all(
            spec[k] == self.spec[k] for k in ("tensors", "dtype", "bucket_bytes"))
        if unchanged:
            return
        self.spec, self._base_due = spec, self.base_spec is not None
        if join:
            self._join()

    def _join(self) -> None:
        """(Re)build the sync group: learner rank 0 is the root; each worker's tensor-parallel
        ranks follow, from 1 on. Every member joins at once: the group's constructor waits for
        all of them."""
        host, port, self.backend = self.learner.sync_address()
        per_worker, members = self.rollout.sync_ranks, self.rollout.sync_members()
        world = 1 + per_worker * len(members)
        joins = [self.learner.join_weight_sync(host, port, world, self.timeout_s, self.backend)]
        joins += [w.init_weight_sync.remote(host, port, 1 + i * per_worker, world, self.timeout_s, self.backend)
                  for i, w in enumerate(members)]
        try:
            # Each member's join probe gives up after sync.timeout_s with its own one-line reason:
            # the driver waits a little longer, to report that reason rather than its own timeout.
            self._wait(joins, "joining the weight-sync group", slack_s=JOIN_SLACK_S)
        except WeightSyncError as error:
            raise WeightSyncError(f"{self._members(host, port, world)}: {error}") from error.__cause__
        except ray.exceptions.RayTaskError as error:
            cause = str(getattr(error, "cause", None) or error).strip().splitlines()[0][:400]
            raise WeightSyncError(f"{self._members(host, port, world)}: {cause}") from error
        # A new group gets a new shared file (a restarted worker maps it afresh); its name is
        # unlinked after the first push, once every receiver has mapped it.
        path = self._shm_path(host)
        if self.base_spec is not None:  # the adapters are small: only the base goes through the file
            self.base_spec["shm_path"], path = path, None
            self._base_due = True  # a restarted engine holds the initial weights, not the base
        self.spec["shm_path"] = path
        self._unlink_after_push = path or (self.base_spec or {}).get("shm_path")

    def _members(self, host: str, port: int, world: int) -> str:
        """The sync group's members, for a join that failed: learner rank 0 (the root, hosting the
        rendezvous) and the generation workers' nodes."""
        try:
            ips = ray.get([w.node_ip.remote() for w in self.rollout.sync_members()], timeout=DEATH_WAIT_S)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            ips = ["(a worker did not answer)"]
        return (f"weight-sync group ({self.backend}, {world} members: learner rank 0 on {host}:{port}, "
                f"generation workers on {', '.join(sorted(set(ips)))})")

    def _shm_path(self, learner_ip: str):
        """The shared-memory file of sync.transport=shm/auto, or None to broadcast the bytes."""
        if self.transport == "broadcast":
            return None
        same_node = all(ip == learner_ip for ip in ray.get([w.node_ip.remote() for w in self.rollout.sync_members()]))
        # Room for the model twice over: what else uses /dev/shm (Ray's object store) may grow.
        room = self.learner.shm_free_bytes() >= 2 * weight_sync.WeightSpec.from_wire(
            self.base_spec or self.spec).total_bytes
        if not (self.backend == "gloo" and same_node and room):
            if self.transport == "shm":
                raise WeightSyncError("sync.transport=shm needs a CPU learner (gloo), every generation worker on "
                                      "learner rank 0's node and /dev/shm with room for two copies of the model; "
                                      "use sync.transport=auto or broadcast")
            return None
        return f"/dev/shm/grpo-sync-{os.getpid()}-{uuid.uuid4().hex[:12]}"

    def repoint(self, learner) -> None:
        """A new learner group in place of a lost one: its rank 0 becomes the group's root and
        every worker joins it afresh (the next push then sends the new group's weights)."""
        with self.lock:
            self.learner = learner
            self._join()

    def recover(self) -> Dict[str, float]:
        """After a generation actor was restarted (a fresh engine, out of the group, holding the
        initial weights): rebuild the group and push the current version to every worker, so
        that the restarted one holds it before it generates again."""
        with self.lock, self.rollout.between_calls():
            self._join()
            return self.push(self.version)

    def _wait(self, refs, what: str, slack_s: float = 0.0):
        try:
            return ray.get(refs, timeout=self.timeout_s + slack_s)
        except ray.exceptions.GetTimeoutError:
            raise WeightSyncError(f"{what} took longer than sync.timeout_s={self.timeout_s:g}s") from None
        except ray.exceptions.RayActorError as error:
            raise WeightSyncError(f"{what} failed: an actor of the sync group died "
                                  f"({type(error).__name__})") from error

    def push(self, version: int) -> Dict[str, float]:
        """Send the learner's weights to every worker; return once all of them hold `version`.

        A worker busy generating takes the weights after its current call (Ray runs an actor's
        calls one at a time): weights never change in the middle of a generation request."""
        with self.lock, self.rollout.between_calls():
            try:
                return self._push(version)
            except WeightSyncError as error:
                if not self._worker_died(error):
                    raise
                died = error.__cause__  # `error` itself is unbound once the except clause ends
            # A generation actor died during the push: Ray restarts it (a fresh engine); the
            # sender leaves the broken group (the survivors' pending receives fail at once),
            # every worker re-joins and the push runs again, once.
            started = time.monotonic()
            self.learner.leave_weight_sync()
            for i, w in enumerate(self.rollout.sync_members()):
                call_when_up(w.ready, self.timeout_s, what=f"generation worker {i}")
            self._join()
            metrics = self._push(version)
            event = RestartEvent("generation worker", death_cause(died), self.rollout.worker_index(died),
                                 time.monotonic() - started, "the weight push")
            return {**metrics, "sync_worker_restarts": 1.0, "restart_events": [event]}

    def _worker_died(self, error: WeightSyncError) -> bool:
        cause = error.__cause__
        if not isinstance(cause, ray.exceptions.RayActorError) or self.rollout.recover is None:
            return False
        return self.rollout.worker_index(cause) >= 0

    def _dead_receiver(self, receives):
        """The RayActorError of a receiver that died, if one did: a dead actor's call fails within
        moments, a live receiver may wait in its broadcast, so the wait is short."""
        return first_death(receives, min(self.timeout_s, DEATH_WAIT_S))

    def _push(self, version: int) -> Dict[str, float]:
        if self._base_due:  # LoRA's base before its adapters: a version's two halves
            self._push_spec(self.base_spec, version)
            self._base_due = False
        return self._push_spec(self.spec, version)

    def _push_spec(self, spec: dict, version: int) -> Dict[str, float]:
        sends = self.learner.send_weights(spec)
        receives = [w.receive_weights.remote(spec, version) for w in self.rollout.sync_members()]
        try:
            results = self._wait(sends + receives, f"weight sync to version {version}")
        except ray.exceptions.RayTaskError as error:
            # A receiver that dies mid-push closes its connection under the sender's broadcast,
            # so the sender's error can arrive first: tell that apart from a sender failure.
            died = self._dead_receiver(receives)
            if died is not None:
                raise WeightSyncError(f"weight sync to version {version}: a generation actor died") from died
            raise WeightSyncError(f"weight sync to version {version} failed: "
                                  f"{str(error).strip().splitlines()[-1][:300]}") from error
        reported = [r["policy_version"] for r in results[len(sends):]]
        if any(v != version for v in reported):
            raise WeightSyncError(f"workers report versions {reported} after pushing version {version}")
        self.version = version
        if self._unlink_after_push:
            self.learner.unlink_sync_file(self._unlink_after_push)
            self._unlink_after_push = None
        metrics = dict(results[0])
        slowest = max(results[len(sends):], key=lambda r: r["load_s"])
        # The slowest worker's whole receive, and the part of it spent waiting for bytes (the
        # rest is vLLM loading them into the engine).
        metrics["sync_load_seconds"], metrics["sync_wait_seconds"] = slowest["load_s"], slowest.get("wait_s", 0.0)
        return metrics
