"""The heavy lock (one measured step at a time on a shared machine) and peak-memory readings."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from dsa.core.errors import DsaError


DEFAULT_LOCK = Path("/tmp/dsa-heavy.lock")


# -- the heavy lock ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def heavy_lock(path: Optional[Path], what: str = "", log: Callable[[str], None] = print) -> Iterator[float]:
    """An exclusive fcntl.flock on `path` (created if absent) for the block; None: no lock. Yields the seconds
    waited for it. Waiting is said once on `log`."""
    if path is None:
        yield 0.0
        return
    path = Path(path)
    fd = os.open(str(path), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        start = time.monotonic()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"dsa scale: waiting for the heavy lock {path}" + (f" ({what})" if what else "") + " …")
            fcntl.flock(fd, fcntl.LOCK_EX)
        waited = time.monotonic() - start
        try:
            yield waited
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# -- peak resident memory of a process, as it sees itself -------------------------------------------------
def read_vmhwm_kib(status_text: str) -> int:
    """VmHWM (the peak resident set, KiB) from the text of /proc/<pid>/status."""
    for line in status_text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise DsaError("/proc/self/status", "has no VmHWM line", "peak memory is read on Linux only")


def own_vmhwm_kib() -> int:
    """This process's peak resident memory (KiB): its VmHWM. Unlike the rusage its parent reaps (ru_maxrss), it
    belongs to this process's own address space, made new at exec, so the parent's size at fork is not in it."""
    with open("/proc/self/status", encoding="ascii") as f:
        return read_vmhwm_kib(f.read())


def memory_total_bytes() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0
