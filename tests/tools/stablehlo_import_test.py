"""The StableHLO import (framework stablehlo, dsa.stages.stablehlo_import), without JAX: the fixtures are small
StableHLO texts in the form jax.export writes them (`module @jit_apply`, argument locations at pytree paths,
`jax.result_info`, a private helper function). The wrapped module compiles with the compile stage's flags, runs
with weights from a parameter archive built by DsaParams, and matches numpy; bad modules are refused with a
message naming the field, argument or op at fault."""

import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from dsa.core.errors import DsaError
from dsa.core.fileio import sha256_bytes, sha256_file
from dsa.core.formats import RECORD_FORMAT
from dsa.stages.compile import compile_flags, run_iree_compile
from dsa.stages.params import build_params
from dsa.stages.stablehlo_import import export_stablehlo, parse_path

# tanh(obs @ w + b), params = {"head": {"b": f32[4], "w": f32[16, 4]}}, obs = f32[2, 16]: what
# jax.export.export(jax.jit(apply))(params_spec, obs_spec).mlir_module() writes for it (the tanh in a jitted
# helper, as JAX emits `@relu`).
MLP = """#loc1 = loc("params['head']['b']")
#loc2 = loc("params['head']['w']")
#loc3 = loc("obs")
module @jit_apply attributes {jax.uses_shape_polymorphism = false, mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<4xf32> loc("params['head']['b']"), %arg1: tensor<16x4xf32> loc("params['head']['w']"), %arg2: tensor<2x16xf32> loc("obs")) -> (tensor<2x4xf32> {jax.result_info = "result"}) {
    %0 = stablehlo.dot_general %arg2, %arg1, contracting_dims = [1] x [0] : (tensor<2x16xf32>, tensor<16x4xf32>) -> tensor<2x4xf32> loc(#loc5)
    %1 = stablehlo.broadcast_in_dim %arg0, dims = [1] : (tensor<4xf32>) -> tensor<1x4xf32> loc(#loc6)
    %2 = stablehlo.broadcast_in_dim %1, dims = [0, 1] : (tensor<1x4xf32>) -> tensor<2x4xf32> loc(#loc7)
    %3 = stablehlo.add %0, %2 : tensor<2x4xf32> loc(#loc7)
    %4 = call @squash(%3) : (tensor<2x4xf32>) -> tensor<2x4xf32> loc(#loc8)
    return %4 : tensor<2x4xf32> loc(#loc4)
  } loc(#loc)
  func.func private @squash(%arg0: tensor<2x4xf32> loc(unknown)) -> tensor<2x4xf32> {
    %0 = stablehlo.tanh %arg0 : tensor<2x4xf32> loc(#loc10)
    return %0 : tensor<2x4xf32> loc(#loc)
  } loc(#loc11)
} loc(#loc)
#loc = loc(unknown)
#loc4 = loc("jit(apply)")
#loc5 = loc("jit(apply)/dot_general")
#loc6 = loc("jit(apply)/broadcast_in_dim")
#loc7 = loc("jit(apply)/add")
#loc8 = loc("jit(apply)/jit(squash)")
#loc9 = loc("jit")
#loc10 = loc("tanh")
#loc11 = loc("jit:"(#loc9))
"""

# A symbolic batch (jax.export with shape polymorphism): main's observation is tensor<?x4xf32>.
DYNAMIC = """#loc1 = loc("params['head']['b']")
#loc2 = loc("obs")
module @jit_apply attributes {jax.uses_shape_polymorphism = true, mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<4xf32> loc("params['head']['b']"), %arg1: tensor<?x4xf32> loc("obs")) -> (tensor<?x4xf32> {jax.result_info = "result"}) {
    %0 = stablehlo.tanh %arg1 : tensor<?x4xf32> loc(#loc3)
    return %0 : tensor<?x4xf32> loc(#loc)
  } loc(#loc)
} loc(#loc)
#loc = loc(unknown)
#loc3 = loc("jit(apply)/tanh")
"""

