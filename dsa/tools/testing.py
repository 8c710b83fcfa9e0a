"""Helpers for tests of compiled policies: locate build outputs in runfiles, build the eager reference."""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path

from dsa.stages.export import load_entry_point


def runfile(short_path: str) -> Path:
    """A workspace-relative path inside the test's runfiles tree (or the cwd outside Bazel)."""
    srcdir = os.environ.get("TEST_SRCDIR")
    if srcdir:
        return Path(srcdir) / os.environ["TEST_WORKSPACE"] / short_path
    return Path(short_path)


def eager_policy(export_view: dict, dims: dict, checkpoint: Path):
    """The model as eager PyTorch, with the checkpoint's weights: the reference compiled modules must match."""
    from safetensors.torch import load_file

    spec = load_entry_point(export_view["model"]["entry_point"])(export_view, dims)
    module = spec.module.eval()
    module.load_state_dict(load_file(str(checkpoint)), strict=True)
    return module, spec


# What an in-process hostile-input case may allocate beyond what the process already holds.
CASE_MEMORY_HEADROOM_BYTES = 1 << 30


def address_space_bytes() -> int:
    """This process's virtual memory size (VmSize), the quantity RLIMIT_AS bounds."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmSize")


@contextlib.contextmanager
def bounded_memory(headroom: int = CASE_MEMORY_HEADROOM_BYTES):
    """Runs the block with the address space capped at what the process holds now plus `headroom`: an input
    that makes a reader allocate more fails the case with MemoryError instead of exhausting the machine.
    The cap is the soft limit only, lifted again afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = address_space_bytes() + headroom
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield cap
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
