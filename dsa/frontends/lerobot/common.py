"""What the LeRobot policy modules share: LeRobot config decoding and its checks, the adapters' module sharing
(`SharedModule`), the observation keys and the manifest's agreement with config.json, and the helpers that
make LeRobot code exportable (`with_constant_lists_as_ops`, `with_globals`, `bilinear_resize`).

LeRobot and its dependencies are imported lazily, only by the functions that need them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import types
from typing import Any, Callable, Dict, List, Optional

from dsa.core.errors import DsaError

SAVED_FILES = ("config.json", "model.safetensors")
DENOISING_LOOPS = ("kept", "unrolled")
FEATURE_TYPES = ("VISUAL", "STATE", "ENV", "ACTION")
# Batch keys LeRobot's policies read (lerobot.utils.constants).
OBS_STATE = "observation.state"
OBS_ENV_STATE = "observation.environment_state"
OBS_IMAGES = "observation.images"
OBS_LANGUAGE_TOKENS = "observation.language.tokens"
OBS_LANGUAGE_ATTENTION_MASK = "observation.language.attention_mask"


# ------------------------------------------------------------------------------------------------------
# LeRobot configs


def check_features(value: Any, where: str) -> None:
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


def decode_config(config_cls, values: Dict[str, Any], where: str, stand_in: Optional[Callable] = None):
    """LeRobot's own decoding (draccus, as `PreTrainedConfig.from_pretrained` does) of a config dict without
    its "type"; LeRobot's validation errors become DsaErrors. `stand_in(values, where)`, when given (PI0 /
    PI0.5's variant names), checks the values and returns `(values, restore)`: the values draccus decodes and a
    function that puts the original values back into the decoded config."""
    import draccus

    known = {f.name for f in dataclasses.fields(config_cls)}
    for key in values:
        if key not in known:
            raise DsaError(f"{where}.{key}", f"not a field of {config_cls.__name__}",
                           f"known fields: {', '.join(sorted(known))}")
    for key in ("input_features", "output_features"):
        if key in values:
            check_features(values[key], f"{where}.{key}")
    restore = None
    if stand_in is not None:
        values, restore = stand_in(values, where)
    try:
        decoded = draccus.decode(config_cls, values)
        return restore(decoded) if restore else decoded
    except Exception as e:  # draccus' DecodingError, the config's own __post_init__ ValueErrors, ...
        root = e  # draccus wraps the config's own error ("Couldn't instantiate ..."): report the innermost
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        text = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
        raise DsaError(where, f"LeRobot rejects the config: {type(root).__name__}: {text}") from None


def no_download(values: Dict[str, Any], where: str, *, force: bool, field: str, off: Any, what: str) -> None:
    """Random init must not fetch pretrained weights: `values[field]` must be `off` (forced so when `force`,
    e.g. when rebuilding an architecture whose weights come from model.safetensors). `what` names the
    weights in the error ("backbone", "VLM")."""
    if force:
        values[field] = off
        return
    weights = values.setdefault(field, off)
    if weights != off:
        raise DsaError(f"{where}.{field}",
                       f"is {weights!r}: random init would download pretrained {what} weights",
                       f"set {field} to {json.dumps(off)}")


def no_backbone_download(values: Dict[str, Any], where: str, *, force: bool) -> None:
    """ACT / Diffusion Policy: `pretrained_backbone_weights` must be None (a real checkpoint names ImageNet
    weights; they would be downloaded only to be overwritten)."""
    no_download(values, where, force=force, field="pretrained_backbone_weights", off=None, what="backbone")


# Defaults of the policy modules' hooks (see dsa.frontends.lerobot's module doc).


def decode_plain(config_cls, values: Dict[str, Any], where: str):
    """`decode_config` without stand-ins."""
    return decode_config(config_cls, values, where)


def building_plain(cfg, where: str):
    """No context is needed while LeRobot builds the policy."""
    return contextlib.nullcontext()


def loaded_as_is(policy, policy_dir) -> None:
    """LeRobot's `from_pretrained` raises on its own when model.safetensors does not load."""


