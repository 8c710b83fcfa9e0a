"""The aarch64 builds of //models:pi0 compute what eager PyTorch computes: each aarch64 target's modules run
under qemu's user-mode emulator (the aarch64 iree-run-module of the pinned iree-base-runtime wheel, with
Debian's aarch64 C/C++ runtime as sysroot) on this x86-64 machine, and match the eager model run here.

Tolerance: that of models/pi0/pi0_test.py, |vmfb - eager| <= 2e-4 * max(1, max|eager|): fp32 on both sides,
NEON's vector width reorders reductions differently from AVX2's; a wrong lowering moves actions by O(1).
Needs toolchains/emulation/install.sh (qemu-user-static and the aarch64 cross runtime); skips, saying so,
where they are absent. .ci/run installs them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsa.core.fileio import read_json
from dsa.manifest.contract import load_manifest, project
from dsa.runtime.policy import sample_inputs
from dsa.tools.testing import aarch64_emulation_missing, eager_policy, run_aarch64, run_module_emulated, runfile

TOOLS = runfile("../dsa_runtime_aarch64/bin")
MANIFEST = runfile("manifests/pi0.yaml")
CHECKPOINT = runfile("models/pi0.safetensors")
REL_TOL = 2e-4
AARCH64 = ["aarch64-neoverse-v2", "aarch64-orin", "aarch64-pi5"]

pytestmark = pytest.mark.skipif(bool(aarch64_emulation_missing()), reason=aarch64_emulation_missing())


def test_the_emulator_runs_aarch64_code():
    proc = run_aarch64(TOOLS, "iree-run-module", "--list_devices")
    assert proc.returncode == 0 and "local-task://" in proc.stdout, proc.stderr


@pytest.mark.parametrize("target", AARCH64)
@pytest.mark.parametrize("slot,steps", [(0, 2), (2, 1)])
def test_aarch64_module_under_emulation_matches_eager(tmp_path, target, slot, steps):
    index_path = runfile(f"models/pi0_{target}.modules.json")
    index = read_json(index_path)
    record = read_json(index_path.parent / index["modules"][slot]["record"])
    bucket = record["bucket"]["size"]
    values = sample_inputs(record, {}, np.random.default_rng(1000 * slot + steps))
    values["steps"] = np.array(steps, dtype=np.int64)
    actions = run_module_emulated(TOOLS, index_path, slot, values, tmp_path)

    manifest = load_manifest(MANIFEST)
    eager, spec = eager_policy(project(manifest, "export"), {"prompt_len": bucket}, CHECKPOINT)
    with torch.no_grad():
        expected = eager(*[torch.from_numpy(np.asarray(values[s.name])) for s in spec.inputs]).numpy()
    assert actions.shape == expected.shape
    err = float(np.abs(actions - expected).max())
    assert err <= REL_TOL * max(1.0, float(np.abs(expected).max())), (target, slot, steps, err)
    # The reference is not all zeros, against which a module that computes nothing would pass.
    assert float(np.abs(expected).max()) > 0
