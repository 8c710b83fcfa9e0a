"""`dsa-diff`: names exactly the inputs and artifacts that differ between two bundles, and flags an artifact
that changed while nothing it is built from did."""

from __future__ import annotations

import json

import pytest

from bundle_testlib import cli, flip_byte, rebundle
from dsa.runtime import bundle as B
from dsa.stages.checkpoint import make_checkpoint
from dsa.tools.diff import diff_bundles, format_text
from dsa.core.fileio import canonical_json, read_json, sha256_file
from dsa.manifest.contract import dump_json, load_manifest, project
from dsa.stages.params import build_params
from dsa.tools.testing import runfile


@pytest.fixture(scope="module")
def checkpoint_bundle(opened, tmp_path_factory):
    """π0 rebuilt from another checkpoint (seed 1 instead of 0) through the same stage code as the build: the
    manifest pins the new checkpoint, DsaParams' function writes the parameter archive, the lock records
    both. Nothing else is touched: a params-only rebuild, as Bazel would do it."""
    tmp = tmp_path_factory.mktemp("checkpoint")
    manifest = load_manifest(opened.manifest_path)
    record = read_json(runfile("models/pi0_model/export_record.json"))

    # The method first: applied to bundle A's own inputs it reproduces A's params view and archive.
    dump_json(project(manifest, "params"), tmp / "params_view_a.json")
    assert sha256_file(tmp / "params_view_a.json") == opened.lock["views"]["params"]
    build_params(runfile("models/pi0.safetensors"), read_json(tmp / "params_view_a.json"), record,
                 tmp / "params_a.irpa")
    assert sha256_file(tmp / "params_a.irpa") == opened.meta["files"]["params.irpa"]["sha256"]

    checkpoint = tmp / "pi0_seed1.safetensors"
    make_checkpoint(project(manifest, "export"), checkpoint, seed=1)
    old_sha, new_sha = manifest["checkpoint"]["sha256"], sha256_file(checkpoint)
    assert old_sha != new_sha
    text = opened.manifest_path.read_text(encoding="utf-8")
    assert text.count(old_sha) == 1
    (tmp / "pi0.yaml").write_text(text.replace(old_sha, new_sha), encoding="utf-8")
    dump_json(project(load_manifest(tmp / "pi0.yaml"), "params"), tmp / "params_view_b.json")
    build_params(checkpoint, read_json(tmp / "params_view_b.json"), record, tmp / "params_b.irpa")

    def relock(lock):
        lock["checkpoint"]["sha256"] = new_sha
        lock["views"]["params"] = sha256_file(tmp / "params_view_b.json")

    return rebundle(opened, tmp / "pi0_bundle.tar", lock_edit=relock, files={
        "manifest.yaml": (tmp / "pi0.yaml").read_bytes(),
        "params.irpa": (tmp / "params_b.irpa").read_bytes(),
    })


@pytest.fixture(scope="module")
def nondeterministic_bundle(opened, tmp_path_factory):
    """The same inputs, but prompt_len_1.vmfb came out different (as from a non-deterministic compiler); its
    compile report and the lock record the different output faithfully."""
    tmp = tmp_path_factory.mktemp("nondeterministic")
    vmfb = tmp / "prompt_len_1.vmfb"
    vmfb.write_bytes((opened.root / "prompt_len_1.vmfb").read_bytes())
    flip_byte(vmfb, 5000)
    report = read_json(opened.root / "prompt_len_1.compile_report.json")
    report["vmfb_sha256"] = sha256_file(vmfb)
    return rebundle(opened, tmp / "pi0_bundle.tar", files={
        "prompt_len_1.vmfb": vmfb.read_bytes(),
        "prompt_len_1.compile_report.json": canonical_json(report).encode(),
    })


def _diff(a, b):
    with B.open_bundle(a) as x, B.open_bundle(b) as y:
        return diff_bundles(x, y)


