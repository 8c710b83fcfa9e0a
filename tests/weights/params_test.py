"""DsaParams streamed (dsa.stages.params.build_params): the same archives as before, checks before writing,
precision, sharded checkpoints.

What it proves:
* the archive is byte-identical to the one the previous, in-memory implementation wrote (kept below as
  `_reference_build_params`: safetensors' get_tensor + iree.runtime.ParameterIndex) for float32, int64 and
  bool parameters, empty tensors, unused parameters, and int8 / int4 quantised weights;
* everything that needs no tensor data is checked before anything is read or written: a wrong shape in the
  last tensor is reported although an earlier one holds NaN, and no archive is left;
* precision: with precision.weights bf16 / f16 and a record storing bfloat16 / float16, a float32, bfloat16 or
  float16 checkpoint is rounded to nearest even (numpy / ml_dtypes casts, checked bit for bit against
  torch's `.to`, with ties both ways); a bfloat16 / float16 checkpoint of a float32 record is widened exactly; a rounding the manifest
  did not ask for is refused with the existing message; NaN is refused before conversion; a finite value
  beyond float16's range is refused naming the tensor and suggesting bf16;
* quantisation from a bfloat16 checkpoint equals quantisation of the same values as float32;
* a sharded checkpoint gives the same archive as one file holding the same tensors.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dsa.core.errors import DsaError
from dsa.core.fileio import atomic_output, sha256_file
from dsa.core.formats import PARAMETER_METADATA_PREFIX
from dsa.stages.params import build_params
from dsa.stages.quant import SCALE_SUFFIX, quantize_weight, scale_name, source_of
from dsa.stages.tensor_files import write_sharded_safetensors


def _reference_build_params(checkpoint, view, record, out_irpa):
    """The parameter stage as it was before streaming (all tensors in one ParameterIndex), minus the checks."""
    import iree.runtime as rt
    import torch
    from safetensors import safe_open

    from dsa.stages.spec import DTYPE_NAMES

    def metadata(dtype, shape):
        return PARAMETER_METADATA_PREFIX + json.dumps({"type": "Tensor", "dtype": dtype, "shape": list(shape)})

    scheme = view["quant_scheme"]
    quantized = record.get("quantization", {"tensors": {}})["tensors"]
    wanted = sorted(p["name"] for p in record["parameters"] if not source_of(p["name"], quantized))
    handle = safe_open(str(checkpoint), framework="pt")
    index = rt.ParameterIndex()
    for name in wanted:
        tensor = handle.get_tensor(name)
        if name in quantized:
            parts = quantize_weight(tensor.numpy(), scheme)
            for key, array in ((name, parts[""]), (scale_name(name), parts[SCALE_SUFFIX])):
                got = DTYPE_NAMES[torch.from_numpy(array).dtype]
                index.add_buffer(key, array.tobytes(), metadata=metadata(got, array.shape))
            continue
        dtype = DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        index.add_buffer(name, data, metadata=metadata(dtype, tensor.shape))
    with atomic_output(out_irpa) as tmp:
        index.create_archive_file(str(tmp))


def _record(params, quantization=None, unused=()):
    record = {"parameters": [{"name": n, "shape": list(s), "dtype": d} for n, s, d in params]}
    if quantization:
        record["quantization"] = quantization
    if unused:
        record["unused_parameters"] = list(unused)
    return record


def _view(path, **extra):
    view = {"model_id": "m", "checkpoint": {"path": path.name, "sha256": sha256_file(path)},
            "quant_scheme": {"kind": "none"}}
    view.update(extra)
    return view


def _save(path, tensors):
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _model():
    rng = np.random.default_rng(3)
    return {
        "a.weight": rng.standard_normal((16, 64)).astype(np.float32),
        "a.bias": rng.standard_normal(16).astype(np.float32),
        "b.weight": rng.standard_normal((8, 16)).astype(np.float32),
        "empty": np.zeros((0, 3), np.float32),
        "position_ids": np.arange(12, dtype=np.int64).reshape(1, 12),
        "mask": rng.standard_normal(5) > 0,
        "vae.encoder": np.ones(4, np.float32),  # in the checkpoint, unused by the graph
    }


def _plain_record(tensors, unused=("vae.encoder",)):
    return _record([(n, a.shape, a.dtype.name) for n, a in tensors.items() if n not in unused], unused=unused)


def test_the_archive_is_byte_identical_to_the_previous_implementation(tmp_path):
    tensors = _model()
    ckpt = _save(tmp_path / "c.safetensors", tensors)
    record = _plain_record(tensors)
    build_params(ckpt, _view(ckpt), record, tmp_path / "new.irpa")
    _reference_build_params(ckpt, _view(ckpt), record, tmp_path / "old.irpa")
    assert (tmp_path / "new.irpa").read_bytes() == (tmp_path / "old.irpa").read_bytes()


@pytest.mark.parametrize("scheme", [{"kind": "int8"}, {"kind": "int4", "group_size": 16}], ids=["int8", "int4"])
def test_quantised_archives_are_byte_identical_to_the_previous_implementation(tmp_path, scheme):
    tensors = _model()
    ckpt = _save(tmp_path / "c.safetensors", tensors)
    quantized = {}
    params = []
    for name in ("a.weight", "b.weight"):
        out_f, in_f = tensors[name].shape
        parts = quantize_weight(tensors[name], scheme)
        quantized[name] = {"shape": [out_f, in_f], "kind": scheme["kind"], "group_size": scheme.get("group_size", in_f)}
        params += [(name, parts[""].shape, parts[""].dtype.name), (name + SCALE_SUFFIX, parts[SCALE_SUFFIX].shape, "float32")]
    params += [(n, a.shape, a.dtype.name) for n, a in tensors.items() if n not in quantized and n != "vae.encoder"]
    record = _record(params, {"scheme": scheme, "tensors": quantized}, unused=["vae.encoder"])
    view = _view(ckpt, quant_scheme=scheme)
    build_params(ckpt, view, record, tmp_path / "new.irpa")
    _reference_build_params(ckpt, view, record, tmp_path / "old.irpa")
    assert (tmp_path / "new.irpa").read_bytes() == (tmp_path / "old.irpa").read_bytes()

    # The same float weights as bfloat16: quantised from their float32 values.
    half = dict(tensors, **{n: tensors[n].astype(ml_dtypes.bfloat16) for n in quantized})
    ckpt16 = _save(tmp_path / "c16.safetensors", half)
    wide = _save(tmp_path / "wide.safetensors", dict(tensors, **{n: half[n].astype(np.float32) for n in quantized}))
    build_params(ckpt16, _view(ckpt16, quant_scheme=scheme), record, tmp_path / "from16.irpa")
    build_params(wide, _view(wide, quant_scheme=scheme), record, tmp_path / "wide.irpa")
    assert (tmp_path / "from16.irpa").read_bytes() == (tmp_path / "wide.irpa").read_bytes()


def test_everything_checkable_from_headers_is_checked_before_any_tensor_is_read(tmp_path, monkeypatch):
    tensors = _model()
    tensors["a.bias"][0] = np.nan  # read first, in name order
    record = _plain_record(tensors)
    tensors["position_ids"] = tensors["position_ids"].reshape(12, 1)  # the last tensor's shape is wrong
    ckpt = _save(tmp_path / "c.safetensors", tensors)
    from dsa.stages import tensor_files

    reads = []
    original = tensor_files.SafetensorsFile.read
    monkeypatch.setattr(tensor_files.SafetensorsFile, "read", lambda self, n: reads.append(n) or original(self, n))
    with pytest.raises(DsaError, match=r"c\.safetensors: tensor 'position_ids': has shape \[12, 1\] int64, the "
                                       r"exported model expects \[1, 12\] int64"):
        build_params(ckpt, _view(ckpt), record, tmp_path / "p.irpa")
    assert reads == [] and list(tmp_path.glob("p.irpa*")) == []


def _rounded(array, dtype):
    """torch's rounding (`.to`, nearest even), independent of the numpy / ml_dtypes casts the stage uses."""
    import torch

    if array.dtype.name == "bfloat16":
        source = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        source = torch.from_numpy(array)
    if np.dtype(dtype).name == "bfloat16":
        return source.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    return source.to(torch.float16).numpy().tobytes()


