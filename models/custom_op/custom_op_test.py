"""The custom-op example: the compiled module (the op's decomposition) matches eager PyTorch (the op's own
kernel), and the export really went through the decomposition (the record counts its ops, not the custom
op). Without the decomposition the same model is refused at export, naming the op and its module path.

Tolerance: |vmfb - eager| <= 1e-5 * max(1, max|eager|) (fp32 both sides, a 256-wide reduction ordered
differently; a wrong normalisation moves the output by O(0.1))."""

import copy

import numpy as np
import pytest
import torch

from dsa.core.errors import DsaError
from dsa.core.fileio import read_json
from dsa.manifest.contract import load_manifest, project
from dsa.runtime.policy import CompiledPolicy, sample_inputs
from dsa.stages.export import export_model
from dsa.stages.spec import ExportSpec
from dsa.tools.testing import eager_policy, runfile
from models.custom_op import custom_op

MANIFEST = runfile("manifests/custom_op.yaml")
INDEX = runfile("models/custom_op.modules.json")
CHECKPOINT = runfile("models/custom_op.safetensors")
RECORD = runfile("models/custom_op_model/export_record.json")
REL_TOL = 1e-5


def test_vmfb_of_the_decomposition_matches_the_eager_kernel():
    manifest = load_manifest(MANIFEST)
    policy = CompiledPolicy(INDEX)
    for seed in range(3):
        obs = sample_inputs(policy.modules[0].record, {}, np.random.default_rng(seed))
        (actions,), _ = policy.run(obs)
        eager, spec = eager_policy(project(manifest, "export"), {}, CHECKPOINT)
        with torch.no_grad():
            expected = eager(torch.from_numpy(obs["state"])).numpy()
        assert actions.shape == expected.shape == (1, manifest["chunk_size"], manifest["outputs"]["action"]["dim"])
        err = float(np.abs(actions - expected).max())
        assert err <= REL_TOL * max(1.0, float(np.abs(expected).max())), err


def test_the_export_applied_the_decomposition():
    ops = read_json(RECORD)["op_histogram"]
    assert not any("rms_norm" in op for op in ops), ops
    assert ops.get("aten::rsqrt") == 1, ops


def test_without_its_decomposition_the_op_is_refused_naming_op_and_module(tmp_path, monkeypatch):
    plain = custom_op.export_spec

    def without(view, dims):
        spec = plain(view, dims)
        return ExportSpec(module=spec.module, inputs=spec.inputs, outputs=spec.outputs)

    without.__module__ = custom_op.__name__  # the export calls only functions of the model's own module
    monkeypatch.setattr(custom_op, "export_spec", without)
    view = copy.deepcopy(project(load_manifest(MANIFEST), "export"))
    with pytest.raises(DsaError, match=r"unsupported op 'dsa_examples\.rms_norm' in module norm \(RmsNorm\)"):
        export_model(view, tmp_path / "m.mlir", tmp_path / "m.json")
    assert not (tmp_path / "m.mlir").exists()
