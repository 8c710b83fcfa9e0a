"""LeRobot's PI0.5 (policy type `pi05`) through rules_dsa: the compiled module (flow-matching loop kept, step
count a runtime input) matches eager LeRobot (`PI05Policy.from_pretrained` on the same policy directory,
`predict_action_chunk` with the same initial noise and `num_steps` set to the runtime step count), at several
batch sizes and step counts, with padded (masked) prompt tokens.

Tolerance: |vmfb - eager| <= 1e-4 * max(1, max|eager|). Both sides run fp32, but IREE reorders the
reductions of SigLIP, the Gemma VLM and the Gemma action expert, demotes the float64 sinusoidal time
embedding to float32, and the exported image resize is `dsa.lerobot.bilinear_resize` (<= 3e-6 from ATen's
kernel). A wrong step count, a wrong time or a wrong weight moves actions by O(0.1-1).
"""

import json
import re

import numpy as np
import pytest

from dsa.lerobot import reference_actions
from dsa.lerobot_pi import GEMMA_SCHEME
from dsa.runtime import CompiledPolicy, sample_inputs
from dsa.testing import runfile

POLICY_DIR = runfile("models/pi05_policy/config.json").parent
REL_TOL = 1e-4
MASK = "observation.language.attention_mask"


@pytest.fixture(scope="module")
def kept():
    return CompiledPolicy(runfile("models/pi05.modules.json"))


def observation(record, batch, seed, steps=None, prompt=8):
    inputs = sample_inputs(record, {"batch": batch}, np.random.default_rng(seed))
    inputs[MASK][:, prompt:] = 0  # a prompt shorter than tokenizer_max_length: the rest is padding
    if steps is not None:
        inputs["steps"] = np.array(steps, dtype=np.int64)
    return inputs


def assert_close(actions, expected):
    assert actions.shape == expected.shape
    err = float(np.abs(actions - expected).max())
    assert err <= REL_TOL * max(1.0, float(np.abs(expected).max())), err


@pytest.mark.parametrize("batch,steps,prompt", [(1, 1, 8), (2, 3, 5), (2, 10, 6)])
def test_kept_loop_matches_eager_lerobot_at_each_runtime_step_count(kept, batch, steps, prompt):
    inputs = observation(kept.modules[0].record, batch, seed=steps, steps=steps, prompt=prompt)
    (actions,), _ = kept.run(inputs)
    assert actions.shape == (batch, 5, 6)
    assert_close(actions, reference_actions(POLICY_DIR, inputs, steps))


def test_step_count_is_a_runtime_input_of_one_module(kept):
    record = kept.modules[0].record
    assert len(kept.modules) == 1
    steps = next(s for s in record["inputs"] if s["name"] == "steps")
    assert steps["shape"] == [] and steps["value_range"][0] == 1
    base = observation(record, 1, seed=7)
    outputs = [kept.run(dict(base, steps=np.array(n, dtype=np.int64)))[0][0] for n in (2, 5)]
    assert float(np.abs(outputs[0] - outputs[1]).max()) > 1e-3


def test_inputs_are_cameras_prompt_and_noise_without_state():
    record = json.loads(runfile("models/pi05_model/export_record.json").read_text())
    assert [(s["name"], s["shape"], s["dtype"]) for s in record["inputs"]] == [
        ("observation.images.top", ["batch", 3, 64, 80], "float32"),
        ("observation.images.wrist", ["batch", 3, 56, 56], "float32"),
        # No state: PI0.5 reads it through its prompt tokens (LeRobot's pre-processor).
        ("observation.language.tokens", ["batch", 8], "int64"),
        (MASK, ["batch", 8], "int64"),
        ("noise", ["batch", 5, 8], "float32"),
        ("steps", [], "int64"),
    ]
    # The tensor names are LeRobot's (model.safetensors'); the action expert's LM head is never read.
    assert record["unused_parameters"] == ["model.paligemma_with_expert.gemma_expert.lm_head.weight"]
    names = {p["name"] for p in record["parameters"]}
    assert "model.paligemma_with_expert.paligemma.lm_head.weight" in names  # the tied token embedding


def test_kept_loop_is_a_loop_with_one_action_expert_in_the_exported_mlir():
    mlir = runfile("models/pi05_model/model.mlir").read_text()
    assert "torch.prim.Loop" in mlir
    # GELU (tanh): 4 in the prefix (SigLIP and the Gemma VLM), then once in the loop body the action expert's
    # 2 layer MLPs (4 + 2 = 6; LeRobot's loop unrolled at 10 steps has 4 + 10 * 2 = 24).
    assert len(re.findall(r"torch\.aten\.gelu\b", mlir)) == 6


def test_policy_directory_names_the_hermetic_sizes():
    config = json.loads((POLICY_DIR / "config.json").read_text())
    assert config["type"] == "pi05"
    assert config["paligemma_variant"].startswith(GEMMA_SCHEME)
    assert config["action_expert_variant"].startswith(GEMMA_SCHEME)
    assert sorted(p.name for p in POLICY_DIR.iterdir()) == ["config.json", "model.safetensors"]