@pytest.mark.parametrize("weights,dtype", [("bf16", ml_dtypes.bfloat16), ("f16", np.float16)])
@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16"])
def test_precision_rounds_any_float_checkpoint_to_nearest_even(tmp_path, weights, dtype, stored):
    import iree.runtime as rt

    rng = np.random.default_rng(5)
    weight = (rng.standard_normal((32, 48)) * 3).astype(np.float32)
    weight[0, :4] = [1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1 + 3 * 2 ** -11]  # ties, both ways, in bf16 and f16
    source = weight.astype(ml_dtypes.bfloat16 if stored == "bfloat16" else np.dtype(stored))
    ids = np.arange(6, dtype=np.int64)
    ckpt = _save(tmp_path / "c.safetensors", {"w": source, "ids": ids})
    want = np.dtype(dtype).name
    record = _record([("w", (32, 48), want), ("ids", (6,), "int64")])
    build_params(ckpt, _view(ckpt, precision={"weights": weights, "compute": "f32"}), record, tmp_path / "p.irpa")
    index = rt.ParameterIndex()
    index.load(str(tmp_path / "p.irpa"))
    entries = dict(index.items())
    assert bytes(entries["w"].file_view) == _rounded(source, dtype)
    assert bytes(entries["ids"].file_view) == ids.tobytes()
    assert json.loads(entries["w"].metadata.decode()[len(PARAMETER_METADATA_PREFIX):])["dtype"] == want


