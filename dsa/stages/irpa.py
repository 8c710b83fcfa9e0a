"""A streaming writer of IREE parameter archives (.irpa), byte-identical to IREE's own.

`iree.runtime.ParameterIndex` + `add_buffer` + `create_archive_file` needs every tensor in memory at once
(the index holds the buffers until the archive is written): a 3.5B-parameter policy would need 14 GB. Here
the archive's layout is computed from each entry's name, byte length and metadata alone, the header, entry
table and metadata segment are written first, and then each entry's bytes are written in entry order, one at
a time: memory is bounded by the largest entry the caller holds, whatever the archive's size.

The format, from IREE's runtime/src/iree/schemas/parameter_archive.h (packed little-endian structs) and the
layout its builder chooses, runtime/src/iree/io/formats/irpa/irpa_builder.c
(`iree_io_parameter_archive_builder_add_data_entry`, `..._write`, `iree_io_build_parameter_archive`):

    0                 header v0 (88 bytes): magic "IRPA", version 0.0, header_size 88, next_header_offset 0,
                      flags 0, entry_count, entry/metadata/storage segments as (offset, length)
    align(88, 16)     entry table: one data entry (76 bytes) per parameter, each at a multiple of 16
                      (zero padding between them, none after the last)
    + table length    metadata segment: per entry its name, then its metadata blob (no padding, no NULs)
    align(.., 64)     storage segment (aligned to the first entry's minimum alignment, 64; 1 when empty):
                      each entry's bytes at align(end of the previous entry, 64), relative to the segment
    ...               zero padding up to a multiple of 4096 (the file size)

A data entry: entry_size (u64, 76), type (u32, 2 = data), flags (u64, 0), name (offset, length into the
metadata segment), metadata (offset, length; offset 0 when there is none), minimum_alignment (u64, 64),
storage (offset into the storage segment, length). tests/weights/irpa_test.py compares the bytes with
IREE's for empty, odd-sized, many, long- and unicode-named entries, with and without metadata.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, Union

from dsa.core.errors import DsaError
from dsa.core.fileio import atomic_output

MAGIC = 0x41505249  # "IRPA", little-endian
_HEADER = struct.Struct("<IHHQQQ" "Q" "QQ" "QQ" "QQ")  # prefix, entry_count, three (offset, length) ranges
_DATA_ENTRY = struct.Struct("<QIQ" "QQ" "QQ" "Q" "QQ")  # entry header, storage range
assert _HEADER.size == 88 and _DATA_ENTRY.size == 76
_ENTRY_ALIGNMENT = 16  # IREE_IO_PARAMETER_ARCHIVE_ENTRY_ALIGNMENT (and _HEADER_ALIGNMENT)
_DATA_ALIGNMENT = 64  # IREE_IO_PARAMETER_ARCHIVE_DEFAULT_DATA_ALIGNMENT
_FILE_ALIGNMENT = 4096  # IREE_IO_PARAMETER_ARCHIVE_DEFAULT_FILE_ALIGNMENT
_ENTRY_TYPE_DATA = 2
_ZEROS = bytes(1 << 16)

Metadata = Union[str, bytes, None]


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclasses.dataclass(frozen=True)
class IrpaEntry:
    """One parameter of an archive: its name, the byte length of its data, and an optional metadata blob
    (a str is stored as UTF-8, as `ParameterIndex.add_buffer(metadata=...)` does)."""

    name: str
    nbytes: int
    metadata: Metadata = None


@dataclasses.dataclass(frozen=True)
class IrpaLayout:
    """Where everything goes: `head` (header + entry table + metadata segment, written first), each entry's
    absolute file offset, and the file's total size."""

    head: bytes
    offsets: Tuple[int, ...]
    total_size: int


