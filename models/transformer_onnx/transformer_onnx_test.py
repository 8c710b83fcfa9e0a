"""The transformer control brought as ONNX (framework onnx): the compiled modules (batch buckets 1 and 4) match
ONNX Runtime on the same .onnx file, the PyTorch-built control's vmfb and eager PyTorch; a weights-only change
reruns nothing but the parameter archive; the import records where every weight lies.

Tolerance: |a - b| <= 2e-4 * max(1, max|b|), as the PyTorch-built control's test (fp32 throughout; IREE, ONNX
Runtime and PyTorch each order the reductions of four 512-wide layers their own way: measured ~5e-5). A wrong
weight, mask or layout moves the output by O(1).
"""

import shutil

import numpy as np
import pytest
import torch

from dsa.core.fileio import read_json, sha256_file
from dsa.manifest.contract import load_manifest, project
from dsa.runtime.policy import CompiledPolicy, sample_inputs
from dsa.tools.testing import eager_policy, runfile

MANIFEST = runfile("manifests/transformer_onnx.yaml")
TORCH_MANIFEST = runfile("manifests/transformer.yaml")
ONNX = runfile("models/transformer_onnx/model.onnx")
DATA = runfile("models/transformer_onnx/model.onnx.data")
INDEX = runfile("models/transformer_onnx.modules.json")
TORCH_INDEX = runfile("models/transformer.modules.json")
CHECKPOINT = runfile("models/transformer.safetensors")
RECORD = runfile("models/transformer_onnx_model/export_record.json")
REL_TOL = 2e-4


def _close(got, want):
    err = float(np.abs(got - want).max())
    assert err <= REL_TOL * max(1.0, float(np.abs(want).max())), err


def _onnxruntime(obs, onnx=ONNX):
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: np.asarray(obs[i.name]) for i in session.get_inputs()})[0]


@pytest.fixture(scope="module")
def policy():
    return CompiledPolicy(INDEX)


def _observation(policy, batch, seed=7):
    obs = sample_inputs(policy.modules[0].record, {"batch": batch}, np.random.default_rng(seed))
    mask = np.ones_like(obs["prompt_mask"])
    mask[:, 100:] = 0
    obs["prompt_mask"] = mask
    return obs


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_compiled_onnx_matches_onnxruntime_eager_pytorch_and_the_pytorch_built_vmfb(policy, batch):
    """Batch 3 runs the 4-bucket, padded, and is cut back to 3 rows."""
    manifest = load_manifest(MANIFEST)
    obs = _observation(policy, batch)
    (actions,), _ = policy.run(obs)
    assert actions.shape == (batch, manifest["chunk_size"], manifest["outputs"]["action"]["dim"])
    _close(actions, _onnxruntime(obs))
    eager, spec = eager_policy(project(load_manifest(TORCH_MANIFEST), "export"), {}, CHECKPOINT)
    with torch.no_grad():
        expected = eager(*[torch.from_numpy(np.asarray(obs[s.name])) for s in spec.inputs]).numpy()
    _close(actions, expected)
    if batch == 1:  # the PyTorch-built control is static at batch 1
        (torch_built,), _ = CompiledPolicy(TORCH_INDEX).run(obs)
        _close(actions, torch_built)


def test_import_names_every_weight_by_its_place_in_the_external_data_file():
    record = read_json(RECORD)
    assert record["framework"] == "onnx"
    assert [i["name"] for i in record["inputs"]] == ["prompt_tokens", "prompt_mask", "state"]
    assert record["inputs"][0]["shape"] == ["batch", 128] and record["inputs"][0]["dims"] == {"0": "batch"}
    assert record["outputs"][0]["shape"] == ["batch", 16, 14]
    assert record["onnx"]["external_data"] == "model.onnx.data"
    size = DATA.stat().st_size
    for p in record["parameters"]:
        place = p["onnx"]
        assert not place.get("inline")
        assert 0 <= place["offset"] and place["offset"] + place["length"] <= size
        assert place["length"] == 4 * int(np.prod(p["shape"]))  # float32
    assert record["parameter_count"] == sum(int(np.prod(p["shape"])) for p in record["parameters"])
    assert record["op_histogram"]["onnx.MatMul"] >= 4 * 4  # q, k, v, o (and more) in each of the 4 blocks


def test_new_weights_change_only_the_parameter_archive(tmp_path):
    """The import reads the graph only: other weights in the external-data file give the same MLIR (so Bazel
    reruns no compile) and a parameter archive whose outputs are ONNX Runtime's on the new weights."""
    from dsa.stages.export import export_model
    from dsa.stages.params import build_params

    manifest = load_manifest(MANIFEST)
    onnx_copy = tmp_path / "model.onnx"
    shutil.copyfile(ONNX, onnx_copy)
    # Weights absent: the import still runs, from the graph alone.
    first = export_model(project(manifest, "export"), tmp_path / "a.mlir", tmp_path / "a.json", model_file=onnx_copy)
    assert first["mlir_sha256"] == read_json(RECORD)["mlir_sha256"]

    data = np.fromfile(DATA, dtype=np.uint8).copy().view(np.float32)
    data *= np.float32(0.5)  # every weight halved (LayerNorm, biases, projections)
    new_data = tmp_path / "model.onnx.data"
    data.view(np.uint8).tofile(new_data)
    params_view = dict(project(manifest, "params"))
    params_view["checkpoint"] = dict(params_view["checkpoint"], sha256=sha256_file(new_data))
    build_params(new_data, params_view, first, tmp_path / "params.irpa")

    second = export_model(project(manifest, "export"), tmp_path / "b.mlir", tmp_path / "b.json", model_file=onnx_copy)
    assert (tmp_path / "a.mlir").read_bytes() == (tmp_path / "b.mlir").read_bytes()

    import iree.runtime as rt

    policy = CompiledPolicy(INDEX)
    module = policy.modules[0]
    config = rt.Config(policy.driver)
    index = rt.ParameterIndex()
    index.load(str(tmp_path / "params.irpa"))
    params = rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope="model"))
    vm_module = rt.VmModule.copy_buffer(config.vm_instance, module.vmfb.read_bytes())
    context = rt.SystemContext(vm_modules=[params, vm_module], config=config)
    obs = _observation(policy, 1)
    got = context.modules.module["main"](*[obs[n] for n in ("prompt_tokens", "prompt_mask", "state")]).to_host()
    new_onnx = tmp_path / "model.onnx"  # beside the new data file: ONNX Runtime reads both
    want = _onnxruntime(obs, new_onnx)
    _close(got, want)
    assert float(np.abs(want - _onnxruntime(obs)).max()) > 1e-2  # the new weights do change the actions
    assert second["parameters"] == first["parameters"]
