"""ACT for Orin's CPU (//models:act_aarch64-orin: LeRobot's ACT at its default size, ResNet-18 over one
480×640 camera) computes what eager LeRobot computes: the batch-1 module runs under qemu's user-mode emulator
(the aarch64 `iree-run-module` of the pinned iree-base-runtime wheel) on this x86-64 machine and is compared
with `predict_action_chunk` of the same policy directory, run here.

Tolerance: act_test.py's, |vmfb - eager| <= 1e-4 * max(1, max|eager|): fp32 on both sides; NEON's vector
width and the aarch64 ukernels reorder the backbone's reductions; a wrong lowering moves actions by O(1).
Needs toolchains/emulation/install.sh; skips, saying so, where it is absent (.ci/run installs it)."""

import numpy as np
import pytest

from dsa.core.fileio import read_json
from dsa.frontends.lerobot import reference_actions
from dsa.runtime.policy import sample_inputs
from dsa.tools.testing import aarch64_emulation_missing, run_module_emulated, runfile

INDEX = runfile("models/act_aarch64-orin.modules.json")
POLICY_DIR = runfile("models/act_policy/config.json").parent
TOOLS = runfile("../dsa_runtime_aarch64/bin")
REL_TOL = 1e-4

pytestmark = pytest.mark.skipif(bool(aarch64_emulation_missing()), reason=aarch64_emulation_missing())


def test_act_batch1_module_for_orin_under_emulation_matches_eager_lerobot(tmp_path):
    index = read_json(INDEX)
    assert index["target"] == "aarch64-orin"
    record = read_json(INDEX.parent / index["modules"][0]["record"])
    assert record["bucket"]["size"] == 1
    inputs = sample_inputs(record, {}, np.random.default_rng(7))
    actions = run_module_emulated(TOOLS, INDEX, 0, inputs, tmp_path)
    expected = reference_actions(POLICY_DIR, inputs, None)
    assert actions.shape == expected.shape == (1, 100, 14)
    err = float(np.abs(actions - expected).max())
    assert err <= REL_TOL * max(1.0, float(np.abs(expected).max())), err
    # The reference is not all zeros, against which a module that computes nothing would pass.
    assert float(np.abs(expected).max()) > 0.01
