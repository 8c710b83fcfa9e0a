"""Deterministic tar archives and their digest sidecar: what a release bundle is made of (docs/bundle-format.md).

The archive is a plain tar (GNU format, no compression) whose members are sorted by name and carry fixed
metadata (mtime, owner, mode), so the same members give the same bytes in any checkout, on any machine. Beside
it, NAME.sha256 holds one `sha256sum` line. The bundle writer (dsa.stages.bundle) writes both; the reader
(dsa.runtime.bundle) checks them.
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from pathlib import Path
from typing import Dict, Optional, Tuple

from dsa.core.fileio import atomic_output, sha256_file

# Fixed member metadata. The mtime is rules_pkg's "portable" 2000-01-01T00:00:00Z: a constant that every
# tar implementation extracts without a warning (0, the epoch, draws "implausibly old time stamp").
MTIME = 946684800
FILE_MODE = 0o644
TAR_FORMAT = tarfile.GNU_FORMAT  # no pax headers (they would carry times); base-256 sizes past 8 GiB
BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE
DIGEST_LINE = re.compile(r"^([0-9a-f]{64})  (\S.*)$")


def digest_line(sha256: str, basename: str) -> str:
    """The `.sha256` file's one line, in `sha256sum` form: `<hex>  <basename>`."""
    return f"{sha256}  {basename}\n"


def sidecar_path(archive: Path) -> Path:
    """Where the digest of `archive` lives: NAME.sha256 beside NAME.tar."""
    archive = Path(archive)
    return archive.with_name((archive.name[:-len(".tar")] if archive.name.endswith(".tar") else archive.name)
                             + ".sha256")


def tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = MTIME
    info.mode = FILE_MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def write_archive(out: Path, payload: Dict[str, Path], generated: Dict[str, bytes], sizes: Dict[str, int],
                  digest_out: Optional[Path]) -> str:
    names = sorted(set(payload) | set(generated))
    with atomic_output(out) as tmp:
        with open(tmp, "wb") as raw:
            with tarfile.open(fileobj=raw, mode="w", format=TAR_FORMAT) as tar:
                for name in names:
                    if name in generated:
                        data = generated[name]
                        tar.addfile(tarinfo(name, len(data)), io.BytesIO(data))
                    else:
                        with open(payload[name], "rb") as f:
                            tar.addfile(tarinfo(name, sizes[name]), f)
    sha = sha256_file(out)
    digest_out = Path(digest_out) if digest_out else sidecar_path(out)
    with atomic_output(digest_out) as tmp:
        tmp.write_text(digest_line(sha, out.name), encoding="utf-8")
    return sha


def member_digests(payload: Dict[str, Path], generated: Dict[str, bytes]) -> Tuple[Dict[str, str], Dict[str, int]]:
    """The sha256 and size of every member: the files to copy and the generated ones."""
    digests: Dict[str, str] = {}
    sizes: Dict[str, int] = {}
    for name, path in payload.items():
        digests[name], sizes[name] = sha256_file(path), path.stat().st_size
    for name, data in generated.items():
        digests[name], sizes[name] = hashlib.sha256(data).hexdigest(), len(data)
    return digests, sizes
