"""Deployment manifests: loading, validation and per-stage views.

A manifest (see manifests/pi0.yaml and schema/manifest.schema.json) is the deployment contract of one policy.
`load_manifest` parses it strictly (safe YAML, no duplicate keys, JSON-compatible values only), checks the
schema version, validates it against the JSON schema and then checks what the schema cannot express. Every
problem is reported as a `ManifestError` naming the file, line and field.

Each pipeline stage reads only its own projection of the manifest (`project`), written as canonical JSON
(`dump_json`), so Bazel reruns exactly the stages a changed field affects; `explain` lists which.

Keys starting with `x-` are allowed in every mapping and ignored: they are dropped from the loaded manifest.

Command line:
    dsa manifest validate PATH [--known-targets-dir DIR] [--min-bucket DIM=N ...]
    dsa manifest explain PATH
    dsa manifest project PATH --view VIEW [--target T] [--bucket DIM:SLOT] --out FILE
        [--known-targets-dir DIR] [--min-bucket DIM=N ...]
Errors go to stderr, one line, exit status 2; `project` then leaves no file at --out."""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from jsonschema import Draft202012Validator, validators

from dsa.core.fileio import write_json_atomic
from dsa.core.formats import FILE_FRAMEWORKS, FILE_FRONT_ENDS, RENAMED_ENTRY_POINTS  # noqa: F401 (FILE_FRAMEWORKS: part of this API)
from dsa.manifest.errors import FieldPath, ManifestError, PathLike, format_field, show_value
# ManifestError and MAX_MANIFEST_BYTES stay part of this module's API (errors.py, yaml_loader.py own them).
from dsa.manifest.yaml_loader import MAX_MANIFEST_BYTES, parse_manifest_file  # noqa: F401


SCHEMA_PATH = Path(__file__).parent / "schema" / "manifest.schema.json"
SCHEMA: Dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
# (major, minor, patch) of the schema this release reads.
SCHEMA_VERSION: Tuple[int, int, int] = tuple(int(p) for p in SCHEMA["x-version"].split("."))
EXTENSION_PREFIX = "x-"
# Framework → the MLIR input dialect of its export, when not torch (the compile stage's --iree-input-type).
INPUT_TYPES: Dict[str, str] = {f.name: f.input_type for f in FILE_FRONT_ENDS.values()}

# View name → the stage that reads it.
VIEWS: Dict[str, str] = {
    "export": "exporting the policy to MLIR",
    "params": "packing (and quantizing) the checkpoint into a parameter archive",
    "compile": "compiling for one target",
    "bucket": "compiling one bucket size of a dynamic dimension",
    "runtime": "the runtime configuration shipped with the artifacts",
}
# View name → the top-level fields its projection reads (what `explain` reports).
VIEW_FIELDS: Dict[str, Tuple[str, ...]] = {
    "export": (
        "schema_version", "model_id", "framework", "model", "inputs", "outputs", "chunk_size", "buckets",
        "quant_scheme", "precision",
    ),
    "params": ("model_id", "checkpoint", "quant_scheme", "precision"),
    "compile": ("model_id", "framework", "quant_scheme", "precision", "targets", "tuning"),
    "bucket": ("buckets",),
    "runtime": (
        "model_id", "chunk_size", "n_action_steps", "flow_steps", "buckets", "power_profile", "normalization",
        "inputs", "outputs", "processors",
    ),
}
# model.config holds an entry point's hyper-parameters (a few hundred bytes in every manifest here): its JSON
# form, its nesting and its integers are bounded, so that a config is data of that kind and not a payload.
# What a config *implies* (the layers and widths it asks for) is bounded where the model is built
# (dsa.stages.export: MAX_MODEL_PARAMETER_TENSORS, MAX_MODEL_ELEMENTS).
MAX_MODEL_CONFIG_BYTES = 64 << 10
MAX_MODEL_CONFIG_DEPTH = 8
MAX_MODEL_CONFIG_INT = 1 << 53
_SEMVER = re.compile(SCHEMA["properties"]["schema_version"]["pattern"])


# ---------------------------------------------------------------------------------------------------------
# Validation


