"""DsaBundle: one compiled policy for one target as a single, deterministic, verifiable release archive.

    bin/dsa bundle create --lock L --manifest M --runtime-view R --target-spec T --params P \\
        --module NAME=VMFB,EXPORT_RECORD,COMPILE_REPORT ... --out NAME.tar [--digest NAME.sha256]
    bin/dsa bundle create --index out/pi0/x86_64-v3.modules.json --manifest manifests/pi0.yaml \\
        --target-spec toolchains/targets/x86_64-v3.json --out pi0_bundle.tar    # from dsa compile's output
    bin/dsa bundle create --pipeline bazel-bin/models/groot.pipeline.json \\
        --stage-manifest groot_backbone=manifests/groot_backbone.yaml \\
        --stage-manifest groot_head=manifests/groot_head.yaml --out groot_bundle.tar   # a linked pipeline
    bin/dsa bundle verify NAME.tar          # every check `dsa run --bundle` makes, then a summary
    bin/dsa bundle list NAME.tar            # the files, their sizes and digests
    dsa bundle release NAME.tar DEST    # verify, then copy NAME.tar and NAME.sha256 into DEST

The archive is a plain tar (GNU format, no compression) whose members are sorted by name and carry fixed
metadata (mtime, owner, mode), so the same inputs give the same bytes in any checkout, on any machine. Its
layout, format 1, is specified in docs/bundle-format.md: the vmfbs with their export records and compile
reports, the parameter archive, the manifest and its runtime view, the target spec, the recipe lock
(`lock.json`), a build report, an in-toto/SLSA provenance statement and `bundle.json` (format, identity,
the digest and size of every other file, and the module index relative to the bundle root).

A pipeline bundle (`dsa_bundle(pipeline = ...)`, "Pipeline bundles" in docs/bundle-format.md) holds several
linked models: each stage's files as above, named `<stage>.<file>`, the link (`link.json`) and the pipeline
index (`pipeline.json`); bundle.json says `"kind": "pipeline"` and lists the stages. One writer serves both
(`write_bundle`: a single-model bundle is one unlinked stage, its files at the root) and one reader
(`extract_bundle`; `OpenedBundle.stages` gives either kind as its list of models).

A reader refuses, with one message naming what failed: an archive whose sha256 differs from the
`NAME.sha256` beside it, a truncated or padded archive, members that are not plain files with plain names,
a bundle format it does not read, and any file whose digest or size differs from bundle.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import atomic_output, canonical_json, read_json, sha256_file
from dsa.core.formats import (BUILD_REPORT_FORMAT, BUNDLE_FORMAT, BUNDLE_FORMATS, EXECUTORCH_BUNDLE_FORMAT,
                              MULTI_TARGET_BUNDLE_FORMAT, PIPELINE_INDEX_FORMAT, BuildReport, BundleMeta, CompileReport,
                              ExportRecord, Link, Lock, ModuleIndex, MultiTargetBundleMeta, PipelineIndex, PteRecord)
from dsa.core.runtime_flags import index_runtime_flags
from dsa.runtime.policy import read_module_index


# Fixed member metadata. The mtime is rules_pkg's "portable" 2000-01-01T00:00:00Z: a constant that every
# tar implementation extracts without a warning (0, the epoch, draws "implausibly old time stamp").
MTIME = 946684800
FILE_MODE = 0o644
TAR_FORMAT = tarfile.GNU_FORMAT  # no pax headers (they would carry times); base-256 sizes past 8 GiB
BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE

BUNDLE_JSON = "bundle.json"
LOCK_JSON = "lock.json"
INDEX_JSON = "modules.json"
BUILD_REPORT_JSON = "build_report.json"
PROVENANCE_JSON = "provenance.intoto.json"
MANIFEST_YAML = "manifest.yaml"
RUNTIME_VIEW_JSON = "runtime_view.json"
TARGET_SPEC_JSON = "target_spec.json"
PARAMS_IRPA = "params.irpa"

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
# Identifies the structure of externalParameters/internalParameters; documented in docs/bundle-format.md.
BUILD_TYPE = "https://rules-dsa.invalid/dsa_bundle/v1"
BUILDER_ID = "https://rules-dsa.invalid/dsa_bundle"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
# No member of a bundle may be larger (a full-size VLA's parameter archive is a few GB; the largest
# parameter archive a 64-bit IREE runtime maps is far above this, a bundle beyond it is a mistake or an attack).
MAX_MEMBER_BYTES = 64 << 30
_DIGEST_LINE = re.compile(r"^([0-9a-f]{64})  (\S.*)$")


@dataclasses.dataclass
class ModuleInput:
    """One compiled module to bundle: its vmfb with the export record and compile report it came with."""

    name: str  # e.g. prompt_len_0; the bundle stores NAME.vmfb, NAME.export_record.json, NAME.compile_report.json
    vmfb: Path
    export_record: Path
    compile_report: Path


def digest_line(sha256: str, basename: str) -> str:
    """The `.sha256` file's one line, in `sha256sum` form: `<hex>  <basename>`."""
    return f"{sha256}  {basename}\n"


def sidecar_path(archive: Path) -> Path:
    """Where the digest of `archive` lives: NAME.sha256 beside NAME.tar."""
    archive = Path(archive)
    return archive.with_name((archive.name[:-len(".tar")] if archive.name.endswith(".tar") else archive.name)
                             + ".sha256")


# ---------------------------------------------------------------------------------------------------------
# Writing


def _json_bytes(obj) -> bytes:
    return canonical_json(obj).encode("utf-8")


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = MTIME
    info.mode = FILE_MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def _check_same(what: str, where: str, expected: Optional[str], actual: str, hint: str) -> None:
    if expected is not None and expected != actual:
        raise DsaError(where, f"{what} is {actual}, but the lock records {expected}", hint)


def _build_report(lock: dict, records: Dict[str, dict], reports: Dict[str, dict], sizes: Dict[str, int],
                  digests: Dict[str, str]) -> dict:
    modules = []
    for name in sorted(records):
        record, report = records[name], reports[name]
        histogram = record.get("op_histogram", {})
        tools = dict(record.get("toolchain", {}))
        if "iree_base_compiler" in report:
            tools["iree-base-compiler"] = report["iree_base_compiler"]
        modules.append({
            "name": name,
            "function": record.get("function"),
            "bucket": record.get("bucket"),
            "export": {
                "op_histogram": dict(sorted(histogram.items())),
                "op_count": sum(histogram.values()),
                "parameter_count": record.get("parameter_count"),
                "parameters_read": len(record.get("parameters", [])),
                "mlir_sha256": record.get("mlir_sha256"),
            },
            "compile": {
                "flags": report.get("flags", []),
                "dispatch_count": report.get("dispatch_count"),
                "executable_count": report.get("executable_count"),
                "runtime_driver": report.get("runtime_driver"),
            },
            "sizes": {"vmfb_bytes": sizes[f"{name}.vmfb"]},
            "tool_versions": dict(sorted(tools.items())),
        })
    toolchain = lock.get("toolchain", {})
    return {
        "format": BUILD_REPORT_FORMAT,
        "model_id": lock["model_id"],
        "target": lock["target"],
        "toolchain": {
            "lock_sha256": toolchain.get("lock_sha256"),
            "python_version": toolchain.get("python_version"),
            "installed": toolchain.get("installed", []),
        },
        "parameters": {"file": PARAMS_IRPA, "bytes": sizes[PARAMS_IRPA], "sha256": digests[PARAMS_IRPA]},
        "modules": modules,
        "sizes": {
            "vmfb_bytes_total": sum(m["sizes"]["vmfb_bytes"] for m in modules),
            "params_bytes": sizes[PARAMS_IRPA],
        },
    }


def _provenance(lock: dict, subjects: Dict[str, str], manifest_source: str, bundle_name: Optional[str]) -> dict:
    """An in-toto Statement v1 with a SLSA provenance v1 predicate. Deliberately without
    runDetails.metadata (invocation id, start and finish times): they would make every build unique."""

    def dep(name: str, sha256: str, role: str, **annotations) -> dict:
        return {"name": name, "digest": {"sha256": sha256}, "annotations": dict(role=role, **annotations)}

    toolchain = lock.get("toolchain", {})
    deps = [
        dep(manifest_source, lock["manifest"]["sha256"], "manifest"),
        dep("checkpoint", lock["checkpoint"]["sha256"], "checkpoint"),
        dep(f"target_spec/{lock['target']}.json", lock["target_spec"]["sha256"], "target_spec"),
        dep("requirements_lock.txt", toolchain.get("lock_sha256", ""), "toolchain_lock",
            python_version=toolchain.get("python_version"), installed=toolchain.get("installed", [])),
    ]
    deps += [dep(path, sha, "model_source") for path, sha in sorted(lock.get("model_sources", {}).items())]
    deps += [dep(path, sha, "tool_source") for path, sha in sorted(lock.get("tool_sources", {}).items())]
    external = {"model_id": lock["model_id"], "target": lock["target"], "manifest": manifest_source}
    if bundle_name:
        external["bundle"] = bundle_name
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": sha}} for name, sha in sorted(subjects.items())],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": external,
                "internalParameters": {
                    "target_flags": lock["target_spec"].get("flags", []),
                    "modules": [{"name": m["name"], "flags": m.get("flags", [])} for m in lock.get("modules", [])],
                },
                "resolvedDependencies": deps,
            },
            "runDetails": {"builder": {"id": BUILDER_ID, "version": {"bundle_format": str(BUNDLE_FORMAT)}}},
        },
    }


@dataclasses.dataclass
class _Stage:
    """One model's files as a bundle holds them (names relative to the model's part of the bundle)."""

    lock: dict
    payload: Dict[str, Path]
    records: Dict[str, dict]
    reports: Dict[str, dict]
    digests: Dict[str, str]
    sizes: Dict[str, int]
    index: dict


