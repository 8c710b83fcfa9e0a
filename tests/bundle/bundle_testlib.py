"""Helpers of the bundle tests: the built π0 bundle's inputs, honest variants of a bundle, damage, the CLIs."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

from dsa.core import tarfiles as T
from dsa.runtime import bundle as B
from dsa.stages import bundle as W
from dsa.core.fileio import canonical_json, read_json, sha256_file
from dsa.tools.testing import runfile

MODULES = ["prompt_len_0", "prompt_len_1", "prompt_len_2"]
BUILT = "models/pi0_bundle.tar"
# The directory that holds the dsa package, for CLI subprocesses.
PACKAGE_ROOT = Path(B.__file__).resolve().parents[2]


def rebundle_pipeline(work: Path, out: Path, manifest_source: str, processors: Sequence[Path]) -> Path:
    """A pipeline bundle made again by the bundle tool (what DsaBundle runs) from its extracted files in `work`
    after a test changed some of them (and, if it chose to, the manifest's pins): the runtime view and the
    lock follow the manifest as it now is, so only what the test changed differs from an honest build."""
    from dsa.manifest.contract import dump_json, load_manifest, project

    dump_json(project(load_manifest(work / B.MANIFEST_YAML), "runtime"), work / B.RUNTIME_VIEW_JSON)
    meta = read_json(work / B.BUNDLE_JSON)
    # A single-model bundle's files lie at the root; a multi-target one's (a policy's levels) under `<target>.`.
    prefixes = [t["target"] + "." for t in meta["targets"]] if meta.get("kind") == "multi-target" else [""]
    stages = []
    for prefix in prefixes:
        lock_path = work / (prefix + B.LOCK_JSON)
        lock = read_json(lock_path)
        lock["manifest"]["sha256"] = sha256_file(work / B.MANIFEST_YAML)
        lock["views"]["runtime"] = sha256_file(work / B.RUNTIME_VIEW_JSON)
        lock_path.write_text(canonical_json(lock), encoding="utf-8")
        modules = sorted(m["name"] for m in lock["modules"])
        stages.append(W.StageInput(
            name="", lock=lock_path, manifest=work / B.MANIFEST_YAML, runtime_view=work / B.RUNTIME_VIEW_JSON,
            target_spec=work / (prefix + B.TARGET_SPEC_JSON), params=work / B.PARAMS_IRPA,
            modules=[W.ModuleInput(m, work / f"{prefix}{m}.vmfb", work / f"{prefix}{m}.export_record.json",
                                   work / f"{prefix}{m}.compile_report.json") for m in modules],
            manifest_source=manifest_source))
    if len(stages) > 1:
        W.write_multi_target_bundle(out, stages, processors=list(processors), policy_config=work / "policy_config.json")
    else:
        W.write_bundle(out, stages, processors=list(processors), policy_config=work / "policy_config.json")
    return out


def built_inputs() -> Dict[str, object]:
    """create_bundle's keyword arguments for the inputs //models:pi0_bundle was built from (runfiles)."""
    return dict(
        lock=runfile("models/pi0.lock.json"),
        manifest=runfile("manifests/pi0.yaml"),
        runtime_view=runfile("models/pi0_model/runtime_view.json"),
        target_spec=runfile("toolchains/targets/x86_64-v3.json"),
        params=runfile("models/pi0_model/params.irpa"),
        modules=[
            W.ModuleInput(m, runfile(f"models/pi0/{m}.vmfb"), runfile(f"models/pi0_buckets/{m}.export_record.json"),
                          runfile(f"models/pi0/{m}.compile_report.json"))
            for m in MODULES
        ],
        manifest_source="manifests/pi0.yaml",
    )


def copy_inputs(kwargs: Dict[str, object], dest: Path) -> Dict[str, object]:
    """The same inputs, copied under `dest` (so their paths differ)."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dict(kwargs)
    for key in ("lock", "manifest", "runtime_view", "target_spec", "params"):
        target = dest / f"{key}.{Path(kwargs[key]).name}"
        shutil.copyfile(kwargs[key], target)
        out[key] = target
    out["modules"] = []
    for m in kwargs["modules"]:
        files = []
        for suffix, path in (("vmfb", m.vmfb), ("record", m.export_record), ("report", m.compile_report)):
            target = dest / f"{m.name}.{suffix}"
            shutil.copyfile(path, target)
            files.append(target)
        out["modules"].append(W.ModuleInput(m.name, *files))
    return out


def rebundle(source: B.OpenedBundle, out: Path, *, files: Optional[Dict[str, bytes]] = None,
             lock_edit: Optional[Callable[[dict], None]] = None) -> Path:
    """A new bundle from an opened one's files, with some files replaced and the lock edited to match.

    The lock keeps recording what the files are: the digests of the bundled files it names are recomputed;
    everything else (checkpoint, views not in the bundle, sources, toolchain) is up to `lock_edit`."""
    work = out.parent / (out.name + ".files")
    shutil.copytree(source.root, work)
    for name, data in (files or {}).items():
        (work / name).write_bytes(data)
    lock = read_json(work / B.LOCK_JSON)
    digest = {p.name: sha256_file(p) for p in work.iterdir()}
    lock["manifest"]["sha256"] = digest[B.MANIFEST_YAML]
    lock["target_spec"]["sha256"] = digest[B.TARGET_SPEC_JSON]
    lock["views"]["runtime"] = digest[B.RUNTIME_VIEW_JSON]
    for name in lock["artifacts"]:
        lock["artifacts"][name] = digest[name]
    for m in lock["modules"]:
        for key, suffix in (("vmfb", ".vmfb"), ("export_record", ".export_record.json"),
                            ("compile_report", ".compile_report.json")):
            m[key] = digest[m["name"] + suffix]
    if lock_edit:
        lock_edit(lock)
    (work / B.LOCK_JSON).write_text(canonical_json(lock), encoding="utf-8")
    W.create_bundle(
        out, lock=work / B.LOCK_JSON, manifest=work / B.MANIFEST_YAML, runtime_view=work / B.RUNTIME_VIEW_JSON,
        target_spec=work / B.TARGET_SPEC_JSON, params=work / B.PARAMS_IRPA,
        modules=[W.ModuleInput(m, work / f"{m}.vmfb", work / f"{m}.export_record.json",
                               work / f"{m}.compile_report.json") for m in MODULES],
        manifest_source=source.meta["manifest_source"],
    )
    return out


def repack(source_dir: Path, out: Path, edit_meta: Callable[[dict], None]) -> Path:
    """The files of an extracted bundle re-archived (same fixed metadata) with bundle.json edited."""
    meta = read_json(source_dir / B.BUNDLE_JSON)
    edit_meta(meta)
    with tarfile.open(out, "w", format=T.TAR_FORMAT) as tar:
        for path in sorted(source_dir.iterdir()):
            data = canonical_json(meta).encode() if path.name == B.BUNDLE_JSON else path.read_bytes()
            tar.addfile(T.tarinfo(path.name, len(data)), io.BytesIO(data))
    return out


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def member_offset(archive: Path, name: str) -> int:
    with tarfile.open(archive) as tar:
        return tar.getmember(name).offset_data


def cli(module: str, *args, cwd: Optional[Path] = None, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT)] + [p for p in sys.path if p])
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full_env)

