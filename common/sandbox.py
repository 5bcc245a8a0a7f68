"""Run untrusted Python (a model's program followed by a row's tests, or a model's call of the
`python` tool) in a throwaway sandbox.

One call = one child process tree, built from Linux namespaces with util-linux's `unshare`:

- a new PID namespace (`--fork --pid --mount-proc`): the program sees only its own processes,
  and when the sandbox's first process dies the kernel kills every other one in it, so a fork
  bomb or a `setsid` escapee cannot outlive the call;
- a new network namespace (`--net`): only a loopback that is down; every connect fails;
- a new mount namespace (`--mount`): empty size-capped tmpfs over /tmp, /var/tmp, /dev/shm and
  the caller's home (Ray's session files, tokens, `~/.netrc` disappear); the working
  directory is a fresh folder on that tmpfs, gone when the call ends;
- a cleaned environment (PATH, LANG, HOME only: no tokens or secrets), `python -I -S`;
- rlimits on CPU seconds, address space, file size, open files and processes; when started
  as root the program runs as `nobody`, so the process limit applies and nothing of the
  caller's is writable; otherwise `--map-root-user` gives the namespaces without privilege.

The caller's wall-clock limit kills `unshare` with SIGKILL; `--kill-child` then kills the
sandbox's first process, which takes the whole PID namespace with it.

A program passes only if the tests ran to their end: the harness writes a random nonce to a
private pipe after the last test statement. `sys.exit(0)` or `os._exit(0)` before the tests
exits cleanly but never writes it.
"""
from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from common.child import die_with_parent

__all__ = ["SandboxLimits", "SandboxResult", "kill", "run_python", "sandbox_problem"]

_NOBODY = 65534
_RESULT_CAP = 64 * 1024


MARGIN_S = 0.25
"""A sandbox gets this much less than its caller's hard limit (a verifier's, a tool call's), so
that a slow program ends as the sandbox's own timeout (cheap) rather than as a kill of the whole
process that called it."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    """Wall-clock limit of the whole call (CPU time is capped at the same number of seconds)."""
    memory_mb: int = 1024
    """Address-space limit of each process in the sandbox."""
    max_file_mb: int = 16
    """Largest file the program may write (and the size of each tmpfs)."""
    max_processes: int = 64
    """Processes the sandbox user may run at once."""


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    """The program and every test ran to the end without an exception."""
    timed_out: bool
    error: str = ""
    """One line: the exception that stopped it, `timeout`, or how the process ended."""
    seconds: float = 0.0
    output: str = ""
    """What the program printed (stdout and stderr, in order), when the caller asked for it:
    the first `capture_chars` characters, then a note of how many more there were."""


# The code that runs inside the namespaces: PID 1 of the new PID namespace, root there (real
# root, or mapped root with --map-root-user). Stdlib only (`python -I -S`). It receives one JSON
# object on stdin: program, tests, nonce, limits, result fd, home.
_HARNESS = r'''
import ctypes, json, os, resource, sys, traceback
job = json.loads(sys.stdin.read())
sys.stdin.close()
fd = job["fd"]
libc = ctypes.CDLL(None, use_errno=True)
def mount(source, target, fstype, flags, opts):
    if libc.mount(source.encode(), target.encode(), fstype.encode(), flags, opts.encode()) != 0:
        raise OSError(ctypes.get_errno(), "mount " + source + " on " + target)
MS_BIND, MS_REC = 4096, 16384
tmpfs = "size=%dm,mode=1777" % (job["file_mb"] * 4)
mount("tmpfs", "/tmp", "tmpfs", 0, tmpfs)
# The interpreter's own files may live under a folder we hide (pyenv in the home): stage them
# on the new /tmp, cover the folder with tmpfs, and bind them back at the same path.
for i, path in enumerate(job["keep"]):
    os.makedirs("/tmp/.keep/%d" % i)
    mount(path, "/tmp/.keep/%d" % i, "", MS_BIND | MS_REC, "")
for where in ["/var/tmp", "/dev/shm"] + job["hide"]:
    if os.path.isdir(where):
        mount("tmpfs", where, "tmpfs", 0, tmpfs)
for i, path in enumerate(job["keep"]):
    os.makedirs(path, exist_ok=True)
    mount("/tmp/.keep/%d" % i, path, "", MS_BIND | MS_REC, "")
work = "/tmp/work"
os.mkdir(work, 0o700)
if os.getuid() == 0 and job["drop"]:
    os.chown(work, 65534, 65534)
os.chdir(work)
lim = resource.setrlimit
cpu = job["cpu_s"]
lim(resource.RLIMIT_CPU, (cpu, cpu))
lim(resource.RLIMIT_AS, (job["memory_mb"] << 20, job["memory_mb"] << 20))
lim(resource.RLIMIT_FSIZE, (job["file_mb"] << 20, job["file_mb"] << 20))
lim(resource.RLIMIT_NOFILE, (64, 64))
lim(resource.RLIMIT_NPROC, (job["nproc"], job["nproc"]))
lim(resource.RLIMIT_CORE, (0, 0))
if os.getuid() == 0 and job["drop"]:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    # a change of uid clears the parent-death signal that --kill-child set: arm it again
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
program, tests, nonce, capture = job["program"], job["tests"], job["nonce"], job["capture"]
del job
class Capped:
    """stdout/stderr kept in memory up to `capture` characters; the rest only counted (a flood
    costs CPU time, which the rlimit bounds, never memory)."""
    def __init__(self):
        self.parts, self.kept, self.dropped = [], 0, 0
    def write(self, text):
        text = str(text)
        room = capture - self.kept
        if room > 0:
            self.parts.append(text[:room])
            self.kept += min(len(text), room)
        self.dropped += max(len(text) - max(room, 0), 0)
        return len(text)
    def flush(self):
        pass
    def text(self):
        more = "\n[... %d more characters]" % self.dropped if self.dropped else ""
        return "".join(self.parts) + more
out = Capped()
if capture:
    sys.stdout = sys.stderr = out
def report(text):
    if capture:
        text = text + "\n" + out.text()
    try:
        os.write(fd, text.encode("utf-8", "replace")[:4096 + 4 * capture])
    except OSError:
        pass
scope = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(program, "solution.py", "exec"), scope)
    exec(compile(tests, "tests.py", "exec"), scope)
except BaseException as exc:
    line = traceback.format_exception_only(type(exc), exc)[-1].strip()
    if capture:
        out.write(line + "\n")
    report("error " + line[:300])
    os._exit(1)
report("ok " + nonce)
os._exit(0)
'''


def _unshare_command(as_root: bool) -> list:
    cmd = ["unshare", "--fork", "--pid", "--mount-proc", "--net", "--mount", "--ipc", "--kill-child"]
    if not as_root:
        cmd.insert(1, "--map-root-user")
    return cmd + [sys.executable, "-I", "-S", "-c", _HARNESS]


def _hidden_paths() -> list:
    """Folders with the caller's secrets that the tmpfs mounts must cover (besides /tmp)."""
    home = os.path.realpath(os.path.expanduser("~"))
    return [home] if home not in ("/", "") and os.path.isdir(home) else []