@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_a_half_precision_checkpoint_of_a_float32_model_is_widened_exactly(tmp_path, stored):
    weight = np.random.default_rng(2).standard_normal((4, 8)).astype(ml_dtypes.bfloat16 if stored == "bfloat16" else np.float16)
    ckpt = _save(tmp_path / "c.safetensors", {"w": weight})
    full = _save(tmp_path / "full.safetensors", {"w": weight.astype(np.float32)})
    record = _record([("w", (4, 8), "float32")])
    build_params(ckpt, _view(ckpt), record, tmp_path / "half.irpa")
    build_params(full, _view(full), record, tmp_path / "full.irpa")
    assert (tmp_path / "half.irpa").read_bytes() == (tmp_path / "full.irpa").read_bytes()


def test_a_rounding_the_manifest_did_not_ask_for_is_refused(tmp_path):
    ckpt = _save(tmp_path / "c.safetensors", {"w": np.zeros((2, 3), np.float32)})
    record = _record([("w", (2, 3), "bfloat16")])
    with pytest.raises(DsaError, match=r"tensor 'w': has shape \[2, 3\] float32, the exported model expects "
                                       r"\[2, 3\] bfloat16 \(the archive stores it as bfloat16: .*precision\.weights"):
        build_params(ckpt, _view(ckpt), record, tmp_path / "p.irpa")
    # Nor does precision turn an integer tensor or a float64 one into a float.
    ckpt = _save(tmp_path / "i.safetensors", {"w": np.zeros((2, 3), np.int32)})
    with pytest.raises(DsaError, match=r"has shape \[2, 3\] int32, the exported model expects \[2, 3\] bfloat16"):
        build_params(ckpt, _view(ckpt, precision={"weights": "bf16"}), record, tmp_path / "p.irpa")
    assert list(tmp_path.glob("p.irpa*")) == []


def test_nan_is_refused_before_rounding_and_float16_overflow_is_refused(tmp_path):
    record = _record([("w", (2, 3), "float16")])
    weight = np.ones((2, 3), np.float32)
    weight[1, 2] = np.nan
    ckpt = _save(tmp_path / "c.safetensors", {"w": weight})
    with pytest.raises(DsaError, match=r"tensor 'w': holds 1 NaN or infinite value: "):
        build_params(ckpt, _view(ckpt, precision={"weights": "f16"}), record, tmp_path / "p.irpa")
    weight[1, 2] = 7e4  # finite in float32, beyond float16's 65504
    weight[0, 0] = -1e5
    ckpt = _save(tmp_path / "c.safetensors", {"w": weight})
    with pytest.raises(DsaError, match=r"c\.safetensors: tensor 'w': holds 2 finite values beyond float16's range "
                                       r"\(±65504\), which would round to infinity \(store the weights as bf16"):
        build_params(ckpt, _view(ckpt, precision={"weights": "f16"}), record, tmp_path / "p.irpa")
    assert list(tmp_path.glob("p.irpa*")) == []


