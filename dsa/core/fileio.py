"""Small file helpers shared by every stage: digests, canonical JSON, and all-or-nothing writes.

Every output a stage produces is written to a temporary file beside its final path and renamed into place
only when complete, so a failed action never leaves a file a later build could mistake for good.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator, Union

PathLike = Union[str, os.PathLike]


def sha256_file(path: PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj) -> str:
    """Deterministic JSON text: sorted keys, two-space indent, trailing newline."""
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


@contextlib.contextmanager
def atomic_output(path: PathLike) -> Iterator[Path]:
    """Yields a temporary path in the destination directory; renames it to `path` on success only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o644)  # mkstemp's 0600 would make outputs unreadable to other users
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_bytes_atomic(path: PathLike, data: bytes) -> None:
    with atomic_output(path) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: PathLike, obj) -> None:
    write_bytes_atomic(path, canonical_json(obj).encode("utf-8"))


def read_json(path: PathLike):
    """JSON from a file; a document nested too deeply for the parser is a ValueError like any other bad JSON."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None
