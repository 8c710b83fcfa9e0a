"""Diffusion Policy through LeRobot: the compiled modules match eager LeRobot (`DiffusionPolicy.
from_pretrained` on the same policy directory, `diffusion.generate_actions` with the same initial noise,
DDIM) — the kept-loop module at several runtime step counts, the unrolled module at its config's 10 steps.
Batch is bucketed (1 and 4: static modules); a batch of 2 runs the 4-bucket, padded, with the actions cut
back. In the static modules the 1-D U-Net's convolutions are matmuls (dsa.stages.passes conv1d_to_matmul,
conv_transpose1d_to_matmul), which is what makes them fast; parity covers the rewritten graph.

Tolerance: |vmfb - eager| <= 1e-4 * max(1, max|eager|). Both sides run fp32; IREE reorders the reductions
of the ResNet-18 encoder and the 1-D U-Net, and up to 10 denoising steps compound them: measured ~1e-6
absolute. A wrong step schedule (a missed step, the wrong alpha) or a wrong weight moves actions by O(0.1-1).
"""

import re

import numpy as np
import pytest

from dsa.frontends.lerobot import reference_actions
from dsa.runtime.policy import CompiledPolicy, sample_inputs
from dsa.tools.testing import runfile, runnable_builds

POLICY_DIR = runfile("models/diffusion_policy/config.json").parent
REL_TOL = 1e-4


KEPT = runfile("models/diffusion.modules.json")
UNROLLED = runfile("models/diffusion_unrolled.modules.json")


# Every build of each (x86_64-v3 and its level x86_64-v4) this machine runs.
@pytest.fixture(scope="module", params=runnable_builds(KEPT))
def kept(request):
    return CompiledPolicy(KEPT, target=request.param)


@pytest.fixture(scope="module", params=runnable_builds(UNROLLED))
def unrolled(request):
    return CompiledPolicy(UNROLLED, target=request.param)


def observation(record, batch, seed, steps=None):
    inputs = sample_inputs(record, {"batch": batch}, np.random.default_rng(seed))
    if steps is not None:
        inputs["steps"] = np.array(steps, dtype=np.int64)
    return inputs


def assert_close(actions, expected):
    assert actions.shape == expected.shape
    err = float(np.abs(actions - expected).max())
    assert err <= REL_TOL * max(1.0, float(np.abs(expected).max())), err


@pytest.mark.parametrize("steps", [1, 3, 10])
def test_kept_loop_matches_eager_lerobot_at_each_runtime_step_count(kept, steps):
    inputs = observation(kept.modules[0].record, 2, seed=steps, steps=steps)
    (actions,), _ = kept.run(inputs)
    assert actions.shape == (2, 8, 2)
    assert_close(actions, reference_actions(POLICY_DIR, inputs, steps))


def test_step_count_is_a_runtime_input_of_one_module_per_batch_bucket(kept):
    record = kept.modules[0].record
    assert [m.bucket["size"] for m in kept.modules] == [1, 4]
    steps = next(s for s in record["inputs"] if s["name"] == "steps")
    assert steps["shape"] == [] and steps["value_range"][0] == 1
    base = observation(record, 1, seed=7)
    outputs = [kept.run(dict(base, steps=np.array(n, dtype=np.int64)))[0][0] for n in (2, 5)]
    assert float(np.abs(outputs[0] - outputs[1]).max()) > 1e-3


def test_batch_one_matches_eager_in_its_own_bucket(kept):
    inputs = observation(kept.modules[0].record, 1, seed=3, steps=10)
    (actions,), module = kept.run(inputs)
    assert module.bucket["size"] == 1 and actions.shape == (1, 8, 2)
    assert_close(actions, reference_actions(POLICY_DIR, inputs, 10))


def test_the_unets_convolutions_are_matmuls_in_every_shipped_module(kept, unrolled):
    """Each of the U-Net's 1-D convolutions (kernel 5 over 4-16 steps) and transposed convolutions is
    rewritten in the static modules; the unrolled module has one U-Net per step."""
    for policy in (kept, unrolled):
        for module in policy.modules:
            rewrites = module.record["rewrites"]
            assert rewrites["conv1d_to_matmul"] > 0 and rewrites["conv_transpose1d_to_matmul"] == 2 * (
                1 if policy is kept else 10), rewrites
    assert unrolled.modules[0].record["rewrites"]["conv1d_to_matmul"] == \
        10 * kept.modules[0].record["rewrites"]["conv1d_to_matmul"]


def test_kept_loop_is_a_loop_in_the_exported_mlir():
    kept_mlir = runfile("models/diffusion_model/model.mlir").read_text()
    unrolled_mlir = runfile("models/diffusion_unrolled_model/model.mlir").read_text()
    assert "torch.prim.Loop" in kept_mlir and "torch.prim.Loop" not in unrolled_mlir
    # The U-Net (1-D convs) appears once in the loop form, once per step unrolled.
    convs = [len(re.findall(r"torch\.aten\.conv1d", text)) for text in (kept_mlir, unrolled_mlir)]
    assert convs[1] > 5 * convs[0] > 0, convs


def test_unrolled_module_matches_eager_lerobot_at_its_config_steps(unrolled):
    record = unrolled.modules[0].record
    assert all(s["name"] != "steps" for s in record["inputs"])
    inputs = observation(record, 2, seed=11)
    (actions,), _ = unrolled.run(inputs)
    assert_close(actions, reference_actions(POLICY_DIR, inputs, 10))
