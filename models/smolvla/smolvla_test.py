"""SmolVLA through LeRobot: the compiled module (flow-matching loop kept, step count a runtime input) matches
eager LeRobot (`SmolVLAPolicy.from_pretrained` on the same policy directory, `predict_action_chunk` with the
same initial noise and `num_steps` set to the runtime step count), at several batch sizes and step counts,
with padded (masked) prompt tokens.

The tolerance and the checks shared with the other kept-loop VLA tests: models/vla_loop_checks.py.
"""

import json
import re

import pytest

from dsa.frontends.lerobot import SMOLVLM_SCHEME
from dsa.runtime.policy import CompiledPolicy
from dsa.tools.testing import runfile, runnable_builds
from models.vla_loop_checks import MASK, check_kept_loop_matches_eager, check_step_count_is_a_runtime_input

POLICY_DIR = runfile("models/smolvla_policy/config.json").parent


INDEX = runfile("models/smolvla.modules.json")


# Every build (x86_64-v3 and its level x86_64-v4) this machine runs.
@pytest.fixture(scope="module", params=runnable_builds(INDEX))
def kept(request):
    return CompiledPolicy(INDEX, target=request.param)


@pytest.mark.parametrize("batch,steps,prompt", [(1, 1, 16), (2, 3, 9), (2, 10, 12)])
def test_kept_loop_matches_eager_lerobot_at_each_runtime_step_count(kept, batch, steps, prompt):
    check_kept_loop_matches_eager(kept, POLICY_DIR, batch, steps, prompt, chunk=(50, 6))


def test_step_count_is_a_runtime_input_of_one_module(kept):
    check_step_count_is_a_runtime_input(kept)


def test_inputs_are_cameras_state_prompt_and_noise():
    record = json.loads(runfile("models/smolvla_model/export_record.json").read_text())
    assert [(s["name"], s["shape"], s["dtype"]) for s in record["inputs"]] == [
        ("observation.images.top", ["batch", 3, 96, 128], "float32"),
        ("observation.images.wrist", ["batch", 3, 64, 64], "float32"),
        ("observation.images.side", ["batch", 3, 96, 128], "float32"),
        ("observation.state", ["batch", 6], "float32"),
        ("observation.language.tokens", ["batch", 16], "int64"),
        (MASK, ["batch", 16], "int64"),
        ("noise", ["batch", 50, 32], "float32"),
        ("steps", [], "int64"),
    ]
    # The VLM's LM head and final norm are never read at inference (LeRobot uses the VLM's layers only).
    assert record["unused_parameters"] == ["model.vlm_with_expert.vlm.lm_head.weight",
                                           "model.vlm_with_expert.vlm.model.text_model.norm.weight"]


def test_kept_loop_is_a_loop_with_one_action_expert_in_the_exported_mlir():
    mlir = runfile("models/smolvla_model/model.mlir").read_text()
    assert "torch.prim.Loop" in mlir
    # SiLU: the prefix's 4 VLM-layer MLPs, then once in the loop body the action expert's 4 layer MLPs and
    # the action-time MLP (4 + 5 = 9; LeRobot's loop unrolled at 10 steps has 4 + 10 * 5 = 54).
    assert len(re.findall(r"torch\.aten\.silu\b", mlir)) == 9


def test_policy_directory_names_the_hermetic_backbone_not_a_path():
    config = json.loads((POLICY_DIR / "config.json").read_text())
    assert config["vlm_model_name"].startswith(SMOLVLM_SCHEME)
    assert config["load_vlm_weights"] is False
    assert sorted(p.name for p in POLICY_DIR.iterdir()) == ["config.json", "model.safetensors"]
