"""Bundles as untrusted data: a module index that names files outside the bundle, sparse or oversized members,
files swapped with bundle.json rewritten to match (the recipe lock still pins the originals), malformed and
deeply nested tables, a vmfb swapped for garbage — each refused with one message naming the file, before
anything it names is loaded or written."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Callable, Dict, Optional

import pytest

from bundle_testlib import cli, rebundle
from dsa.core.errors import DsaError
from dsa.core.fileio import canonical_json, read_json
from dsa.core import tarfiles as T
from dsa.runtime import bundle as B
from dsa.tools.testing import bounded_memory


@pytest.fixture(autouse=True)
def _case_memory_limit():
    """Every case runs under a memory limit: at most 1 GiB more address space than the process holds."""
    with bounded_memory():
        yield


def _repack(opened: B.OpenedBundle, out: Path, *, files: Optional[Dict[str, bytes]] = None,
            edit_meta: Optional[Callable[[dict], None]] = None, extra: Optional[tarfile.TarInfo] = None,
            extra_data: bytes = b"") -> Path:
    """The bundle's files re-archived with some replaced and bundle.json's digests recomputed to match (an
    attacker can rewrite bundle.json; the recipe lock is what they must also forge)."""
    meta = json.loads(json.dumps(opened.meta))
    contents = {p.name: p.read_bytes() for p in opened.root.iterdir() if p.name != B.BUNDLE_JSON}
    contents.update(files or {})
    for name, data in contents.items():
        if name in meta["files"]:
            meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    if B.INDEX_JSON in (files or {}):
        meta["index"] = json.loads(contents[B.INDEX_JSON])
    if edit_meta:
        edit_meta(meta)
    with tarfile.open(out, "w", format=T.TAR_FORMAT) as tar:
        table = canonical_json(meta).encode()
        tar.addfile(T.tarinfo(B.BUNDLE_JSON, len(table)), io.BytesIO(table))
        if extra is not None:
            tar.addfile(extra, io.BytesIO(extra_data))
        for name in sorted(contents):
            tar.addfile(T.tarinfo(name, len(contents[name])), io.BytesIO(contents[name]))
    return out


def _refused(archive: Path, *needles: str, dest: Optional[Path] = None) -> str:
    dest = dest or archive.parent / (archive.name + ".out")
    with pytest.raises(DsaError) as info:
        B.extract_bundle(archive, dest)
    text = str(info.value)
    for needle in needles:
        assert needle in text, text
    return text


def _index_with(opened, **changes) -> bytes:
    index = read_json(opened.root / B.INDEX_JSON)
    for key, value in changes.items():
        if key.startswith("module0_"):
            index["modules"][0][key[len("module0_"):]] = value
        else:
            index[key] = value
    return canonical_json(index).encode()


@pytest.mark.parametrize("field,value", [
    ("parameter_archive", "/etc/passwd"),
    ("parameter_archive", "../params.irpa"),
    ("target_spec", "/proc/self/environ"),
    ("runtime_view", "sub/runtime_view.json"),
    ("module0_vmfb", "/tmp/evil.vmfb"),
    ("module0_record", "../../prompt_len_0.export_record.json"),
])
def test_a_module_index_naming_a_file_outside_the_bundle_is_refused(opened, tmp_path, field, value):
    archive = _repack(opened, tmp_path / "escape.tar", files={B.INDEX_JSON: _index_with(opened, **{field: value})})
    shown = field.replace("module0_", "modules[0].")
    _refused(archive, "modules.json", f"'{shown}' is '{value}', which is not a file of the bundle")


def test_a_sparse_member_declaring_gigabytes_is_refused_before_anything_is_written(opened, tmp_path):
    sparse = tarfile.TarInfo("zzz.bin")
    table = b"1\n0\n0\n" + b"\0" * (512 - 6)
    sparse.size = len(table)
    sparse.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "zzz.bin",
                          "GNU.sparse.realsize": str(10 ** 10)}
    out = tmp_path / "sparse.tar"
    _repack(opened, out, edit_meta=lambda m: m["files"].update({"zzz.bin": {"sha256": "0" * 64, "size": 10 ** 10}}))
    # Re-write with the sparse member first (PAX format for its headers).
    with tarfile.open(out) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(members[0][0], io.BytesIO(members[0][1]))   # bundle.json
        tar.addfile(sparse, io.BytesIO(table))
    dest = tmp_path / "dest"
    _refused(out, "member 'zzz.bin'", "is a sparse file", dest=dest)
    assert not (dest / "zzz.bin").exists()


def test_a_member_larger_than_bundle_json_says_is_refused_before_it_is_written(opened, tmp_path):
    params = (opened.root / B.PARAMS_IRPA).read_bytes()
    out = _repack(opened, tmp_path / "big.tar", files={B.PARAMS_IRPA: params + bytes(1 << 20)},
                  edit_meta=lambda m: m["files"].update({B.PARAMS_IRPA: {
                      "sha256": hashlib.sha256(params).hexdigest(), "size": len(params)}}))
    dest = tmp_path / "dest"
    _refused(out, f"{B.PARAMS_IRPA}: declares {len(params) + (1 << 20)} bytes, bundle.json records {len(params)}",
             dest=dest)
    assert not (dest / B.PARAMS_IRPA).exists()


def test_a_file_size_beyond_the_member_limit_in_bundle_json_is_refused(opened, tmp_path):
    def huge(meta):
        meta["files"][B.PARAMS_IRPA]["size"] = B.MAX_MEMBER_BYTES + 1
    _refused(_repack(opened, tmp_path / "huge.tar", edit_meta=huge), "is malformed", "at most")


def test_swapped_weights_with_bundle_json_rewritten_are_refused_by_the_lock(opened, tmp_path):
    params = bytearray((opened.root / B.PARAMS_IRPA).read_bytes())
    params[-1] ^= 0x01   # one weight byte: bundle.json's digest is recomputed, the lock's is not
    archive = _repack(opened, tmp_path / "swapped.tar", files={B.PARAMS_IRPA: bytes(params)})
    _refused(archive, f"{B.PARAMS_IRPA}: has sha256", "the recipe lock pins")


def test_a_swapped_manifest_is_refused_by_the_lock(opened, tmp_path):
    manifest = (opened.root / B.MANIFEST_YAML).read_bytes() + b"\n# edited\n"
    _refused(_repack(opened, tmp_path / "manifest.tar", files={B.MANIFEST_YAML: manifest}),
             f"{B.MANIFEST_YAML}: has sha256", "the recipe lock pins")


def test_a_lock_missing_a_field_is_refused_naming_it(opened, tmp_path):
    lock = read_json(opened.root / B.LOCK_JSON)
    del lock["modules"]
    archive = _repack(opened, tmp_path / "lock.tar", files={B.LOCK_JSON: canonical_json(lock).encode()})
    _refused(archive, "lock.json", "lacks modules")


def test_a_lock_that_is_not_json_is_refused(opened, tmp_path):
    _refused(_repack(opened, tmp_path / "lockjunk.tar", files={B.LOCK_JSON: b"\xff{not json"}),
             "lock.json", "is not a readable recipe lock")


def test_deeply_nested_bundle_json_is_refused_without_a_traceback(opened, tmp_path):
    deep = b"[" * 200_000 + b"]" * 200_000
    out = tmp_path / "deep.tar"
    with tarfile.open(out, "w", format=T.TAR_FORMAT) as tar:
        tar.addfile(T.tarinfo(B.BUNDLE_JSON, len(deep)), io.BytesIO(deep))
    proc = cli("dsa.runtime.run", "--bundle", out)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert "nested too deeply" in proc.stderr


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", "bundle.json"])
def test_bundle_json_listing_a_path_is_refused(opened, tmp_path, name):
    def listed(meta):
        meta["files"][name] = {"sha256": "0" * 64, "size": 0}
    _refused(_repack(opened, tmp_path / "listed.tar", edit_meta=listed), "is not a plain file name")


def test_a_vmfb_swapped_for_garbage_with_a_forged_lock_is_refused_by_the_runtime(opened, tmp_path):
    # Everything re-hashed, the lock included (rebundle): the bundle verifies; the runtime must still not crash.
    archive = rebundle(opened, tmp_path / "garbage.tar", files={"prompt_len_0.vmfb": b"\x00garbage" * 100})
    proc = cli("dsa.runtime.run", "--bundle", archive, "--prompt-len", "8", "--repeats", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert "prompt_len_0.vmfb" in proc.stderr and "is not the vmfb its compile report names" in proc.stderr


def test_a_vmfb_swapped_for_another_buckets_is_refused_by_the_runtime(opened, tmp_path):
    other = (opened.root / "prompt_len_2.vmfb").read_bytes()
    archive = rebundle(opened, tmp_path / "other.tar", files={"prompt_len_0.vmfb": other})
    proc = cli("dsa.runtime.run", "--bundle", archive, "--prompt-len", "8", "--repeats", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert "is not the vmfb its compile report names" in proc.stderr
