"""Memory caps for the processes a test starts: a fresh Linux memory cgroup per process (cgroup v1's memory
controller, or v2's where it is enabled), the way a CI runner or a container bounds a build. A test fixture,
not part of the rule set. Needs root (or a delegated cgroup subtree); `available()` says why not."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Optional, Sequence


def _mounts():
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            separator = fields.index("-")
            yield Path(fields[4]), fields[separator + 1], fields[separator + 3].split(",")


def _v1_root() -> Optional[Path]:
    for point, kind, options in _mounts():
        if kind == "cgroup" and "memory" in options:
            return point
    return None


def _v2_root() -> Optional[Path]:
    for point, kind, _ in _mounts():
        if kind == "cgroup2" and "memory" in (point / "cgroup.subtree_control").read_text().split():
            return point
    return None


class MemoryCap:
    """One cgroup limited to `limit_bytes` (no swap); `run(argv)` runs a process inside it and returns its
    CompletedProcess; `peak_bytes()` is the most memory the group was charged (anonymous memory and page
    cache, as the kernel's OOM killer counts it); `oom_killed()` whether the kernel killed in it."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        name = f"dsa-memory-cap-{uuid.uuid4().hex[:12]}"
        v1, v2 = _v1_root(), _v2_root()
        if v1 is not None:
            self.path, self.version = v1 / name, 1
        elif v2 is not None:
            self.path, self.version = v2 / name, 2
        else:
            raise OSError("no writable memory cgroup: neither cgroup v1's memory controller nor a cgroup v2 "
                          "subtree with memory enabled is mounted")
        self.path.mkdir()
        if self.version == 1:
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limit_bytes))
        else:
            (self.path / "memory.max").write_text(str(limit_bytes))
            (self.path / "memory.swap.max").write_text("0")

    def run(self, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        procs = str(self.path / "cgroup.procs")

        def enter():  # in the child, before exec: it and everything it starts are in the group
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return subprocess.run(list(argv), preexec_fn=enter, capture_output=True, text=True, **kwargs)

    def peak_bytes(self) -> int:
        if self.version == 1:
            return int((self.path / "memory.max_usage_in_bytes").read_text())
        peak = self.path / "memory.peak"
        return int(peak.read_text()) if peak.exists() else -1

    def oom_killed(self) -> bool:
        if self.version == 1:
            control = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
            return int(control.get("oom_kill", 0)) > 0
        events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
        return int(events.get("oom_kill", 0)) > 0

    def close(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.path.rmdir()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def available() -> str:
    """'' when a capped group can be made here, else why not."""
    try:
        MemoryCap(1 << 30).close()
        return ""
    except OSError as e:
        return str(e)
