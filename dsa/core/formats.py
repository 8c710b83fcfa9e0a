"""The format version of each artifact the rule set writes, in one place, and the typed artifact classes.

A reader refuses a format it does not know; docs/manifest.md and docs/bundle-format.md say when a version
moves. Every writer and reader takes its version from here, so two modules can never disagree.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, Tuple

from dsa.core.errors import DsaError
from dsa.core.fileio import canonical_json, read_json, write_bytes_atomic

# <name>.modules.json: the module index the runtime loads (dsa_vmfb, dsa compile).
INDEX_FORMAT = 1
# export_record.json: what DsaExport traced (inputs, outputs, parameters, op histogram).
RECORD_FORMAT = 1
# compile_report.json: how DsaCompile compiled one module (flags, dispatches, sizes, digests).
REPORT_FORMAT = 1
# bundle.json and build_report.json inside a release bundle (docs/bundle-format.md).
BUNDLE_FORMAT = 1
# A bundle of one model's modules for several targets, sharing one parameter archive (docs/bundle-format.md,
# "Multi-target bundles"): a new format, since a format-1 reader would not find its modules.
MULTI_TARGET_BUNDLE_FORMAT = 2
# A bundle of an ExecuTorch program (dsa_pte: the Plan B beside the vmfb; docs/bundle-format.md, "ExecuTorch
# bundles"): a new format, since it holds no IREE module a format-1 or -2 reader could run.
EXECUTORCH_BUNDLE_FORMAT = 3
BUNDLE_FORMATS = (BUNDLE_FORMAT, MULTI_TARGET_BUNDLE_FORMAT, EXECUTORCH_BUNDLE_FORMAT)  # what this release reads
# <name>.pte_record.json: what DsaPte built (inputs, outputs, delegation, provenance).
PTE_RECORD_FORMAT = 1
BUILD_REPORT_FORMAT = 1
# Parameter archives (.irpa): each entry's metadata is this prefix + JSON {type, dtype, shape}, as
# iree-turbine's ParameterArchiveBuilder writes it, so turbine's ParameterArchive reads ours back.
PARAMETER_METADATA_PREFIX = "PYTORCH:"
# <name>.lock.json: the recipe lock (DsaLock, dsa compile).
LOCK_FORMAT = 1
# link.json: the checked edges of a dsa_pipeline (DsaLink).
LINK_FORMAT = 1
# The IREE parameter scope every exported module names its weights under (`#stream.parameter.named<"model"::...>`),
# whatever front end wrote it (torch export, ONNX, StableHLO): the runtime binds one archive to it.
PARAMETER_SCOPE = "model"
# Tuning files (toolchains/tuning/<family>.<target>.json): flags per model family and target.
TUNING_FORMAT = 1
# policy_pipeline.json: a LeRobot policy's processors and module, as a pipeline bundle ships them.
POLICY_PIPELINE_FORMAT = 1
# <name>.pipeline.json: the stages of a dsa_pipeline, in run order.
PIPELINE_INDEX_FORMAT = 1
# policies_index.json: the dsa_policy / dsa_pipeline targets of models/BUILD.bazel (dsa_policies,
# rules/private/policy.bzl), for the tools (benchmark, import matrix).
POLICIES_INDEX_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class FileFrontEnd:
    """A framework whose model is a file the export imports as it is (the manifest's model.file), not code an
    entry point builds. `importer`: "module:function" in dsa/stages/, called as
    `function(view, model_file, bucket=..., manifest_name=...) -> (mlir, record)` by dsa.stages.export;
    `input_type`: the `--iree-input-type` its compile view carries (dsa.manifest.contract); `weights`: how
    dsa.stages.params reads the checkpoint: "safetensors", or the "module:Class" of a TensorSource in a
    dsa/stages/<name>_weights.py module (ONNX: the external-data file, onnx_weights.OnnxTensors);
    `weights_file`: what the manifest's checkpoint is, for messages;
    `suffixes`: the model file's (the export refuses another, naming these);
    `label`: how the model reached IREE, as the import matrix writes it."""

    name: str
    importer: str
    input_type: str
    weights: str
    weights_file: str
    suffixes: Tuple[str, ...]
    label: str


# The file front ends, one record each (docs/frontends.md); the manifest schema's `framework` enum lists every
# one (//tests/manifest checks).
FILE_FRONT_ENDS: Dict[str, FileFrontEnd] = {f.name: f for f in (
    FileFrontEnd("onnx", importer="dsa.stages.onnx_import:export_onnx", input_type="onnx",
                 weights="dsa.stages.onnx_weights:OnnxTensors",
                 weights_file="the model's external-data file", suffixes=(".onnx",),
                 label="ONNX (IREE's importer)"),
    FileFrontEnd("stablehlo", importer="dsa.stages.stablehlo_import:export_stablehlo", input_type="stablehlo",
                 weights="safetensors", weights_file="a safetensors file of tensors by parameter name",
                 suffixes=(".mlir",), label="StableHLO (jax.export)"),
)}
# Their names (the contract checks that exactly these have a model.file).
FILE_FRAMEWORKS: Tuple[str, ...] = tuple(FILE_FRONT_ENDS)


@dataclasses.dataclass(frozen=True)
class ModuleIndex:
    """`<name>.modules.json`: what a runner loads — the compiled modules of one model for one target, each with
    its export record, and the files they share. Paths are relative to the index's directory. The one writer
    (dsa_vmfb's DsaLock action, `dsa compile`, the bundle writer) and reader of the format INDEX_FORMAT."""

    target: str
    target_spec: str
    parameter_archive: str
    parameter_scope: str
    runtime_view: str
    modules: Tuple[Tuple[str, str], ...]  # (vmfb, export record), in the order given
    # IREE runtime flags the modules need set before the process's first device (their compile reports'
    # `runtime_flags`, merged); absent from the JSON when there are none.
    runtime_flags: Tuple[str, ...] = ()
    # The same modules compiled for further targets of the same machines (an x86-64-v4 build beside an
    # x86-64-v3 one): (target, the file name of its module index, in this index's directory). A runner without
    # an explicit target takes the most capable of this index and its levels that the machine executes
    # (dsa.runtime.policy.choose_level). Absent from the JSON when there are none.
    levels: Tuple[Tuple[str, str], ...] = ()

    _FIELDS = ("target", "target_spec", "parameter_archive", "parameter_scope", "runtime_view")

    def to_json(self) -> dict:
        data = {
            "format": INDEX_FORMAT,
            **{name: getattr(self, name) for name in self._FIELDS},
            "modules": [{"vmfb": vmfb, "record": record} for vmfb, record in self.modules],
        }
        if self.runtime_flags:
            data["runtime_flags"] = list(self.runtime_flags)
        if self.levels:
            data["levels"] = [{"target": target, "index": index} for target, index in self.levels]
        return data

    def text(self) -> str:
        return canonical_json(self.to_json())

    def write(self, path: Path) -> None:
        write_bytes_atomic(path, self.text().encode("utf-8"))

    @classmethod
    def from_json(cls, data, where: str) -> "ModuleIndex":
        if not isinstance(data, dict):
            raise DsaError(where, "is not a module index (a JSON object)", "pass a NAME.modules.json")
        if data.get("format") != INDEX_FORMAT:
            raise DsaError(where, f"module index format {data.get('format')} is not supported",
                           f"this release reads format {INDEX_FORMAT}")
        missing = [name for name in cls._FIELDS + ("modules",) if name not in data]
        if missing:
            raise DsaError(where, f"module index lacks {', '.join(missing)}", "rebuild it")
        try:
            modules = tuple((m["vmfb"], m["record"]) for m in data["modules"])
        except (TypeError, KeyError):
            raise DsaError(where, "modules: each entry needs vmfb and record", "rebuild it") from None
        runtime_flags = data.get("runtime_flags", [])
        if not isinstance(runtime_flags, list) or not all(isinstance(f, str) for f in runtime_flags):
            raise DsaError(where, "runtime_flags: must be a list of '--flag=value' strings", "rebuild it")
        return cls(**{name: data[name] for name in cls._FIELDS}, modules=modules,
                   runtime_flags=tuple(runtime_flags), levels=_levels(data.get("levels", []), data["target"], where))

    @classmethod
    def read(cls, path: Path) -> "ModuleIndex":
        return cls.from_json(_read_json_artifact(path, "module index"), str(path))


def level_index_name(name: str) -> bool:
    """Whether `name` may name a level's module index: a file name in the index's own directory (no path: a
    level is built beside the index it belongs to), NAME.modules.json."""
    return (isinstance(name, str) and name.endswith(".modules.json") and len(name) > len(".modules.json")
            and "/" not in name and "\\" not in name and not name.startswith("."))


def _levels(levels, own_target: str, where: str) -> Tuple[Tuple[str, str], ...]:
    """A module index's `levels`, checked: distinct targets other than the index's own, each index a file name
    beside it."""
    if not isinstance(levels, list):
        raise DsaError(where, "levels: must be a list of {target, index}", "rebuild it")
    out, seen = [], {own_target}
    for i, level in enumerate(levels):
        if not isinstance(level, dict) or sorted(level) != ["index", "target"]:
            raise DsaError(f"{where}: levels[{i}]", "must be {\"target\": NAME, \"index\": NAME.modules.json}",
                           "rebuild it")
        target, index = level["target"], level["index"]
        if not isinstance(target, str) or target in seen:
            raise DsaError(f"{where}: levels[{i}].target", f"{target!r} is not a further target of this index "
                           f"(targets so far: {', '.join(sorted(seen))})", "rebuild it")
        if not level_index_name(index):
            raise DsaError(f"{where}: levels[{i}].index", f"{index!r} is not a module index file name beside this "
                           "index (NAME.modules.json, no directory)", "rebuild it")
        seen.add(target)
        out.append((target, index))
    return tuple(out)


def _read_json_artifact(path, kind: str):
    """JSON of one of the rule set's files, or a DsaError naming the file (bad JSON, too deep, unreadable)."""
    try:
        return read_json(path)
    except (ValueError, UnicodeError) as e:  # read_json turns a too-deep nesting into a ValueError too
        raise DsaError(str(path), f"is not a readable {kind}: {str(e)[:200]}", "rebuild it, or copy it again") from None
    except OSError as e:
        raise DsaError(str(path), f"cannot be read: {e.strerror or e}", f"pass an existing {kind}") from None


class JsonArtifact:
    """A JSON artifact of the rule set: KIND names it in messages, FORMAT is its version, REQUIRED the fields
    every instance has. Each subclass is the one writer (`write`, `dumps`: checked, canonical JSON, written
    atomically) and reader (`read`, `check`: another format or a missing field is refused, naming the file)
    of its format."""

    KIND = "artifact"
    FORMAT = 0
    REQUIRED: Tuple[str, ...] = ()

    @classmethod
    def check(cls, data, where: str) -> dict:
        if not isinstance(data, dict):
            raise DsaError(where, f"is not a {cls.KIND} (a JSON object)", "rebuild it")
        if data.get("format") != cls.FORMAT:
            raise DsaError(where, f"{cls.KIND} format {data.get('format')!r} is not supported",
                           f"this release reads format {cls.FORMAT}")
        missing = [name for name in cls.REQUIRED if name not in data]
        if missing:
            raise DsaError(where, f"{cls.KIND} lacks {', '.join(missing)}", "rebuild it")
        return data

    @classmethod
    def read(cls, path) -> dict:
        return cls.check(_read_json_artifact(path, cls.KIND), str(path))

    @classmethod
    def dumps(cls, data: dict) -> bytes:
        cls.check(data, f"the {cls.KIND} being written")
        return canonical_json(data).encode("utf-8")

    @classmethod
    def write(cls, path, data: dict) -> None:
        write_bytes_atomic(Path(path), cls.dumps(data))


class ExportRecord(JsonArtifact):
    KIND = "export record"
    FORMAT = RECORD_FORMAT
    REQUIRED = ("model_id", "function", "parameter_scope", "inputs", "outputs", "parameters")


class PteRecord(JsonArtifact):
    KIND = "ExecuTorch program record"
    FORMAT = PTE_RECORD_FORMAT
    REQUIRED = ("model_id", "method", "inputs", "outputs", "pte_sha256")


class CompileReport(JsonArtifact):
    KIND = "compile report"
    FORMAT = REPORT_FORMAT
    REQUIRED = ("model_id", "target", "flags", "mlir_sha256", "vmfb_sha256")


class Lock(JsonArtifact):
    KIND = "recipe lock"
    FORMAT = LOCK_FORMAT
    REQUIRED = ("model_id", "target", "manifest", "checkpoint", "tool_sources", "modules")


class Link(JsonArtifact):
    KIND = "link"
    FORMAT = LINK_FORMAT
    REQUIRED = ("stages", "edges", "inputs", "outputs")


class PipelineIndex(JsonArtifact):
    KIND = "pipeline index"
    FORMAT = PIPELINE_INDEX_FORMAT
    REQUIRED = ("link", "stages")


class PoliciesIndex(JsonArtifact):
    """`policies_index.json` (Starlark's dsa_policies writes it): `policies`, one row per dsa_policy (POLICY_ROW:
    paths relative to the workspace's output root; None where the policy has none; `test`: its test target or "")
    and `pipelines`, one row per dsa_pipeline (PIPELINE_ROW). `read` refuses a row that lacks a field or gives it the wrong type, naming the
    file, the row and the field."""

    KIND = "policies index"
    FORMAT = POLICIES_INDEX_FORMAT
    REQUIRED = ("policies", "pipelines")
    # field → what it holds: "path" (a non-empty string), "path or null", "text" (a string; a policy without a
    # test target has "" as its test)
    POLICY_ROW = {"name": "path", "label": "path", "test": "text", "index": "path", "manifest": "path",
                  "checkpoint": "path", "policy_config": "path or null", "model_file": "path or null",
                  "python": "path or null"}
    PIPELINE_ROW = {"name": "path", "label": "path", "test": "text", "index": "path"}
    # Optional in a policy row: `level_of`, the policy whose default build this one is a level of (its index
    # lists it; the tools measure the policy, not each level apart).

    @classmethod
    def check(cls, data, where: str) -> dict:
        data = super().check(data, where)
        hint = "rebuild //models:policies_index (rules/private/policy.bzl's dsa_policies writes it)"
        for section, fields in (("policies", cls.POLICY_ROW), ("pipelines", cls.PIPELINE_ROW)):
            rows = data[section]
            if not isinstance(rows, list):
                raise DsaError(f"{where}: {section}", f"is {type(rows).__name__}, not a list of rows", hint)
            for i, row in enumerate(rows):
                if not isinstance(row, dict):
                    raise DsaError(f"{where}: {section}[{i}]", f"is {type(row).__name__}, not an object", hint)
                for field, holds in fields.items():
                    if field not in row:
                        raise DsaError(f"{where}: {section}[{i}].{field}", "is missing", hint)
                    value = row[field]
                    if holds == "text":
                        ok, wanted = isinstance(value, str), "a string"
                    else:
                        ok = (isinstance(value, str) and value != "") or (holds == "path or null" and value is None)
                        wanted = "a non-empty string" + (" or null" if holds == "path or null" else "")
                    if not ok:
                        raise DsaError(f"{where}: {section}[{i}].{field}", f"is {str(value)[:60]!r}, not {wanted}",
                                       hint)
                level_of = row.get("level_of")
                if section == "policies" and level_of is not None and not (isinstance(level_of, str) and level_of):
                    raise DsaError(f"{where}: policies[{i}].level_of", f"is {str(level_of)[:60]!r}, not the name "
                                   "of the policy this build is a level of", hint)
                if section == "pipelines":
                    stages = row.get("stages")
                    if not (isinstance(stages, list) and stages and all(isinstance(s, str) and s for s in stages)):
                        raise DsaError(f"{where}: pipelines[{i}].stages", f"is {str(stages)[:60]!r}, not a "
                                       "non-empty list of dsa_vmfb names", hint)
        return data


class BundleMeta(JsonArtifact):
    """bundle.json (read by dsa.runtime.bundle.read_bundle_json, which names newer formats for the user)."""

    KIND = "bundle"
    FORMAT = BUNDLE_FORMAT
    REQUIRED = ("files",)


class MultiTargetBundleMeta(BundleMeta):
    """bundle.json of a multi-target bundle (format 2)."""

    FORMAT = MULTI_TARGET_BUNDLE_FORMAT
    REQUIRED = ("files", "targets", "parameter_archive", "runtime_view")


class BuildReport(JsonArtifact):
    KIND = "build report"
    FORMAT = BUILD_REPORT_FORMAT


# Entry points of the rule set's own front ends that moved when the package was layered (dsa/lerobot.py became
# dsa/frontends/lerobot): a 1.x manifest naming the old one stays valid (docs/manifest.md) and builds the same
# model (dsa.stages.export.load_entry_point imports the current name); `dsa manifest validate` says which name
# replaced it.
RENAMED_ENTRY_POINTS = {
    "dsa.lerobot:export_spec": "dsa.frontends.lerobot:export_spec",
}


def current_entry_point(entry_point: str) -> str:
    """The entry point as this release names it (RENAMED_ENTRY_POINTS), the given one if it was not renamed."""
    return RENAMED_ENTRY_POINTS.get(entry_point, entry_point)
