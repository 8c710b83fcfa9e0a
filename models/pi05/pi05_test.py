"""LeRobot's PI0.5 (policy type `pi05`) through rules_dsa: the compiled module (flow-matching loop kept, step
count a runtime input) matches eager LeRobot (`PI05Policy.from_pretrained` on the same policy directory,
`predict_action_chunk` with the same initial noise and `num_steps` set to the runtime step count), at several
batch sizes and step counts, with padded (masked) prompt tokens.

The tolerance and the checks shared with the other kept-loop VLA tests: models/vla_loop_checks.py.
"""

import json
import re

import pytest

from dsa.frontends.lerobot.third_party.openpi_transformers import GEMMA_SCHEME
from dsa.runtime.policy import CompiledPolicy
from dsa.tools.testing import runfile, runnable_builds
from models.vla_loop_checks import MASK, check_kept_loop_matches_eager, check_step_count_is_a_runtime_input

POLICY_DIR = runfile("models/pi05_policy/config.json").parent


INDEX = runfile("models/pi05.modules.json")


# Every build (x86_64-v3 and its level x86_64-v4) this machine runs.
@pytest.fixture(scope="module", params=runnable_builds(INDEX))
def kept(request):
    return CompiledPolicy(INDEX, target=request.param)


@pytest.mark.parametrize("batch,steps,prompt", [(1, 1, 8), (2, 3, 5), (2, 10, 6)])
def test_kept_loop_matches_eager_lerobot_at_each_runtime_step_count(kept, batch, steps, prompt):
    check_kept_loop_matches_eager(kept, POLICY_DIR, batch, steps, prompt, chunk=(50, 6))


def test_step_count_is_a_runtime_input_of_one_module(kept):
    check_step_count_is_a_runtime_input(kept)


def test_inputs_are_cameras_prompt_and_noise_without_state():
    record = json.loads(runfile("models/pi05_model/export_record.json").read_text())
    assert [(s["name"], s["shape"], s["dtype"]) for s in record["inputs"]] == [
        ("observation.images.top", ["batch", 3, 64, 80], "float32"),
        ("observation.images.wrist", ["batch", 3, 56, 56], "float32"),
        ("observation.images.side", ["batch", 3, 64, 80], "float32"),
        # No state: PI0.5 reads it through its prompt tokens (LeRobot's pre-processor).
        ("observation.language.tokens", ["batch", 8], "int64"),
        (MASK, ["batch", 8], "int64"),
        ("noise", ["batch", 50, 8], "float32"),
        ("steps", [], "int64"),
    ]
    # The tensor names are LeRobot's (model.safetensors'); the action expert's LM head is never read.
    assert record["unused_parameters"] == ["model.paligemma_with_expert.gemma_expert.lm_head.weight"]
    names = {p["name"] for p in record["parameters"]}
    assert "model.paligemma_with_expert.paligemma.lm_head.weight" in names  # the tied token embedding


def test_kept_loop_is_a_loop_with_one_action_expert_in_the_exported_mlir():
    mlir = runfile("models/pi05_model/model.mlir").read_text()
    assert "torch.prim.Loop" in mlir
    # GELU (tanh): 5 in the prefix (SigLIP's one layer once per camera, three cameras, and the Gemma VLM's 2
    # layers), then once in the loop body the action expert's 2 layer MLPs (5 + 2 = 7; LeRobot's loop unrolled
    # at 10 steps has 5 + 10 * 2 = 25).
    assert len(re.findall(r"torch\.aten\.gelu\b", mlir)) == 7


def test_policy_directory_names_the_hermetic_sizes():
    config = json.loads((POLICY_DIR / "config.json").read_text())
    assert config["type"] == "pi05"
    assert config["paligemma_variant"].startswith(GEMMA_SCHEME)
    assert config["action_expert_variant"].startswith(GEMMA_SCHEME)
    assert sorted(p.name for p in POLICY_DIR.iterdir()) == ["config.json", "model.safetensors"]
