"""The files a LeRobot processor pipeline is read from, bounded before they are used: every size a file can
state has a limit, a member name stays inside its directory, JSON is read within a byte bound, statistics are
checked finite and ordered, and safetensors files are read by a checked header (numpy only)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from dsa.core.errors import DsaError


# -- limits: every size a processor file can state is bounded before it is used ----------------------------------
# A LeRobot processor JSON is a few kilobytes with under ten steps; its statistics a few kilobytes (per-channel
# image stats, state and action vectors <= 4096); Gemma's tokenizer.json, the largest a LeRobot policy pins, is
# 34 MB. Each bound is far above what a policy needs and far below what exhausts a robot's memory.
MAX_PIPELINE_JSON_BYTES = 1 << 20  # policy_preprocessor.json / policy_postprocessor.json / tokenizer_config.json
MAX_PIPELINE_STEPS = 64
MAX_STATE_FILE_BYTES = 16 << 20  # a step's statistics .safetensors
MAX_TOKENIZER_BYTES = 64 << 20  # tokenizer.json
MAX_TOKENIZER_LENGTH = 8192  # tokenizer_processor max_length
MAX_TASK_CHARS = 16384  # a task (or subtask) text
MAX_RENAMES = 1024
# Statistics: finite, |value| <= MAX_STAT_MAGNITUDE (pixels are <= 255, joint angles, positions in mm and encoder
# ticks are well within), std >= 0, max >= min, q99 >= q01, q90 >= q10. A zero std or range is accepted, as
# LeRobot accepts it (its eps rule: MEAN_STD divides by std + eps, MIN_MAX / quantiles replace a zero range by
# eps): a feature that never moved in the dataset.
MAX_STAT_MAGNITUDE = 1e6
_STAT_ORDER = (("std", None), ("min", "max"), ("q01", "q99"), ("q10", "q90"))


def pipeline_member(directory: Path, name: Any, where: str, field: str, max_bytes: int) -> Path:
    """The file a pipeline names (`field`, in `where`): a plain file name (no directory part, not absolute, no
    `..`) of a regular file in `directory`, at most `max_bytes`; refused before anything is read. Every file a
    processor JSON or policy_pipeline.json names is resolved here, so a bundle can name nothing outside itself."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\x00" in name or len(name) > 255):
        raise DsaError(where, f"{field} {str(name)[:100]!r} is not a plain file name",
                       "a pipeline names only files beside it (a bundle's members, a policy directory's files): "
                       "no directory, absolute path or '..'")
    path = Path(directory) / name
    try:
        info = path.stat()
    except OSError:
        raise DsaError(where, f"{field} {name} is missing from {directory}",
                       "copy the pipeline's files (statistics .safetensors, tokenizer) with its JSON") from None
    import stat as _stat

    if not _stat.S_ISREG(info.st_mode):
        raise DsaError(where, f"{field} {name} is not a regular file", "name the file itself")
    if info.st_size > max_bytes:
        raise DsaError(where, f"{field} {name} is {info.st_size} bytes, over the {max_bytes}-byte limit",
                       "this is not the policy's own file")
    return path


