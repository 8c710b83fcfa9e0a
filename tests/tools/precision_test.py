"""The manifest's precision (schema 1.7, dsa.stages.precision): half-precision weights widened to f32 where read
run on every target and match eager PyTorch run with the same rounded weights as tightly as f32 does; a policy
computing in bf16 compiles for a target with bf16 arithmetic, matches within bf16's bound, and is refused for a
target without it, naming the target and the field; quantised weights and tied weights are left as they are."""

import copy
import json

import numpy as np
import pytest
import torch

from dsa.core.errors import DsaError
from dsa.manifest.contract import load_manifest, project
from dsa.stages.compile import compile_flags, compile_module
from dsa.stages.export import export_model, load_entry_point
from dsa.stages.params import build_params
from dsa.stages.spec import DTYPES
from dsa.tools.testing import runfile

# Relative to the largest |output|: f32 (and widened half weights: the same f32 arithmetic) vs bf16 arithmetic
# (8-bit mantissas: activations rounded at every contraction; measured 3.5e-3 on the transformer control).
F32_BOUND = 1e-4
BF16_COMPUTE_BOUND = 2e-2


@pytest.fixture(scope="module")
def manifest():
    return load_manifest(runfile("manifests/transformer.yaml"))


@pytest.fixture(scope="module")
def seeded(manifest, tmp_path_factory):
    from dsa.stages.checkpoint import make_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "transformer.safetensors"
    make_checkpoint(project(manifest, "export"), path, seed=0, pythonpath=[str(_root())])
    return path


def _root():
    return runfile("models/transformer/transformer.py").parents[2]


def _target(name):
    return json.loads(runfile(f"toolchains/targets/{name}.json").read_text())


def _views(manifest, precision, target="x86_64-v3"):
    views = {}
    for name in ("export", "params"):
        views[name] = copy.deepcopy(project(manifest, name))
        views[name]["precision"] = dict(precision)
    compile_view = copy.deepcopy(project(manifest, "compile", target="x86_64-v3"))
    compile_view.update(target=target, precision=dict(precision))
    views["compile"] = compile_view
    return views


def _build(manifest, seeded, precision, target, tmp_path):
    views = _views(manifest, precision, target)
    record = export_model(views["export"], tmp_path / "m.mlir", tmp_path / "r.json", pythonpath=[str(_root())])
    params = dict(views["params"], checkpoint=dict(views["params"]["checkpoint"]))
    from dsa.core.fileio import sha256_file

    params["checkpoint"]["sha256"] = sha256_file(seeded)
    build_params(seeded, params, record, tmp_path / "p.irpa")
    compile_module(tmp_path / "m.mlir", views["compile"], _target(target), tmp_path / "m.vmfb")
    return record


def _run(tmp_path, record, inputs):
    import iree.runtime as rt

    index = rt.ParameterIndex()
    index.load(str(tmp_path / "p.irpa"))
    config = rt.Config("local-task")
    context = rt.SystemContext(vm_modules=[
        rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope="model")),
        rt.create_hal_module(config.vm_instance, config.device),
        rt.VmModule.copy_buffer(config.vm_instance, (tmp_path / "m.vmfb").read_bytes())], config=config)
    return context.modules.module["main"](*inputs).to_host()