# jnp.linalg.eig-like: a custom_call to a LAPACK kernel, which IREE cannot lower.
CUSTOM_CALL = """#loc1 = loc("params['head']['b']")
#loc2 = loc("obs")
module @jit_apply attributes {jax.uses_shape_polymorphism = false, mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<4xf32> loc("params['head']['b']"), %arg1: tensor<2x4xf32> loc("obs")) -> (tensor<2x4xf32> {jax.result_info = "result"}) {
    %0 = stablehlo.custom_call @lapack_sgeev_ffi(%arg1) {mhlo.backend_config = {}, operand_layouts = [dense<[1, 0]> : tensor<2xindex>], result_layouts = [dense<[1, 0]> : tensor<2xindex>]} : (tensor<2x4xf32>) -> tensor<2x4xf32> loc(#loc3)
    %1 = stablehlo.broadcast_in_dim %arg0, dims = [1] : (tensor<4xf32>) -> tensor<2x4xf32> loc(#loc4)
    %2 = stablehlo.add %0, %1 : tensor<2x4xf32> loc(#loc5)
    return %2 : tensor<2x4xf32> loc(#loc6)
  } loc(#loc)
} loc(#loc)
#loc = loc(unknown)
#loc3 = loc("jit(apply)/eig")
#loc4 = loc("jit(apply)/broadcast_in_dim")
#loc5 = loc("jit(apply)/add")
#loc6 = loc("jit(apply)")
"""

# The flags of toolchains/targets/x86_64-v3.json (llvm-cpu, x86-64-v3).
TARGET = {
    "name": "x86_64-v3",
    "device": "local",
    "backends": ["llvm-cpu"],
    "runtime_driver": "local-task",
    "flags": ["--iree-hal-local-target-device-backends=llvm-cpu",
              "--iree-llvmcpu-target-triple=x86_64-unknown-linux-gnu",
              "--iree-llvmcpu-target-cpu=x86-64-v3"],
}


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def _view(model_file, chunk_size=2, action_dim=4, bucket_dims=()):
    return {
        "model_id": "jax_mlp",
        "framework": "stablehlo",
        "model": {"file": {"path": "model.stablehlo.mlir", "sha256": sha256_file(model_file)}},
        "inputs": {},
        "outputs": {"action": {"dim": action_dim}},
        "chunk_size": chunk_size,
        "bucket_dims": list(bucket_dims),
        "quant_scheme": {"kind": "none"},
    }


def _weights(seed):
    rng = np.random.default_rng(seed)
    return {"head.b": rng.standard_normal(4).astype(np.float32),
            "head.w": rng.standard_normal((16, 4)).astype(np.float32)}


def _reference(weights, obs):
    return np.tanh(obs.astype(np.float64) @ weights["head.w"] + weights["head.b"])


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    out = tmp_path_factory.mktemp("stablehlo")
    model_file = _write(out / "model.stablehlo.mlir", MLP)
    view = _view(model_file)
    mlir, record = export_stablehlo(view, model_file, manifest_name="jax_mlp.yaml")
    return out, model_file, view, mlir, record


@pytest.fixture(scope="module")
def vmfb(mlp):
    out, _, _, mlir, record = mlp
    mlir_path = _write(out / "wrapped.mlir", mlir)
    view = {"model_id": record["model_id"], "quant_scheme": {"kind": "none"}, "target": TARGET["name"],
            "input_type": "stablehlo"}
    flags = compile_flags(view, TARGET, "compile")
    assert "--iree-input-type=stablehlo" in flags
    path = out / "model.vmfb"
    run_iree_compile(mlir_path, flags + ["--mlir-disable-threading"], path, "compile")
    return path


def _archive(out, name, weights, record):
    checkpoint = out / f"{name}.safetensors"
    save_file(weights, str(checkpoint))
    view = {"model_id": record["model_id"], "checkpoint": {"path": checkpoint.name, "sha256": sha256_file(checkpoint)},
            "quant_scheme": {"kind": "none"}}
    irpa = out / f"{name}.irpa"
    build_params(checkpoint, view, dict(record, format=RECORD_FORMAT), irpa, manifest_name="jax_mlp.yaml")
    return irpa


def _run(vmfb_path, irpa, record, obs):
    import iree.runtime as rt

    config = rt.Config("local-sync")
    index = rt.ParameterIndex()
    index.load(str(irpa))
    params = rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope=record["parameter_scope"]))
    module = rt.VmModule.copy_buffer(config.vm_instance, vmfb_path.read_bytes())
    # Without JAX's module name (`jit_apply`) the vmfb's module is `module`, as for the other frameworks.
    assert module.name == "module"
    context = rt.SystemContext(vm_modules=[params, module], config=config)
    return np.asarray(getattr(context.modules[module.name], record["function"])(obs))


