"""StderrTail: what an engine's process writes to file descriptor 2 is kept and passed on, and
closing it gives the descriptor back without leaving any open."""
from __future__ import annotations

import subprocess
import sys

from rollout.engine_log import root_cause

# Run in a child process (the tail takes over descriptor 2 of whatever process runs it), after
# PRELUDE: the descriptors open before, and a wait until they are all that is open again (the
# copying thread closes its two once every writer of the pipe has closed it).
PRELUDE = r"""
import os, subprocess, sys, time
from rollout.engine_log import StderrTail

def open_fds():
    return sorted(int(fd) for fd in os.listdir("/proc/self/fd"))

def back_to(fds):
    for _ in range(100):
        if open_fds() == fds:
            return True
        time.sleep(0.05)
    return False

before = open_fds()
"""

SCRIPT = PRELUDE + r"""
tail = StderrTail()
subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('ValueError: from a child\\n')"])
os.write(2, b"kept line\n")
tail.close()
closed = back_to(before)
os.write(2, b"after close\n")
print(repr(tail.text()), closed)
"""


def test_stderr_tail_keeps_passes_on_and_gives_back_file_descriptor_2():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == repr("ValueError: from a child\nkept line\n") + " True"
    # everything reached the real stderr, the line written after close() only there
    assert result.stderr == "ValueError: from a child\nkept line\nafter close\n"


# A child that inherited the pipe writes after close(): its line still reaches the real stderr, and
# the descriptors close only once it has exited. A second close() changes nothing.
CHILD_SCRIPT = PRELUDE + r"""
tail = StderrTail()
child = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(1); sys.stderr.write('late\\n')"])
tail.close()
tail.close()
still_open = open_fds() != before
child.wait()
print(still_open, back_to(before), repr(tail.text()))
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
