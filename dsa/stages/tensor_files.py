"""Checkpoints read and written one tensor at a time: safetensors files, sharded safetensors checkpoints.

A policy of 3.5B parameters is a 14 GB checkpoint; the build machine has 24 GB shared by every action. So
nothing here holds a whole checkpoint, or maps it: safetensors' own `get_tensor` reads from an mmap of the
file, and every page it touches stays in the process's resident set (a 14 GB checkpoint read through it shows
14 GB RSS). Instead:

* Reading (`SafetensorsFile`, `ShardedSafetensors`): the file is validated by `safetensors.safe_open` (header
  length against the file size, offsets contiguous and in bounds, known dtypes) and closed; its JSON header
  is parsed here (safetensors caps it at 100 MB) for each tensor's dtype, shape and byte range; `read(name)`
  reads that one range with `os.preadv` into a fresh numpy array, then asks the kernel to drop those pages
  from its cache (`POSIX_FADV_DONTNEED`, best effort), so reading a checkpoint larger than memory neither
  grows the process nor fills the page cache.
* Writing (`write_safetensors`, `write_sharded_safetensors`): the header is computed from each tensor's
  name, dtype and shape, then `produce(name)` is called for one tensor at a time and its bytes written.

Every reader has one interface, `TensorSource`: `keys()`, `info(name)` (dtype, shape, byte length, without
reading data), `read(name)` (a numpy array), `where(name)` (the file to name in a message). dtypes are named
as export records name them ("float32", "bfloat16", "int8", ...). bfloat16 and float8 tensors are numpy arrays
of `ml_dtypes` types (`ml_dtypes.bfloat16`): their bytes are the file's, and numpy casts them (`astype`,
round to nearest even) without torch.

The safetensors format (https://github.com/huggingface/safetensors, `safetensors/src/tensor.rs`): 8 bytes
little-endian header length N; N bytes of JSON {"__metadata__": {str: str}?, name: {"dtype", "shape",
"data_offsets": [begin, end]}}, padded with spaces to a multiple of 8; then the data, offsets relative to
its start. Its writer (`prepare`) orders tensors by dtype, largest alignment first (the `Dtype` enum's order,
descending), then by name, and writes the JSON compactly in that order with `__metadata__` first.

A sharded checkpoint is the Hugging Face form: `model.safetensors.index.json` ({"metadata": {...},
"weight_map": {tensor name: shard file name}}) beside its shard files. The manifest pins the index
(`checkpoint.sha256`) and each shard (`checkpoint.shards`): `check_shards` refuses a shard the index names
that the manifest does not list, and one it lists that the index never names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import stat
import struct
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from dsa.core.errors import DsaError
from dsa.core.fileio import atomic_output, canonical_json

# safetensors dtype code → the name export records use, in the order of safetensors' `Dtype` enum (its
# writer's sort key; the enum also has F4, F6_E2M3, F6_E3M2 and F8_E8M0, which numpy cannot hold and which
# are read as nothing here).
_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
}
_CODES = {name: code for code, name in _DTYPES.items()}
_RANK = {code: i for i, code in enumerate(_DTYPES)}
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e5m2", "float8_e4m3fn"})

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit (MAX_HEADER_SIZE)
MAX_INDEX_BYTES = 64 << 20  # a sharded checkpoint's index: a 4096-shard, million-tensor index is ~50 MB
INDEX_NAME = "model.safetensors.index.json"


def numpy_dtype(name: str):
    """The numpy dtype of a dtype name (bfloat16 and float8: ml_dtypes')."""
    import numpy as np

    if name in ("bfloat16", "float8_e5m2", "float8_e4m3fn"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def dtype_name(dtype) -> str:
    """The name of a numpy dtype (or of a name), as export records write it."""
    import numpy as np

    if isinstance(dtype, str) and dtype in _CODES:
        return dtype
    return np.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: str  # as export records name dtypes: "float32", "bfloat16", ...
    shape: Tuple[int, ...]
    nbytes: int


class TensorSource:
    """The interface every checkpoint reader has."""

    def keys(self) -> List[str]:
        raise NotImplementedError

    def info(self, name: str) -> TensorInfo:
        raise NotImplementedError

    def read(self, name: str):
        """The tensor as a fresh numpy array (writable, owning its memory)."""
        raise NotImplementedError

    def where(self, name: str) -> str:
        """The file that holds `name`, for messages."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_range(fd: int, offset: int, nbytes: int, dtype, shape, where: str):
    """`nbytes` bytes at `offset` of an open file as a fresh array of `dtype` and `shape`; the pages are then
    dropped from the page cache (best effort)."""
    import numpy as np

    array = np.empty(nbytes, dtype=np.uint8)
    view = memoryview(array)
    done = 0
    while done < nbytes:  # Linux returns at most ~2 GiB per call
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise DsaError(where, f"ends before byte {offset + nbytes} (read {done} of {nbytes} bytes at "
                                  f"{offset}): the file changed or was truncated while it was read",
                           "do not modify the checkpoint during the build")
        done += n
    drop_cache(fd, offset, nbytes)
    return array.view(dtype).reshape(shape)


def drop_cache(fd: int, offset: int, nbytes: int) -> None:
    """Tells the kernel these file pages will not be read again (best effort: a no-op where unsupported)."""
    if nbytes and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def sha256_streamed(path) -> str:
    """The file's sha256, read in 4 MiB blocks into one buffer, dropping the pages read from the page cache."""
    digest = hashlib.sha256()
    buffer = bytearray(4 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        offset = 0
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
            drop_cache(fd, offset, n)
            offset += n
    return digest.hexdigest()


# -- reading ------------------------------------------------------------------------------------------------


def _validate(path: Path) -> None:
    """safetensors' own check of the file (header length against the file size, offsets contiguous and in
    bounds, dtypes), as one line naming the file. It maps the file but reads only the header."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except (SafetensorError, OSError, ValueError) as e:
        raise DsaError(str(path), f"not a readable safetensors file: {e}",
                       "point checkpoint.path at a .safetensors file") from None


class SafetensorsFile(TensorSource):
    """One .safetensors file, read tensor by tensor (see the module doc)."""

    def __init__(self, path):
        self.path = Path(path)
        _validate(self.path)
        self._fd: Optional[int] = None
        self._entries: Dict[str, Tuple[str, Tuple[int, ...], int, int]] = {}
        try:  # safe_open has checked all of this; a file replaced since is refused the same way
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > MAX_HEADER_BYTES:
                    raise ValueError(f"header of {n} bytes")
                header = json.loads(f.read(n).decode("utf-8"))
            self.data_offset = 8 + n
            self.metadata: Dict[str, str] = header.pop("__metadata__", None) or {}
            for name, entry in header.items():
                code = entry["dtype"]
                begin, end = (int(x) for x in entry["data_offsets"])
                shape = tuple(int(d) for d in entry["shape"])
                self._entries[name] = (_DTYPES.get(code, code), shape, self.data_offset + begin, end - begin)
        except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise DsaError(str(self.path), f"not a readable safetensors file: {type(e).__name__}: {e}",
                           "point checkpoint.path at a .safetensors file") from None

    def keys(self) -> List[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def info(self, name: str) -> TensorInfo:
        dtype, shape, _, nbytes = self._entries[name]
        return TensorInfo(dtype, shape, nbytes)

    def where(self, name: str) -> str:
        return str(self.path)

    def read(self, name: str):
        dtype, shape, offset, nbytes = self._entries[name]
        if dtype not in _CODES:
            raise DsaError(f"{self.path}: tensor '{name}'", f"has dtype {dtype}, which cannot be read here",
                           f"store it as one of {', '.join(sorted(_CODES))}")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return read_range(self._fd, offset, nbytes, numpy_dtype(dtype), shape, str(self.path))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _shard_name_problem(name) -> Optional[str]:
    if not isinstance(name, str) or not name:
        return "is not a file name"
    if "/" in name or "\\" in name or "\0" in name:
        return "has a path separator: shards are files in the index's own directory"
    if ".." in name or name == ".":
        return "has '..': shards are files in the index's own directory"
    return None


def read_index(index: Path) -> Dict[str, str]:
    """A sharded checkpoint's weight_map ({tensor name: shard file name}), refusing an index that is too
    large, not JSON, not the Hugging Face form, or that names a shard outside its directory."""
    index = Path(index)
    hint = f"a sharded checkpoint's index is {INDEX_NAME} as Hugging Face writes it: {{\"metadata\": {{...}}, " \
           "\"weight_map\": {tensor name: shard file name}}"
    try:
        st = index.stat()
    except OSError as e:
        raise DsaError(str(index), f"cannot be read: {e.strerror}", hint) from None
    if not stat.S_ISREG(st.st_mode):
        raise DsaError(str(index), "is not a regular file", hint)
    if st.st_size > MAX_INDEX_BYTES:
        raise DsaError(str(index), f"is {st.st_size} bytes, more than a checkpoint index may be "
                                   f"({MAX_INDEX_BYTES} bytes)", hint)
    with open(index, "rb") as f:
        data = f.read(MAX_INDEX_BYTES + 1)
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise DsaError(str(index), f"is not a JSON checkpoint index ({type(e).__name__})", hint) from None
    if not isinstance(document, dict) or not isinstance(document.get("weight_map"), dict):
        raise DsaError(str(index), "has no weight_map mapping", hint)
    weight_map = document["weight_map"]
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            raise DsaError(f"{index}: weight_map['{tensor}']", f"is {type(shard).__name__}, not a shard file name",
                           hint)
        problem = _shard_name_problem(shard)
        if problem:
            raise DsaError(f"{index}: weight_map['{tensor}']", f"shard '{shard}' {problem}", hint)
    return dict(weight_map)


def check_shards(index: Path, weight_map: Mapping[str, str], listed: Iterable[str], manifest_name: str) -> None:
    """The shards the index names must be exactly the ones the manifest lists (checkpoint.shards)."""
    named = set(weight_map.values())
    listed = set(listed)
    unlisted = sorted(named - listed)
    if unlisted:
        raise DsaError(f"{manifest_name}: checkpoint.shards",
                       f"the index {index} names {len(unlisted)} shard(s) the manifest does not list: "
                       f"{', '.join(unlisted[:5])}",
                       "list every shard file of the index under checkpoint.shards, with its sha256")
    unnamed = sorted(listed - named)
    if unnamed:
        raise DsaError(f"{manifest_name}: checkpoint.shards",
                       f"lists {len(unnamed)} shard(s) that the index {index} never names: {', '.join(unnamed[:5])}",
                       "list exactly the shard files the index's weight_map names")


def shard_path(index: Path, shard: str) -> Path:
    """A shard's file beside the index: it must be a regular file."""
    path = Path(index).parent / shard
    problem = _shard_name_problem(shard)
    if problem:
        raise DsaError(str(path), f"shard '{shard}' {problem}", "name shard files without directories")
    try:
        st = path.stat()
    except OSError:
        raise DsaError(str(path), f"shard '{shard}' of {index} is missing",
                       "put every shard file beside the index (model.safetensors.index.json)") from None
    if not stat.S_ISREG(st.st_mode):
        raise DsaError(str(path), f"shard '{shard}' of {index} is not a regular file",
                       "put every shard file beside the index (model.safetensors.index.json)")
    return path


class ShardedSafetensors(TensorSource):
    """A sharded safetensors checkpoint through its index, every shard validated as `SafetensorsFile` does
    and held to the weight_map: a tensor the map places in a shard must be in that shard, and each shard's
    tensors must be the ones the map places there. At most one shard's file is open at a time."""

    def __init__(self, index, listed: Optional[Iterable[str]] = None, manifest_name: str = "manifest"):
        self.index = Path(index)
        weight_map = read_index(self.index)
        if listed is not None:
            check_shards(self.index, weight_map, listed, manifest_name)
        self._shards: Dict[str, SafetensorsFile] = {}
        for shard in sorted(set(weight_map.values())):
            self._shards[shard] = SafetensorsFile(shard_path(self.index, shard))
        self._owner: Dict[str, str] = {}
        for shard, source in self._shards.items():
            for name in source.keys():
                if name in self._owner:
                    raise DsaError(str(self.index),
                                   f"tensor '{name}' is in two shards, {self._owner[name]} and {shard}",
                                   "each tensor of a sharded checkpoint belongs in one shard; re-save the checkpoint")
                self._owner[name] = shard
        for name, shard in sorted(weight_map.items()):
            if self._owner.get(name) != shard:
                found = f", it is in {self._owner[name]}" if name in self._owner else ""
                raise DsaError(f"{self.index}: weight_map['{name}']",
                               f"places tensor '{name}' in {shard}, which does not hold it{found}",
                               "use the index saved with these shards")
        stray = sorted(n for n in self._owner if n not in weight_map)
        if stray:
            raise DsaError(str(self.index), f"{len(stray)} tensor(s) in the shards that the weight_map does not "
                                            f"list: {', '.join(f'{n} ({self._owner[n]})' for n in stray[:5])}",
                           "use the index saved with these shards")
        self._open: Optional[str] = None

    def keys(self) -> List[str]:
        return sorted(self._owner)

    def __contains__(self, name: str) -> bool:
        return name in self._owner

    def info(self, name: str) -> TensorInfo:
        return self._shards[self._owner[name]].info(name)

    def where(self, name: str) -> str:
        return str(self._shards[self._owner[name]].path)

    def read(self, name: str):
        shard = self._owner[name]
        if self._open is not None and self._open != shard:
            self._shards[self._open].close()  # so that 4096 shards never hold 4096 descriptors
        self._open = shard
        return self._shards[shard].read(name)

    def close(self) -> None:
        for source in self._shards.values():
            source.close()
        self._open = None


def open_safetensors(path, listed: Optional[Iterable[str]] = None, manifest_name: str = "manifest") -> TensorSource:
    """A safetensors checkpoint: one file, or a sharded one through its index (when `listed`, the manifest's
    shard files, is given, or the path is a .json index)."""
    path = Path(path)
    if listed is not None or path.name.endswith(".json"):
        return ShardedSafetensors(path, listed, manifest_name)
    return SafetensorsFile(path)


# -- writing ------------------------------------------------------------------------------------------------


Entry = Tuple[str, object, Sequence[int]]  # (name, dtype or dtype name, shape)


def _normalise(entries: Iterable[Entry], where: str) -> List[Tuple[str, str, Tuple[int, ...]]]:
    out, seen = [], set()
    for name, dtype, shape in entries:
        dtype = dtype_name(dtype)
        if dtype not in _CODES:
            raise DsaError(where, f"tensor '{name}': dtype {dtype} has no safetensors code",
                           f"use one of {', '.join(sorted(_CODES))}")
        if name in seen:
            raise DsaError(where, f"tensor '{name}' is listed twice", "give each tensor one entry")
        seen.add(name)
        out.append((name, dtype, tuple(int(d) for d in shape)))
    return out


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * numpy_dtype(dtype).itemsize


def safetensors_header(entries: Iterable[Entry], metadata: Optional[Mapping[str, str]] = None,
                       where: str = "safetensors") -> Tuple[bytes, List[Tuple[str, str, Tuple[int, ...]]]]:
    """(the file's first 8 + N bytes, the entries in file order), exactly as safetensors' writer makes them.
    Metadata keys are written sorted (safetensors writes them in hash order, so the two agree for one key)."""
    ordered = sorted(_normalise(entries, where), key=lambda e: (-_RANK[_CODES[e[1]]], e[0]))
    header = {}
    if metadata is not None:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    offset = 0
    for name, dtype, shape in ordered:
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    # serde_json's compact form: no spaces, non-ASCII as UTF-8, control characters escaped as Python does.
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, ordered


def _write_tensor(f, name: str, dtype: str, shape: Tuple[int, ...], array, where: str) -> None:
    import numpy as np

    got = (dtype_name(array.dtype), tuple(array.shape))
    if got != (dtype, shape):
        raise DsaError(where, f"tensor '{name}' was produced as {list(got[1])} {got[0]}, the header says "
                              f"{list(shape)} {dtype}", "produce each tensor with its declared dtype and shape")
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.byteswap().view(array.dtype.newbyteorder("<"))
    if array.nbytes:
        f.write(memoryview(array.reshape(-1).view(np.uint8)))


def write_safetensors(out, entries: Iterable[Entry], produce: Callable[[str], object],
                      metadata: Optional[Mapping[str, str]] = None) -> None:
    """Writes a .safetensors file atomically, streamed: the header from `entries` [(name, dtype, shape)]
    first, then `produce(name)` (a numpy array of that dtype and shape) for one tensor at a time, in file
    order. Byte-identical to `safetensors.numpy.save_file(tensors, out, metadata=metadata)` (with at most one
    metadata key, which safetensors otherwise writes in hash order)."""
    head, ordered = safetensors_header(entries, metadata, str(out))
    with atomic_output(out) as tmp, open(tmp, "wb") as f:
        f.write(head)
        for name, dtype, shape in ordered:
            _write_tensor(f, name, dtype, shape, produce(name), str(out))


def shard_file_name(i: int, count: int) -> str:
    """Hugging Face's shard naming, 1-based: model-00001-of-00004.safetensors."""
    return f"model-{i:05d}-of-{count:05d}.safetensors"


def plan_shards(entries: Iterable[Entry], max_shard_bytes: int) -> List[List[Tuple[str, str, Tuple[int, ...]]]]:
    """Entries grouped into shards, in order: a new shard when the next tensor would take the current one
    past `max_shard_bytes` (a tensor larger than that gets a shard of its own)."""
    shards: List[list] = []
    size = 0
    for entry in _normalise(entries, "shards"):
        n = _nbytes(entry[1], entry[2])
        if not shards or (shards[-1] and size + n > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    return shards


def write_sharded_safetensors(directory, entries: Iterable[Entry], produce: Callable[[str], object],
                              max_shard_bytes: int, metadata: Optional[Mapping[str, str]] = None) -> Path:
    """Writes a sharded checkpoint into `directory`: shards `model-0000i-of-0000N.safetensors` (each written as
    `write_safetensors` writes, with `metadata` in its header) and then their index, `model.safetensors.index
    .json` ({"metadata": {"total_size": bytes of all tensors}, "weight_map": {name: shard}}, canonical JSON).
    Each file is written atomically and the index last, so a failure leaves no index. Returns the index."""
    if max_shard_bytes <= 0:
        raise DsaError(str(directory), f"max_shard_bytes {max_shard_bytes} is not positive")
    directory = Path(directory)
    shards = plan_shards(entries, max_shard_bytes)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        name = shard_file_name(i, len(shards))
        write_safetensors(directory / name, shard, produce, metadata)
        for tensor, dtype, shape in shard:
            weight_map[tensor] = name
            total += _nbytes(dtype, shape)
    index = directory / INDEX_NAME
    with atomic_output(index) as tmp:
        tmp.write_bytes(canonical_json({"metadata": {"total_size": total}, "weight_map": weight_map}).encode("utf-8"))
    return index
