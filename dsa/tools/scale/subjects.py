"""What `dsa scale` measures: subjects (a manifest, its weights), family sweeps, the stand-in weights and the
manifest pinned to them."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError


# The stand-in of a LeRobot policy: LeRobot's config JSON in models/<model_id>/policy.json (as dsa_policy's
# `lerobot_config` names it).
LEROBOT_CONFIG = "models/{model_id}/policy.json"

# A family sweep: the family at three sizes. `recipe` is the real size's manifest, whose RECIPE_FIELDS every
# point takes; each point is a manifest (its inputs, outputs, chunk) and the LeRobot policy config to generate
# the stand-in from, with `variants` replacing config fields. A point without changes is the subject of that
# manifest itself (its key is the manifest's model_id).
RECIPE_FIELDS = ("schema_version", "precision", "buckets", "quant_scheme", "targets", "tuning")
# PI0's medium size: the real size's inputs (three 224x224 cameras, a 48-token prompt, chunk 50) with a
# SigLIP-B-sized vision tower (768 wide, 12 layers) and a 6-layer Gemma of gemma_300m's width and heads in
# both the VLM and the action expert: 0.56B parameters the graph reads (0.82B in the checkpoint), between the
# small 16.6M and the real 3.24B on a log scale. Names as dsa.frontends.lerobot.third_party.openpi_transformers'
# gemma_name writes them (canonical JSON).
_PI0_MEDIUM_GEMMA = {"depth": 6, "head_dim": 256, "mlp_dim": 4096, "num_heads": 8, "num_kv_heads": 1, "width": 1024}
_PI0_MEDIUM_VISION = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12}


def _gemma_name(sizes: dict) -> str:
    return "dsa-gemma:" + json.dumps(sizes, sort_keys=True, separators=(",", ":"))


SWEEPS = {
    "pi0": {
        "recipe": "manifests/pi0_full.yaml",
        "points": [
            {"size": "small", "key": "pi0_small", "manifest": "manifests/pi0_lerobot.yaml",
             "config": "models/pi0_lerobot/policy.json", "variants": {}},
            {"size": "medium", "key": "pi0_medium", "manifest": "manifests/pi0_full.yaml",
             "config": "models/pi0_full/policy.json",
             "variants": {"paligemma_variant": _gemma_name(dict(_PI0_MEDIUM_GEMMA, vision=_PI0_MEDIUM_VISION)),
                          "action_expert_variant": _gemma_name(_PI0_MEDIUM_GEMMA)}},
            {"size": "real", "key": "pi0_full", "manifest": "manifests/pi0_full.yaml",
             "config": "models/pi0_full/policy.json", "variants": {}},
        ],
        # The design before weightless building, measured where it fits (at real size it was OOM-killed).
        "old_design": ["small", "medium"],
    },
}


# -- subjects ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Subject:
    """One model to measure: a manifest (as data; `source` is its file), the policy config its LeRobot stand-in
    is made from (variants applied), or given weights."""

    key: str
    source: Path                       # the manifest file the subject comes from
    manifest: dict                     # its data, with a sweep point's recipe fields
    lerobot_config: Optional[Path] = None
    variants: Dict[str, str] = dataclasses.field(default_factory=dict)
    weights: Optional[Path] = None     # given weights (policy dir / checkpoint file / sharded index)
    family: Optional[str] = None
    size: Optional[str] = None
    old_design: bool = False
    description: str = ""
    derived: bool = False              # a sweep point's manifest, made here: pinned to its stand-in by design

    @property
    def framework(self) -> str:
        return self.manifest.get("framework", "pytorch")

    @property
    def model_id(self) -> str:
        return self.manifest["model_id"]


def read_manifest_data(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise DsaError(str(path), f"cannot read the manifest: {e}") from None
    if not isinstance(data, dict) or "model_id" not in data:
        raise DsaError(str(path), "is not a manifest with a model_id")
    return data


def relative_to(path: Path, root: Path) -> str:
    """`path` relative to the checkout where it lies inside it (as given, else resolved), else as given."""
    for p, r in ((Path(os.path.abspath(path)), Path(os.path.abspath(root))), (Path(path).resolve(), root.resolve())):
        try:
            return str(p.relative_to(r))
        except ValueError:
            continue
    return str(path)


def manifest_subject(path: Path, root: Path, weights: Optional[Path] = None) -> Subject:
    """A subject for a manifest as it is: LeRobot's stand-in from models/<model_id>/policy.json."""
    data = read_manifest_data(path)
    config = None
    if data.get("framework") == "lerobot" and weights is None:
        config = root / LEROBOT_CONFIG.format(model_id=data["model_id"])
        if not config.is_file():
            raise DsaError(str(path), f"framework lerobot: no policy config at {config} to make the stand-in from",
                           f"put the policy's LeRobot config there, or pass --weights {data['model_id']}=POLICY_DIR")
    return Subject(key=data["model_id"], source=Path(path), manifest=data, lerobot_config=config, weights=weights,
                   description=relative_to(path, root))