def test_wrapper_compiles_and_runs_like_numpy(mlp, vmfb):
    out, _, _, _, record = mlp
    weights = _weights(0)
    obs = np.random.default_rng(7).standard_normal((2, 16)).astype(np.float32)
    got = _run(vmfb, _archive(out, "a", weights, record), record, obs)
    assert got.shape == (2, 4) and got.dtype == np.float32
    np.testing.assert_allclose(got, _reference(weights, obs), rtol=0, atol=1e-5)


def test_two_weight_sets_give_their_own_results_with_the_same_vmfb(mlp, vmfb):
    out, _, _, _, record = mlp
    obs = np.random.default_rng(8).standard_normal((2, 16)).astype(np.float32)
    first, second = _weights(1), _weights(2)
    got_first = _run(vmfb, _archive(out, "first", first, record), record, obs)
    got_second = _run(vmfb, _archive(out, "second", second, record), record, obs)
    np.testing.assert_allclose(got_first, _reference(first, obs), rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_second, _reference(second, obs), rtol=0, atol=1e-5)
    assert np.abs(got_first - got_second).max() > 1e-2


def test_import_is_byte_identical_and_has_no_locations(mlp, tmp_path):
    _, model_file, view, mlir, record = mlp
    # Another copy of the file elsewhere: nothing of its path reaches the MLIR.
    elsewhere = tmp_path / "deeper" / "copy.mlir"
    elsewhere.parent.mkdir()
    shutil.copy(model_file, elsewhere)
    again, record_again = export_stablehlo(view, elsewhere, manifest_name="jax_mlp.yaml")
    assert again == mlir
    assert record_again == record
    assert "loc(" not in mlir and str(model_file.parent) not in mlir
    assert record["mlir_sha256"] == sha256_bytes(mlir.encode("utf-8"))
    # JAX's main is a private function of the wrapper; the public main takes the observation only.
    assert "func.func private @jax_main(" in mlir
    assert "func.func @main(%arg0: tensor<2x16xf32>) -> tensor<2x4xf32>" in mlir
    assert '#flow.parameter.named<"model"::"head.w"> : tensor<16x4xf32>' in mlir


def test_record_names_parameters_inputs_and_outputs(mlp):
    _, model_file, _, _, record = mlp
    assert "format" not in record  # export.py adds it
    assert record["framework"] == "stablehlo"
    assert record["function"] == "main"
    assert record["parameter_scope"] == "model"
    assert record["parameters"] == [{"name": "head.b", "shape": [4], "dtype": "float32"},
                                    {"name": "head.w", "shape": [16, 4], "dtype": "float32"}]
    assert record["parameter_count"] == 4 + 16 * 4
    assert record["inputs"] == [{"name": "obs", "shape": [2, 16], "dtype": "float32"}]
    assert record["outputs"] == [{"name": "result", "shape": [2, 4], "dtype": "float32"}]
    # Counted over every function: the tanh is in the private helper.
    assert record["op_histogram"] == {"stablehlo.add": 1, "stablehlo.broadcast_in_dim": 2,
                                      "stablehlo.dot_general": 1, "stablehlo.tanh": 1}
    assert record["sources"] == {"model.stablehlo.mlir": sha256_file(model_file)}
    assert record["dynamic_dims"] == {} and record["rewrites"] == {}
    assert set(record["toolchain"]) == {"iree-base-compiler"}


def test_pytree_paths_become_dotted_names():
    assert parse_path("params['mlp']['l1']['w']") == ("params", ["mlp", "l1", "w"])
    assert parse_path("params['layers'][0]['w']") == ("params", ["layers", "0", "w"])
    assert parse_path("params.encoder['w']") == ("params", ["encoder", "w"])
    assert parse_path('obs["state"]') == ("obs", ["state"])
    assert parse_path("obs") == ("obs", [])


def test_sha256_mismatch_is_refused(tmp_path):
    model_file = _write(tmp_path / "model.stablehlo.mlir", MLP)
    view = _view(model_file)
    view["model"]["file"]["sha256"] = "0" * 64
    with pytest.raises(DsaError) as e:
        export_stablehlo(view, model_file, manifest_name="jax_mlp.yaml")
    assert e.value.where == "jax_mlp.yaml: model.file.sha256"
    assert "set model.file.sha256" in str(e.value)