def _collect(*, lock: Path, manifest: Path, runtime_view: Path, target_spec: Path, params: Path,
             modules: Sequence[ModuleInput]) -> _Stage:
    """Reads one model's files and checks them against its lock (so a bundle's lock always describes its own
    files); returns them with their digests, sizes and module index."""
    lock_path = Path(lock)
    lock_data = Lock.read(lock_path)
    if not modules:
        raise DsaError("dsa-bundle", "no modules to bundle", "pass at least one --module")

    payload: Dict[str, Path] = {
        LOCK_JSON: lock_path,
        MANIFEST_YAML: Path(manifest),
        RUNTIME_VIEW_JSON: Path(runtime_view),
        TARGET_SPEC_JSON: Path(target_spec),
        PARAMS_IRPA: Path(params),
    }
    records: Dict[str, dict] = {}
    reports: Dict[str, dict] = {}
    for m in modules:
        if not _NAME.match(m.name) or m.name in records:
            raise DsaError("dsa-bundle", f"module name '{m.name}' is not a plain, unique file name",
                           "name modules with letters, digits, '_', '.', '-'")
        payload[f"{m.name}.vmfb"] = Path(m.vmfb)
        payload[f"{m.name}.export_record.json"] = Path(m.export_record)
        payload[f"{m.name}.compile_report.json"] = Path(m.compile_report)
        records[m.name] = ExportRecord.read(m.export_record)
        reports[m.name] = CompileReport.read(m.compile_report)

    digests = {name: sha256_file(path) for name, path in payload.items()}
    sizes = {name: path.stat().st_size for name, path in payload.items()}

    # The lock must describe exactly these files.
    where = str(lock_path)
    rebuild = "rebuild the bundle from one consistent build (the lock and the files come from different builds)"
    _check_same("the manifest's sha256", where, lock_data["manifest"]["sha256"], digests[MANIFEST_YAML], rebuild)
    _check_same("the target spec's sha256", where, lock_data["target_spec"]["sha256"], digests[TARGET_SPEC_JSON],
                f"pass --target-spec toolchains/targets/{lock_data.get('target')}.json, the spec file the lock "
                "was made from")
    _check_same("the runtime view's sha256", where, lock_data.get("views", {}).get("runtime"),
                digests[RUNTIME_VIEW_JSON], rebuild)
    for name, sha in lock_data.get("artifacts", {}).items():
        if name in digests:
            _check_same(f"{name}'s sha256", where, sha, digests[name], rebuild)
    locked = sorted(m["name"] for m in lock_data.get("modules", []))
    if locked != sorted(records):
        raise DsaError(where, f"locks modules {locked}, but the bundle is given {sorted(records)}", rebuild)
    for name, record in records.items():
        if record.get("model_id") != lock_data["model_id"]:
            raise DsaError(f"{name}.export_record.json", f"is for model '{record.get('model_id')}', the lock "
                           f"for '{lock_data['model_id']}'", rebuild)

    scopes = {r.get("parameter_scope", "model") for r in records.values()}
    if len(scopes) != 1:
        raise DsaError("dsa-bundle", f"modules use different parameter scopes {sorted(scopes)}",
                       "bundle modules of one model")
    index = ModuleIndex(
        target=lock_data["target"],
        target_spec=TARGET_SPEC_JSON,
        parameter_archive=PARAMS_IRPA,
        parameter_scope=scopes.pop(),
        runtime_view=RUNTIME_VIEW_JSON,
        modules=tuple((f"{name}.vmfb", f"{name}.export_record.json") for name in sorted(records)),
        runtime_flags=index_runtime_flags(reports[name] for name in sorted(records)),
    ).to_json()
    return _Stage(lock_data, payload, records, reports, digests, sizes, index)


def _write_archive(out: Path, payload: Dict[str, Path], generated: Dict[str, bytes], sizes: Dict[str, int],
                   digest_out: Optional[Path]) -> str:
    names = sorted(set(payload) | set(generated))
    with atomic_output(out) as tmp:
        with open(tmp, "wb") as raw:
            with tarfile.open(fileobj=raw, mode="w", format=TAR_FORMAT) as tar:
                for name in names:
                    if name in generated:
                        data = generated[name]
                        tar.addfile(_tarinfo(name, len(data)), io.BytesIO(data))
                    else:
                        with open(payload[name], "rb") as f:
                            tar.addfile(_tarinfo(name, sizes[name]), f)
    sha = sha256_file(out)
    digest_out = Path(digest_out) if digest_out else sidecar_path(out)
    with atomic_output(digest_out) as tmp:
        tmp.write_text(digest_line(sha, out.name), encoding="utf-8")
    return sha


def _member_digests(payload: Dict[str, Path], generated: Dict[str, bytes]) -> Tuple[Dict[str, str], Dict[str, int]]:
    """The sha256 and size of every member: the files to copy and the generated ones."""
    digests: Dict[str, str] = {}
    sizes: Dict[str, int] = {}
    for name, path in payload.items():
        digests[name], sizes[name] = sha256_file(path), path.stat().st_size
    for name, data in generated.items():
        digests[name], sizes[name] = hashlib.sha256(data).hexdigest(), len(data)
    return digests, sizes


@dataclasses.dataclass
class StageInput:
    """One model's files to bundle: its lock, manifest, views, parameters and compiled modules. A single-model
    bundle is one unlinked stage; a pipeline bundle is several stages and their link."""

    name: str  # the stage name link.json uses; in a pipeline bundle the stage's members are `<name>.<member>`
    lock: Path
    manifest: Path
    runtime_view: Path
    target_spec: Path
    params: Path
    modules: Sequence[ModuleInput]
    manifest_source: Optional[str] = None

    @property
    def source(self) -> str:
        return self.manifest_source or Path(self.manifest).name


LINK_JSON = "link.json"
PIPELINE_JSON = "pipeline.json"
POLICY_PIPELINE_JSON = "policy_pipeline.json"  # dsa.runtime.policy_pipeline.POLICY_PIPELINE_JSON
POLICY_PIPELINE_CONFIG_JSON = "policy_config.json"  # dsa.runtime.policy_pipeline.POLICY_CONFIG_JSON


def _prefixed_index(index: dict, prefix: str, shared: Sequence[str] = ()) -> dict:
    """A model's module index with its files named `<prefix><file>`, except the `shared` ones (at the root)."""
    out = dict(index)
    for key in ("parameter_archive", "runtime_view", "target_spec"):
        if index[key] not in shared:
            out[key] = prefix + index[key]
    out["modules"] = [{"vmfb": prefix + m["vmfb"], "record": prefix + m["record"]} for m in index["modules"]]
    return out


def _pipeline_provenance(collected, digests: Dict[str, str], bundle_name: str, target: str) -> dict:
    """One statement for a pipeline: every member as a subject, every stage's inputs as dependencies (the
    shared tool sources and toolchain once)."""
    statement = None
    deps: List[dict] = []
    seen = set()
    for s, c, _ in collected:
        one = _provenance(c.lock, digests, s.source, bundle_name)
        if statement is None:
            statement = one
        for dep in one["predicate"]["buildDefinition"]["resolvedDependencies"]:
            role = dep["annotations"]["role"]
            if role in ("tool_source", "toolchain_lock"):
                key = (dep["name"], dep["digest"]["sha256"])
                if key in seen:
                    continue
                seen.add(key)
            else:
                dep = dict(dep, annotations=dict(dep["annotations"], stage=s.name))
                if role == "checkpoint":
                    dep["name"] = f"{s.name}.checkpoint"
            deps.append(dep)
    definition = statement["predicate"]["buildDefinition"]
    definition["externalParameters"] = {
        "model_id": bundle_name, "target": target, "bundle": bundle_name,
        "stages": [{"name": s.name, "model_id": c.lock["model_id"], "manifest": s.source} for s, c, _ in collected],
    }
    definition["internalParameters"] = {
        "target_flags": collected[0][1].lock["target_spec"].get("flags", []),
        "modules": [{"name": f"{s.name}.{m['name']}", "flags": m.get("flags", [])}
                    for s, c, _ in collected for m in c.lock.get("modules", [])],
    }
    definition["resolvedDependencies"] = deps
    return statement


