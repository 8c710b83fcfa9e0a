"""DsaCheckpoint streamed (dsa.stages.checkpoint.make_checkpoint): the seeded stand-in checkpoints keep their
bytes, and need only the model's structure.

What it proves: make_checkpoint, which now generates and writes one tensor at a time, writes exactly the
files the manifests pin (checkpoint.sha256 of manifests/pi0.yaml, custom_op.yaml, and groot_head.yaml with its
seed 1 — digests taken from the previous, all-in-memory implementation), and the same bytes as
safetensors' save_file of all the values at once; the plan it generates from (each state_dict entry's name,
shape and owning module type) is the same when the model is built on the meta device, without values; and
each tensor's values, drawn in chunks into its float32 array (so a 2 GB embedding needs 2 GB, not 10), are
those of one float64 draw of the whole tensor, scaled and cast, as first written.
"""

from __future__ import annotations

import pytest
from safetensors.numpy import save_file

from dsa.core.fileio import sha256_file
from dsa.manifest.contract import load_manifest, project
from dsa.stages.checkpoint import init_plan, init_values, make_checkpoint
from dsa.stages.export import NominalDims, load_entry_point
from dsa.tools.testing import runfile

SEEDED = [("pi0", 0), ("custom_op", 0), ("groot_head", 1)]


def _pythonpath():
    return [str(runfile(".").resolve())]


@pytest.mark.parametrize("name,seed", SEEDED, ids=[name for name, _ in SEEDED])
def test_seeded_checkpoints_keep_the_bytes_their_manifests_pin(tmp_path, name, seed):
    manifest = load_manifest(runfile(f"manifests/{name}.yaml"))
    view = project(manifest, "export")
    out = tmp_path / f"{name}.safetensors"
    make_checkpoint(view, out, seed=seed, pythonpath=_pythonpath())
    assert sha256_file(out) == manifest["checkpoint"]["sha256"]
    # And the all-at-once form gives the same bytes.
    spec = load_entry_point(view["model"]["entry_point"], _pythonpath())(view, NominalDims())
    save_file(init_values(spec.module, seed), str(tmp_path / "all.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "all.safetensors").read_bytes() == out.read_bytes()


def test_the_plan_needs_no_tensor_values(tmp_path):
    import torch

    view = project(load_manifest(runfile("manifests/pi0.yaml")), "export")
    entry = load_entry_point(view["model"]["entry_point"], _pythonpath())
    real = init_plan(entry(view, NominalDims()).module)
    with torch.device("meta"):
        module = entry(view, NominalDims()).module
    assert any(p.is_meta for p in module.parameters())
    assert init_plan(module) == real


@pytest.mark.parametrize("owner,pname,shape", [(None, "bias", (1000,)), ("linear", "weight", (37, 29)),
                                               ("embedding", "weight", (50, 16)), ("layernorm", "weight", (9,)),
                                               ("layernorm", "bias", (9,)), (None, "scale", ())])
def test_values_drawn_in_chunks_are_those_of_one_draw(owner, pname, shape):
    import math
    import zlib

    import numpy as np
    from torch import nn

    from dsa.stages.checkpoint import init_value

    kind = {"linear": nn.Linear, "embedding": nn.Embedding, "layernorm": nn.LayerNorm, None: None}[owner]
    whole = init_value("t", shape, kind, pname, 3, chunk=1 << 30)
    assert whole.dtype == np.float32 and whole.shape == shape
    np.testing.assert_array_equal(init_value("t", shape, kind, pname, 3, chunk=7), whole)
    # The formula as it was first written: one float64 draw, scaled, cast.
    rng = np.random.default_rng([3, zlib.crc32(b"t")])
    if owner == "layernorm":
        expected = np.ones(shape) if pname == "weight" else np.zeros(shape)
    elif pname == "bias" or owner is None:
        expected = rng.standard_normal(shape) * 0.02
    elif owner == "embedding":
        expected = rng.standard_normal(shape) / math.sqrt(shape[-1])
    else:
        expected = rng.standard_normal(shape) / math.sqrt(int(np.prod(shape[1:])))
    assert whole.tobytes() == expected.astype(np.float32).tobytes()
