"""LeRobot policies (ACT, Diffusion Policy, SmolVLA, PI0, PI0.5) as rules_dsa models: random-init checkpoints,
export adapters, eager reference outputs.

Three things, all through LeRobot's own classes (lerobot 0.4.x), never a re-implementation of a policy:

* `init_policy` / `python -m dsa.frontends.lerobot.adapter init`: builds a policy of a given type with random weights from a
  config JSON (LeRobot's config class, `device="cpu"`, no pretrained backbone download), seeds torch, and
  writes the policy's own `save_pretrained` output: exactly `config.json` + `model.safetensors`, byte for
  byte the same on every run and in any directory.

* `export_spec(view, dims)`: the entry point of manifests with `framework: lerobot`. The export tool puts
  the policy's parsed `config.json` into `view["model"]["pretrained_config"]`; `policy_from_config` rebuilds
  the policy from it (random init: the weights are externalised by the export and later read from
  `model.safetensors` by name). The returned module is an *adapter*: it registers the policy's own
  submodules, parameters and buffers as its own, so `adapter.state_dict()` has exactly the keys of the
  policy's `state_dict()`, which are exactly the tensor names in `model.safetensors`; the policy object
  itself is kept outside the module tree (`object.__setattr__`), so no name gets a prefix.

  - ACT: `forward(*cameras (B,C,H,W), state (B,D)[, env_state]) = policy.predict_action_chunk(batch)` →
    "action" (B, chunk_size, action_dim). ACT's inference is one pass (the VAE encoder is unused in eval).
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

  - SmolVLA: inputs `*cameras (B,C,H,W)`, `observation.state (B,D)`, `observation.language.tokens` and
    `observation.language.attention_mask` (B, tokenizer_max_length) int64 (mask 0/1; LeRobot's bool mask is
    `mask != 0`), `noise (B, chunk_size, max_action_dim)`, and with the kept loop an int64 scalar `steps`;
    output "action" (B, chunk_size, action_dim).

      `kept` (default): the prefix (images, language, state) runs once through the VLM with LeRobot's own
      `embed_prefix` and `vlm_with_expert.forward(fill_kv_cache=True)`, as `sample_actions` does; then a
      while_loop of `steps` Euler steps (dt = -1/steps, time = 1 + i*dt, as sample_actions computes them in
      float64) calls the policy's own `VLAFlowMatching.denoise_step`. The KV cache (one key and one value
      tensor per VLM layer) is closed over by the loop body; torch lifts those tensors into loop inputs.

      `unrolled`: `policy.predict_action_chunk(batch, noise=noise)` itself, traced for config.num_steps.

    Three overrides on the *policy instance* (no file of LeRobot or transformers is edited), each checked or
    tested against the original: (1) the SmolVLM vision embeddings' forward for the full patch mask SmolVLA
    always uses (transformers' own loops over the batch and sizes aranges by mask sums); (2) SmolVLA's
    `embed_prefix` / `embed_suffix` run with `torch.tensor(<flat list>)` made by `torch.full`/`torch.cat`
    (a constant would be inlined in the MLIR, and torch 2.14 cannot functionalise a while_loop body that
    creates one); (3) `prepare_images` resizes with `bilinear_resize` (IREE lowers neither
    `aten.upsample_bilinear2d` nor its decomposition; <= 3e-6 from ATen's kernel).

    SmolVLA's VLM backbone is named by `vlm_model_name`. `dsa-smolvlm:<json of SmolVLMConfig sizes>`
    (`smolvlm_name`) is a hermetic SmolVLM: whenever LeRobot builds the policy (init, export,
    `reference_actions`) dsa.frontends.lerobot.adapter writes its config.json and processor files (a synthetic tokenizer of
    text_config.vocab_size ids) into a temporary directory and points LeRobot at it, so the policy
    directory stays config.json + model.safetensors and config.json holds the name, never a path. Any other
    name is LeRobot's: a real checkpoint's `HuggingFaceTB/SmolVLM2-500M-Video-Instruct` works offline when
    the HF cache holds that repo's config and processor files (HF_HUB_OFFLINE=1; the VLM weights are never
    downloaded: `load_vlm_weights` is forced false, the weights come from model.safetensors). Random init
    refuses `load_vlm_weights: true`. The VLM's LM head and final norm are never read at inference: they
    are the export record's `unused_parameters`.

  - PI0 / PI0.5 (`pi0`, `pi05`): inputs `*cameras (B,C,H,W)`, PI0 only `observation.state (B,D)`, the
    prompt `observation.language.tokens` / `.attention_mask` (B, tokenizer_max_length) int64 (mask 0/1; ids of
    PaliGemma's 257152-token vocabulary), `noise (B, chunk_size, max_action_dim)`, and with the kept loop an
    int64 scalar `steps`; output "action" (B, chunk_size, action_dim). PI0.5 has no state input: LeRobot's
    PI0.5 pre-processor writes the binned, normalised state into the prompt text, and
    `PI05Pytorch.sample_actions` takes no state. The manifest's `inputs.state.dim` (required by the schema) is
    still checked against config.json's observation.state feature: it is what that pre-processing tokenises.

      `kept` (default): as SmolVLA's: the prefix (images, language) runs once through PaliGemma's language
      model (`embed_prefix`, `paligemma_with_expert.forward(use_cache=True)`, as `sample_actions`), then a
      while_loop of `steps` Euler steps around the policy's own `denoise_step`, which reads the prefix KV
      cache without changing it (dsa.frontends.lerobot.third_party.openpi_transformers's read-only cache path).

      `unrolled`: `policy.predict_action_chunk(batch, noise=noise)` itself, traced for num_inference_steps.

    dsa.frontends.lerobot.third_party.openpi_transformers patches transformers 4.57.6 the way LeRobot's PI code expects (openpi's patched
    transformers, Apache-2.0; see that module) and resolves `dsa-gemma:<json>` variant names (small Gemma /
    SigLIP sizes, hermetic in config.json; `gemma_2b` / `gemma_300m` stay LeRobot's). Instance-level
    overrides for export, each checked against or equal by construction to the original: `embed_prefix` /
    `embed_suffix` with `_with_constant_lists_as_ops`; `_preprocess_images` with `bilinear_resize`; the
    SigLIP position ids and the Gemma RoPE `inv_freq` computed in the graph (non-persistent buffers, in no
    checkpoint); the prefix cache a `_PrefixCache` (a DynamicCache starts from `torch.tensor([])`, a
    constant); and the tied token embedding read through `...paligemma.lm_head.weight`, the name LeRobot's
    save_pretrained keeps. The action expert's LM head is never read (`unused_parameters`). Only
    `dtype: float32` is exported. LeRobot's PI `from_pretrained` prints instead of raising when
    model.safetensors does not load; `load_pretrained` checks every saved tensor arrived.

Batch is a dynamic dim named `batch` (minimum 1) on every tensor input.

* `reference_actions(policy_dir, inputs, steps)`: eager LeRobot outputs of `PolicyClass.from_pretrained`
  (ACT `predict_action_chunk`; Diffusion `generate_actions` with `steps` DDIM steps; SmolVLA
  `predict_action_chunk` with `num_steps = steps`; PI0 / PI0.5 `predict_action_chunk(batch, noise=...,
  num_steps=steps)`), for parity checks.

Supported policy types: act, diffusion, smolvla, pi0, pi05. LeRobot and its dependencies are imported lazily,
only by the functions that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from dsa.core.errors import DsaError, run_cli

SUPPORTED_TYPES = ("act", "diffusion", "smolvla", "pi0", "pi05")
# Policy types whose VLM is PaliGemma + a Gemma action expert (dsa.frontends.lerobot.third_party.openpi_transformers).
PI_TYPES = ("pi0", "pi05")
SAVED_FILES = ("config.json", "model.safetensors")
DENOISING_LOOPS = ("kept", "unrolled")
BETA_SCHEDULES = ("squaredcos_cap_v2", "linear")
FEATURE_TYPES = ("VISUAL", "STATE", "ENV", "ACTION")
# Batch keys LeRobot's policies read (lerobot.utils.constants).
OBS_STATE = "observation.state"
OBS_ENV_STATE = "observation.environment_state"
OBS_IMAGES = "observation.images"
OBS_LANGUAGE_TOKENS = "observation.language.tokens"
OBS_LANGUAGE_ATTENTION_MASK = "observation.language.attention_mask"
# SmolVLA's `vlm_model_name` scheme for a hermetic SmolVLM backbone (see `smolvlm_name`).
SMOLVLM_SCHEME = "dsa-smolvlm:"
SMOLVLM_KEYS = ("scale_factor", "text_config", "vision_config")
_SUPPORTED_TEXT = ", ".join(SUPPORTED_TYPES)


# ------------------------------------------------------------------------------------------------------
# LeRobot classes and configs


def _classes(policy_type: Any, where: str):
    """(config class, policy class) of a supported policy type."""
    if policy_type == "act":
        from lerobot.policies.act.configuration_act import ACTConfig
        from lerobot.policies.act.modeling_act import ACTPolicy

        return ACTConfig, ACTPolicy
    if policy_type == "diffusion":
        from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
        from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

        return DiffusionConfig, DiffusionPolicy
    if policy_type == "smolvla":
        from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
        from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

        return SmolVLAConfig, SmolVLAPolicy
    if policy_type in PI_TYPES:
        import importlib

        from dsa.frontends.lerobot.third_party import openpi_transformers as lerobot_pi

        lerobot_pi.apply()  # before LeRobot builds any Gemma / PaliGemma
        package = f"lerobot.policies.{policy_type}"
        configuration = importlib.import_module(f"{package}.configuration_{policy_type}")
        modeling = importlib.import_module(f"{package}.modeling_{policy_type}")
        lerobot_pi.install_sizes(modeling)
        name = "PI0" if policy_type == "pi0" else "PI05"
        return getattr(configuration, f"{name}Config"), getattr(modeling, f"{name}Policy")
    raise DsaError(
        where,
        f"policy type {policy_type!r} is not supported by rules_dsa's LeRobot adapters",
        f"supported types: {_SUPPORTED_TEXT}",
    )


def _check_features(value: Any, where: str) -> None:
    """Checks `{name: {"type": VISUAL|STATE|ENV|ACTION, "shape": [ints]}}` before LeRobot parses it."""
    if not isinstance(value, dict):
        raise DsaError(where, f"must be a mapping of feature name to {{type, shape}}, got {type(value).__name__}")
    for name, feature in value.items():
        field = f"{where}.{name}"
        if not isinstance(feature, dict) or set(feature) != {"type", "shape"}:
            raise DsaError(field, f"must be {{\"type\": ..., \"shape\": [...]}}, got {feature!r}")
        if feature["type"] not in FEATURE_TYPES:
            raise DsaError(f"{field}.type", f"unknown feature type {feature['type']!r}",
                           f"use one of {', '.join(FEATURE_TYPES)}")
        shape = feature["shape"]
        if (not isinstance(shape, (list, tuple)) or not shape
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
            raise DsaError(f"{field}.shape", f"must be a non-empty list of positive ints, got {shape!r}")


def _decode_config(config_cls, values: Dict[str, Any], where: str):
    """LeRobot's own decoding (draccus, as `PreTrainedConfig.from_pretrained` does) of a config dict without
    its "type"; LeRobot's validation errors become DsaErrors."""
    import draccus

    known = {f.name for f in dataclasses.fields(config_cls)}
    for key in values:
        if key not in known:
            raise DsaError(f"{where}.{key}", f"not a field of {config_cls.__name__}",
                           f"known fields: {', '.join(sorted(known))}")
    for key in ("input_features", "output_features"):
        if key in values:
            _check_features(values[key], f"{where}.{key}")
    restore = None
    if "paligemma_variant" in known:  # PI0 / PI0.5: `dsa-gemma:` names are validated by dsa.frontends.lerobot.third_party.openpi_transformers
        from dsa.frontends.lerobot.third_party import openpi_transformers as lerobot_pi

        lerobot_pi.check_variants(values, where)
        with lerobot_pi.stand_in_variants(values) as (values, restore):
            pass
    try:
        decoded = draccus.decode(config_cls, values)
        return restore(decoded) if restore else decoded
    except Exception as e:  # draccus' DecodingError, the config's own __post_init__ ValueErrors, ...
        root = e  # draccus wraps the config's own error ("Couldn't instantiate ..."): report the innermost
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        text = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
        raise DsaError(where, f"LeRobot rejects the config: {type(root).__name__}: {text}") from None


