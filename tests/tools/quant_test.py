"""Weight-only quantisation end to end: export with packed weights, DsaParams quantises the float checkpoint,
the compiled module runs from the archive.

Two checks per scheme. Exactness: the module equals eager PyTorch run with the dequantised weights within
1e-5 (relative to max|output|): packing, nibble order, scale layout and the in-graph dequantisation are
right. Accuracy against fp32, relative to max|fp32 output|: int8 per-channel <= 2e-2, int4 group-64
<= 3e-1. Symmetric quantisation errs by at most half a step per weight (1/254 of a row's range for int8,
1/14 of a group's for int4); through three layers of random Gaussian weights that measures ~0.5% (int8)
and ~16% (int4) here — random weights have no outliers to protect and are the worst case for int4.
"""

import copy

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from dsa.stages.compile import compile_module
from dsa.stages.export import export_model
from dsa.core.fileio import sha256_file
from dsa.runtime.policy import read_archive_metadata
from dsa.stages.params import build_params
from dsa.stages.quant import dequantize, quantize_weight

SCHEMES = {
    "int8": ({"kind": "int8"}, 2e-2),
    "int4": ({"kind": "int4", "group_size": 64}, 3e-1),
}


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantize_weight_round_trips_within_half_a_step(kind):
    scheme, _ = SCHEMES[kind]
    w = np.random.default_rng(1).standard_normal((16, 128)).astype(np.float32)
    parts = quantize_weight(w, scheme)
    g = scheme.get("group_size", 128)
    back = dequantize(parts[""], parts["_scale"], {"shape": [16, 128], "kind": kind, "group_size": g})
    step = np.repeat(parts["_scale"], g, axis=1)
    assert np.all(np.abs(back - w) <= 0.5 * step + 1e-6)
    assert parts[""].dtype == (np.int8 if kind == "int8" else np.uint8)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_module_matches_fp32_eager_and_is_smaller(kind, tiny_view, target_spec, tmp_path):
    import iree.runtime as rt

    scheme, tolerance = SCHEMES[kind]
    view = copy.deepcopy(tiny_view)
    view["model"]["entry_point"] = "tiny_models:mlp"
    fp32_view = dict(view, quant_scheme={"kind": "none"})
    quant_view = dict(view, quant_scheme=scheme)

    fp32_record = export_model(fp32_view, tmp_path / "f.mlir", tmp_path / "f.json")
    record = export_model(quant_view, tmp_path / "q.mlir", tmp_path / "q.json")
    assert set(record["quantization"]["tensors"]) == {"fc1.weight", "fc2.weight", "fc3.weight"}
    assert {p["name"]: p["dtype"] for p in record["parameters"]}["fc2.weight"] == ("int8" if kind == "int8" else "uint8")

    rng = np.random.default_rng(0)
    weights = {p["name"]: (rng.standard_normal(p["shape"]) / np.sqrt(p["shape"][-1])).astype(np.float32)
               for p in fp32_record["parameters"]}
    ckpt = tmp_path / "c.safetensors"
    save_file(weights, str(ckpt), metadata={"format": "pt"})
    params_view = {"model_id": "tiny", "checkpoint": {"path": "c", "sha256": sha256_file(ckpt)}}
    build_params(ckpt, dict(params_view, quant_scheme={"kind": "none"}), fp32_record, tmp_path / "f.irpa")
    build_params(ckpt, dict(params_view, quant_scheme=scheme), record, tmp_path / "q.irpa")
    meta = read_archive_metadata(tmp_path / "q.irpa")
    assert meta["fc2.weight_scale"]["dtype"] == "float32"
    # Weights dominate: int8 stores a quarter of fp32's bytes, int4 an eighth (plus scales).
    ratio = (tmp_path / "f.irpa").stat().st_size / (tmp_path / "q.irpa").stat().st_size
    assert ratio > (3.5 if kind == "int8" else 5.0), ratio

    compile_view = {"model_id": "tiny", "quant_scheme": scheme, "target": target_spec["name"]}
    report = compile_module(tmp_path / "q.mlir", compile_view, target_spec, tmp_path / "q.vmfb")
    assert "--iree-opt-const-eval=false" in report["flags"]

    x = rng.standard_normal((4, 64)).astype(np.float32)
    from tiny_models import Mlp

    eager = Mlp().eval()
    eager.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    with torch.no_grad():
        expected = eager(torch.from_numpy(x)).numpy()

    instance = rt.VmInstance()
    device = rt.get_device("local-task")
    index = rt.ParameterIndex()
    index.load(str(tmp_path / "q.irpa"))
    modules = [rt.create_hal_module(instance, device),
               rt.create_io_parameters_module(instance, index.create_provider(scope="model"))]
    vm_module = rt.VmModule.copy_buffer(instance, (tmp_path / "q.vmfb").read_bytes())
    context = rt.VmContext(instance, modules=modules + [vm_module])
    out = rt.FunctionInvoker(context, device, vm_module.lookup_function("main"))(x).to_host()
    error = float(np.abs(out - expected).max()) / float(np.abs(expected).max())
    assert 0 < error <= tolerance, error  # > 0: it really ran the quantised weights

    dequantised = dict(weights)
    for name, info in record["quantization"]["tensors"].items():
        parts = quantize_weight(weights[name], scheme)
        dequantised[name] = dequantize(parts[""], parts["_scale"], info)
    eager.load_state_dict({k: torch.from_numpy(v) for k, v in dequantised.items()})
    with torch.no_grad():
        same_math = eager(torch.from_numpy(x)).numpy()
    assert float(np.abs(out - same_math).max()) <= 1e-5 * float(np.abs(same_math).max())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_one_row_matmul_reads_the_packed_weight_in_one_dispatch(kind, target_spec, tmp_path):
    """A decode step (one row: the matvec of every autoregressive step at batch 1) is where packed weights
    pay: memory-bound, it reads a quarter (int8) or an eighth (int4) of fp32's bytes — if the dequantisation
    runs inside the matvec. dsa.stages.quant's fused op gives IREE the bit-extend and the grouped contraction
    with no reshape between them: one dispatch, as for the float layer. (A separate dequantisation dispatch
    would write the float weight on every call: the 1.6x slowdown this replaced.) It also equals the plain
    torch reference on the same packed weight."""
    import iree.runtime as rt
    from iree.turbine import aot
    from torch import nn

    from dsa.stages.quant import SCALE_SUFFIX, quantize_module, reference_matmul

    scheme = {"kind": kind, "group_size": 32}
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(256, 96, bias=False)).eval()
    quantize_module(layer, scheme)
    parts = quantize_weight(torch.randn(96, 256).numpy(), scheme)
    layer[0].weight.copy_(torch.from_numpy(parts[""]))
    getattr(layer[0], "weight" + SCALE_SUFFIX).copy_(torch.from_numpy(parts[SCALE_SUFFIX]))
    x = torch.randn(1, 256)
    with torch.no_grad():
        expected = reference_matmul(kind, x, layer[0].weight, getattr(layer[0], "weight" + SCALE_SUFFIX)).numpy()
        eager = layer(x).numpy()  # the op's eager implementation is the reference
    np.testing.assert_allclose(eager, expected, rtol=1e-6)
    mlir = str(aot.export(torch.export.export(layer, (x,), strict=False)).mlir_module)
    assert 'torch.operator "' not in mlir and f"dsa_{kind}_matmul_96x256_g32" in mlir
    (tmp_path / "q.mlir").write_text(mlir)
    view = {"model_id": "layer", "quant_scheme": scheme, "target": target_spec["name"]}
    report = compile_module(tmp_path / "q.mlir", view, target_spec, tmp_path / "q.vmfb")
    assert report["dispatch_count"] == 1, report["dispatch_count"]
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, (tmp_path / "q.vmfb").read_bytes()))
    out = ctx.modules.module.main(x.numpy()).to_host()
    assert float(np.abs(out - expected).max()) <= 1e-5 * float(np.abs(expected).max())


