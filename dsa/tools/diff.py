"""dsa diff: what changed between two release bundles, from their recipe locks, manifests and build reports.

    bin/dsa diff A.tar B.tar [--json]
    bin/dsa diff A.tar B.tar --target aarch64-orin   # one target of multi-target bundles

Both bundles are verified first (as `dsa run --bundle` does). The report has three parts:

* inputs: the checkpoint; the manifest, field by field (the parsed YAML, so comments and formatting do
  not count; the checkpoint's own pin, `checkpoint.*`, is reported with the checkpoint); model source files
  and rules_dsa tool source files (added, removed, changed); the Python toolchain (lock digest,
  interpreter, each package's version); the target and its spec; each module's compile flags.
* artifacts: what the build made and the bundle ships: the parameter archive, each vmfb, export record and
  compile report (with size, dispatch count and exported op count where they changed), the runtime view and
  the module index; `intermediates` (manifest views, MLIR digests from the lock) are in --json only.
* pipeline (bundles with the policy's whole pipeline, docs/policy-pipeline.md): each pipeline node whose inputs
  changed, by name — a normalisation step's statistics, the tokenizer, a processor file's configuration, the
  network's modules — with the digests of what it reads; nodes added or removed. The processor files are
  inputs the bundle copies, so they are reported here, not among the artifacts.
* suspicious: an artifact that changed although nothing it is built from did — in particular any artifact
  change while no input changed at all. Same inputs must give the same bytes; this is a non-deterministic
  tool or an input the lock does not record.

Exit status: 0 when the comparison holds nothing suspicious (whatever changed), 1 when it flags a suspicious
change, 2 when a bundle cannot be read (corrupted, truncated, unsupported format).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Mapping, Optional

from dsa.runtime import bundle as B
from dsa.runtime.bundle import OpenedBundle, open_bundle, user_path
from dsa.core.errors import DsaError, run_cli

DIFF_FORMAT = 1
_MISSING = "(absent)"
# Bundle files that are not build outputs: copies of inputs (compared as inputs) and the evidence about them.
_NOT_ARTIFACTS = {B.MANIFEST_YAML, B.TARGET_SPEC_JSON, B.LOCK_JSON, B.BUILD_REPORT_JSON, B.PROVENANCE_JSON}


def _flatten(value: Any, prefix: str = "") -> Dict[str, Any]:
    """Dotted field paths → leaf values; lists of mappings are indexed (`inputs.cameras[0].shape`), other
    lists are one value."""
    if isinstance(value, Mapping):
        out: Dict[str, Any] = {}
        for key in value:
            out.update(_flatten(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def _changed(a: Any, b: Any) -> Optional[Dict[str, Any]]:
    return None if a == b else {"a": a, "b": b}


def _mapping_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> Dict[str, Any]:
    """{added: {k: b}, removed: {k: a}, changed: {k: {a, b}}}, empty parts left out."""
    out: Dict[str, Any] = {}
    added = {k: b[k] for k in sorted(set(b) - set(a))}
    removed = {k: a[k] for k in sorted(set(a) - set(b))}
    changed = {k: {"a": a[k], "b": b[k]} for k in sorted(set(a) & set(b)) if a[k] != b[k]}
    for key, part in (("added", added), ("removed", removed), ("changed", changed)):
        if part:
            out[key] = part
    return out


def _list_diff(a: List[Any], b: List[Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if a != b:
        out = {"a": a, "b": b}
        added = [x for x in b if x not in a]
        removed = [x for x in a if x not in b]
        if added:
            out["added"] = added
        if removed:
            out["removed"] = removed
    return out


def _packages(installed: List[str]) -> Dict[str, str]:
    out = {}
    for entry in installed:
        name, _, version = entry.partition("==")
        out[name] = version
    return out


def _manifest(bundle: OpenedBundle) -> dict:
    from dsa.manifest.contract import load_manifest

    return load_manifest(bundle.manifest_path)


def _pipeline_nodes(bundle: OpenedBundle) -> Optional[Dict[str, dict]]:
    """node name → {implementation, sha256: {file: digest}} of a bundle's policy pipeline, or None."""
    name = bundle.meta.get("policy_pipeline")
    if not name:
        return None
    spec = json.loads((bundle.root / name).read_text(encoding="utf-8"))
    nodes = {}
    for node in spec["nodes"]:
        digests = {}
        for key in ("pipeline", "state_file", "tokenizer"):
            if key in node:
                digests[node[key]["file"]] = node[key]["sha256"]
        digests.update({f"{m}.vmfb": sha for m, sha in node.get("modules", {}).items()})
        nodes[node["name"]] = {"implementation": node["implementation"], "sha256": digests}
    return nodes


