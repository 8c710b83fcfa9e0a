"""LeRobot policies (ACT, Diffusion Policy, SmolVLA, PI0, PI0.5) as rules_dsa models: random-init checkpoints,
export adapters, eager reference outputs.

Three things, all through LeRobot's own classes (lerobot 0.4.x), never a re-implementation of a policy:

* `init_policy` / `python -m dsa.frontends.lerobot.cli init`: builds a policy of a given type with random weights
  from a config JSON (LeRobot's config class, `device="cpu"`, no pretrained backbone download), seeds torch,
  and writes the policy's own `save_pretrained` output: exactly `config.json` + `model.safetensors`, byte for
  byte the same on every run and in any directory.

* `export_spec(view, dims)`: the entry point of manifests with `framework: lerobot`
  (`dsa.frontends.lerobot:export_spec`). The export tool puts the policy's parsed `config.json` into
  `view["model"]["pretrained_config"]`; `policy_from_config` rebuilds the policy from it (random init: the
  weights are externalised by the export and later read from `model.safetensors` by name). The returned
  module is an *adapter*: it registers the policy's own submodules, parameters and buffers as its own
  (`common.SharedModule`), so `adapter.state_dict()` has exactly the keys of the policy's `state_dict()`,
  which are exactly the tensor names in `model.safetensors`; the policy object itself is kept outside the
  module tree (`object.__setattr__`), so no name gets a prefix. `view["model"]["denoising_loop"]` (`kept`,
  the default, or `unrolled`) chooses how a denoising loop is exported. Batch is a dynamic dim named `batch`
  (minimum 1) on every tensor input.

* `reference_actions(policy_dir, inputs, steps)`: eager LeRobot outputs of `PolicyClass.from_pretrained`, for
  parity checks.

What differs between policy types lives in one module per type, `POLICY_TYPES` (type name → module), made from
the table of types `dsa.core.lerobot_types` (each record names its `frontend` module): `act`, `diffusion`,
`smolvla`, `pi` (pi0 and pi05); `common` holds what they share. Each module's doc
describes its export adapter, inputs and reference. A policy module provides:

  TYPES                                    the type names it serves
  classes(policy_type)                     (LeRobot config class, policy class)
  no_download(values, where, *, force)     refuses (force: turns off) pretrained weight downloads
  decode(config_cls, values, where)        LeRobot's config object (common.decode_config)
  building(cfg, where)                     context manager around building the policy from cfg
  check_loaded(policy, policy_dir)         checks `from_pretrained` loaded model.safetensors
  precheck(config)                         refusals on config.json before the policy is built
  export(view, policy, loop, batch)        the ExportSpec
  reference(policy, tensors, steps)        LeRobot's eager actions (called under torch.no_grad)

Supported policy types: those registered in dsa.core.lerobot_types (act, diffusion, smolvla, pi0, pi05). LeRobot
and its dependencies are imported lazily, only by the functions that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, List, Mapping, Optional

from dsa.core.determinism import pin_math_libraries
from dsa.core.errors import DsaError
from dsa.core.lerobot_types import LEROBOT_TYPES
from dsa.frontends.lerobot import common, pi
from dsa.frontends.lerobot.common import (DENOISING_LOOPS, OBS_ENV_STATE, OBS_IMAGES,  # noqa: F401 (public API)
                                          OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS, OBS_STATE, SAVED_FILES,
                                          bilinear_resize, camera_name)
from dsa.frontends.lerobot.diffusion import (BETA_SCHEDULES, alphas_cumprod, ddim_step,  # noqa: F401 (public API)
                                             ddim_timesteps)
from dsa.frontends.lerobot.smolvla import SMOLVLM_SCHEME, smolvlm_name, write_smolvlm  # noqa: F401 (public API)

# Policy type (config.json's `type`) → the module that handles it: the record's `frontend` in the one table of
# LeRobot types (dsa.core.lerobot_types).
POLICY_TYPES = {t.name: importlib.import_module(f"{__name__}.{t.frontend}") for t in LEROBOT_TYPES.values()}
SUPPORTED_TYPES = tuple(POLICY_TYPES)
# Policy types whose VLM is PaliGemma + a Gemma action expert (dsa.frontends.lerobot.third_party.openpi_transformers).
PI_TYPES = pi.TYPES
_SUPPORTED_TEXT = ", ".join(SUPPORTED_TYPES)


# ------------------------------------------------------------------------------------------------------
# LeRobot classes and configs


def policy_module(policy_type: Any, where: str):
    """The module of a supported policy type (POLICY_TYPES); any other type is refused, naming `where`."""
    if isinstance(policy_type, str) and policy_type in POLICY_TYPES:
        return POLICY_TYPES[policy_type]
    raise DsaError(
        where,
        f"policy type {policy_type!r} is not supported by rules_dsa's LeRobot adapters",
        f"supported types: {_SUPPORTED_TEXT}",
    )


def policy_classes(policy_type: Any, where: str):
    """(config class, policy class) of a supported policy type."""
    return policy_module(policy_type, where).classes(policy_type)


def make_config(policy_type: str, config: Mapping[str, Any], where: str = "config"):
    """LeRobot's config object for `policy_type` with the given field overrides, on CPU, no downloads."""
    module = policy_module(policy_type, "--type")
    config_cls, _ = module.classes(policy_type)
    values = dict(config)
    if values.get("type", policy_type) != policy_type:
        raise DsaError(f"{where}.type", f"is {values['type']!r} but the policy type is {policy_type!r}",
                       "drop 'type' from the config or make it match --type")
    values.pop("type", None)
    if values.get("device", "cpu") != "cpu":
        raise DsaError(f"{where}.device", f"is {values['device']!r}; policies are built on the CPU",
                       "drop 'device' or set it to \"cpu\"")
    values["device"] = "cpu"
    module.no_download(values, where, force=False)
    if values.get("compile_model"):
        raise DsaError(f"{where}.compile_model", "torch.compile renames the UNet's parameters (_orig_mod.)",
                       "set compile_model to false")
    return module.decode(config_cls, values, where)


