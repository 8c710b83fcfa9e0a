"""dsa compile's cache: the outputs of finished stages, keyed by exactly what the Bazel action of each stage is
keyed by, so that a second `dsa compile` (another target, another tuning file, a failed compile retried) does
not export, archive or compile again what it already has.

    cache = cache_from_environment()                     # ~/.cache/rules_dsa/compile-cache, or $DSA_COMPILE_CACHE
    key = cache.key("export", {"export_view": ..., ...}) # sha256 of the inputs, as canonical JSON
    hit = cache.fetch("export", key, {"model.mlir": out / "model.mlir", ...}, "export")
    if hit is None:
        ...run the stage...
        cache.store("export", key, {"model.mlir": out / "model.mlir", ...}, "export", inputs)

The caller (dsa.tools.pipeline) composes the inputs; this module knows nothing of stages. Layout, under the
cache directory (`DSA_COMPILE_CACHE=DIR` moves it, `DSA_COMPILE_CACHE=off` or `dsa compile --no-cache` turns it
off; deleting it is always safe):

    v1/entries/<stage>/<key>/   one entry: the stage's output files, read-only, and entry.json (each file's
                                sha256 and size; for a large file also its stat fingerprint; the inputs)
    v1/tmp/                     entries being written, and entries being discarded

An entry is written in a directory of v1/tmp and renamed into place whole: a half-written entry is never
seen. Files come in and go out by hardlink when the cache and the output are on one filesystem (a 14 GB
parameter archive is not copied), by copy otherwise. Hardlinked outputs share the entry's inode: every stage
writes a new file and renames it into place (dsa.core.fileio.atomic_output), never writing into an existing
one, and the files are made read-only.

Every file is checked before it is used. A file under LARGE_FILE_BYTES is hashed each time (milliseconds). A
larger one (the parameter archive) is hashed again only when its size, mtime or inode differ from what was
recorded when it was stored: a full hash of a 14 GB archive costs 11 s from the page cache and 34 s from
disk (measured here: 1.24 GiB/s and 0.41 GiB/s) on every hit, on top of the lock's own read of the archive, and
every write to the entry or to an output hardlinked to it moves the mtime. What a stat cannot see (a bit
flipped on the medium, an mtime put back by hand) the caller confirms for free with the digest it computes of
the output anyway (`confirm`: the lock hashes the archive; `recheck`: the checkpoint's pin check failed). An
entry that fails a check is discarded with a one-line warning naming it, and the stage runs again: a corrupt
entry never reaches an output.

The cache never fails a build: a directory that cannot be created or written warns once and the build runs
without it; a store that fails warns and the build goes on.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Dict, Mapping, Optional

from dsa.core.fileio import canonical_json, read_json, sha256_bytes, sha256_file, write_bytes_atomic

FORMAT = 1
ENVIRONMENT_VARIABLE = "DSA_COMPILE_CACHE"
DEFAULT_DIR = "~/.cache/rules_dsa/compile-cache"
# Files at least this large are re-hashed only when their stat fingerprint changed (see the module's doc).
LARGE_FILE_BYTES = 256 << 20
# Directories in v1/tmp older than this are left over from a killed run: removed when a cache is opened.
STALE_TMP_S = 24 * 3600
ENTRY_MANIFEST = "entry.json"


def warn(message: str) -> None:
    print(f"dsa compile: warning: {message}", file=sys.stderr)


def cache_from_environment(disabled: bool = False, environ: Mapping[str, str] = os.environ) -> Optional["CompileCache"]:
    """The cache `dsa compile` uses: none when `disabled` (--no-cache) or DSA_COMPILE_CACHE=off, else the
    directory DSA_COMPILE_CACHE names, or ~/.cache/rules_dsa/compile-cache."""
    value = environ.get(ENVIRONMENT_VARIABLE, "").strip()
    if disabled or value.lower() == "off":
        return None
    return CompileCache.open(Path(os.path.expanduser(value or DEFAULT_DIR)))


@dataclasses.dataclass
class Hit:
    """A stage's outputs taken from the cache: its entry, and the files only checked by their stat
    fingerprint (name → the sha256 recorded for it), which the caller confirms where it hashes them anyway."""

    stage: str
    label: str
    entry: Path
    unhashed: Dict[str, str]


def _fingerprint(st: os.stat_result) -> list:
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]


def _link_or_copy(src: Path, dest: Path) -> bool:
    """Puts `src` at `dest` (replacing it) by hardlink, or by copy across filesystems or where links are
    refused; returns whether it linked. Never writes into an existing file: a new name, then a rename."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}.cache")
    try:
        try:
            os.link(src, tmp)
            linked = True
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES, errno.ENOTSUP,
                               errno.EOPNOTSUPP):
                raise
            shutil.copyfile(src, tmp)
            linked = False
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()
    return linked


