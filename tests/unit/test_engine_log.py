"""StderrTail: what an engine's process writes to file descriptor 2 is kept and passed on, and
closing it gives the descriptor back without leaving any open."""
from __future__ import annotations

import subprocess
import sys

from rollout.engine_log import root_cause

# In a child process: the tail takes over descriptor 2 of whatever process runs it.
SCRIPT = r"""
import os, subprocess, sys, time
from rollout.engine_log import StderrTail

def open_fds():
    return sorted(int(fd) for fd in os.listdir("/proc/self/fd"))

before = open_fds()
tail = StderrTail()
subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('ValueError: from a child\\n')"])
os.write(2, b"kept line\n")
tail.close()
for _ in range(100):  # the copying thread sees the pipe's end and closes its descriptors
    if open_fds() == before:
        break
    time.sleep(0.05)
os.write(2, b"after close\n")
print(repr(tail.text()), open_fds() == before)
"""


def test_stderr_tail_keeps_passes_on_and_gives_back_file_descriptor_2():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == repr("ValueError: from a child\nkept line\n") + " True"
    # everything reached the real stderr, the line written after close() only there
    assert result.stderr == "ValueError: from a child\nkept line\nafter close\n"


# A child that inherited the pipe writes after close(): its line still reaches the real stderr, and
# the descriptors close only once it has exited. A second close() changes nothing.
CHILD_SCRIPT = r"""
import os, subprocess, sys, time
from rollout.engine_log import StderrTail

def open_fds():
    return sorted(int(fd) for fd in os.listdir("/proc/self/fd"))

before = open_fds()
tail = StderrTail()
child = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(1); sys.stderr.write('late\\n')"])
tail.close()
tail.close()
still_open = open_fds() != before
child.wait()
for _ in range(100):
    if open_fds() == before:
        break
    time.sleep(0.05)
print(still_open, open_fds() == before, repr(tail.text()))
"""


def test_stderr_tail_waits_for_children_holding_the_pipe_and_closes_once():
    result = subprocess.run([sys.executable, "-c", CHILD_SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True True " + repr("late\n")
    assert result.stderr == "late\n"


def test_root_cause_is_the_last_exception_line_that_is_not_a_pointer():
    log = ("Traceback (most recent call last):\n  ...\nValueError: too small\n"
           "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert root_cause(log) == "ValueError: too small"
    assert root_cause("all fine\n") is None