def _no_download(values: Dict[str, Any], where: str, *, force: bool, policy_type: str = "act") -> None:
    """Random init must not fetch pretrained weights: ACT/Diffusion's pretrained_backbone_weights must be None,
    SmolVLA's load_vlm_weights false (forced so when `force`, e.g. when rebuilding an architecture whose
    weights come from model.safetensors)."""
    if policy_type in PI_TYPES:  # PI0 / PI0.5 build PaliGemma from configs only; nothing is downloaded
        return
    field, off = ("load_vlm_weights", False) if policy_type == "smolvla" else ("pretrained_backbone_weights", None)
    if force:
        values[field] = off
        return
    weights = values.setdefault(field, off)
    if weights != off:
        raise DsaError(f"{where}.{field}",
                       f"is {weights!r}: random init would download pretrained "
                       f"{'VLM' if policy_type == 'smolvla' else 'backbone'} weights",
                       f"set {field} to {json.dumps(off)}")


def make_config(policy_type: str, config: Mapping[str, Any], where: str = "config"):
    """LeRobot's config object for `policy_type` with the given field overrides, on CPU, no downloads."""
    config_cls, _ = _classes(policy_type, "--type")
    values = dict(config)
    if values.get("type", policy_type) != policy_type:
        raise DsaError(f"{where}.type", f"is {values['type']!r} but the policy type is {policy_type!r}",
                       "drop 'type' from the config or make it match --type")
    values.pop("type", None)
    if values.get("device", "cpu") != "cpu":
        raise DsaError(f"{where}.device", f"is {values['device']!r}; policies are built on the CPU",
                       "drop 'device' or set it to \"cpu\"")
    values["device"] = "cpu"
    _no_download(values, where, force=False, policy_type=policy_type)
    if values.get("compile_model"):
        raise DsaError(f"{where}.compile_model", "torch.compile renames the UNet's parameters (_orig_mod.)",
                       "set compile_model to false")
    return _decode_config(config_cls, values, where)


def _seed(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------------
# SmolVLA's hermetic SmolVLM backbone


def smolvlm_name(sizes: Mapping[str, Any]) -> str:
    """The `vlm_model_name` of a hermetic SmolVLM backbone: `dsa-smolvlm:` + canonical JSON of
    `{"scale_factor": int, "text_config": {...}, "vision_config": {...}}` (transformers' `SmolVLMConfig`
    arguments; text_config is a llama config). dsa.frontends.lerobot.adapter writes that backbone's config.json and processor
    files into a temporary directory whenever LeRobot builds the policy, so the policy directory stays
    exactly config.json + model.safetensors and config.json holds this name, not a path."""
    return SMOLVLM_SCHEME + json.dumps(dict(sizes), sort_keys=True, separators=(",", ":"))


def _smolvlm_sizes(name: str, where: str) -> Dict[str, Any]:
    text = name[len(SMOLVLM_SCHEME):]
    try:
        sizes = json.loads(text)
    except json.JSONDecodeError as e:
        raise DsaError(where, f"{SMOLVLM_SCHEME} must be followed by a JSON object: {e}") from None
    if not isinstance(sizes, dict) or set(sizes) != set(SMOLVLM_KEYS):
        raise DsaError(where, f"{SMOLVLM_SCHEME} needs exactly the keys {', '.join(SMOLVLM_KEYS)}, got "
                       f"{sorted(sizes) if isinstance(sizes, dict) else type(sizes).__name__}")
    if not isinstance(sizes["text_config"], dict) or not isinstance(sizes["vision_config"], dict):
        raise DsaError(where, "text_config and vision_config must be JSON objects")
    if sizes["text_config"].get("model_type", "llama") != "llama":
        raise DsaError(f"{where}: text_config.model_type", "SmolVLM's text model is llama")
    vocab = sizes["text_config"].get("vocab_size")
    if not isinstance(vocab, int) or vocab < len(_SMOLVLM_SPECIALS) + 2:
        raise DsaError(f"{where}: text_config.vocab_size",
                       f"must be an int of at least {len(_SMOLVLM_SPECIALS) + 2}, got {vocab!r}")
    return sizes


# The synthetic tokenizer's special tokens (SmolVLM's own strings); the rest of its vocabulary is w0, w1, ...
_SMOLVLM_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
                     "<global-img>", "<end_of_utterance>", "<unk>")


