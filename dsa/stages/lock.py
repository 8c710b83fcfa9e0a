"""DsaLock: the recipe lock of one model's compiled modules for one target (`<name>.lock.json`).

It records the sha256 of everything that went in — the manifest and each projection of it, the checkpoint,
the model's sources, the rule set's tool sources, the Python environment's identity, the target spec and
the compile flags — and of everything that came out: export records, MLIR, vmfbs, compile reports and the
parameter archive. Entries are keyed by role or by repository-relative path, never by where a build put
them, and carry no timestamps, so the same inputs give a byte-identical lock from Bazel or `dsa compile`,
in any checkout. Bundles carry it; `dsa diff` compares two of them.
"""

from __future__ import annotations

import argparse
import os
import dataclasses
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import read_json, sha256_file

from dsa.core.formats import LOCK_FORMAT, Lock, ModuleIndex, level_index_name  # noqa: E402 (LOCK_FORMAT re-exported)
from dsa.core.runtime_flags import index_runtime_flags


@dataclasses.dataclass
class ModuleFiles:
    name: str  # e.g. prompt_len_0
    mlir: Path
    export_record: Path
    vmfb: Path
    compile_report: Path


def make_lock(
    *,
    manifest: Path,
    views: Mapping[str, Path],
    checkpoint: Path,
    model_sources: Mapping[str, Path],
    tool_sources: Mapping[str, Path],
    identity: dict,
    target_spec: Path,
    modules: List[ModuleFiles],
    params: Path,
    tuning: Optional[tuple] = None,
    policy_config: Optional[Path] = None,
    export_identity: Optional[dict] = None,
    model_file: Optional[Path] = None,
    checkpoint_shards: Sequence[Path] = (),
) -> dict:
    """`tuning`: (repository-relative key, path) of the tuning file the modules were compiled with.
    `policy_config`: framework lerobot, the policy's config.json; `export_identity`: the environment the
    export ran in when it is not `identity`'s (LeRobot policies). `checkpoint_shards`: a sharded checkpoint's
    shard files (`checkpoint` is then its index), recorded by file name."""
    compile_view = read_json(views["compile"])
    modules_out = []
    artifacts: Dict[str, str] = {"params.irpa": sha256_file(params)}
    for m in modules:
        report = read_json(m.compile_report)
        entry = {
            "name": m.name,
            "flags": report["flags"],
            "mlir": sha256_file(m.mlir),
            "export_record": sha256_file(m.export_record),
            "vmfb": sha256_file(m.vmfb),
            "compile_report": sha256_file(m.compile_report),
        }
        modules_out.append(entry)
        artifacts[f"{m.name}.vmfb"] = entry["vmfb"]
        artifacts[f"{m.name}.export_record.json"] = entry["export_record"]
        artifacts[f"{m.name}.compile_report.json"] = entry["compile_report"]
    target = read_json(target_spec)
    lock = {
        "format": LOCK_FORMAT,
        "model_id": compile_view["model_id"],
        "target": compile_view["target"],
        "manifest": {"sha256": sha256_file(manifest)},
        "views": {name: sha256_file(path) for name, path in sorted(views.items())},
        "checkpoint": _checkpoint_entry(checkpoint, checkpoint_shards),
        "model_sources": {key: sha256_file(path) for key, path in sorted(model_sources.items())},
        "tool_sources": {key: sha256_file(path) for key, path in sorted(tool_sources.items())},
        "toolchain": identity,
        "target_spec": {"sha256": sha256_file(target_spec), "flags": target["flags"]},
        "modules": sorted(modules_out, key=lambda e: e["name"]),
        "artifacts": dict(sorted(artifacts.items())),
    }
    if policy_config is not None:
        lock["policy_config"] = {"sha256": sha256_file(policy_config)}
    if model_file is not None:
        lock["model_file"] = {"sha256": sha256_file(model_file)}
    if export_identity is not None:
        lock["export_toolchain"] = export_identity
    if tuning is not None:
        key, path = tuning
        lock["tuning"] = {"path": key, "sha256": sha256_file(path), "flags": read_json(path)["flags"]}
    return lock


def _checkpoint_entry(checkpoint: Path, shards: Sequence[Path]) -> dict:
    """The checkpoint's digest; for a sharded checkpoint also each shard's, by file name (absent otherwise, so
    that single-file locks keep their bytes)."""
    entry = {"sha256": sha256_file(checkpoint)}
    if shards:
        entry["shards"] = {Path(s).name: sha256_file(s) for s in sorted(shards, key=lambda s: Path(s).name)}
    return entry


# The layers of the dsa package whose code the actions a lock covers run (//dsa:stage_code); runtime/ and
# tools/ are not among them, so editing a tool changes no lock.
STAGE_LAYERS = ("core", "manifest", "stages")


def stage_source_files(package_dir: Path, entry_point: str = "") -> Dict[str, Path]:
    """The stage code a lock records, keyed as `dsa/<layer>/<file>`: the package's `__init__.py`, the Python
    modules and the manifest schema of STAGE_LAYERS, and — when the model's entry point is a front end of the
    rule set (`dsa.frontends.<name>...`) — that front end's package. Bazel records the same set
    (//dsa:stage_code plus the front end the dsa_model's deps name)."""
    files = [package_dir / "__init__.py"]
    for layer in STAGE_LAYERS:
        files += (package_dir / layer).glob("*.py")
    files += (package_dir / "manifest" / "schema").glob("*.json")
    parts = entry_point.partition(":")[0].split(".")
    if len(parts) > 2 and parts[:2] == ["dsa", "frontends"]:
        files += [package_dir / "frontends" / "__init__.py"]
        files += (package_dir / "frontends" / parts[2]).rglob("*.py")
    return {str(f.relative_to(package_dir.parent)): f for f in sorted(files)}