def write_bundle(out: Path, stages: Sequence[StageInput], *, link: Optional[Path] = None,
                 digest_out: Optional[Path] = None, processors: Optional[Sequence[Path]] = None,
                 policy_config: Optional[Path] = None) -> str:
    """The bundle writer: writes the archive `out` (and `digest_out`, default NAME.sha256 beside it) and
    returns its sha256.

    Without `link` there is exactly one stage and its files lie at the archive root (a single-model bundle);
    with `link` (a dsa_pipeline's link.json) each stage's files are named `<stage>.<member>` and the link and
    the pipeline index are added (docs/bundle-format.md, "Pipeline bundles"). Either way every stage's files
    are checked against its lock, and a linked stage's export records against the link, so the bundle's lock
    and link describe its own files. The result depends only on the contents of the inputs and on each
    stage's `manifest_source` (its repository-relative name), never on where the inputs are."""
    out = Path(out)
    bundle_name = out.name[:-len(".tar")] if out.name.endswith(".tar") else out.name
    payload: Dict[str, Path] = {}
    generated: Dict[str, bytes] = {}
    linked = link is not None
    if linked:
        link_path = Path(link)
        link_data = Link.read(link_path)
        names = [s.name for s in stages]
        in_link = [s["name"] for s in link_data["stages"]]
        if names != in_link:
            raise DsaError(str(link_path), f"links stages {in_link}, but the bundle is given {names}",
                           "bundle the stages of this link, in its order")
        payload[LINK_JSON] = link_path
    elif len(stages) != 1:
        raise DsaError("dsa-bundle", f"{len(stages)} models to bundle without a link",
                       "bundle one model (dsa_bundle(module = ...)), or several linked by a dsa_pipeline "
                       "(dsa_bundle(pipeline = ...))")

    collected: List[Tuple[StageInput, _Stage, dict]] = []
    for n, stage in enumerate(stages):
        if linked and not _NAME.match(stage.name):
            raise DsaError("dsa-bundle", f"stage name '{stage.name}' is not a plain file name")
        c = _collect(lock=stage.lock, manifest=stage.manifest, runtime_view=stage.runtime_view,
                     target_spec=stage.target_spec, params=stage.params, modules=stage.modules)
        prefix = stage.name + "." if linked else ""
        if linked:
            records = [c.digests[m["record"]] for m in c.index["modules"]]
            if sorted(records) != sorted(link_data["stages"][n]["export_records"]):
                raise DsaError(str(link_path), f"stage {stage.name}: the link was checked against other export "
                               "records than the bundle's", "rebuild the pipeline and the bundle from one build")
        for name, path in c.payload.items():
            payload[prefix + name] = path
        index = _prefixed_index(c.index, prefix)
        generated[prefix + INDEX_JSON] = ModuleIndex.from_json(index, prefix + INDEX_JSON).text().encode("utf-8")
        collected.append((stage, c, index))

    targets = sorted({c.lock["target"] for _, c, _ in collected})
    if len(targets) != 1:
        raise DsaError("dsa-bundle", f"the stages are compiled for different targets {targets}",
                       "bundle one target's modules")
    reports = [_build_report(c.lock, c.records, c.reports, c.sizes, c.digests) for _, c, _ in collected]
    if linked:
        pipeline = {
            "format": PIPELINE_INDEX_FORMAT,
            "link": LINK_JSON,
            "stages": [{"name": s.name, "index": s.name + "." + INDEX_JSON} for s, _, _ in collected],
        }
        generated[PIPELINE_JSON] = PipelineIndex.dumps(pipeline)
        generated[BUILD_REPORT_JSON] = BuildReport.dumps({
            "format": BUILD_REPORT_FORMAT, "model_id": bundle_name, "target": targets[0],
            "stages": [dict(report, stage=s.name) for (s, _, _), report in zip(collected, reports)],
        })
    else:
        if processors is not None:
            reports[0]["policy_pipeline"] = _add_policy_pipeline(collected[0], processors, policy_config,
                                                                 payload, generated)
        generated[BUILD_REPORT_JSON] = BuildReport.dumps(reports[0])

    digests, sizes = _member_digests(payload, generated)
    if linked:
        statement = _pipeline_provenance(collected, digests, bundle_name, targets[0])
    else:
        statement = _provenance(collected[0][1].lock, digests, collected[0][0].source, bundle_name)
    provenance = _json_bytes(statement)
    generated[PROVENANCE_JSON] = provenance
    digests[PROVENANCE_JSON], sizes[PROVENANCE_JSON] = hashlib.sha256(provenance).hexdigest(), len(provenance)

    def stage_meta(s: StageInput, c: _Stage, index: dict) -> dict:
        prefix = s.name + "." if linked else ""
        return {"model_id": c.lock["model_id"], "manifest": prefix + MANIFEST_YAML, "manifest_source": s.source,
                "lock": prefix + LOCK_JSON, "index_file": prefix + INDEX_JSON, "index": index}

    common = {"format": BUNDLE_FORMAT, "target": targets[0], "build_report": BUILD_REPORT_JSON,
              "provenance": PROVENANCE_JSON}
    if linked:
        meta = dict(common, kind="pipeline", model_id=bundle_name, link=LINK_JSON, pipeline_file=PIPELINE_JSON,
                    pipeline=pipeline, stages=[dict(stage_meta(*entry), name=entry[0].name) for entry in collected])
    else:
        meta = dict(common, **stage_meta(*collected[0]))
        if processors is not None:
            meta["policy_pipeline"] = POLICY_PIPELINE_JSON
    meta["files"] = {name: {"sha256": digests[name], "size": sizes[name]} for name in sorted(digests)}
    generated[BUNDLE_JSON] = BundleMeta.dumps(meta)
    return _write_archive(out, payload, generated, sizes, digest_out)


def _add_policy_pipeline(collected, processors: Sequence[Path], policy_config: Optional[Path],
                         payload: Dict[str, Path], generated: Dict[str, bytes]) -> List[dict]:
    """Adds the policy's processor files, config.json and policy_pipeline.json to a single-model bundle; returns
    the pipeline's nodes for the build report (name, implementation, the digests of what each reads)."""
    from dsa.runtime.policy_pipeline import describe, pinned_files

    stage, c, _ = collected
    if policy_config is None:
        raise DsaError("dsa-bundle create", "--processor needs --policy-config (the policy's config.json)")
    # The runtime view carries the processors' pins (checked against the lock in _collect); the manifest is
    # not parsed here (the runtime layer reads no YAML).
    manifest = read_json(stage.runtime_view)
    members = pinned_files(manifest, stage.source or str(stage.manifest), processors, Path(policy_config))
    for name, path in members.items():
        if name in payload or name == POLICY_PIPELINE_JSON:
            raise DsaError("dsa-bundle create", f"processor file '{name}' has the name of a bundle member",
                           "rename the module or the file")
        payload[name] = path
    spec = describe(manifest, stage.source or str(stage.manifest), members, c.records,
                    {name: c.digests[f"{name}.vmfb"] for name in c.records})
    generated[POLICY_PIPELINE_JSON] = _json_bytes(spec)
    report = []
    for node in spec["nodes"]:
        entry = {"name": node["name"], "implementation": node["implementation"]}
        digests = {}
        for key in ("pipeline", "state_file", "tokenizer"):
            if key in node:
                digests[node[key]["file"]] = node[key]["sha256"]
        if "modules" in node:
            digests.update({f"{n}.vmfb": sha for n, sha in node["modules"].items()})
        if digests:
            entry["sha256"] = digests
        report.append(entry)
    return report


# The files every target of a multi-target bundle shares, at the archive root: parameters do not depend on the
# target, nor do the manifest and its runtime view.
SHARED_MEMBERS = (MANIFEST_YAML, PARAMS_IRPA, RUNTIME_VIEW_JSON)


def write_multi_target_bundle(out: Path, targets: Sequence[StageInput], *,
                              digest_out: Optional[Path] = None) -> str:
    """One model's modules for several targets in one archive (format 2, docs/bundle-format.md "Multi-target
    bundles"): one parameter archive, manifest and runtime view at the root, each target's lock, target spec,
    module index and modules under `<target>.` names. `targets` are in preference order: `dsa run` runs the
    first one this machine can execute. Refused unless every target's files come from one build of one model
    (same manifest, checkpoint, parameters and runtime view) and no target appears twice."""
    out = Path(out)
    bundle_name = out.name[:-len(".tar")] if out.name.endswith(".tar") else out.name
    if len(targets) < 2:
        raise DsaError("dsa-bundle", f"{len(targets)} target(s) for a multi-target bundle",
                       "bundle one target's modules with dsa_bundle(module = ...), several with modules = [...]")
    collected: List[Tuple[StageInput, _Stage]] = []
    for t in targets:
        c = _collect(lock=t.lock, manifest=t.manifest, runtime_view=t.runtime_view, target_spec=t.target_spec,
                     params=t.params, modules=t.modules)
        collected.append((t, c))
    names = [c.lock["target"] for _, c in collected]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DsaError("dsa-bundle", f"target {', '.join(twice)} is given more than once (targets {names})",
                       "give each target's modules once; a build with --//:target compiles every dsa_vmfb for that "
                       "one target: build a multi-target bundle without it")
    for n in names:
        if not _NAME.match(n):
            raise DsaError("dsa-bundle", f"target name '{n}' is not a plain file name")
    first_t, first = collected[0]
    same = (("model_id", lambda c: c.lock["model_id"]), ("manifest", lambda c: c.digests[MANIFEST_YAML]),
            ("checkpoint", lambda c: c.lock["checkpoint"]["sha256"]),
            ("parameter archive", lambda c: c.digests[PARAMS_IRPA]),
            ("runtime view", lambda c: c.digests[RUNTIME_VIEW_JSON]))
    for what, key in same:
        for t, c in collected[1:]:
            if key(c) != key(first):
                raise DsaError("dsa-bundle", f"the {what} of target {c.lock['target']} differs from target "
                               f"{first.lock['target']}'s ({key(c)} vs {key(first)})",
                               "a multi-target bundle holds one model's modules, compiled from one export and "
                               "one parameter archive: bundle dsa_vmfb targets of the same dsa_model")

    payload: Dict[str, Path] = {name: first.payload[name] for name in SHARED_MEMBERS}
    generated: Dict[str, bytes] = {}
    tables = []
    for t, c in collected:
        target = c.lock["target"]
        prefix = target + "."
        for name, path in c.payload.items():
            if name not in SHARED_MEMBERS:
                payload[prefix + name] = path
        index = _prefixed_index(c.index, prefix, SHARED_MEMBERS)
        generated[prefix + INDEX_JSON] = ModuleIndex.from_json(index, prefix + INDEX_JSON).text().encode("utf-8")
        spec = read_json(c.payload[TARGET_SPEC_JSON])
        tables.append({"target": target, "runtime_driver": spec.get("runtime_driver", "local-task"),
                       "lock": prefix + LOCK_JSON, "target_spec": prefix + TARGET_SPEC_JSON,
                       "index_file": prefix + INDEX_JSON, "index": index})
    reports = [_build_report(c.lock, c.records, c.reports, c.sizes, c.digests) for _, c in collected]
    generated[BUILD_REPORT_JSON] = BuildReport.dumps({
        "format": BUILD_REPORT_FORMAT, "model_id": first.lock["model_id"], "targets": reports,
        "parameters": reports[0]["parameters"],
    })

    digests, sizes = _member_digests(payload, generated)

    # One statement: every member a subject; the model's inputs once, each target's spec and flags.
    statement = _provenance(first.lock, digests, first_t.source, bundle_name)
    definition = statement["predicate"]["buildDefinition"]
    deps = [d for d in definition["resolvedDependencies"] if d["annotations"]["role"] != "target_spec"]
    deps[2:2] = [{"name": f"target_spec/{c.lock['target']}.json", "digest": {"sha256": c.lock["target_spec"]["sha256"]},
                  "annotations": {"role": "target_spec", "target": c.lock["target"]}} for _, c in collected]
    definition["resolvedDependencies"] = deps
    definition["externalParameters"] = {"model_id": first.lock["model_id"], "targets": names,
                                        "manifest": first_t.source, "bundle": bundle_name}
    definition["internalParameters"] = {"targets": [
        {"target": c.lock["target"], "target_flags": c.lock["target_spec"].get("flags", []),
         "modules": [{"name": m["name"], "flags": m.get("flags", [])} for m in c.lock.get("modules", [])]}
        for _, c in collected]}
    statement["predicate"]["runDetails"]["builder"]["version"]["bundle_format"] = str(MULTI_TARGET_BUNDLE_FORMAT)
    provenance = _json_bytes(statement)
    generated[PROVENANCE_JSON] = provenance
    digests[PROVENANCE_JSON], sizes[PROVENANCE_JSON] = hashlib.sha256(provenance).hexdigest(), len(provenance)

    meta = {"format": MULTI_TARGET_BUNDLE_FORMAT, "kind": "multi-target", "model_id": first.lock["model_id"],
            "manifest": MANIFEST_YAML, "manifest_source": first_t.source, "parameter_archive": PARAMS_IRPA,
            "runtime_view": RUNTIME_VIEW_JSON, "build_report": BUILD_REPORT_JSON, "provenance": PROVENANCE_JSON,
            "targets": tables}
    meta["files"] = {name: {"sha256": digests[name], "size": sizes[name]} for name in sorted(digests)}
    generated[BUNDLE_JSON] = MultiTargetBundleMeta.dumps(meta)
    return _write_archive(out, payload, generated, sizes, digest_out)