def _eager(manifest, seeded, weights):
    """Eager PyTorch in f32 with the checkpoint's weights rounded to `weights` (what the archive stores)."""
    from safetensors.torch import load_file

    view = project(manifest, "export")
    spec = load_entry_point(view["model"]["entry_point"], [str(_root())])(view, {"batch": 2})
    module = spec.module.eval()
    dtype = DTYPES[{"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[weights]]
    module.load_state_dict({k: v.to(dtype).float() for k, v in load_file(str(seeded)).items()})
    inputs = [s.example(np.random.default_rng(3)).numpy() for s in spec.inputs]
    with torch.no_grad():
        return module(*[torch.from_numpy(i) for i in inputs]).numpy(), inputs


@pytest.mark.parametrize("weights", ["bf16", "f16"])
def test_half_precision_weights_are_stored_half_and_match_eager_like_f32(manifest, seeded, weights, tmp_path):
    record = _build(manifest, seeded, {"weights": weights, "compute": "f32"}, "x86_64-v3", tmp_path)
    assert {p["dtype"] for p in record["parameters"]} == {"bfloat16" if weights == "bf16" else "float16"}
    assert record["precision"] == {"weights": weights, "compute": "f32"}
    f32_bytes = sum(int(np.prod(p["shape"])) * 4 for p in record["parameters"])
    assert (tmp_path / "p.irpa").stat().st_size < 0.55 * f32_bytes
    expected, inputs = _eager(manifest, seeded, weights)
    got = _run(tmp_path, record, inputs)
    assert np.abs(got - expected).max() <= F32_BOUND * np.abs(expected).max()


def test_widened_weights_keep_the_float32_interface_and_fuse_the_widening(manifest):
    view = _views(manifest, {"weights": "bf16", "compute": "f32"})["compile"]
    flags = compile_flags(view, _target("x86_64-v3"), "test")
    assert "--iree-dispatch-creation-block-matmul-producer-fusion=false" in flags
    assert "--iree-opt-const-expr-hoisting=false" in flags


def test_bf16_compute_is_refused_for_a_target_without_bf16_arithmetic_naming_target_and_field(manifest):
    view = _views(manifest, {"weights": "bf16", "compute": "bf16"})["compile"]
    with pytest.raises(DsaError, match=r"precision\.compute: target 'x86_64-v3' has no bf16 arithmetic"):
        compile_flags(view, _target("x86_64-v3"), "test")
    for name in ("x86_64-v4-bf16", "cuda-sm_80", "aarch64-neoverse-v2"):
        view = dict(view, target=name)
        compile_flags(view, _target(name), "test")  # accepted


def _host_has(feature):
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        return any(line.startswith("flags") and feature in line.split() for line in f)


def test_bf16_compute_compiles_for_x86_64_v4_bf16_and_matches_within_the_bf16_bound(manifest, seeded, tmp_path):
    record = _build(manifest, seeded, {"weights": "bf16", "compute": "bf16"}, "x86_64-v4-bf16", tmp_path)
    assert {p["dtype"] for p in record["parameters"]} == {"bfloat16"}
    assert [i["dtype"] for i in record["inputs"]] == ["int64", "int64", "float32"]
    assert [o["dtype"] for o in record["outputs"]] == ["float32"]
    if not _host_has("avx512_bf16"):
        pytest.skip("compiled; this CPU has no AVX-512 BF16 to run it (x86_64-v4-bf16's host requirement)")
    expected, inputs = _eager(manifest, seeded, "bf16")
    got = _run(tmp_path, record, inputs)
    error = np.abs(got - expected).max() / np.abs(expected).max()
    assert error <= BF16_COMPUTE_BOUND
    assert error > F32_BOUND / 10  # it did compute in bf16


def test_quantised_weights_and_their_scales_stay_as_quantised_with_bf16_weights(manifest, tmp_path):
    view = copy.deepcopy(project(manifest, "export"))
    view["model"] = {"entry_point": "tiny_models:mlp", "config": {}}
    view.update(quant_scheme={"kind": "int4", "group_size": 32}, precision={"weights": "bf16", "compute": "f32"})
    import sys

    sys.path.insert(0, str(runfile("tests/tools/tiny_models.py").parent))
    record = export_model(view, tmp_path / "m.mlir", tmp_path / "r.json", pythonpath=[])
    dtypes = {p["name"]: p["dtype"] for p in record["parameters"]}
    assert dtypes["fc1.weight"] == "uint8" and dtypes["fc1.weight_scale"] == "float32"
    assert dtypes["fc1.bias"] == "bfloat16"