def _pipeline_files(bundle: OpenedBundle) -> set:
    """The files a policy pipeline bundle copies from its inputs (processor files, config.json)."""
    nodes = _pipeline_nodes(bundle) or {}
    files = {f for n in nodes.values() for f in n["sha256"] if not f.endswith(".vmfb")}
    if nodes:
        files |= {"policy_config.json"} | {f for f in bundle.meta["files"]
                                           if f in ("tokenizer_config.json", "special_tokens_map.json")}
    return files


def _pipeline_diff(a: OpenedBundle, b: OpenedBundle) -> Dict[str, Any]:
    """Each pipeline node whose inputs changed (by the digests it reads), and nodes added or removed."""
    na, nb = _pipeline_nodes(a), _pipeline_nodes(b)
    if na is None and nb is None:
        return {}
    if na is None or nb is None:
        return {"kind": {"a": "network only" if na is None else "policy pipeline",
                         "b": "network only" if nb is None else "policy pipeline"}}
    out: Dict[str, Any] = {}
    added = [n for n in nb if n not in na]
    removed = [n for n in na if n not in nb]
    changed = {}
    for name in [n for n in na if n in nb]:
        da, db = na[name]["sha256"], nb[name]["sha256"]
        files = {f: {"a": da.get(f, _MISSING), "b": db.get(f, _MISSING)}
                 for f in sorted(set(da) | set(db)) if da.get(f) != db.get(f)}
        if files or na[name]["implementation"] != nb[name]["implementation"]:
            changed[name] = files
    for key, part in (("changed", changed), ("added", added), ("removed", removed)):
        if part:
            out[key] = part
    return out


def _module_facts(report: dict) -> Dict[str, dict]:
    return {m["name"]: m for m in report.get("modules", [])}


def diff_bundles(a: OpenedBundle, b: OpenedBundle) -> Dict[str, Any]:
    """The comparison of two verified bundles, as JSON data (see the module doc for its parts)."""
    la, lb = a.lock, b.lock
    for bundle, lock in ((a, la), (b, lb)):
        if lock.get("format") != 1:
            raise DsaError(f"{bundle.archive}: lock.json", f"recipe lock format {lock.get('format')!r} is not "
                           "supported", "this release compares lock format 1")
    inputs: Dict[str, Any] = {}

    for key in ("model_id", "target"):
        change = _changed(la.get(key), lb.get(key))
        if change:
            inputs[key] = change

    checkpoint = _changed(la["checkpoint"]["sha256"], lb["checkpoint"]["sha256"])
    if checkpoint:
        inputs["checkpoint"] = checkpoint

    fields_a, fields_b = _flatten(_manifest(a)), _flatten(_manifest(b))
    fields = {}
    pin_fields = {}
    for name in sorted(set(fields_a) | set(fields_b)):
        va, vb = fields_a.get(name, _MISSING), fields_b.get(name, _MISSING)
        if va != vb:
            # The checkpoint's pin belongs to the checkpoint: a new checkpoint must change it.
            (pin_fields if name.startswith("checkpoint.") and checkpoint else fields)[name] = {"a": va, "b": vb}
    if pin_fields:
        inputs["checkpoint"]["manifest_fields"] = pin_fields
    manifest_sha = _changed(la["manifest"]["sha256"], lb["manifest"]["sha256"])
    if fields or (manifest_sha and not pin_fields):
        inputs["manifest"] = {"sha256": manifest_sha or {"a": la["manifest"]["sha256"], "b": lb["manifest"]["sha256"]},
                              "fields": fields}

    for key in ("model_sources", "tool_sources"):
        part = _mapping_diff(la.get(key, {}), lb.get(key, {}))
        if part:
            inputs[key] = part

    ta, tb = la.get("toolchain", {}), lb.get("toolchain", {})
    toolchain: Dict[str, Any] = {}
    for key in sorted((set(ta) | set(tb)) - {"installed"}):
        change = _changed(ta.get(key), tb.get(key))
        if change:
            toolchain[key] = change
    packages = _mapping_diff(_packages(ta.get("installed", [])), _packages(tb.get("installed", [])))
    if packages:
        toolchain["packages"] = packages
    if toolchain:
        inputs["toolchain"] = toolchain

    spec_a, spec_b = la["target_spec"], lb["target_spec"]
    if spec_a != spec_b:
        inputs["target_spec"] = {"sha256": _changed(spec_a.get("sha256"), spec_b.get("sha256")),
                                 "flags": _list_diff(spec_a.get("flags", []), spec_b.get("flags", []))}

    mods_a = {m["name"]: m for m in la.get("modules", [])}
    mods_b = {m["name"]: m for m in lb.get("modules", [])}
    flags = {}
    for name in sorted(set(mods_a) | set(mods_b)):
        fa = mods_a.get(name, {}).get("flags")
        fb = mods_b.get(name, {}).get("flags")
        if fa is not None and fb is not None and fa != fb:
            flags[name] = _list_diff(fa, fb)
    if flags:
        inputs["flags"] = flags
    module_set = _mapping_diff({n: True for n in mods_a}, {n: True for n in mods_b})
    if module_set:
        inputs["modules"] = {k: sorted(v) for k, v in module_set.items() if k != "changed"}

    # Derived, not inputs: manifest views and each module's MLIR / export record. They localise a change.
    intermediates: Dict[str, Any] = {}
    views = _mapping_diff(la.get("views", {}), lb.get("views", {}))
    if views:
        intermediates["views"] = views
    for name in sorted(set(mods_a) & set(mods_b)):
        change = {k: {"a": mods_a[name][k], "b": mods_b[name][k]}
                  for k in ("mlir", "export_record") if mods_a[name].get(k) != mods_b[name].get(k)}
        if change:
            intermediates.setdefault("modules", {})[name] = change

    # Artifacts: what the bundle ships that the build made (the lock's artifacts, the runtime view, the index).
    files_a, files_b = a.meta["files"], b.meta["files"]
    facts_a, facts_b = _module_facts(a.build_report), _module_facts(b.build_report)
    artifacts: Dict[str, Any] = {}
    copied = _pipeline_files(a) | _pipeline_files(b)
    for name in sorted((set(files_a) | set(files_b)) - _NOT_ARTIFACTS - copied):
        sa, sb = files_a.get(name, {}).get("sha256"), files_b.get(name, {}).get("sha256")
        if sa == sb:
            continue
        entry: Dict[str, Any] = {"sha256": {"a": sa, "b": sb}}
        size = _changed(files_a.get(name, {}).get("size"), files_b.get(name, {}).get("size"))
        if size:
            entry["size"] = size
        if name.endswith(".vmfb"):
            module = name[:-len(".vmfb")]
            ma, mb = facts_a.get(module, {}), facts_b.get(module, {})
            for label, path in (("dispatch_count", ("compile", "dispatch_count")),
                                ("op_count", ("export", "op_count"))):
                va = ma.get(path[0], {}).get(path[1])
                vb = mb.get(path[0], {}).get(path[1])
                if va != vb:
                    entry[label] = {"a": va, "b": vb}
        artifacts[name] = entry

    suspicious = _suspicious(inputs, intermediates, artifacts, mods_a, mods_b)
    return {
        "format": DIFF_FORMAT,
        "a": {"bundle": str(a.archive), "sha256": a.sha256, "model_id": la.get("model_id"), "target": la.get("target")},
        "b": {"bundle": str(b.archive), "sha256": b.sha256, "model_id": lb.get("model_id"), "target": lb.get("target")},
        "identical": a.sha256 == b.sha256,
        "inputs": inputs,
        "intermediates": intermediates,
        "artifacts": artifacts,
        "pipeline": _pipeline_diff(a, b),
        "suspicious": suspicious,
    }