class CompileCache:
    """A cache directory (see the module's doc). Open it with `open`, which returns None for an unusable one."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.entries = self.root / f"v{FORMAT}" / "entries"
        self.tmp = self.root / f"v{FORMAT}" / "tmp"

    @classmethod
    def open(cls, root: Path) -> Optional["CompileCache"]:
        cache = cls(root)
        try:
            cache.entries.mkdir(parents=True, exist_ok=True)
            cache.tmp.mkdir(parents=True, exist_ok=True)
            os.rmdir(tempfile.mkdtemp(prefix="probe.", dir=cache.tmp))  # writable, not just present
        except OSError as e:
            warn(f"the compile cache {root} is not usable ({e.strerror or e}): building without it "
                 f"(set {ENVIRONMENT_VARIABLE}=DIR to use another directory, or =off)")
            return None
        cache._remove_stale_tmp()
        return cache

    def _remove_stale_tmp(self) -> None:
        now = time.time()
        try:
            for path in self.tmp.iterdir():
                try:
                    if now - path.lstat().st_mtime > STALE_TMP_S:
                        shutil.rmtree(path, ignore_errors=True)
                except OSError:
                    pass
        except OSError:
            pass

    # -- keys -------------------------------------------------------------------------------------------------

    @staticmethod
    def key(stage: str, inputs: Mapping) -> str:
        """The entry key of a stage run on these inputs (a JSON-able mapping of digests and small values)."""
        return sha256_bytes(canonical_json({"format": FORMAT, "stage": stage, "inputs": inputs}).encode("utf-8"))

    def entry_path(self, stage: str, key: str) -> Path:
        return self.entries / stage / key

    # -- use --------------------------------------------------------------------------------------------------

    def fetch(self, stage: str, key: str, outputs: Mapping[str, Path], label: str) -> Optional[Hit]:
        """Puts the entry's files at `outputs` (file name → output path) and returns the hit, or returns None
        (a miss) when there is no entry, or when it was corrupt (then discarded, with a warning naming it)."""
        entry = self.entry_path(stage, key)
        if not entry.exists():
            return None
        try:
            meta = read_json(entry / ENTRY_MANIFEST)
            files = meta["files"]
            if meta.get("format") != FORMAT or meta.get("key") != key or not isinstance(files, dict):
                raise ValueError("not an entry of this key and format")
        except FileNotFoundError:
            return self._corrupt(entry, label, f"it has no {ENTRY_MANIFEST}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            return self._corrupt(entry, label, f"its {ENTRY_MANIFEST} is unreadable: {e}")
        if sorted(files) != sorted(outputs):
            return self._corrupt(entry, label, f"it holds {sorted(files)}, the stage writes {sorted(outputs)}")
        unhashed: Dict[str, str] = {}
        refreshed = False
        for name, info in sorted(files.items()):
            path = entry / name
            try:
                st = os.stat(path)
                if st.st_size != info["size"]:
                    return self._corrupt(entry, label, f"{name} has {st.st_size} bytes, {info['size']} recorded")
                if info["size"] >= LARGE_FILE_BYTES and info.get("stat") == _fingerprint(st):
                    unhashed[name] = info["sha256"]
                    continue
                digest = sha256_file(path)
            except OSError as e:
                return self._corrupt(entry, label, f"{name} cannot be read: {e.strerror or e}")
            if digest != info["sha256"]:
                return self._corrupt(entry, label, f"{name} has sha256 {digest}, {info['sha256']} recorded")
            if info["size"] >= LARGE_FILE_BYTES:  # hashed and good: its new fingerprint saves the next hash
                info["stat"] = _fingerprint(st)
                refreshed = True
        if refreshed:
            try:
                write_bytes_atomic(entry / ENTRY_MANIFEST, canonical_json(meta).encode("utf-8"))
            except OSError:
                pass  # only a saving lost: the next use hashes again
        try:
            for name, dest in outputs.items():
                _link_or_copy(entry / name, Path(dest))
        except OSError as e:
            warn(f"could not take {label} from the compile cache ({e.strerror or e}): running it")
            return None
        return Hit(stage, label, entry, unhashed)

    def confirm(self, hit: Hit, name: str, sha256: str) -> bool:
        """The caller hashed the output `name` of `hit` (the lock hashes the archive): False, discarding the
        entry with a warning, when that differs from what the entry recorded."""
        recorded = hit.unhashed.get(name)
        if recorded is None or recorded == sha256:
            return True
        self._corrupt(hit.entry, hit.label, f"{name} has sha256 {sha256}, {recorded} recorded")
        return False

    def recheck(self, hit: Hit) -> bool:
        """Hashes the files of `hit` that were only stat-checked: False, discarding the entry with a warning,
        when one differs from what the entry recorded."""
        for name, recorded in sorted(hit.unhashed.items()):
            try:
                digest = sha256_file(hit.entry / name)
            except OSError as e:
                digest = f"unreadable ({e.strerror or e})"
            if not self.confirm(hit, name, digest):
                return False
        return True

    # -- store ------------------------------------------------------------------------------------------------

    def store(self, stage: str, key: str, outputs: Mapping[str, Path], label: str, inputs: Mapping) -> None:
        """Stores the stage's finished outputs (file name → output path) under `key`; warns and goes on if the
        cache cannot take them. The outputs become read-only (hardlinked: the entry's files are theirs)."""
        entry = self.entry_path(stage, key)
        if entry.exists():
            return
        tmp: Optional[Path] = None
        try:
            self.tmp.mkdir(parents=True, exist_ok=True)  # (the cache may have been deleted since it was opened)
            tmp = Path(tempfile.mkdtemp(prefix=f"{stage}.{key[:12]}.", dir=self.tmp))
            files = {}
            for name, src in sorted(outputs.items()):
                dest = tmp / name
                _link_or_copy(Path(src), dest)
                digest = sha256_file(dest)  # what the entry holds (the output itself, or its copy)
                os.chmod(dest, 0o444)
                st = os.stat(dest)
                files[name] = {"sha256": digest, "size": st.st_size}
                if st.st_size >= LARGE_FILE_BYTES:
                    files[name]["stat"] = _fingerprint(st)
            meta = {"format": FORMAT, "key": key, "stage": stage, "label": label, "files": files, "inputs": inputs}
            (tmp / ENTRY_MANIFEST).write_bytes(canonical_json(meta).encode("utf-8"))
            entry.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(tmp, entry)
                tmp = None
            except OSError as e:
                if not entry.exists():  # else: another run stored the same entry first; keep that one
                    raise e
        except OSError as e:
            warn(f"could not store {label} in the compile cache {self.root} ({e.strerror or e}): going on "
                 "without it")
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    # -- discard ----------------------------------------------------------------------------------------------

    def _corrupt(self, entry: Path, label: str, why: str) -> None:
        """Warns, naming the entry and what is wrong with it, and discards it; None: the caller's miss."""
        warn(f"compile cache entry {entry} is corrupt ({why}): discarded, {label} runs again")
        self.discard(entry)
        return None

    def discard(self, entry: Path) -> None:
        """Moves the entry aside (no later run can take it) and deletes it."""
        try:
            aside = Path(tempfile.mkdtemp(prefix="discarded.", dir=self.tmp))
            os.rename(entry, aside / "entry")
        except OSError:
            aside = entry
        shutil.rmtree(aside, ignore_errors=True)


def digest_files(paths: Mapping[str, Path]) -> Dict[str, str]:
    """{key: sha256 of the file} for a mapping of files (model sources, stage code)."""
    return {key: sha256_file(path) for key, path in sorted(paths.items())}


def digest_file(path: Optional[Path]) -> Optional[str]:
    return None if path is None else sha256_file(path)

