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


def _dequantising_linear_class():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class DequantisingLinear(nn.Module):
        """A packed nn.Linear of the quantised reference: integer values q [out, groups, group] (int8, for
        int4 as for int8) and float32 scales [out, groups], dequantised to float32 when the layer runs, exactly
        as the compiled kernel does (float(q) · scale), then x @ wᵀ (+ bias) in float32."""

        def __init__(self, q, scale, bias):
            super().__init__()
            self.register_buffer("q", q)
            self.register_buffer("scale", scale)
            self.bias = bias

        def forward(self, x):
            weight = (self.q.to(torch.float32) * self.scale.unsqueeze(-1)).reshape(self.q.shape[0], -1)
            return F.linear(x, weight, self.bias)

    return DequantisingLinear


def quantised_eager_policy(export_view: dict, record: dict, checkpoint: Path, dims: dict):
    """The eager reference of a weight-quantised model (the export record's `quantization`) when its float32
    weights do not fit in memory: the model built without weights, each quantised nn.Linear it runs replaced
    by a DequantisingLinear over dsa.stages.quant's own quantisation of the checkpoint's tensor (what DsaParams
    packs into the archive), every other tensor it reads widened from the checkpoint, one tensor at a time.
    Both sides then compute in float32 with the same weights; only the order of reductions differs. It holds
    one byte per quantised weight (int4 values as int8) plus their float32 scales, and builds the float32
    weight of one layer at a time, while that layer runs. Layers the graph never runs (the record's
    `unused_parameters`) stay weightless."""
    import numpy as np
    import torch
    from torch import nn

    from dsa.stages.export import load_entry_point
    from dsa.stages.quant import quantize_weight
    from dsa.stages.tensor_files import open_safetensors
    from dsa.stages.weightless import torch_of, without_weights

    with without_weights():
        spec = load_entry_point(export_view["model"]["entry_point"])(export_view, dims)
    module = spec.module.eval()
    scheme = record["quantization"]["scheme"]
    quantized = record["quantization"]["tensors"]
    unused = set(record.get("unused_parameters", ()))
    dequantising = _dequantising_linear_class()
    with open_safetensors(checkpoint) as tensors:
        for prefix, parent in list(module.named_modules()):
            for attr, child in list(parent.named_children()):
                name = f"{prefix}.{attr}" if prefix else attr
                weight = name + ".weight"
                if not isinstance(child, nn.Linear) or weight not in quantized or weight in unused:
                    continue
                parts = quantize_weight(tensors.read(weight), scheme)
                packed, scale = parts[""], parts["_scale"]
                if quantized[weight]["kind"] == "int4":
                    q = (np.stack([packed & 15, packed >> 4], axis=-1).reshape(scale.shape + (-1,)).astype(np.int8)
                         - np.int8(8))
                else:
                    q = packed
                del parts, packed
                bias = None
                if child.bias is not None:
                    bias = nn.Parameter(torch_of(tensors.read(name + ".bias")).to(torch.float32),
                                        requires_grad=False)
                setattr(parent, attr, dequantising(torch.from_numpy(np.ascontiguousarray(q)),
                                                   torch.from_numpy(scale), bias))
        values = {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            if tensor.is_meta and name not in unused:
                values[name] = torch_of(tensors.read(name)).to(tensor.dtype)
        module.load_state_dict(values, strict=False, assign=True)
    missing = [n for n, t in module.state_dict(keep_vars=True).items() if t.is_meta and n not in unused]
    if missing:
        raise KeyError(f"{checkpoint}: the quantised reference has no value for {missing[:5]}")
    return module, spec


def quantised_eager_bytes(record: dict, checkpoint_elements: int) -> int:
    """About what quantised_eager_policy holds: one byte per quantised weight and a float32 scale per group,
    float32 for every other tensor of the checkpoint."""
    quantized = (record.get("quantization") or {}).get("tensors") or {}
    packed = scales = 0
    for info in quantized.values():
        n = 1
        for d in info["shape"]:
            n *= int(d)
        packed += n
        scales += n // max(1, int(info.get("group_size") or 1))
    return packed + 4 * scales + 4 * max(0, int(checkpoint_elements) - packed)


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


def runnable_builds(index: Path) -> list:
    """The targets of a module index's builds (its own target's, then its levels') this machine executes: a
    parity test checks each one, not only the one a runner would choose."""
    from dsa.core.fileio import read_json
    from dsa.runtime.host import runs_here
    from dsa.runtime.policy import ModuleIndex, builds_of

    return [target for target, path in builds_of(index).items()
            if runs_here(read_json(path.parent / ModuleIndex.read(path).target_spec))]