def read_bounded_json(path: Path, where: str, max_bytes: int) -> Any:
    """A JSON file of at most `max_bytes` (checked before reading), parsed with nesting bounded by Python's own
    recursion limit (a RecursionError is a refusal naming the file)."""
    try:
        size = Path(path).stat().st_size
    except OSError as e:
        raise DsaError(str(path), f"cannot read it: {e.strerror or e}") from None
    if size > max_bytes:
        raise DsaError(where, f"{path} is {size} bytes, over the {max_bytes}-byte limit", "this is not the file "
                       "LeRobot wrote")
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as e:
        raise DsaError(str(path), f"cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise DsaError(str(path), f"is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise DsaError(str(path), f"is not JSON ({e})") from None
    except RecursionError:
        raise DsaError(str(path), "is nested too deeply to be a pipeline file") from None


def check_statistics(stats: Dict[str, Dict[str, np.ndarray]], where: str,
                     shapes: Optional[Dict[str, List[int]]] = None) -> None:
    """The statistics contract (see MAX_STAT_MAGNITUDE): every value finite and within the bound, the pairs
    ordered, the arrays of one feature of one shape, broadcastable to the feature's shape when `shapes` gives it.
    Refused naming the file (`where`), the feature, the statistic and the value."""
    for key, by_stat in stats.items():
        shape = None
        for stat, array in by_stat.items():
            field = f"{key}.{stat}" if stat else key
            bad = ~np.isfinite(array)
            if bad.any():
                index = int(np.flatnonzero(bad)[0])
                raise DsaError(where, f"statistic {field} holds {array.reshape(-1)[index]} at index {index}: "
                               "statistics must be finite", "recompute the dataset statistics")
            big = np.abs(array) > MAX_STAT_MAGNITUDE
            if big.any():
                index = int(np.flatnonzero(big)[0])
                raise DsaError(where, f"statistic {field} holds {array.reshape(-1)[index]:g} at index {index}, "
                               f"beyond the bound of {MAX_STAT_MAGNITUDE:g}",
                               "recompute the dataset statistics (in the units the robot reports)")
            if stat in ("mean", "std", "min", "max", "q01", "q99", "q10", "q90"):
                if shape is not None and array.shape != shape:
                    raise DsaError(where, f"statistic {field} has shape {list(array.shape)}, the feature's other "
                                   f"statistics {list(shape)}", "recompute the dataset statistics")
                shape = array.shape
        if shape is not None and shapes and key in shapes:
            feature = tuple(int(d) for d in shapes[key])
            try:
                broadcast = np.broadcast_shapes(shape, feature)
            except ValueError:
                broadcast = None
            if broadcast != feature:
                raise DsaError(where, f"statistics of {key} have shape {list(shape)}, which does not fit the "
                               f"feature's shape {list(feature)}", "these are another policy's statistics")
        for low, high in _STAT_ORDER:
            if high is None:
                if low in by_stat and (by_stat[low] < 0).any():
                    index = int(np.flatnonzero(by_stat[low] < 0)[0])
                    raise DsaError(where, f"statistic {key}.{low} is negative ({by_stat[low].reshape(-1)[index]} "
                                   f"at index {index})", "a standard deviation is >= 0: recompute the statistics")
            elif low in by_stat and high in by_stat:
                wrong = by_stat[high] < by_stat[low]
                if wrong.any():
                    index = int(np.flatnonzero(wrong)[0])
                    raise DsaError(where, f"statistic {key}.{high} is below {key}.{low} at index {index} "
                                   f"({by_stat[high].reshape(-1)[index]} < {by_stat[low].reshape(-1)[index]})",
                                   "recompute the dataset statistics")

# -- safetensors ----------------------------------------------------------------------------------------------

_ST_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}


def read_safetensors(path) -> Dict[str, np.ndarray]:
    """The tensors of a .safetensors file by name, as native-order numpy arrays (BF16 widened to float32).

    Strict: a truncated file, a header that is not a JSON object, a tensor whose offsets fall outside the data,
    overlap another's or disagree with its shape, or an unknown dtype is a DsaError naming the file (and tensor).
    """
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise DsaError(str(path), f"cannot read the safetensors file: {e.strerror or e}") from None
    if len(blob) < 8:
        raise DsaError(str(path), f"is truncated: {len(blob)} bytes, shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", blob[:8])
    if header_len > len(blob) - 8:
        raise DsaError(str(path), f"is truncated: the header says {header_len} header bytes but only "
                       f"{len(blob) - 8} follow", "the file was cut short; copy it again")
    try:
        header = json.loads(blob[8:8 + header_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DsaError(str(path), f"header is not JSON ({e})", "this is not a safetensors file") from None
    if not isinstance(header, dict):
        raise DsaError(str(path), "header is not a JSON object", "this is not a safetensors file")
    data = memoryview(blob)[8 + header_len:]
    spans: List[Tuple[int, int, str]] = []
    out: Dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise DsaError(where, "entry lacks dtype, shape or data_offsets")
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise DsaError(where, f"has unknown dtype {info['dtype']!r}", f"supported: {', '.join(_ST_DTYPES)}")
        shape, offsets = info["shape"], info["data_offsets"]
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)):
            raise DsaError(where, f"has a malformed shape {shape!r} or data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= len(data):
            raise DsaError(where, f"data_offsets [{begin}, {end}] fall outside the {len(data)} data bytes",
                           "the file is truncated or corrupt")
        count = math.prod(shape)
        if end - begin != count * dtype.itemsize:
            raise DsaError(where, f"holds {end - begin} bytes but shape {shape} of {info['dtype']} needs "
                           f"{count * dtype.itemsize}")
        spans.append((begin, end, name))
        array = np.frombuffer(data[begin:end], dtype=dtype, count=count).reshape(shape)
        if info["dtype"] == "BF16":  # bfloat16 is the top half of a float32
            array = (array.astype(np.uint32) << 16).view(np.float32)
        out[name] = array.astype(dtype.newbyteorder("=") if info["dtype"] != "BF16" else np.float32, copy=True)
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise DsaError(f"{path}: tensor {n1!r}", f"data [{b1}, {e1}] overlaps tensor {n0!r} [{b0}, {e0}]",
                           "the file is corrupt")
    return out


def nest_stats(flat: Dict[str, np.ndarray]) -> Dict[str, Dict[str, np.ndarray]]:
    """"observation.state.mean" -> {"observation.state": {"mean": ...}}, as float32 (LeRobot loads them so)."""
    stats: Dict[str, Dict[str, np.ndarray]] = {}
    for flat_key, array in flat.items():
        key, stat = flat_key.rsplit(".", 1) if "." in flat_key else (flat_key, "")
        stats.setdefault(key, {})[stat] = np.asarray(array, dtype=np.float32)
    return stats
