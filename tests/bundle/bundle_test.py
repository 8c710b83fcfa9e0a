"""dsa.stages.bundle writes, dsa.runtime.bundle reads: the archive is deterministic, holds what
docs/bundle-format.md says, and is refused when it is corrupted, truncated, padded, of a newer format or
inconsistent with its lock."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest

from bundle_testlib import MODULES, built_inputs, cli, copy_inputs, flip_byte, member_offset, repack
from dsa.core import tarfiles as T
from dsa.runtime import bundle as B
from dsa.stages import bundle as W
from dsa.core.errors import DsaError
from dsa.core.fileio import read_json, sha256_file
from dsa.tools.testing import runfile

EXPECTED_FILES = sorted(
    ["build_report.json", "bundle.json", "lock.json", "manifest.yaml", "modules.json", "params.irpa",
     "provenance.intoto.json", "runtime_view.json", "target_spec.json"]
    + [f"{m}{s}" for m in MODULES for s in (".vmfb", ".export_record.json", ".compile_report.json")]
)


# -- determinism ----------------------------------------------------------------------------------------

def test_same_inputs_give_the_same_bytes_from_different_paths(tmp_path):
    inputs = built_inputs()
    shas = []
    for where in ("one/deeper/path", "two"):
        out = tmp_path / where / "out" / "pi0_bundle.tar"
        shas.append(W.create_bundle(out, **copy_inputs(inputs, tmp_path / where / "inputs")))
        assert sha256_file(out) == shas[-1]
    assert shas[0] == shas[1]
    first = (tmp_path / "one/deeper/path/out/pi0_bundle.tar").read_bytes()
    assert first == (tmp_path / "two/out/pi0_bundle.tar").read_bytes()


def test_the_python_api_and_the_bazel_rule_give_the_same_archive(tmp_path, built):
    out = tmp_path / "pi0_bundle.tar"
    sha = W.create_bundle(out, **built_inputs())
    assert out.read_bytes() == built.read_bytes()
    assert B.sidecar_path(out).read_text() == B.sidecar_path(built).read_text() == f"{sha}  pi0_bundle.tar\n"


def test_create_from_a_module_index_gives_the_same_archive(tmp_path, built):
    """`dsa bundle create --index` (how a dsa compile output is bundled), here on the build's own index."""
    out = tmp_path / "pi0_bundle.tar"
    proc = cli("dsa.tools.bundle_cli", "create", "--index", "models/pi0.modules.json",
               "--manifest", "manifests/pi0.yaml",
               "--out", out, cwd=runfile("."))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == built.read_bytes()
    assert f"wrote {out}" in proc.stdout


def test_create_without_index_names_the_missing_flag(tmp_path):
    proc = cli("dsa.tools.bundle_cli", "create", "--manifest", "m.yaml", "--out", tmp_path / "x.tar")
    assert proc.returncode == 2 and "--lock is required without --index" in proc.stderr


def test_members_are_sorted_plain_files_with_fixed_metadata(built):
    with tarfile.open(built) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == EXPECTED_FILES
        for m in members:
            assert m.isreg() and not m.name.startswith("/") and "/" not in m.name
            assert (m.mtime, m.mode, m.uid, m.gid, m.uname, m.gname) == (T.MTIME, 0o644, 0, 0, "", "")
            assert not m.pax_headers
    raw = built.read_bytes()
    assert b"ustar  \x00" in raw[:512]  # GNU magic: no pax extended headers
    assert len(raw) % tarfile.RECORDSIZE == 0


def test_sidecar_is_sha256sum_format(built):
    line = B.sidecar_path(built).read_text()
    assert line == f"{hashlib.sha256(built.read_bytes()).hexdigest()}  {built.name}\n"


# -- contents -------------------------------------------------------------------------------------------

def test_bundle_json_lists_every_file_with_digest_and_size(opened):
    meta = opened.meta
    assert meta["format"] == 1 and meta["model_id"] == "pi0" and meta["target"] == "x86_64-v3"
    assert meta["manifest_source"] == "manifests/pi0.yaml"
    assert sorted(meta["files"]) == [f for f in EXPECTED_FILES if f != "bundle.json"]
    for name, entry in meta["files"].items():
        path = opened.root / name
        assert entry == {"sha256": sha256_file(path), "size": path.stat().st_size}
    assert meta["index"] == read_json(opened.root / "modules.json")
    assert meta["index"]["parameter_archive"] == "params.irpa"
    assert [m["vmfb"] for m in meta["index"]["modules"]] == [f"{m}.vmfb" for m in MODULES]