def create_bundle(out: Path, *, lock: Path, manifest: Path, runtime_view: Path, target_spec: Path, params: Path,
                  modules: Sequence[ModuleInput], manifest_source: Optional[str] = None,
                  digest_out: Optional[Path] = None, processors: Optional[Sequence[Path]] = None,
                  policy_config: Optional[Path] = None) -> str:
    """A single-model bundle: write_bundle of one unlinked stage."""
    stage = StageInput(name="", lock=Path(lock), manifest=Path(manifest), runtime_view=Path(runtime_view),
                       target_spec=Path(target_spec), params=Path(params), modules=modules,
                       manifest_source=manifest_source)
    return write_bundle(out, [stage], digest_out=digest_out, processors=processors, policy_config=policy_config)


def pipeline_inputs(pipeline_index: Path, manifests: Dict[str, Tuple[Path, Optional[str]]]) -> dict:
    """write_bundle's arguments from a pipeline index (dsa_pipeline's NAME.pipeline.json) and each
    stage's manifest (stage name → (path, repository-relative name))."""
    pipeline_index = Path(pipeline_index)
    if not pipeline_index.is_file():
        raise DsaError(str(pipeline_index), "no such pipeline index", "build the dsa_pipeline first")
    data = PipelineIndex.read(pipeline_index)
    base = pipeline_index.parent
    if not (base / data["link"]).is_file():
        raise DsaError(str(base / data["link"]), "no such link file", "build the dsa_pipeline first")
    stages = []
    for entry in data["stages"]:
        if entry["name"] not in manifests:
            raise DsaError("dsa-bundle create", f"no manifest for stage '{entry['name']}'",
                           f"pass --stage-manifest {entry['name']}=MANIFEST")
        files = inputs_from_index(base / entry["index"])
        path, source = manifests[entry["name"]]
        stages.append(StageInput(entry["name"], manifest=Path(path), manifest_source=source, **files))
    extra = sorted(set(manifests) - {e["name"] for e in data["stages"]})
    if extra:
        raise DsaError("dsa-bundle create", f"--stage-manifest names no stage of the pipeline: {', '.join(extra)}")
    return dict(link=base / data["link"], stages=stages)


def inputs_from_index(index: Path, *, lock: Optional[Path] = None, target_spec: Optional[Path] = None) -> dict:
    """create_bundle's file arguments from a module index (`dsa_vmfb`'s NAME.modules.json in a runfiles tree,
    or `dsa compile`'s TARGET.modules.json): each module's compile report lies beside its vmfb, the lock
    beside the index (NAME.lock.json) unless given. The manifest is not in the index: pass it as well."""
    index = Path(index)
    data = read_module_index(index)
    base = index.parent
    stem = index.name[:-len(".modules.json")] if index.name.endswith(".modules.json") else index.stem
    modules = []
    for m in data["modules"]:
        vmfb = base / m["vmfb"]
        name = vmfb.name[:-len(".vmfb")]
        modules.append(ModuleInput(name, vmfb, base / m["record"], vmfb.with_name(name + ".compile_report.json")))
    return dict(
        lock=Path(lock) if lock else base / f"{stem}.lock.json",
        runtime_view=base / data["runtime_view"],
        target_spec=Path(target_spec) if target_spec else base / data["target_spec"],
        params=base / data["parameter_archive"],
        modules=modules,
    )


# ---------------------------------------------------------------------------------------------------------
# Reading


@dataclasses.dataclass(frozen=True)
class BundleStage:
    """One model of a verified bundle: a single-model bundle has one (at the root, `name` None), a pipeline
    bundle one per stage, in run order (`<name>.<member>` files)."""

    name: Optional[str]
    model_id: str
    manifest_source: str
    manifest_path: Path
    lock_path: Path
    index_path: Path

    @property
    def lock(self) -> dict:
        return Lock.read(self.lock_path)


def _stage_tables(meta: dict) -> List[dict]:
    """bundle.json's table of each model: its stages, a multi-target bundle's targets (each with the shared
    manifest), or for a single-model bundle bundle.json itself."""
    if _is_multi_target(meta):
        return [dict(t, name=t.get("target"), model_id=meta.get("model_id"), manifest=meta.get("manifest"),
                     manifest_source=meta.get("manifest_source")) for t in meta["targets"]]
    return meta["stages"] if _is_pipeline(meta) else [meta]


@dataclasses.dataclass
class OpenedBundle:
    """A verified bundle, extracted into `root`."""

    archive: Path
    root: Path
    sha256: str
    sidecar: Optional[Path]  # the NAME.sha256 the archive was checked against, or None when there is none
    meta: dict  # bundle.json
    # A multi-target bundle seen as one target's single-model bundle (for_target), or None.
    selected: Optional[str] = None

    @property
    def is_pipeline(self) -> bool:
        return _is_pipeline(self.meta)

    @property
    def is_multi_target(self) -> bool:
        return _is_multi_target(self.meta)

    @property
    def targets(self) -> List[str]:
        """The targets the bundle holds modules for, in preference order."""
        if self.is_multi_target:
            return [t["target"] for t in self.meta["targets"]]
        return [self.meta["target"]]

    @property
    def stages(self) -> List[BundleStage]:
        named = self.is_pipeline or self.is_multi_target
        return [BundleStage(name=t.get("name") if named else None, model_id=t["model_id"],
                            manifest_source=t["manifest_source"], manifest_path=self.root / t["manifest"],
                            lock_path=self.root / t["lock"], index_path=self.root / t["index_file"])
                for t in _stage_tables(self.meta)]

    def _single(self, what: str) -> BundleStage:
        if self.is_pipeline:
            stages = ", ".join(s["name"] for s in self.meta["stages"])
            raise DsaError(str(self.archive), f"is a pipeline bundle (stages {stages}): it has one {what} per stage",
                           "run it with `bin/dsa link run --bundle`; its stages' files are "
                           "<stage>.<file> (docs/bundle-format.md)")
        if self.is_multi_target:
            if self.selected is not None:
                return next(s for s in self.stages if s.name == self.selected)
            raise DsaError(str(self.archive), f"is a multi-target bundle (targets {', '.join(self.targets)}): it "
                           f"has one {what} per target", "choose one target: --target NAME")
        return self.stages[0]

    def target_spec(self, target: str) -> dict:
        """The target spec the bundle holds for `target`."""
        if self.is_multi_target:
            table = next(t for t in self.meta["targets"] if t["target"] == target)
            return read_json(self.root / table["target_spec"])
        return read_json(self.root / self.meta["index"]["target_spec"])

    def why_not_here(self) -> Dict[str, Optional[str]]:
        """target → why this machine cannot run its modules (dsa.runtime.host), or None where it can."""
        from dsa.runtime.host import host_arch, host_cpu_features, missing_driver, missing_for

        arch, features = host_arch(), host_cpu_features()
        out = {}
        for target in self.targets:
            spec = self.target_spec(target)
            out[target] = missing_for(spec, arch, features) or missing_driver(spec)
        return out

    def select_target(self, target: Optional[str] = None) -> BundleStage:
        """The model to run: with `target`, that target's (refused when the bundle has none for it); without,
        the first target in the bundle's order that this machine can execute (its CPU, or a device of its
        runtime driver). Refuses, naming each target and what it needs, when none can run here."""
        if target is not None and target not in self.targets:
            raise DsaError(str(self.archive), f"holds no modules for target '{target}' (it holds "
                           f"{', '.join(self.targets)})", "pass one of the bundle's targets to --target")
        if not self.is_multi_target:
            return self._single("module index")
        if target is None:
            reasons = self.why_not_here()
            target = next((t for t, why in reasons.items() if why is None), None)
            if target is None:
                lines = "; ".join(f"{t} (driver {self.target_spec(t).get('runtime_driver', 'local-task')}): {why}"
                                  for t, why in reasons.items())
                raise DsaError(str(self.archive), f"has no module this machine can run: {lines}",
                               "run it on a device one of its targets names, or build a bundle that also holds "
                               "a target for this machine (dsa_bundle(modules = [...]); docs/targets.md)")
        self.selected = target
        return self._single("module index")

    @property
    def index_path(self) -> Path:
        return self._single("module index").index_path

    @property
    def pipeline_path(self) -> Path:
        if not self.is_pipeline:
            raise DsaError(str(self.archive), "is a single-model bundle, not a pipeline bundle",
                           "run it with `bin/dsa run`")
        return self.root / self.meta["pipeline_file"]

    @property
    def manifest_path(self) -> Path:
        return self._single("manifest").manifest_path

    @property
    def lock(self) -> dict:
        return self._single("recipe lock").lock

    @property
    def build_report(self) -> dict:
        return BuildReport.read(self.root / self.meta["build_report"])

    @property
    def stage_reports(self) -> List[dict]:
        """Each model's build report (with its `stage` name in a pipeline bundle; one per target in a
        multi-target bundle), in run order."""
        report = self.build_report
        if self.is_multi_target:
            return report["targets"]
        return report["stages"] if self.is_pipeline else [report]

    def for_target(self, target: str) -> "OpenedBundle":
        """A multi-target bundle seen as the single-model bundle of one of its targets: its lock, index and
        build report, and its files under their single-model names (`<target>.` dropped) with the shared ones.
        `dsa diff --target` compares two bundles this way."""
        if not self.is_multi_target:
            self.select_target(target)  # refuses another target
            return self
        stage = self.select_target(target)
        table = next(t for t in self.meta["targets"] if t["target"] == target)
        prefix = target + "."
        files = {name[len(prefix):]: entry for name, entry in self.meta["files"].items() if name.startswith(prefix)}
        files.update({name: self.meta["files"][name] for name in SHARED_MEMBERS})
        # The index as a single-target bundle holds it (its paths without the prefix), so that comparing it
        # with a single-target bundle's compares content, not the layout.
        index = dict(table["index"], target_spec=TARGET_SPEC_JSON,
                     modules=[{k: v[len(prefix):] for k, v in m.items()} for m in table["index"]["modules"]])
        text = ModuleIndex.from_json(index, table["index_file"]).text().encode("utf-8")
        files[INDEX_JSON] = {"sha256": hashlib.sha256(text).hexdigest(), "size": len(text)}
        report = next(r for r in self.build_report["targets"] if r["target"] == target)
        view = tempfile.mkdtemp(prefix="target-", dir=self.root)
        (Path(view) / BUILD_REPORT_JSON).write_text(canonical_json(report), encoding="utf-8")
        meta = {"format": BUNDLE_FORMAT, "model_id": self.meta["model_id"], "target": target,
                "manifest": MANIFEST_YAML, "manifest_source": self.meta["manifest_source"],
                "lock": stage.lock_path.name, "index_file": table["index_file"], "index": index,
                "build_report": str(Path(view).name) + "/" + BUILD_REPORT_JSON,
                "provenance": self.meta["provenance"], "files": files}
        return dataclasses.replace(self, meta=meta, selected=None)

    @property
    def provenance(self) -> dict:
        return read_json(self.root / self.meta["provenance"])

    def describe(self) -> str:
        checked = f"matches {self.sidecar.name}" if self.sidecar else "no .sha256 beside it"
        what = (f"pipeline {' → '.join(s.model_id for s in self.stages)}" if self.is_pipeline
                else self.meta["model_id"])
        where = (f"targets {', '.join(self.targets)}" if self.is_multi_target else self.meta["target"])
        return (f"bundle {self.archive.name}: format {self.meta['format']}, {what} for {where}, "
                f"sha256 {self.sha256} ({checked}), {len(self.meta['files'])} files verified")


