"""ACT through LeRobot: the compiled module matches eager LeRobot (`ACTPolicy.from_pretrained` on the same
policy directory, `predict_action_chunk`) at several batch sizes of one module, and it reads exactly the
tensors of LeRobot's model.safetensors.

Tolerance: |vmfb - eager| <= 1e-4 * max(1, max|eager|). Both sides run fp32; IREE reorders the reductions of
the ResNet-18 backbone and the 4+1-layer transformer: measured ~2e-6 absolute on actions of magnitude ~1.
A real defect (a wrong weight, a dropped camera, a mis-ordered input) moves the actions by O(1).
"""

import numpy as np
import pytest
from safetensors import safe_open

from dsa.frontends.lerobot import reference_actions
from dsa.runtime.policy import CompiledPolicy, sample_inputs
from dsa.tools.testing import runfile

INDEX = runfile("models/act.modules.json")
POLICY_DIR = runfile("models/act_policy/config.json").parent
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def policy():
    return CompiledPolicy(INDEX)


@pytest.mark.parametrize("batch", [1, 3])
def test_vmfb_matches_eager_lerobot_at_each_batch_size(policy, batch):
    inputs = sample_inputs(policy.modules[0].record, {"batch": batch}, np.random.default_rng(batch))
    (actions,), _ = policy.run(inputs)
    expected = reference_actions(POLICY_DIR, inputs, None)
    assert actions.shape == expected.shape == (batch, 100, 14)
    err = float(np.abs(actions - expected).max())
    assert err <= REL_TOL * max(1.0, float(np.abs(expected).max())), err


def test_batch_is_a_dynamic_dim_of_the_single_module(policy):
    assert len(policy.modules) == 1
    record = policy.modules[0].record
    assert record["dynamic_dims"] == {"batch": {"min": 1, "max": 65536}}
    assert all(spec["shape"][0] == "batch" for spec in record["inputs"])


def test_module_reads_the_tensors_of_lerobots_model_safetensors(policy):
    with safe_open(str(POLICY_DIR / "model.safetensors"), "np") as f:
        saved = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    params = {p["name"]: p["shape"] for p in policy.modules[0].record["parameters"]}
    assert params and all(saved.get(name) == shape for name, shape in params.items())