def write_smolvlm(sizes: Mapping[str, Any], out_dir: Path) -> None:
    """A SmolVLM backbone directory LeRobot's `SmolVLMWithExpertModel` accepts as `model_id` (no weights:
    LeRobot builds it with `SmolVLMForConditionalGeneration(AutoConfig.from_pretrained(dir))` when
    load_vlm_weights is false): `SmolVLMConfig(**sizes)` and a `SmolVLMProcessor` whose tokenizer is a
    synthetic word-level one of text_config.vocab_size ids with SmolVLM's special tokens (LeRobot reads
    `fake_image_token_id` and `global_image_token_id` from it). Token ids are the policy's interface; text is
    never tokenised by the exported module."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (PreTrainedTokenizerFast, SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor,
                              SmolVLMVideoProcessor)

    out_dir = Path(out_dir)
    text_config = dict(sizes["text_config"], model_type="llama")
    vocab_size = text_config["vocab_size"]
    words = [f"w{i}" for i in range(vocab_size - len(_SMOLVLM_SPECIALS))]
    vocab = {token: i for i, token in enumerate(list(_SMOLVLM_SPECIALS) + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<|endoftext|>", bos_token="<|im_start|>",
        eos_token="<end_of_utterance>", model_max_length=text_config.get("max_position_embeddings", 8192),
        extra_special_tokens={"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                              "end_of_utterance_token": "<end_of_utterance>", "global_image_token": "<global-img>"})
    vision = sizes["vision_config"]
    side = vision.get("image_size", 224) // vision.get("patch_size", 32)
    image_seq_len = max(1, side * side // (sizes["scale_factor"] ** 2))
    processor = SmolVLMProcessor(image_processor=SmolVLMImageProcessor(), video_processor=SmolVLMVideoProcessor(),
                                 tokenizer=tokenizer, image_seq_len=image_seq_len)
    processor.save_pretrained(str(out_dir))
    config = SmolVLMConfig(image_token_id=vocab["<image>"], scale_factor=sizes["scale_factor"],
                           pad_token_id=vocab["<|endoftext|>"], vision_config=dict(vision),
                           text_config=text_config)
    config.save_pretrained(str(out_dir))


@contextlib.contextmanager
def _vlm_source(cfg, where: str = "config.json: vlm_model_name"):
    """While LeRobot builds a SmolVLA policy from `cfg`: a `dsa-smolvlm:` name is replaced by a temporary
    directory holding that backbone (`write_smolvlm`), and put back afterwards (so `save_pretrained` writes
    the name, never the path). Any other name (a hub id such as HuggingFaceTB/SmolVLM2-500M-Video-Instruct,
    found offline in the HF cache, or a local directory) is left to LeRobot/transformers. Other policy types
    pass through."""
    name = getattr(cfg, "vlm_model_name", None)
    if getattr(cfg, "type", None) != "smolvla" or not isinstance(name, str) or not name.startswith(SMOLVLM_SCHEME):
        yield
        return
    sizes = _smolvlm_sizes(name, where)
    tmp = Path(tempfile.mkdtemp(prefix="dsa-smolvlm-"))
    try:
        try:
            write_smolvlm(sizes, tmp)
        except DsaError:
            raise
        except Exception as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DsaError(where, f"cannot make the SmolVLM backbone: {type(e).__name__}: {text}") from None
        cfg.vlm_model_name = str(tmp)
        yield
    finally:
        cfg.vlm_model_name = name
        shutil.rmtree(tmp, ignore_errors=True)


def init_policy(policy_type: str, config: dict, seed: int, out_dir: Path) -> None:
    """Builds a random-init LeRobot policy and writes its `save_pretrained` output (config.json and
    model.safetensors, nothing else) into `out_dir`. Same inputs → same bytes, wherever out_dir is."""
    import torch

    out_dir = Path(out_dir)
    cfg = make_config(policy_type, config)
    _, policy_cls = _classes(policy_type, "--type")
    if out_dir.exists():
        stray = sorted(p.name for p in out_dir.iterdir() if p.name not in SAVED_FILES)
        if stray:
            raise DsaError(str(out_dir), f"holds files other than {' and '.join(SAVED_FILES)}: "
                           f"{', '.join(stray[:5])}", "write into an empty directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    _seed(seed)
    try:
        with torch.no_grad(), _vlm_source(cfg, "config.vlm_model_name"):
            policy = policy_cls(cfg)
    except DsaError:
        raise
    except Exception as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DsaError("config", f"LeRobot cannot build a {policy_type} policy from it: "
                       f"{type(e).__name__}: {text}") from None
    tmp = Path(tempfile.mkdtemp(prefix=".init-", dir=out_dir))
    try:
        policy.save_pretrained(tmp)
        written = sorted(p.name for p in tmp.iterdir())
        if written != sorted(SAVED_FILES):
            raise DsaError(f"{policy_cls.__name__}.save_pretrained",
                           f"wrote {written}, rules_dsa expects exactly {sorted(SAVED_FILES)}",
                           "this LeRobot version saves policies differently; update dsa/frontends/lerobot/adapter.py")
        for name in SAVED_FILES:
            os.chmod(tmp / name, 0o644)
            os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def policy_from_config(config_dict: Mapping[str, Any], where: str = "config.json"):
    """A randomly initialised LeRobot policy (eval mode, CPU) with the architecture of a pretrained policy's
    parsed `config.json`. The weights are meaningless: the export externalises them. `device` is forced to
    cpu and `pretrained_backbone_weights` to None (a real checkpoint names ImageNet weights; they would be
    downloaded only to be overwritten)."""
    import torch

    if not isinstance(config_dict, Mapping):
        raise DsaError(where, f"must be a JSON object, got {type(config_dict).__name__}")
    if "type" not in config_dict:
        raise DsaError(f"{where}: type", "is missing: the policy type cannot be told",
                       f"set it to one of {_SUPPORTED_TEXT}")
    policy_type = config_dict["type"]
    config_cls, policy_cls = _classes(policy_type, f"{where}: type")
    values = {k: v for k, v in config_dict.items() if k != "type"}
    values["device"] = "cpu"
    _no_download(values, where, force=True, policy_type=policy_type)
    if values.get("compile_model"):
        raise DsaError(f"{where}: compile_model", "torch.compile renames the UNet's parameters (_orig_mod.)",
                       "set compile_model to false")
    cfg = _decode_config(config_cls, values, where)
    with torch.no_grad(), _vlm_source(cfg, f"{where}: vlm_model_name"):
        policy = policy_cls(cfg)
    return policy.eval()


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


def _nn():
    import torch

    return torch.nn


class _SharedModule:
    """Mixin body: registers a policy's submodules/parameters/buffers as the adapter's own (same objects, same
    names) and keeps the policy object itself outside the module tree."""

    @staticmethod
    def share(adapter, policy) -> None:
        object.__setattr__(adapter, "policy", policy)
        adapter._modules.update(policy._modules)
        adapter._parameters.update(policy._parameters)
        adapter._buffers.update(policy._buffers)
        adapter._non_persistent_buffers_set.update(policy._non_persistent_buffers_set)


def _observation_keys(cfg) -> List[str]:
    """Observation inputs in order: the cameras (config order), the robot state, the environment state."""
    keys = list(cfg.image_features)
    if cfg.robot_state_feature is not None:
        keys.append(OBS_STATE)
    if cfg.env_state_feature is not None:
        keys.append(OBS_ENV_STATE)
    return keys


def _act_adapter(policy):
    nn = _nn()

    class ACTAdapter(nn.Module):
        """forward(*observations) = policy.predict_action_chunk(batch) → (B, chunk_size, action_dim)."""

        def __init__(self):
            super().__init__()
            _SharedModule.share(self, policy)
            self.keys = _observation_keys(policy.config)

        def forward(self, *observations):
            return self.policy.predict_action_chunk(dict(zip(self.keys, observations)))

    return ACTAdapter()


def _diffusion_batch(cfg, keys, observations):
    import torch

    named = dict(zip(keys, observations))
    batch = {OBS_STATE: named[OBS_STATE]}
    if cfg.image_features:  # as DiffusionPolicy.select_action stacks them
        batch[OBS_IMAGES] = torch.stack([named[k] for k in cfg.image_features], dim=-4)
    if cfg.env_state_feature is not None:
        batch[OBS_ENV_STATE] = named[OBS_ENV_STATE]
    return batch


def _diffusion_adapter(policy, loop: str):
    import torch
    from dsa.stages.loops import kept_loop

    nn = _nn()
    cfg = policy.config
    model = policy.diffusion
    n_keys = len(_observation_keys(cfg))
    schedule = (cfg.num_train_timesteps, cfg.beta_schedule, cfg.beta_start, cfg.beta_end)
    step_options = dict(prediction_type=cfg.prediction_type, clip_sample=cfg.clip_sample,
                        clip_sample_range=cfg.clip_sample_range)
    start, end = cfg.n_obs_steps - 1, cfg.n_obs_steps - 1 + cfg.n_action_steps

    class DiffusionKeptAdapter(nn.Module):
        """forward(*observations, noise, steps): `steps` DDIM steps in a while_loop around the policy's UNet."""

        def __init__(self):
            super().__init__()
            _SharedModule.share(self, policy)
            self.keys = _observation_keys(cfg)

        def forward(self, *args):
            observations, noise, steps = args[:n_keys], args[n_keys], args[n_keys + 1]
            global_cond = model._prepare_global_conditioning(_diffusion_batch(cfg, self.keys, observations))
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
            _SharedModule.share(self, policy)
            self.keys = _observation_keys(cfg)
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
                return model.generate_actions(_diffusion_batch(cfg, self.keys, observations), noise=noise)
            finally:
                sched.alphas_cumprod, sched.final_alpha_cumprod = saved

    return DiffusionKeptAdapter() if loop == "kept" else DiffusionUnrolledAdapter()


