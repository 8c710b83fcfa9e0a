"""Diffusion Policy (`diffusion`): LeRobot's DiffusionPolicy as a rules_dsa model, with a tensorised DDIM step.

- Diffusion Policy: inputs `*cameras (B, n_obs_steps, C, H, W)`, `state (B, n_obs_steps, D)`
  [, `env_state`], `noise (B, horizon, action_dim)`, and with the kept loop an int64 scalar `steps`;
  output "action" (B, n_action_steps, action_dim) = `policy.diffusion.generate_actions(batch, noise=noise)`
  for that many DDIM steps. (`predict_action_chunk` is not exportable: it reads the observation deques
  that `select_action` fills.) `view["model"]["denoising_loop"]` chooses how the denoising loop is exported:

    `kept` (default): a `torch._higher_order_ops.while_loop` whose trip count is the runtime input `steps`
    (1..num_train_timesteps), so one compiled module serves any step count and the IR keeps one UNet.
    The global conditioning is computed once before the loop with the policy's own
    `DiffusionModel._prepare_global_conditioning`; the body calls the policy's own UNet
    (`policy.diffusion.unet(sample, t, global_cond=...)`) and a tensorised DDIM step (`ddim_step`).

    `unrolled`: `generate_actions` itself, traced for `num_inference_steps` (num_train_timesteps when
    None) steps: the UNet appears once per step in the IR (bigger MLIR, longer compile). Two overrides on
    the *scheduler instance* (no file of LeRobot or diffusers is edited): `set_timesteps` is replaced by one
    that sets the precomputed timesteps as a list of Python ints (iterating diffusers' timestep tensor
    under torch.export would make every `t` data-dependent), and `alphas_cumprod` /
    `final_alpha_cumprod` are set, inside forward, to tensors computed in the graph (`alphas_cumprod`),
    so no schedule table is inlined as a constant.

Scheduler facts (diffusers 0.35 `DDIMScheduler` as LeRobot constructs it: only num_train_timesteps,
beta_start, beta_end, beta_schedule, clip_sample, clip_sample_range and prediction_type are passed; the rest
are diffusers' defaults, which `export_spec` checks on the live scheduler):

* betas: `linear` = `torch.linspace(beta_start, beta_end, T, float32)`; `squaredcos_cap_v2` (LeRobot's
  default) = float64 `min(1 - abar((i+1)/T) / abar(i/T), 0.999)` with
  `abar(t) = cos((t + 0.008) / 1.008 * pi / 2) ** 2`, then cast to float32.
  `alphas_cumprod = cumprod(1 - betas)` in float32. `alphas_cumprod(...)` computes exactly this from
  `arange`/`linspace` in the graph — bit-identical to diffusers for T = 1..1000 (checked) — so the table is
  neither a parameter (the parameter stage only knows checkpoint tensors) nor an inlined constant.
  Other beta schedules are refused.
* timesteps ("leading" spacing, steps_offset 0): `ratio = T // n`, `t_k = (n - 1 - k) * ratio`, k = 0..n-1.
* step (eta = 0, set_alpha_to_one = True, no thresholding): `prev = t - ratio`,
  `a_t = alphas_cumprod[t]`, `a_prev = alphas_cumprod[prev] if prev >= 0 else 1`;
  epsilon: `x0 = (x - (1 - a_t) ** .5 * out) / a_t ** .5`, `eps = out`;
  sample: `x0 = out`, `eps = (x - a_t ** .5 * x0) / (1 - a_t) ** .5`;
  `x0 = clamp(x0, ±clip_sample_range)` if clip_sample; `x_prev = a_prev ** .5 * x0 + (1 - a_prev) ** .5 * eps`.
  `ddim_step` writes these with the same tensor ops in the same order as diffusers, so eager results are
  bit-identical.
* DDPM is refused for export (both loop forms): `DDPMScheduler.step` draws fresh Gaussian noise in every
  step with t > 0 (`randn_tensor`), which no exported graph can reproduce (IREE's RNG is not torch's), so
  the artifact could never be checked against LeRobot. A DDPM-trained Diffusion Policy can be sampled with
  DDIM (same training objective and beta schedule): set `noise_scheduler_type: DDIM` in config.json.

Reference: `diffusion.generate_actions(batch, noise)` with `steps` DDIM steps (None: the config's
num_inference_steps). The hooks of a policy module are described in dsa.frontends.lerobot's module doc.
"""