def sweep_subjects(name: str, root: Path) -> List[Subject]:
    """The points of a family sweep (SWEEPS), smallest first."""
    if name not in SWEEPS:
        raise DsaError("--sweep", f"no sweep {name!r}", f"known: {', '.join(SWEEPS)}")
    sweep = SWEEPS[name]
    recipe_path = root / sweep["recipe"]
    recipe = read_manifest_data(recipe_path)
    subjects = []
    for point in sweep["points"]:
        path = root / point["manifest"]
        data = read_manifest_data(path)
        changed = bool(point["variants"]) or path.resolve() != recipe_path.resolve()
        if changed:
            data = {k: v for k, v in data.items() if k != "processors"}  # files beside the manifest: not built here
            for field in RECIPE_FIELDS:
                if field in recipe:
                    data[field] = recipe[field]
                else:
                    data.pop(field, None)
            data["model_id"] = point["key"]
        what = f"{point['config']}" + (" with " + ", ".join(f"{k} {v}" for k, v in point["variants"].items())
                                        if point["variants"] else "")
        if changed:
            what += f", {point['manifest']}'s inputs, {sweep['recipe']}'s recipe"
        subjects.append(Subject(key=point["key"], source=path, manifest=data, lerobot_config=root / point["config"],
                                variants=dict(point["variants"]), family=name, size=point["size"],
                                old_design=point["size"] in sweep["old_design"], description=what,
                                derived=changed))
    return subjects


def real_size_manifests(bin_dir: Path, root: Path) -> List[Path]:
    """The manifests of the real-size policies index (//models:policies_real_size_index), in its order."""
    path = bin_dir / "models" / "policies_real_size_index.json"
    if not path.is_file():
        raise DsaError(str(path), "no real-size policies index",
                       "build it: `bazel build //models:policies_real_size_index` (it builds no model), or name "
                       "the manifests")
    seen: Dict[str, Path] = {}
    for policy in json.loads(path.read_text())["policies"]:
        manifest = policy.get("manifest")
        if manifest and manifest not in seen:
            seen[manifest] = root / manifest
    return list(seen.values())


# -- environments -----------------------------------------------------------------------------------------
def lerobot_python_candidates(root: Path, bin_dir: Optional[Path]) -> List[Path]:
    """Where the LeRobot environment's interpreter may be: this binary's runfiles (`bazel run`), the output
    base of `bin_dir` (bazel-bin → <output_base>/execroot/<ws>/bazel-out/<cfg>/bin)."""
    candidates = []
    here = Path(os.path.abspath(__file__)).parents[3]
    for base in (here, root):
        candidates += [base.parent / "dsa_lerobot_python" / "bin" / "python3",
                       base / "external" / "dsa_lerobot_python" / "bin" / "python3"]
    if bin_dir is not None and bin_dir.exists():
        resolved = bin_dir.resolve()
        if len(resolved.parents) > 4:
            candidates.append(resolved.parents[4] / "external" / "dsa_lerobot_python" / "bin" / "python3")
    return candidates