def test_bundled_files_are_the_built_ones(opened):
    inputs = built_inputs()
    assert sha256_file(opened.root / "lock.json") == sha256_file(inputs["lock"])
    assert sha256_file(opened.root / "params.irpa") == sha256_file(inputs["params"])
    assert sha256_file(opened.root / "manifest.yaml") == sha256_file(inputs["manifest"])
    for m in inputs["modules"]:
        assert sha256_file(opened.root / f"{m.name}.vmfb") == sha256_file(m.vmfb)
    lock = opened.lock
    for name, sha in lock["artifacts"].items():
        assert opened.meta["files"][name]["sha256"] == sha


def test_provenance_is_an_in_toto_slsa_statement_naming_every_input(opened):
    statement = opened.provenance
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    subjects = {s["name"]: s["digest"]["sha256"] for s in statement["subject"]}
    payload = {n: e["sha256"] for n, e in opened.meta["files"].items() if n != "provenance.intoto.json"}
    assert subjects == payload
    definition = statement["predicate"]["buildDefinition"]
    deps = {(d["annotations"]["role"], d["name"]): d["digest"]["sha256"] for d in definition["resolvedDependencies"]}
    lock = opened.lock
    assert deps[("checkpoint", "checkpoint")] == lock["checkpoint"]["sha256"]
    assert deps[("manifest", "manifests/pi0.yaml")] == lock["manifest"]["sha256"]
    assert deps[("toolchain_lock", "requirements_lock.txt")] == lock["toolchain"]["lock_sha256"]
    assert deps[("target_spec", "target_spec/x86_64-v3.json")] == lock["target_spec"]["sha256"]
    for path, sha in lock["model_sources"].items():
        assert deps[("model_source", path)] == sha
    for path, sha in lock["tool_sources"].items():
        assert deps[("tool_source", path)] == sha
    assert "models/pi0/pi0.py" in lock["model_sources"]
    text = json.dumps(statement)
    assert "startedOn" not in text and "finishedOn" not in text and "metadata" not in statement["predicate"]["runDetails"]
    assert "/tmp" not in text and "bazel-out" not in text and "execroot" not in text


def test_build_report_has_ops_dispatches_flags_sizes_and_tool_versions(opened):
    report = opened.build_report
    assert report["format"] == 1 and [m["name"] for m in report["modules"]] == MODULES
    for m in report["modules"]:
        record = read_json(opened.root / f"{m['name']}.export_record.json")
        compile_report = read_json(opened.root / f"{m['name']}.compile_report.json")
        assert m["export"]["op_histogram"] == record["op_histogram"]
        assert m["export"]["op_histogram"]["while_loop"] == 1
        assert m["compile"]["dispatch_count"] == compile_report["dispatch_count"] > 0
        assert m["compile"]["flags"] == compile_report["flags"]
        assert m["sizes"]["vmfb_bytes"] == (opened.root / f"{m['name']}.vmfb").stat().st_size
        assert m["tool_versions"]["torch"] == record["toolchain"]["torch"]
        assert m["tool_versions"]["iree-base-compiler"] == compile_report["iree_base_compiler"]
    assert report["parameters"]["bytes"] == (opened.root / "params.irpa").stat().st_size
    assert [m["bucket"]["size"] for m in report["modules"]] == [32, 64, 128]


def test_list_and_verify_cli(built):
    listed = cli("dsa.tools.bundle_cli", "list", built)
    assert listed.returncode == 0, listed.stderr
    assert "matches pi0_bundle.sha256" in listed.stdout
    for name in EXPECTED_FILES:
        if name != "bundle.json":
            assert name in listed.stdout
    verified = cli("dsa.tools.bundle_cli", "verify", built)
    assert verified.returncode == 0, verified.stderr
    assert "prompt_len_2: prompt_len=128" in verified.stdout and "dispatches" in verified.stdout


# -- refusals -------------------------------------------------------------------------------------------

def _refused(path, *fragments):
    with pytest.raises(DsaError) as e:
        B.extract_bundle(path, path.parent / "x")
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)
    return str(e.value)