def no_precheck(config) -> None:
    """Nothing to refuse in config.json before the policy is built."""


def seed(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------------
# Export adapters


def torch_nn():
    import torch

    return torch.nn


class SharedModule:
    """Mixin body: registers a policy's submodules/parameters/buffers as the adapter's own (same objects, same
    names) and keeps the policy object itself outside the module tree."""

    @staticmethod
    def share(adapter, policy) -> None:
        object.__setattr__(adapter, "policy", policy)
        adapter._modules.update(policy._modules)
        adapter._parameters.update(policy._parameters)
        adapter._buffers.update(policy._buffers)
        adapter._non_persistent_buffers_set.update(policy._non_persistent_buffers_set)


def observation_keys(cfg) -> List[str]:
    """Observation inputs in order: the cameras (config order), the robot state, the environment state."""
    keys = list(cfg.image_features)
    if cfg.robot_state_feature is not None:
        keys.append(OBS_STATE)
    if cfg.env_state_feature is not None:
        keys.append(OBS_ENV_STATE)
    return keys


def feature_shape(cfg, key: str) -> tuple:
    """The per-step shape of an observation input (a camera, the robot state, the environment state)."""
    if key == OBS_STATE:
        return tuple(cfg.robot_state_feature.shape)
    if key == OBS_ENV_STATE:
        return tuple(cfg.env_state_feature.shape)
    return tuple(cfg.image_features[key].shape)


def camera_name(feature_key: str) -> str:
    """The manifest's name of a LeRobot image feature: `observation.images.top` → `top`, and LeRobot's
    single-camera key `observation.image` → `image`."""
    return feature_key.rsplit(".", 1)[-1]


def check_manifest_agrees(view: dict, cfg, keys, action_dim: int, *, chunk_field: str = "chunk_size",
                          vocab: Optional[int] = None, backbone: Optional[str] = None) -> None:
    """The manifest's inputs/outputs/chunk_size (and a VLA's prompt vocabulary, `vocab` of its `backbone`)
    describe the policy config.json builds: the runtime and the bundle read the manifest, so a disagreement
    is refused here, naming the field. `chunk_field`: the config field of the actions returned per call."""
    hint = "make the manifest describe the policy's config.json (its input_features / output_features)"
    cameras = [(camera_name(k), list(feature_shape(cfg, k))) for k in keys if k in cfg.image_features]
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
    chunk = getattr(cfg, chunk_field)
    if view["chunk_size"] != chunk:
        raise DsaError("manifest: chunk_size",
                       f"is {view['chunk_size']}, the policy returns {chunk} actions per call "
                       f"({chunk_field} in config.json)", hint)
    if backbone is None:
        return
    prompt = view["inputs"].get("prompt")
    if prompt is None or prompt["vocab_size"] != vocab:
        raise DsaError("manifest: inputs.prompt.vocab_size",
                       f"is {None if prompt is None else prompt['vocab_size']}, the {backbone} backbone's "
                       f"text_config.vocab_size is {vocab}", hint)
    if not 0 <= prompt["pad_id"] < vocab:
        raise DsaError("manifest: inputs.prompt.pad_id", f"is {prompt['pad_id']}, not below vocab_size {vocab}")


def with_constant_lists_as_ops(fn):
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
    return with_globals(fn, torch=shim)


def with_globals(fn, **overrides):
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


def functional_with_bilinear_resize():
    """`torch.nn.functional` except `interpolate`, which is `bilinear_resize` for the bilinear resize LeRobot's
    image pre-processing makes (anything else goes to torch's interpolate)."""
    import torch.nn.functional as F

    def interpolate(x, size=None, scale_factor=None, mode="nearest", align_corners=None, **kwargs):
        if mode == "bilinear" and not align_corners and size is not None and scale_factor is None and not kwargs:
            return bilinear_resize(x, size)
        return F.interpolate(x, size=size, scale_factor=scale_factor, mode=mode, align_corners=align_corners,
                             **kwargs)

    functional = types.ModuleType("torch.nn.functional")
    functional.__dict__.update(F.__dict__)
    functional.interpolate = interpolate
    return functional
