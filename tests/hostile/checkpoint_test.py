"""Hostile checkpoints through `dsa compile` (exit 2, one line, no traceback, under a time and memory limit):
paths that leave the manifest's directory, files that are not regular files (a directory, a FIFO, a device
behind a symlink), weights holding NaN or Inf, files that are not safetensors (refused before
the export). Each refusal names the field
or tensor; nothing is left in --out. The opt-in (`checkpoint.allow_nonfinite: true`) packs NaN weights."""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from hostile_lib import cli, refused  # noqa: E402
from dsa.core.fileio import sha256_file  # noqa: E402
from dsa.tools.testing import runfile  # noqa: E402

MANIFEST = runfile("manifests/custom_op.yaml")
CHECKPOINT = runfile("models/custom_op.safetensors")


def _manifest(directory: Path, path: str, sha256: str = "0" * 64, **checkpoint) -> Path:
    data = yaml.safe_load(MANIFEST.read_text())
    data["checkpoint"] = {"path": path, "sha256": sha256, **checkpoint}
    out = directory / "policy.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def _compile(tmp_path: Path, manifest: Path):
    proc = cli("dsa", "compile", "--manifest", manifest, "--out", tmp_path / "out",
               "--pythonpath", runfile(".").resolve(), cwd=tmp_path)
    return proc


def _weights(tmp_path: Path, spoil=None) -> Path:
    from safetensors.numpy import load_file

    tensors = load_file(str(CHECKPOINT))
    if spoil:
        spoil(tensors)
    path = tmp_path / "policy" / "weights.safetensors"
    path.parent.mkdir(exist_ok=True)
    save_file(tensors, str(path))
    return path


@pytest.fixture
def policy_dir(tmp_path):
    directory = tmp_path / "policy"
    directory.mkdir()
    return directory


@pytest.mark.parametrize("path", ["../outside.safetensors", "sub/../../outside.safetensors", "/etc/passwd"])
def test_a_checkpoint_path_leaving_the_manifest_directory_is_refused_unread(tmp_path, policy_dir, path):
    (tmp_path / "outside.safetensors").write_bytes(CHECKPOINT.read_bytes())
    line = refused(_compile(tmp_path, _manifest(policy_dir, path)), f"checkpoint.path: '{path}' leaves the "
                                                                    "manifest's directory")
    assert "sha256" not in line  # nothing was read, so no digest was printed
    assert not (tmp_path / "out").exists()


def _directory(policy_dir):
    (policy_dir / "weights.safetensors").mkdir()


def _fifo(policy_dir):
    os.mkfifo(policy_dir / "weights.safetensors")  # opening it would block until a writer comes


def _device(policy_dir):
    (policy_dir / "weights.safetensors").symlink_to("/dev/zero")  # reading it never ends


@pytest.mark.parametrize("make, needle", [
    (_directory, "is not a regular file"),
    (_fifo, "is not a regular file"),
    (_device, "is a symlink to /dev/zero, outside the manifest's directory"),  # refused before it is opened
], ids=["directory", "fifo", "device"])
def test_a_checkpoint_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, policy_dir, make, needle):
    make(policy_dir)
    refused(_compile(tmp_path, _manifest(policy_dir, "weights.safetensors")), needle)
    assert not (tmp_path / "out").exists()


def _link_to_outside_file(tmp_path, policy_dir):
    (tmp_path / "elsewhere.safetensors").write_bytes(CHECKPOINT.read_bytes())
    (policy_dir / "weights.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    return "weights.safetensors"


def _link_to_outside_directory(tmp_path, policy_dir):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "weights.safetensors").write_bytes(CHECKPOINT.read_bytes())
    (policy_dir / "store").symlink_to(tmp_path / "store", target_is_directory=True)
    return "store/weights.safetensors"


@pytest.mark.parametrize("make", [_link_to_outside_file, _link_to_outside_directory], ids=["file", "directory"])
def test_a_symlink_beside_the_manifest_cannot_reach_a_checkpoint_outside_its_directory(tmp_path, policy_dir, make):
    """The path's text stays inside the manifest's directory, its target does not: refused after resolving the
    link, before the file is read (the pinned digest is the real one, so only the link is wrong)."""
    relative = make(tmp_path, policy_dir)
    line = refused(_compile(tmp_path, _manifest(policy_dir, relative, sha256_file(CHECKPOINT))),
                   "outside the manifest's directory")
    assert "checkpoint.path" in line and "--checkpoint FILE" in line
    assert not (tmp_path / "out").exists()


def test_a_symlink_that_stays_inside_the_manifest_directory_is_followed(tmp_path, policy_dir):
    (policy_dir / "v1.safetensors").write_bytes(CHECKPOINT.read_bytes())
    (policy_dir / "weights.safetensors").symlink_to("v1.safetensors")
    proc = _compile(tmp_path, _manifest(policy_dir, "weights.safetensors", sha256_file(CHECKPOINT)))
    assert proc.returncode == 0, proc.stderr[-2000:]


def _nan(tensors):
    tensors["norm.weight"][3] = np.nan


def _inf(tensors):
    tensors["action_out.weight"][:2, :2] = -np.inf


@pytest.mark.parametrize("spoil,tensor,count", [(_nan, "norm.weight", "1 NaN or infinite value:"),
                                                (_inf, "action_out.weight", "4 NaN or infinite values")],
                         ids=["nan", "inf"])
def test_nonfinite_weights_are_refused_naming_the_tensor(tmp_path, policy_dir, spoil, tensor, count):
    weights = _weights(tmp_path, spoil)
    line = refused(_compile(tmp_path, _manifest(policy_dir, weights.name, sha256_file(weights))),
                   f"tensor '{tensor}': holds {count}")
    assert "checkpoint.allow_nonfinite" in line
    assert not (tmp_path / "out").exists()


def test_nonfinite_weights_are_packed_when_the_manifest_opts_in(tmp_path, policy_dir):
    # Also the control of this file: the same harness, manifest and checkpoint compile when nothing is wrong.
    weights = _weights(tmp_path, _nan)
    proc = _compile(tmp_path, _manifest(policy_dir, weights.name, sha256_file(weights), allow_nonfinite=True))
    assert proc.returncode == 0, proc.stderr[-2000:]


def _garbage(policy_dir):
    (policy_dir / "weights.safetensors").write_bytes(b"not a safetensors file at all" * 10)


def _huge_header(policy_dir):
    # A header length of 2^60 bytes: a reader that believed it would allocate exabytes.
    (policy_dir / "weights.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"{}")


def _truncated(policy_dir):
    (policy_dir / "weights.safetensors").write_bytes(CHECKPOINT.read_bytes()[:5000])


@pytest.mark.parametrize("make", [_garbage, _huge_header, _truncated], ids=["garbage", "huge_header", "truncated"])
def test_a_file_that_is_not_a_safetensors_checkpoint_is_refused(tmp_path, policy_dir, make):
    make(policy_dir)
    weights = policy_dir / "weights.safetensors"
    proc = _compile(tmp_path, _manifest(policy_dir, weights.name, sha256_file(weights)))
    line = refused(proc, "weights.safetensors: not a readable safetensors file")
    assert "dsa compile: export:" not in proc.stderr  # refused before the export, which takes seconds
    assert not (tmp_path / "out").exists()
