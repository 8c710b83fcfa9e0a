"""Sets the IREE runtime flags a compiled module needs (its module index's `runtime_flags`) before this
process's first device. IREE reads them once, when a driver is first created (the Python binding caches the
driver for the process): a flag set after that is ignored, so a module needing more than the process was set
up with is refused here, by name, rather than left to overflow a worker's stack."""

from __future__ import annotations

from typing import Dict, Iterable, Optional

from dsa.core.errors import DsaError
from dsa.core.runtime_flags import runtime_flag_values

# What this process's IREE runtime was set up with, once a first module asked (None: not yet).
_in_effect: Optional[Dict[str, int]] = None


def require(flags: Iterable[str], where: str) -> None:
    """Before a module's device is first used: sets `flags` if this is the process's first module, else
    checks that what was set covers them (a larger worker stack serves a module that needs less)."""
    global _in_effect
    needed = runtime_flag_values(list(flags), where)
    if _in_effect is None:
        if needed:
            import iree.runtime as rt

            rt.flags.parse_flags(*[f"{name}={value}" for name, value in sorted(needed.items())])
        _in_effect = dict(needed)
        return
    short = {name: value for name, value in needed.items() if _in_effect.get(name, 0) < value}
    if short:
        have = ", ".join(f"{name}={_in_effect[name]}" if name in _in_effect else f"{name} at IREE's default"
                         for name in sorted(short))
        raise DsaError(where, f"needs the IREE runtime flags {', '.join(f'{n}={v}' for n, v in sorted(short.items()))}"
                       f", but this process set up IREE's runtime for an earlier module with {have}",
                       "load the module that needs the most first, or run it in a process of its own")


def in_effect() -> Optional[Dict[str, int]]:
    """What this process's IREE runtime was set up with (None before the first module)."""
    return None if _in_effect is None else dict(_in_effect)


def set_task_threads(threads: int) -> None:
    """IREE's local-task driver: one worker per requested thread (like torch's and ONNX Runtime's thread
    counts, so that timings compare), set before this process's first device. A runtime without the flag
    keeps one worker per core."""
    import iree.runtime as rt

    try:
        rt.flags.parse_flags(f"--task_topology_max_group_count={threads}")
    except Exception:  # flag absent in this runtime: it then uses one worker per core
        pass