def test_checkpoint_only_names_the_checkpoint_and_params_irpa(built, checkpoint_bundle):
    result = _diff(built, checkpoint_bundle)
    assert sorted(result["inputs"]) == ["checkpoint"]
    assert sorted(result["artifacts"]) == ["params.irpa"]
    assert result["suspicious"] == []
    checkpoint = result["inputs"]["checkpoint"]
    assert checkpoint["a"] == read_json(runfile("models/pi0.lock.json"))["checkpoint"]["sha256"]
    assert list(checkpoint["manifest_fields"]) == ["checkpoint.sha256"]
    # Derived: only the params view moved (JSON only).
    assert result["intermediates"] == {"views": {"changed": {"params": result["intermediates"]["views"]["changed"]["params"]}}}

    proc = cli("dsa.tools.diff", built, checkpoint_bundle)
    assert proc.returncode == 0, proc.stderr
    changed = [line.strip().split(":")[0] for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert changed == ["checkpoint", "params.irpa"], proc.stdout
    assert "manifest pin checkpoint.sha256 follows it" in proc.stdout
    assert "SUSPICIOUS" not in proc.stdout


def test_checkpoint_diff_as_json(built, checkpoint_bundle):
    proc = cli("dsa.tools.diff", "--json", built, checkpoint_bundle)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert sorted(result["inputs"]) == ["checkpoint"] and sorted(result["artifacts"]) == ["params.irpa"]
    assert result["artifacts"]["params.irpa"]["sha256"]["b"] == sha256_file(
        checkpoint_bundle.parent / "pi0_bundle.tar.files" / "params.irpa")
    assert result["format"] == 1 and result["identical"] is False


def test_artifact_changed_with_no_input_is_suspicious(built, nondeterministic_bundle):
    result = _diff(built, nondeterministic_bundle)
    assert result["inputs"] == {}
    assert sorted(result["artifacts"]) == ["prompt_len_1.compile_report.json", "prompt_len_1.vmfb"]
    assert len(result["suspicious"]) == 1 and "while no input did" in result["suspicious"][0]
    proc = cli("dsa.tools.diff", built, nondeterministic_bundle)
    assert proc.returncode == 1, proc.stderr
    assert "inputs changed: none" in proc.stdout
    assert "SUSPICIOUS: prompt_len_1.compile_report.json, prompt_len_1.vmfb changed while no input did" in proc.stdout


def test_vmfb_changed_with_unrelated_input_change_is_still_suspicious(opened, tmp_path):
    """A runtime-only manifest field changed, and a vmfb too: the field cannot explain the vmfb."""
    manifest = opened.manifest_path.read_text(encoding="utf-8")
    assert manifest.count("power_profile: balanced") == 1
    (tmp_path / "m.yaml").write_text(manifest.replace("power_profile: balanced", "power_profile: performance"))
    dump_json(project(load_manifest(tmp_path / "m.yaml"), "runtime"), tmp_path / "runtime_view.json")
    vmfb = bytearray((opened.root / "prompt_len_2.vmfb").read_bytes())
    vmfb[777] ^= 1
    other = rebundle(opened, tmp_path / "pi0_bundle.tar", files={
        "manifest.yaml": (tmp_path / "m.yaml").read_bytes(),
        "runtime_view.json": (tmp_path / "runtime_view.json").read_bytes(),
        "prompt_len_2.vmfb": bytes(vmfb),
    })
    result = _diff(opened.archive, other)
    assert result["inputs"]["manifest"]["fields"] == {"power_profile": {"a": "balanced", "b": "performance"}}
    assert sorted(result["artifacts"]) == ["prompt_len_2.vmfb", "runtime_view.json"]
    assert result["suspicious"] == ["prompt_len_2.vmfb changed although its MLIR, compile flags, target spec and "
                                    "toolchain did not: the compile is not reproducible"]


def test_manifest_fields_sources_toolchain_and_flags_are_named(opened, tmp_path):
    """A runtime field and list-of-mapping field, a model source, a package version and a flag, all at once
    (lock edits only; the diff reads what the locks and manifests say)."""
    manifest = opened.manifest_path.read_text(encoding="utf-8")
    manifest = manifest.replace("flow_steps: 10", "flow_steps: 12").replace("- name: wrist_rgb", "- name: wrist_cam")
    (tmp_path / "m.yaml").write_text(manifest)

    # A real compile flag the build does not already pass (the tuned flags change as tuning is re-measured).
    added = next(f for f in ("--iree-llvmcpu-reassociate-fp-reductions", "--iree-opt-level=O2",
                             "--iree-llvmcpu-enable-ukernels=none") if f not in opened.lock["modules"][0]["flags"])

    def relock(lock):
        lock["model_sources"]["models/pi0/pi0.py"] = "0" * 64
        lock["model_sources"]["models/pi0/extra.py"] = "1" * 64
        lock["toolchain"]["installed"] = [p if not p.startswith("numpy==") else "numpy==9.9.9"
                                          for p in lock["toolchain"]["installed"]]
        lock["modules"][0]["flags"] = lock["modules"][0]["flags"] + [added]

    other = rebundle(opened, tmp_path / "pi0_bundle.tar", lock_edit=relock,
                     files={"manifest.yaml": (tmp_path / "m.yaml").read_bytes()})
    result = _diff(opened.archive, other)
    inputs = result["inputs"]
    assert sorted(inputs) == ["flags", "manifest", "model_sources", "toolchain"]
    assert inputs["manifest"]["fields"] == {"flow_steps": {"a": 10, "b": 12},
                                            "inputs.cameras[1].name": {"a": "wrist_rgb", "b": "wrist_cam"}}
    assert inputs["model_sources"] == {"added": {"models/pi0/extra.py": "1" * 64},
                                       "changed": {"models/pi0/pi0.py": {
                                           "a": opened.lock["model_sources"]["models/pi0/pi0.py"], "b": "0" * 64}}}
    assert inputs["toolchain"]["packages"]["changed"]["numpy"]["b"] == "9.9.9"
    assert inputs["flags"] == {"prompt_len_0": {"a": opened.lock["modules"][0]["flags"],
                                                "b": opened.lock["modules"][0]["flags"] + [added],
                                                "added": [added]}}
    assert result["artifacts"] == {} and result["suspicious"] == []
    text = format_text(result)
    for line in ("manifest field flow_steps: 10 -> 12", "manifest field inputs.cameras[1].name: wrist_rgb -> wrist_cam",
                 "model source models/pi0/pi0.py: changed", "model source models/pi0/extra.py: added",
                 "toolchain package numpy:", f"compile flags of prompt_len_0: added {added}",
                 "artifacts changed: none"):
        assert line in text, text


def test_identical_bundles(built):
    proc = cli("dsa.tools.diff", built, built)
    assert proc.returncode == 0 and "identical" in proc.stdout


def test_unreadable_bundle_exits_2(built, built_copy):
    flip_byte(built_copy, 9000)
    proc = cli("dsa.tools.diff", built, built_copy)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "dsa diff: error:" in proc.stderr