def test_one_flipped_byte_is_refused_by_the_sidecar(built_copy):
    flip_byte(built_copy, member_offset(built_copy, "params.irpa") + 1000)
    _refused(built_copy, "sha256 is", "pi0_bundle.sha256 records", "corrupted or truncated")


def test_one_flipped_byte_is_refused_without_sidecar(built_copy):
    B.sidecar_path(built_copy).unlink()
    flip_byte(built_copy, member_offset(built_copy, "prompt_len_1.vmfb") + 7)
    _refused(built_copy, "prompt_len_1.vmfb", "bundle.json records")


@pytest.mark.parametrize("where", ["header", "padding", "trailer"])
def test_flipped_byte_outside_file_data_is_refused_without_sidecar(built_copy, where):
    B.sidecar_path(built_copy).unlink()
    with tarfile.open(built_copy) as tar:
        manifest = tar.getmember("manifest.yaml")
    assert manifest.size % 512, "the test needs a member with padding"
    offset = {
        "header": manifest.offset + 140,  # the member's mtime field: its header checksum no longer holds
        "padding": manifest.offset_data + manifest.size + 3,
        "trailer": built_copy.stat().st_size - 100,
    }[where]
    flip_byte(built_copy, offset)
    _refused(built_copy, "is not a readable bundle archive")


@pytest.mark.parametrize("keep", [9_000_000, 10_208_256, 512])
def test_truncated_is_refused(built_copy, keep):
    data = built_copy.read_bytes()
    built_copy.write_bytes(data[:keep])
    message = _refused(built_copy, "pi0_bundle.sha256 records")
    B.sidecar_path(built_copy).unlink()
    message = _refused(built_copy, "is not a readable bundle archive")
    assert "truncated" in message


def test_appended_bytes_are_refused(built_copy):
    B.sidecar_path(built_copy).unlink()
    with open(built_copy, "ab") as f:
        f.write(b"\0" * 10240)
    _refused(built_copy, "after the end of the archive")


def test_a_format_newer_than_this_reader_is_refused(opened, tmp_path):
    newer = repack(opened.root, tmp_path / "newer.tar", lambda meta: meta.update(format=4))
    _refused(newer, "bundle format 4 is not supported", "reads formats 1, 2 and 3", "docs/bundle-format.md")
    proc = cli("dsa.tools.bundle_cli", "verify", newer)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "bundle format 4 is not supported" in proc.stderr


def test_format_2_is_the_multi_target_kind_only(opened, tmp_path):
    """A single-model bundle relabelled format 2 (the multi-target format) is refused, not read as one."""
    relabelled = repack(opened.root, tmp_path / "relabelled.tar", lambda meta: meta.update(format=2))
    _refused(relabelled, "is format 2 with kind None: format 2 is exactly the multi-target bundles")


def test_format_3_is_the_executorch_kind_only(opened, tmp_path):
    """A single-model bundle relabelled format 3 (the ExecuTorch format) is refused, not read as one."""
    relabelled = repack(opened.root, tmp_path / "relabelled.tar", lambda meta: meta.update(format=3))
    _refused(relabelled, "is format 3 with kind None: format 3 is exactly the ExecuTorch bundles")


def test_newer_format_with_another_layout_is_refused_for_its_format(opened, tmp_path):
    """A format-4 archive may lay its files out differently (here: a directory): the format is checked first."""
    newer = tmp_path / "newer.tar"
    meta = dict(opened.meta, format=4)
    with tarfile.open(newer, "w", format=T.TAR_FORMAT) as tar:
        for name, data in (("bundle.json", json.dumps(meta).encode()), ("modules/a.vmfb", b"x")):
            tar.addfile(T.tarinfo(name, len(data)), io.BytesIO(data))
    _refused(newer, "bundle format 4 is not supported: this reader reads formats 1, 2 and 3", "a newer rules_dsa wrote it")


def test_a_repack_with_format_1_reads(opened, tmp_path):
    same = repack(opened.root, tmp_path / "pi0_bundle.tar", lambda meta: None)
    assert same.read_bytes() == opened.archive.read_bytes()