def _suspicious(inputs: dict, intermediates: dict, artifacts: dict, mods_a: dict, mods_b: dict) -> List[str]:
    found: List[str] = []
    if artifacts and not inputs:
        found.append(f"{', '.join(sorted(artifacts))} changed while no input did (checkpoint, manifest, sources, "
                     "toolchain, target and flags are all the same): a non-deterministic tool or an input the "
                     "lock does not record")
        return found
    # Stage by stage: a vmfb depends on its MLIR, its flags, the target spec and the toolchain only.
    compile_inputs_changed = any(k in inputs for k in ("toolchain", "target_spec", "target", "tool_sources"))
    for name in sorted(set(mods_a) & set(mods_b)):
        vmfb = f"{name}.vmfb"
        if vmfb not in artifacts or compile_inputs_changed:
            continue
        if name in intermediates.get("modules", {}) or name in inputs.get("flags", {}):
            continue
        found.append(f"{vmfb} changed although its MLIR, compile flags, target spec and toolchain did not: the "
                     "compile is not reproducible")
    # The parameter archive depends on the checkpoint, the params view, the export and the toolchain.
    if "params.irpa" in artifacts and not any(
            k in inputs for k in ("checkpoint", "toolchain", "tool_sources", "model_sources", "model_id")) \
            and "params" not in intermediates.get("views", {}).get("changed", {}):
        found.append("params.irpa changed although the checkpoint, the params view, the model and the "
                     "toolchain did not: the parameter archive is not reproducible")
    return found


def _short(value: Any) -> str:
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]
    return json.dumps(value) if not isinstance(value, str) else value


def _ab(change: Mapping[str, Any]) -> str:
    return f"{_short(change['a'])} -> {_short(change['b'])}"


