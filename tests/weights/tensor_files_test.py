"""dsa.stages.tensor_files: safetensors read and written one tensor at a time, and sharded checkpoints.

What it proves:
* `write_safetensors` writes the bytes `safetensors.numpy.save_file` writes for the same tensors and metadata
  (every dtype numpy can hold, in safetensors' dtype-then-name order; names with quotes, backslashes, control
  characters, unicode, empty; scalars and empty tensors; no metadata, one key, an empty map), calling
  `produce` once per tensor;
* `SafetensorsFile` gives each tensor's dtype, shape and byte length from the header, and reads each one alone
  into a fresh, writable array equal to safetensors' own; garbage, truncated and exabyte-header files are
  refused with the one-line "not a readable safetensors file";
* `write_sharded_safetensors` splits at the cap in order (an oversized tensor alone), names shards as Hugging
  Face does, writes a canonical index, and is deterministic; `ShardedSafetensors` reads it back;
* every malformed sharded checkpoint is refused naming the file and what to do: an index over the size cap,
  not JSON, no weight_map, a non-string shard, a shard name with a slash or '..', a shard named by the index
  but not listed by the manifest and the reverse, a missing shard, a tensor the weight_map places in a shard
  that does not hold it, a shard holding a tensor the map does not list, a tensor in two shards; and through
  `dsa.stages.params.check_checkpoint_digest`, an index or a shard whose sha256 is not its pin.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from dsa.core.errors import DsaError
from dsa.core.fileio import sha256_file
from dsa.stages.params import check_checkpoint_digest, open_checkpoint
from dsa.stages.tensor_files import (INDEX_NAME, MAX_INDEX_BYTES, SafetensorsFile, ShardedSafetensors, numpy_dtype,
                                     plan_shards, write_safetensors, write_sharded_safetensors)

DTYPES = ["bool", "uint8", "int8", "int16", "uint16", "float16", "bfloat16", "int32", "uint32", "float32",
          "float64", "int64", "uint64", "complex64", "float8_e4m3fn", "float8_e5m2"]
NAMES = ["a", 'b"q\\', "é☃ü", "\x01ctrl\x7f\n", "z" * 300, "", "model.layers.0.w"]
SHAPES = [(3, 5), (0,), (), (7,), (1, 2, 3)]


def _tensors():
    rng = np.random.default_rng(0)
    tensors = {}
    for i, dtype in enumerate(DTYPES):
        for j, name in enumerate(NAMES):
            shape = SHAPES[(i + j) % len(SHAPES)]
            values = rng.standard_normal(shape) * 4
            tensors[f"{name}{dtype}{j}"] = np.asarray(values > 0 if dtype == "bool" else values.astype(numpy_dtype(dtype)))
    return tensors


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {}], ids=["none", "one_key", "empty"])
def test_write_safetensors_is_byte_identical_to_save_file(tmp_path, metadata):
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata=metadata)
    calls = []

    def produce(name):
        calls.append(name)
        return tensors[name]

    write_safetensors(tmp_path / "ours.safetensors", [(k, v.dtype, v.shape) for k, v in tensors.items()], produce,
                      metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    assert sorted(calls) == sorted(tensors) and len(calls) == len(tensors)  # each tensor produced once


def test_a_produced_tensor_must_match_its_declared_dtype_and_shape(tmp_path):
    with pytest.raises(DsaError, match=r"tensor 'w' was produced as \[2\] float64, the header says \[2\] float32"):
        write_safetensors(tmp_path / "x.safetensors", [("w", "float32", (2,))], lambda n: np.zeros(2))
    assert list(tmp_path.iterdir()) == []


def test_reader_gives_headers_without_reading_and_tensors_one_at_a_time(tmp_path):
    tensors = _tensors()
    path = tmp_path / "c.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    source = SafetensorsFile(path)
    assert sorted(source.keys()) == sorted(tensors)
    assert source.metadata == {"format": "pt"}
    with safe_open(str(path), framework="pt") as theirs:
        for name, array in tensors.items():
            info = source.info(name)
            assert (info.dtype, info.shape, info.nbytes) == (array.dtype.name, array.shape, array.nbytes)
            got = source.read(name)
            assert got.dtype == array.dtype and got.shape == array.shape and got.flags.writeable
            reference = theirs.get_tensor(name).contiguous().reshape(-1).view(torch.uint8).numpy()
            assert got.tobytes() == reference.tobytes()
    source.close()


@pytest.mark.parametrize("content", [b"not a safetensors file at all" * 10, struct.pack("<Q", 1 << 60) + b"{}",
                                     "truncated"], ids=["garbage", "huge_header", "truncated"])
def test_not_a_safetensors_file_is_refused_in_one_line(tmp_path, content):
    path = tmp_path / "c.safetensors"
    if content == "truncated":
        save_file({"w": np.zeros((64, 64), np.float32)}, str(path))
        content = path.read_bytes()[:5000]
    path.write_bytes(content)
    with pytest.raises(DsaError, match=r"c\.safetensors: not a readable safetensors file: .*point checkpoint\.path"):
        SafetensorsFile(path)


# -- sharded ---------------------------------------------------------------------------------------------


def _model(n=7, size=1000):
    rng = np.random.default_rng(1)
    tensors = {f"layer.{i}.weight": rng.standard_normal(size + 10 * i).astype(np.float32) for i in range(n)}
    tensors["step"] = np.array(3, np.int64)
    tensors["embed.bf16"] = rng.standard_normal((4, 8)).astype(numpy_dtype("bfloat16"))
    return tensors


def _sharded(directory, tensors=None, cap=9000):
    tensors = tensors or _model()
    entries = [(k, v.dtype, v.shape) for k, v in sorted(tensors.items())]
    return write_sharded_safetensors(directory, entries, tensors.__getitem__, cap, metadata={"format": "pt"})


def test_shards_are_planned_in_order_under_the_cap_and_an_oversized_tensor_stands_alone():
    entries = [("a", "float32", (10,)), ("b", "float32", (10,)), ("c", "float32", (100,)), ("d", "uint8", (1,))]
    shards = plan_shards(entries, 80)
    assert [[e[0] for e in shard] for shard in shards] == [["a", "b"], ["c"], ["d"]]


def test_sharded_writer_is_deterministic_hugging_face_shaped_and_read_back(tmp_path):
    tensors = _model()
    index = _sharded(tmp_path / "one", tensors)
    _sharded(tmp_path / "two", tensors)
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)] + [INDEX_NAME]
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    document = json.loads(index.read_text())
    assert document["metadata"] == {"total_size": sum(a.nbytes for a in tensors.values())}
    assert sorted(document["weight_map"]) == sorted(tensors)
    assert index.read_text() == json.dumps(document, indent=2, sort_keys=True) + "\n"
    for shard in set(document["weight_map"].values()):
        assert (tmp_path / "one" / shard).stat().st_size <= 9000 + 1000  # cap plus one header
    source = ShardedSafetensors(index, listed=set(document["weight_map"].values()))
    for name, array in tensors.items():
        assert source.info(name).dtype == array.dtype.name
        assert source.read(name).tobytes() == array.tobytes()
        assert source.where(name) == str(tmp_path / "one" / document["weight_map"][name])
    source.close()


def _edit_index(index, edit):
    document = json.loads(index.read_text())
    edit(document)
    index.write_text(json.dumps(document))


def _listed(index):
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def test_an_index_that_is_not_a_checkpoint_index_is_refused(tmp_path):
    index = tmp_path / INDEX_NAME
    index.write_bytes(b"\xff not json")
    with pytest.raises(DsaError, match=r"index\.json: is not a JSON checkpoint index .*weight_map"):
        ShardedSafetensors(index)
    index.write_text('{"metadata": {}}')
    with pytest.raises(DsaError, match=r"index\.json: has no weight_map mapping"):
        ShardedSafetensors(index)
    index.write_text('{"weight_map": {"w": 3}}')
    with pytest.raises(DsaError, match=r"weight_map\['w'\]: is int, not a shard file name"):
        ShardedSafetensors(index)
    with open(index, "wb") as f:
        f.truncate(MAX_INDEX_BYTES + 1)
    with pytest.raises(DsaError, match=r"is 67108865 bytes, more than a checkpoint index may be"):
        ShardedSafetensors(index)


@pytest.mark.parametrize("shard", ["../model.safetensors", "sub/model.safetensors", "..", "/etc/passwd"])
def test_a_shard_name_that_leaves_the_index_directory_is_refused(tmp_path, shard):
    index = _sharded(tmp_path)
    _edit_index(index, lambda d: d["weight_map"].update({"step": shard}))
    with pytest.raises(DsaError, match=r"weight_map\['step'\]: shard .* (has a path separator|has '\.\.')"):
        ShardedSafetensors(index)


def test_shards_named_and_listed_must_agree(tmp_path):
    index = _sharded(tmp_path)
    listed = _listed(index)
    with pytest.raises(DsaError, match=r"policy\.yaml: checkpoint\.shards: the index .* names 1 shard\(s\) the "
                                       r"manifest does not list: model-00004-of-00004\.safetensors"):
        ShardedSafetensors(index, listed[:-1], "policy.yaml")
    with pytest.raises(DsaError, match=r"checkpoint\.shards: lists 1 shard\(s\) that the index .* never names: "
                                       r"extra\.safetensors"):
        ShardedSafetensors(index, listed + ["extra.safetensors"], "policy.yaml")


def test_a_missing_shard_is_refused(tmp_path):
    index = _sharded(tmp_path)
    (tmp_path / _listed(index)[1]).unlink()
    with pytest.raises(DsaError, match=r"model-00002-of-00004\.safetensors: shard .* is missing \(put every shard"):
        ShardedSafetensors(index)


def test_weight_map_and_shards_must_agree_tensor_by_tensor(tmp_path):
    index = _sharded(tmp_path)
    shards = _listed(index)
    # The map places a tensor in a shard that does not hold it.
    document = json.loads(index.read_text())
    holder = document["weight_map"]["step"]
    other = next(s for s in shards if s != holder)
    _edit_index(index, lambda d: d["weight_map"].update({"step": other}))
    with pytest.raises(DsaError, match=rf"weight_map\['step'\]: places tensor 'step' in {other}, which does not "
                                       rf"hold it, it is in {holder}"):
        ShardedSafetensors(index)
    # A shard holds a tensor the map does not list.
    _edit_index(index, lambda d: (d["weight_map"].update({"step": holder}), d["weight_map"].pop("layer.0.weight")))
    with pytest.raises(DsaError, match=r"1 tensor\(s\) in the shards that the weight_map does not list: "
                                       r"layer\.0\.weight \(model-00001-of-00004"):
        ShardedSafetensors(index)
    # A tensor in two shards.
    _edit_index(index, lambda d: d["weight_map"].update({"layer.0.weight": shards[0]}))
    save_file({"layer.0.weight": np.zeros(3, np.float32)}, str(tmp_path / "dup.safetensors"))
    _edit_index(index, lambda d: d["weight_map"].update({"dup.only": "dup.safetensors"}))
    with pytest.raises(DsaError, match=r"tensor 'layer\.0\.weight' is in two shards, dup\.safetensors and "
                                       r"model-00001-of-00004\.safetensors"):
        ShardedSafetensors(index)


def test_a_shard_that_is_not_safetensors_is_refused_naming_it(tmp_path):
    index = _sharded(tmp_path)
    (tmp_path / _listed(index)[2]).write_bytes(b"garbage" * 20)
    with pytest.raises(DsaError, match=r"model-00003-of-00004\.safetensors: not a readable safetensors file"):
        ShardedSafetensors(index)


def _view(index, shards=None):
    listed = shards if shards is not None else [{"file": f, "sha256": sha256_file(index.parent / f)}
                                                 for f in _listed(index)]
    return {"model_id": "m", "checkpoint": {"path": index.name, "sha256": sha256_file(index), "shards": listed},
            "quant_scheme": {"kind": "none"}}


def test_digests_of_the_index_and_of_every_shard_are_checked(tmp_path):
    index = _sharded(tmp_path)
    view = _view(index)
    check_checkpoint_digest(index, view, "policy.yaml")
    assert isinstance(open_checkpoint(index, view=view), ShardedSafetensors)
    bad = dict(view, checkpoint=dict(view["checkpoint"], sha256="0" * 64))
    with pytest.raises(DsaError, match=r"policy\.yaml: checkpoint\.sha256: checkpoint index .* has sha256 "
                                       r"[0-9a-f]{64}, but the manifest pins 0{64}"):
        check_checkpoint_digest(index, bad, "policy.yaml")
    shards = [dict(s) for s in view["checkpoint"]["shards"]]
    shards[2]["sha256"] = "1" * 64
    with pytest.raises(DsaError, match=r"policy\.yaml: checkpoint\.shards\[2\]\.sha256: shard .*model-00003-of-00004"
                                       r"\.safetensors has sha256 [0-9a-f]{64}, but the manifest pins 1{64} "
                                       r"\(if this shard is the one you mean to ship, set checkpoint\.shards\[2\]"):
        check_checkpoint_digest(index, _view(index, shards), "policy.yaml")
    with pytest.raises(DsaError, match=r"checkpoint\.shards: the index .* names 1 shard\(s\) the manifest does not "
                                       r"list"):
        check_checkpoint_digest(index, _view(index, view["checkpoint"]["shards"][:-1]), "policy.yaml")
    (tmp_path / "model-00001-of-00004.safetensors").unlink()
    with pytest.raises(DsaError, match=r"model-00001-of-00004\.safetensors: shard .* is missing"):
        check_checkpoint_digest(index, view, "policy.yaml")
