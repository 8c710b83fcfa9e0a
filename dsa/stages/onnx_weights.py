"""An ONNX model's weights read where an ONNX export record places them (the file front end onnx's `weights`,
dsa.core.formats.FILE_FRONT_ENDS): the parameter stage reads them through this TensorSource."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

from dsa.core.errors import DsaError
from dsa.stages.tensor_files import TensorInfo, TensorSource, dtype_name, numpy_dtype, read_range


class OnnxTensors(TensorSource):
    """An ONNX model's weights by parameter name, as an ONNX export record places them (framework onnx):
    slices of the external-data file at the recorded offsets, or — when `checkpoint` is the .onnx file itself
    — its inline initializers. A `TensorSource` like the safetensors readers: each slice is checked against
    the file's size and the recorded shape and dtype by `info`, before anything is written, and read alone by
    `read`."""

    def __init__(self, checkpoint: Path, record: dict):
        self.path = Path(checkpoint)
        self.entries = {p["name"]: p for p in record["parameters"]}
        self.inline = None
        self._fd: Optional[int] = None
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

    def where(self, name: str) -> str:
        return str(self.path)

    def _initializer(self, name: str):
        source = self.entries[name]["onnx"]
        if source["initializer"] not in self.inline:
            raise DsaError(f"{self.path}: tensor '{name}'", f"the model has no initializer '{source['initializer']}'",
                           "use the .onnx file the model was exported from")
        return self.inline[source["initializer"]]

    def info(self, name: str) -> TensorInfo:
        entry = self.entries[name]
        source = entry["onnx"]
        if source.get("inline"):
            from onnx.helper import tensor_dtype_to_np_dtype

            tensor = self._initializer(name)
            dtype = dtype_name(tensor_dtype_to_np_dtype(tensor.data_type))
            shape = tuple(int(d) for d in tensor.dims)
            return TensorInfo(dtype, shape, math.prod(shape) * numpy_dtype(dtype).itemsize)
        offset, length = source["offset"], source["length"]
        if length is None or offset < 0 or offset + length > self.size:
            raise DsaError(f"{self.path}: tensor '{name}'",
                           f"lies at bytes {offset}..{offset + (length or 0)}, past the file's {self.size} bytes",
                           "use the external-data file saved with this .onnx graph")
        itemsize = numpy_dtype(entry["dtype"]).itemsize
        count = math.prod(entry["shape"])
        if length != count * itemsize:
            found = f"{length // itemsize} values" if length % itemsize == 0 else f"{length} bytes"
            raise DsaError(f"{self.path}: tensor '{name}'",
                           f"has {found} at its recorded place, the model expects {count}",
                           "use the external-data file saved with this .onnx graph")
        return TensorInfo(entry["dtype"], tuple(entry["shape"]), length)

    def read(self, name: str):
        import numpy as np

        info = self.info(name)
        source = self.entries[name]["onnx"]
        if source.get("inline"):
            from onnx import numpy_helper

            return np.array(numpy_helper.to_array(self._initializer(name)), copy=True, order="C")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return read_range(self._fd, source["offset"], info.nbytes, numpy_dtype(info.dtype), info.shape,
                          str(self.path))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
