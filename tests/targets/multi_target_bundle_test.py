"""Multi-target bundles (docs/bundle-format.md, format 2): //models:pi0_fleet_bundle holds π0 for CUDA sm_87,
aarch64 (Orin), x86-64-v4 and x86-64-v3 with one parameter archive; `dsa run` runs the first target this
machine executes and gives that target's own actions; a bundle none of whose targets runs here is refused
naming each target and its driver."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from dsa.core.fileio import canonical_json, read_json, sha256_file
from dsa.core import tarfiles as T
from dsa.runtime import bundle as B
from dsa.stages import bundle as W
from dsa.tools.testing import runfile

FLEET = "models/pi0_fleet_bundle.tar"
DEVICES_ONLY = "tests/targets/pi0_devices_only_bundle.tar"
FLEET_MODULES = ["pi0_cuda-sm_87", "pi0_aarch64-orin", "pi0_x86_64-v4", "pi0"]
FLEET_TARGETS = ["cuda-sm_87", "aarch64-orin", "x86_64-v4", "x86_64-v3"]
PACKAGE_ROOT = Path(B.__file__).resolve().parents[2]


def cli(module: str, *args, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE_ROOT)] + [p for p in sys.path if p]))
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env)


def refused(proc, *fragments):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not re.search(r"^flow_steps=", proc.stdout, re.M)
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def first_actions(stdout: str):
    return re.findall(r"first action: (\[[^\]]*\])", stdout)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    return B.extract_bundle(runfile(FLEET), tmp_path_factory.mktemp("fleet"))


def test_one_parameter_archive_serves_every_target(fleet):
    assert fleet.meta["format"] == 2 and fleet.meta["kind"] == "multi-target"
    assert fleet.targets == FLEET_TARGETS  # the order the rule gave: the order `dsa run` prefers
    names = set(fleet.meta["files"])
    assert [n for n in names if n.endswith(".irpa")] == ["params.irpa"]
    assert {"manifest.yaml", "runtime_view.json"} <= names
    single = B.extract_bundle(runfile("models/pi0_bundle.tar"), fleet.root.parent / "single")
    assert fleet.meta["files"]["params.irpa"] == single.meta["files"]["params.irpa"]
    for table in fleet.meta["targets"]:
        target = table["target"]
        index = read_json(fleet.root / table["index_file"])
        assert index["target"] == target and index["parameter_archive"] == "params.irpa"
        assert all(m["vmfb"].startswith(target + ".") for m in index["modules"]) and len(index["modules"]) == 3
        assert read_json(fleet.root / table["lock"])["target"] == target
        assert read_json(fleet.root / table["target_spec"])["name"] == target
    drivers = {t["target"]: t["runtime_driver"] for t in fleet.meta["targets"]}
    assert drivers == {"cuda-sm_87": "cuda", "aarch64-orin": "local-task", "x86_64-v4": "local-task",
                       "x86_64-v3": "local-task"}
    # The x86-64-v3 modules are the very bytes of //models:pi0's (and its single-target bundle's).
    for m in ("prompt_len_0", "prompt_len_1", "prompt_len_2"):
        assert fleet.meta["files"][f"x86_64-v3.{m}.vmfb"] == single.meta["files"][f"{m}.vmfb"]


def test_bazel_bundle_equals_the_cli_bundle_from_runfiles(tmp_path):
    """Same bytes from the DsaBundle action and from `dsa bundle create --index ...` on the runfiles copies."""
    args = []
    for name in FLEET_MODULES:
        args += ["--index", runfile(f"models/{name}.modules.json")]
    out = tmp_path / "pi0_fleet_bundle.tar"
    proc = cli("dsa.tools.bundle_cli", "create", *args, "--manifest", runfile("manifests/pi0.yaml"),
               "--manifest-source", "manifests/pi0.yaml", "--out", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sha256_file(out) == sha256_file(runfile(FLEET))
    assert B.sidecar_path(out).read_text() == B.sidecar_path(runfile(FLEET)).read_text()


def _expected_target(fleet) -> str:
    reasons = fleet.why_not_here()
    runnable = [t for t, why in reasons.items() if why is None]
    if not runnable or runnable[0] not in ("x86_64-v4", "x86_64-v3"):
        pytest.skip(f"this machine runs {runnable or 'none'} of the fleet's targets first; the test compares "
                    "with the x86 builds")
    return runnable[0]


def test_run_picks_the_first_target_this_machine_runs_with_its_own_actions(fleet):
    expected = _expected_target(fleet)
    args = ["--prompt-len", "100", "--steps", "1", "10", "--repeats", "1"]
    proc = cli("dsa.runtime.run", "--bundle", runfile(FLEET), *args)
    assert proc.returncode == 0, proc.stderr
    assert f"target {expected} (the first of the bundle's targets this machine runs" in proc.stdout
    assert f"model pi0 on {expected} (local-task)" in proc.stdout
    # Each skipped target is named with why it cannot run here (the CUDA one: its driver).
    skipped = FLEET_TARGETS[:FLEET_TARGETS.index(expected)]
    line = next(l for l in proc.stdout.splitlines() if l.startswith(f"target {expected}"))
    assert all(f"; {t}: " in line for t in skipped) and "'cuda'" in line, line
    index = "models/pi0.modules.json" if expected == "x86_64-v3" else "models/pi0_x86_64-v4.modules.json"
    own = cli("dsa.runtime.run", "--index", runfile(index), "--target", expected, *args)
    assert own.returncode == 0, own.stderr
    assert first_actions(proc.stdout) == first_actions(own.stdout) and len(first_actions(own.stdout)) == 2


def test_target_flag_runs_that_target_and_refuses_one_the_bundle_lacks(fleet):
    proc = cli("dsa.runtime.run", "--bundle", runfile(FLEET), "--target", "x86_64-v3", "--steps", "1",
               "--repeats", "1")
    if fleet.why_not_here()["x86_64-v3"] is not None:
        pytest.skip("this machine does not run x86_64-v3 modules")
    assert proc.returncode == 0, proc.stderr
    assert "target x86_64-v3 (chosen with --target)" in proc.stdout
    refused(cli("dsa.runtime.run", "--bundle", runfile(FLEET), "--target", "riscv64-rvv", "--steps", "1"),
            "holds no modules for target 'riscv64-rvv'", "cuda-sm_87, aarch64-orin, x86_64-v4, x86_64-v3")
    # An index's --target chooses among its own build and its levels.
    refused(cli("dsa.runtime.run", "--index", runfile("models/pi0.modules.json"), "--target", "riscv64-rvv"),
            "has no build for target 'riscv64-rvv' (it has x86_64-v3, x86_64-v4, x86_64-v4-bf16)",
            "pass one of its targets")


def test_target_this_machine_cannot_run_is_refused_before_loading(fleet):
    why = fleet.why_not_here()["aarch64-orin"]
    if why is None:
        pytest.skip("this machine runs aarch64 modules")
    refused(cli("dsa.runtime.run", "--bundle", runfile(FLEET), "--target", "aarch64-orin", "--steps", "1"),
            "compiled for target 'aarch64-orin' and cannot run on this machine", why)


def test_bundle_with_no_target_for_this_machine_is_refused_naming_each_driver(tmp_path):
    opened = B.extract_bundle(runfile(DEVICES_ONLY), tmp_path / "x")
    reasons = opened.why_not_here()
    if any(why is None for why in reasons.values()):
        pytest.skip(f"this machine runs some of {sorted(reasons)}")
    proc = cli("dsa.runtime.run", "--bundle", runfile(DEVICES_ONLY), "--steps", "1")
    refused(proc, "pi0_devices_only_bundle.tar: has no module this machine can run",
            "cuda-sm_87 (driver cuda): it needs", "vulkan-rdna3 (driver vulkan): it needs",
            "aarch64-pi5 (driver local-task): its code is for aarch64", "dsa_bundle(modules = [...])")
    verify = cli("dsa.tools.bundle_cli", "verify", runfile(DEVICES_ONLY))
    assert verify.returncode == 0, verify.stderr
    assert "target cuda-sm_87 (cuda): not here: it needs the IREE runtime driver 'cuda'" in verify.stdout


def test_diff_compares_one_target_of_a_multi_target_bundle():
    same = cli("dsa.tools.diff", runfile(FLEET), runfile("models/pi0_bundle.tar"), "--target", "x86_64-v3")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "inputs changed: none" in same.stdout and "artifacts changed: none" in same.stdout
    other = cli("dsa.tools.diff", runfile(FLEET), runfile(DEVICES_ONLY), "--target", "cuda-sm_87")
    assert other.returncode == 0 and "artifacts changed: none" in other.stdout, other.stdout + other.stderr
    refused(cli("dsa.tools.diff", runfile(FLEET), runfile("models/pi0_bundle.tar")),
            "is a multi-target bundle (targets cuda-sm_87, aarch64-orin, x86_64-v4, x86_64-v3)", "--target NAME")
    refused(cli("dsa.tools.diff", runfile(FLEET), runfile("models/pi0_bundle.tar"), "--target", "x86_64-v4"),
            "pi0_bundle.tar: holds no modules for target 'x86_64-v4'")


def _repack(fleet, out: Path, edit) -> Path:
    """The fleet bundle's files re-archived with bundle.json (and members) edited by `edit(meta, files)`."""
    files = {p.name: p.read_bytes() for p in fleet.root.iterdir() if p.is_file()}
    meta = read_json(fleet.root / B.BUNDLE_JSON)
    edit(meta, files)
    files[B.BUNDLE_JSON] = canonical_json(meta).encode()
    with tarfile.open(out, "w", format=T.TAR_FORMAT) as tar:
        for name in sorted(files):
            tar.addfile(T.tarinfo(name, len(files[name])), io.BytesIO(files[name]))
    return out


