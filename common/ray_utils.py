"""Small Ray and networking helpers shared by the driver and the actors."""
from __future__ import annotations

import os
import random
import re
import socket


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


_HANDED_OUT: set = set()
LOWEST_PORT = 20000
"""Above Ray's worker ports (10002-19999 unless its start says otherwise)."""


def free_port() -> int:
    """A TCP port free on this node now, for a server that a process about to start will bind
    (a rendezvous, a sync group). Chosen at random below the kernel's ephemeral range, where
    the kernel never picks the port of an outgoing connection: a port it picked for us (bind to
    port 0) lies in that range, and in the seconds before a learner rank bound it, a connection
    had taken it (EADDRINUSE; CI at 710d593). Never the same port twice from one process."""
    lowest_ephemeral = _ephemeral_ports()[0]
    rng = random.SystemRandom()
    for _ in range(200 if lowest_ephemeral - LOWEST_PORT >= 1000 else 0):
        port = rng.randrange(LOWEST_PORT, lowest_ephemeral)
        if port not in _HANDED_OUT and _bindable(port):
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a machine whose ephemeral range is all
        s.bind(("", 0))
        return s.getsockname()[1]


def _ephemeral_ports() -> tuple:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def init_ray(address: str | None, num_cpus: int | None, env_vars: dict | None = None,
             num_gpus: int | None = None) -> str | None:
    """Join `address` (or RAY_ADDRESS) if given, else start a local Ray. Returns the Ray
    dashboard's address (None for the local Ray, which runs without one)."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        context = ray.init(address=address, runtime_env={"env_vars": env_vars} if env_vars else None,
                           log_to_driver=False, logging_level="ERROR")
        url = getattr(context, "dashboard_url", None)
        return f"http://{url}" if url and not url.startswith("http") else url
    start_local_ray(num_cpus, num_gpus, env_vars)
    return None


def start_local_ray(num_cpus: int | None, num_gpus: int | None = None, env_vars: dict | None = None) -> None:
    """A Ray of this process's own, quiet (the progress bar is the run's voice; actor errors
    still reach the driver as exceptions), never one some other process started on this machine
    (plain ray.init() would join that one)."""
    import ray

    # The raylet kills a dead worker's whole process group, so what an actor started (vLLM's
    # engine core and its ranks) never outlives it, however it died (docs/cluster.md).
    os.environ.setdefault("RAY_process_group_cleanup_enabled", "1")
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus,
             runtime_env={"env_vars": env_vars} if env_vars else None, include_dashboard=False,
             log_to_driver=False, logging_level="ERROR",
             # Ray starts one idle worker process per CPU for the first driver, for tasks that
             # hardly come here: every actor gets a process of its own. Those workers start
             # while the actors import vLLM, torch and DeepSpeed, on the same cores. Without
             # them a small run's actors were ready sooner on 2 cores, in interleaved pairs
             # (bench/end_to_end.py, "actors ready"). A RayConfig key of the Ray setup.py pins.
             _system_config={"prestart_worker_first_driver": False})


def death_cause(error: BaseException) -> str:
    """What Ray says killed an actor, in a few words (its own message is many lines and lists
    every possible cause, out-of-memory first, even for a plain kill)."""
    text = str(error)
    # Only the memory monitor's own words: every plain-kill message also lists "the OOM killer"
    # among its possible causes, in a wording that changes between Ray releases.
    if type(error).__name__ == "OutOfMemoryError" or "memory monitor" in text or "low on memory" in text:
        return "out of memory (Ray's memory monitor killed it)"
    if getattr(error, "actor_init_failed", False):  # its __init__ raised: the traceback's last line says what
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return f"its start failed: {lines[-1][:160]}" if lines else "its start failed"
    detail = re.search(r"Worker exit detail: ([^\n]*)", text)
    if detail:
        line = detail.group(1).strip()
        if "connection error" in line or "End of file" in line:
            return "its process ended without a word (a kill signal or a crash)"
        return line.split(". ")[0][:160]
    if "ray.kill" in text:
        return "killed with ray.kill"
    if type(error).__name__ == "ActorUnavailableError":
        return "its process stopped answering (killed or crashed)"
    return type(error).__name__


def actor_index(handles, cause) -> int:
    """The index in `handles` of the actor `cause` (a RayActorError) names; -1 when it names
    none of them. Ray gives a handle no public id: `_actor_id` is read here and nowhere else."""
    actor_id = getattr(cause, "actor_id", None)
    actor_id = actor_id.hex() if isinstance(actor_id, bytes) else actor_id
    ids = [h._actor_id.hex() for h in handles]
    return ids.index(actor_id) if actor_id in ids else -1


def first_death(refs, wait_s: float):
    """The RayActorError of an actor among `refs`' that died, if one did. A dead actor's call
    fails within moments while a live one may still wait (in a collective, a broadcast), so the
    wait is bounded by `wait_s`."""
    import ray

    ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    for ref in refs:
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as error:
            return error
        except Exception:  # an actor that failed but lives, or is still waiting
            continue
    return None
