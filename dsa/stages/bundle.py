"""DsaBundle: one compiled policy for one target (or a linked pipeline, or one model for several targets, or an
ExecuTorch program) as a single, deterministic, verifiable release archive: the bundle writer, the build action
of `dsa_bundle` (rules/private/bundle.bzl) and `dsa bundle create` (dsa/tools/bundle_cli.py).

    python -m dsa.stages.bundle create --lock L --manifest M --runtime-view R --target-spec T --params P \\
        --module NAME=VMFB,EXPORT_RECORD,COMPILE_REPORT ... --out NAME.tar [--digest NAME.sha256]

The archive's layout, format 1, is specified in docs/bundle-format.md: the vmfbs with their export records and
compile reports, the parameter archive, the manifest and its runtime view, the target spec, the recipe lock
(`lock.json`), a build report, an in-toto/SLSA provenance statement (both dsa.stages.provenance) and
`bundle.json` (format, identity, the digest and size of every other file, and the module index relative to the
bundle root). The tar itself is written by dsa.core.tarfiles: same inputs, same bytes.

A pipeline bundle (`dsa_bundle(pipeline = ...)`, "Pipeline bundles" in docs/bundle-format.md) holds several
linked models: each stage's files as above, named `<stage>.<file>`, the link (`link.json`) and the pipeline
index (`pipeline.json`); bundle.json says `"kind": "pipeline"` and lists the stages. One writer serves both
(`write_bundle`: a single-model bundle is one unlinked stage, its files at the root); the reader is
dsa.runtime.bundle.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dsa.core.bundle_layout import (BUILD_REPORT_JSON, BUNDLE_JSON, EXECUTORCH_KIND, INDEX_JSON, LINK_JSON, LOCK_JSON,
                                    MANIFEST_YAML, PARAMS_IRPA, PIPELINE_JSON, PLAIN_NAME, POLICY_PIPELINE_JSON,
                                    PROGRAM_PTE, PROVENANCE_JSON, PTE_RECORD_JSON, RUNTIME_VIEW_JSON, SHARED_MEMBERS,
                                    TARGET_SPEC_JSON)
from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import canonical_json, read_json, sha256_file
from dsa.core.formats import (BUILD_REPORT_FORMAT, BUNDLE_FORMAT, EXECUTORCH_BUNDLE_FORMAT, MULTI_TARGET_BUNDLE_FORMAT,
                              PIPELINE_INDEX_FORMAT, BuildReport, BundleMeta, CompileReport, ExportRecord, Link, Lock,
                              ModuleIndex, MultiTargetBundleMeta, PipelineIndex, PteRecord)
from dsa.core.runtime_flags import index_runtime_flags
from dsa.core.tarfiles import member_digests, sidecar_path, write_archive
from dsa.stages.provenance import (build_report, multi_target_provenance, pipeline_provenance, provenance_statement,
                                   pte_provenance)


@dataclasses.dataclass
class ModuleInput:
    """One compiled module to bundle: its vmfb with the export record and compile report it came with."""

    name: str  # e.g. prompt_len_0; the bundle stores NAME.vmfb, NAME.export_record.json, NAME.compile_report.json
    vmfb: Path
    export_record: Path
    compile_report: Path


def _json_bytes(obj) -> bytes:
    return canonical_json(obj).encode("utf-8")


def _check_same(what: str, where: str, expected: Optional[str], actual: str, hint: str) -> None:
    if expected is not None and expected != actual:
        raise DsaError(where, f"{what} is {actual}, but the lock records {expected}", hint)


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
        if not PLAIN_NAME.match(m.name) or m.name in records:
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


def _prefixed_index(index: dict, prefix: str, shared: Sequence[str] = ()) -> dict:
    """A model's module index with its files named `<prefix><file>`, except the `shared` ones (at the root)."""
    out = dict(index)
    for key in ("parameter_archive", "runtime_view", "target_spec"):
        if index[key] not in shared:
            out[key] = prefix + index[key]
    out["modules"] = [{"vmfb": prefix + m["vmfb"], "record": prefix + m["record"]} for m in index["modules"]]
    return out


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
        if linked and not PLAIN_NAME.match(stage.name):
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
    reports = [build_report(c.lock, c.records, c.reports, c.sizes, c.digests) for _, c, _ in collected]
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
            stage, c, _ = collected[0]
            reports[0]["policy_pipeline"] = _add_policy_pipeline(
                stage, c.records, {name: c.digests[f"{name}.vmfb"] for name in c.records}, processors,
                policy_config, payload, generated)
        generated[BUILD_REPORT_JSON] = BuildReport.dumps(reports[0])

    digests, sizes = member_digests(payload, generated)
    if linked:
        statement = pipeline_provenance(collected, digests, bundle_name, targets[0])
    else:
        statement = provenance_statement(collected[0][1].lock, digests, collected[0][0].source, bundle_name)
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
    return write_archive(out, payload, generated, sizes, digest_out)


