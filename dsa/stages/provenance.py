"""What a bundle says about its build: the build report (build_report.json) and the in-toto/SLSA provenance
statement (provenance.intoto.json) of each bundle kind: a single-model, pipeline, multi-target and ExecuTorch
bundle (docs/bundle-format.md). Part of the DsaBundle action (dsa.stages.bundle)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from dsa.core.bundle_layout import PARAMS_IRPA
from dsa.core.formats import BUILD_REPORT_FORMAT, BUNDLE_FORMAT, EXECUTORCH_BUNDLE_FORMAT, MULTI_TARGET_BUNDLE_FORMAT

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
# Identify the structure of externalParameters/internalParameters; documented in docs/bundle-format.md.
BUILD_TYPE = "https://rules-dsa.invalid/dsa_bundle/v1"
BUILDER_ID = "https://rules-dsa.invalid/dsa_bundle"
PTE_BUILD_TYPE = "https://rules-dsa.invalid/dsa_pte/v1"


def build_report(lock: dict, records: Dict[str, dict], reports: Dict[str, dict], sizes: Dict[str, int],
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


def provenance_statement(lock: dict, subjects: Dict[str, str], manifest_source: str,
                         bundle_name: Optional[str]) -> dict:
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


def pipeline_provenance(collected, digests: Dict[str, str], bundle_name: str, target: str) -> dict:
    """One statement for a pipeline: every member as a subject, every stage's inputs as dependencies (the
    shared tool sources and toolchain once)."""
    statement = None
    deps: List[dict] = []
    seen = set()
    for s, c, _ in collected:
        one = provenance_statement(c.lock, digests, s.source, bundle_name)
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

def multi_target_provenance(locks: Sequence[dict], subjects: Dict[str, str], manifest_source: str,
                            bundle_name: str) -> dict:
    """One statement for a multi-target bundle (`locks` in the bundle's target order): every member a subject;
    the model's inputs once, each target's spec and flags."""
    first = locks[0]
    statement = provenance_statement(first, subjects, manifest_source, bundle_name)
    definition = statement["predicate"]["buildDefinition"]
    deps = [d for d in definition["resolvedDependencies"] if d["annotations"]["role"] != "target_spec"]
    deps[2:2] = [{"name": f"target_spec/{lock['target']}.json", "digest": {"sha256": lock["target_spec"]["sha256"]},
                  "annotations": {"role": "target_spec", "target": lock["target"]}} for lock in locks]
    definition["resolvedDependencies"] = deps
    definition["externalParameters"] = {"model_id": first["model_id"], "targets": [lock["target"] for lock in locks],
                                        "manifest": manifest_source, "bundle": bundle_name}
    definition["internalParameters"] = {"targets": [
        {"target": lock["target"], "target_flags": lock["target_spec"].get("flags", []),
         "modules": [{"name": m["name"], "flags": m.get("flags", [])} for m in lock.get("modules", [])]}
        for lock in locks]}
    statement["predicate"]["runDetails"]["builder"]["version"]["bundle_format"] = str(MULTI_TARGET_BUNDLE_FORMAT)
    return statement


def pte_provenance(record: dict, subjects: Dict[str, str], manifest_source: str, bundle_name: str) -> dict:
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