from __future__ import annotations

import math
from typing import List

from dsa.core.errors import DsaError
from dsa.frontends.lerobot.common import (OBS_ENV_STATE, OBS_IMAGES, OBS_STATE, SharedModule, building_plain,
                                          check_manifest_agrees, decode_plain, feature_shape, loaded_as_is,
                                          no_backbone_download, observation_keys, torch_nn)

TYPES = ("diffusion",)
BETA_SCHEDULES = ("squaredcos_cap_v2", "linear")
decode = decode_plain
no_download = no_backbone_download
building = building_plain
check_loaded = loaded_as_is


def classes(policy_type: str):
    """(config class, policy class)."""
    from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

    return DiffusionConfig, DiffusionPolicy


# ------------------------------------------------------------------------------------------------------
# DDIM, tensorised


def alphas_cumprod(num_train_timesteps: int, beta_schedule: str, beta_start: float, beta_end: float,
                   where: str = "config.json: beta_schedule"):
    """diffusers' `alphas_cumprod` (float32, [T]) computed with tensor ops from `arange`/`linspace`, so that
    under torch.export it is graph computation, not a constant or a parameter. Bit-identical to
    `DDIMScheduler(...).alphas_cumprod` in eager (same formula, same dtypes, same op order)."""
    import torch

    T = int(num_train_timesteps)
    if beta_schedule == "linear":
        betas = torch.linspace(beta_start, beta_end, T, dtype=torch.float32)
    elif beta_schedule == "squaredcos_cap_v2":
        i = torch.arange(T, dtype=torch.float64)

        def alpha_bar(t):  # diffusers.schedulers.scheduling_ddim.betas_for_alpha_bar, cosine
            return torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

        betas = torch.clamp(1 - alpha_bar((i + 1) / T) / alpha_bar(i / T), max=0.999).to(torch.float32)
    else:
        raise DsaError(where, f"beta schedule {beta_schedule!r} is not supported by the exported DDIM loop",
                       f"use one of {', '.join(BETA_SCHEDULES)}")
    return torch.cumprod(1.0 - betas, dim=0)


def ddim_step(model_output, timestep, step_ratio, sample, table, *, prediction_type: str, clip_sample: bool,
              clip_sample_range: float):
    """One `DDIMScheduler.step` (eta=0, set_alpha_to_one=True, no thresholding) with tensor `timestep` and
    `step_ratio` (= T // steps), written with diffusers' own expressions so eager values are bit-identical.
    `table` is `alphas_cumprod(...)`."""
    import torch

    prev_timestep = timestep - step_ratio
    alpha_prod_t = torch.index_select(table, 0, timestep.reshape(1)).reshape(())
    previous = torch.index_select(table, 0, prev_timestep.clamp(min=0).reshape(1)).reshape(())
    alpha_prod_t_prev = torch.where(prev_timestep >= 0, previous, torch.ones((), dtype=table.dtype))
    beta_prod_t = 1 - alpha_prod_t
    if prediction_type == "epsilon":
        pred_original_sample = (sample - beta_prod_t ** (0.5) * model_output) / alpha_prod_t ** (0.5)
        pred_epsilon = model_output
    elif prediction_type == "sample":
        pred_original_sample = model_output
        pred_epsilon = (sample - alpha_prod_t ** (0.5) * pred_original_sample) / beta_prod_t ** (0.5)
    else:
        raise DsaError("config.json: prediction_type", f"{prediction_type!r} is not supported",
                       "use epsilon or sample")
    if clip_sample:
        pred_original_sample = pred_original_sample.clamp(-clip_sample_range, clip_sample_range)
    # diffusers: (1 - a_prev - std_dev_t**2) ** 0.5 with std_dev_t = 0 * variance**0.5 = 0 (eta = 0).
    pred_sample_direction = (1 - alpha_prod_t_prev) ** (0.5) * pred_epsilon
    return alpha_prod_t_prev ** (0.5) * pred_original_sample + pred_sample_direction