def subject_python(framework: str, *, lerobot_python: Optional[Path], toolchain_python: Path) -> Path:
    """The interpreter a subject's stages run in: the LeRobot environment for framework lerobot (LeRobot and
    its pinned torch), the toolchain's for every other framework."""
    if framework == "lerobot":
        if lerobot_python is None or not Path(lerobot_python).exists():
            raise DsaError("framework lerobot", "the LeRobot environment's interpreter was not found",
                           "pass --lerobot-python PATH (or set DSA_LEROBOT_PYTHON), or run `bazel run //tools:scale`")
        return Path(lerobot_python)
    return Path(toolchain_python)


def requirements_lock_for(framework: str, root: Path) -> Path:
    """The lock the subject's environment was installed from (recorded in dsa compile's lock)."""
    lerobot = root / "requirements_lerobot_lock.txt"
    return lerobot if framework == "lerobot" and lerobot.is_file() else root / "requirements_lock.txt"


# -- the stand-in ---------------------------------------------------------------------------------------------
def stand_in_recipe(manifest: dict) -> dict:
    """How the Bazel rules' stand-in for a manifest is made, from the manifest alone: {"generator": "lerobot" |
    "checkpoint", "dtype": "float32" | "bfloat16", "shards": N (0: one file), "weights": "lerobot" | "seeded"
    (LeRobot)}. Weights stored in bf16 (precision.weights) and sharded checkpoints (published large models) are
    bf16 stand-ins; a LeRobot bf16 stand-in is seeded per tensor (LeRobot's own init saves float32 only)."""
    shards = len((manifest.get("checkpoint") or {}).get("shards") or [])
    precision = (manifest.get("precision") or {}).get("weights")
    dtype = "bfloat16" if precision == "bf16" or shards else "float32"
    if manifest.get("framework") == "lerobot":
        return {"generator": "lerobot", "dtype": dtype, "shards": 0,
                "weights": "seeded" if dtype == "bfloat16" else "lerobot"}
    return {"generator": "checkpoint", "dtype": dtype, "shards": shards}


def stand_in_command(python: Path, recipe: dict, *, out: Path, config: Optional[Path] = None,
                     view: Optional[Path] = None, pythonpath: Sequence[str] = (), seed: int = 0) -> List[str]:
    """The generator's command line (the same module and flags the Bazel actions run)."""
    if recipe["generator"] == "lerobot":
        cmd = [str(python), "-m", "dsa.frontends.lerobot.cli", "init", "--config-file", str(config),
               "--seed", str(seed), "--out-dir", str(out)]
        if recipe.get("weights") == "seeded":
            cmd += ["--weights", "seeded", "--dtype", recipe["dtype"]]
        return cmd
    cmd = [str(python), "-m", "dsa.stages.checkpoint", "--view", str(view), "--seed", str(seed),
           "--dtype", recipe["dtype"], "--out", str(out)]
    for p in pythonpath:
        cmd += ["--pythonpath", str(p)]
    if recipe["shards"]:
        cmd += ["--shards", str(recipe["shards"])]
    return cmd


def checkpoint_files(checkpoint: Path) -> List[Path]:
    """A checkpoint's files: the .safetensors file, or a sharded checkpoint's index and every shard it names."""
    checkpoint = Path(checkpoint)
    if checkpoint.name.endswith(".index.json"):
        index = json.loads(checkpoint.read_text())
        shards = sorted(set(index.get("weight_map", {}).values()))
        return [checkpoint] + [checkpoint.parent / s for s in shards]
    return [checkpoint]


