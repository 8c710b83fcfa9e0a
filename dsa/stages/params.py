"""DsaParams: checkpoint + the manifest's params view + the export record → an IREE parameter archive (.irpa).

The checkpoint (a .safetensors file, a sharded safetensors checkpoint through its index, or an ONNX model's
weights) is checked against the manifest's pinned sha256 (the index's and every shard's), then against the
export record: every parameter the compiled module will ask for must be present with the recorded shape and
dtype (or one that converts to it: `_conversion`), and nothing else may be in the file. (The IREE runtime
itself does not notice a transposed or oversized tensor.) All of that is checked from the files' headers
before anything is written; then each tensor is read, checked for NaN / Inf, converted (precision) or
quantised (quant_scheme), written and dropped, one at a time (dsa.stages.tensor_files, dsa.stages.irpa):
memory stays bounded by the largest tensor, whatever the checkpoint's size. Entries are written in name
order with shape/dtype metadata, so the archive is deterministic and self-describing — byte-identical to
what IREE's `ParameterIndex` writes for them. Only this stage reads the checkpoint: a weights-only change
reruns it and nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
from pathlib import Path
from typing import List, Optional

from dsa.core.determinism import pin_math_libraries
from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import atomic_output, read_json
from dsa.stages.irpa import IrpaEntry, IrpaWriter
from dsa.stages.quant import SCALE_SUFFIX, quantize_weight, scale_name, source_of
from dsa.stages.tensor_files import (FLOAT_DTYPES, TensorInfo, TensorSource, check_shards, dtype_name, numpy_dtype,
                                     open_safetensors, read_index, sha256_streamed, shard_path)

# Same metadata form as iree-turbine's ParameterArchiveBuilder, so turbine's ParameterArchive reads it back.
from dsa.core.formats import PARAMETER_METADATA_PREFIX as _METADATA_PREFIX
from dsa.core.formats import FILE_FRONT_ENDS, ExportRecord


def _metadata(dtype: str, shape) -> str:
    return _METADATA_PREFIX + json.dumps({"type": "Tensor", "dtype": dtype, "shape": list(shape)})


def _precision_weights(view: dict) -> str:
    """The params view's precision.weights (dsa.manifest.contract.precision_of: absent means f32)."""
    return (view.get("precision") or {"weights": "f32"})["weights"]


def check_checkpoint_digest(checkpoint: Path, view: dict, manifest_name: str = "manifest") -> None:
    """The checkpoint must be the one the manifest pins (checkpoint.sha256). For a sharded checkpoint
    (checkpoint.shards), `checkpoint` is its index: the index must be the pinned one, name exactly the listed
    shards, and every shard beside it must have its pinned digest. Streamed: nothing is held in memory."""
    pin = view["checkpoint"]
    shards = pin.get("shards")
    expected_sha = pin["sha256"]
    actual_sha = sha256_streamed(checkpoint)
    if actual_sha != expected_sha:
        what = "checkpoint index" if shards else "checkpoint"
        raise DsaError(
            f"{manifest_name}: checkpoint.sha256",
            f"{what} {checkpoint} has sha256 {actual_sha}, but the manifest pins {expected_sha}",
            "if this checkpoint is the one you mean to ship, set checkpoint.sha256 to the new digest",
        )
    if shards is None:
        return
    check_shards(checkpoint, read_index(checkpoint), [s["file"] for s in shards], manifest_name)
    for i, shard in enumerate(shards):
        path = shard_path(checkpoint, shard["file"])
        actual = sha256_streamed(path)
        if actual != shard["sha256"]:
            raise DsaError(
                f"{manifest_name}: checkpoint.shards[{i}].sha256",
                f"shard {path} has sha256 {actual}, but the manifest pins {shard['sha256']}",
                f"if this shard is the one you mean to ship, set checkpoint.shards[{i}].sha256 to the new digest",
            )


def open_checkpoint(checkpoint: Path, framework: str = "numpy", view: Optional[dict] = None,
                    manifest_name: str = "manifest") -> TensorSource:
    """The checkpoint's tensors (a `dsa.stages.tensor_files.TensorSource`, read one tensor at a time), or the
    one-line error for a file that is not a safetensors file (garbage, a truncated file, a header that claims
    exabytes: safetensors checks the header against the file size). A sharded checkpoint when the params
    `view` lists shards (held to that list), or when `checkpoint` is a .json index. `framework` is accepted
    for older callers; the tensors are numpy arrays."""
    shards = (view or {}).get("checkpoint", {}).get("shards")
    listed = [s["file"] for s in shards] if shards is not None else None
    return open_safetensors(checkpoint, listed, manifest_name)


# A file front end's `weights` (dsa.core.formats.FILE_FRONT_ENDS) names how its checkpoint is read: "safetensors"
# (a file or a sharded checkpoint, as for every other framework), or the "module:Class" of a TensorSource in a
# dsa/stages/<name>_weights.py module (ONNX's external-data reader: onnx_weights.OnnxTensors), constructed as
# `Class(checkpoint, record)`.
SAFETENSORS = "safetensors"