def test_dynamic_dim_is_refused_naming_the_argument(tmp_path):
    model_file = _write(tmp_path / "model.stablehlo.mlir", DYNAMIC)
    with pytest.raises(DsaError) as e:
        export_stablehlo(_view(model_file), model_file)
    message = str(e.value)
    assert "'obs'" in message and "tensor<?x4xf32>" in message
    assert "static shapes" in message and "fixed batch" in message


def test_bucket_is_refused(tmp_path):
    model_file = _write(tmp_path / "model.stablehlo.mlir", MLP)
    with pytest.raises(DsaError) as e:
        export_stablehlo(_view(model_file), model_file, bucket={"dim": "batch", "size": 2, "slot": 0})
    assert e.value.where == "manifest: buckets.batch"
    assert "export once per size" in str(e.value)
    with pytest.raises(DsaError) as e:
        export_stablehlo(_view(model_file, bucket_dims=["batch"]), model_file)
    assert e.value.where == "manifest: buckets"


def test_custom_call_is_refused_naming_the_call_target(tmp_path):
    model_file = _write(tmp_path / "model.stablehlo.mlir", CUSTOM_CALL)
    with pytest.raises(DsaError) as e:
        export_stablehlo(_view(model_file), model_file)
    message = str(e.value)
    assert ("IREE cannot lower StableHLO op 'stablehlo.custom_call' (call_target_name \"lapack_sgeev_ffi\") at "
            "jit(apply)/eig") in message
    assert "docs/frontends.md" in message
    assert str(model_file) in e.value.where


def test_wrong_action_shape_is_refused_naming_chunk_size(tmp_path):
    model_file = _write(tmp_path / "model.stablehlo.mlir", MLP)
    with pytest.raises(DsaError) as e:
        export_stablehlo(_view(model_file, chunk_size=8), model_file, manifest_name="jax_mlp.yaml")
    message = str(e.value)
    assert "[2, 4]" in message and "chunk_size 8" in message and "outputs.action.dim 4" in message


def test_module_without_argument_locations_is_refused(tmp_path):
    from iree.compiler import ir

    # The same module printed without debug info, as a rewrite that drops JAX's locations would leave it.
    stripped = ir.Module.parse(MLP, ir.Context()).operation.get_asm(enable_debug_info=False)
    assert "params[" not in stripped
    model_file = _write(tmp_path / "model.stablehlo.mlir", stripped)
    with pytest.raises(DsaError) as e:
        export_stablehlo(_view(model_file), model_file)
    message = str(e.value)
    assert "no name locations" in message and "exported.mlir_module()" in message


def test_a_manifest_input_the_module_lacks_is_refused_naming_the_field(tmp_path):
    model_file = _write(tmp_path / "model.stablehlo.mlir", MLP)
    view = dict(_view(model_file), inputs={"state": {"dim": 16}, "cameras": []})
    with pytest.raises(DsaError) as e:
        export_stablehlo(view, model_file, manifest_name="jax_mlp.yaml")
    assert e.value.where == "jax_mlp.yaml: inputs.state.dim"
    assert "no input of that name (its inputs: 'obs' [2, 16])" in str(e.value)


def test_dict_observations_are_named_by_key_and_checked_against_the_manifest(tmp_path):
    # The MLP with its observation a dict leaf, obs['state'], as jax.export locates it.
    text = MLP.replace('loc("obs")', """loc("obs['state']")""")
    model_file = _write(tmp_path / "model.stablehlo.mlir", text)
    _, record = export_stablehlo(dict(_view(model_file), inputs={"state": {"dim": 16}}), model_file)
    assert [i["name"] for i in record["inputs"]] == ["state"]
    with pytest.raises(DsaError) as e:
        export_stablehlo(dict(_view(model_file), inputs={"state": {"dim": 14}}), model_file,
                         manifest_name="jax_mlp.yaml")
    assert e.value.where == "jax_mlp.yaml: inputs.state.dim"
    assert "input 'state' of" in str(e.value) and "has shape [2, 16], but the manifest declares [14]" in str(e.value)
