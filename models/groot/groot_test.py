"""GR00T-style split policy: the linked compiled pipeline (backbone → head) matches eager PyTorch, the link
records its edges, a mismatched edge is refused naming it, and the pipeline bundle runs like the build tree.

Tolerance, elementwise max, relative to max(1, max|eager|): 2e-4 on the action chunk, 5e-4 on the backbone
features. Both sides run fp32; IREE fuses and reorders the reductions (matmul, softmax, layer norm) of the
backbone's 5 blocks and the head's 4, and the head integrates up to 10 velocity evaluations on the compiled
backbone's features, so results differ by rounding. Measured on x86-64-v3 (1, 4, 10 steps): actions
~1e-5 relative, features ~6-8e-5 relative (the prompt embeddings enter at sqrt(width) scale before the
final layer norm), so both bounds leave 7-20x headroom, while a real defect (a wrong mask, a missed step, a
swapped edge, a transposed weight) moves the outputs by O(1).
"""

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa.runtime.bundle import open_bundle
from dsa.core.errors import DsaError
from dsa.stages.export import export_model
from dsa.core.fileio import read_json
from dsa.runtime.pipeline_runtime import CompiledPipeline
from dsa.stages.link import Stage, link
from dsa.manifest.contract import load_manifest, project
from dsa.tools.testing import eager_policy, runfile

BACKBONE_MANIFEST = runfile("manifests/groot_backbone.yaml")
HEAD_MANIFEST = runfile("manifests/groot_head.yaml")
PIPELINE = runfile("models/groot.pipeline.json")
LINK = runfile("models/groot.link.json")
BUNDLE = runfile("models/groot_bundle.tar")
REL_TOL = 2e-4  # actions
FEATURES_REL_TOL = 5e-4


@pytest.fixture(scope="module")
def views():
    return (project(load_manifest(BACKBONE_MANIFEST), "export"), project(load_manifest(HEAD_MANIFEST), "export"))


@pytest.fixture(scope="module")
def pipeline():
    return CompiledPipeline(PIPELINE)


@pytest.fixture(scope="module")
def eager(views):
    backbone, bspec = eager_policy(views[0], {}, runfile("models/groot_backbone.safetensors"))
    head, hspec = eager_policy(views[1], {}, runfile("models/groot_head.safetensors"))
    return backbone, bspec, head, hspec


def sample(pipeline, seed, steps, pad=0):
    values = pipeline.sample_inputs(np.random.default_rng(seed))
    values["steps"] = np.array(steps, dtype=np.int64)
    if pad:  # a prompt shorter than the static length: padded with pad_id and masked out
        values["prompt_tokens"][:, -pad:] = 0
        values["prompt_mask"][:, -pad:] = 0
    return values


def run_eager(eager, values):
    backbone, bspec, head, hspec = eager
    with torch.no_grad():
        features, mask = backbone(*[torch.from_numpy(np.asarray(values[s.name])) for s in bspec.inputs])
        fed = dict(values, backbone_features=features.numpy(), backbone_mask=mask.numpy())
        actions = head(*[torch.from_numpy(np.asarray(fed[s.name])) for s in hspec.inputs])
    return features.numpy(), actions.numpy()


def _close(got, expected, what, tol=REL_TOL):
    err = float(np.abs(got - expected).max())
    bound = tol * max(1.0, float(np.abs(expected).max()))
    assert got.shape == expected.shape and err <= bound, (what, err, bound)
    return err


@pytest.mark.parametrize("pad", [0, 5])
@pytest.mark.parametrize("steps", [1, 4, 10])
def test_pipeline_matches_eager(pipeline, eager, views, steps, pad):
    values = sample(pipeline, seed=steps * 10 + pad, steps=steps, pad=pad)
    outputs, produced = pipeline.run(values)
    features, actions = run_eager(eager, values)
    head_view = views[1]
    assert outputs["action"].shape == (1, head_view["chunk_size"], head_view["outputs"]["action"]["dim"])
    f_err = _close(produced["groot_backbone"]["backbone_features"], features, "backbone_features", FEATURES_REL_TOL)
    a_err = _close(outputs["action"], actions, "action")
    print(f"steps={steps} pad={pad}: max|err| features {f_err:.2e}, actions {a_err:.2e}")