def open_tensors(checkpoint: Path, record: dict, view: Optional[dict] = None,
                 manifest_name: str = "manifest") -> TensorSource:
    """The checkpoint's tensors by parameter name, by the reader of the record's framework (its `weights`): a
    safetensors file or sharded checkpoint, or for an ONNX export (framework onnx) the model's weights where its
    record places them."""
    file_front_end = FILE_FRONT_ENDS.get(record.get("framework"))
    weights = file_front_end.weights if file_front_end is not None else SAFETENSORS
    if weights == SAFETENSORS:
        return open_checkpoint(checkpoint, view=view, manifest_name=manifest_name)
    return weights_reader(weights)(checkpoint, record)


def weights_reader(weights: str):
    """The TensorSource class a file front end's `weights` ("module:Class") names."""
    module, _, name = weights.partition(":")
    return getattr(importlib.import_module(module), name)


_CHECKPOINT_FLOATS = ("float32", "bfloat16", "float16")


def _conversion(have: str, want: str, weights: str) -> Optional[str]:
    """How a checkpoint tensor of dtype `have` becomes the archive's `want`: "same"; "round" (to bf16 / f16,
    nearest even, when the manifest's precision.weights stores half-precision weights); "widen" (a bf16 or
    f16 tensor to float32: exact, always allowed); None: refused."""
    if have == want:
        return "same"
    if want in ("bfloat16", "float16") and weights in ("bf16", "f16") and have in _CHECKPOINT_FLOATS:
        return "round"
    if want == "float32" and have in ("bfloat16", "float16"):
        return "widen"
    return None


@dataclasses.dataclass(frozen=True)
class _Step:
    """One checkpoint tensor → one archive entry (two for a quantised weight: the packed weight, its scales)."""

    name: str
    have: TensorInfo
    want_dtype: str
    conversion: str
    quantized: bool


def _plan(source: TensorSource, view: dict, record: dict, checkpoint: Path, manifest_name: str):
    """(steps, archive entries): everything checked that needs no tensor data — missing and extra tensors,
    shapes, dtypes and their conversions — so that a wrong checkpoint is refused before anything is written."""
    quantization = record.get("quantization", {"scheme": {"kind": "none"}, "tensors": {}})
    quantized = quantization["tensors"]
    # What the checkpoint must hold: the float weight behind each quantised tensor, every other parameter
    # as recorded; scales are derived, not read.
    wanted = {}
    for p in record["parameters"]:
        if source_of(p["name"], quantized):
            continue
        if p["name"] in quantized:
            wanted[p["name"]] = {"name": p["name"], "shape": quantized[p["name"]]["shape"], "dtype": "float32"}
        else:
            wanted[p["name"]] = p
    recorded = {p["name"]: p for p in record["parameters"]}
    present = set(source.keys())
    missing = sorted(set(wanted) - present)
    # Tensors of the model that inference never reads (ACT's training-only VAE encoder) are in a real
    # checkpoint but not in the graph: the export record names them, and they are left out of the archive.
    unused = set(record.get("unused_parameters", []))
    extra = sorted(present - set(wanted) - unused)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) the model needs: {', '.join(missing[:5])}")
        if extra:
            parts.append(f"{len(extra)} tensor(s) the model does not have: {', '.join(extra[:5])}")
        raise DsaError(str(checkpoint), "; ".join(parts),
                       "use a checkpoint of the same architecture as the manifest's model.config")

    weights = _precision_weights(view)
    steps, entries = [], []
    for name in sorted(wanted):
        want = wanted[name]
        have = source.info(name)
        conversion = _conversion(have.dtype, want["dtype"], weights)
        if list(have.shape) != list(want["shape"]) or conversion is None:
            hint = "use a checkpoint of the same architecture as the manifest's model.config"
            if list(have.shape) == list(want["shape"]) and {have.dtype, want["dtype"]} <= set(_CHECKPOINT_FLOATS):
                hint = (f"the archive stores it as {want['dtype']}: a checkpoint's float32, bfloat16 or float16 "
                        f"tensor is rounded to bfloat16 / float16 when precision.weights in {manifest_name} says so "
                        "(as for the export), and a bfloat16 or float16 tensor is widened to float32")
            raise DsaError(
                f"{source.where(name)}: tensor '{name}'",
                f"has shape {list(have.shape)} {have.dtype}, the exported model expects {want['shape']} {want['dtype']}",
                hint,
            )
        steps.append(_Step(name, have, want["dtype"], conversion, name in quantized))
        keys = (name, scale_name(name)) if name in quantized else (name,)
        for key in keys:
            if key not in recorded:
                raise DsaError(f"export record: {key}", "is not among the record's parameters",
                               "build the parameter archive and the export from the same manifest")
            out = recorded[key] if name in quantized else want
            nbytes = math.prod(out["shape"]) * numpy_dtype(out["dtype"]).itemsize
            entries.append(IrpaEntry(key, nbytes, _metadata(out["dtype"], out["shape"])))
    return steps, entries


