"""Keep the tail of what a vLLM engine writes to stderr, to name the cause when it fails to start.

vLLM starts its engine core (and, with tensor parallelism, its workers) as child processes; when
one of them fails, the parent raises only "Engine core initialization failed. See root cause
above", and the root cause is in the children's stderr: on a cluster, in a Ray worker log file
the user never sees. `StderrTail` points file descriptor 2 at a pipe for the actor's lifetime (the
children inherit it) and a thread copies everything on to the real stderr, keeping the last
64 KB, from which `root_cause` picks the last exception line.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Optional

_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit)\w*): (.+)$")
TAIL_BYTES = 1 << 16


class StderrTail:
    def __init__(self):
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._closed = False
        read_end, write_end = os.pipe()
        self._real = os.dup(2)
        os.dup2(write_end, 2)
        os.close(write_end)
        threading.Thread(target=self._pump, args=(read_end,), daemon=True, name="stderr-tail").start()

    def _pump(self, read_end: int) -> None:
        try:
            while True:
                chunk = os.read(read_end, 65536)
                if not chunk:  # every writer closed it (close(), and any child that inherited it)
                    return
                with contextlib.suppress(OSError):  # keep draining: a full pipe would block the writers
                    os.write(self._real, chunk)
                with self._lock:
                    self._tail += chunk
                    del self._tail[:-TAIL_BYTES]
        finally:
            os.close(read_end)
            os.close(self._real)

    def close(self) -> None:
        """Point file descriptor 2 back at the real stderr. The pipe loses this process's writer;
        once the children that inherited it have closed theirs too, the thread copies what is
        left and closes both of its descriptors. A second call does nothing."""
        with self._lock:
            if not self._closed:
                self._closed = True
                os.dup2(self._real, 2)

    def text(self) -> str:
        with self._lock:
            return self._tail.decode(errors="replace")


def root_cause(text: str) -> Optional[str]:
    """The last `SomeError: message` line of a log, without the wrapper that points elsewhere."""
    found = None
    for line in text.splitlines():
        match = _EXCEPTION_LINE.match(line.strip())
        if match and "See root cause above" not in line:
            found = f"{match.group(1)}: {match.group(2).strip()}"
    return found