def _is_pipeline(meta: dict) -> bool:
    """A pipeline bundle (several linked models) rather than one model's."""
    return meta.get("kind") == "pipeline"


def _is_multi_target(meta: dict) -> bool:
    """A multi-target bundle (one model's modules for several targets, format 2)."""
    return meta.get("kind") == "multi-target"


def check_archive_digest(archive: Path) -> Tuple[str, Optional[Path]]:
    """The archive's sha256, checked against NAME.sha256 beside it when that exists."""
    archive = Path(archive)
    if not archive.is_file():
        raise DsaError(str(archive), "no such bundle archive", "pass the NAME.tar a dsa_bundle built")
    sha = sha256_file(archive)
    sidecar = sidecar_path(archive)
    if not sidecar.is_file():
        return sha, None
    text = sidecar.read_text(encoding="utf-8", errors="replace").strip()
    match = _DIGEST_LINE.match(text)
    if not match or "\n" in text:
        raise DsaError(str(sidecar), "is not one `<sha256>  <file name>` line",
                       "restore it from the release, or delete it to check the files against bundle.json only")
    if match.group(1) != sha:
        raise DsaError(str(archive), f"sha256 is {sha}, but {sidecar.name} records {match.group(1)}",
                       "the archive is corrupted or truncated; copy the release again")
    return sha, sidecar


def _read_error(archive: Path, what: str) -> DsaError:
    return DsaError(str(archive), f"is not a readable bundle archive: {what}",
                    "the archive is truncated or corrupted; copy the release again")