def _strict_integer(checker: Any, instance: Any) -> bool:
    """JSON Schema counts 16.0 as an integer; a manifest must write 16."""
    return isinstance(instance, int) and not isinstance(instance, bool)


_Validator = validators.extend(
    Draft202012Validator, type_checker=Draft202012Validator.TYPE_CHECKER.redefine("integer", _strict_integer)
)
_VALIDATOR = _Validator(SCHEMA)
# Validators whose failure means "this value is not what the schema describes".
_VALUE_KEYWORDS = frozenset(
    {"type", "enum", "minimum", "maximum", "pattern", "minLength", "minItems", "maxItems"}
)


def _expected(schema: Mapping[str, Any]) -> str:
    """What a (sub)schema accepts, in words."""
    if "enum" in schema:
        return "one of " + ", ".join(show_value(v) for v in schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        if high is not None:
            return f"an integer from {low} to {high}"
        return f"an integer >= {low}" if low is not None else "an integer"
    if kind == "string":
        if "pattern" in schema:
            return f"a string matching {schema['pattern']}"
        return "a non-empty string" if schema.get("minLength") else "a string"
    if kind == "array":
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if high is not None:
            return f"a list of {low} entries" if low == high else f"a list of {low} to {high} entries"
        return "a non-empty list" if low else "a list"
    if kind == "object":
        return "a mapping"
    return f"a {kind}"


def _error_order(error: Any) -> tuple:
    """Sort key for schema errors: by field path, then validator (deterministic, list indices numerically)."""
    return tuple((isinstance(p, str), p) for p in error.absolute_path), error.validator, error.message


def _describe(error: Any) -> Tuple[FieldPath, str, Optional[str]]:
    """Translates a jsonschema error into (field path, message, hint)."""
    path = tuple(error.absolute_path)
    schema = error.schema if isinstance(error.schema, dict) else {}
    description = schema.get("description")
    instance = error.instance
    if len(error.schema_path) >= 2 and error.schema_path[-2] == "propertyNames":
        return path + (instance,), f"invalid name {instance!r}: expected {_expected(schema)}", description
    if error.validator == "required":
        missing = next(name for name in error.validator_value if name not in instance)
        prop = schema.get("properties", {}).get(missing, {})
        return path + (missing,), "missing required field", prop.get("description", description)
    if error.validator == "additionalProperties":
        known = list(schema.get("properties", {}))
        name = next(k for k in instance if k not in known and not k.startswith(EXTENSION_PREFIX))
        # A field the name begins (`sha` for sha256) before the closest spelling (which would be `shards`).
        close = [k for k in known if k.startswith(name)][:1] or difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else (
            f"remove it; extension fields must start with '{EXTENSION_PREFIX}'"
        )
        return path + (name,), f"unknown field '{name}'", hint
    if error.validator == "uniqueItems":
        index = next(i for i, item in enumerate(instance) if item in instance[:i])
        return path + (index,), f"duplicate entry {show_value(instance[index])}", description
    if error.validator == "not" and list(error.validator_value) == ["required"]:
        return path + (error.validator_value["required"][0],), "field not allowed here", description
    if error.validator == "enum" and instance in schema.get("x-reserved", ()):
        return path, f"{show_value(instance)} is reserved and not yet supported", f"use {_expected(schema)}"
    if error.validator in _VALUE_KEYWORDS:
        return path, f"expected {_expected(schema)}, got {show_value(instance)}", description
    return path, error.message, description


def _check_version(document: Mapping[str, Any], source: str, lines: Mapping[FieldPath, int]) -> Optional[str]:
    """Refuses an unsupported major version; returns a note when the minor version is newer than ours."""
    version = document.get("schema_version")
    if not (isinstance(version, str) and _SEMVER.match(version)):
        return None  # missing or malformed: the schema reports it
    major, minor, _ = (int(p) for p in version.split("."))
    if major != SCHEMA_VERSION[0]:
        raise ManifestError(
            f"unsupported schema_version '{version}': this release reads schema_version {SCHEMA_VERSION[0]}.x",
            file=source,
            line=lines.get(("schema_version",)),
            field="schema_version",
            hint=f"use a rules_dsa release that reads {major}.x, or rewrite the manifest "
            f"for {SCHEMA_VERSION[0]}.x",
        )
    if minor > SCHEMA_VERSION[1]:
        return (
            f"the manifest declares schema_version {version}, newer than the "
            f"{SCHEMA_VERSION[0]}.{SCHEMA_VERSION[1]} this release reads"
        )
    return None


def _strip_extensions(value: Any) -> Any:
    """Drops every `x-` key, at any depth."""
    if isinstance(value, dict):
        return {k: _strip_extensions(v) for k, v in value.items() if not k.startswith(EXTENSION_PREFIX)}
    if isinstance(value, list):
        return [_strip_extensions(v) for v in value]
    return value


def renamed_entry_point_note(manifest: Mapping[str, Any]) -> Optional[str]:
    """What `validate` adds to "ok" for a manifest naming a renamed entry point."""
    old = (manifest.get("model") or {}).get("entry_point")
    if old in RENAMED_ENTRY_POINTS:
        return (f"model.entry_point '{old}' is now named '{RENAMED_ENTRY_POINTS[old]}' (the same front end; "
                "the old name keeps working, the new one is what to write)")
    return None


def _model_config_problems(config: Any) -> Iterator[Tuple[FieldPath, str, str]]:
    """model.config's bounds (MAX_MODEL_CONFIG_*): the first value past one, by field."""
    hint = ("model.config holds the entry point's hyper-parameters; data the model needs belongs in the "
            "checkpoint or a file it reads")
    size = len(json.dumps(config, allow_nan=True))
    if size > MAX_MODEL_CONFIG_BYTES:
        yield (("model", "config"), f"is {size} bytes as JSON, over the {MAX_MODEL_CONFIG_BYTES}-byte limit", hint)
        return
    stack: List[Tuple[FieldPath, Any]] = [(("model", "config"), config)]
    while stack:
        path, value = stack.pop()
        depth = len(path) - 2
        if isinstance(value, (dict, list)) and depth >= MAX_MODEL_CONFIG_DEPTH:
            yield (path, f"nests deeper than the {MAX_MODEL_CONFIG_DEPTH} levels model.config may have", hint)
            return
        if isinstance(value, dict):
            stack.extend((path + (key,), item) for key, item in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((path + (i,), item) for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, float) and not math.isfinite(value):
            yield (path, f"{value} is not a finite number", "give the hyper-parameter a finite value")
            return
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_MODEL_CONFIG_INT:
            yield (path, f"{show_value(value)} is beyond ±2^53, larger than any hyper-parameter", hint)
            return


def _semantic_problems(
    manifest: Mapping[str, Any],
    known_targets: Optional[Iterable[str]],
    min_bucket: Optional[Mapping[str, int]],
    target_specs: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> Iterator[Tuple[FieldPath, str, str]]:
    """Yields (field path, message, hint) for what the schema cannot express, in manifest order."""
    model = manifest["model"]
    framework = manifest["framework"]
    model_props = SCHEMA["properties"]["model"]["properties"]
    if framework in FILE_FRAMEWORKS:
        if "file" not in model:
            yield (("model", "file"), "missing required field",
                   f"framework '{framework}' imports a model file: add model.file: {{path: ..., sha256: ...}}")
        for field in ("entry_point", "config", "rewrites"):
            if field in model:
                yield (
                    ("model", field),
                    f"model.{field} is read only for frameworks 'pytorch' and 'lerobot' (this manifest's: "
                    f"'{framework}' imports model.file as it is)",
                    f"remove model.{field}",
                )
    else:
        if "entry_point" not in model:
            yield (("model", "entry_point"), "missing required field", model_props["entry_point"]["description"])
        if "file" in model:
            yield (("model", "file"),
                   f"model.file is read only for frameworks {', '.join(repr(f) for f in FILE_FRAMEWORKS)} "
                   f"(this manifest's: '{framework}' builds the model from model.entry_point)",
                   "remove model.file, or set the framework of the file")
    if "config" in model:
        yield from _model_config_problems(model["config"])
    if manifest["framework"] == "lerobot" and "policy_config" not in model:
        yield (
            ("model",),
            "framework 'lerobot' needs model.policy_config (the policy's config.json and its sha256)",
            "add model.policy_config: {path: config.json, sha256: ...}, the file next to model.safetensors",
        )
    if manifest["framework"] != "lerobot":
        for field in ("policy_config", "denoising_loop"):
            if field in model:
                yield (
                    ("model", field),
                    f"model.{field} is read only for framework 'lerobot' (this manifest's: "
                    f"'{manifest['framework']}')",
                    f"remove model.{field}, or set framework: lerobot",
                )
    precision = manifest.get("precision")
    if precision is not None:
        compute = precision.get("compute", "f32")
        if compute != "f32" and compute != precision["weights"]:
            yield (
                ("precision", "compute"),
                f"compute '{compute}' with weights '{precision['weights']}': a policy computes in f32 or in its "
                "weights' own precision",
                f"set precision.weights: {compute}, or precision.compute: f32",
            )
        if framework in FILE_FRAMEWORKS and (precision["weights"] != "f32" or compute != "f32"):
            yield (
                ("precision",),
                f"precision is applied by the PyTorch export (frameworks 'pytorch' and 'lerobot'); framework "
                f"'{framework}' imports model.file with the dtypes it declares",
                "remove precision, or store the model file's weights in the precision you want",
            )
    shards = manifest["checkpoint"].get("shards")
    if shards is not None:
        file_front_end = FILE_FRONT_ENDS.get(framework)
        if file_front_end is not None and file_front_end.weights != "safetensors":
            yield (("checkpoint", "shards"), f"framework '{framework}' reads its weights from "
                   f"{file_front_end.weights_file}", "remove checkpoint.shards")
        first_shard: Dict[str, int] = {}
        for i, shard in enumerate(shards):
            if shard["file"] in first_shard:
                yield (
                    ("checkpoint", "shards", i, "file"),
                    f"duplicate shard '{shard['file']}' (also checkpoint.shards[{first_shard[shard['file']]}])",
                    "list each shard once",
                )
            first_shard.setdefault(shard["file"], i)
    processors = manifest.get("processors")
    if processors is not None and manifest["framework"] != "lerobot":
        yield (
            ("processors",),
            f"processors are LeRobot's processor pipelines, read only for framework 'lerobot' (this manifest's: "
            f"'{manifest['framework']}')",
            "remove processors, or set framework: lerobot",
        )
    if processors is not None:
        first_file: Dict[str, int] = {}
        for i, entry in enumerate(processors.get("files", [])):
            if entry["path"] in first_file:
                yield (
                    ("processors", "files", i, "path"),
                    f"duplicate file '{entry['path']}' (also processors.files[{first_file[entry['path']]}])",
                    "list each state file once",
                )
            first_file.setdefault(entry["path"], i)
    inputs = manifest["inputs"]
    first_camera: Dict[str, int] = {}
    for i, camera in enumerate(inputs["cameras"]):
        name = camera["name"]
        if name in first_camera:
            yield (
                ("inputs", "cameras", i, "name"),
                f"duplicate camera name '{name}' (also inputs.cameras[{first_camera[name]}].name)",
                "camera names must be unique; rename one",
            )
        first_camera.setdefault(name, i)
    prompt = inputs.get("prompt")
    if prompt is not None and prompt["pad_id"] >= prompt["vocab_size"]:
        yield (
            ("inputs", "prompt", "pad_id"),
            f"pad_id {prompt['pad_id']} is not below vocab_size {prompt['vocab_size']}",
            "pad_id must be a token id the embedding accepts",
        )
    if manifest["n_action_steps"] > manifest["chunk_size"]:
        yield (
            ("n_action_steps",),
            f"n_action_steps {manifest['n_action_steps']} exceeds chunk_size {manifest['chunk_size']}",
            "the runtime executes at most one chunk per inference call; lower n_action_steps or raise chunk_size",
        )
    for dim, sizes in manifest["buckets"].items():
        minimum = (min_bucket or {}).get(dim)
        for i, size in enumerate(sizes):
            if i > 0 and size <= sizes[i - 1]:
                yield (
                    ("buckets", dim, i),
                    f"bucket {size} is not larger than the previous bucket {sizes[i - 1]}",
                    "bucket sizes must be strictly increasing: sort them and drop duplicates",
                )
            if minimum is not None and size < minimum:
                yield (
                    ("buckets", dim, i),
                    f"bucket {size} is below the model's minimum {minimum} for {dim}",
                    f"the model cannot be exported with {dim} < {minimum}; raise or remove this bucket",
                )
    compute = precision_of(manifest)["compute"]
    if compute != "f32" and target_specs is not None:
        for i, target in enumerate(manifest["targets"]):
            spec = target_specs.get(target)
            if spec is not None and compute not in spec.get("precisions", []):
                yield (
                    ("precision", "compute"),
                    f"target '{target}' (targets[{i}]) has no {compute} arithmetic (its spec lists "
                    f"{', '.join(['f32'] + list(spec.get('precisions', [])))})",
                    f"set precision.compute: f32 (the {precision_of(manifest)['weights']} weights are then "
                    f"widened where used), or remove the target",
                )
    if known_targets is not None:
        known = sorted(set(known_targets))
        for i, target in enumerate(manifest["targets"]):
            if target not in known:
                yield (
                    ("targets", i),
                    f"unknown target '{target}'; known targets: {', '.join(known) or 'none'}",
                    "targets are defined in toolchains/targets/<name>.json; add one there or use a known target",
                )


def load_manifest(
    path: PathLike,
    *,
    known_targets: Optional[Iterable[str]] = None,
    min_bucket: Optional[Mapping[str, int]] = None,
    target_specs: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> Dict[str, Any]:
    """Loads and validates a manifest; returns it as plain JSON data with `x-` keys removed.

    known_targets: the target names that exist (toolchains/targets/); when given, every manifest target
        must be one of them.
    target_specs: target name → its spec (toolchains/targets/<name>.json); when given, a `precision.compute`
        that one of the manifest's targets has no arithmetic for is refused, naming the target.
    min_bucket: dynamic dim name → the smallest size the model can be exported at (its ExportSpec's
        dim_minimums); buckets below it are refused.
    Raises ManifestError on the first problem found.
    """
    source = str(path)
    document, lines = parse_manifest_file(path)
    newer_minor_note = _check_version(document, source, lines)

    def fail(field: FieldPath, message: str, hint: Optional[str]) -> ManifestError:
        line = next((lines[field[:n]] for n in range(len(field), 0, -1) if field[:n] in lines), None)
        return ManifestError(message, file=source, line=line, field=format_field(field), hint=hint)

    errors = sorted(_VALIDATOR.iter_errors(document), key=_error_order)
    if errors:
        field, message, hint = _describe(errors[0])
        if newer_minor_note:
            message += f"; {newer_minor_note}"
        raise fail(field, message, hint)
    manifest = _strip_extensions(document)
    for field, message, hint in _semantic_problems(manifest, known_targets, min_bucket, target_specs):
        raise fail(field, message, hint)
    return manifest


# ---------------------------------------------------------------------------------------------------------
# Views


def project(
    manifest: Mapping[str, Any],
    view: str,
    *,
    target: Optional[str] = None,
    bucket: Optional[Tuple[str, int]] = None,
) -> Dict[str, Any]:
    """The projection of a loaded manifest that one stage reads (see VIEWS).

    target: required by, and only allowed for, the "compile" view; must be one of the manifest's targets.
    bucket: (dim name, slot index), required by, and only allowed for, the "bucket" view.
    Raises ValueError for a misuse (unknown view, missing or extra target/bucket) and ManifestError when the
    manifest lacks the requested target or bucket.
    """
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; views: {', '.join(VIEWS)}")
    if (target is not None) != (view == "compile"):
        raise ValueError("the compile view, and only it, takes a target")
    if (bucket is not None) != (view == "bucket"):
        raise ValueError("the bucket view, and only it, takes a bucket (dim, slot)")
    m = manifest
    if view == "export":
        result = {
            "schema_major": int(m["schema_version"].split(".")[0]),
            "model_id": m["model_id"],
            "framework": m["framework"],
            "model": m["model"],
            "inputs": m["inputs"],
            "outputs": m["outputs"],
            "chunk_size": m["chunk_size"],
            "bucket_dims": sorted(m["buckets"]),
            # Quantisation reshapes the exported graph (packed weights, in-graph dequantisation).
            "quant_scheme": m["quant_scheme"],
        }
        if "precision" in m:  # only when set, so that manifests without it keep their views' bytes
            result["precision"] = precision_of(m)
    elif view == "params":
        result = {"model_id": m["model_id"], "checkpoint": m["checkpoint"], "quant_scheme": m["quant_scheme"]}
        if "precision" in m:  # the dtype the archive stores float weights in
            result["precision"] = precision_of(m)
    elif view == "compile":
        if target not in m["targets"]:
            raise ManifestError(
                f"target '{target}' is not one of the manifest's targets ({', '.join(m['targets'])})",
                field="targets",
                hint="add it to targets, or compile for a listed one",
            )
        result = {"model_id": m["model_id"], "quant_scheme": m["quant_scheme"], "target": target}
        if "tuning" in m:  # only when set, so that manifests without it keep their compile views' bytes
            result["tuning"] = m["tuning"]
        if "precision" in m:  # likewise; the compile stage checks the target has the arithmetic
            result["precision"] = precision_of(m)
        if m["framework"] in INPUT_TYPES:  # likewise: torch-dialect exports keep their views' bytes
            result["input_type"] = INPUT_TYPES[m["framework"]]
    elif view == "bucket":
        dim, slot = bucket
        if dim not in m["buckets"]:
            raise ManifestError(
                f"no buckets for dim '{dim}'; bucketed dims: {', '.join(sorted(m['buckets'])) or 'none'}",
                field="buckets",
                hint=f"add buckets.{dim}, or pick a bucketed dim",
            )
        sizes = m["buckets"][dim]
        if not 0 <= slot < len(sizes):
            raise ManifestError(
                f"no bucket slot {slot}: the manifest lists {len(sizes)} buckets for {dim}",
                field=f"buckets.{dim}",
                hint=f"use a slot from 0 to {len(sizes) - 1}",
            )
        result = {"dim": dim, "slot": slot, "size": sizes[slot], "count": len(sizes)}
    else:
        result = {
            "model_id": m["model_id"],
            "chunk_size": m["chunk_size"],
            "n_action_steps": m["n_action_steps"],
            "flow_steps": m["flow_steps"],
            "buckets": m["buckets"],
            "power_profile": m["power_profile"],
            "normalization": m.get("normalization"),
            "inputs": m["inputs"],
            "outputs": m["outputs"],
        }
        if "processors" in m:  # only when set, so that manifests without it keep their runtime views' bytes
            result["processors"] = m["processors"]
            # The pipeline bundle checks the config.json it ships against this pin (and reads no manifest).
            result["policy_config"] = m["model"].get("policy_config")
    return copy.deepcopy(result)


def precision_of(manifest: Mapping[str, Any]) -> Dict[str, str]:
    """The manifest's precision with its default filled in: {"weights": ..., "compute": ...}."""
    precision = manifest.get("precision") or {"weights": "f32"}
    return {"weights": precision["weights"], "compute": precision.get("compute", "f32")}


def check_precision_for_target(manifest: Mapping[str, Any], target: str, spec: Mapping[str, Any],
                               where: str = "manifest") -> None:
    """Refuses a `precision.compute` the target's hardware does not have (its spec's `precisions`: the
    arithmetic it runs natively; f32 always), naming the target and the field."""
    compute = precision_of(manifest)["compute"]
    have = ["f32"] + [p for p in spec.get("precisions", []) if p != "f32"]
    if compute not in have:
        raise ManifestError(
            f"target '{target}' has no {compute} arithmetic (its spec lists {', '.join(have)})",
            file=where, field="precision.compute",
            hint=f"set precision.compute: f32 (the {precision_of(manifest)['weights']} weights are then widened "
                 f"where used), or build for a target with {compute} arithmetic",
        )


def explain(manifest: Mapping[str, Any]) -> List[Tuple[str, List[str]]]:
    """For each top-level field of the manifest, in schema order: the views (stages) a change to it affects."""
    return [
        (field, [view for view, fields in VIEW_FIELDS.items() if field in fields])
        for field in SCHEMA["properties"]
        if field in manifest
    ]


def dump_json(obj: Any, path: PathLike) -> None:
    """Writes `obj` as canonical JSON (sorted keys, 2-space indent, UTF-8, trailing newline), atomically."""
    write_json_atomic(path, obj)


# ---------------------------------------------------------------------------------------------------------
# Command line


def _known_targets_dir(value: str) -> Path:
    directory = Path(value)
    if not directory.is_dir():
        raise argparse.ArgumentTypeError(f"not a directory: {value}")
    return directory


def read_target_specs(paths: Iterable[PathLike]) -> Dict[str, Dict[str, Any]]:
    """Target specs by name (a spec's `name`, else its file name), for the precision check."""
    specs = {}
    for path in paths:
        try:
            spec = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ManifestError(f"cannot read target spec: {err}", file=str(path),
                                hint="pass a toolchains/targets/<name>.json file") from None
        if not isinstance(spec, dict):
            raise ManifestError("a target spec is a JSON object", file=str(path))
        specs[str(spec.get("name", Path(path).stem))] = spec
    return specs


def _min_bucket(value: str) -> Tuple[str, int]:
    dim, sep, size = value.partition("=")
    if not (sep and dim and size.isdigit()):
        raise argparse.ArgumentTypeError(f"expected DIM=N, got {value!r}")
    return dim, int(size)


def _bucket(value: str) -> Tuple[str, int]:
    dim, sep, slot = value.partition(":")
    if not (sep and dim and slot.isdigit()):
        raise argparse.ArgumentTypeError(f"expected DIM:SLOT, got {value!r}")
    return dim, int(slot)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsa manifest", description="Validate and project manifests.")
    commands = parser.add_subparsers(dest="command", required=True)
    checks = argparse.ArgumentParser(add_help=False)
    checks.add_argument(
        "--known-targets-dir", type=_known_targets_dir, metavar="DIR",
        help="directory of target definitions (<name>.json); the manifest's targets must be among them",
    )
    checks.add_argument(
        "--min-bucket", type=_min_bucket, action="append", default=[], metavar="DIM=N",
        help="smallest size the model accepts for a dynamic dim (repeatable)",
    )
    validate = commands.add_parser("validate", parents=[checks], help="check a manifest")
    validate.add_argument("manifest")
    explain_ = commands.add_parser("explain", help="list the views each top-level field affects")
    explain_.add_argument("manifest")
    project_ = commands.add_parser("project", parents=[checks], help="write one view as canonical JSON")
    project_.add_argument("manifest")
    project_.add_argument("--view", required=True, choices=list(VIEWS))
    project_.add_argument("--target", help="target name (compile view)")
    project_.add_argument("--bucket", type=_bucket, metavar="DIM:SLOT", help="bucket slot (bucket view)")
    project_.add_argument("--out", required=True, help="output JSON file")
    project_.add_argument("--target-spec", action="append", default=[], metavar="FILE",
                          help="a target's spec: a precision.compute it has no arithmetic for is refused")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    out = Path(args.out) if args.command == "project" else None
    try:
        if args.command == "explain":
            for field, views in explain(load_manifest(args.manifest)):
                print(f"{field}: {', '.join(views)}")
            return 0
        spec_files = list(getattr(args, "target_spec", []))
        known = None
        if args.known_targets_dir is not None:
            spec_files += sorted(args.known_targets_dir.glob("*.json"))
            known = sorted(p.stem for p in args.known_targets_dir.glob("*.json"))
        manifest = load_manifest(
            args.manifest, known_targets=known, min_bucket=dict(args.min_bucket),
            target_specs=read_target_specs(spec_files) if spec_files else None,
        )
        if args.command == "validate":
            print(f"{args.manifest}: ok")
            note = renamed_entry_point_note(manifest)
            if note:
                print(f"{args.manifest}: note: {note}", file=sys.stderr)
            return 0
        try:
            view = project(manifest, args.view, target=args.target, bucket=args.bucket)
        except ValueError as err:
            out.unlink(missing_ok=True)
            parser.error(str(err))
        dump_json(view, out)
        return 0
    except ManifestError as err:
        if err.file is None:
            err.file = args.manifest
        if out is not None:
            out.unlink(missing_ok=True)
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