def init_policy(policy_type: str, config: dict, seed: int, out_dir: Path) -> None:
    """Builds a random-init LeRobot policy and writes its `save_pretrained` output (config.json and
    model.safetensors, nothing else) into `out_dir`. Same inputs → same bytes, wherever out_dir is."""
    import torch

    out_dir = Path(out_dir)
    cfg = make_config(policy_type, config)
    module = policy_module(policy_type, "--type")
    _, policy_cls = module.classes(policy_type)
    _check_out_dir(out_dir)
    common.seed(seed)
    try:
        with torch.no_grad(), module.building(cfg, "config.vlm_model_name"):
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
        _move_saved(tmp, out_dir, f"{policy_cls.__name__}.save_pretrained")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# How `init_policy` makes a stand-in's weights: LeRobot's own random initialisation, saved by LeRobot's
# save_pretrained (the whole model in memory: small policies), or seeded per tensor and streamed (any size).
INIT_WEIGHTS = ("lerobot", "seeded")
# The float dtypes a seeded stand-in can be saved in.
INIT_DTYPES = ("float32", "bfloat16")


def init_seeded_policy(policy_type: str, config: dict, seed: int, out_dir: Path, dtype: str = "float32") -> None:
    """A real-size policy directory without the model in memory: LeRobot's config.json (its own
    `_save_pretrained`) and a model.safetensors whose tensors are exactly those LeRobot's save_pretrained would
    write — the policy's state_dict, built without weights (dsa.stages.weightless), less the second name of
    each tied pair (safetensors' `save_model` rule: the first name in sorted order is kept, the other recorded
    in the file's metadata) — with seeded values (dsa.stages.checkpoint's per-tensor initialisation: the same
    bytes on every machine), generated and written one tensor at a time in `dtype`. A 3.5B-parameter PI0 needs
    the memory of its largest tensor."""
    import numpy as np
    import torch

    from dsa.stages.checkpoint import init_plan, init_value
    from dsa.stages.tensor_files import write_safetensors
    from dsa.stages.weightless import is_weightless, without_weights

    if dtype not in INIT_DTYPES:
        raise DsaError("--dtype", f"is {dtype!r}", f"use one of {', '.join(INIT_DTYPES)}")
    out_dir = Path(out_dir)
    cfg = make_config(policy_type, config)
    module = policy_module(policy_type, "--type")
    _, policy_cls = module.classes(policy_type)
    _check_out_dir(out_dir)
    try:
        with torch.no_grad(), without_weights(), module.building(cfg, "config.vlm_model_name"):
            policy = policy_cls(cfg)
    except DsaError:
        raise
    except Exception as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DsaError("config", f"LeRobot cannot build a {policy_type} policy from it: "
                       f"{type(e).__name__}: {text}") from None
    state = policy.state_dict(keep_vars=True)
    names_of: dict = {}
    for name, tensor in state.items():  # tied tensors: one object under several names
        names_of.setdefault(id(tensor), []).append(name)
    removed = {}
    for names in names_of.values():
        for other in sorted(names)[1:]:
            removed[other] = sorted(names)[0]
    plan = {name: entry for name, entry in init_plan(policy).items() if name not in removed}
    numpy_dtype = {"float32": np.float32, "bfloat16": None}[dtype]

    def stored_dtype(name):
        return dtype if state[name].is_floating_point() else str(state[name].dtype).replace("torch.", "")

    def produce(name):
        tensor = state[name]
        if not is_weightless(tensor):  # a real persistent buffer (normalisation statistics): its own values
            value = tensor.detach().numpy()
        else:
            shape, owner, pname = plan[name]
            value = init_value(name, shape, owner, pname, seed)
        if not tensor.is_floating_point():
            return value
        if numpy_dtype is not None:
            return value.astype(numpy_dtype)
        import ml_dtypes

        return value.astype(ml_dtypes.bfloat16)

    tmp = Path(tempfile.mkdtemp(prefix=".init-", dir=out_dir))
    try:
        write_safetensors(tmp / "model.safetensors", [(n, stored_dtype(n), state[n].shape) for n in sorted(plan)],
                          produce, metadata=dict(sorted(removed.items())) or None)
        cfg._save_pretrained(tmp)
        _move_saved(tmp, out_dir, f"{policy_cls.__name__} config")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists():
        stray = sorted(p.name for p in out_dir.iterdir() if p.name not in SAVED_FILES)
        if stray:
            raise DsaError(str(out_dir), f"holds files other than {' and '.join(SAVED_FILES)}: "
                           f"{', '.join(stray[:5])}", "write into an empty directory")
    out_dir.mkdir(parents=True, exist_ok=True)