def _pairs(values: List[str], what: str) -> Dict[str, Path]:
    out = {}
    for value in values:
        key, sep, path = value.partition("=")
        if not sep:
            raise DsaError(what, f"'{value}' is not KEY=PATH")
        out[key] = Path(path)
    return out


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa-lock", description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--view", action="append", default=[], help="NAME=PATH of a manifest view")
    parser.add_argument("--checkpoint", required=True, help="the checkpoint file (a sharded one's index)")
    parser.add_argument("--checkpoint-shard", action="append", default=[], help="a sharded checkpoint's shard")
    parser.add_argument("--model-source", action="append", default=[], help="KEY=PATH")
    parser.add_argument("--tool-source", action="append", default=[], help="KEY=PATH")
    parser.add_argument("--identity", required=True, help="identity.json of the Python environment")
    parser.add_argument("--target-spec", required=True)
    parser.add_argument("--module", action="append", default=[],
                        help="NAME=MLIR,EXPORT_RECORD,VMFB,COMPILE_REPORT")
    parser.add_argument("--params", required=True)
    parser.add_argument("--tuning", help="KEY=PATH of the tuning file the modules were compiled with")
    parser.add_argument("--policy-config", help="framework lerobot: the policy's config.json")
    parser.add_argument("--model-file", help="frameworks onnx, stablehlo: the model file the export imported")
    parser.add_argument("--export-identity", help="identity.json of the environment the export ran in, if another")
    parser.add_argument("--out", required=True)
    # The module index of these modules (dsa_vmfb's <name>.modules.json), written here so that one writer,
    # dsa.core.formats.ModuleIndex, makes every index: paths relative to the index's directory.
    parser.add_argument("--index-out", help="write the module index here")
    parser.add_argument("--index-target", help="the target's name, for the index")
    parser.add_argument("--index-target-spec", help="the target spec beside the modules, for the index")
    parser.add_argument("--index-runtime-view", help="the runtime view, for the index")
    parser.add_argument("--index-level", action="append", default=[], metavar="TARGET=NAME.modules.json",
                        help="a level of these modules: the same export compiled for TARGET, its index beside this "
                             "one (repeatable; the runner takes the most capable one the machine executes)")
    a = parser.parse_args(argv)
    modules = []
    for name, paths in _pairs(a.module, "--module").items():
        parts = str(paths).split(",")
        if len(parts) != 4:
            raise DsaError("--module", f"'{name}' needs MLIR,EXPORT_RECORD,VMFB,COMPILE_REPORT")
        modules.append(ModuleFiles(name, *map(Path, parts)))
    lock = make_lock(
        manifest=Path(a.manifest),
        views=_pairs(a.view, "--view"),
        checkpoint=Path(a.checkpoint),
        model_sources=_pairs(a.model_source, "--model-source"),
        tool_sources=_pairs(a.tool_source, "--tool-source"),
        identity=read_json(a.identity),
        target_spec=Path(a.target_spec),
        modules=modules,
        params=Path(a.params),
        tuning=next(iter(_pairs([a.tuning], "--tuning").items())) if a.tuning else None,
        policy_config=Path(a.policy_config) if a.policy_config else None,
        model_file=Path(a.model_file) if a.model_file else None,
        export_identity=read_json(a.export_identity) if a.export_identity else None,
        checkpoint_shards=[Path(s) for s in a.checkpoint_shard],
    )
    Lock.write(a.out, lock)
    if a.index_out:
        _write_index(a, modules)


def _write_index(a: argparse.Namespace, modules: List[ModuleFiles]) -> None:
    base = os.path.dirname(a.index_out)
    scopes = {read_json(m.export_record).get("parameter_scope", "model") for m in modules}
    if len(scopes) != 1:
        raise DsaError("--module", f"the modules use different parameter scopes {sorted(scopes)}",
                       "index the modules of one model")
    ModuleIndex(
        target=a.index_target,
        target_spec=os.path.relpath(a.index_target_spec, base),
        parameter_archive=os.path.relpath(a.params, base),
        parameter_scope=scopes.pop(),
        runtime_view=os.path.relpath(a.index_runtime_view, base),
        modules=tuple((os.path.relpath(m.vmfb, base), os.path.relpath(m.export_record, base)) for m in modules),
        runtime_flags=index_runtime_flags(read_json(m.compile_report) for m in modules),
        levels=tuple(_level(v) for v in a.index_level),
    ).write(Path(a.index_out))


def _level(value: str) -> Tuple[str, str]:
    target, sep, index = value.partition("=")
    if not sep or not target or not level_index_name(index):
        raise DsaError("--index-level", f"{value!r} is not TARGET=NAME.modules.json (an index beside this one)",
                       "build the levels in the package of the policy")
    return target, index


if __name__ == "__main__":
    run_cli(main, "dsa-lock")
