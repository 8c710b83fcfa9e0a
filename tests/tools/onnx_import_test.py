"""The ONNX import (framework onnx, dsa.stages.onnx_import) on small graphs made with onnx.helper: an op IREE
cannot import or lower is refused naming the op and its node (a custom-domain op before the import, where IREE
would blame the node after it; a standard op IREE has no lowering for from IREE's own diagnostic), and a graph
whose inputs are not the manifest's is refused naming the manifest field."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper, save

from dsa.core.errors import DsaError
from dsa.core.fileio import sha256_file
from dsa.stages.onnx_import import export_onnx


def _graph(tmp_path, op, domain="", state_dim=14):
    """state [1, S] → MatMul → `op` → Reshape → action [1, 16, 14]."""
    state = helper.make_tensor_value_info("state", TensorProto.FLOAT, [1, state_dim])
    action = helper.make_tensor_value_info("action", TensorProto.FLOAT, [1, 16, 14])
    weight = numpy_helper.from_array(np.full((state_dim, 224), 0.1, np.float32), "proj.weight")
    shape = numpy_helper.from_array(np.array([1, 16, 14], np.int64), "shape")
    nodes = [helper.make_node("MatMul", ["state", "proj.weight"], ["h"], name="proj"),
             helper.make_node(op, ["h"], ["u"], name="squash", domain=domain),
             helper.make_node("Reshape", ["u", "shape"], ["action"], name="to_chunk")]
    opsets = [helper.make_opsetid("", 21)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(helper.make_graph(nodes, "policy", [state], [action], initializer=[weight, shape]),
                              opset_imports=opsets)
    path = tmp_path / "model.onnx"
    save(model, str(path))
    return path


def _view(path, state_dim=14):
    return {"model_id": "onnx_policy", "model": {"file": {"path": "model.onnx", "sha256": sha256_file(path)}},
            "inputs": {"state": {"dim": state_dim}, "cameras": []}, "outputs": {"action": {"dim": 14}},
            "chunk_size": 16, "bucket_dims": [], "quant_scheme": {"kind": "none"}}


def test_a_graph_of_lowerable_ops_imports_with_its_weight_as_a_parameter(tmp_path):
    path = _graph(tmp_path, "Tanh")
    mlir, record = export_onnx(_view(path), path, manifest_name="policy.yaml")
    assert [p["onnx"]["initializer"] for p in record["parameters"]] == ["proj.weight"]
    assert [i["name"] for i in record["inputs"]] == ["state"]
    assert "flow.parameter.named" in mlir or "util.global" in mlir


def test_a_custom_domain_op_is_refused_naming_op_and_node(tmp_path):
    path = _graph(tmp_path, "Frobnicate", domain="com.acme")
    with pytest.raises(DsaError) as e:
        export_onnx(_view(path), path, manifest_name="policy.yaml")
    message = str(e.value)
    assert "ONNX op 'com.acme.Frobnicate' (node 'squash') is not in the standard ONNX operator sets" in message
    assert "to_chunk" not in message and "docs/frontends.md" in message
    assert e.value.where == f"policy.yaml: model.file ({path})"


def test_a_standard_op_iree_cannot_lower_is_refused_naming_op_and_node(tmp_path):
    # Softsign (opset 21) has no lowering in IREE 3.13's ONNX conversion.
    path = _graph(tmp_path, "Softsign")
    with pytest.raises(DsaError) as e:
        export_onnx(_view(path), path, manifest_name="policy.yaml")
    message = str(e.value)
    assert "IREE cannot lower ONNX op 'Softsign' (node 'squash')" in message
    assert "failed to legalize" in message


def test_inputs_that_are_not_the_manifests_are_refused_naming_the_field(tmp_path):
    path = _graph(tmp_path, "Tanh", state_dim=10)
    with pytest.raises(DsaError) as e:
        export_onnx(_view(path, state_dim=14), path, manifest_name="policy.yaml")
    assert e.value.where == "policy.yaml: inputs.state.dim"
    assert "input 'state' of" in str(e.value) and "has shape [1, 10], but the manifest declares [14]" in str(e.value)


def test_a_quant_scheme_is_refused_for_an_imported_graph(tmp_path):
    path = _graph(tmp_path, "Tanh")
    view = dict(_view(path), quant_scheme={"kind": "int8"})
    with pytest.raises(DsaError) as e:
        export_onnx(view, path, manifest_name="policy.yaml")
    assert e.value.where == "policy.yaml: quant_scheme" and "set quant_scheme kind: none" in str(e.value)


def test_inline_weights_are_read_from_the_onnx_file_and_the_module_matches_onnxruntime(tmp_path):
    """An ONNX file without external data: the .onnx itself is the checkpoint; DsaParams reads each
    initializer where the file holds it, and the compiled module equals ONNX Runtime on the same file."""
    import iree.runtime as rt
    import onnxruntime as ort

    from dsa.core.formats import RECORD_FORMAT
    from dsa.stages.compile import compile_flags, run_iree_compile
    from dsa.stages.params import build_params

    path = _graph(tmp_path, "Tanh")
    mlir, record = export_onnx(_view(path), path, manifest_name="policy.yaml")
    (tmp_path / "model.mlir").write_text(mlir, encoding="utf-8")
    target = {"name": "x86_64-v3", "device": "local", "backends": ["llvm-cpu"], "runtime_driver": "local-task",
              "flags": ["--iree-hal-local-target-device-backends=llvm-cpu",
                        "--iree-llvmcpu-target-triple=x86_64-unknown-linux-gnu",
                        "--iree-llvmcpu-target-cpu=x86-64-v3"]}
    flags = compile_flags({"model_id": "onnx_policy", "quant_scheme": {"kind": "none"}, "target": "x86_64-v3",
                           "input_type": "onnx"}, target, "compile")
    vmfb = tmp_path / "model.vmfb"
    run_iree_compile(tmp_path / "model.mlir", flags + ["--mlir-disable-threading"], vmfb, "compile")
    params_view = {"model_id": "onnx_policy", "checkpoint": {"path": "model.onnx", "sha256": sha256_file(path)},
                   "quant_scheme": {"kind": "none"}}
    irpa = tmp_path / "params.irpa"
    build_params(path, params_view, dict(record, format=RECORD_FORMAT), irpa, manifest_name="policy.yaml")

    state = np.random.default_rng(3).standard_normal((1, 14)).astype(np.float32)
    config = rt.Config("local-sync")
    index = rt.ParameterIndex()
    index.load(str(irpa))
    params = rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope=record["parameter_scope"]))
    module = rt.VmModule.copy_buffer(config.vm_instance, vmfb.read_bytes())
    context = rt.SystemContext(vm_modules=[params, module], config=config)
    got = np.asarray(getattr(context.modules[module.name], record["function"])(state))
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"state": state})[0]
    assert got.shape == (1, 16, 14)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