def _extract(archive: Path, dest: Path, listed: Dict[str, dict]) -> Dict[str, Tuple[str, int]]:
    """Extracts the plain-file members into `dest`; returns name → (sha256, size). Refuses links, directories,
    paths, duplicates, sparse members, a member bundle.json does not list or whose declared size is not the
    listed one (before a byte of it is written: the files' sizes are bounded by bundle.json, read first), and an
    archive that does not end exactly where the last member does."""
    found: Dict[str, Tuple[str, int]] = {}
    padding: List[Tuple[int, int]] = []  # (offset, length) of each member's zero padding
    end = 0
    try:
        with tarfile.open(archive, mode="r:") as tar:
            for member in tar:
                name = member.name
                if not member.isreg() or not _NAME.match(name) or name in found:
                    kind = "a duplicate of an earlier member" if name in found else (
                        "not a plain file" if not member.isreg() else "not a plain file name")
                    raise DsaError(f"{archive}: member '{name}'", f"is {kind}",
                                   "bundles hold plain files at their root only; this archive was not made "
                                   "by dsa_bundle")
                if member.issparse():
                    raise DsaError(f"{archive}: member '{name}'", "is a sparse file",
                                   "bundles hold plain files only; this archive was not made by dsa_bundle")
                if name != BUNDLE_JSON:
                    if name not in listed:
                        raise DsaError(str(archive), f"holds '{name}', which bundle.json does not list",
                                       "the archive is corrupted or was not made by dsa_bundle")
                    if member.size != listed[name]["size"]:
                        raise DsaError(f"{archive}: {name}", f"declares {member.size} bytes, bundle.json records "
                                       f"{listed[name]['size']}", "the archive is corrupted; copy the release again")
                source = tar.extractfile(member)
                digest = hashlib.sha256()
                size = 0
                with open(dest / name, "wb") as f:
                    for block in iter(lambda: source.read(1 << 20), b""):
                        digest.update(block)
                        f.write(block)
                        size += len(block)
                if size != member.size:
                    raise _read_error(archive, f"member '{name}' ends after {size} of {member.size} bytes")
                found[name] = (digest.hexdigest(), size)
                padding.append((member.offset_data + size, -(-size // BLOCK) * BLOCK - size))
                end = member.offset_data + -(-size // BLOCK) * BLOCK
    except DsaError:
        raise
    except (tarfile.TarError, EOFError, OSError, UnicodeError) as e:
        raise _read_error(archive, str(e) or type(e).__name__) from None
    if not found:
        raise _read_error(archive, "no members")
    # Everything tarfile does not check must be zeros: the padding after each member's data and the
    # end-of-archive blocks, which fill the last record. (Headers carry a checksum, data is in bundle.json.)
    expected = -(-(end + 2 * BLOCK) // RECORD) * RECORD
    actual = archive.stat().st_size
    if actual < expected:
        raise _read_error(archive, f"truncated: {actual} bytes, its last member ends at byte {end} and the "
                          f"archive at {expected}")
    padding.append((end, actual - end))
    with open(archive, "rb") as raw:
        for offset, length in padding:
            raw.seek(offset)
            if raw.read(length).strip(b"\0"):
                what = ("does not end where its last member does (corrupted, or data appended)"
                        if offset == end else f"has non-zero bytes in the padding at byte {offset}")
                raise _read_error(archive, what)
    if actual != expected:
        raise _read_error(archive, f"{actual - expected} bytes of zeros after the end of the archive")
    return found


# -- ExecuTorch bundles (format 3): the Plan B program with its provenance ---------------------------------

PROGRAM_PTE = "program.pte"
PTE_RECORD_JSON = "pte_record.json"
EXECUTORCH_KIND = "executorch"
PTE_BUILD_TYPE = "https://rules-dsa.invalid/dsa_pte/v1"


def _pte_provenance(record: dict, subjects: Dict[str, str], manifest_source: str, bundle_name: str) -> dict:
    """The in-toto/SLSA statement of an ExecuTorch bundle: the same shape as a vmfb bundle's, its
    dependencies the digests the DsaPte action recorded (manifest, views, checkpoint, model and stage code,
    environment)."""
    source = record.get("provenance") or {}

    def dep(name: str, sha256: str, role: str, **annotations) -> dict:
        return {"name": name, "digest": {"sha256": sha256}, "annotations": dict(role=role, **annotations)}

    toolchain = source.get("toolchain", {})
    deps = [dep(manifest_source, source.get("manifest", {}).get("sha256", ""), "manifest"),
            dep("checkpoint", source.get("checkpoint", {}).get("sha256", ""), "checkpoint"),
            dep("requirements_executorch_lock.txt", toolchain.get("lock_sha256", ""), "toolchain_lock",
                python_version=toolchain.get("python_version"), installed=toolchain.get("installed", []))]
    deps += [dep(f"view/{name}", sha, "manifest_view") for name, sha in sorted(source.get("views", {}).items())]
    deps += [dep(path, sha, "model_source") for path, sha in sorted(source.get("model_sources", {}).items())]
    deps += [dep(path, sha, "tool_source") for path, sha in sorted(source.get("tool_sources", {}).items())]
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": sha}} for name, sha in sorted(subjects.items())],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": PTE_BUILD_TYPE,
                "externalParameters": {"model_id": record["model_id"], "backend": record.get("backend"),
                                       "manifest": manifest_source, "bundle": bundle_name},
                "internalParameters": {"toolchain": record.get("toolchain", {}), "dims": record.get("dims", {})},
                "resolvedDependencies": deps,
            },
            "runDetails": {"builder": {"id": BUILDER_ID,
                                       "version": {"bundle_format": str(EXECUTORCH_BUNDLE_FORMAT)}}},
        },
    }


def write_pte_bundle(out: Path, *, pte: Path, record: Path, manifest: Path, runtime_view: Path,
                     manifest_source: Optional[str] = None, digest_out: Optional[Path] = None) -> str:
    """An ExecuTorch bundle (format 3, kind "executorch"): the .pte, its program record, the manifest and its
    runtime view, a provenance statement and bundle.json. The record must describe exactly this program and
    manifest (its digests were taken by the action that built the program)."""
    out = Path(out)
    data = PteRecord.read(record)
    rebuild = "rebuild the bundle from one consistent build (the program and its record come from different builds)"
    _check_same("the program's sha256", str(record), data["pte_sha256"], sha256_file(pte), rebuild)
    recorded_manifest = (data.get("provenance") or {}).get("manifest", {}).get("sha256")
    _check_same("the manifest's sha256", str(record), recorded_manifest, sha256_file(manifest), rebuild)
    payload = {PROGRAM_PTE: Path(pte), PTE_RECORD_JSON: Path(record), MANIFEST_YAML: Path(manifest),
               RUNTIME_VIEW_JSON: Path(runtime_view)}
    digests, sizes = _member_digests(payload, {})
    name = out.name[:-len(".tar")] if out.name.endswith(".tar") else out.name
    provenance = _json_bytes(_pte_provenance(data, digests, manifest_source or _source_name(Path(manifest)), name))
    generated = {PROVENANCE_JSON: provenance}
    digests[PROVENANCE_JSON], sizes[PROVENANCE_JSON] = hashlib.sha256(provenance).hexdigest(), len(provenance)
    meta = {"format": EXECUTORCH_BUNDLE_FORMAT, "kind": EXECUTORCH_KIND, "model_id": data["model_id"],
            "program": PROGRAM_PTE, "record": PTE_RECORD_JSON, "manifest": MANIFEST_YAML,
            "runtime_view": RUNTIME_VIEW_JSON, "provenance": PROVENANCE_JSON,
            "files": {n: {"sha256": digests[n], "size": sizes[n]} for n in sorted(digests)}}
    generated[BUNDLE_JSON] = _json_bytes(meta)
    sizes[BUNDLE_JSON] = len(generated[BUNDLE_JSON])
    return _write_archive(out, payload, generated, sizes, digest_out)


def _is_executorch(meta: dict) -> bool:
    return meta.get("kind") == EXECUTORCH_KIND


def extract_pte_bundle(archive: Path, dest: Path) -> dict:
    """Verifies an ExecuTorch bundle into `dest` (sidecar digest, structure, every file against bundle.json, the
    program against its record); returns bundle.json."""
    archive, dest = Path(archive), Path(dest)
    check_archive_digest(archive)
    meta = read_bundle_json(archive)
    if not _is_executorch(meta):
        raise DsaError(str(archive), f"is a {meta.get('kind') or 'single-model'} bundle of IREE modules, not an "
                       "ExecuTorch bundle", "run it with `dsa run`")
    listed = meta.get("files")
    if not isinstance(listed, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("size"), int)
            and not isinstance(e.get("size"), bool) and 0 <= e["size"] <= MAX_MEMBER_BYTES for e in listed.values()):
        raise DsaError(f"{archive}: {BUNDLE_JSON}", "is malformed: 'files' must map each file to its sha256 and size",
                       "this is not a bundle dsa_bundle made")
    if sorted(n for n in listed if not isinstance(n, str) or not _NAME.match(n) or n == BUNDLE_JSON):
        raise DsaError(f"{archive}: {BUNDLE_JSON}", "lists a name that is not a plain file name",
                       "this is not a bundle dsa_bundle made")
    for key in ("program", "record", "manifest", "runtime_view", "provenance"):
        if not isinstance(meta.get(key), str) or meta[key] not in listed:
            raise DsaError(f"{archive}: {BUNDLE_JSON}", f"'{key}' names no file of the bundle",
                           "the archive is corrupted or was not made by dsa_bundle")
    dest.mkdir(parents=True, exist_ok=True)
    found = _extract(archive, dest, listed)
    missing = sorted(set(listed) - set(found))
    if missing:
        raise DsaError(str(archive), f"does not hold {', '.join(missing)}", "the archive is corrupted; copy it again")
    for name, (sha, size) in found.items():
        if name != BUNDLE_JSON and (sha, size) != (listed[name]["sha256"], listed[name]["size"]):
            raise DsaError(f"{archive}: {name}", f"has sha256 {sha} ({size} bytes), bundle.json records "
                           f"{listed[name]['sha256']} ({listed[name]['size']} bytes)",
                           "the archive is corrupted; copy the release again")
    record = PteRecord.read(dest / meta["record"])
    if record["pte_sha256"] != found[meta["program"]][0]:
        raise DsaError(f"{archive}: {meta['program']}", "is not the program its record describes",
                       "the archive was not made by dsa_bundle")
    return meta


def read_bundle_json(archive: Path) -> dict:
    """bundle.json of `archive`, after checking that this reader reads its format."""
    archive = Path(archive)
    try:
        with tarfile.open(archive, mode="r:") as tar:
            member = next((m for m in tar if m.name == BUNDLE_JSON), None)
            if member is None or not member.isreg():
                raise DsaError(str(archive), f"has no {BUNDLE_JSON}", "this is not a rules_dsa bundle")
            if member.size > 64 << 20:
                raise DsaError(f"{archive}: {BUNDLE_JSON}", f"is {member.size} bytes",
                               "this is not a rules_dsa bundle")
            data = tar.extractfile(member).read()
    except DsaError:
        raise
    except (tarfile.TarError, EOFError, OSError, UnicodeError) as e:
        raise _read_error(archive, str(e) or type(e).__name__) from None
    try:
        meta = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise DsaError(f"{archive}: {BUNDLE_JSON}", "is nested too deeply to be a bundle's table",
                       "this is not a rules_dsa bundle") from None
    except (ValueError, UnicodeError) as e:
        raise DsaError(f"{archive}: {BUNDLE_JSON}", f"is not valid JSON: {e}",
                       "the archive is corrupted; copy the release again") from None
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt not in BUNDLE_FORMATS or isinstance(fmt, bool):
        readable = ", ".join(str(f) for f in BUNDLE_FORMATS[:-1]) + f" and {BUNDLE_FORMATS[-1]}"
        raise DsaError(f"{archive}: {BUNDLE_JSON}", f"bundle format {fmt!r} is not supported: this reader "
                       f"reads formats {readable}",
                       "a newer rules_dsa wrote it: read it with that release; docs/bundle-format.md lists "
                       "the formats" if isinstance(fmt, int) and fmt > max(BUNDLE_FORMATS)
                       else "this is not a rules_dsa bundle")
    if (fmt == MULTI_TARGET_BUNDLE_FORMAT) != _is_multi_target(meta):
        raise DsaError(f"{archive}: {BUNDLE_JSON}", f"is format {fmt} with kind {meta.get('kind')!r}: format "
                       f"{MULTI_TARGET_BUNDLE_FORMAT} is exactly the multi-target bundles",
                       "the archive is corrupted or was not made by dsa_bundle")
    if (fmt == EXECUTORCH_BUNDLE_FORMAT) != _is_executorch(meta):
        raise DsaError(f"{archive}: {BUNDLE_JSON}", f"is format {fmt} with kind {meta.get('kind')!r}: format "
                       f"{EXECUTORCH_BUNDLE_FORMAT} is exactly the ExecuTorch bundles",
                       "the archive is corrupted or was not made by dsa_bundle")
    return meta


def extract_bundle(archive: Path, dest: Path) -> OpenedBundle:
    """Verifies `archive` (sidecar digest, structure, format, every file against bundle.json) into `dest`."""
    archive = Path(archive)
    dest = Path(dest)
    sha, sidecar = check_archive_digest(archive)
    # The format first: every format keeps bundle.json at the root; the rest of the layout is the format's.
    meta = read_bundle_json(archive)
    if _is_executorch(meta):
        raise DsaError(str(archive), "is an ExecuTorch bundle (format 3): it holds an ExecuTorch program, no IREE "
                       "module", "check it with `dsa bundle verify`; run it with `dsa pte run` in the ExecuTorch "
                       "environment (docs/frontends.md)")
    listed = meta.get("files")
    if not isinstance(listed, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("size"), int)
            and not isinstance(e.get("size"), bool) and 0 <= e["size"] <= MAX_MEMBER_BYTES
            for e in listed.values()) or not _has_index(meta):
        raise DsaError(f"{archive}: {BUNDLE_JSON}", "is malformed: 'files' must map each file to its sha256 "
                       f"and size (at most {MAX_MEMBER_BYTES} bytes), 'index' must be the module index "
                       "('targets' the targets' tables, each with its index, in a multi-target bundle)",
                       "this is not a bundle dsa_bundle made")
    bad_names = sorted(n for n in listed if not isinstance(n, str) or not _NAME.match(n) or n == BUNDLE_JSON)
    if bad_names:
        raise DsaError(f"{archive}: {BUNDLE_JSON}", f"lists '{bad_names[0]}', which is not a plain file name",
                       "bundles hold plain files at their root only; this is not a bundle dsa_bundle made")
    dest.mkdir(parents=True, exist_ok=True)
    found = _extract(archive, dest, listed)
    present = set(found) - {BUNDLE_JSON}
    missing = sorted(set(listed) - present)
    extra = sorted(present - set(listed))
    if missing or extra:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unlisted {', '.join(extra)}"] if extra else [])
        raise DsaError(str(archive), f"does not hold the files bundle.json lists: {'; '.join(parts)}",
                       "the archive is corrupted; copy the release again")
    for name in sorted(listed):
        sha_f, size = found[name]
        want = listed[name]
        if size != want.get("size") or sha_f != want.get("sha256"):
            raise DsaError(f"{archive}: {name}", f"has sha256 {sha_f} ({size} bytes), bundle.json records "
                           f"{want.get('sha256')} ({want.get('size')} bytes)",
                           "the archive is corrupted; copy the release again")
    if _is_pipeline(meta):
        stages = meta.get("stages")
        if not isinstance(stages, list) or not stages or not all(isinstance(s, dict) for s in stages):
            raise DsaError(f"{archive}: {BUNDLE_JSON}", "is malformed: a pipeline bundle lists its 'stages'",
                           "the archive is corrupted or was not made by dsa_bundle")
        checks = [(meta, ("build_report", "provenance", "link", "pipeline_file"))]
        indexes = [(meta, "pipeline_file", "pipeline")]
    elif _is_multi_target(meta):
        checks = [(meta, ("build_report", "provenance", "manifest", "parameter_archive", "runtime_view"))]
        checks += [(table, ("target_spec",)) for table in _stage_tables(meta)]
        indexes = []
    else:
        checks = [(meta, ("build_report", "provenance") + (("policy_pipeline",) if "policy_pipeline" in meta else ()))]
        indexes = []
    checks += [(table, ("manifest", "lock", "index_file")) for table in _stage_tables(meta)]
    indexes += [(table, "index_file", "index") for table in _stage_tables(meta)]
    for table, keys in checks:
        for key in keys:
            if not isinstance(table.get(key), str) or table[key] not in listed:
                raise DsaError(f"{archive}: {BUNDLE_JSON}", f"'{key}' names no file of the bundle",
                               "the archive is corrupted or was not made by dsa_bundle")
    for table, file_key, key in indexes:
        try:
            index = read_json(dest / table[file_key])
        except (ValueError, UnicodeError):
            index = None
        if index != table.get(key):
            raise DsaError(f"{archive}: {table[file_key]}", f"differs from the {key} in bundle.json",
                           "the archive was not made by dsa_bundle")
    if _is_pipeline(meta):
        pipeline = meta["pipeline"]
        named = [("link", pipeline.get("link"))] + [
            (f"stages[{i}].index", s.get("index") if isinstance(s, dict) else None)
            for i, s in enumerate(pipeline.get("stages") if isinstance(pipeline.get("stages"), list) else [None])]
        for field, value in named:
            if not isinstance(value, str) or value not in listed:
                raise DsaError(f"{archive}: {meta['pipeline_file']}", f"'{field}' is {value!r}, which is not a file "
                               "of the bundle", "this archive was not made by dsa_bundle")
    multi = _is_multi_target(meta)
    for table in _stage_tables(meta):
        _check_index_paths(archive, table["index_file"], table["index"], listed)
        if multi:
            _check_target_table(archive, table, meta)
        _check_against_lock(archive, dest, table, found,
                            prefix=f"{table['name']}." if _is_pipeline(meta) or multi else "",
                            shared=SHARED_MEMBERS if multi else ())
    return OpenedBundle(archive=archive, root=dest, sha256=sha, sidecar=sidecar, meta=meta)


