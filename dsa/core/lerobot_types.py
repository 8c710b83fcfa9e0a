"""The LeRobot policy types rules_dsa builds, one record per type: the one owner of what each reader needs to
know about a type. Torch-free and LeRobot-free (plain data), so that the pipeline runtime and its processors,
which run in torch-free bundles, read the same table as the front end, deploy, the tuner and the benchmark.

Modelled on LeRobot's `PreTrainedConfig.register_subclass`: a type is registered under its name (config.json's
`type`) once, and every reader looks its facts up instead of testing the name:

  dsa.frontends.lerobot          imports `frontend` (the module that exports the type, builds and checks it)
  dsa.frontends.lerobot_processors   `tokenises`: the preprocessor needs a tokenizer directory
  dsa.runtime.policy_pipeline    `kind`, `obs_steps_field`, `temporal_ensemble`: the action loop's facts
  dsa.runtime.processors         `processor_steps`: the type's own LeRobot processor steps, each implemented
                                 there (a test checks every one is)
  dsa.tools.bench                `noise` (how eager LeRobot takes the runtime's noise), `kind` (a DDIM loop:
                                 ONNX Runtime also gets the front end's unrolled form)

Adding a type: one `register(...)` here and its front-end module `dsa/frontends/lerobot/<frontend>.py`
(docs/architecture.md, "A LeRobot policy type").
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

# How a type computes its action chunk from an observation.
KINDS = (
    "single_pass",  # one network call (ACT)
    "denoising",    # a DDIM denoising loop around a U-Net step (Diffusion Policy); the runtime draws its noise
    "flow",         # a flow-matching loop around a VLM + action expert (SmolVLA, PI0, PI0.5); likewise
)
# How LeRobot's eager policy takes the noise the runtime draws: none, `predict_action_chunk(batch, noise=...)`,
# or its `model.sample_noise`.
NOISE_HOOKS = ("none", "argument", "sample_noise")


@dataclasses.dataclass(frozen=True)
class LeRobotType:
    """One LeRobot policy type. `name`: config.json's `type`; `frontend`: the module under dsa.frontends.lerobot
    that exports it (one module may serve several types); `kind`: one of KINDS; `tokenises`: its preprocessor
    tokenises the task text; `obs_steps_field`: the config field giving how many observation steps the network
    takes (None: one); `temporal_ensemble`: it has ACT's `temporal_ensemble_coeff`; `noise`: one of NOISE_HOOKS;
    `processor_steps`: the registry names of its own LeRobot processor steps (beyond the shared ones)."""

    name: str
    frontend: str
    kind: str
    tokenises: bool = False
    obs_steps_field: Optional[str] = None
    temporal_ensemble: bool = False
    noise: str = "none"
    processor_steps: Tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"LeRobot type {self.name!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.noise not in NOISE_HOOKS:
            raise ValueError(f"LeRobot type {self.name!r}: noise {self.noise!r} is not one of {', '.join(NOISE_HOOKS)}")
        if (self.kind == "single_pass") != (self.noise == "none"):
            raise ValueError(f"LeRobot type {self.name!r}: a {self.kind} policy takes noise "
                             f"{'never' if self.kind == 'single_pass' else 'from the runtime'}; noise is {self.noise!r}")

    @property
    def draws_noise(self) -> bool:
        """Whether the runtime draws the network's noise (a denoising or flow loop)."""
        return self.kind != "single_pass"


LEROBOT_TYPES: Dict[str, LeRobotType] = {}


def register(record: LeRobotType) -> LeRobotType:
    """Adds a type to LEROBOT_TYPES; a name registered twice is refused."""
    if record.name in LEROBOT_TYPES:
        raise ValueError(f"LeRobot type {record.name!r} is registered twice")
    LEROBOT_TYPES[record.name] = record
    return record


register(LeRobotType("act", frontend="act", kind="single_pass", temporal_ensemble=True))
register(LeRobotType("diffusion", frontend="diffusion", kind="denoising", obs_steps_field="n_obs_steps",
                     noise="argument"))
register(LeRobotType("smolvla", frontend="smolvla", kind="flow", tokenises=True, noise="sample_noise",
                     processor_steps=("smolvla_new_line_processor",)))
register(LeRobotType("pi0", frontend="pi", kind="flow", tokenises=True, noise="sample_noise",
                     processor_steps=("pi0_new_line_processor",)))
register(LeRobotType("pi05", frontend="pi", kind="flow", tokenises=True, noise="sample_noise",
                     processor_steps=("pi05_prepare_state_tokenizer_processor_step",)))

# The supported type names, in registration order.
LEROBOT_TYPE_NAMES: Tuple[str, ...] = tuple(LEROBOT_TYPES)


def lerobot_type(name: object) -> Optional[LeRobotType]:
    """The record of a supported type, or None."""
    return LEROBOT_TYPES.get(name) if isinstance(name, str) else None