def _count(mask_of, array, chunk: int = 1 << 24) -> int:
    """How many values of `array` `mask_of` is true for, in chunks (a mask of 16 Mi values at most)."""
    import numpy as np

    flat = array.reshape(-1)
    return sum(int(np.count_nonzero(mask_of(flat[i:i + chunk]))) for i in range(0, flat.size, chunk))


def _round(array, want: str, where: str, manifest_name: str):
    """The float tensor rounded to nearest even in bfloat16 (ml_dtypes' cast) or float16 (numpy's): both
    round to nearest even, bit for bit as torch's `.to(dtype)` does (tests/weights/params_test.py). A finite
    value beyond float16's range would become infinite: refused."""
    import numpy as np

    rounded = array.astype(numpy_dtype(want))
    if want == "float16" and array.dtype.name != "float16":
        # Rounding turns no infinity finite and no NaN infinite: every new infinity was a finite value.
        overflow = _count(np.isinf, rounded) - _count(np.isinf, array)
        if overflow:
            raise DsaError(where, f"holds {overflow} finite value{'s' if overflow != 1 else ''} beyond float16's "
                                  "range (±65504), which would round to infinity",
                           f"store the weights as bf16 (precision.weights: bf16 in {manifest_name}), whose range is "
                           "float32's")
    return rounded


def build_params(
    checkpoint: Path,
    view: dict,
    record: dict,
    out_irpa: Path,
    *,
    manifest_name: str = "manifest",
) -> None:
    """Writes the parameter archive, streamed: the checkpoint is checked whole (digests, names, shapes, dtypes)
    before anything is written, then read, checked, converted and written one tensor at a time, so memory
    stays bounded by the largest tensor (times a small constant for conversion or quantisation), whatever
    the checkpoint's size. The archive is byte-identical to IREE's own `ParameterIndex` writer's."""
    check_checkpoint_digest(checkpoint, view, manifest_name)
    scheme = view["quant_scheme"]
    quantization = record.get("quantization", {"scheme": {"kind": "none"}, "tensors": {}})
    if quantization["scheme"] != scheme:
        raise DsaError(
            f"{manifest_name}: quant_scheme",
            f"the params view asks for {scheme} but the model was exported for {quantization['scheme']}",
            "build the parameter archive and the export from the same manifest",
        )
    import numpy as np

    recorded = {p["name"]: p for p in record["parameters"]}
    allow_nonfinite = bool(view["checkpoint"].get("allow_nonfinite", False))
    with open_tensors(checkpoint, record, view, manifest_name) as source:
        steps, entries = _plan(source, view, record, checkpoint, manifest_name)
        with atomic_output(out_irpa) as tmp, IrpaWriter(tmp, entries, where=str(out_irpa)) as writer:
            for step in steps:
                name = step.name
                where = f"{source.where(name)}: tensor '{name}'"
                array = source.read(name)
                if step.have.dtype in FLOAT_DTYPES and not allow_nonfinite and array.size:
                    count = array.size - _count(np.isfinite, array)
                    if count:
                        raise DsaError(where, f"holds {count} NaN or infinite value{'s' if count != 1 else ''}: "
                                              "a policy with such weights outputs NaN actions",
                                       f"use a healthy checkpoint (or set checkpoint.allow_nonfinite: true in "
                                       f"{manifest_name} to pack it as it is)")
                if step.quantized:
                    weight = array if step.have.dtype == "float32" else array.astype("float32")
                    del array
                    parts = quantize_weight(weight, scheme)
                    del weight
                    for key, part in ((name, parts[""]), (scale_name(name), parts[SCALE_SUFFIX])):
                        want = recorded[key]
                        got = dtype_name(part.dtype)
                        if list(part.shape) != want["shape"] or got != want["dtype"]:
                            raise DsaError(key, f"quantised to {list(part.shape)} {got}, the export expects "
                                                f"{want['shape']} {want['dtype']} (export and params disagree)")
                        writer.write(key, part)
                    del parts
                    continue
                if step.conversion == "widen":
                    array = array.astype("float32")
                elif step.conversion == "round":
                    array = _round(array, step.want_dtype, where, manifest_name)
                writer.write(name, array)
                del array


def main(argv: Optional[List[str]] = None) -> None:
    pin_math_libraries()  # before any computation: dsa.core.determinism
    parser = argparse.ArgumentParser(prog="dsa-params", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True,
                        help="the .safetensors file (a sharded checkpoint: its index, the shards beside it)")
    parser.add_argument("--view", required=True, help="the manifest's params view (JSON)")
    parser.add_argument("--record", required=True, help="the model's export record (JSON)")
    parser.add_argument("--manifest-name", default="manifest")
    parser.add_argument("--out", required=True)
    a = parser.parse_args(argv)
    build_params(Path(a.checkpoint), read_json(a.view), ExportRecord.read(a.record), Path(a.out),
                 manifest_name=a.manifest_name)


if __name__ == "__main__":
    run_cli(main, "dsa-params")
