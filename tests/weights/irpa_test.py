"""dsa.stages.irpa: the streaming parameter-archive writer.

What it proves: for the same entries in the same order, the archive is byte for byte the one IREE's own
writer makes (`iree.runtime.ParameterIndex` + `add_buffer` + `create_archive_file`) — for an empty archive,
zero-byte entries (also last), odd sizes across the 64-byte data alignment and the 4096-byte file alignment,
hundreds of entries, long and unicode names, entries with and without metadata, and the metadata form the
parameter stage writes. IREE's runtime and iree-turbine's ParameterArchive read it back. A write out of
order, of the wrong length, past the last entry, or an archive closed with entries unwritten is refused with
a DsaError, and a failure midway leaves no file.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dsa.core.errors import DsaError
from dsa.core.fileio import atomic_output
from dsa.core.formats import PARAMETER_METADATA_PREFIX
from dsa.stages.irpa import IrpaEntry, IrpaWriter, layout, write_irpa


def _metadata(dtype, shape):
    return PARAMETER_METADATA_PREFIX + json.dumps({"type": "Tensor", "dtype": dtype, "shape": list(shape)})


def _iree_archive(path, entries):
    import iree.runtime as rt

    index = rt.ParameterIndex()
    for name, data, metadata in entries:
        if metadata is None:
            index.add_buffer(name, data)
        else:
            index.add_buffer(name, data, metadata=metadata)
    index.create_archive_file(str(path))
    return path.read_bytes()


def _ours(path, entries):
    data = {name: payload for name, payload, _ in entries}
    write_irpa(path, [IrpaEntry(name, len(payload), metadata) for name, payload, metadata in entries],
               data.__getitem__)
    return path.read_bytes()


def _rng_bytes(rng, n):
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def _cases():
    rng = np.random.default_rng(7)
    return {
        "empty_archive": [],
        "one_empty_entry": [("a", b"", None)],
        "empty_entry_last": [("a", _rng_bytes(rng, 5), "m"), ("b", b"", "meta")],
        "odd_sizes": [(f"t{n}", _rng_bytes(rng, n), None) for n in (1, 3, 63, 64, 65, 127, 4095, 4096, 4097, 9999)],
        "many": [(f"layer.{i}.w", _rng_bytes(rng, (i * 37) % 300), None if i % 3 else f"meta{i}")
                 for i in range(400)],
        "long_names": [("x" * 5000, _rng_bytes(rng, 10), "m" * 3000), ("y" * 17, _rng_bytes(rng, 70), None)],
        "unicode_names": [("poids.é", _rng_bytes(rng, 9), "métadonnée ☃"), ("权重/层", _rng_bytes(rng, 130), None),
                          ("emoji🙂", b"", "")],
        "params_form": [(name, (np.arange(np.prod(shape)) % 2).astype(dtype).tobytes(), _metadata(np.dtype(dtype).name, shape))
                        for name, dtype, shape in [("embed.bias", np.float32, (8,)), ("embed.weight", np.float32, (8, 4)),
                                                   ("head.weight", np.int8, (2, 1, 11)), ("ids", np.int64, (0,)),
                                                   ("mask", np.bool_, (3,))]],
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_the_archive_is_byte_identical_to_iree_s_own(case, tmp_path):
    entries = _cases()[case]
    theirs = _iree_archive(tmp_path / "iree.irpa", entries)
    ours = _ours(tmp_path / "ours.irpa", entries)
    assert len(ours) == len(theirs) and len(ours) % 4096 == 0
    assert ours == theirs


def test_iree_runtime_and_turbine_read_it_back(tmp_path):
    import iree.runtime as rt
    from iree.turbine.aot import ParameterArchive

    rng = np.random.default_rng(0)
    arrays = {"a.weight": rng.standard_normal((3, 5)).astype(np.float32), "b": np.arange(7, dtype=np.int64),
              "c.packed": rng.integers(-8, 8, (2, 33), dtype=np.int8), "é": np.zeros((0, 4), np.float32)}
    entries = [IrpaEntry(name, a.nbytes, _metadata(a.dtype.name, a.shape)) for name, a in arrays.items()]
    path = tmp_path / "p.irpa"
    write_irpa(path, entries, arrays.__getitem__)

    index = rt.ParameterIndex()
    index.load(str(path))
    loaded = dict(index.items())
    assert sorted(loaded) == sorted(arrays)
    for name, array in arrays.items():
        assert loaded[name].is_file and loaded[name].length == array.nbytes
        assert bytes(loaded[name].file_view) == array.tobytes()
        assert loaded[name].metadata.decode("utf-8") == _metadata(array.dtype.name, array.shape)

    archive = ParameterArchive(str(path))
    for name, entry in archive.items():
        tensor = entry.as_tensor()
        assert tensor.shape == arrays[name].shape
        np.testing.assert_array_equal(tensor.numpy(), arrays[name])


def test_the_head_is_written_before_any_data_and_offsets_are_aligned():
    entries = [IrpaEntry("a", 10, "m"), IrpaEntry("b", 0), IrpaEntry("c", 100)]
    plan = layout(entries)
    assert plan.head[:4] == b"IRPA"
    assert all(offset % 64 == 0 for offset in plan.offsets)
    assert plan.offsets[0] >= len(plan.head) and plan.offsets[2] >= plan.offsets[0] + 10
    assert plan.total_size % 4096 == 0


def _writer(tmp_path, entries):
    return IrpaWriter(tmp_path / "w.irpa", entries)


def test_out_of_order_wrong_length_extra_and_missing_writes_are_refused(tmp_path):
    entries = [IrpaEntry("a", 4), IrpaEntry("b", 8)]
    w = _writer(tmp_path, entries)
    with pytest.raises(DsaError, match=r"parameter 'b' written out of order: entry 0 is 'a'"):
        w.write("b", bytes(8))
    with pytest.raises(DsaError, match=r"parameter 'a' has 5 bytes, the archive's entry 4"):
        w.write("a", bytes(5))
    w.write("a", bytes(4))
    with pytest.raises(DsaError, match=r"1 planned parameter\(s\) never written: b"):
        w.close()
    w = _writer(tmp_path, entries)
    w.write("a", bytes(4))
    w.write("b", np.zeros(2, np.float32))  # any buffer: a numpy array is written as its bytes
    with pytest.raises(DsaError, match=r"parameter 'c' written after all 2 entries"):
        w.write("c", b"")
    w.close()
    with pytest.raises(DsaError, match=r"parameter 'a' is listed twice"):
        _writer(tmp_path, [IrpaEntry("a", 1), IrpaEntry("a", 1)])


def test_a_failure_midway_leaves_no_archive(tmp_path):
    def produce(name):
        if name == "b":
            raise RuntimeError("the checkpoint went away")
        return bytes(4)

    out = tmp_path / "p.irpa"
    with pytest.raises(RuntimeError):
        write_irpa(out, [IrpaEntry("a", 4), IrpaEntry("b", 4)], produce)
    assert os.listdir(tmp_path) == []
    # And an archive left incomplete is refused at close, inside atomic_output: no file either.
    with pytest.raises(DsaError, match="never written"):
        with atomic_output(out) as tmp, IrpaWriter(tmp, [IrpaEntry("a", 4)]):
            pass
    assert os.listdir(tmp_path) == []
