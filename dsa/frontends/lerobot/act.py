"""ACT (`act`): LeRobot's ACTPolicy as a rules_dsa model.

Export: `forward(*cameras (B,C,H,W), state (B,D)[, env_state]) = policy.predict_action_chunk(batch)` →
"action" (B, chunk_size, action_dim). ACT's inference is one pass (the VAE encoder is unused in eval), so
`denoising_loop` does not apply. Reference: `predict_action_chunk`, no steps.

The hooks of a policy module are described in dsa.frontends.lerobot's module doc.
"""

from __future__ import annotations

from dsa.core.errors import DsaError
from dsa.frontends.lerobot.common import (SharedModule, building_plain, check_manifest_agrees, decode_plain,
                                          feature_shape, loaded_as_is, no_backbone_download, no_precheck,
                                          observation_keys, torch_nn)

TYPES = ("act",)
decode = decode_plain
no_download = no_backbone_download
building = building_plain
check_loaded = loaded_as_is
precheck = no_precheck


def classes(policy_type: str):
    """(config class, policy class)."""
    from lerobot.policies.act.configuration_act import ACTConfig
    from lerobot.policies.act.modeling_act import ACTPolicy

    return ACTConfig, ACTPolicy


def adapter(policy):
    nn = torch_nn()

    class ACTAdapter(nn.Module):
        """forward(*observations) = policy.predict_action_chunk(batch) → (B, chunk_size, action_dim)."""

        def __init__(self):
            super().__init__()
            SharedModule.share(self, policy)
            self.keys = observation_keys(policy.config)

        def forward(self, *observations):
            return self.policy.predict_action_chunk(dict(zip(self.keys, observations)))

    return ACTAdapter()


def export(view: dict, policy, loop: str, batch: int):
    """ACT's export: one input per observation key (cameras, state, environment state), batch dynamic."""
    from dsa.stages.spec import ExportSpec, InputSpec

    cfg = policy.config
    keys = observation_keys(cfg)
    check_manifest_agrees(view, cfg, keys, cfg.action_feature.shape[0])
    dyn = {0: "batch"}
    inputs = [InputSpec(k, (batch,) + feature_shape(cfg, k), "float32", dynamic=dyn) for k in keys]
    return ExportSpec(module=adapter(policy), inputs=inputs, outputs=["action"], dim_minimums={"batch": 1})


def reference(policy, tensors, steps):
    """LeRobot's eager `predict_action_chunk` (under torch.no_grad)."""
    keys = observation_keys(policy.config)
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise DsaError("reference_actions: inputs", f"missing {', '.join(missing)}")
    if steps is not None:
        raise DsaError("reference_actions: steps", "ACT has no denoising steps", "pass steps=None")
    return policy.predict_action_chunk({k: tensors[k] for k in keys})
