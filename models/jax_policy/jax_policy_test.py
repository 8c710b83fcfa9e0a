"""The JAX policy brought as StableHLO (framework stablehlo): the compiled module matches JAX running the same
`apply` on the same weights; weights from another seed, loaded into the same vmfb, match JAX on those weights;
the StableHLO file is the same whatever the weights (so a new weights file reruns DsaParams alone) and whatever
the directory it is exported from. Runs in @dsa_jax_python: JAX, IREE's runtime, no torch.

Tolerance: |a - b| <= 2e-4 * max(1, max|b|): fp32 throughout; XLA and IREE order the reductions of the
convolutions, attention and layer norms their own way (measured ~1e-6 on tanh-bounded actions). A wrong weight,
a swapped input or a wrong layout moves the output by O(0.1).
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from dsa.core.fileio import read_json, sha256_file
from dsa.runtime.policy import CompiledPolicy
from dsa.tools.testing import runfile

MANIFEST = runfile("manifests/jax_policy.yaml")
MODEL_FILE = runfile("models/jax_policy/model.stablehlo.mlir")
WEIGHTS = runfile("models/jax_policy/params.safetensors")
EXPORT = runfile("models/jax_policy/export.py")
INDEX = runfile("models/jax_policy.modules.json")
RECORD = runfile("models/jax_policy_model/export_record.json")
REL_TOL = 2e-4

sys.path.insert(0, str(EXPORT.parent))
import policy  # noqa: E402


def _close(got, want):
    err = float(np.abs(got - want).max())
    assert err <= REL_TOL * max(1.0, float(np.abs(want).max())), err


def _sizes():
    return policy.io_sizes(yaml.safe_load(MANIFEST.read_text(encoding="utf-8")))


def _observation(seed):
    sizes = _sizes()
    rng = np.random.default_rng(seed)
    return {sizes["camera"]: rng.standard_normal([1] + sizes["image"]).astype(np.float32),
            "state": rng.standard_normal((1, sizes["state"])).astype(np.float32)}


def _jax(flat_weights, obs):
    import jax

    sizes = _sizes()
    params = policy.nest({k: np.asarray(v) for k, v in flat_weights.items()})
    return np.asarray(jax.jit(lambda p, o: policy.apply(p, o, camera=sizes["camera"]))(params, obs))


def _weights(path):
    from safetensors.numpy import load_file

    return load_file(str(path))


@pytest.mark.parametrize("seed", [0, 1])
def test_compiled_stablehlo_matches_jax_on_the_same_weights(seed):
    obs = _observation(seed)
    (actions,), _ = CompiledPolicy(INDEX).run(obs)
    manifest = yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))
    assert actions.shape == (1, manifest["chunk_size"], manifest["outputs"]["action"]["dim"])
    _close(actions, _jax(_weights(WEIGHTS), obs))


def test_the_record_names_the_manifests_inputs_and_every_weight():
    record = read_json(RECORD)
    sizes = _sizes()
    assert [(i["name"], i["shape"]) for i in record["inputs"]] == [
        (sizes["camera"], [1] + sizes["image"]), ("state", [1, sizes["state"]])]
    assert sorted(p["name"] for p in record["parameters"]) == sorted(policy.param_shapes(sizes))
    assert record["framework"] == "stablehlo" and record["sources"] == {
        "jax_policy/model.stablehlo.mlir": sha256_file(MODEL_FILE)}


def test_weights_of_another_seed_run_through_the_same_vmfb(tmp_path):
    """The vmfb holds no weight: the other seed's weights, given as a parameter provider, give JAX's result on
    those weights (and not the shipped weights' result)."""
    import iree.runtime as rt

    other = policy.init_params(_sizes(), seed=5)
    index = read_json(INDEX)
    params = rt.ParameterIndex()
    for name, value in other.items():
        params.add_buffer(name, np.ascontiguousarray(value).tobytes())
    instance = rt.VmInstance()
    device = rt.get_device("local-task")
    vmfb = (INDEX.parent / index["modules"][0]["vmfb"]).read_bytes()
    module = rt.VmModule.copy_buffer(instance, vmfb)
    context = rt.VmContext(instance, modules=[
        rt.create_hal_module(instance, device),
        rt.create_io_parameters_module(instance, params.create_provider(scope=index["parameter_scope"])),
        module])
    invoke = rt.FunctionInvoker(context, device, module.lookup_function("main"))
    obs = _observation(3)
    record = read_json(RECORD)
    got = np.asarray(invoke(*[obs[i["name"]] for i in record["inputs"]]).to_host())
    want = _jax(other, obs)
    _close(got, want)
    assert float(np.abs(want - _jax(_weights(WEIGHTS), obs)).max()) > 1e-2  # the weights do matter


def test_the_stablehlo_file_depends_on_neither_weights_nor_directory(tmp_path):
    """Exported again with another seed, from a copy of the script in another directory: the same bytes as
    the pinned file (and so the same import and compile), while the weights file differs."""
    import shutil

    copy = tmp_path / "elsewhere" / "jax_policy"
    copy.mkdir(parents=True)
    for name in ("export.py", "policy.py"):
        shutil.copy(EXPORT.parent / name, copy / name)
    out_mlir, out_weights = tmp_path / "model.stablehlo.mlir", tmp_path / "params.safetensors"
    subprocess.run([sys.executable, str(copy / "export.py"), "--manifest", str(MANIFEST), "--seed", "9",
                    "--mlir", str(out_mlir), "--params", str(out_weights)], check=True, cwd=tmp_path,
                   env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert sha256_file(out_mlir) == sha256_file(MODEL_FILE)
    manifest = yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))
    assert sha256_file(MODEL_FILE) == manifest["model"]["file"]["sha256"]
    assert sha256_file(out_weights) != sha256_file(WEIGHTS) == manifest["checkpoint"]["sha256"]