def _has_index(meta: dict) -> bool:
    if _is_multi_target(meta):
        targets = meta.get("targets")
        return (isinstance(targets, list) and bool(targets) and all(
            isinstance(t, dict) and isinstance(t.get("target"), str) and _NAME.match(t["target"])
            and isinstance(t.get("index"), dict) for t in targets)
            and len({t["target"] for t in targets}) == len(targets))
    return isinstance(meta.get("pipeline" if _is_pipeline(meta) else "index"), dict)


def _check_target_table(archive: Path, table: dict, meta: dict) -> None:
    """A multi-target bundle's target: its index is for that target, names that target's own spec and the
    bundle's one parameter archive and runtime view."""
    index, target = table["index"], table["target"]
    expected = {"target": target, "target_spec": table["target_spec"],
                "parameter_archive": meta["parameter_archive"], "runtime_view": meta["runtime_view"]}
    for key, value in expected.items():
        if index.get(key) != value:
            raise DsaError(f"{archive}: {table['index_file']}", f"'{key}' is {index.get(key)!r}, but the "
                           f"bundle's table of target {target} says {value!r}",
                           "the archive was not made by dsa_bundle")
    for m in index.get("modules", []):
        for key in ("vmfb", "record"):
            if not str(m.get(key, "")).startswith(target + "."):
                raise DsaError(f"{archive}: {table['index_file']}", f"module file {m.get(key)!r} is not one of "
                               f"target {target}'s files ({target}.*)", "the archive was not made by dsa_bundle")


def _index_paths(index: dict) -> List[Tuple[str, object]]:
    """(field, value) of every file a module index names."""
    paths = [(key, index.get(key)) for key in ("target_spec", "parameter_archive", "runtime_view")]
    modules = index.get("modules")
    for i, module in enumerate(modules if isinstance(modules, list) else [None]):
        for key in ("vmfb", "record"):
            paths.append((f"modules[{i}].{key}", module.get(key) if isinstance(module, dict) else None))
    return paths


def _check_index_paths(archive: Path, index_file: str, index: dict, listed: Dict[str, dict]) -> None:
    """Every file the bundle's module index names is one of the bundle's own verified files: not an absolute
    path, not `../`, nothing outside the archive (the runtime would load native code from there)."""
    for field, value in _index_paths(index):
        if not isinstance(value, str) or value not in listed:
            raise DsaError(f"{archive}: {index_file}", f"'{field}' is {value!r}, which is not a file of the bundle",
                           "a bundle's module index names only the bundle's own files; this archive was not "
                           "made by dsa_bundle")


def _check_against_lock(archive: Path, dest: Path, table: dict, found: Dict[str, Tuple[str, int]], *,
                        prefix: str, shared: Sequence[str] = ()) -> None:
    """The bundle's files are the ones its recipe lock pins: each artifact the lock lists is in the bundle with
    the lock's sha256, and so is the manifest (bundle.json alone could be rewritten to match swapped files)."""
    try:
        lock = Lock.read(dest / table["lock"])
    except DsaError as e:
        raise DsaError(f"{archive}: {table['lock']}", f"is not a readable recipe lock ({e})",
                       "the archive is corrupted or was not made by dsa_bundle") from None
    artifacts = lock.get("artifacts")
    manifest = lock.get("manifest")
    if not isinstance(artifacts, dict) or not isinstance(manifest, dict):
        raise DsaError(f"{archive}: {table['lock']}", "is malformed: it has no artifact or manifest digests",
                       "the archive is corrupted or was not made by dsa_bundle")
    pinned = {(name if name in shared else prefix + name): sha for name, sha in artifacts.items()}
    pinned[table["manifest"]] = manifest.get("sha256")
    if table.get("target") is not None and lock.get("target") != table["target"]:
        raise DsaError(f"{archive}: {table['lock']}", f"is the lock of target {lock.get('target')!r}, the bundle "
                       f"lists it for {table['target']!r}", "the archive was not made by dsa_bundle")
    if table.get("target_spec") in found:
        spec = lock.get("target_spec")
        if not isinstance(spec, dict) or found[table["target_spec"]][0] != spec.get("sha256"):
            raise DsaError(f"{archive}: {table['target_spec']}", "is not the target spec the recipe lock pins",
                           "the bundle's files are not the ones its lock was built with: it was altered; copy "
                           "the release again")
    for name, sha in sorted(pinned.items()):
        got = found.get(name, (None, 0))[0]
        if got != sha:
            held = f"has sha256 {got}" if got else "is not in the bundle"
            raise DsaError(f"{archive}: {name}", f"{held}, the recipe lock pins {sha}",
                           "the bundle's files are not the ones its lock was built with: it was altered; copy "
                           "the release again")
    _check_views_against_lock(archive, dest, table, found, lock, prefix)


def _member_json(archive: Path, dest: Path, name: str):
    """An extracted member read as JSON, or a refusal naming it."""
    try:
        return read_json(dest / name)
    except (ValueError, UnicodeError, RecursionError):
        raise DsaError(f"{archive}: {name}", "is not JSON", "copy the release again") from None


def _check_views_against_lock(archive: Path, dest: Path, table: dict, found: Dict[str, Tuple[str, int]],
                              lock: dict, prefix: str) -> None:
    """What the lock pins through the manifest: the runtime view (its digest is in the lock's `views`), and,
    from the view, a pipeline bundle's processor files and policy config (the manifest's `processors` and
    `model.policy_config` pins) and policy_pipeline.json's loop (n_action_steps, flow steps). bundle.json
    alone could be rewritten to cover a swapped n_action_steps or swapped statistics; the lock cannot be,
    short of forging the manifest's digest."""
    views = lock.get("views") if isinstance(lock.get("views"), dict) else {}
    name = next((n for n in (prefix + RUNTIME_VIEW_JSON, RUNTIME_VIEW_JSON) if n in found), None)
    if name is None or not isinstance(views.get("runtime"), str):
        return
    if found[name][0] != views["runtime"]:
        raise DsaError(f"{archive}: {name}", f"has sha256 {found[name][0]}, the recipe lock pins "
                       f"{views['runtime']}", "the bundle's files are not the ones its lock was built with: it "
                       "was altered; copy the release again")
    view = _member_json(archive, dest, name)
    procs = view.get("processors") if isinstance(view, dict) else None
    if not isinstance(procs, dict) or POLICY_PIPELINE_JSON not in found:
        return
    pins = [procs.get("preprocessor"), procs.get("postprocessor"), procs.get("tokenizer"),
            *(procs.get("files") if isinstance(procs.get("files"), list) else [])]
    pins = [(Path(str(p.get("path"))).name, p.get("sha256")) for p in pins if isinstance(p, dict)]
    config = view.get("policy_config")
    if isinstance(config, dict):
        pins.append((POLICY_PIPELINE_CONFIG_JSON, config.get("sha256")))
    for member, sha in pins:
        got = found.get(member, (None, 0))[0]
        if got is not None and got != sha:
            raise DsaError(f"{archive}: {member}", f"has sha256 {got}, the manifest the recipe lock pins says "
                           f"{sha}", "the bundle's processor files are not the ones it was built with: it was "
                           "altered; copy the release again")
    spec = _member_json(archive, dest, POLICY_PIPELINE_JSON)
    loop = spec.get("loop") if isinstance(spec, dict) and isinstance(spec.get("loop"), dict) else {}
    steps = loop.get("steps") if isinstance(loop.get("steps"), dict) else None
    for field, ours, pinned in (("loop.n_action_steps", loop.get("n_action_steps"), view.get("n_action_steps")),
                                ("loop.steps.value", steps.get("value") if steps else None, view.get("flow_steps")
                                 if steps else None)):
        if ours != pinned:
            raise DsaError(f"{archive}: {POLICY_PIPELINE_JSON}", f"{field} is {str(ours)[:40]}, the manifest the "
                           f"recipe lock pins says {pinned}", "the bundle was altered; copy the release again")


@contextlib.contextmanager
def open_bundle(archive: Path) -> Iterator[OpenedBundle]:
    """Verifies and extracts `archive` into a temporary directory, removed on exit."""
    with tempfile.TemporaryDirectory(prefix="dsa-bundle-") as tmp:
        yield extract_bundle(Path(archive), Path(tmp))


def release(archive: Path, dest: Path, *, public_key: Optional[Path] = None) -> Tuple[Path, Path]:
    """Verifies `archive`, then copies it and its NAME.sha256 into directory `dest` (created if missing). With
    `public_key`, the archive must carry a valid signature by it (NAME.dsse.json), which is copied too."""
    archive = Path(archive)
    if public_key is not None:
        from dsa.runtime.signing import verify_signature

        verify_signature(archive, public_key)
    with open_bundle(archive) as b:
        sha = b.sha256
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise DsaError(str(dest), "exists and is not a directory", "pass a directory to release into")
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / archive.name
    with atomic_output(out) as tmp:
        shutil.copyfile(archive, tmp)
        os.chmod(tmp, 0o644)  # Bazel's outputs are read-only
    if sha256_file(out) != sha:
        raise DsaError(str(out), "differs from the verified archive after copying", "check the disk")
    digest = sidecar_path(out)
    with atomic_output(digest) as tmp:
        tmp.write_text(digest_line(sha, out.name), encoding="utf-8")
    if public_key is not None:
        from dsa.runtime.signing import signature_path

        with atomic_output(signature_path(out)) as tmp:
            shutil.copyfile(signature_path(archive), tmp)
    return out, digest


# ---------------------------------------------------------------------------------------------------------
# Command line