def layout(entries: Sequence[IrpaEntry]) -> IrpaLayout:
    """The archive's layout for these entries, in this order (IREE keeps the order they were added in)."""
    names = [e.name.encode("utf-8") for e in entries]
    blobs = [(e.metadata.encode("utf-8") if isinstance(e.metadata, str) else bytes(e.metadata or b""))
             for e in entries]
    table_offset = _align(_HEADER.size, _ENTRY_ALIGNMENT)
    table_length = (_align(_DATA_ENTRY.size, _ENTRY_ALIGNMENT) * (len(entries) - 1) + _DATA_ENTRY.size
                    if entries else 0)
    metadata_offset = table_offset + table_length
    metadata_length = sum(len(n) + len(b) for n, b in zip(names, blobs))
    # The builder aligns the storage segment to the first entry's minimum alignment (1 with no entries).
    storage_offset = _align(metadata_offset + metadata_length, _DATA_ALIGNMENT if entries else 1)
    table = bytearray()
    storage_length = 0
    relative = []
    cursor = 0  # into the metadata segment
    for entry, name, blob in zip(entries, names, blobs):
        start = _align(storage_length, _DATA_ALIGNMENT)
        storage_length = start + entry.nbytes
        relative.append(start)
        name_ref = (cursor, len(name))
        cursor += len(name)
        blob_ref = (cursor if blob else 0, len(blob))
        cursor += len(blob)
        table += bytes(_align(len(table), _ENTRY_ALIGNMENT) - len(table))
        table += _DATA_ENTRY.pack(_DATA_ENTRY.size, _ENTRY_TYPE_DATA, 0, *name_ref, *blob_ref, _DATA_ALIGNMENT,
                                  start, entry.nbytes)
    assert len(table) == table_length
    header = _HEADER.pack(MAGIC, 0, 0, _HEADER.size, 0, 0, len(entries), table_offset, table_length,
                          metadata_offset, metadata_length, storage_offset, storage_length)
    head = header + bytes(table_offset - len(header)) + bytes(table) + b"".join(n + b for n, b in zip(names, blobs))
    return IrpaLayout(head=head, offsets=tuple(storage_offset + r for r in relative),
                      total_size=_align(storage_offset + storage_length, _FILE_ALIGNMENT))


def _byte_view(data) -> memoryview:
    """A flat byte view of `data`, without a copy when it is contiguous (a numpy array of any dtype, bf16
    included, is viewed as uint8: a memoryview of an ml_dtypes array has no buffer format to cast)."""
    if isinstance(data, (bytes, bytearray)):
        return memoryview(data)
    if hasattr(data, "dtype") and hasattr(data, "view"):  # numpy
        import numpy as np

        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    return memoryview(data).cast("B")


class IrpaWriter:
    """Writes an archive of `entries` to `path`, streamed: the head at once, then each entry's bytes through
    `write(name, data)`, in entry order. `close()` refuses an archive with entries never written.

    Used as a context manager inside `dsa.core.fileio.atomic_output`, so that a failure midway leaves no
    archive: `with atomic_output(out) as tmp, IrpaWriter(tmp, entries) as w: ...`."""

    def __init__(self, path, entries: Sequence[IrpaEntry], *, where: Optional[str] = None):
        self.path = Path(path)
        self.where = where or str(path)
        self.entries: List[IrpaEntry] = list(entries)
        seen = set()
        for e in self.entries:
            if e.name in seen:
                raise DsaError(self.where, f"parameter '{e.name}' is listed twice",
                               "give each parameter of an archive one entry")
            if e.nbytes < 0:
                raise DsaError(self.where, f"parameter '{e.name}' has a negative length {e.nbytes}")
            seen.add(e.name)
        self.layout = layout(self.entries)
        self._next = 0
        self._file = open(self.path, "wb")
        self._file.write(self.layout.head)
        self._position = len(self.layout.head)

    def __enter__(self) -> "IrpaWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()

    def _pad_to(self, offset: int) -> None:
        while self._position < offset:
            n = min(offset - self._position, len(_ZEROS))
            self._file.write(_ZEROS[:n])
            self._position += n

    def write(self, name: str, data) -> None:
        """The next entry's bytes (any buffer: bytes, a contiguous numpy array, a memoryview)."""
        if self._next >= len(self.entries):
            raise DsaError(self.where, f"parameter '{name}' written after all {len(self.entries)} entries",
                           "write each planned entry once, in order")
        entry = self.entries[self._next]
        if name != entry.name:
            raise DsaError(self.where, f"parameter '{name}' written out of order: entry {self._next} is "
                                       f"'{entry.name}'", "write the entries in the order they were planned")
        view = _byte_view(data)
        if view.nbytes != entry.nbytes:
            raise DsaError(self.where, f"parameter '{name}' has {view.nbytes} bytes, the archive's entry "
                                       f"{entry.nbytes}", "write exactly the planned bytes")
        self._pad_to(self.layout.offsets[self._next])
        self._file.write(view)
        self._position += view.nbytes
        self._next += 1

    def close(self) -> None:
        """Pads the file to its final size; refuses it (after closing) if an entry was never written."""
        if self._file.closed:
            return
        try:
            if self._next != len(self.entries):
                missing = [e.name for e in self.entries[self._next:]]
                raise DsaError(self.where, f"{len(missing)} planned parameter(s) never written: "
                                           f"{', '.join(missing[:5])}", "write every planned entry")
            self._pad_to(self.layout.total_size)
            self._file.flush()
        finally:
            self._file.close()


def write_irpa(path, entries: Sequence[IrpaEntry], produce: Callable[[str], object]) -> None:
    """Writes an archive atomically: `produce(name)` gives each entry's bytes, one entry at a time, in order."""
    with atomic_output(path) as tmp, IrpaWriter(tmp, entries, where=str(path)) as writer:
        for entry in entries:
            writer.write(entry.name, produce(entry.name))
