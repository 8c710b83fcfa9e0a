"""Transformer control: the compiled module matches eager PyTorch, with a full prompt and a padded one.

Tolerance: |vmfb - eager| <= 2e-4 * max(1, max|eager|) (fp32 both sides; four 512-wide layers reorder
reductions differently in IREE's fused kernels; measured ~1e-6 relative). A wrong mask or weight moves the
output by O(1).
"""

import numpy as np
import torch

from dsa.manifest.contract import load_manifest, project
from dsa.runtime.policy import CompiledPolicy, sample_inputs
from dsa.tools.testing import eager_policy, runfile

MANIFEST = runfile("manifests/transformer.yaml")
INDEX = runfile("models/transformer.modules.json")
CHECKPOINT = runfile("models/transformer.safetensors")
REL_TOL = 2e-4


def _compare(policy, manifest, obs):
    (actions,), _ = policy.run(obs)
    eager, spec = eager_policy(project(manifest, "export"), {}, CHECKPOINT)
    with torch.no_grad():
        expected = eager(*[torch.from_numpy(np.asarray(obs[s.name])) for s in spec.inputs]).numpy()
    assert actions.shape == expected.shape == (1, manifest["chunk_size"], manifest["outputs"]["action"]["dim"])
    err = float(np.abs(actions - expected).max())
    assert err <= REL_TOL * max(1.0, float(np.abs(expected).max())), err
    return actions


def test_vmfb_matches_eager_on_full_and_padded_prompts():
    manifest = load_manifest(MANIFEST)
    policy = CompiledPolicy(INDEX)
    obs = sample_inputs(policy.modules[0].record, {}, np.random.default_rng(7))
    full = _compare(policy, manifest, obs)
    padded = dict(obs)
    mask = np.ones_like(obs["prompt_mask"])
    mask[:, 100:] = 0
    padded["prompt_mask"] = mask
    # Masking a quarter of the prompt changes the actions: the mask reaches the compiled attention.
    assert float(np.abs(_compare(policy, manifest, padded) - full).max()) > 1e-3
