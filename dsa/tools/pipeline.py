"""dsa compile: the whole pipeline without Bazel, for users not on Bazel yet.

    bin/dsa compile --manifest manifests/pi0.yaml --out out/pi0 [--checkpoint FILE | --seeded-checkpoint 0]

Runs the same stage functions the Bazel rules run, in the same order: manifest views → export → parameter
archive → one export per shape bucket → compile for every target the manifest lists → module index.
Without `--target` every target is compiled; the index of a portable target (x86_64-v3) lists the builds for
the same machines' richer CPUs (x86_64-v4) as its `levels`, and `dsa run --index` on it runs the most capable
one this machine executes (as Bazel's `bazel build //models:<policy>` and its module index do).

What a stage finished is kept in a cache (dsa.tools.compile_cache: ~/.cache/rules_dsa/compile-cache, or
$DSA_COMPILE_CACHE; `DSA_COMPILE_CACHE=off` or `--no-cache` turns it off), keyed by exactly the inputs the
stage's Bazel action is keyed by: a second run for another target, with another tuning file or after a failed
compile runs only what changed, and gives the same bytes. Each stage is stored as soon as it succeeds, so a
failed build (which leaves `--out` as it was) keeps its finished export and parameter archive for the next.

Each stage (checkpoint, export, params, each bucket's export, each compile) runs in a process of its own, as
each Bazel action does (dsa.tools.stage_process): the peak memory is the largest stage's, not their sum, and
`<out>/timings.json` records each stage's wall time and peak RSS and the whole import→vmfb time (numbers
that differ run to run: never part of the artifacts or the lock); a stage taken from the cache is marked
`"cached": true` there, and on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dsa.core.formats import ExportRecord
from dsa.stages.checkpoint import make_checkpoint
from dsa.stages.compile import check_tuning_family, compile_module, load_tuning, target_flags, tuning_flags
from dsa.core.errors import DsaError, run_cli
from dsa.stages.export import export_model, model_source_files
from dsa.core.fileio import read_json, write_json_atomic
from dsa.core.identity import identity
from dsa.stages.lock import ModuleFiles, make_lock, stage_source_files
from dsa.manifest.contract import load_manifest, project, read_target_specs
from dsa.core.formats import Lock, ModuleIndex
from dsa.core.runtime_flags import index_runtime_flags
from dsa.stages.params import build_params, check_checkpoint_digest, open_checkpoint
from dsa.stages.tensor_files import shard_path
from dsa.tools import compile_cache
from dsa.tools.compile_cache import CompileCache, Hit, cache_from_environment, digest_file, digest_files
from dsa.tools.stage_process import StageRunner


def run_pipeline(manifest_path: Path, out: Path, **options) -> List[Path]:
    """Builds every artifact of the manifest's model into `out`; returns the module index of each target (see
    build_into). Everything is written into a staging directory beside `out` and swapped into place only when
    the whole build succeeded: `out` is then either the earlier complete output or the new one, never a mix
    that `dsa run --index` would run (a failed or interrupted build leaves the earlier output as it was).

    A build that fails with a refusal (DsaError) keeps what it had staged in `<out>.failed/` (never read by a
    build or by `dsa run`; replaced by the next failure, removed by the next success), and its message names
    the files there: the MLIR an iree-compile error points into can be read, not a deleted staging path."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DsaError("--out", f"{out} is a file, not an output directory", "pass a directory path")
    out.parent.mkdir(parents=True, exist_ok=True)
    failed = out.parent / f"{out.name}.failed"
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
    try:
        indexes = build_into(manifest_path, staging, **options)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / out.name)
        os.rename(staging, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(failed, ignore_errors=True)
    except DsaError as e:
        named = str(staging) in str(e) or os.path.relpath(staging) in str(e)
        if named and (not failed.exists() or failed.is_dir()):
            shutil.rmtree(failed, ignore_errors=True)
            os.rename(staging, failed)
            raise DsaError(*(_restaged(part, staging, failed) for part in (e.where, e.message, e.hint))) from None
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [out / index.relative_to(staging) for index in indexes]


def _restaged(text: Optional[str], staging: Path, failed: Path) -> Optional[str]:
    """A message part with the staging directory's paths (absolute or relative) as those of `failed`."""
    if text is None:
        return None
    for old, new in ((str(staging), str(failed)), (os.path.relpath(staging), os.path.relpath(failed))):
        text = text.replace(old, new)
    return text


def build_into(
    manifest_path: Path,
    out: Path,
    *,
    targets_dir: Path,
    checkpoint: Optional[Path] = None,
    seeded_checkpoint: Optional[int] = None,
    pythonpath: List[str] = (),
    requirements_lock: Path = Path("requirements_lock.txt"),
    tuning: Optional[dict] = None,
    policy_config: Optional[Path] = None,
    tuning_dir: Optional[Path] = None,
    targets: Optional[List[str]] = None,
    model_file: Optional[Path] = None,
    cache: Optional[CompileCache] = None,
) -> List[Path]:
    """Builds every artifact of the manifest's model into the (empty) directory `out`; returns the module index
    of each target (`targets`, default: every target the manifest lists). Beside each index lies `<target>.lock.json`, the same recipe lock the Bazel rules write.

    `tuning` maps a target name to the tuning file to compile it with; a target without one compiles with
    `tuning_dir/<family>.<target>.json` when the manifest names its tuning family, else with the target
    spec's flags only. Every tuning file is checked against its target and the manifest before any export.

    `cache` (dsa.tools.compile_cache; `dsa compile` passes the user's, None runs every stage): the checkpoint,
    export, params, bucket export and compile stages are taken from it when their inputs are unchanged, and
    stored in it as each finishes."""
    started = time.monotonic()
    known = sorted(p.stem for p in targets_dir.glob("*.json"))
    # Every target's spec: a precision.compute one of them has no arithmetic for is refused before any work.
    manifest = load_manifest(manifest_path, known_targets=known,
                             target_specs=read_target_specs(sorted(targets_dir.glob("*.json"))))
    name = str(manifest_path)
    unlisted = sorted(set(targets or ()) - set(manifest["targets"]))
    if unlisted:
        raise DsaError("--target", f"{', '.join(unlisted)} is not one of {name}'s targets "
                       f"({', '.join(manifest['targets'])})", "add it to the manifest's `targets`, or choose a listed one")
    # The targets this build compiles for, in the manifest's order.
    manifest = dict(manifest, targets=[t for t in manifest["targets"] if not targets or t in targets])
    tuning = resolve_tuning(manifest, name, targets_dir, tuning_dir or _RULES_DSA_ROOT / "toolchains" / "tuning",
                            dict(tuning or {}))
    views = out / "views"
    export_view = project(manifest, "export")
    write_json_atomic(views / "export_view.json", export_view)
    params_view = project(manifest, "params")
    write_json_atomic(views / "params_view.json", params_view)
    write_json_atomic(out / "runtime_view.json", project(manifest, "runtime"))
    entry_point = export_view["model"].get("entry_point", "")

    import dsa

    # The stage code and the Python environment: recorded in the lock, and part of every cache key.
    tool_sources = stage_source_files(Path(dsa.__file__).parent, entry_point)
    environment = identity(str(requirements_lock))
    stage = _Stages(cache, {"stage_code": digest_files(tool_sources), "identity": environment})

    checkpoint_hit = None
    if checkpoint is None:
        if seeded_checkpoint is not None:
            checkpoint = out / "checkpoint.safetensors"
            checkpoint_inputs = None
            if cache is not None:
                checkpoint_inputs = {"export_view": digest_file(views / "export_view.json"),
                                     "seed": seeded_checkpoint,
                                     "model_sources": _digest_sources(_model_sources(entry_point, pythonpath))}
            checkpoint_hit = stage.cached("checkpoint", "checkpoint", checkpoint_inputs,
                                          {"checkpoint.safetensors": checkpoint}, make_checkpoint, export_view,
                                          checkpoint, seed=seeded_checkpoint, pythonpath=pythonpath)
        else:
            checkpoint = manifest_file(manifest_path, manifest["checkpoint"]["path"], "checkpoint.path",
                                       "pass --checkpoint FILE, or --seeded-checkpoint SEED for a generated "
                                       "stand-in")
    elif not checkpoint.is_file():
        raise DsaError("--checkpoint", f"{checkpoint} is not a regular file", "pass a .safetensors file")

    try:
        check_checkpoint_digest(checkpoint, params_view, name)  # before the export: it can take minutes
    except DsaError:
        # A generated checkpoint from the cache that was only stat-checked: a corrupt entry is discarded and
        # the checkpoint generated again; a good one is the checkpoint the manifest does not pin.
        if checkpoint_hit is None or cache.recheck(checkpoint_hit):
            raise
        stage.cached("checkpoint", "checkpoint", checkpoint_inputs, {"checkpoint.safetensors": checkpoint},
                     make_checkpoint, export_view, checkpoint, seed=seeded_checkpoint, pythonpath=pythonpath)
        check_checkpoint_digest(checkpoint, params_view, name)
    if manifest["framework"] != "onnx":  # an ONNX model's weights are checked against its import's record
        # A readable safetensors file (or sharded checkpoint), also before the export.
        open_checkpoint(checkpoint, framework="numpy", view=params_view, manifest_name=name).close()
    if policy_config is None and "policy_config" in manifest["model"]:
        # framework lerobot: the policy's config.json, relative to the manifest
        policy_config = manifest_file(manifest_path, manifest["model"]["policy_config"]["path"],
                                      "model.policy_config.path", "pass --policy-config FILE")
    if model_file is None and "file" in manifest["model"]:
        # frameworks onnx, stablehlo: the model file, relative to the manifest
        model_file = manifest_file(manifest_path, manifest["model"]["file"]["path"], "model.file.path",
                                   "pass --model-file FILE")
    sources = _model_sources(entry_point, pythonpath)
    export_inputs = None
    if cache is not None:
        # DsaExport's inputs: the export view, the model code, the policy config / model file (and the stage
        # code and environment every key has).
        export_inputs = {"export_view": digest_file(views / "export_view.json"),
                         "model_sources": _digest_sources(sources),
                         "policy_config": digest_file(policy_config), "model_file": digest_file(model_file),
                         "bucket_view": None, "reference_record": None}
    stage.cached("export", "export", export_inputs,
                 {"model.mlir": out / "model.mlir", "export_record.json": out / "export_record.json"},
                 export_model, export_view, out / "model.mlir", out / "export_record.json",
                 sources=sources, pythonpath=pythonpath, manifest_name=name, policy_config=policy_config,
                 model_file=model_file)
    # The record as the Bazel actions read it: from its file (the same whether it was exported or cached).
    record = ExportRecord.read(out / "export_record.json")
    params_inputs = None
    if cache is not None:
        # DsaParams' inputs: the params view, the checkpoint (its pins, verified above against the file), the
        # export record.
        shards = params_view["checkpoint"].get("shards")
        params_inputs = {"params_view": digest_file(views / "params_view.json"),
                         "checkpoint": params_view["checkpoint"]["sha256"],
                         "shards": None if shards is None else [[s["file"], s["sha256"]] for s in shards],
                         "export_record": digest_file(out / "export_record.json")}

    def params():
        return stage.cached("params", "params", params_inputs, {"params.irpa": out / "params.irpa"},
                            build_params, checkpoint, params_view, record, out / "params.irpa", manifest_name=name)

    params_hit = params()

    view_files = {"export": views / "export_view.json", "params": views / "params_view.json",
                  "runtime": out / "runtime_view.json"}
    exported = []  # (mlir, record) per module
    for dim, sizes in sorted(manifest["buckets"].items()):
        for slot in range(len(sizes)):
            stem = out / "buckets" / f"{dim}_{slot}"
            bucket = project(manifest, "bucket", bucket=(dim, slot))
            view_files[f"bucket/{dim}_{slot}"] = views / f"{dim}_{slot}.bucket_view.json"
            write_json_atomic(view_files[f"bucket/{dim}_{slot}"], bucket)
            bucket_inputs = None
            if cache is not None:
                bucket_inputs = dict(export_inputs, bucket_view=digest_file(view_files[f"bucket/{dim}_{slot}"]),
                                     reference_record=digest_file(out / "export_record.json"))
            stage.cached(f"export {dim}_{slot}", "export", bucket_inputs,
                         {"model.mlir": stem.with_suffix(".mlir"),
                          "export_record.json": stem.with_suffix(".export_record.json")},
                         export_model, export_view, stem.with_suffix(".mlir"),
                         stem.with_suffix(".export_record.json"), bucket=bucket, reference_record=record,
                         sources=sources, pythonpath=pythonpath, manifest_name=name, policy_config=policy_config,
                         model_file=model_file)
            exported.append((stem.with_suffix(".mlir"), stem.with_suffix(".export_record.json")))
    if not exported:
        exported.append((out / "model.mlir", out / "export_record.json"))

    indexes = []
    for target_name in manifest["targets"]:
        target_spec = targets_dir / f"{target_name}.json"
        target = read_json(target_spec)
        tuning_file = (tuning or {}).get(target_name)
        compile_view = project(manifest, "compile", target=target_name)
        compile_view_file = views / f"compile_view.{target_name}.json"
        write_json_atomic(compile_view_file, compile_view)
        modules = []
        module_files = []
        for mlir, module_record in exported:
            vmfb = out / target_name / (mlir.stem + ".vmfb")
            report = vmfb.with_suffix(".compile_report.json")
            compile_inputs = None
            if cache is not None:
                # DsaCompile's inputs: the MLIR, the compile view, the target spec, the tuning file.
                compile_inputs = {"mlir": digest_file(mlir), "compile_view": digest_file(compile_view_file),
                                  "target_spec": digest_file(target_spec), "tuning": digest_file(tuning_file)}
            stage.cached(f"compile {mlir.stem} {target_name}", "compile", compile_inputs,
                         {"module.vmfb": vmfb, "compile_report.json": report},
                         compile_module, mlir, compile_view, target, vmfb, report,
                         where=f"{mlir} for target {target_name}",
                         tuning=load_tuning(tuning_file) if tuning_file else None)
            modules.append({"vmfb": os.path.relpath(vmfb, out), "record": os.path.relpath(module_record, out)})
            module_files.append(ModuleFiles(mlir.stem, mlir, module_record, vmfb, report))
        target_copy = out / target_name / f"{target_name}.json"
        shutil.copyfile(target_spec, target_copy)  # byte for byte: the lock digests it
        index = out / f"{target_name}.modules.json"
        ModuleIndex(
            target=target_name,
            target_spec=os.path.relpath(target_copy, out),
            parameter_archive="params.irpa",
            parameter_scope=record["parameter_scope"],
            runtime_view="runtime_view.json",
            modules=tuple((m["vmfb"], m["record"]) for m in modules),
            runtime_flags=index_runtime_flags(read_json(m.compile_report) for m in module_files),
        ).write(index)

        def lock():
            return make_lock(
                manifest=manifest_path,
                views=dict(view_files, compile=compile_view_file),
                checkpoint=checkpoint,
                model_sources={rel: Path(path) for rel, path in sources.items()},
                tool_sources=tool_sources,
                identity=environment,
                target_spec=target_spec,
                modules=module_files,
                params=out / "params.irpa",
                tuning=(_tuning_key(tuning_file), tuning_file) if tuning_file else None,
                policy_config=policy_config,
                model_file=model_file,
                checkpoint_shards=[shard_path(checkpoint, s["file"])
                                   for s in params_view["checkpoint"].get("shards", [])],
            )

        lock_data = lock()
        if params_hit is not None:
            # The lock hashed the archive, which a large cached one was only stat-checked: the same digest as
            # the cache entry's, or the entry is discarded and the archive built again.
            if not cache.confirm(params_hit, "params.irpa", lock_data["artifacts"]["params.irpa"]):
                params()
                lock_data = lock()
            params_hit = None
        Lock.write(out / f"{target_name}.lock.json", lock_data)
        indexes.append(index)
    add_levels(indexes)
    stage.report(cache)
    write_timings(out / "timings.json", stage.timings, time.monotonic() - started)
    return indexes


def _machine(spec: dict) -> tuple:
    """What a target's modules run on, but for the CPU features: targets alike in it are levels of each other."""
    host = spec.get("host") or {}
    return (spec.get("device"), spec.get("runtime_driver"), tuple(spec.get("backends", [])), host.get("arch"))


def add_levels(indexes: List[Path]) -> None:
    """Links the builds of targets that run on the same machines (x86_64-v3, x86_64-v4) as Bazel's dsa_policy
    `levels` do: the index of the one whose CPU features every other needs too (the portable one) lists the
    others under `levels`, so `dsa run --index` on it takes the most capable one the machine executes. Targets
    whose features do not nest (no portable one) are left apart."""
    groups: Dict[tuple, List[Tuple[Path, ModuleIndex, set]]] = {}
    for path in indexes:
        index = ModuleIndex.read(path)
        spec = read_json(path.parent / index.target_spec)
        if spec.get("host"):
            groups.setdefault(_machine(spec), []).append((path, index, set(spec["host"].get("cpu_features", []))))
    for builds in groups.values():
        if len(builds) < 2:
            continue
        base = min(builds, key=lambda b: (len(b[2]), b[1].target))
        if not all(base[2] <= features for _, _, features in builds):
            continue
        path, index, _ = base
        others = sorted((i.target, p.name) for p, i, _ in builds if p != path)
        dataclasses.replace(index, levels=tuple(others)).write(path)


def _model_sources(entry_point: str, pythonpath: List[str]) -> dict:
    """The model code behind the entry point, {workspace-relative path: the file} (what the export digests)."""
    sources = {}
    for rel in model_source_files(entry_point, pythonpath) if entry_point else ():
        sources[rel] = next(str(Path(root) / rel) for root in pythonpath if (Path(root) / rel).exists())
    return sources


def _digest_sources(sources: dict) -> dict:
    return digest_files({rel: Path(path) for rel, path in sources.items()})


def manifest_file(manifest_path: Path, relative: str, field: str, hint: str) -> Path:
    """A file a manifest names relative to itself: a relative path that stays inside the manifest's directory
    (no absolute path, no `..` out of it) to a regular file, so a manifest cannot make the build read
    /etc/shadow, block on a FIFO or read /dev/zero forever. A file elsewhere is passed explicitly
    (--checkpoint, --policy-config, or the Bazel rule's label). The check holds after symlinks are resolved: a
    symlink (or a symlinked directory) on the way is followed only where it ends inside the manifest's directory
    (itself resolved), so a link planted beside the manifest cannot reach a file elsewhere; a file you keep
    elsewhere on purpose is passed by its own flag."""
    where = f"{manifest_path}: {field}"
    normal = os.path.normpath(relative)
    if os.path.isabs(relative) or normal == ".." or normal.startswith(".." + os.sep):
        raise DsaError(where, f"'{relative}' leaves the manifest's directory",
                       f"keep it beside the manifest, or {hint}")
    path = manifest_path.parent / normal
    if not path.exists():
        raise DsaError(where, f"no file at {path}", hint)
    home = os.path.realpath(manifest_path.parent)
    real = os.path.realpath(path)
    if os.path.commonpath([home, real]) != home:
        raise DsaError(where, f"{path} is a symlink to {real}, outside the manifest's directory {home}",
                       f"a file elsewhere is named by its own flag: {hint}")
    if not path.is_file():
        raise DsaError(where, f"{path} is not a regular file", hint)
    return path


@dataclasses.dataclass(frozen=True)
class _Timing:
    stage: str
    wall_s: float
    peak_rss_kib: int
    cached: bool = False


class _Stages:
    """Runs each stage in a process of its own (StageRunner), or takes its outputs from the cache, and says on
    stderr what each took as it finishes. `timings`: one _Timing per stage, in call order."""

    def __init__(self, cache: Optional[CompileCache], common_inputs: dict):
        self.runner = StageRunner()
        self.cache = cache
        self.common_inputs = common_inputs  # in every key: the stage code and the environment's identity
        self.timings: List[_Timing] = []

    def __call__(self, name, fn, *args, **kwargs):
        result = self.runner(name, fn, *args, **kwargs)
        t = self.runner.timings[-1]
        self.timings.append(_Timing(t.stage, t.wall_s, t.peak_rss_kib))
        print(f"dsa compile: {name}: {t.wall_s:.1f} s, peak RSS {t.peak_rss_kib / 1024:.0f} MiB", file=sys.stderr)
        return result

    def cached(self, name: str, kind: str, inputs: Optional[dict], outputs: dict, fn, *args, **kwargs) -> Optional[Hit]:
        """Stage `name` (cache stage `kind`) writing `outputs` (entry file name → output path): from the cache
        when it has an entry for `inputs` (returns the hit), else run and stored (returns None)."""
        if self.cache is None:
            self(name, fn, *args, **kwargs)
            return None
        start = time.monotonic()
        inputs = dict(inputs, **self.common_inputs)
        key = self.cache.key(kind, inputs)
        hit = self.cache.fetch(kind, key, outputs, name)
        if hit is not None:
            took = time.monotonic() - start
            self.timings.append(_Timing(name, took, 0, cached=True))
            print(f"dsa compile: {name}: cached ({took:.1f} s to check and link)", file=sys.stderr)
            return hit
        self(name, fn, *args, **kwargs)
        self.cache.store(kind, key, outputs, name, inputs)
        return None

    def report(self, cache: Optional[CompileCache]) -> None:
        if cache is not None:
            hits = sum(t.cached for t in self.timings)
            print(f"dsa compile: {hits} of {len(self.timings)} stages from the compile cache {cache.root}",
                  file=sys.stderr)


def write_timings(path: Path, timings, total_s: float) -> None:
    """`timings.json`: each stage's wall time and peak RSS (its process and what it ran; a stage taken from the
    cache, `"cached": true`, ran no process: its wall time is the check and link, its peak 0), the whole run's
    wall time (import→vmfb) and the largest peak with its stage (null when every stage came from the cache)."""
    ran = [t for t in timings if not getattr(t, "cached", False)]
    peak = max(ran, key=lambda t: t.peak_rss_kib) if ran else None
    write_json_atomic(path, {
        "stages": [{"stage": t.stage, "wall_s": round(t.wall_s, 3), "peak_rss_kib": t.peak_rss_kib,
                    "cached": bool(getattr(t, "cached", False))}
                   for t in timings],
        "total_s": round(total_s, 3),
        "peak_rss_kib": peak.peak_rss_kib if peak else 0,
        "peak_stage": peak.stage if peak else None,
    })


# The checkout this module runs from (holds toolchains/ and requirements_lock.txt).
_RULES_DSA_ROOT = Path(__file__).resolve().parents[2]
_WORKSPACE_FILES = ("WORKSPACE", "WORKSPACE.bazel", "MODULE.bazel")


def default_pythonpath(manifest: Path) -> List[str]:
    """Where the model code is imported from without --pythonpath: the current directory, and the workspace
    (the nearest directory with a WORKSPACE or MODULE.bazel file) that holds the manifest, so that `dsa
    compile` works from any directory."""
    paths = ["."]
    for parent in Path(manifest).resolve().parents:
        if any((parent / name).is_file() for name in _WORKSPACE_FILES):
            if parent != Path.cwd().resolve():
                paths.append(str(parent))
            break
    return paths


def _tuning_key(path: Path) -> str:
    """How the lock names a tuning file: repository-relative inside this checkout (as Bazel names it)."""
    resolved = Path(path).resolve()
    if resolved.is_relative_to(_RULES_DSA_ROOT):
        return str(resolved.relative_to(_RULES_DSA_ROOT))
    return str(path)


def resolve_tuning(manifest: dict, name: str, targets_dir: Path, tuning_dir: Path, given: dict) -> dict:
    """The tuning file of each target (target name → path), checked before any work: one given for a target
    the manifest does not list, for another target or of another family than the manifest's `tuning` is
    refused; a target without one gets `<tuning>.<target>.json` from `tuning_dir` when the manifest names a
    family (refused, naming the file, when there is none)."""
    extra = sorted(set(given) - set(manifest["targets"]))
    if extra:
        raise DsaError("--tuning", f"target {', '.join(extra)} is not one of {name}'s targets "
                       f"({', '.join(manifest['targets'])})", "tune a target the manifest lists")
    family = manifest.get("tuning")
    for target_name in manifest["targets"]:
        spec_path = targets_dir / f"{target_name}.json"
        if spec_path.is_file():  # every spec's flags checked before any stage runs (compile_flags allow-list)
            target_flags(read_json(spec_path), str(spec_path))
        if target_name not in given and family is not None:
            path = tuning_dir / f"{family}.{target_name}.json"
            if not path.is_file():
                raise DsaError(f"{name}: tuning", f"family '{family}' has no tuning file for target "
                               f"{target_name} ({path})", "measure one (`bazel run //bench:tune`), pass "
                               f"--tuning {target_name}=FILE, or remove the target")
            given[target_name] = path
        if target_name in given:
            where = str(given[target_name])
            data = read_json(given[target_name])
            tuning_flags(data, read_json(targets_dir / f"{target_name}.json"), where)
            check_tuning_family(project(manifest, "compile", target=target_name), data, where)
    return given


def _tuning_args(values: List[str]) -> dict:
    tuning = {}
    for value in values:
        target, sep, path = value.partition("=")
        if not sep or not path:
            raise DsaError("--tuning", f"'{value}' is not TARGET=FILE",
                           "e.g. --tuning x86_64-v3=toolchains/tuning/transformer.x86_64-v3.json")
        if not Path(path).is_file():
            raise DsaError("--tuning", f"no tuning file at {path}")
        tuning[target] = Path(path)
    return tuning


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa compile", description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--checkpoint", type=Path, help="default: checkpoint.path, relative to the manifest")
    parser.add_argument("--seeded-checkpoint", type=int, metavar="SEED",
                        help="generate the seeded stand-in checkpoint (as dsa_checkpoint does)")
    parser.add_argument("--targets-dir", type=Path, default=_RULES_DSA_ROOT / "toolchains" / "targets",
                        help="target specs (default: this checkout's toolchains/targets)")
    parser.add_argument("--requirements-lock", type=Path, default=_RULES_DSA_ROOT / "requirements_lock.txt",
                        help="the lock the Python environment was installed from (recorded in the lock)")
    parser.add_argument("--pythonpath", action="append", default=None,
                        help="directory holding the model code (default: the current directory and the "
                        "workspace that holds the manifest)")
    parser.add_argument("--policy-config", type=Path,
                        help="framework lerobot: the policy's config.json (default: model.policy_config.path, "
                        "relative to the manifest)")
    parser.add_argument("--model-file", type=Path,
                        help="frameworks onnx, stablehlo: the model file (default: model.file.path, relative to "
                        "the manifest)")
    parser.add_argument("--target", action="append", default=[], metavar="NAME", dest="targets",
                        help="compile for this target of the manifest's `targets` (repeatable; default: all)")
    parser.add_argument("--tuning", action="append", default=[], metavar="TARGET=FILE",
                        help="compile TARGET with this tuning file (default: the manifest's tuning family's "
                        "file in --tuning-dir, if it names one)")
    parser.add_argument("--tuning-dir", type=Path, default=_RULES_DSA_ROOT / "toolchains" / "tuning",
                        help="where the manifest's tuning family is looked up (default: this checkout's "
                        "toolchains/tuning)")
    parser.add_argument("--no-cache", action="store_true",
                        help="run every stage, neither taking from nor adding to the compile cache "
                        f"(default: {compile_cache.DEFAULT_DIR}, or ${compile_cache.ENVIRONMENT_VARIABLE}=DIR; "
                        "=off turns it off too)")
    a = parser.parse_args(argv)
    # Every file argument is checked before any work (an export can take minutes).
    for flag, path in (("--manifest", a.manifest), ("--checkpoint", a.checkpoint),
                       ("--policy-config", a.policy_config), ("--model-file", a.model_file),
                       ("--requirements-lock", a.requirements_lock)):
        if path is not None and not path.is_file():
            raise DsaError(flag, f"no file at {path}")
    if not a.targets_dir.is_dir():
        raise DsaError("--targets-dir", f"no directory at {a.targets_dir}")
    tuning = _tuning_args(a.tuning)
    indexes = run_pipeline(a.manifest, a.out, targets_dir=a.targets_dir, checkpoint=a.checkpoint,
                           seeded_checkpoint=a.seeded_checkpoint,
                           pythonpath=a.pythonpath or default_pythonpath(a.manifest),
                           requirements_lock=a.requirements_lock, tuning=tuning,
                           policy_config=a.policy_config, tuning_dir=a.tuning_dir, targets=a.targets or None,
                           model_file=a.model_file, cache=cache_from_environment(disabled=a.no_cache))
    for index in indexes:
        print(f"dsa compile: wrote {index} and {index.name.replace('.modules.json', '.lock.json')}")
        levels = ModuleIndex.read(index).levels
        if levels:
            print(f"dsa compile: {index.name} lists its levels {', '.join(t for t, _ in levels)}: `dsa run --index "
                  f"{index}` runs the most capable build this machine executes")


if __name__ == "__main__":
    run_cli(main, "dsa compile")