def _add_policy_pipeline(stage: StageInput, records: Dict[str, dict], module_digests: Dict[str, str],
                         processors: Sequence[Path], policy_config: Optional[Path],
                         payload: Dict[str, Path], generated: Dict[str, bytes]) -> List[dict]:
    """Adds the policy's processor files, config.json and policy_pipeline.json to a single-model bundle (or a
    multi-target one: `records` and `module_digests` then name every target's modules, `<target>.<module>`);
    returns the pipeline's nodes for the build report (name, implementation, the digests of what each reads)."""
    from dsa.runtime.policy_pipeline import describe, pinned_files

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
    spec = describe(manifest, stage.source or str(stage.manifest), members, records, module_digests)
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


def write_multi_target_bundle(out: Path, targets: Sequence[StageInput], *,
                              digest_out: Optional[Path] = None, most_capable_first: bool = False,
                              processors: Optional[Sequence[Path]] = None,
                              policy_config: Optional[Path] = None) -> str:
    """One model's modules for several targets in one archive (format 2, docs/bundle-format.md "Multi-target
    bundles"): one parameter archive, manifest and runtime view at the root, each target's lock, target spec,
    module index and modules under `<target>.` names. `targets` are in preference order: `dsa run` runs the
    first one this machine can execute. `most_capable_first` orders them by the CPU features their specs
    need, most first (a policy's levels: the runner then takes the most capable one the machine executes),
    keeping the given order among equals. With `processors` (and `policy_config`) the bundle ships the policy's
    whole pipeline, as a single-model bundle does: its network node names every target's modules. Refused unless every target's files come from one build of one model
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
    if most_capable_first:
        collected.sort(key=lambda tc: -len(read_json(tc[1].payload[TARGET_SPEC_JSON]).get("host", {})
                                            .get("cpu_features", [])))
    names = [c.lock["target"] for _, c in collected]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DsaError("dsa-bundle", f"target {', '.join(twice)} is given more than once (targets {names})",
                       "give each target's modules once; a build with --//:target compiles every dsa_vmfb for that "
                       "one target: build a multi-target bundle without it")
    for n in names:
        if not PLAIN_NAME.match(n):
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
    reports = [build_report(c.lock, c.records, c.reports, c.sizes, c.digests) for _, c in collected]
    report = {"format": BUILD_REPORT_FORMAT, "model_id": first.lock["model_id"], "targets": reports,
              "parameters": reports[0]["parameters"]}
    if processors is not None:
        prefixed = [(c.lock["target"] + "." + name, c, name) for _, c in collected for name in c.records]
        report["policy_pipeline"] = _add_policy_pipeline(
            first_t, {p: c.records[name] for p, c, name in prefixed},
            {p: c.digests[f"{name}.vmfb"] for p, c, name in prefixed}, processors, policy_config, payload, generated)
    generated[BUILD_REPORT_JSON] = BuildReport.dumps(report)

    digests, sizes = member_digests(payload, generated)

    statement = multi_target_provenance([c.lock for _, c in collected], digests, first_t.source, bundle_name)
    provenance = _json_bytes(statement)
    generated[PROVENANCE_JSON] = provenance
    digests[PROVENANCE_JSON], sizes[PROVENANCE_JSON] = hashlib.sha256(provenance).hexdigest(), len(provenance)

    meta = {"format": MULTI_TARGET_BUNDLE_FORMAT, "kind": "multi-target", "model_id": first.lock["model_id"],
            "manifest": MANIFEST_YAML, "manifest_source": first_t.source, "parameter_archive": PARAMS_IRPA,
            "runtime_view": RUNTIME_VIEW_JSON, "build_report": BUILD_REPORT_JSON, "provenance": PROVENANCE_JSON,
            "targets": tables}
    if processors is not None:
        meta["policy_pipeline"] = POLICY_PIPELINE_JSON
    meta["files"] = {name: {"sha256": digests[name], "size": sizes[name]} for name in sorted(digests)}
    generated[BUNDLE_JSON] = MultiTargetBundleMeta.dumps(meta)
    return write_archive(out, payload, generated, sizes, digest_out)


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
    data = ModuleIndex.read(index).to_json()
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
    digests, sizes = member_digests(payload, {})
    name = out.name[:-len(".tar")] if out.name.endswith(".tar") else out.name
    provenance = _json_bytes(pte_provenance(data, digests, manifest_source or source_name(Path(manifest)), name))
    generated = {PROVENANCE_JSON: provenance}
    digests[PROVENANCE_JSON], sizes[PROVENANCE_JSON] = hashlib.sha256(provenance).hexdigest(), len(provenance)
    meta = {"format": EXECUTORCH_BUNDLE_FORMAT, "kind": EXECUTORCH_KIND, "model_id": data["model_id"],
            "program": PROGRAM_PTE, "record": PTE_RECORD_JSON, "manifest": MANIFEST_YAML,
            "runtime_view": RUNTIME_VIEW_JSON, "provenance": PROVENANCE_JSON,
            "files": {n: {"sha256": digests[n], "size": sizes[n]} for n in sorted(digests)}}
    generated[BUNDLE_JSON] = _json_bytes(meta)
    sizes[BUNDLE_JSON] = len(generated[BUNDLE_JSON])
    return write_archive(out, payload, generated, sizes, digest_out)


def source_name(path: Path) -> str:
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


def add_create_arguments(c: argparse.ArgumentParser) -> None:
    """`create`'s flags (here, and in `dsa bundle create`)."""
    c.add_argument("--index", action="append", default=[],
                   help="take the files from this module index (dsa compile's TARGET.modules.json, dsa_vmfb's "
                   "NAME.modules.json); the flags below override. Repeat it, once per target in preference "
                   "order, for a multi-target bundle of one model (its lock beside each index)")
    c.add_argument("--most-capable-first", action="store_true",
                   help="with several --index: order the targets by the CPU features they need, most first (a "
                   "policy's levels), instead of as given")
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


