"""DsaParams: checkpoint + the manifest's params view + the export record → an IREE parameter archive (.irpa).

The checkpoint is checked against the manifest's pinned sha256, then tensor by tensor against the export
record: every parameter the compiled module will ask for must be present with the recorded shape and dtype,
and nothing else may be in the file. (The IREE runtime itself does not notice a transposed or oversized
tensor.) Entries are written in name order with shape/dtype metadata, so the archive is deterministic and
self-describing. Only this stage reads the checkpoint: a weights-only change reruns it and nothing else.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List, Optional

from dsa.core.determinism import pin_math_libraries
from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import atomic_output, read_json, sha256_file
from dsa.stages.quant import SCALE_SUFFIX, quantize_weight, scale_name, source_of

# Same metadata form as iree-turbine's ParameterArchiveBuilder, so turbine's ParameterArchive reads it back.
from dsa.core.formats import PARAMETER_METADATA_PREFIX as _METADATA_PREFIX
from dsa.core.formats import ExportRecord


def _metadata(dtype: str, shape) -> str:
    return _METADATA_PREFIX + json.dumps({"type": "Tensor", "dtype": dtype, "shape": list(shape)})


def check_checkpoint_digest(checkpoint: Path, view: dict, manifest_name: str = "manifest") -> None:
    """The checkpoint must be the one the manifest pins (checkpoint.sha256)."""
    expected_sha = view["checkpoint"]["sha256"]
    actual_sha = sha256_file(checkpoint)
    if actual_sha != expected_sha:
        raise DsaError(
            f"{manifest_name}: checkpoint.sha256",
            f"checkpoint {checkpoint} has sha256 {actual_sha}, but the manifest pins {expected_sha}",
            "if this checkpoint is the one you mean to ship, set checkpoint.sha256 to the new digest",
        )


def open_checkpoint(checkpoint: Path, framework: str = "pt"):
    """The checkpoint's safetensors handle, or the one-line error for a file that is not one (garbage, a
    truncated file, a header that claims exabytes: safetensors checks the header against the file size)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(checkpoint), framework=framework)
    except (SafetensorError, OSError, ValueError) as e:
        raise DsaError(str(checkpoint), f"not a readable safetensors file: {e}",
                       "point checkpoint.path at a .safetensors file") from None


class OnnxTensors:
    """An ONNX model's weights by parameter name, as an ONNX export record places them (framework onnx):
    slices of the external-data file at the recorded offsets, or — when `checkpoint` is the .onnx file itself
    — its inline initializers. The same interface as a safetensors handle: keys(), get_tensor(name)."""

    def __init__(self, checkpoint: Path, record: dict):
        import numpy as np

        self.path = Path(checkpoint)
        self.entries = {p["name"]: p for p in record["parameters"]}
        self.inline = None
        self._np = np
        external = [p for p in record["parameters"] if not p["onnx"].get("inline")]
        if any(p["onnx"].get("inline") for p in record["parameters"]) or self.path.suffix == ".onnx":
            import onnx

            try:
                model = onnx.load(str(self.path), load_external_data=False)
            except Exception as e:
                raise DsaError(str(self.path), f"not a readable ONNX model: {type(e).__name__}",
                               "for framework onnx, checkpoint.path is the model's external-data file, or the "
                               ".onnx file itself when its weights are inline") from None
            self.inline = {t.name: t for t in model.graph.initializer}
            if external:
                raise DsaError(str(self.path), f"{len(external)} weight(s) of the model are in its external-data "
                               f"file ({record.get('onnx', {}).get('external_data')}), not in this .onnx file",
                               "point checkpoint.path at the external-data file")
        self.size = self.path.stat().st_size

    def keys(self):
        return list(self.entries)

    def get_tensor(self, name: str):
        import torch
        from onnx import numpy_helper

        from dsa.stages.spec import DTYPE_NAMES

        entry = self.entries[name]
        source = entry["onnx"]
        if source.get("inline"):
            array = numpy_helper.to_array(self.inline[source["initializer"]])
        else:
            offset, length = source["offset"], source["length"]
            if length is None or offset < 0 or offset + length > self.size:
                raise DsaError(f"{self.path}: tensor '{name}'",
                               f"lies at bytes {offset}..{offset + (length or 0)}, past the file's {self.size} bytes",
                               "use the external-data file saved with this .onnx graph")
            dtype = {v: k for k, v in DTYPE_NAMES.items()}[entry["dtype"]]
            with open(self.path, "rb") as f:
                f.seek(offset)
                data = f.read(length)
            tensor = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
            count = 1
            for d in entry["shape"]:
                count *= d
            if tensor.numel() != count:
                raise DsaError(f"{self.path}: tensor '{name}'",
                               f"has {tensor.numel()} values at its recorded place, the model expects {count}",
                               "use the external-data file saved with this .onnx graph")
            return tensor.reshape(entry["shape"])
        return torch.from_numpy(self._np.ascontiguousarray(array))