def _kept_paths(hidden: list) -> list:
    """The interpreter's installation, when it lies under a hidden folder (pyenv in the home)."""
    prefix = os.path.realpath(sys.base_prefix)
    return [prefix] if any(prefix.startswith(h.rstrip("/") + "/") for h in hidden) else []


def _read_report(fd: int) -> str:
    chunks, size, deadline = [], 0, time.monotonic() + 1.0
    while size < _RESULT_CAP:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            break
        data = os.read(fd, 4096)
        if not data:
            break
        chunks.append(data)
        size += len(data)
    return b"".join(chunks).decode("utf-8", "replace")


def kill(proc: subprocess.Popen) -> None:
    """End a sandbox from another thread: its `run_python` call then returns at once."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL unshare and its process group. The sandbox's PID 1 dies with it (parent-death
    signal, or the group if it stayed in it), and the kernel then kills the whole namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_python(program: str, tests: str, limits: SandboxLimits = SandboxLimits(),
               capture_chars: int = 0,
               on_start: Optional[Callable[[subprocess.Popen], None]] = None) -> SandboxResult:
    """Run `program` then `tests` (Python source, assertions) in one sandboxed interpreter.
    `capture_chars` > 0 keeps that much of what it prints, in `SandboxResult.output`.
    `on_start(proc)` gets the sandbox's process as soon as it exists: a caller that shuts down
    may kill it (`kill`) rather than wait for its time limit."""
    start = time.monotonic()
    as_root = os.getuid() == 0
    nonce = secrets.token_hex(16)
    read_fd, write_fd = os.pipe()
    hidden = _hidden_paths()
    job = {
        "program": program, "tests": tests, "nonce": nonce, "fd": write_fd,
        "cpu_s": max(1, int(limits.timeout_s + 0.999)), "memory_mb": limits.memory_mb,
        "file_mb": limits.max_file_mb, "nproc": limits.max_processes,
        "hide": hidden, "keep": _kept_paths(hidden), "drop": as_root, "capture": int(capture_chars),
    }
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp/work",
           "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        proc = subprocess.Popen(_unshare_command(as_root), stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                pass_fds=(write_fd,), cwd="/", start_new_session=True,
                                preexec_fn=die_with_parent)
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        return SandboxResult(False, False, f"sandbox did not start: {exc}", time.monotonic() - start)
    os.close(write_fd)
    if on_start is not None:
        on_start(proc)
    timed_out = False
    try:
        try:
            # ensure_ascii: lone surrogates (invalid UTF-8 decoded with surrogateescape) survive
            proc.communicate(json.dumps(job).encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc)
        except BrokenPipeError:
            proc.wait(timeout=limits.timeout_s)
        report = _read_report(read_fd)
        report, _, output = report.partition("\n") if capture_chars else (report, "", "")
    finally:
        os.close(read_fd)
        if proc.poll() is None:
            _kill(proc)
    return _verdict(proc.returncode, report, nonce, timed_out, time.monotonic() - start, output)


def _verdict(returncode: Optional[int], report: str, nonce: str, timed_out: bool, seconds: float,
             output: str) -> SandboxResult:
    """What a finished sandbox run means: passed only with a clean exit and the run's own nonce."""
    if timed_out:
        return SandboxResult(False, True, "timeout", seconds, output)
    if returncode == 0 and report == f"ok {nonce}":
        return SandboxResult(True, False, "", seconds, output)
    if report.startswith("error "):
        return SandboxResult(False, False, report[6:].splitlines()[0][:300], seconds, output)
    if returncode and returncode < 0:
        error = f"killed by {signal.Signals(-returncode).name}"
    elif returncode and returncode > 128:
        error = f"killed by signal {returncode - 128}"
    else:
        error = f"exited with status {returncode} before the tests finished"
    return SandboxResult(False, False, error, seconds, output)


def sandbox_problem() -> Optional[str]:
    """None if the sandbox works on this machine, else one line saying why it does not."""
    if shutil.which("unshare") is None:
        return "the code verifier needs util-linux's `unshare` (Linux namespaces), not found on PATH"
    result = run_python("x = 1", "assert x == 1", SandboxLimits(timeout_s=20))
    if not result.passed:
        return (f"the code verifier's sandbox does not work here ({result.error}); it needs Linux "
                f"namespaces: run as root or allow unprivileged user namespaces")
    return None