def _full_mask_vision_embeddings(policy) -> None:
    """Replaces, on this policy's SmolVLM vision embeddings *instance* (no file of transformers is edited),
    `forward` by its value for a full patch mask, which is what SmolVLA always passes (`embed_image` calls the
    vision model with patch_attention_mask=None → all ones). transformers' own forward loops over the batch
    (`for p_attn_mask in patch_attention_mask`) and sizes `arange`s by mask sums, which torch.export cannot
    trace for a dynamic batch; with a full mask and the image as large as the vision config's image_size
    (SmolVLA resizes every camera to resize_imgs_with_padding) its position ids depend on static sizes
    only; they are computed with the same float ops, `bucketize(x, b, right=True)` written as the count of
    boundaries <= x. Checked against the original forward on a probe image."""
    import torch

    vision = policy.model.vlm_with_expert.get_vlm_model().vision_model
    emb = vision.embeddings
    if getattr(emb, "_dsa_full_mask", False):
        return
    cfg = policy.config
    size = tuple(cfg.resize_imgs_with_padding or ())
    if size != (emb.image_size, emb.image_size):
        raise DsaError("config.json: resize_imgs_with_padding",
                       f"is {list(size) or None}; the export needs every camera resized to the vision encoder's "
                       f"image_size ({emb.image_size}x{emb.image_size})",
                       f"set resize_imgs_with_padding to [{emb.image_size}, {emb.image_size}]")
    original = emb.forward

    def forward(pixel_values, patch_attention_mask=None):
        patches = emb.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        side_h, side_w = pixel_values.shape[2] // emb.patch_size, pixel_values.shape[3] // emb.patch_size
        per_side = emb.num_patches_per_side
        boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side, device=pixel_values.device)

        def buckets(n):  # transformers' fractional coords, bucketize(right=True) as a count of boundaries <= x
            coords = torch.arange(n, device=pixel_values.device, dtype=pixel_values.dtype) / n * (1 - 1e-6)
            return (boundaries[None, :] <= coords[:, None]).sum(-1)

        ids = (buckets(side_h)[:, None] * per_side + buckets(side_w)).flatten()[None, :]
        return patches + emb.position_embedding(ids)

    probe = torch.linspace(-1, 1, 3 * emb.image_size ** 2).reshape(1, 3, emb.image_size, emb.image_size)
    side = emb.image_size // emb.patch_size
    with torch.no_grad():
        want = original(pixel_values=probe, patch_attention_mask=torch.ones(1, side, side, dtype=torch.bool))
        got = forward(probe)
    if not torch.equal(want, got):
        raise DsaError("SmolVLM vision embeddings", "the full-mask embedding differs from transformers' own",
                       "this transformers version embeds patches differently; update dsa/frontends/lerobot/adapter.py")
    emb.forward = forward
    emb._dsa_full_mask = True