def ddim_timesteps(num_train_timesteps: int, steps: int) -> List[int]:
    """DDIM "leading" timesteps (steps_offset 0), as `DDIMScheduler.set_timesteps(steps)` makes them."""
    ratio = num_train_timesteps // steps
    return [(steps - 1 - k) * ratio for k in range(steps)]


# Scheduler settings the tensorised step assumes (diffusers defaults; LeRobot does not set them).
_DDIM_ASSUMED = {"timestep_spacing": "leading", "steps_offset": 0, "set_alpha_to_one": True,
                 "thresholding": False, "rescale_betas_zero_snr": False, "trained_betas": None}


def _check_scheduler(policy, where: str) -> None:
    cfg = policy.config
    if cfg.noise_scheduler_type != "DDIM":
        raise DsaError(
            f"{where}: noise_scheduler_type",
            f"is {cfg.noise_scheduler_type!r}: DDPM draws fresh Gaussian noise inside every denoising step, which "
            "an exported graph cannot reproduce, so its actions could never match LeRobot's",
            "set noise_scheduler_type to DDIM (deterministic, eta=0; it samples DDPM-trained weights too)",
        )
    if cfg.beta_schedule not in BETA_SCHEDULES:
        raise DsaError(f"{where}: beta_schedule", f"beta schedule {cfg.beta_schedule!r} is not supported",
                       f"use one of {', '.join(BETA_SCHEDULES)}")
    sched = policy.diffusion.noise_scheduler.config
    for key, value in _DDIM_ASSUMED.items():
        if sched.get(key, value) != value:
            raise DsaError(f"{where}: noise scheduler {key}", f"is {sched.get(key)!r}, the export assumes {value!r}")


# ------------------------------------------------------------------------------------------------------
# Export adapters


def make_batch(cfg, keys, observations):
    import torch

    named = dict(zip(keys, observations))
    batch = {OBS_STATE: named[OBS_STATE]}
    if cfg.image_features:  # as DiffusionPolicy.select_action stacks them
        batch[OBS_IMAGES] = torch.stack([named[k] for k in cfg.image_features], dim=-4)
    if cfg.env_state_feature is not None:
        batch[OBS_ENV_STATE] = named[OBS_ENV_STATE]
    return batch


