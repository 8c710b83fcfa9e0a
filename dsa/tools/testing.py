"""Helpers for tests of compiled policies: locate build outputs in runfiles, build the eager reference."""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path


def runfile(short_path: str) -> Path:
    """A workspace-relative path inside the test's runfiles tree (or the cwd outside Bazel)."""
    srcdir = os.environ.get("TEST_SRCDIR")
    if srcdir:
        return Path(srcdir) / os.environ["TEST_WORKSPACE"] / short_path
    return Path(short_path)


def eager_policy(export_view: dict, dims: dict, checkpoint: Path):
    """The model as eager PyTorch, with the checkpoint's weights (a .safetensors file, or a sharded
    checkpoint's index): the reference compiled modules must match. Built without weights and given the
    checkpoint's tensors one at a time (dsa.stages.weightless.materialise): the weights are held once, in the
    model's dtype, and nothing is initialised, so a multi-billion-parameter reference fits where its
    weights do."""
    # Imported here: runfile() serves tests in torch-free environments.
    from dsa.stages.export import load_entry_point
    from dsa.stages.tensor_files import open_safetensors
    from dsa.stages.weightless import materialise, without_weights

    with without_weights():
        spec = load_entry_point(export_view["model"]["entry_point"])(export_view, dims)
    module = spec.module.eval()
    with open_safetensors(checkpoint) as tensors:
        extra = sorted(set(tensors.keys()) - set(module.state_dict()))
        if extra:
            raise KeyError(f"{checkpoint} holds tensors the model does not have: {extra[:5]}")
        materialise(module, tensors.read)
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


# User-mode emulation of aarch64 modules (toolchains/emulation): Debian's qemu-user-static, the aarch64 IREE
# runtime tools of the pinned iree-base-runtime wheel (@dsa_runtime_aarch64) and Debian's aarch64 C/C++ runtime.
QEMU_AARCH64 = Path("/usr/bin/qemu-aarch64-static")
AARCH64_SYSROOT = Path("/usr/aarch64-linux-gnu")
AARCH64_LOADER = AARCH64_SYSROOT / "lib" / "ld-linux-aarch64.so.1"
_IREE_SCALAR = {"int64": "i64", "int32": "i32", "float32": "f32"}


def aarch64_emulation_missing() -> str:
    """Why aarch64 modules cannot be emulated here, or '' when they can."""
    import shutil

    qemu = shutil.which("qemu-aarch64-static") or str(QEMU_AARCH64)
    if not Path(qemu).exists() or not AARCH64_LOADER.exists():
        return "no qemu-aarch64-static or aarch64 sysroot: run toolchains/emulation/install.sh"
    return ""


def run_aarch64(tools: Path, tool: str, *args: str, timeout: int = 900):
    """An aarch64 IREE tool (`tools`/`tool`) under qemu. The loader is called explicitly: qemu's -L alone runs
    nothing."""
    import shutil
    import subprocess

    qemu = shutil.which("qemu-aarch64-static") or str(QEMU_AARCH64)
    argv = [qemu, "-L", str(AARCH64_SYSROOT), str(AARCH64_LOADER), "--library-path", str(AARCH64_SYSROOT / "lib"),
            str(Path(tools) / tool), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def run_module_emulated(tools: Path, index_path: Path, slot: int, values: dict, workdir: Path):
    """Runs module `slot` of a module index (an aarch64 target's) on `values` (input name → array) with the
    aarch64 `iree-run-module` under qemu; returns its first output as a numpy array."""
    import numpy as np

    from dsa.core.fileio import read_json

    index = read_json(index_path)
    module = index["modules"][slot]
    base = Path(index_path).parent
    record = read_json(base / module["record"])
    flags = []
    for spec in record["inputs"]:
        value = np.asarray(values[spec["name"]])  # (np.ascontiguousarray would make a 0-d array 1-d)
        if value.ndim == 0:  # iree-run-module reads a 0-d .npy as shape [1]: a scalar goes on the command line
            flags.append(f"--input={_IREE_SCALAR[spec['dtype']]}={value.item()}")
            continue
        path = Path(workdir) / f"{spec['name']}.npy"
        np.save(path, np.ascontiguousarray(value))
        flags.append(f"--input=@{path}")
    out = Path(workdir) / "output.npy"
    proc = run_aarch64(
        tools, "iree-run-module", f"--module={base / module['vmfb']}", "--device=local-task",
        f"--function={record.get('function', 'main')}",
        f"--parameters={index['parameter_scope']}={base / index['parameter_archive']}", *flags, f"--output=@{out}")
    if proc.returncode != 0:
        raise AssertionError(f"iree-run-module under qemu failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return np.load(out)