def _with_constant_lists_as_ops(fn):
    """`fn` (a LeRobot function: the same code object) with its global `torch` replaced by a module that is
    torch except `torch.tensor(<flat list of Python scalars of one type>, dtype=, device=)`, which returns
    the same tensor made by ops: `torch.cat` of one `torch.full` per run of equal values. SmolVLA's
    `embed_prefix` / `embed_suffix` build their attention patterns with `torch.tensor([0] * n + [1] * m)`;
    as constants (1) the exported MLIR would inline them (dense_resource), and (2) torch 2.14 cannot
    functionalise a while_loop whose body creates a tensor constant (run_decompositions raises "Attempting
    to use FunctionalTensor on its own")."""
    import types

    import torch

    def tensor(data, *args, **kwargs):
        if (args or not set(kwargs) <= {"dtype", "device"} or not isinstance(data, (list, tuple)) or not data
                or type(data[0]) not in (bool, int, float) or any(type(v) is not type(data[0]) for v in data)):
            return torch.tensor(data, *args, **kwargs)
        runs = [[data[0], 0]]
        for v in data:
            if v == runs[-1][0]:
                runs[-1][1] += 1
            else:
                runs.append([v, 1])
        dtype = kwargs.get("dtype") or torch.tensor(data[:1]).dtype
        parts = [torch.full((n,), v, dtype=dtype, device=kwargs.get("device")) for v, n in runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    shim = types.ModuleType("torch")
    shim.__dict__.update(torch.__dict__)
    shim.tensor = tensor
    return _with_globals(fn, torch=shim)


def _with_globals(fn, **overrides):
    """`fn` (a LeRobot function: the same code object) seeing `overrides` in place of some of its globals."""
    import types

    return types.FunctionType(fn.__code__, dict(fn.__globals__, **overrides), fn.__name__, fn.__defaults__,
                              fn.__closure__)


def bilinear_resize(x, size):
    """`F.interpolate(x, size, mode="bilinear", align_corners=False)` (no antialias) of a (B, C, H, W)
    tensor, with `index_select` and elementwise ops: IREE lowers neither `aten.upsample_bilinear2d(.vec)`
    nor torch's decomposition of it (`aten._unsafe_index`). Source indices and weights as ATen's CPU kernel
    computes them (`area_pixel_compute_source_index`: src = (dst + 0.5) * in / out - 0.5, clamped at 0;
    i1 = i0 + 1 below the edge), interpolated along W first, then H, as the kernel does."""
    import torch

    def axis(n_in, n_out):
        scale = n_in / n_out
        src = ((torch.arange(n_out, dtype=torch.float32) + 0.5) * scale - 0.5).clamp(min=0)
        i0 = src.to(torch.int64)
        w1 = src - i0.to(torch.float32)
        i1 = torch.where(i0 < n_in - 1, i0 + 1, i0)
        return i0, i1, 1.0 - w1, w1

    h0, h1, hw0, hw1 = axis(x.shape[2], size[0])
    c0, c1, cw0, cw1 = axis(x.shape[3], size[1])
    rows = x.index_select(3, c0) * cw0 + x.index_select(3, c1) * cw1
    return rows.index_select(2, h0) * hw0[:, None] + rows.index_select(2, h1) * hw1[:, None]


def _exportable_prepare_images(policy):
    """SmolVLA's own `prepare_images` on this instance, with its `resize_with_pad` seeing `F.interpolate` =
    `bilinear_resize` for the bilinear resize it makes (anything else goes to torch's interpolate)."""
    import types

    import torch.nn.functional as F
    from lerobot.policies.smolvla import modeling_smolvla

    def interpolate(x, size=None, scale_factor=None, mode="nearest", align_corners=None, **kwargs):
        if mode == "bilinear" and not align_corners and size is not None and scale_factor is None and not kwargs:
            return bilinear_resize(x, size)
        return F.interpolate(x, size=size, scale_factor=scale_factor, mode=mode, align_corners=align_corners,
                             **kwargs)

    functional = types.ModuleType("torch.nn.functional")
    functional.__dict__.update(F.__dict__)
    functional.interpolate = interpolate
    resize = _with_globals(modeling_smolvla.resize_with_pad, F=functional)
    prepare = _with_globals(type(policy).prepare_images, resize_with_pad=resize)
    policy.prepare_images = types.MethodType(prepare, policy)


def _smolvla_batch(cfg, observations, tokens, mask):
    """SmolVLA's batch: cameras and state by their LeRobot keys, language tokens, and the attention mask as
    LeRobot's tokenizer step makes it (bool) from the int 0/1 input."""
    batch = dict(zip(list(cfg.image_features) + [OBS_STATE], observations))
    batch[OBS_LANGUAGE_TOKENS] = tokens
    batch[OBS_LANGUAGE_ATTENTION_MASK] = mask != 0
    return batch


def _smolvla_adapter(policy, loop: str):
    import types

    import torch
    from dsa.stages.loops import kept_loop
    from lerobot.policies.smolvla.modeling_smolvla import make_att_2d_masks

    nn = _nn()
    cfg = policy.config
    model = policy.model
    n_obs = len(cfg.image_features) + 1
    action_dim = cfg.action_feature.shape[0]
    _full_mask_vision_embeddings(policy)
    for name in ("embed_prefix", "embed_suffix"):  # on this instance only
        setattr(model, name, types.MethodType(_with_constant_lists_as_ops(getattr(type(model), name)), model))
    _exportable_prepare_images(policy)

    class SmolVLAKeptAdapter(nn.Module):
        """forward(*cameras, state, tokens, mask, noise, steps): the prefix (images, language, state) runs
        once through the VLM and fills LeRobot's KV cache (`fill_kv_cache=True`, as `sample_actions`); then a
        while_loop of `steps` Euler steps around the policy's own `VLAFlowMatching.denoise_step`, which reads
        the cache (closed over by the loop body: torch lifts its tensors into loop inputs)."""

        def __init__(self):
            super().__init__()
            _SharedModule.share(self, policy)

        def forward(self, *args):
            observations, (tokens, mask, noise, steps) = args[:n_obs], args[n_obs:]
            batch = self.policy._prepare_batch(_smolvla_batch(cfg, observations, tokens, mask))
            images, img_masks = self.policy.prepare_images(batch)
            state = self.policy.prepare_state(batch)
            prefix_embs, prefix_pad_masks, prefix_att_masks = model.embed_prefix(
                images, img_masks, batch[OBS_LANGUAGE_TOKENS], batch[OBS_LANGUAGE_ATTENTION_MASK], state=state)
            prefix_att_2d_masks = make_att_2d_masks(prefix_pad_masks, prefix_att_masks)
            prefix_position_ids = torch.cumsum(prefix_pad_masks, dim=1) - 1
            _, cache = model.vlm_with_expert.forward(
                attention_mask=prefix_att_2d_masks, position_ids=prefix_position_ids, past_key_values=None,
                inputs_embeds=[prefix_embs, None], use_cache=True, fill_kv_cache=True)
            layers = sorted(cache)
            keys = [cache[i]["key_states"] for i in layers]
            values = [cache[i]["value_states"] for i in layers]
            # sample_actions: dt = -1 / num_steps, time = 1 + step * dt in Python floats (float64), then a
            # float32 tensor; x_t + dt * v_t multiplies by dt as a float32 scalar.
            dt = -1.0 / steps.to(torch.float64)

            def step(i, x_t):
                time = (1.0 + i.to(torch.float64) * dt).to(torch.float32).expand(x_t.shape[0])
                past = {n: {"key_states": k, "value_states": v} for n, k, v in zip(layers, keys, values)}
                v_t = model.denoise_step(x_t=x_t, prefix_pad_masks=prefix_pad_masks, past_key_values=past,
                                         timestep=time)
                return x_t + dt.to(torch.float32) * v_t

            x_t = kept_loop(steps, step, noise)
            actions = x_t[:, :, :action_dim]
            if cfg.adapt_to_pi_aloha:
                actions = self.policy._pi_aloha_encode_actions(actions)
            return actions

    class SmolVLAUnrolledAdapter(nn.Module):
        """forward(*cameras, state, tokens, mask, noise) = policy.predict_action_chunk(batch, noise=noise):
        LeRobot's own loop of config.num_steps steps, unrolled by tracing."""

        def __init__(self):
            super().__init__()
            _SharedModule.share(self, policy)

        def forward(self, *args):
            observations, (tokens, mask, noise) = args[:n_obs], args[n_obs:]
            self.policy.reset()
            return self.policy.predict_action_chunk(_smolvla_batch(cfg, observations, tokens, mask), noise=noise)

    return SmolVLAKeptAdapter() if loop == "kept" else SmolVLAUnrolledAdapter()


def _exportable_pi_images(policy):
    """PI0 / PI0.5's own `_preprocess_images` on this instance, with its `resize_with_pad_torch` seeing
    `F.interpolate` = `bilinear_resize` for the bilinear resize it makes (as `_exportable_prepare_images`)."""
    import sys
    import types

    import torch.nn.functional as F

    modeling = sys.modules[type(policy).__module__]

    def interpolate(x, size=None, scale_factor=None, mode="nearest", align_corners=None, **kwargs):
        if mode == "bilinear" and not align_corners and size is not None and scale_factor is None and not kwargs:
            return bilinear_resize(x, size)
        return F.interpolate(x, size=size, scale_factor=scale_factor, mode=mode, align_corners=align_corners,
                             **kwargs)

    functional = types.ModuleType("torch.nn.functional")
    functional.__dict__.update(F.__dict__)
    functional.interpolate = interpolate
    resize = _with_globals(modeling.resize_with_pad_torch, F=functional)
    prepare = _with_globals(type(policy)._preprocess_images, resize_with_pad_torch=resize)
    policy._preprocess_images = types.MethodType(prepare, policy)


def _tied_embedding_by_checkpoint_name(paligemma) -> None:
    """PaliGemma ties its language model's `embed_tokens.weight` to `lm_head.weight`, and LeRobot's
    save_pretrained (safetensors' `save_model`) keeps one name of the pair: `...paligemma.lm_head.weight`.
    An exported module names a shared parameter by its first name (`...embed_tokens.weight`, not in the
    file), so on this instance `embed_tokens` becomes a module that reads `lm_head.weight` at call time: the
    adapter's state_dict is then exactly the checkpoint's tensor names, and the embedding lookup reads the
    checkpoint's (tied) tensor."""
    import torch.nn.functional as F

    nn = _nn()
    language = paligemma.model.language_model
    embed, head = language.embed_tokens, paligemma.lm_head
    if embed is None or embed.weight is not head.weight:
        return

    class TiedEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            object.__setattr__(self, "head", head)  # not a submodule: lm_head keeps its one name
            self.padding_idx = embed.padding_idx

        def forward(self, ids):
            return F.embedding(ids, self.head.weight, self.padding_idx)

    language.embed_tokens = TiedEmbedding()


def _rotary_in_graph(rotary) -> None:
    """On this Gemma rotary embedding *instance*: `forward` computes `inv_freq` with the module's own
    `rope_init_fn` (arange / pow, graph ops) instead of reading the non-persistent `inv_freq` buffer, which
    is in no checkpoint and would be inlined into the MLIR as a constant. Same body as transformers'
    `GemmaRotaryEmbedding.forward` (default RoPE only; checked equal to the buffer)."""
    import torch

    if getattr(rotary, "_dsa_in_graph", False):
        return
    if rotary.rope_type != "default":
        raise DsaError("Gemma rotary embedding", f"rope_type {rotary.rope_type!r} is not exported",
                       "rules_dsa exports PaliGemma/Gemma with default RoPE")
    inv_freq, scaling = rotary.rope_init_fn(rotary.config, None)
    if not torch.equal(inv_freq, rotary.inv_freq) or scaling != rotary.attention_scaling:
        raise DsaError("Gemma rotary embedding", "recomputing inv_freq does not give the module's buffer",
                       "this transformers version builds RoPE differently; update dsa/frontends/lerobot/adapter.py")

    def forward(x, position_ids):
        inv_freq, scaling = rotary.rope_init_fn(rotary.config, None)
        inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq_expanded.float() @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype=x.dtype), (emb.sin() * scaling).to(dtype=x.dtype)

    rotary.forward = forward
    rotary._dsa_in_graph = True


