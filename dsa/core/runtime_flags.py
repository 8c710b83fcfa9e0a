"""IREE runtime flags a module may need of whoever runs it, as the tuning file, the compile report and the
module index carry them (`runtime_flags`: ["--name=value", ...]). Standard library only: the torch-free runtime
reads them too (dsa.runtime.iree_flags sets them)."""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

from dsa.core.errors import DsaError

# IREE runtime flags a tuning may require of whoever runs its modules (`runtime_flags` in the tuning file;
# the compile report and the module index carry them; dsa.runtime.iree_flags sets them before the process's
# first device): the stack of each local-task worker. A module compiled with a stack-allocation limit over
# the compiler's default can need more than the runtime's default 128 KiB worker stack, and overflows it
# (a crash, not an error) without the flag.
RUNTIME_FLAGS = ("--task_worker_stack_size",)
# The largest value any of them may take: a worker stack of 64 MiB is far beyond any module's need (the largest
# stack-allocation limit a tuning may set is 8 MiB, dsa/stages/compile_flags.py), and a larger one is a
# per-thread reservation that can abort the runner (2^63-1 did).
MAX_RUNTIME_FLAG_VALUE = 64 * 1024 * 1024


def runtime_flag_values(flags, where: str) -> Dict[str, int]:
    """`["--name=BYTES", ...]` → {name: BYTES}, refusing a flag outside RUNTIME_FLAGS or a value that is not a
    positive byte count."""
    if not isinstance(flags, (list, tuple)):
        raise DsaError(where, "'runtime_flags' must be a list of '--flag=value' strings")
    values = {}
    for flag in flags:
        name, sep, value = flag.partition("=") if isinstance(flag, str) else ("", "", "")
        if name not in RUNTIME_FLAGS:
            raise DsaError(where, f"runtime flag {flag!r} is not one a tuning may require",
                           f"allowed: {', '.join(f'{n}=BYTES' for n in RUNTIME_FLAGS)}")
        if not sep or not value.isdigit() or len(value) > 12 or not 0 < int(value) <= MAX_RUNTIME_FLAG_VALUE:
            raise DsaError(where, f"runtime flag {flag[:80]!r} needs a positive byte count of at most "
                           f"{MAX_RUNTIME_FLAG_VALUE} (64 MiB)", f"write {name}=524288")
        values[name] = int(value)
    return values


def merge_runtime_flags(lists: Iterable) -> List[str]:
    """The runtime flags that satisfy every list: per flag, the largest value (a bigger worker stack serves a
    module that needs less), sorted by name."""
    merged: dict = {}
    for flags in lists:
        for name, value in runtime_flag_values(flags, "runtime_flags").items():
            merged[name] = max(value, merged.get(name, 0))
    return [f"{name}={merged[name]}" for name in sorted(merged)]


def index_runtime_flags(reports: Iterable[dict]) -> Tuple[str, ...]:
    """A module index's `runtime_flags`: what its modules' compile reports require, merged (every index writer:
    DsaLock, `dsa compile`, the bundle)."""
    return tuple(merge_runtime_flags(report.get("runtime_flags", []) for report in reports))
