"""Whether this machine can run a target's modules: its architecture and the CPU features the target needs.

A module compiled for a CPU the host lacks does not fail politely: IREE loads it and the first AVX-512
instruction kills the process with SIGILL. A target spec therefore names what its code needs
(`"host": {"arch": "x86_64", "cpu_features": [...]}`, feature names as Linux's /proc/cpuinfo spells them), and
every runner checks it before it loads a module (`check_host`), with a message that names the target, what
is missing and what to do. `best_target` picks the most capable target a machine runs, and `host_cpu_model`
names its CPU (the benchmark and the tuner label their measurements with it).
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import List, Optional, Sequence

from dsa.core.errors import DsaError
from dsa.core.fileio import read_json

_CPUINFO = Path("/proc/cpuinfo")


def host_arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _cpuinfo_field(keys: Sequence[str], cpuinfo: Path) -> Optional[str]:
    """The value of /proc/cpuinfo's first line whose key is one of `keys`, or None (no such line, not Linux)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value.strip()
    return None


def host_cpu_features(cpuinfo: Path = _CPUINFO) -> Optional[List[str]]:
    """The CPU's feature flags (/proc/cpuinfo `flags`, or `Features` on aarch64), or None where the system does
    not say (not Linux)."""
    value = _cpuinfo_field(("flags", "Features"), cpuinfo)
    return None if value is None else value.split()


def host_cpu_model(cpuinfo: Path = _CPUINFO) -> str:
    """The CPU's name as /proc/cpuinfo gives it (`model name`), else as the platform module does, else
    "unknown": what a measurement is labelled with."""
    return _cpuinfo_field(("model name",), cpuinfo) or platform.processor() or "unknown"


def missing_for(spec: dict, arch: str, features: Optional[Sequence[str]]) -> Optional[str]:
    """Why a host of `arch` with `features` cannot run `spec`'s modules, or None when it can (or when the spec
    states no requirement, or the host's features are unknown and the arch matches)."""
    needs = spec.get("host")
    if not needs:
        return None
    if needs.get("arch") and needs["arch"] != arch:
        return f"its code is for {needs['arch']} CPUs and this machine is {arch}"
    if features is None:
        return None
    lacking = sorted(set(needs.get("cpu_features", [])) - set(features))
    if lacking:
        return f"it needs the CPU features {', '.join(lacking)}, which this CPU lacks"
    return None


def capability(spec: dict) -> int:
    """How capable a CPU a target needs: the number of CPU features its spec's `host` names. Among targets a
    machine runs, the one with the most is taken (best_target; a policy's levels: dsa.runtime.policy)."""
    return len((spec.get("host") or {}).get("cpu_features", []))


def best_target(targets_dir: Path, *, features: Optional[Sequence[str]] = None, arch: Optional[str] = None) -> str:
    """The most capable target of `targets_dir` (the one needing the most CPU features) that a CPU of `arch`
    with `features` runs, by each spec's `host` requirements; both default to this machine's. A CPU whose
    features are unknown is taken to have none (only a target needing none would fit)."""
    if features is None:
        features = host_cpu_features() or []
    arch = arch or host_arch()
    specs = [read_json(p) for p in sorted(targets_dir.glob("*.json"))]
    fitting = [s for s in specs if s.get("host") and missing_for(s, arch, features) is None]
    if not fitting:
        raise DsaError(str(targets_dir), "no target spec fits this machine's CPU",
                       "pass --target NAME, or add a target for this CPU (docs/architecture.md)")
    return max(fitting, key=lambda s: (capability(s), s["name"]))["name"]


def runs_here(spec: dict) -> bool:
    return missing_for(spec, host_arch(), host_cpu_features()) is None and missing_driver(spec) is None


# Runtime drivers that run on the host CPU: always there.
_CPU_DRIVERS = ("local-task", "local-sync")


def missing_driver(spec: dict) -> Optional[str]:
    """Why this machine cannot run `spec`'s modules for lack of a device (a GPU target's `runtime_driver`:
    cuda, hip, vulkan), or None. Asks the IREE runtime for the driver's devices without creating one."""
    driver = spec.get("runtime_driver", "local-task")
    if driver in _CPU_DRIVERS:
        return None
    try:
        import iree.runtime as rt

        devices = rt.get_driver(driver).query_available_devices()
    except Exception as e:  # the driver is not compiled in, or its system library (libcuda, ...) is absent
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"it needs the IREE runtime driver '{driver}', which cannot start here ({first})"
    if not devices:
        return f"it needs a device of the IREE runtime driver '{driver}', and this machine has none"
    return None


def check_host(spec: dict, where: str) -> None:
    """Refuses, before anything is loaded, a target this machine cannot execute: code for a CPU it lacks, or
    for a device (GPU driver) it does not have."""
    why = missing_for(spec, host_arch(), host_cpu_features()) or missing_driver(spec)
    if why is not None:
        raise DsaError(
            where,
            f"the module is compiled for target '{spec.get('name')}' and cannot run on this machine: {why}",
            "run a module built for a target this machine supports (the manifest's `targets`; e.g. "
            "x86_64-v3 for x86-64 CPUs without AVX-512; docs/targets.md names each target's driver)",
        )