def test_unlisted_missing_and_unsafe_members_are_refused(opened, tmp_path):
    def drop(meta):
        del meta["files"]["target_spec.json"]
    _refused(repack(opened.root, tmp_path / "a.tar", drop), "holds 'target_spec.json', which bundle.json does not list")

    def ghost(meta):
        meta["files"]["ghost.bin"] = {"sha256": "0" * 64, "size": 1}
    _refused(repack(opened.root, tmp_path / "b.tar", ghost), "missing ghost.bin")

    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w", format=T.TAR_FORMAT) as tar:
        tar.addfile(T.tarinfo("../escape.txt", 0), io.BytesIO(b""))
        meta = json.dumps(opened.meta).encode()
        tar.addfile(T.tarinfo("bundle.json", len(meta)), io.BytesIO(meta))
    _refused(evil, "member '../escape.txt'", "not a plain file name")
    assert not (tmp_path / "escape.txt").exists()


def test_missing_bundle_json_is_refused(opened, tmp_path):
    plain = tmp_path / "plain.tar"
    with tarfile.open(plain, "w", format=T.TAR_FORMAT) as tar:
        tar.add(opened.root / "lock.json", arcname="lock.json")
    _refused(plain, "has no bundle.json")


def test_create_refuses_files_the_lock_does_not_describe(tmp_path):
    inputs = copy_inputs(built_inputs(), tmp_path / "in")
    flip_byte(inputs["modules"][0].vmfb, 100)
    with pytest.raises(DsaError, match="prompt_len_0.vmfb's sha256 is .* but the lock records"):
        W.create_bundle(tmp_path / "out.tar", **inputs)
    assert not (tmp_path / "out.tar").exists()


def test_create_refuses_another_lock_format(tmp_path):
    inputs = copy_inputs(built_inputs(), tmp_path / "in")
    lock = read_json(inputs["lock"])
    lock["format"] = 2
    inputs["lock"].write_text(json.dumps(lock))
    with pytest.raises(DsaError, match="recipe lock format 2 is not supported"):
        W.create_bundle(tmp_path / "out.tar", **inputs)


# -- release --------------------------------------------------------------------------------------------

def test_release_copies_archive_and_digest_into_a_new_directory(built, tmp_path):
    proc = cli("dsa.tools.bundle_cli", "release", built, "dist/v1", env={"BUILD_WORKING_DIRECTORY": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    dest = tmp_path / "dist/v1"
    assert (dest / "pi0_bundle.tar").read_bytes() == built.read_bytes()
    assert (dest / "pi0_bundle.sha256").read_text() == B.sidecar_path(built).read_text()
    assert str(dest / "pi0_bundle.tar") in proc.stdout
    # Released again over itself: the same result.
    again = cli("dsa.tools.bundle_cli", "release", built, str(dest))
    assert again.returncode == 0, again.stderr


def test_release_refuses_a_corrupted_bundle(built_copy, tmp_path):
    flip_byte(built_copy, member_offset(built_copy, "params.irpa"))
    proc = cli("dsa.tools.bundle_cli", "release", built_copy, tmp_path / "dist")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "sha256" in proc.stderr
    assert not (tmp_path / "dist").exists()


# -- one writer, one reader -------------------------------------------------------------------------------

def test_a_single_model_bundle_is_write_bundle_of_one_unlinked_stage(tmp_path, built):
    """create_bundle is write_bundle of one stage without a link: the same bytes, members at the root."""
    inputs = built_inputs()
    stage = W.StageInput(name="pi0", manifest_source=inputs.pop("manifest_source", "manifests/pi0.yaml"), **inputs)
    out = tmp_path / "pi0_bundle.tar"
    W.write_bundle(out, [stage])
    assert out.read_bytes() == built.read_bytes()


def test_several_models_without_a_link_are_refused(tmp_path):
    inputs = built_inputs()
    stages = [W.StageInput(name=n, **inputs) for n in ("a", "b")]
    with pytest.raises(DsaError, match="2 models to bundle without a link"):
        W.write_bundle(tmp_path / "out.tar", stages)
    assert not (tmp_path / "out.tar").exists()


def test_the_reader_gives_a_single_model_bundle_as_one_stage(opened):
    (stage,) = opened.stages
    assert stage.name is None and stage.model_id == "pi0"
    assert stage.manifest_path == opened.manifest_path == opened.root / "manifest.yaml"
    assert stage.index_path == opened.index_path and stage.lock == opened.lock
    assert opened.stage_reports == [opened.build_report]
