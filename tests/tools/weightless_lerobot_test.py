"""LeRobot's own policy classes built without their weights (dsa.stages.weightless) export exactly the MLIR and
export record they export when built with LeRobot's random initialisation: ACT, Diffusion Policy (kept and
unrolled loops), SmolVLA, PI0 and PI0.5 at small sizes."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network

import json

import pytest

import dsa.frontends.lerobot as lerobot
from dsa.stages.export import export_model
from lerobot_test import SMALL_ACT, SMALL_DIFFUSION, SMALL_PI, SMALL_SMOLVLA, _view


def _export_view(config, loop):
    view = _view(config, loop)
    view["model"]["entry_point"] = "dsa.frontends.lerobot:export_spec"
    view.update(model_id="weightless", framework="lerobot", schema_major=1, bucket_dims=[],
                quant_scheme={"kind": "none"})
    return view


@pytest.mark.parametrize("policy_type,config,loop", [
    ("act", SMALL_ACT, "kept"),
    ("diffusion", SMALL_DIFFUSION, "kept"),
    ("diffusion", SMALL_DIFFUSION, "unrolled"),
    ("smolvla", SMALL_SMOLVLA, "kept"),
    ("pi0", SMALL_PI, "kept"),
    ("pi05", SMALL_PI, "kept"),
])
def test_lerobot_policy_exports_the_same_without_its_weights(policy_type, config, loop, tmp_path):
    # config.json as LeRobot saves it (every field, defaults included): no weights are needed to export.
    lerobot.make_config(policy_type, config)._save_pretrained(tmp_path)
    view = _export_view(json.loads((tmp_path / "config.json").read_text()), loop)
    outputs = {}
    for weightless in (False, True):
        out = tmp_path / str(weightless)
        export_model(view, out / "model.mlir", out / "record.json", weightless=weightless)
        outputs[weightless] = ((out / "model.mlir").read_bytes(), (out / "record.json").read_bytes())
    assert outputs[True][0] == outputs[False][0], "MLIR differs"
    assert outputs[True][1] == outputs[False][1], "export record differs"