def format_text(result: Dict[str, Any]) -> str:
    a, b = result["a"], result["b"]
    lines = [f"a: {a['bundle']} ({a['model_id']} for {a['target']}, sha256 {a['sha256'][:12]})",
             f"b: {b['bundle']} ({b['model_id']} for {b['target']}, sha256 {b['sha256'][:12]})"]
    if result["identical"]:
        lines.append("identical: the two archives have the same sha256")
        return "\n".join(lines) + "\n"
    inputs = result["inputs"]
    lines.append("inputs changed:" if inputs else "inputs changed: none")
    for key in ("model_id", "target"):
        if key in inputs:
            lines.append(f"  {key}: {_ab(inputs[key])}")
    if "checkpoint" in inputs:
        c = inputs["checkpoint"]
        pins = ", ".join(c.get("manifest_fields", {}))
        lines.append(f"  checkpoint: sha256 {_ab(c)}" + (f" (manifest pin {pins} follows it)" if pins else ""))
    if "manifest" in inputs:
        m = inputs["manifest"]
        if not m["fields"]:
            lines.append("  manifest: bytes differ, no field does (comments or formatting)")
        for name, change in m["fields"].items():
            lines.append(f"  manifest field {name}: {_ab(change)}")
    for key, label in (("model_sources", "model source"), ("tool_sources", "rules_dsa tool source")):
        part = inputs.get(key, {})
        for path in part.get("changed", {}):
            lines.append(f"  {label} {path}: changed")
        for path in part.get("added", {}):
            lines.append(f"  {label} {path}: added")
        for path in part.get("removed", {}):
            lines.append(f"  {label} {path}: removed")
    tool = inputs.get("toolchain", {})
    for key, change in tool.items():
        if key != "packages":
            lines.append(f"  toolchain {key}: {_ab(change)}")
    packages = tool.get("packages", {})
    for name, change in packages.get("changed", {}).items():
        lines.append(f"  toolchain package {name}: {change['a']} -> {change['b']}")
    for name, version in packages.get("added", {}).items():
        lines.append(f"  toolchain package {name}: added ({version})")
    for name, version in packages.get("removed", {}).items():
        lines.append(f"  toolchain package {name}: removed (was {version})")
    if "target_spec" in inputs:
        t = inputs["target_spec"]
        detail = "; ".join(f"{k} {' '.join(t['flags'].get(k, []))}" for k in ("added", "removed") if t["flags"].get(k))
        lines.append("  target spec: changed" + (f" (flags {detail})" if detail else ""))
    for name, change in inputs.get("flags", {}).items():
        detail = "; ".join(f"{k} {' '.join(change.get(k, []))}" for k in ("added", "removed") if change.get(k))
        lines.append(f"  compile flags of {name}: {detail or 'reordered'}")
    for key, names in inputs.get("modules", {}).items():
        lines.append(f"  modules {key}: {', '.join(names)}")
    artifacts = result["artifacts"]
    lines.append("artifacts changed:" if artifacts else "artifacts changed: none")
    for name, entry in artifacts.items():
        extra = [f"{k} {_ab(entry[k])}" for k in ("size", "dispatch_count", "op_count") if k in entry]
        lines.append(f"  {name}: sha256 {_ab(entry['sha256'])}" + (f" ({', '.join(extra)})" if extra else ""))
    pipeline = result.get("pipeline") or {}
    if pipeline:
        lines.append("pipeline nodes changed:")
        if "kind" in pipeline:
            lines.append(f"  bundle kind: {pipeline['kind']['a']} -> {pipeline['kind']['b']}")
        for node, files in pipeline.get("changed", {}).items():
            detail = "; ".join(f"{f} sha256 {_ab(c)}" for f, c in files.items())
            lines.append(f"  {node}: {detail or 'implementation changed'}")
        for key in ("added", "removed"):
            for node in pipeline.get(key, []):
                lines.append(f"  {node}: {key}")
    for message in result["suspicious"]:
        lines.append(f"SUSPICIOUS: {message}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="dsa diff", description=__doc__.splitlines()[0])
    parser.add_argument("a", help="the first bundle (NAME.tar)")
    parser.add_argument("b", help="the second bundle")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument("--target", help="compare this target's modules (required when a bundle is a "
                        "multi-target one; a single-target bundle must be for this target)")
    args = parser.parse_args(argv)
    with open_bundle(user_path(args.a)) as a, open_bundle(user_path(args.b)) as b:
        if args.target:
            a, b = a.for_target(args.target), b.for_target(args.target)
        result = diff_bundles(a, b)
    if args.json:
        sys.stdout.write(json.dumps(result, sort_keys=True, indent=2) + "\n")
    else:
        sys.stdout.write(format_text(result))
    return 1 if result["suspicious"] else 0


if __name__ == "__main__":
    code: List[int] = []
    run_cli(lambda: code.append(main()), "dsa diff")
    sys.exit(code[0] if code else 0)