def test_a_sharded_checkpoint_gives_the_archive_of_the_single_file(tmp_path):
    tensors = _model()
    single = _save(tmp_path / "c.safetensors", tensors)
    record = _plain_record(tensors)
    entries = [(n, a.dtype, a.shape) for n, a in sorted(tensors.items())]
    index = write_sharded_safetensors(tmp_path / "sharded", entries, tensors.__getitem__, 2000, {"format": "pt"})
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert len(shards) >= 3
    view = _view(index)
    view["checkpoint"]["shards"] = [{"file": s, "sha256": sha256_file(index.parent / s)} for s in shards]
    build_params(index, view, record, tmp_path / "sharded.irpa", manifest_name="policy.yaml")
    build_params(single, _view(single), record, tmp_path / "single.irpa")
    assert (tmp_path / "sharded.irpa").read_bytes() == (tmp_path / "single.irpa").read_bytes()

    # A NaN in a shard is refused naming the shard file.
    tensors["b.weight"][1, 1] = np.inf
    index = write_sharded_safetensors(tmp_path / "bad", entries, tensors.__getitem__, 2000, {"format": "pt"})
    view = _view(index)
    view["checkpoint"]["shards"] = [{"file": s, "sha256": sha256_file(index.parent / s)} for s in shards]
    with pytest.raises(DsaError, match=r"bad/model-0000\d-of-0000\d\.safetensors: tensor 'b\.weight': holds 1 NaN"):
        build_params(index, view, record, tmp_path / "bad.irpa")


def _onnx_record(places):
    return {"framework": "onnx", "parameters": [
        {"name": name, "shape": list(shape), "dtype": dtype,
         "onnx": {"initializer": f"init_{name}", "offset": offset, "length": length}}
        for name, shape, dtype, offset, length in places]}


def test_an_onnx_external_data_file_is_read_slice_by_slice_and_checked_before_writing(tmp_path):
    import iree.runtime as rt

    rng = np.random.default_rng(4)
    w = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    ids = np.arange(4, dtype=np.int64)
    data = tmp_path / "model.onnx.data"
    data.write_bytes(w.tobytes() + bytes(4) + b.tobytes() + ids.tobytes())
    places = [("w", w.shape, "float32", 0, w.nbytes), ("b", b.shape, "float32", w.nbytes + 4, b.nbytes),
              ("ids", ids.shape, "int64", w.nbytes + 4 + b.nbytes, ids.nbytes)]
    build_params(data, _view(data), _onnx_record(places), tmp_path / "p.irpa")
    index = rt.ParameterIndex()
    index.load(str(tmp_path / "p.irpa"))
    entries = dict(index.items())
    for name, array in (("w", w), ("b", b), ("ids", ids)):
        assert bytes(entries[name].file_view) == array.tobytes()

    past = places[:2] + [("ids", ids.shape, "int64", w.nbytes + 4 + b.nbytes + 8, ids.nbytes)]
    with pytest.raises(DsaError, match=r"model\.onnx\.data: tensor 'ids': lies at bytes 92\.\.124, past the file's "
                                       r"116 bytes"):
        build_params(data, _view(data), _onnx_record(past), tmp_path / "q.irpa")
    short = places[:2] + [("ids", ids.shape, "int64", w.nbytes + 4 + b.nbytes, ids.nbytes - 8)]
    with pytest.raises(DsaError, match=r"tensor 'ids': has 3 values at its recorded place, the model expects 4"):
        build_params(data, _view(data), _onnx_record(short), tmp_path / "q.irpa")
    assert list(tmp_path.glob("q.irpa*")) == []