def create(a: argparse.Namespace) -> None:
    """Writes the bundle `create`'s flags describe."""
    if a.pte:
        if not (a.manifest and a.runtime_view):
            raise DsaError("dsa-bundle create", "--pte needs --manifest and --runtime-view")
        pte = Path(a.pte)
        record = pte.with_name(pte.name[:-len(".pte")] + ".pte_record.json") if pte.name.endswith(".pte") else None
        if record is None or not pte.is_file() or not record.is_file():
            raise DsaError("--pte", f"{pte} is not a .pte with its .pte_record.json beside it",
                           "build the dsa_pte first")
        sha = write_pte_bundle(Path(a.out), pte=pte, record=record, manifest=Path(a.manifest),
                               runtime_view=Path(a.runtime_view), manifest_source=a.manifest_source,
                               digest_out=Path(a.digest) if a.digest else None)
        if not a.digest:
            print(f"dsa-bundle: wrote {a.out} (sha256 {sha}) and {sidecar_path(Path(a.out))}")
        return
    if a.pipeline:
        manifests = {}
        for value in a.stage_manifest:
            stage, sep, rest = value.partition("=")
            path, _, source = rest.partition(",")
            if not sep or not path:
                raise DsaError("--stage-manifest", f"'{value}' is not STAGE=MANIFEST[,NAME]")
            manifests[stage] = (Path(path), source or source_name(Path(path)))
        sha = write_bundle(Path(a.out), digest_out=Path(a.digest) if a.digest else None,
                                     **pipeline_inputs(Path(a.pipeline), manifests))
        return
    if len(a.index) > 1:
        if not a.manifest:
            raise DsaError("dsa-bundle create", "--manifest is required without --pipeline")
        given = [f"--{k.replace('_', '-')}" for k in ("lock", "runtime_view", "target_spec", "params", "module")
                 if getattr(a, k)]
        if given:
            raise DsaError("dsa-bundle create", f"{', '.join(given)} cannot be combined with several --index",
                           "a multi-target bundle takes every target's files from its module index")
        source = a.manifest_source or source_name(Path(a.manifest))
        for index in a.index:
            if not Path(index).is_file():
                raise DsaError(index, "no such module index", "build the dsa_vmfb (or run dsa compile) first")
        stages = [StageInput(name="", manifest=Path(a.manifest), manifest_source=source,
                             **inputs_from_index(Path(index))) for index in a.index]
        sha = write_multi_target_bundle(Path(a.out), stages, digest_out=Path(a.digest) if a.digest else None,
                                        most_capable_first=a.most_capable_first,
                                        processors=[Path(p) for p in a.processor] if a.processor else None,
                                        policy_config=Path(a.policy_config) if a.policy_config else None)
        if not a.digest:  # by hand, not in a build action: say what was written
            print(f"dsa-bundle: wrote {a.out} (sha256 {sha}) and {sidecar_path(Path(a.out))}")
        return
    if a.most_capable_first:
        raise DsaError("--most-capable-first", "orders the targets of a multi-target bundle",
                       "pass an --index per target")
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
                        manifest_source=a.manifest_source or source_name(Path(a.manifest)),
                        digest_out=Path(a.digest) if a.digest else None,
                        processors=[Path(p) for p in a.processor] if a.processor else None,
                        policy_config=Path(a.policy_config) if a.policy_config else None, **files)
    if a.index:  # by hand, not in a build action: say what was written
        print(f"dsa-bundle: wrote {a.out} (sha256 {sha}) and {a.digest or sidecar_path(Path(a.out))}")


def main(argv: Optional[List[str]] = None) -> None:
    """The DsaBundle action: `create ...` (`dsa bundle` also verifies, lists and releases: dsa/tools/bundle_cli.py)."""
    parser = argparse.ArgumentParser(prog="dsa bundle", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_create_arguments(sub.add_parser("create", help="write a bundle archive and its .sha256"))
    create(parser.parse_args(argv))


if __name__ == "__main__":
    run_cli(main, "dsa bundle")
