"""SmolVLA through LeRobot: the compiled module (flow-matching loop kept, step count a runtime input) matches
eager LeRobot (`SmolVLAPolicy.from_pretrained` on the same policy directory, `predict_action_chunk` with the
same initial noise and `num_steps` set to the runtime step count), at several batch sizes and step counts,
with padded (masked) prompt tokens.

Tolerance: |vmfb - eager| <= 1e-4 * max(1, max|eager|). Both sides run fp32, but IREE reorders the
reductions of the vision encoder, the VLM and the action expert, demotes SmolVLA's float64 sinusoidal
time embedding to float32, and the exported image resize is `dsa.lerobot.bilinear_resize` (<= 3e-6 from
ATen's kernel); measured <= 3e-5 absolute on actions of magnitude ~3. A wrong step count, a wrong time or
a wrong weight moves actions by O(0.1-1).
"""

import json
import re

import numpy as np
import pytest

from dsa.lerobot import SMOLVLM_SCHEME, reference_actions
from dsa.runtime import CompiledPolicy, sample_inputs
from dsa.testing import runfile

POLICY_DIR = runfile("models/smolvla_policy/config.json").parent
REL_TOL = 1e-4
MASK = "observation.language.attention_mask"


@pytest.fixture(scope="module")
def kept():
    return CompiledPolicy(runfile("models/smolvla.modules.json"))


def observation(record, batch, seed, steps=None, prompt=16):
    inputs = sample_inputs(record, {"batch": batch}, np.random.default_rng(seed))
    inputs[MASK][:, prompt:] = 0  # a prompt shorter than tokenizer_max_length: the rest is padding
    if steps is not None:
        inputs["steps"] = np.array(steps, dtype=np.int64)
    return inputs


def assert_close(actions, expected):
    assert actions.shape == expected.shape
    err = float(np.abs(actions - expected).max())
    assert err <= REL_TOL * max(1.0, float(np.abs(expected).max())), err


@pytest.mark.parametrize("batch,steps,prompt", [(1, 1, 16), (2, 3, 9), (2, 10, 12)])
def test_kept_loop_matches_eager_lerobot_at_each_runtime_step_count(kept, batch, steps, prompt):
    inputs = observation(kept.modules[0].record, batch, seed=steps, steps=steps, prompt=prompt)
    (actions,), _ = kept.run(inputs)
    assert actions.shape == (batch, 10, 6)
    assert_close(actions, reference_actions(POLICY_DIR, inputs, steps))


def test_step_count_is_a_runtime_input_of_one_module(kept):
    record = kept.modules[0].record
    assert len(kept.modules) == 1
    steps = next(s for s in record["inputs"] if s["name"] == "steps")
    assert steps["shape"] == [] and steps["value_range"][0] == 1
    base = observation(record, 1, seed=7)
    outputs = [kept.run(dict(base, steps=np.array(n, dtype=np.int64)))[0][0] for n in (2, 5)]
    assert float(np.abs(outputs[0] - outputs[1]).max()) > 1e-3


def test_inputs_are_cameras_state_prompt_and_noise():
    record = json.loads(runfile("models/smolvla_model/export_record.json").read_text())
    assert [(s["name"], s["shape"], s["dtype"]) for s in record["inputs"]] == [
        ("observation.images.top", ["batch", 3, 96, 128], "float32"),
        ("observation.images.wrist", ["batch", 3, 64, 64], "float32"),
        ("observation.state", ["batch", 6], "float32"),
        ("observation.language.tokens", ["batch", 16], "int64"),
        (MASK, ["batch", 16], "int64"),
        ("noise", ["batch", 10, 32], "float32"),
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