def user_path(value: str) -> Path:
    """A path from the command line: as given when it exists, else relative to the directory `bazel run` was
    started in (BUILD_WORKING_DIRECTORY; `bazel run` itself runs in the runfiles tree)."""
    path = Path(value)
    base = os.environ.get("BUILD_WORKING_DIRECTORY")
    if path.is_absolute() or path.exists() or not base:
        return path
    return Path(base) / path


def _source_name(path: Path) -> str:
    """A manifest's name for the provenance: as given when relative, else relative to the working directory
    when under it, else its file name (never an absolute path: it would differ between checkouts)."""
    if not path.is_absolute():
        return path.as_posix()
    try:
        return path.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return path.name


def _module_arg(value: str) -> ModuleInput:
    name, sep, paths = value.partition("=")
    parts = paths.split(",")
    if not sep or len(parts) != 3:
        raise DsaError("--module", f"'{value}' is not NAME=VMFB,EXPORT_RECORD,COMPILE_REPORT")
    return ModuleInput(name, *map(Path, parts))


def _format_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa bundle", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("create", help="write a bundle archive and its .sha256")
    c.add_argument("--index", action="append", default=[],
                   help="take the files from this module index (dsa compile's TARGET.modules.json, dsa_vmfb's "
                   "NAME.modules.json); the flags below override. Repeat it, once per target in preference "
                   "order, for a multi-target bundle of one model (its lock beside each index)")
    c.add_argument("--lock", help="the recipe lock (NAME.lock.json) from dsa_vmfb or dsa compile")
    c.add_argument("--manifest", help="the manifest (required unless --pipeline)")
    c.add_argument("--manifest-source", help="the manifest's repository-relative name, for the provenance "
                   "(default: --manifest as given)")
    c.add_argument("--runtime-view")
    c.add_argument("--target-spec")
    c.add_argument("--params", help="the parameter archive (.irpa)")
    c.add_argument("--module", action="append", default=[], type=_module_arg,
                   help="NAME=VMFB,EXPORT_RECORD,COMPILE_REPORT (repeat per module)")
    c.add_argument("--pipeline", help="bundle a linked pipeline: its index (dsa_pipeline's NAME.pipeline.json); "
                   "each stage's files come from its module index, its manifest from --stage-manifest")
    c.add_argument("--stage-manifest", action="append", default=[],
                   help="with --pipeline: STAGE=MANIFEST[,REPOSITORY_RELATIVE_NAME] (repeat per stage)")
    c.add_argument("--pte", help="bundle an ExecuTorch program (dsa_pte's NAME.pte; its NAME.pte_record.json "
                   "beside it), with --manifest and --runtime-view: an ExecuTorch bundle (format 3)")
    c.add_argument("--processor", action="append", default=[],
                   help="a LeRobot processor file the manifest's `processors` pins (policy_preprocessor.json, "
                   "policy_postprocessor.json, their statistics, tokenizer.json; repeat per file): the bundle "
                   "ships the policy's whole pipeline (docs/policy-pipeline.md); needs --policy-config")
    c.add_argument("--policy-config", help="with --processor: the policy's config.json (model.policy_config)")
    c.add_argument("--out", required=True, help="the archive to write (NAME.tar)")
    c.add_argument("--digest", help="where to write `<sha256>  NAME.tar` (default NAME.sha256 beside it)")
    for command, text in (("verify", "check a bundle as `dsa run` would and summarise it"),
                          ("list", "list a verified bundle's files")):
        p = sub.add_parser(command, help=text)
        p.add_argument("bundle")
    r = sub.add_parser("release", help="verify a bundle, then copy it and its .sha256 into DEST")
    r.add_argument("bundle")
    r.add_argument("dest", help="directory (created if missing); relative to where `bazel run` was started")
    r.add_argument("--key", help="the signer's public key (KEY.pub.pem): release only a bundle it signed, and "
                   "ship the signature beside it")
    a = parser.parse_args(argv)

    if a.command == "create" and a.pte:
        if not (a.manifest and a.runtime_view):
            raise DsaError("dsa-bundle create", "--pte needs --manifest and --runtime-view")
        pte = Path(a.pte)
        record = pte.with_name(pte.name[:-len(".pte")] + ".pte_record.json") if pte.name.endswith(".pte") else None
        if record is None or not pte.is_file() or not record.is_file():
            raise DsaError("--pte", f"{pte} is not a .pte with its .pte_record.json beside it", "build the dsa_pte first")
        sha = write_pte_bundle(Path(a.out), pte=pte, record=record, manifest=Path(a.manifest),
                               runtime_view=Path(a.runtime_view), manifest_source=a.manifest_source,
                               digest_out=Path(a.digest) if a.digest else None)
        if not a.digest:
            print(f"dsa-bundle: wrote {a.out} (sha256 {sha}) and {sidecar_path(Path(a.out))}")
        return
    if a.command == "create" and a.pipeline:
        manifests = {}
        for value in a.stage_manifest:
            stage, sep, rest = value.partition("=")
            path, _, source = rest.partition(",")
            if not sep or not path:
                raise DsaError("--stage-manifest", f"'{value}' is not STAGE=MANIFEST[,NAME]")
            manifests[stage] = (Path(path), source or _source_name(Path(path)))
        sha = write_bundle(Path(a.out), digest_out=Path(a.digest) if a.digest else None,
                                     **pipeline_inputs(Path(a.pipeline), manifests))
        return
    if a.command == "create" and len(a.index) > 1:
        if not a.manifest:
            raise DsaError("dsa-bundle create", "--manifest is required without --pipeline")
        given = [f"--{k.replace('_', '-')}" for k in ("lock", "runtime_view", "target_spec", "params", "module")
                 if getattr(a, k)]
        if given:
            raise DsaError("dsa-bundle create", f"{', '.join(given)} cannot be combined with several --index",
                           "a multi-target bundle takes every target's files from its module index")
        source = a.manifest_source or _source_name(Path(a.manifest))
        for index in a.index:
            if not Path(index).is_file():
                raise DsaError(index, "no such module index", "build the dsa_vmfb (or run dsa compile) first")
        stages = [StageInput(name="", manifest=Path(a.manifest), manifest_source=source,
                             **inputs_from_index(Path(index))) for index in a.index]
        sha = write_multi_target_bundle(Path(a.out), stages, digest_out=Path(a.digest) if a.digest else None)
        if not a.digest:  # by hand, not in a build action: say what was written
            print(f"dsa-bundle: wrote {a.out} (sha256 {sha}) and {sidecar_path(Path(a.out))}")
        return
    if a.command == "create":
        if not a.manifest:
            raise DsaError("dsa-bundle create", "--manifest is required without --pipeline")
        a.index = a.index[0] if a.index else None
        files = inputs_from_index(Path(a.index), lock=a.lock, target_spec=a.target_spec) if a.index else {}
        for key in ("lock", "runtime_view", "target_spec", "params"):
            if getattr(a, key):
                files[key] = Path(getattr(a, key))
            if key not in files:
                raise DsaError("dsa-bundle create", f"--{key.replace('_', '-')} is required without --index")
        if a.module:
            files["modules"] = a.module
        if not files.get("modules"):
            raise DsaError("dsa-bundle create", "no modules", "pass --index or --module")
        sha = create_bundle(Path(a.out), manifest=Path(a.manifest),
                            manifest_source=a.manifest_source or _source_name(Path(a.manifest)),
                            digest_out=Path(a.digest) if a.digest else None,
                            processors=[Path(p) for p in a.processor] if a.processor else None,
                            policy_config=Path(a.policy_config) if a.policy_config else None, **files)
        if a.index:  # by hand, not in a build action: say what was written
            print(f"dsa-bundle: wrote {a.out} (sha256 {sha}) and {a.digest or sidecar_path(Path(a.out))}")
        return
    if a.command == "release":
        # DEST is always relative to where `bazel run` was started (the runfiles tree is no place for it).
        dest = Path(os.environ.get("BUILD_WORKING_DIRECTORY", ".")) / a.dest
        archive, digest = release(user_path(a.bundle), dest, public_key=user_path(a.key) if a.key else None)
        print(f"released {archive} and {digest.name}: sha256 {digest.read_text(encoding='utf-8').split()[0]}")
        return
    if a.command in ("verify", "list") and _is_executorch(read_bundle_json(user_path(a.bundle))):
        with tempfile.TemporaryDirectory(prefix="dsa-bundle-") as tmp:
            meta = extract_pte_bundle(user_path(a.bundle), Path(tmp))
            record = PteRecord.read(Path(tmp) / meta["record"])
        print(f"{a.bundle}: ExecuTorch bundle (format {meta['format']}) of {meta['model_id']}: "
              f"{record.get('backend')}, {record.get('delegates')} delegated subgraphs, "
              f"{_format_size(meta['files'][meta['program']]['size'])} program; every file matches bundle.json")
        if a.command == "list":
            for name, entry in sorted(meta["files"].items()):
                print(f"  {entry['sha256']}  {entry['size']:>12d}  {name}")
        return
    with open_bundle(user_path(a.bundle)) as b:
        print(b.describe())
        if a.command == "list":
            for name, entry in sorted(b.meta["files"].items()):
                print(f"  {entry['sha256']}  {entry['size']:>12d}  {name}")
        else:
            for stage, report in zip(b.stages, b.stage_reports):
                prefix = f"{stage.name}." if stage.name else ""
                for m in report["modules"]:
                    bucket = f"{m['bucket']['dim']}={m['bucket']['size']}" if m.get("bucket") else "dynamic"
                    print(f"  {prefix}{m['name']}: {bucket}, {m['export']['op_count']} exported ops, "
                          f"{m['compile']['dispatch_count']} dispatches, {_format_size(m['sizes']['vmfb_bytes'])}")
            if b.is_multi_target:
                for target, why in b.why_not_here().items():
                    print(f"  target {target} ({b.target_spec(target).get('runtime_driver', 'local-task')}): "
                          + ("runs on this machine" if why is None else f"not here: {why}"))
            params = sum(report["parameters"]["bytes"] for report in
                         (b.stage_reports[:1] if b.is_multi_target else b.stage_reports))
            label = (f"{PARAMS_IRPA} (all stages)" if b.is_pipeline else
                     f"{PARAMS_IRPA} (shared by all targets)" if b.is_multi_target else PARAMS_IRPA)
            print(f"  {label}: {_format_size(params)}; archive {_format_size(b.archive.stat().st_size)}")

if __name__ == "__main__":
    run_cli(main, "dsa bundle")