def _move_saved(tmp: Path, out_dir: Path, writer: str) -> None:
    written = sorted(p.name for p in tmp.iterdir())
    if written != sorted(SAVED_FILES):
        raise DsaError(writer, f"wrote {written}, rules_dsa expects exactly {sorted(SAVED_FILES)}",
                       "this LeRobot version saves policies differently; update dsa/frontends/lerobot/__init__.py")
    for name in SAVED_FILES:
        os.chmod(tmp / name, 0o644)
        os.replace(tmp / name, out_dir / name)


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
    module = policy_module(policy_type, f"{where}: type")
    config_cls, policy_cls = module.classes(policy_type)
    values = {k: v for k, v in config_dict.items() if k != "type"}
    values["device"] = "cpu"
    module.no_download(values, where, force=True)
    if values.get("compile_model"):
        raise DsaError(f"{where}: compile_model", "torch.compile renames the UNet's parameters (_orig_mod.)",
                       "set compile_model to false")
    cfg = module.decode(config_cls, values, where)
    with torch.no_grad(), module.building(cfg, f"{where}: vlm_model_name"):
        policy = policy_cls(cfg)
    return policy.eval()


# ------------------------------------------------------------------------------------------------------
# Export


def export_spec(view: dict, dims: Mapping[str, int]):
    """The entry point of `framework: lerobot` manifests: the policy of `view["model"]["pretrained_config"]`
    (a parsed LeRobot config.json) wrapped in an export adapter, with its inputs for `dims["batch"]`."""
    model_view = view["model"]
    config = model_view.get("pretrained_config")
    if config is None:
        raise DsaError("model.pretrained_config", "is missing: the export tool did not pass the policy's config.json")
    loop = model_view.get("denoising_loop", "kept")
    if loop not in DENOISING_LOOPS:
        raise DsaError("model.denoising_loop", f"is {loop!r}", f"use one of {', '.join(DENOISING_LOOPS)}")
    module = policy_module(config.get("type") if isinstance(config, Mapping) else None, "config.json: type")
    module.precheck(config)
    policy = policy_from_config(config)
    return module.export(view, policy, loop, dims["batch"])


# ------------------------------------------------------------------------------------------------------
# Eager reference


def load_pretrained(policy_dir: Path):
    """`PolicyClass.from_pretrained(policy_dir)` (LeRobot's own loader) on CPU, without backbone downloads."""
    policy_dir = Path(policy_dir)
    where = str(policy_dir / "config.json")
    config_dict = json.loads((policy_dir / "config.json").read_text())
    policy_type = config_dict.get("type")
    module = policy_module(policy_type, f"{where}: type")
    config_cls, policy_cls = module.classes(policy_type)
    values = {k: v for k, v in config_dict.items() if k != "type"}
    values["device"] = "cpu"
    module.no_download(values, where, force=True)
    cfg = module.decode(config_cls, values, where)
    # PI0 / PI0.5's from_pretrained prints its key remapping ("Could not remap state dict keys ... Missing
    # key(s)") even when the load is complete; check_loaded then verifies every tensor against the file. So
    # its printing is held back, and shown only when that check fails (LeRobot's account of what it missed).
    chatter = io.StringIO()
    try:
        with module.building(cfg, f"{where}: vlm_model_name"), contextlib.redirect_stdout(chatter):
            policy = policy_cls.from_pretrained(policy_dir, config=cfg)
        module.check_loaded(policy, policy_dir)
    except BaseException:
        sys.stdout.write(chatter.getvalue())
        raise
    return policy.eval()


