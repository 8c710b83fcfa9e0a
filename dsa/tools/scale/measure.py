"""One subject measured end to end (stand-in, `dsa compile`, sizes, runtime, eager, the old design) and the
merge of its entry into the data."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from dsa.core.errors import DsaError
from dsa.tools.scale.children import child_env, eager_weight_bytes, run_child, run_stage
from dsa.tools.scale.memory import heavy_lock, memory_total_bytes
from dsa.tools.scale.subjects import (
    SWEEPS, Subject, checkpoint_elements, checkpoint_files, estimate_scratch_bytes, pin_manifest, relative_to,
    requirements_lock_for, resolve_weights, stand_in_command, stand_in_recipe, subject_python, write_manifest)


DATA_FORMAT = 1
# Memory this machine keeps for everything else while an eager reference runs.
EAGER_MEMORY_MARGIN_BYTES = 3 << 30


# -- measuring one subject ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Settings:
    root: Path
    work: Path
    lock: Optional[Path]
    runs: int
    threads: int
    toolchain_python: Path
    lerobot_python: Optional[Path]
    pythonpath: List[str]
    targets: Optional[List[str]] = None
    runtime: bool = True
    eager: bool = True
    keep: bool = False
    max_scratch_bytes: Optional[int] = None
    log: Callable[[str], None] = print


def _stage_timings(path: Path) -> dict:
    from dsa.core.fileio import read_json

    return read_json(path)


def _size(paths: Sequence[Path]) -> int:
    return sum(Path(p).stat().st_size for p in paths)


def _relative_error(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        got = got.reshape(want.shape) if got.size == want.size else got
    if got.shape != want.shape:
        return float("nan")
    return float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))


def measure_subject(subject: Subject, s: Settings, command: str) -> dict:
    """Everything the tables need about one subject (see the module doc); failures of a runtime or eager
    step become notes, a failed build raises."""
    from dsa.core.fileio import read_json, sha256_file, write_json_atomic
    from dsa.core.formats import ExportRecord, ModuleIndex
    from dsa.manifest.contract import load_manifest, project
    from dsa.runtime.host import host_arch, host_cpu_features, missing_driver, missing_for

    log = s.log
    work = s.work / subject.key
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    python = subject_python(subject.framework, lerobot_python=s.lerobot_python, toolchain_python=s.toolchain_python)
    env = child_env(s.root, s.pythonpath)
    targets_dir = s.root / "toolchains" / "targets"
    known_targets = sorted(p.stem for p in targets_dir.glob("*.json"))
    entry = {
        "key": subject.key, "model_id": subject.model_id, "manifest": relative_to(subject.source, s.root),
        "framework": subject.framework, "description": subject.description, "family": subject.family,
        "size": subject.size, "date": time.strftime("%Y-%m-%d %H:%M"), "command": command,
        "machine": machine(s.threads), "environment": _env_name(python, s),
        "notes": [],
    }
    recipe = stand_in_recipe(subject.manifest)

    # The manifest as measured (written: its file is what dsa compile reads).
    manifest_file = write_manifest(subject.manifest, work / "manifest" / f"{subject.model_id}.yaml")
    manifest = load_manifest(manifest_file, known_targets=known_targets)
    view_file = work / "export_view.json"
    write_json_atomic(view_file, project(manifest, "export"))

    config = subject.lerobot_config
    if config is not None and subject.variants:
        values = json.loads(config.read_text())
        values.update(subject.variants)
        config = work / "policy.json"
        config.write_text(json.dumps(values, indent=2) + "\n")

    # -- weights
    if subject.weights is None:
        if s.max_scratch_bytes:
            counted = work / "count.json"
            log(f"dsa scale: {subject.key}: sizing the stand-in …")
            cmd = [str(python), "-m", "dsa.tools.scale", "--count-child", subject.framework, str(view_file),
                   str(counted)] + (["--config", str(config)] if config else []) + \
                  [a for p in s.pythonpath for a in ("--pythonpath", p)]
            elements = run_child(cmd, env, counted, f"{subject.key}: sizing the stand-in")["elements"]
            needed = estimate_scratch_bytes(subject.manifest, elements)
            free = shutil.disk_usage(s.work).free
            if needed > s.max_scratch_bytes or needed > free:
                raise DsaError(subject.key, f"needs about {needed / 1e9:.1f} GB of scratch for its stand-in "
                               f"({elements / 1e9:.2f} B values) and parameter archive; the limit is "
                               f"{s.max_scratch_bytes / 1e9:.1f} GB (--max-scratch-gb), {free / 1e9:.1f} GB free",
                               "raise --max-scratch-gb where the disk allows, or pass --weights")
        out = work / "stand_in"
        target_out = out
        if recipe["generator"] == "checkpoint" and not recipe["shards"]:
            out.mkdir(parents=True, exist_ok=True)
            target_out = out / "model.safetensors"
        cmd = stand_in_command(python, recipe, out=target_out, config=config, view=view_file,
                               pythonpath=[str(s.root)] + s.pythonpath)
        with heavy_lock(s.lock, f"{subject.key}: stand-in", log) as waited:
            log(f"dsa scale: {subject.key}: stand-in ({recipe['generator']}, {recipe['dtype']}"
                + (f", {recipe['shards']} shards" if recipe["shards"] else "") + ") …")
            made = run_stage(cmd, env, f"{subject.key}: stand-in")
        if recipe["generator"] == "lerobot":
            checkpoint, policy_config = out / "model.safetensors", out / "config.json"
        else:
            checkpoint = out / "model.safetensors.index.json" if recipe["shards"] else target_out
            policy_config = None
        stand_in_stage = {"stage": "stand-in", "wall_s": round(made["wall_s"], 3), "peak_rss_kib": made["peak_rss_kib"],
                          "lock_wait_s": round(waited, 1)}
        entry["weights"] = dict(recipe, source="stand-in", command="python " + _shown_command(_portable(cmd[1:], work, s.root)))
    else:
        checkpoint, policy_config = resolve_weights(subject.weights, subject.framework)
        stand_in_stage = None
        entry["weights"] = {"source": "given", "path": str(subject.weights)}
    files = checkpoint_files(checkpoint)
    entry["checkpoint_bytes"] = _size(files)
    entry["checkpoint_files"] = len(files) - (1 if checkpoint.name.endswith(".index.json") else 0)
    entry["checkpoint_parameters"] = checkpoint_elements(checkpoint)

    # -- pins
    manifest_file = pin_manifest(subject, checkpoint, policy_config, manifest_file, entry)

    # -- build: dsa compile --no-cache
    out_dir = work / "build"
    # `dsa compile` (the cli runs this module): the same flags, output and exit codes.
    cmd = [str(python), "-m", "dsa.tools.pipeline", "--manifest", str(manifest_file), "--out", str(out_dir),
           "--checkpoint", str(checkpoint), "--targets-dir", str(targets_dir),
           "--tuning-dir", str(s.root / "toolchains" / "tuning"),
           "--requirements-lock", str(requirements_lock_for(subject.framework, s.root)), "--no-cache"]
    for p in [str(s.root)] + s.pythonpath:
        cmd += ["--pythonpath", p]
    if policy_config is not None:
        cmd += ["--policy-config", str(policy_config)]
    model_file = (subject.manifest.get("model") or {}).get("file")
    if model_file:
        cmd += ["--model-file", str(subject.source.parent / model_file["path"])]
    targets = [t for t in manifest["targets"] if not s.targets or t in s.targets]
    if s.targets:
        if not targets:
            raise DsaError(subject.key, f"lists none of the targets {', '.join(s.targets)}",
                           f"its targets: {', '.join(manifest['targets'])}")
        for t in targets:
            cmd += ["--target", t]
    with heavy_lock(s.lock, f"{subject.key}: dsa compile", log) as waited:
        log(f"dsa scale: {subject.key}: dsa compile --no-cache ({', '.join(targets)}) …")
        built = run_stage(cmd, env, f"{subject.key}: dsa compile")
    timings = _stage_timings(out_dir / "timings.json")
    stages = ([stand_in_stage] if stand_in_stage else []) + [
        {"stage": t["stage"], "wall_s": t["wall_s"], "peak_rss_kib": t["peak_rss_kib"]} for t in timings["stages"]]
    entry["stages"] = stages
    entry["import_s"] = round(built["wall_s"], 3)
    entry["build_lock_wait_s"] = round(waited, 1)
    entry["compile_command"] = "dsa compile " + _shown_command(_portable(cmd[3:], work, s.root))
    entry["targets"] = targets

    record = ExportRecord.read(out_dir / "export_record.json")
    entry["parameter_count"] = record.get("parameter_count")
    entry["irpa_bytes"] = (out_dir / "params.irpa").stat().st_size
    entry["mlir_bytes"] = _size([p for p in [out_dir / "model.mlir", *sorted((out_dir / "buckets").glob("*.mlir"))]
                                 if p.is_file()])
    entry["modules"], entry["vmfb_bytes"], entry["runtime"] = {}, {}, {}
    runnable = []
    for target in targets:
        index_path = out_dir / f"{target}.modules.json"
        index = ModuleIndex.read(index_path)
        modules = []
        for vmfb, rec in index.modules:
            bucket = read_json(out_dir / rec).get("bucket")
            modules.append({"vmfb": vmfb, "bytes": (out_dir / vmfb).stat().st_size,
                            "sha256": sha256_file(out_dir / vmfb),
                            "bucket": {"dim": bucket["dim"], "size": bucket["size"]} if bucket else None})
        modules.sort(key=lambda m: (m["bucket"] or {}).get("size", 0))  # as CompiledPolicy: smallest first
        entry["modules"][target] = modules
        entry["vmfb_bytes"][target] = sum(m["bytes"] for m in modules)
        spec = read_json(out_dir / index.target_spec)
        why = missing_for(spec, host_arch(), host_cpu_features()) or missing_driver(spec)
        if why is not None:
            entry["runtime"][target] = {"not_run": why}
        else:
            runnable.append((target, index_path))

    # -- runtime, each target in a process of its own
    outputs = {}
    if s.runtime:
        for target, index_path in runnable:
            result, output = work / f"runtime.{target}.json", work / f"runtime.{target}.npy"
            cmd = [str(s.toolchain_python), "-m", "dsa.tools.scale", "--runtime-child", str(index_path),
                   "--runs", str(s.runs), "--threads", str(s.threads), "--result", str(result), "--output", str(output)]
            with heavy_lock(s.lock, f"{subject.key}: runtime {target}", log):
                log(f"dsa scale: {subject.key}: runtime {target} (1 + {s.runs} calls) …")
                try:
                    entry["runtime"][target] = run_child(cmd, env, result, f"{subject.key}: runtime {target}")
                    outputs[target] = output
                except DsaError as e:
                    entry["runtime"][target] = {"error": str(e)[:500]}
                    entry["notes"].append(f"runtime {target}: {e}")
    else:
        for target, _ in runnable:
            entry["runtime"][target] = {"not_run": "--no-runtime"}

    # -- eager, in the subject's environment
    entry["eager"] = None
    if s.eager:
        record_rel = ModuleIndex.read(out_dir / f"{targets[0]}.modules.json").modules
        smallest = min(record_rel, key=lambda m: (read_json(out_dir / m[1]).get("bucket") or {}).get("size", 0))
        needed = eager_weight_bytes(record, int(entry["checkpoint_parameters"] or 0))
        available = memory_total_bytes() - EAGER_MEMORY_MARGIN_BYTES
        if needed > available:
            entry["eager"] = {"not_run": f"its weights alone need {needed / 2**30:.1f} GiB; this machine has "
                                         f"{memory_total_bytes() / 2**30:.1f} GiB"}
        else:
            result, output = work / "eager.json", work / "eager.npy"
            cmd = [str(python), "-m", "dsa.tools.scale", "--eager-child", subject.framework,
                   str(out_dir / smallest[1]), "--flow-steps", str(manifest.get("flow_steps") or 0),
                   "--runs", str(s.runs), "--threads", str(s.threads), "--result", str(result),
                   "--output", str(output)]
            if subject.framework == "lerobot":
                cmd += ["--policy-dir", str(Path(checkpoint).parent)]
            else:
                cmd += ["--view", str(view_file), "--checkpoint", str(checkpoint)]
            with heavy_lock(s.lock, f"{subject.key}: eager", log):
                log(f"dsa scale: {subject.key}: eager {subject.framework} (1 + {s.runs} calls) …")
                try:
                    entry["eager"] = run_child(cmd, env, result, f"{subject.key}: eager")
                except DsaError as e:
                    entry["eager"] = {"error": str(e)[:500]}
                    entry["notes"].append(f"eager: {e}")
            if output.is_file():
                import numpy as np

                want = np.load(output)
                for target, path in outputs.items():
                    entry["runtime"][target]["error_vs_eager"] = _relative_error(np.load(path), want)
    else:
        entry["eager"] = {"not_run": "--no-eager"}

    # -- the design before weightless building (sweeps, small and medium only)
    if subject.old_design:
        entry["old_design"] = measure_old_design(subject, s, work, python, env, view_file, config, manifest_file)

    if not s.keep:
        shutil.rmtree(work, ignore_errors=True)
    return entry


def _portable(args: Sequence[str], work: Path, root: Path) -> List[str]:
    """A command's arguments as the docs show them: scratch paths as <scratch>/..., the checkout's relative."""
    shown = []
    for arg in args:
        if arg.startswith(str(work)):
            arg = "<scratch>" + arg[len(str(work)):]
        elif arg == str(root):
            arg = "."
        elif arg.startswith(str(root) + os.sep):
            arg = arg[len(str(root)) + 1:]
        shown.append(arg)
    return shown


def without_work(text: str, work: Path) -> str:
    return text.replace(str(work), "<scratch>")


def _shown_command(args: Sequence[str]) -> str:
    """shlex.join, leaving <scratch>/... unquoted (it is a placeholder, not a shell redirection to run)."""
    return " ".join(a if re.fullmatch(r"[\w@%+=:,./<>-]+", a) else shlex.quote(a) for a in args)


def measure_old_design(subject: Subject, s: Settings, work: Path, python: Path, env: dict, view_file: Path,
                       config: Optional[Path], manifest_file: Path) -> dict:
    """LeRobot's own initialisation as the stand-in, and the export with weights materialised."""
    from dsa.core.fileio import write_json_atomic
    from dsa.manifest.contract import load_manifest, project

    log = s.log
    old = {}
    old_dir = work / "old_design"
    old_dir.mkdir(parents=True, exist_ok=True)
    if subject.framework == "lerobot":
        cmd = stand_in_command(python, {"generator": "lerobot", "weights": "lerobot", "dtype": "float32"},
                               out=old_dir / "policy", config=config)
        with heavy_lock(s.lock, f"{subject.key}: old stand-in", log):
            log(f"dsa scale: {subject.key}: stand-in, old design (LeRobot's init, float32) …")
            try:
                made = run_stage(cmd, env, f"{subject.key}: old-design stand-in")
                old["stand-in"] = {"wall_s": round(made["wall_s"], 3), "peak_rss_kib": made["peak_rss_kib"],
                                   "how": "LeRobot's random initialisation and save_pretrained (float32)"}
            except DsaError as e:
                old["stand-in"] = {"error": str(e)[:500]}
        shutil.rmtree(old_dir / "policy", ignore_errors=True)
    # The export view of the pinned manifest (the config's pin must be the one passed).
    view = old_dir / "export_view.json"
    write_json_atomic(view, project(load_manifest(manifest_file, known_targets=sorted(
        p.stem for p in (s.root / "toolchains" / "targets").glob("*.json"))), "export"))
    policy_config = work / "stand_in" / "config.json" if subject.framework == "lerobot" else None
    cmd = [str(python), "-m", "dsa.tools.scale", "--old-export-child", str(view), str(old_dir)]
    if policy_config is not None:
        cmd += ["--config", str(policy_config)]
    for p in [str(s.root)] + s.pythonpath:
        cmd += ["--pythonpath", p]
    with heavy_lock(s.lock, f"{subject.key}: old export", log):
        log(f"dsa scale: {subject.key}: export, old design (weights materialised) …")
        try:
            made = run_stage(cmd, env, f"{subject.key}: old-design export")
            old["export"] = {"wall_s": round(made["wall_s"], 3), "peak_rss_kib": made["peak_rss_kib"],
                             "how": "export_model(..., weightless=False): the model built with its weights"}
        except DsaError as e:
            old["export"] = {"error": str(e)[:500]}
    return old