def open_tensors(checkpoint: Path, record: dict):
    """The checkpoint's tensors by parameter name: a safetensors handle, or for an ONNX export (framework
    onnx) the model's weights where its record places them."""
    if record.get("framework") == "onnx":
        return OnnxTensors(checkpoint, record)
    return open_checkpoint(checkpoint)


def build_params(
    checkpoint: Path,
    view: dict,
    record: dict,
    out_irpa: Path,
    *,
    manifest_name: str = "manifest",
) -> None:
    import iree.runtime as rt
    import torch

    from dsa.stages.spec import DTYPE_NAMES

    check_checkpoint_digest(checkpoint, view, manifest_name)
    scheme = view["quant_scheme"]
    quantization = record.get("quantization", {"scheme": {"kind": "none"}, "tensors": {}})
    if quantization["scheme"] != scheme:
        raise DsaError(
            f"{manifest_name}: quant_scheme",
            f"the params view asks for {scheme} but the model was exported for {quantization['scheme']}",
            "build the parameter archive and the export from the same manifest",
        )
    quantized = quantization["tensors"]

    handle = open_tensors(checkpoint, record)
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
    present = set(handle.keys())
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

    allow_nonfinite = bool(view["checkpoint"].get("allow_nonfinite", False))
    index = rt.ParameterIndex()
    for name in sorted(wanted):
        tensor = handle.get_tensor(name)
        want = wanted[name]
        if tensor.is_floating_point() and not allow_nonfinite and tensor.numel():
            finite = torch.isfinite(tensor)
            if not bool(finite.all()):
                count = int(tensor.numel() - finite.sum())
                raise DsaError(f"{checkpoint}: tensor '{name}'",
                               f"holds {count} NaN or infinite value{'s' if count != 1 else ''}: a policy with such "
                               "weights outputs NaN actions",
                               f"use a healthy checkpoint (or set checkpoint.allow_nonfinite: true in "
                               f"{manifest_name} to pack it as it is)")
        dtype = DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
        if list(tensor.shape) != want["shape"] or dtype != want["dtype"]:
            raise DsaError(
                f"{checkpoint}: tensor '{name}'",
                f"has shape {list(tensor.shape)} {dtype}, the exported model expects {want['shape']} {want['dtype']}",
                "use a checkpoint of the same architecture as the manifest's model.config",
            )
        if name in quantized:
            parts = quantize_weight(tensor.numpy(), scheme)
            for key, array in ((name, parts[""]), (scale_name(name), parts[SCALE_SUFFIX])):
                want = recorded[key]
                got = DTYPE_NAMES[torch.from_numpy(array).dtype]
                if list(array.shape) != want["shape"] or got != want["dtype"]:
                    raise DsaError(key, f"quantised to {list(array.shape)} {got}, the export expects "
                                        f"{want['shape']} {want['dtype']} (export and params disagree)")
                index.add_buffer(key, array.tobytes(), metadata=_metadata(got, array.shape))
            continue
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        index.add_buffer(name, data, metadata=_metadata(dtype, tensor.shape))
    with atomic_output(out_irpa) as tmp:
        index.create_archive_file(str(tmp))


def main(argv: Optional[List[str]] = None) -> None:
    pin_math_libraries()  # before any computation: dsa.core.determinism
    parser = argparse.ArgumentParser(prog="dsa-params", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--view", required=True, help="the manifest's params view (JSON)")
    parser.add_argument("--record", required=True, help="the model's export record (JSON)")
    parser.add_argument("--manifest-name", default="manifest")
    parser.add_argument("--out", required=True)
    a = parser.parse_args(argv)
    build_params(Path(a.checkpoint), read_json(a.view), ExportRecord.read(a.record), Path(a.out),
                 manifest_name=a.manifest_name)


if __name__ == "__main__":
    run_cli(main, "dsa-params")
