"""The ExecuTorch Plan B of the transformer control (//models/transformer:transformer_pte): the XNNPACK program
matches eager PyTorch and the IREE-built control on full and padded prompts, its record says what XNNPACK
took, and its bundle (format 3) verifies, carries the provenance of every input and runs.

Tolerance: |pte - eager| <= 2e-4 * max(1, max|eager|), as the IREE-built control's (fp32; XNNPACK orders the
reductions its own way). A wrong weight or mask moves the output by O(1).
"""

import json
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch

from dsa.core.errors import DsaError
from dsa.core.fileio import read_json, sha256_file
from dsa.manifest.contract import load_manifest, project
from dsa.runtime.policy import CompiledPolicy, sample_inputs
from dsa.tools.executorch import PteProgram, open_program
from dsa.tools.testing import eager_policy, runfile

MANIFEST = runfile("manifests/transformer.yaml")
CHECKPOINT = runfile("models/transformer.safetensors")
PTE = runfile("models/transformer/transformer_pte.pte")
RECORD = runfile("models/transformer/transformer_pte.pte_record.json")
BUNDLE = runfile("models/transformer/transformer_pte_bundle.tar")
INDEX = runfile("models/transformer.modules.json")
REL_TOL = 2e-4


def _close(got, want):
    err = float(np.abs(got - want).max())
    assert err <= REL_TOL * max(1.0, float(np.abs(want).max())), err


@pytest.fixture(scope="module")
def program():
    return PteProgram(PTE, read_json(RECORD))


def _observations():
    obs = sample_inputs(CompiledPolicy(INDEX).modules[0].record, {}, np.random.default_rng(7))
    padded = dict(obs)
    mask = np.ones_like(obs["prompt_mask"])
    mask[:, 100:] = 0
    padded["prompt_mask"] = mask
    return obs, padded


def test_program_matches_eager_pytorch_and_the_iree_build_on_full_and_padded_prompts(program):
    eager, spec = eager_policy(project(load_manifest(MANIFEST), "export"), {}, CHECKPOINT)
    iree = CompiledPolicy(INDEX)
    outs = []
    for obs in _observations():
        (got,) = program.run(obs)
        with torch.no_grad():
            want = eager(*[torch.from_numpy(np.asarray(obs[s.name])) for s in spec.inputs]).numpy()
        _close(got, want)
        (compiled,), _ = iree.run(obs)
        _close(got, compiled)
        outs.append(got)
    assert float(np.abs(outs[0] - outs[1]).max()) > 1e-3  # the mask reaches the program's attention


def test_record_says_what_xnnpack_took_and_pins_every_input():
    record = read_json(RECORD)
    assert record["backend"] == "XnnpackBackend" and record["delegates"] >= 1
    assert record["delegated_ops"]["linear"] >= 4 * 4  # every block's projections and MLP run in XNNPACK
    assert record["pte_sha256"] == sha256_file(PTE)
    provenance = record["provenance"]
    assert provenance["manifest"]["sha256"] == sha256_file(MANIFEST)
    assert provenance["checkpoint"]["sha256"] == sha256_file(CHECKPOINT)
    assert "models/transformer/transformer.py" in provenance["model_sources"]
    assert "dsa/stages/pte.py" in provenance["tool_sources"]
    assert any(p.startswith("executorch==") for p in provenance["toolchain"]["installed"])


def test_bundle_verifies_runs_and_names_its_inputs_in_the_provenance(tmp_path):
    program = open_program(BUNDLE, tmp_path / "x")
    (got,) = program.run(_observations()[0])
    assert got.shape == (1, 16, 14)
    with tarfile.open(BUNDLE) as tar:
        meta = json.load(tar.extractfile("bundle.json"))
        statement = json.load(tar.extractfile("provenance.intoto.json"))
    assert meta["format"] == 3 and meta["kind"] == "executorch"
    assert {s["name"] for s in statement["subject"]} >= {"program.pte", "pte_record.json", "manifest.yaml"}
    roles = {d["annotations"]["role"] for d in statement["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert {"manifest", "checkpoint", "toolchain_lock", "model_source", "tool_source"} <= roles
    out = subprocess.run([sys.executable, "-m", "dsa", "bundle", "verify", str(BUNDLE)], capture_output=True, text=True)
    assert out.returncode == 0 and "ExecuTorch bundle (format 3)" in out.stdout, out.stderr


def test_tampered_program_and_iree_runner_are_refused(tmp_path):
    from dsa.runtime.bundle import extract_bundle

    with pytest.raises(DsaError, match="ExecuTorch bundle"):
        extract_bundle(BUNDLE, tmp_path / "iree")
    broken = tmp_path / "broken.tar"
    data = bytearray(BUNDLE.read_bytes())
    with tarfile.open(BUNDLE) as tar:
        offset = tar.getmember("program.pte").offset_data
    data[offset + 1000] ^= 0xFF
    broken.write_bytes(bytes(data))
    with pytest.raises(DsaError, match="program.pte: has sha256"):
        open_program(broken, tmp_path / "y")


def test_wrong_input_shape_is_refused_before_the_program_runs(program):
    obs = _observations()[0]
    obs["state"] = np.zeros((2, 14), np.float32)
    with pytest.raises(DsaError, match="the program takes \\[1, 14\\]"):
        program.run(obs)