def _siglip_positions_in_graph(embeddings) -> None:
    """On this SigLIP vision embeddings *instance*: `forward` looks the position embedding up with
    `arange(num_positions)` instead of the non-persistent `position_ids` buffer (in no checkpoint; it would be
    inlined into the MLIR). Checked against the original forward on a probe image."""
    import torch

    if getattr(embeddings, "_dsa_in_graph", False):
        return
    original = embeddings.forward

    def forward(pixel_values, interpolate_pos_encoding=False):
        if interpolate_pos_encoding:
            return original(pixel_values, interpolate_pos_encoding=True)
        weight = embeddings.patch_embedding.weight
        patches = embeddings.patch_embedding(pixel_values.to(dtype=weight.dtype)).flatten(2).transpose(1, 2)
        ids = torch.arange(embeddings.num_positions, device=pixel_values.device)[None, :]
        return patches + embeddings.position_embedding(ids)

    size = embeddings.image_size
    probe = torch.linspace(-1, 1, 3 * size * size).reshape(1, 3, size, size)
    with torch.no_grad():
        if not torch.equal(original(probe), forward(probe)):
            raise DsaError("SigLIP vision embeddings", "the in-graph position lookup differs from transformers' own",
                           "this transformers version embeds patches differently; update dsa/frontends/lerobot/adapter.py")
    embeddings.forward = forward
    embeddings._dsa_in_graph = True


class _PrefixCache:
    """The prefix KV cache of the exported PI0 / PI0.5: filled once by the prefix forward (`update`, as a
    fresh `DynamicCache` fills: its first update returns the new keys/values, cat'ed to an empty tensor) and
    read by the patched Gemma attention through `layers[i].keys / .values` (dsa.frontends.lerobot.third_party.openpi_transformers's read-only path).
    transformers' DynamicCache starts each layer from `torch.tensor([])`, which an export inlines as a
    constant; this one holds only the traced tensors."""

    def __init__(self):
        self.layers = []

    def update(self, keys, values, layer_idx, cache_kwargs=None):
        import types

        if layer_idx != len(self.layers):
            raise DsaError("PI prefix cache", f"layer {layer_idx} filled out of order or twice")
        self.layers.append(types.SimpleNamespace(keys=keys, values=values))
        return keys, values

    def get_seq_length(self, layer_idx=0):
        return self.layers[layer_idx].keys.shape[-2] if self.layers else 0


def _pi_batch(cfg, observations, tokens, mask):
    """PI0 / PI0.5's batch: cameras (and, PI0 only, the state) by their LeRobot keys, language tokens, and the
    attention mask as LeRobot's tokenizer step makes it (bool) from the int 0/1 input."""
    keys = list(cfg.image_features) + ([OBS_STATE] if cfg.type == "pi0" else [])
    batch = dict(zip(keys, observations))
    batch[OBS_LANGUAGE_TOKENS] = tokens
    batch[OBS_LANGUAGE_ATTENTION_MASK] = mask != 0
    return batch


def _pi_adapter(policy, loop: str):
    import sys
    import types

    import torch
    from dsa.stages.loops import kept_loop

    nn = _nn()
    cfg = policy.config
    model = policy.model
    make_att_2d_masks = sys.modules[type(model).__module__].make_att_2d_masks
    pi0 = cfg.type == "pi0"
    n_obs = len(cfg.image_features) + (1 if pi0 else 0)
    action_dim = cfg.action_feature.shape[0]
    for name in ("embed_prefix", "embed_suffix"):  # on this instance only
        setattr(model, name, types.MethodType(_with_constant_lists_as_ops(getattr(type(model), name)), model))
    _exportable_pi_images(policy)
    _tied_embedding_by_checkpoint_name(model.paligemma_with_expert.paligemma)
    _siglip_positions_in_graph(model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings)
    _rotary_in_graph(model.paligemma_with_expert.paligemma.model.language_model.rotary_emb)
    _rotary_in_graph(model.paligemma_with_expert.gemma_expert.model.rotary_emb)
    backbone = model.paligemma_with_expert
    lerobot_forward = type(backbone).forward

    def forward(self, *args, past_key_values=None, use_cache=None, **kwargs):
        # LeRobot's prefix forward (use_cache, no cache) fills a _PrefixCache instead of a DynamicCache.
        if use_cache and past_key_values is None:
            past_key_values = _PrefixCache()
        return lerobot_forward(self, *args, past_key_values=past_key_values, use_cache=use_cache, **kwargs)

    backbone.forward = types.MethodType(forward, backbone)  # on this instance only
    # sample_actions / denoise_step set these on every call; set once here so that tracing sees no change.
    model.paligemma_with_expert.paligemma.language_model.config._attn_implementation = "eager"
    model.paligemma_with_expert.gemma_expert.model.config._attn_implementation = "eager"

    class PIKeptAdapter(nn.Module):
        """forward(*cameras[, state], tokens, mask, noise, steps): the prefix (images, language) runs once
        through PaliGemma's language model and fills its KV cache (as `sample_actions`; a `_PrefixCache`);
        then a while_loop of `steps` Euler steps around the policy's own `denoise_step`, which reads the cache
        without changing it (dsa.frontends.lerobot.third_party.openpi_transformers's read-only cache; the loop body closes over it: torch lifts its
        tensors into loop inputs)."""

        def __init__(self):
            super().__init__()
            _SharedModule.share(self, policy)

        def forward(self, *args):
            observations, (tokens, mask, noise, steps) = args[:n_obs], args[n_obs:]
            batch = _pi_batch(cfg, observations, tokens, mask)
            images, img_masks = self.policy._preprocess_images(batch)
            state = {"state": self.policy.prepare_state(batch)} if pi0 else {}
            prefix_embs, prefix_pad_masks, prefix_att_masks = model.embed_prefix(
                images, img_masks, batch[OBS_LANGUAGE_TOKENS], batch[OBS_LANGUAGE_ATTENTION_MASK])
            prefix_att_2d_masks = make_att_2d_masks(prefix_pad_masks, prefix_att_masks)
            prefix_position_ids = torch.cumsum(prefix_pad_masks, dim=1) - 1
            _, cache = model.paligemma_with_expert.forward(
                attention_mask=model._prepare_attention_masks_4d(prefix_att_2d_masks),
                position_ids=prefix_position_ids, past_key_values=None, inputs_embeds=[prefix_embs, None],
                use_cache=True)
            # sample_actions: dt = -1 / num_steps, time = 1 + step * dt in Python floats (float64), then a
            # float32 tensor; x_t + dt * v_t multiplies by dt as a float32 scalar.
            dt = -1.0 / steps.to(torch.float64)

            def step(i, x_t):
                time = (1.0 + i.to(torch.float64) * dt).to(torch.float32).expand(x_t.shape[0])
                v_t = model.denoise_step(**state, prefix_pad_masks=prefix_pad_masks, past_key_values=cache,
                                         x_t=x_t, timestep=time)
                return x_t + dt.to(torch.float32) * v_t

            x_t = kept_loop(steps, step, noise)
            return x_t[:, :, :action_dim]

    class PIUnrolledAdapter(nn.Module):
        """forward(*cameras[, state], tokens, mask, noise) = policy.predict_action_chunk(batch, noise=noise):
        LeRobot's own loop of config.num_inference_steps steps, unrolled by tracing."""

        def __init__(self):
            super().__init__()
            _SharedModule.share(self, policy)

        def forward(self, *args):
            observations, (tokens, mask, noise) = args[:n_obs], args[n_obs:]
            return self.policy.predict_action_chunk(_pi_batch(cfg, observations, tokens, mask), noise=noise)

    return PIKeptAdapter() if loop == "kept" else PIUnrolledAdapter()


def camera_name(feature_key: str) -> str:
    """The manifest's name of a LeRobot image feature: `observation.images.top` → `top`, and LeRobot's
    single-camera key `observation.image` → `image`."""
    return feature_key.rsplit(".", 1)[-1]


