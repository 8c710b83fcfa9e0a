"""SmolVLA at its real size (SmolVLM2-500M dimensions, two 480×640 cameras, 48-token prompt, chunk 50): the
compiled module matches eager LeRobot on one observation at the default 10 flow-matching steps, within the
tolerance of the small SmolVLA (models/vla_loop_checks.py; measured 1.1e-4 on actions of magnitude ~4), and
the export is the full-size model, not a small one.
"""

import json

import pytest

from dsa.runtime.policy import CompiledPolicy
from dsa.tools.testing import runfile
from models.vla_loop_checks import MASK, check_kept_loop_matches_eager

POLICY_DIR = runfile("models/smolvla_full_policy/config.json").parent
RECORD = runfile("models/smolvla_full_model/export_record.json")


@pytest.fixture(scope="module")
def kept():
    return CompiledPolicy(runfile("models/smolvla_full.modules.json"))


def test_full_size_module_matches_eager_lerobot_at_ten_steps(kept):
    check_kept_loop_matches_eager(kept, POLICY_DIR, batch=1, steps=10, prompt=20, chunk=(50, 6))


def test_inputs_are_two_480x640_cameras_state_a_48_token_prompt_and_noise():
    record = json.loads(RECORD.read_text())
    assert [(s["name"], s["shape"]) for s in record["inputs"]] == [
        ("observation.images.top", ["batch", 3, 480, 640]),
        ("observation.images.wrist", ["batch", 3, 480, 640]),
        ("observation.state", ["batch", 6]),
        ("observation.language.tokens", ["batch", 48]),
        (MASK, ["batch", 48]),
        ("noise", ["batch", 50, 32]),
        ("steps", []),
    ]


def test_the_export_holds_the_full_size_weights():
    """SmolVLM2-500M's vision encoder (~86M), 16 text layers and embeddings (~200M) and the action expert:
    ~400M parameters in use (the LM head and final norm are never read)."""
    record = json.loads(RECORD.read_text())
    assert 390e6 <= record["parameter_count"] <= 420e6, record["parameter_count"]
    config = json.loads((POLICY_DIR / "config.json").read_text())
    assert config["num_vlm_layers"] == 16 and config["resize_imgs_with_padding"] == [512, 512]