def test_steps_is_a_runtime_input_of_one_head_module(pipeline):
    chunks = {steps: pipeline.run(sample(pipeline, seed=3, steps=steps))[0]["action"] for steps in (1, 4, 10)}
    assert not np.allclose(chunks[1], chunks[4]) and not np.allclose(chunks[4], chunks[10])


def test_the_link_records_each_edge(views):
    data = read_json(LINK)
    width = views[0]["model"]["config"]["lm"]["width"]
    assert data["edges"] == [
        {"name": "backbone_features", "shape": [1, 32, width], "dtype": "float32",
         "producer": {"stage": "groot_backbone", "output": "backbone_features"},
         "consumer": {"stage": "groot_head", "input": "backbone_features"}},
        {"name": "backbone_mask", "shape": [1, 32], "dtype": "float32",
         "producer": {"stage": "groot_backbone", "output": "backbone_mask"},
         "consumer": {"stage": "groot_head", "input": "backbone_mask"}},
    ]
    assert [s["name"] for s in data["stages"]] == ["groot_backbone", "groot_head"]
    assert [i["name"] for i in data["inputs"]] == ["ego_view", "prompt_tokens", "prompt_mask", "state", "noise",
                                                   "steps"]
    assert data["outputs"] == [{"name": "action", "shape": [1, 16, 14], "dtype": "float32", "stage": "groot_head"}]


def test_a_head_built_for_another_backbone_width_is_refused(views, tmp_path):
    """The head's manifest expecting 96-wide features (the backbone gives 128): exported for real, then linked
    against the built backbone's record; the link names the edge and both shapes. (The Bazel build runs the
    same check in its DsaLink action.)"""
    head_view = copy.deepcopy(views[1])
    head_view["model"]["config"]["backbone"]["width"] = 96
    export_model(head_view, tmp_path / "head.mlir", tmp_path / "head.export_record.json")
    backbone = Stage.load("groot_backbone", runfile("models/groot_backbone.modules.json"))
    head = Stage.load("groot_head", tmp_path / "head.export_record.json")
    edges = [("groot_head.backbone_features", "groot_backbone.backbone_features"),
             ("groot_head.backbone_mask", "groot_backbone.backbone_mask")]
    with pytest.raises(DsaError) as e:
        link([backbone, head], edges)
    text = str(e.value)
    assert text.startswith("edge 'backbone_features' (groot_backbone.backbone_features → groot_head.backbone_features)")
    assert "[1, 32, 128] float32" in text and "[1, 32, 96] float32" in text
    # The CLI the DsaLink action runs: exit 2, one line, no link.json.
    out = tmp_path / "groot.link.json"
    proc = subprocess.run(
        [sys.executable, "-m", "dsa.stages.link", "link", "--stage", f"groot_backbone={runfile('models/groot_backbone.modules.json')}",
         "--stage", f"groot_head={tmp_path / 'head.export_record.json'}"]
        + [f"--edge={c}={p}" for c, p in edges] + ["--out", str(out)],
        capture_output=True, text=True, cwd=Path(__import__("dsa").__file__).resolve().parent.parent, check=False)
    assert proc.returncode == 2 and "edge 'backbone_features'" in proc.stderr and not out.exists()


def test_the_pipeline_bundle_holds_both_models_and_runs_like_the_build(pipeline):
    values = sample(pipeline, seed=11, steps=4)
    expected, _ = pipeline.run(values)
    with open_bundle(BUNDLE) as bundle:
        assert bundle.is_pipeline
        assert [s["name"] for s in bundle.meta["stages"]] == ["groot_backbone", "groot_head"]
        assert (bundle.root / "link.json").read_bytes() == LINK.read_bytes()
        for stage in ("groot_backbone", "groot_head"):
            for member in ("params.irpa", "lock.json", "manifest.yaml", "model.vmfb", "modules.json"):
                assert f"{stage}.{member}" in bundle.meta["files"]
        with pytest.raises(DsaError, match="is a pipeline bundle"):
            bundle.index_path
        outputs, _ = CompiledPipeline(bundle.pipeline_path).run(values)
    np.testing.assert_array_equal(outputs["action"], expected["action"])