def load_pretrained_mapped(policy_dir: Path):
    """The policy of `policy_dir` as LeRobot's own class, with model.safetensors' weights, for policies too
    large for `load_pretrained`: LeRobot's `from_pretrained` initialises every weight and then loads the file
    beside them (two copies: ~28 GB for a 3.5B PI0). Here the policy is built without weights
    (dsa.stages.weightless) and given the file's tensors one at a time, widened to the model's dtype: one
    copy, no initialisation. Every tensor of the model must be in the file (tied pairs under either name) and
    nothing else."""
    import torch

    from dsa.stages.tensor_files import open_safetensors
    from dsa.stages.weightless import materialise, without_weights

    policy_dir = Path(policy_dir)
    where = str(policy_dir / "config.json")
    config_dict = json.loads((policy_dir / "config.json").read_text())
    policy_type = config_dict.get("type")
    module = policy_module(policy_type, f"{where}: type")
    config_cls, policy_cls = module.classes(policy_type)
    values = {k: v for k, v in config_dict.items() if k != "type"}
    values["device"] = "cpu"
    module.no_download(values, where, force=True)
    cfg = module.decode(config_cls, values, where)
    with torch.no_grad(), without_weights(), module.building(cfg, f"{where}: vlm_model_name"):
        policy = policy_cls(cfg)
    checkpoint = policy_dir / "model.safetensors"
    with open_safetensors(checkpoint) as tensors:
        extra = sorted(set(tensors.keys()) - set(policy.state_dict()))
        if extra:
            raise DsaError(str(checkpoint), f"holds {len(extra)} tensor(s) the policy does not have: "
                           f"{', '.join(extra[:5])}", "use the model.safetensors saved with this config.json")
        try:
            materialise(policy, tensors.read)
        except KeyError as e:
            raise DsaError(str(checkpoint), f"is missing a tensor of the policy: {e.args[0]}",
                           "use the model.safetensors saved with this config.json") from None
    return policy.eval()


def reference_actions(policy_dir, inputs: Mapping[str, Any], steps: Optional[int] = None):
    """LeRobot's eager actions for `inputs` (name → array, the names of the export's inputs): ACT
    `predict_action_chunk`; Diffusion `diffusion.generate_actions(batch, noise=inputs["noise"])` with `steps`
    denoising steps (None: the config's num_inference_steps); SmolVLA `predict_action_chunk(batch,
    noise=inputs["noise"])` with `steps` flow-matching steps (None: the config's num_steps); PI0 / PI0.5
    `predict_action_chunk(batch, noise=inputs["noise"], num_steps=steps)`. `policy_dir` is the policy's
    directory (loaded with LeRobot's `from_pretrained`), or a policy already loaded (`load_pretrained_mapped`
    for a real-size one, loaded once for several references)."""
    import numpy as np
    import torch

    policy = load_pretrained(policy_dir) if isinstance(policy_dir, (str, os.PathLike)) else policy_dir
    tensors = {k: torch.as_tensor(np.asarray(v)) for k, v in inputs.items()}
    with torch.no_grad():
        out = POLICY_TYPES[policy.config.type].reference(policy, tensors, steps)
    return out.numpy()


# ------------------------------------------------------------------------------------------------------
# CLI (dsa.frontends.lerobot.cli)


def main(argv: Optional[List[str]] = None) -> None:
    pin_math_libraries()  # before any computation: dsa.core.determinism
    parser = argparse.ArgumentParser(prog="dsa-lerobot", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="write a random-init policy (config.json + model.safetensors)")
    init.add_argument("--type", help=f"policy type: {_SUPPORTED_TEXT} (or the config file's `type`)")
    source = init.add_mutually_exclusive_group()
    source.add_argument("--config-json", default="{}", help="config field overrides (a JSON object)")
    source.add_argument("--config-file", help="a JSON file: `type` and the config fields (dsa_lerobot_policy)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--weights", choices=INIT_WEIGHTS, default="lerobot",
                      help="lerobot: LeRobot's random init and save_pretrained (the model in memory); seeded: "
                      "seeded per tensor and streamed, for policies of any size")
    init.add_argument("--dtype", choices=INIT_DTYPES, default="float32", help="float dtype of seeded weights")
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
    if a.weights == "seeded":
        init_seeded_policy(policy_type, config, a.seed, Path(a.out_dir), dtype=a.dtype)
    else:
        if a.dtype != "float32":
            raise DsaError("--dtype", "LeRobot's own initialisation saves float32", "use --weights seeded")
        init_policy(policy_type, config, a.seed, Path(a.out_dir))