def _check_manifest_agrees(view: dict, cfg, keys, feature_shape, action_dim: int,
                           vocab: Optional[int] = None) -> None:
    """The manifest's inputs/outputs/chunk_size (and SmolVLA's prompt vocabulary, `vocab`) describe the policy
    config.json builds: the runtime and the bundle read the manifest, so a disagreement is refused here,
    naming the field."""
    hint = "make the manifest describe the policy's config.json (its input_features / output_features)"
    cameras = [(camera_name(k), list(feature_shape(k))) for k in keys if k in cfg.image_features]
    declared = [(c["name"], list(c["shape"])) for c in view["inputs"]["cameras"]]
    if declared != cameras:
        raise DsaError("manifest: inputs.cameras",
                       f"lists {declared}, the policy's image features are {cameras} (name, shape)", hint)
    state = cfg.robot_state_feature
    if state is None or view["inputs"]["state"]["dim"] != state.shape[0]:
        raise DsaError("manifest: inputs.state.dim",
                       f"is {view['inputs']['state']['dim']}, the policy's observation.state is "
                       f"{None if state is None else list(state.shape)}", hint)
    if view["outputs"]["action"]["dim"] != action_dim:
        raise DsaError("manifest: outputs.action.dim",
                       f"is {view['outputs']['action']['dim']}, the policy's action is {action_dim}", hint)
    chunk_field = "n_action_steps" if cfg.type == "diffusion" else "chunk_size"
    chunk = getattr(cfg, chunk_field)
    if view["chunk_size"] != chunk:
        raise DsaError("manifest: chunk_size",
                       f"is {view['chunk_size']}, the policy returns {chunk} actions per call "
                       f"({chunk_field} in config.json)", hint)
    if cfg.type not in ("smolvla",) + PI_TYPES:
        return
    prompt = view["inputs"].get("prompt")
    backbone = "SmolVLM" if cfg.type == "smolvla" else "PaliGemma"
    if prompt is None or prompt["vocab_size"] != vocab:
        raise DsaError("manifest: inputs.prompt.vocab_size",
                       f"is {None if prompt is None else prompt['vocab_size']}, the {backbone} backbone's "
                       f"text_config.vocab_size is {vocab}", hint)
    if not 0 <= prompt["pad_id"] < vocab:
        raise DsaError("manifest: inputs.prompt.pad_id", f"is {prompt['pad_id']}, not below vocab_size {vocab}")


def export_spec(view: dict, dims: Mapping[str, int]):
    """The entry point of `framework: lerobot` manifests: the policy of `view["model"]["pretrained_config"]`
    (a parsed LeRobot config.json) wrapped in an export adapter, with its inputs for `dims["batch"]`."""
    from dsa.stages.spec import ExportSpec, InputSpec

    model_view = view["model"]
    config = model_view.get("pretrained_config")
    if config is None:
        raise DsaError("model.pretrained_config", "is missing: the export tool did not pass the policy's config.json")
    loop = model_view.get("denoising_loop", "kept")
    if loop not in DENOISING_LOOPS:
        raise DsaError("model.denoising_loop", f"is {loop!r}", f"use one of {', '.join(DENOISING_LOOPS)}")
    if not isinstance(config, Mapping) or config.get("type") not in SUPPORTED_TYPES:
        _classes(config.get("type") if isinstance(config, Mapping) else None, "config.json: type")
    if config["type"] == "diffusion" and config.get("noise_scheduler_type") != "DDIM":
        # Refuse before building the (possibly large) policy; _check_scheduler repeats it on the live object.
        raise DsaError(
            "config.json: noise_scheduler_type",
            f"is {config.get('noise_scheduler_type')!r}: DDPM draws fresh Gaussian noise inside every denoising "
            "step, which an exported graph cannot reproduce, so its actions could never match LeRobot's",
            "set noise_scheduler_type to DDIM (deterministic, eta=0; it samples DDPM-trained weights too)",
        )
    policy = policy_from_config(config)
    cfg = policy.config
    batch = dims["batch"]
    dyn = {0: "batch"}

    def feature_shape(key):
        if key == OBS_STATE:
            return tuple(cfg.robot_state_feature.shape)
        if key == OBS_ENV_STATE:
            return tuple(cfg.env_state_feature.shape)
        return tuple(cfg.image_features[key].shape)

    action_dim = cfg.action_feature.shape[0]
    keys = _observation_keys(cfg)
    if cfg.type == "smolvla":
        return _smolvla_spec(view, policy, loop, batch, keys, feature_shape, action_dim)
    if cfg.type in PI_TYPES:
        return _pi_spec(view, policy, loop, batch, keys, feature_shape, action_dim)
    _check_manifest_agrees(view, cfg, keys, feature_shape, action_dim)
    if cfg.type == "act":
        inputs = [InputSpec(k, (batch,) + feature_shape(k), "float32", dynamic=dyn) for k in keys]
        return ExportSpec(module=_act_adapter(policy), inputs=inputs, outputs=["action"],
                          dim_minimums={"batch": 1})

    _check_scheduler(policy, "config.json")
    obs = cfg.n_obs_steps
    inputs = [InputSpec(k, (batch, obs) + feature_shape(k), "float32", dynamic=dyn) for k in keys]
    inputs.append(InputSpec("noise", (batch, cfg.horizon, action_dim), "float32", dynamic=dyn))
    if loop == "kept":
        inputs.append(InputSpec("steps", (), "int64", value_range=(1, cfg.num_train_timesteps)))
    return ExportSpec(module=_diffusion_adapter(policy, loop), inputs=inputs, outputs=["action"],
                      dim_minimums={"batch": 1})


SMOLVLA_MAX_STEPS = 1000


def _smolvla_spec(view, policy, loop, batch, keys, feature_shape, action_dim):
    """SmolVLA's export: inputs `*cameras (B,C,H,W)`, `observation.state (B,D)`, the language prompt
    `observation.language.tokens` / `.attention_mask` (B, tokenizer_max_length) int64 (mask 0/1), `noise
    (B, chunk_size, max_action_dim)` and, with the kept loop, the int64 scalar `steps`."""
    from dsa.stages.spec import ExportSpec, InputSpec

    cfg = policy.config
    where = "config.json"
    if cfg.empty_cameras:
        raise DsaError(f"{where}: empty_cameras", f"is {cfg.empty_cameras}: the export takes the real cameras only",
                       "set empty_cameras to 0")
    if not cfg.use_cache:
        raise DsaError(f"{where}: use_cache", "is false: SmolVLA samples actions from the prefix KV cache",
                       "set use_cache to true")
    if cfg.rtc_config is not None:
        raise DsaError(f"{where}: rtc_config", "real-time chunking needs the previous chunk; not exported",
                       "set rtc_config to null")
    if cfg.n_obs_steps != 1:
        raise DsaError(f"{where}: n_obs_steps", f"is {cfg.n_obs_steps}; SmolVLA reads one observation step",
                       "set n_obs_steps to 1")
    keys = [k for k in keys if k != OBS_ENV_STATE]  # SmolVLA reads no environment state
    vocab = policy.model.vlm_with_expert.config.text_config.vocab_size
    _check_manifest_agrees(view, cfg, keys, feature_shape, action_dim, vocab)
    pad_id = view["inputs"]["prompt"]["pad_id"]
    dyn = {0: "batch"}
    length = cfg.tokenizer_max_length
    inputs = [InputSpec(k, (batch,) + feature_shape(k), "float32", dynamic=dyn) for k in keys]
    inputs += [
        InputSpec(OBS_LANGUAGE_TOKENS, (batch, length), "int64", dynamic=dyn, sample_range=(0, vocab - 1),
                  pad_value=pad_id),
        InputSpec(OBS_LANGUAGE_ATTENTION_MASK, (batch, length), "int64", dynamic=dyn, sample_range=(1, 1)),
        InputSpec("noise", (batch, cfg.chunk_size, cfg.max_action_dim), "float32", dynamic=dyn),
    ]
    if loop == "kept":
        inputs.append(InputSpec("steps", (), "int64", value_range=(1, SMOLVLA_MAX_STEPS)))
    return ExportSpec(module=_smolvla_adapter(policy, loop), inputs=inputs, outputs=["action"],
                      dim_minimums={"batch": 1})


PI_MAX_STEPS = 1000