def adapter(policy, loop: str):
    import torch
    from dsa.stages.loops import kept_loop

    nn = torch_nn()
    cfg = policy.config
    model = policy.diffusion
    n_keys = len(observation_keys(cfg))
    schedule = (cfg.num_train_timesteps, cfg.beta_schedule, cfg.beta_start, cfg.beta_end)
    step_options = dict(prediction_type=cfg.prediction_type, clip_sample=cfg.clip_sample,
                        clip_sample_range=cfg.clip_sample_range)
    start, end = cfg.n_obs_steps - 1, cfg.n_obs_steps - 1 + cfg.n_action_steps

    class DiffusionKeptAdapter(nn.Module):
        """forward(*observations, noise, steps): `steps` DDIM steps in a while_loop around the policy's UNet."""

        def __init__(self):
            super().__init__()
            SharedModule.share(self, policy)
            self.keys = observation_keys(cfg)

        def forward(self, *args):
            observations, noise, steps = args[:n_keys], args[n_keys], args[n_keys + 1]
            global_cond = model._prepare_global_conditioning(make_batch(cfg, self.keys, observations))
            table = alphas_cumprod(*schedule)
            ratio = cfg.num_train_timesteps // steps

            def step(i, sample):
                t = (steps - 1 - i) * ratio
                out = model.unet(sample, t.reshape(1).expand(sample.shape[0]), global_cond=global_cond)
                return ddim_step(out, t, ratio, sample, table, **step_options)

            return kept_loop(steps, step, noise)[:, start:end]

    class DiffusionUnrolledAdapter(nn.Module):
        """forward(*observations, noise) = policy.diffusion.generate_actions(batch, noise) for the config's
        number of inference steps, with the scheduler-instance overrides described in the module doc."""

        def __init__(self):
            super().__init__()
            SharedModule.share(self, policy)
            self.keys = observation_keys(cfg)
            sched = model.noise_scheduler
            sched.set_timesteps(model.num_inference_steps)  # diffusers' own timesteps, pinned as ints
            fixed = [int(t) for t in sched.timesteps]
            assert fixed == ddim_timesteps(cfg.num_train_timesteps, model.num_inference_steps), fixed

            def set_timesteps(num_inference_steps=None, device=None, timesteps=None):
                sched.timesteps = list(fixed)

            sched.set_timesteps = set_timesteps

        def forward(self, *args):
            observations, noise = args[:n_keys], args[n_keys]
            sched = model.noise_scheduler
            saved = sched.alphas_cumprod, sched.final_alpha_cumprod
            sched.alphas_cumprod = alphas_cumprod(*schedule)
            sched.final_alpha_cumprod = torch.ones((), dtype=torch.float32)
            try:
                return model.generate_actions(make_batch(cfg, self.keys, observations), noise=noise)
            finally:
                sched.alphas_cumprod, sched.final_alpha_cumprod = saved

    return DiffusionKeptAdapter() if loop == "kept" else DiffusionUnrolledAdapter()


def precheck(config) -> None:
    """DDPM is refused before the (possibly large) policy is built; `_check_scheduler` repeats it on the live
    object."""
    if config.get("noise_scheduler_type") != "DDIM":
        raise DsaError(
            "config.json: noise_scheduler_type",
            f"is {config.get('noise_scheduler_type')!r}: DDPM draws fresh Gaussian noise inside every denoising "
            "step, which an exported graph cannot reproduce, so its actions could never match LeRobot's",
            "set noise_scheduler_type to DDIM (deterministic, eta=0; it samples DDPM-trained weights too)",
        )


def export(view: dict, policy, loop: str, batch: int):
    """Diffusion Policy's export: observations `(B, n_obs_steps, ...)`, `noise (B, horizon, action_dim)` and,
    with the kept loop, the int64 scalar `steps`."""
    from dsa.stages.spec import ExportSpec, InputSpec

    cfg = policy.config
    keys = observation_keys(cfg)
    action_dim = cfg.action_feature.shape[0]
    check_manifest_agrees(view, cfg, keys, action_dim, chunk_field="n_action_steps")
    _check_scheduler(policy, "config.json")
    dyn = {0: "batch"}
    obs = cfg.n_obs_steps
    inputs = [InputSpec(k, (batch, obs) + feature_shape(cfg, k), "float32", dynamic=dyn) for k in keys]
    inputs.append(InputSpec("noise", (batch, cfg.horizon, action_dim), "float32", dynamic=dyn))
    if loop == "kept":
        inputs.append(InputSpec("steps", (), "int64", value_range=(1, cfg.num_train_timesteps)))
    return ExportSpec(module=adapter(policy, loop), inputs=inputs, outputs=["action"],
                      dim_minimums={"batch": 1})


def reference(policy, tensors, steps):
    """LeRobot's eager `diffusion.generate_actions(batch, noise=tensors["noise"])` with `steps` denoising
    steps (None: the config's num_inference_steps), under torch.no_grad."""
    cfg = policy.config
    keys = observation_keys(cfg)
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise DsaError("reference_actions: inputs", f"missing {', '.join(missing)}")
    if "noise" not in tensors:
        raise DsaError("reference_actions: inputs", "missing noise")
    if steps is not None:
        policy.diffusion.num_inference_steps = int(steps)  # read by conditional_sample's set_timesteps
    batch = make_batch(cfg, keys, [tensors[k] for k in keys])
    return policy.diffusion.generate_actions(batch, noise=tensors["noise"])