def resolve_weights(given: Path, framework: str) -> Tuple[Path, Optional[Path]]:
    """(checkpoint file, LeRobot config.json or None) of given weights: a LeRobot policy directory, a
    .safetensors file, a sharded checkpoint's index or the directory holding it."""
    given = Path(given)
    if framework == "lerobot":
        if not (given / "config.json").is_file() or not (given / "model.safetensors").is_file():
            raise DsaError("--weights", f"{given} is not a LeRobot policy directory (config.json + model.safetensors)")
        return given / "model.safetensors", given / "config.json"
    if given.is_dir():
        indexes = sorted(given.glob("*.index.json"))
        if len(indexes) != 1:
            raise DsaError("--weights", f"{given} holds {len(indexes)} checkpoint indexes", "pass the index file")
        return indexes[0], None
    if not given.is_file():
        raise DsaError("--weights", f"no checkpoint at {given}")
    return given, None


def repin(manifest: dict, checkpoint: Path, policy_config: Optional[Path]) -> Tuple[dict, List[str]]:
    """The manifest pinned to these weights: (the manifest, possibly a changed copy; the pins that changed).
    A sharded checkpoint's index and each shard listed, and a LeRobot policy's config.json."""
    from dsa.core.fileio import sha256_file

    data = json.loads(json.dumps(manifest))
    changed = []
    pins = data.setdefault("checkpoint", {})
    digest = sha256_file(checkpoint)
    if pins.get("sha256") != digest:
        pins["sha256"] = digest
        changed.append("checkpoint.sha256")
    for i, shard in enumerate(pins.get("shards") or []):
        digest = sha256_file(Path(checkpoint).parent / shard["file"])
        if shard.get("sha256") != digest:
            shard["sha256"] = digest
            changed.append(f"checkpoint.shards[{i}].sha256")
    config_pin = (data.get("model") or {}).get("policy_config")
    if policy_config is not None and config_pin is not None:
        digest = sha256_file(policy_config)
        if config_pin.get("sha256") != digest:
            config_pin["sha256"] = digest
            changed.append("model.policy_config.sha256")
    return (data if changed else manifest), changed


def pin_manifest(subject: Subject, checkpoint: Path, policy_config: Optional[Path], manifest_file: Path,
                 entry: dict) -> Path:
    """The manifest file dsa compile is given: `manifest_file` rewritten with the weights' pins where the
    subject's differ (entry["weights"]["pins"]: "match", "re-pinned" with a note, or "derived": a sweep point's
    manifest, made here, is pinned to its stand-in by design)."""
    pinned, changed = repin(subject.manifest, checkpoint, policy_config)
    entry["weights"]["pins"] = ("derived" if subject.derived else "re-pinned") if changed else "match"
    if not changed:
        return manifest_file
    if not subject.derived:
        entry["notes"].append(f"the manifest's pins ({', '.join(changed)}) are not this {entry['weights']['source']}'s:"
                              " built from a copy pinned to it")
    return write_manifest(pinned, manifest_file)


def write_manifest(data: dict, path: Path) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Written by dsa scale (a measured subject): do not edit.\n"
                    + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def estimate_scratch_bytes(manifest: dict, elements: int) -> int:
    """An upper estimate of the scratch a subject needs at once: its stand-in checkpoint and its parameter
    archive (weights as stored: bf16/f16 precision 2 bytes, else 4; int8/int4 quantisation a fraction)."""
    recipe = stand_in_recipe(manifest)
    checkpoint = elements * (2 if recipe["dtype"] == "bfloat16" else 4)
    archive_width = 2 if (manifest.get("precision") or {}).get("weights") in ("bf16", "f16") else 4
    kind = (manifest.get("quant_scheme") or {}).get("kind", "none")
    fraction = {"int8": 0.35, "int4": 0.2}.get(kind, 1.0)
    return int(checkpoint + elements * archive_width * fraction)


def checkpoint_elements(checkpoint: Path) -> Optional[int]:
    """The number of values in a checkpoint (every shard), from the safetensors headers."""
    import struct

    total = 0
    for path in checkpoint_files(checkpoint):
        if path.name.endswith(".json"):
            continue
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in info["shape"]:
                count *= d
            total += count
    return total