def _env_name(python: Path, s: Settings) -> str:
    if s.lerobot_python is not None and Path(python) == Path(s.lerobot_python):
        return "LeRobot environment"
    return "toolchain environment"


# -- the data file --------------------------------------------------------------------------------------------
def machine(threads: int) -> dict:
    from dsa.runtime.host import host_cpu_features, host_cpu_model

    flags = host_cpu_features() or []
    return {"cpu": host_cpu_model(), "cores": len(os.sched_getaffinity(0)), "threads": threads,
            "memory_gib": round(memory_total_bytes() / 2 ** 30, 1), "avx512": "avx512f" in flags,
            "system": f"{platform.system()} {platform.release()}",
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def toolchain(lerobot_python: Optional[Path]) -> dict:
    from importlib import metadata

    versions = {}
    for package in ("iree-base-compiler", "iree-base-runtime", "iree-turbine", "torch"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    if lerobot_python is not None and Path(lerobot_python).exists():
        code = ("import json; from importlib import metadata as m; "
                "print(json.dumps({p: m.version(p) for p in ('lerobot', 'torch', 'transformers')}))")
        try:
            proc = subprocess.run([str(lerobot_python), "-c", code], capture_output=True, text=True, timeout=120)
            versions["lerobot environment"] = json.loads(proc.stdout)
        except (subprocess.SubprocessError, ValueError):
            pass
    return versions


def merge(data: Optional[dict], entries: Sequence[dict], sweeps: Sequence[str], toolchain_versions: dict) -> dict:
    """The data file with `entries` put in place of the same keys (new keys at the end)."""
    data = dict(data or {"format": DATA_FORMAT, "subjects": [], "sweeps": {}})
    if data.get("format") != DATA_FORMAT:
        raise DsaError("docs/real-size.json", f"format {data.get('format')!r} is not {DATA_FORMAT}",
                       "measure again into a new file")
    subjects = list(data.get("subjects", []))
    keys = [e["key"] for e in subjects]
    for entry in entries:
        if entry["key"] in keys:
            subjects[keys.index(entry["key"])] = entry
        else:
            subjects.append(entry)
            keys.append(entry["key"])
    data["subjects"] = subjects
    data["sweeps"] = dict(data.get("sweeps", {}))
    for name in sweeps:
        sweep = SWEEPS[name]
        data["sweeps"][name] = {"recipe": sweep["recipe"], "old_design": sweep["old_design"],
                                "points": [{"size": p["size"], "key": p["key"], "config": p["config"],
                                            "variants": p["variants"]} for p in sweep["points"]]}
    if entries:
        data["date"] = time.strftime("%Y-%m-%d")
        data["toolchain"] = toolchain_versions
    return data