def _quantize_whole(weight, scheme):
    """quantize_weight as it was before it worked in row blocks: the whole tensor at once (the reference the
    blocked version must equal bit for bit)."""
    from dsa.stages.quant import QMAX, group_size_for

    kind = scheme["kind"]
    out_f, in_f = weight.shape
    g = group_size_for(scheme, in_f)
    groups = weight.astype(np.float32).reshape(out_f, in_f // g, g)
    scale = np.abs(groups).max(axis=2) / QMAX[kind]
    scale = np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)
    q = np.clip(np.rint(groups / scale[:, :, None]), -QMAX[kind] - (kind == "int4"), QMAX[kind])
    if kind == "int8":
        packed = q.astype(np.int8)
    else:
        nibbles = (q + 8).astype(np.uint8).reshape(out_f, in_f // g, g // 2, 2)
        packed = (nibbles[..., 0] | (nibbles[..., 1] << 4)).astype(np.uint8)
    return {"": np.ascontiguousarray(packed), "_scale": np.ascontiguousarray(scale)}


@pytest.mark.parametrize("scheme", [{"kind": "int8"}, {"kind": "int8", "group_size": 32},
                                    {"kind": "int4", "group_size": 32}, {"kind": "int4", "group_size": 128}])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_quantize_weight_in_row_blocks_is_bit_identical_to_the_whole_tensor(scheme, dtype):
    """quantize_weight works a block of rows at a time (its temporaries bounded by the block): every output
    byte equals the whole-tensor computation's, for block sizes that do and do not divide the rows, a block
    smaller than one row, all-zero groups and rows (scale 1) and exact ties (round half to even), from
    float32, bfloat16 (a bf16 checkpoint: each block widened to float32 here) and float16 weights."""
    import ml_dtypes

    rng = np.random.default_rng(7)
    w = (rng.standard_normal((67, 256)) * rng.uniform(0.01, 3, (67, 1))).astype(np.float32)
    w[3] = 0.0                       # an all-zero row
    w[5, :32] = 0.0                  # an all-zero group
    w[9, :32] = np.arange(32) - 16   # values on the quantisation grid's half steps
    w = w.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    want = _quantize_whole(w, scheme)
    for chunk in (1, 256, 1000, 256 * 8, 256 * 67, 1 << 22):
        got = quantize_weight(w, scheme, chunk_values=chunk)
        for key in ("", "_scale"):
            assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, (chunk, key)
            assert got[key].tobytes() == want[key].tobytes(), (chunk, key)
            assert got[key].flags["C_CONTIGUOUS"]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantize_weight_temporaries_are_bounded_by_its_block_not_the_tensor(kind):
    """The largest quantised tensor of OpenVLA-7B, the 32064 x 4096 lm_head, is 0.5 GB in float32; the
    whole-tensor computation held ~3 float32 copies of a tensor at its peak (measured here: 3.0-3.3x, and
    a bf16 checkpoint's tensor widened first adds one more). Measured with tracemalloc (numpy reports its
    allocations there) on a 4096 x 4096 weight (64 MiB in float32): quantised in row blocks, the peak is the
    outputs plus a few 16 MiB blocks, whatever the tensor's size."""
    import tracemalloc

    scheme = {"kind": kind, "group_size": 32}
    w = np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32)
    out_bytes = w.size * (1 if kind == "int8" else 0.5) + w.size // 32 * 4

    def peak(fn):
        tracemalloc.start()
        try:
            fn(w, scheme)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    blocked, whole = peak(quantize_weight), peak(_quantize_whole)
    assert blocked <= out_bytes + (64 << 20), (blocked, out_bytes)
    assert whole >= 2.5 * w.nbytes, whole  # the whole-tensor computation: several float32 copies