def _pi_spec(view, policy, loop, batch, keys, feature_shape, action_dim):
    """PI0 / PI0.5's export: inputs `*cameras (B,C,H,W)`, PI0 only `observation.state (B,D)`, the language
    prompt `observation.language.tokens` / `.attention_mask` (B, tokenizer_max_length) int64 (mask 0/1),
    `noise (B, chunk_size, max_action_dim)` and, with the kept loop, the int64 scalar `steps`.

    PI0.5 takes no state input: its pre-processor writes the (normalised, binned) state into the prompt text,
    and `PI05Pytorch.sample_actions` has no state argument. The manifest's `inputs.state.dim` (required by the
    schema) is still checked against config.json's observation.state feature, which is what the runtime's
    pre-processing must turn into prompt tokens."""
    from dsa.stages.spec import ExportSpec, InputSpec

    cfg = policy.config
    where = "config.json"
    if cfg.empty_cameras:
        raise DsaError(f"{where}: empty_cameras", f"is {cfg.empty_cameras}: the export takes the real cameras only",
                       "set empty_cameras to 0")
    if cfg.rtc_config is not None:
        raise DsaError(f"{where}: rtc_config", "real-time chunking needs the previous chunk; not exported",
                       "set rtc_config to null")
    if cfg.n_obs_steps != 1:
        raise DsaError(f"{where}: n_obs_steps", f"is {cfg.n_obs_steps}; {cfg.type} reads one observation step",
                       "set n_obs_steps to 1")
    if cfg.dtype != "float32":
        raise DsaError(f"{where}: dtype", f"is {cfg.dtype!r}; rules_dsa exports PI0 / PI0.5 in float32",
                       "set dtype to \"float32\"")
    keys = [k for k in keys if k in cfg.image_features or (k == OBS_STATE and cfg.type == "pi0")]
    vocab = policy.model.paligemma_with_expert.paligemma.config.text_config.vocab_size
    _check_manifest_agrees(view, cfg, list(cfg.image_features) + [OBS_STATE], feature_shape, action_dim, vocab)
    pad_id = view["inputs"]["prompt"]["pad_id"]
    dyn = {0: "batch"}
    length = cfg.tokenizer_max_length
    inputs = [InputSpec(k, (batch,) + feature_shape(k), "float32", dynamic=dyn) for k in keys]
    inputs += [
        InputSpec(OBS_LANGUAGE_TOKENS, (batch, length), "int64", dynamic=dyn, sample_range=(0, vocab - 1),
                  pad_value=pad_id),
        InputSpec(OBS_LANGUAGE_ATTENTION_MASK, (batch, length), "int64", dynamic=dyn, sample_range=(1, 1)),
        InputSpec("noise", (batch, cfg.chunk_size, cfg.max_action_dim), "float32", dynamic=dyn),
    ]
    if loop == "kept":
        inputs.append(InputSpec("steps", (), "int64", value_range=(1, PI_MAX_STEPS)))
    return ExportSpec(module=_pi_adapter(policy, loop), inputs=inputs, outputs=["action"],
                      dim_minimums={"batch": 1})


# ------------------------------------------------------------------------------------------------------
# Eager reference


def load_pretrained(policy_dir: Path):
    """`PolicyClass.from_pretrained(policy_dir)` (LeRobot's own loader) on CPU, without backbone downloads."""
    policy_dir = Path(policy_dir)
    where = str(policy_dir / "config.json")
    config_dict = json.loads((policy_dir / "config.json").read_text())
    config_cls, policy_cls = _classes(config_dict.get("type"), f"{where}: type")
    values = {k: v for k, v in config_dict.items() if k != "type"}
    values["device"] = "cpu"
    _no_download(values, where, force=True, policy_type=config_dict.get("type"))
    cfg = _decode_config(config_cls, values, where)
    with _vlm_source(cfg, f"{where}: vlm_model_name"):
        policy = policy_cls.from_pretrained(policy_dir, config=cfg)
    if cfg.type in PI_TYPES:
        _check_loaded(policy, policy_dir)
    return policy.eval()


def _check_loaded(policy, policy_dir: Path) -> None:
    """PI0 / PI0.5's `from_pretrained` prints, instead of raising, when model.safetensors cannot be loaded
    (and returns the random-init model): every tensor of the file must be the policy's, by name."""
    import torch
    from safetensors.torch import load_file

    state = policy.state_dict()
    saved = load_file(str(Path(policy_dir) / "model.safetensors"))
    wrong = [k for k, v in saved.items() if k not in state or not torch.equal(state[k], v)]
    if wrong or not saved:
        raise DsaError(str(Path(policy_dir) / "model.safetensors"),
                       f"LeRobot's {type(policy).__name__}.from_pretrained did not load it: "
                       f"{len(wrong)} of {len(saved)} tensors differ or are missing, e.g. {wrong[:3]}")


def reference_actions(policy_dir: Path, inputs: Mapping[str, Any], steps: Optional[int] = None):
    """LeRobot's eager actions for `inputs` (name → array, the names of the export's inputs): ACT
    `predict_action_chunk`; Diffusion `diffusion.generate_actions(batch, noise=inputs["noise"])` with `steps`
    denoising steps (None: the config's num_inference_steps); SmolVLA `predict_action_chunk(batch,
    noise=inputs["noise"])` with `steps` flow-matching steps (None: the config's num_steps)."""
    import numpy as np
    import torch

    policy = load_pretrained(policy_dir)
    cfg = policy.config
    tensors = {k: torch.as_tensor(np.asarray(v)) for k, v in inputs.items()}
    keys = _observation_keys(cfg)
    if cfg.type in PI_TYPES:  # cameras, and PI0's state (PI0.5's state is in its prompt)
        keys = list(cfg.image_features) + ([OBS_STATE] if cfg.type == "pi0" else [])
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise DsaError("reference_actions: inputs", f"missing {', '.join(missing)}")
    with torch.no_grad():
        if cfg.type == "act":
            if steps is not None:
                raise DsaError("reference_actions: steps", "ACT has no denoising steps", "pass steps=None")
            out = policy.predict_action_chunk({k: tensors[k] for k in keys})
        elif cfg.type in PI_TYPES:
            for name in (OBS_LANGUAGE_TOKENS, OBS_LANGUAGE_ATTENTION_MASK, "noise"):
                if name not in tensors:
                    raise DsaError("reference_actions: inputs", f"missing {name}")
            batch = _pi_batch(cfg, [tensors[k] for k in keys], tensors[OBS_LANGUAGE_TOKENS],
                              tensors[OBS_LANGUAGE_ATTENTION_MASK])
            out = policy.predict_action_chunk(batch, noise=tensors["noise"], num_steps=steps)
        elif cfg.type == "smolvla":
            for name in (OBS_LANGUAGE_TOKENS, OBS_LANGUAGE_ATTENTION_MASK, "noise"):
                if name not in tensors:
                    raise DsaError("reference_actions: inputs", f"missing {name}")
            if steps is not None:
                cfg.num_steps = int(steps)  # read by VLAFlowMatching.sample_actions
            keys = [k for k in keys if k != OBS_ENV_STATE]
            batch = _smolvla_batch(cfg, [tensors[k] for k in keys], tensors[OBS_LANGUAGE_TOKENS],
                                   tensors[OBS_LANGUAGE_ATTENTION_MASK])
            out = policy.predict_action_chunk(batch, noise=tensors["noise"])
        else:
            if "noise" not in tensors:
                raise DsaError("reference_actions: inputs", "missing noise")
            if steps is not None:
                policy.diffusion.num_inference_steps = int(steps)  # read by conditional_sample's set_timesteps
            batch = _diffusion_batch(cfg, keys, [tensors[k] for k in keys])
            out = policy.diffusion.generate_actions(batch, noise=tensors["noise"])
    return out.numpy()


# ------------------------------------------------------------------------------------------------------
# CLI


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa-lerobot", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="write a random-init policy (config.json + model.safetensors)")
    init.add_argument("--type", help=f"policy type: {_SUPPORTED_TEXT} (or the config file's `type`)")
    source = init.add_mutually_exclusive_group()
    source.add_argument("--config-json", default="{}", help="config field overrides (a JSON object)")
    source.add_argument("--config-file", help="a JSON file: `type` and the config fields (dsa_lerobot_policy)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--out-dir", required=True)
    a = parser.parse_args(argv)
    where = a.config_file or "--config-json"
    try:
        text = Path(a.config_file).read_text(encoding="utf-8") if a.config_file else a.config_json
        config = json.loads(text)
    except OSError as e:
        raise DsaError(where, f"cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise DsaError(where, f"not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise DsaError(where, f"must be a JSON object, got {type(config).__name__}")
    policy_type = config.pop("type", None) if a.config_file else None
    if a.type and policy_type and a.type != policy_type:
        raise DsaError(f"{where}: type", f"'{policy_type}' disagrees with --type {a.type}", "give one of them")
    policy_type = a.type or policy_type
    if not policy_type:
        raise DsaError(f"{where}: type", "no policy type", f"set `type` to one of: {_SUPPORTED_TEXT}")
    init_policy(policy_type, config, a.seed, Path(a.out_dir))


if __name__ == "__main__":
    run_cli(main, "dsa-lerobot")