def test_format_and_kind_must_agree(fleet, tmp_path):
    def as_format(n):
        return lambda meta, files: meta.update(format=n)

    with pytest.raises(B.DsaError, match="format 1 with kind 'multi-target'"):
        B.extract_bundle(_repack(fleet, tmp_path / "a.tar", as_format(1)), tmp_path / "a")
    with pytest.raises(B.DsaError, match="format 3 with kind 'multi-target'"):
        B.extract_bundle(_repack(fleet, tmp_path / "c.tar", as_format(3)), tmp_path / "c")
    with pytest.raises(B.DsaError, match=r"bundle format 4 is not supported: this reader reads formats 1, 2 and 3 "
                       r"\(a newer rules_dsa wrote it"):
        B.extract_bundle(_repack(fleet, tmp_path / "b.tar", as_format(4)), tmp_path / "b")


def test_target_index_naming_another_targets_module_is_refused(fleet, tmp_path):
    def swap(meta, files):  # x86_64-v3's index runs the aarch64 code; bundle.json rewritten to agree
        table = next(t for t in meta["targets"] if t["target"] == "x86_64-v3")
        table["index"]["modules"][0]["vmfb"] = "aarch64-orin.prompt_len_0.vmfb"
        files[table["index_file"]] = B.ModuleIndex.from_json(table["index"], "x").text().encode()
        entry = meta["files"][table["index_file"]]
        entry["size"] = len(files[table["index_file"]])
        import hashlib
        entry["sha256"] = hashlib.sha256(files[table["index_file"]]).hexdigest()

    with pytest.raises(B.DsaError, match=r"x86_64-v3.modules.json: module file 'aarch64-orin.prompt_len_0.vmfb' "
                       r"is not one of target x86_64-v3's files"):
        B.extract_bundle(_repack(fleet, tmp_path / "c.tar", swap), tmp_path / "c")


def test_writer_refuses_a_target_twice_and_a_single_target(tmp_path):
    inputs = W.inputs_from_index(runfile("models/pi0.modules.json"))
    stage = W.StageInput(name="", manifest=runfile("manifests/pi0.yaml"), **inputs)
    with pytest.raises(B.DsaError, match="target x86_64-v3 is given more than once"):
        W.write_multi_target_bundle(tmp_path / "twice.tar", [stage, stage])
    with pytest.raises(B.DsaError, match="1 target.* for a multi-target bundle"):
        W.write_multi_target_bundle(tmp_path / "one.tar", [stage])
    assert not list(tmp_path.iterdir())  # nothing half-written
