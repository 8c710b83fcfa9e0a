"""What is measured of a row: the iree-compile re-run (time, peak RSS), latency, the import from the
source file, and the benchmark's and `dsa scale`'s measurements matched by vmfb sha256; `collect`."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError
from dsa.core.fileio import read_json
from dsa.core.formats import CompileReport, ExportRecord
from dsa.runtime.host import check_host
from dsa.tools.measure import run_measured
from dsa.tools.import_matrix.models import (
    ModelSpec, Unit, collect_files, module_units, parse_test_result, read_unit, test_xml_dir)


DATA_FORMAT = 1


# -- measurement: compile time and peak RSS ----------------------------------------------------------------


def measure_compile(module: dict, work: Path, where: str) -> dict:
    """Re-runs iree-compile on a module's built MLIR with exactly its compile report's flags; compares bytes."""
    from dsa.stages.compile import first_error_line, iree_compile_path  # the build's own compiler binary and error digest
    from dsa.core.fileio import sha256_file

    report = CompileReport.read(module["report"])
    mlir_sha = sha256_file(module["mlir"])
    if report.get("mlir_sha256") not in (None, mlir_sha):
        raise DsaError(where, f"{module['mlir'].name} is not the MLIR its compile report names "
                       f"({mlir_sha[:12]} vs {report['mlir_sha256'][:12]})", "rebuild the model")
    out = work / "rerun.vmfb"
    cmd = [iree_compile_path(), str(module["mlir"]), *report["flags"], "-o", str(out)]
    result = run_measured(cmd)
    if result["returncode"] != 0:
        raise DsaError(where, f"iree-compile failed on re-run: {first_error_line(result['stderr']).strip()}",
                       f"reproduce with: {shlex.join(cmd)}")
    built = module["vmfb"].read_bytes()
    rerun = out.read_bytes()
    return {
        "compile_s": result["wall_s"],
        "peak_rss_kib": result["peak_rss_kib"],
        "identical": built == rerun,
        "vmfb_sha256": sha256_file(out),
        "built_sha256": report.get("vmfb_sha256"),
        "flags": report["flags"],
    }


# -- measurement: latency ------------------------------------------------------------------------------------
def sample_sizes(record: dict) -> Dict[str, int]:
    """Sizes of the named dims for the benchmark: each dynamic dim at its smallest size (the bucketed dim of a
    bucketed module stays at its bucket)."""
    return {dim: int(bounds.get("min", 1)) for dim, bounds in (record.get("dynamic_dims") or {}).items()}


def sample_values(record: dict, flow_steps: Optional[int]) -> Tuple[dict, str]:
    """Deterministic inputs for a record (dsa.runtime.policy.sample_inputs, the export's example seed) and a short
    description ("batch=1, steps=10"); the step-count input (an integer scalar with a value range) at
    flow_steps, clamped to its range."""
    import numpy as np

    from dsa.runtime.policy import sample_inputs

    sizes = sample_sizes(record)
    values = sample_inputs(record, sizes, np.random.default_rng(0))
    described = [f"{dim}={size}" for dim, size in sorted(sizes.items())]
    if record.get("bucket"):
        described.insert(0, f"{record['bucket']['dim']}={record['bucket']['size']}")
    for spec in record["inputs"]:
        if "value_range" in spec and flow_steps is not None:
            lo, hi = spec["value_range"]
            steps = min(max(int(flow_steps), lo), hi)
            values[spec["name"]] = np.array(steps, dtype=spec["dtype"])
            described.append(f"{spec['name']}={steps}")
    return values, ", ".join(described)


def benchmark_command(vmfb: Path, *, driver: str, irpa: Path, scope: str, function: str, inputs: Sequence[str],
                      runs: int, threads: int, runtime_flags: Sequence[str] = ()) -> List[str]:
    from dsa.tools.profiler import runtime_tool_path  # iree-base-runtime's own tools, as dsa-profile finds them

    return [runtime_tool_path("iree-benchmark-module"), f"--module={vmfb}", f"--device={driver}",
            f"--parameters={scope}={irpa}", f"--function={function}", *inputs,
            f"--task_topology_max_group_count={threads}", *runtime_flags,
            "--benchmark_min_time=1x", f"--benchmark_repetitions={runs}",
            "--benchmark_report_aggregates_only=false", "--benchmark_format=json"]


def parse_benchmark(stdout: str) -> List[float]:
    """Per-repetition wall times (ms) from iree-benchmark-module's google-benchmark JSON."""
    data = json.loads(stdout[stdout.index("{"):])
    samples = []
    for b in data["benchmarks"]:
        if b.get("error_occurred"):
            raise ValueError(b.get("error_message", "benchmark error"))
        if b.get("run_type", "iteration") != "iteration":
            continue
        unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
        samples.append(float(b["real_time"]) * unit)
    if not samples:
        raise ValueError("no timed repetitions")
    return samples


def measure_latency(unit: Unit, module: dict, work: Path, *, runs: int, threads: int, where: str) -> dict:
    from dsa.tools.profiler import benchmark_input_flags

    record = ExportRecord.read(module["record"])
    runtime_view = json.loads((unit.base / unit.index["runtime_view"]).read_text())
    target_spec = json.loads((unit.base / unit.index["target_spec"]).read_text())
    check_host(target_spec, where)  # a build for a CPU this machine lacks would die of SIGILL
    values, described = sample_values(record, runtime_view.get("flow_steps"))
    described = described or "static shapes"
    specs = [argparse.Namespace(name=s["name"], dtype=s["dtype"]) for s in record["inputs"]]
    inputs = benchmark_input_flags(specs, values, work)
    irpa = unit.base / unit.index["parameter_archive"]
    common = dict(driver=target_spec["runtime_driver"], irpa=irpa, scope=unit.index["parameter_scope"],
                  function=record.get("function", "main"), inputs=inputs, threads=threads,
                  runtime_flags=unit.index.get("runtime_flags", []))
    # One process: the first repetition (parameter upload, cold caches) is the warm-up and is dropped.
    cmd = benchmark_command(module["vmfb"], runs=runs + 1, **common)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        samples = parse_benchmark(proc.stdout)[1:]
        if proc.returncode != 0 or not samples:
            raise ValueError(f"exit status {proc.returncode}")
    except (ValueError, KeyError) as e:
        lines = (proc.stderr + "\n" + proc.stdout).strip().splitlines() or [str(e)]
        message = next((l for l in lines if "error" in l.lower()), lines[-1])
        raise DsaError(where, f"iree-benchmark-module failed: {message.strip()[:300]}",
                       f"reproduce with: {shlex.join(cmd)}") from None
    return {"latency_ms": statistics.median(samples), "latency_runs": len(samples), "threads": threads,
            "driver": target_spec["runtime_driver"], "inputs": described}


def read_bench_latencies(path: Path) -> Dict[str, dict]:
    """The benchmark's timings (bench/results.json, `bazel run //bench`) by the sha256 of the vmfb timed: for
    each module, its median call and eager's in the same alternating rounds, the case, the run's date and
    call count. A LeRobot policy is its shipped module; a project model is the bench's tuned build (its last,
    longest case). Results from before the bench recorded hashes give nothing: they cannot be matched."""
    if not path.is_file():
        return {}
    from dsa.core.fileio import read_json

    data = read_json(path)
    common = {"date": data.get("date"), "runs": data.get("runs"), "light": bool(data.get("light")),
              "source": str(path.name)}
    found: Dict[str, dict] = {}

    def add(sha: Optional[str], case: str, runtimes: dict, vmfb_key: str, runs: Optional[int]) -> None:
        if not sha or vmfb_key not in runtimes or "eager" not in runtimes:
            return
        vmfb, eager = runtimes[vmfb_key]["median_ms"], runtimes["eager"]["median_ms"]
        entry = dict(common, case=case, vmfb_ms=vmfb, eager_ms=eager, vs_eager=round(vmfb / eager, 3),
                     runs=runs or common["runs"])
        if "onnxruntime" in runtimes:
            entry["vs_onnxruntime"] = round(vmfb / runtimes["onnxruntime"]["median_ms"], 3)
        found[sha] = entry

    for policy in data.get("policies", []):
        if "runtimes" in policy:
            add(policy.get("vmfb_sha256"), policy.get("case", ""), policy["runtimes"], "vmfb",
                policy["runtimes"].get("vmfb", {}).get("runs"))
    for model in data.get("models", []):
        tuned = (model.get("variants") or {}).get("tuned") or {}
        if model.get("cases"):
            case = model["cases"][-1]
            add(tuned.get("vmfb_sha256"), case["case"], case["runtimes"], "vmfb:tuned",
                case["runtimes"].get("vmfb:tuned", {}).get("runs"))
    return found


def attach_bench(row: dict, unit: Unit, bench: Dict[str, dict]) -> None:
    """row["bench"]: the benchmark's timing of the row's measured module (the smallest bucket), if it has one."""
    from dsa.core.fileio import sha256_file

    row["bench"] = None
    if bench and unit.modules and unit.modules[0]["vmfb"].is_file():
        row["bench"] = bench.get(sha256_file(unit.modules[0]["vmfb"]))


# Where `dsa scale` keeps its measurements (dsa/tools/scale/).
REAL_SIZE_RESULTS = "docs/real-size.json"


def read_scale_results(path: Path) -> Dict[str, dict]:
    """`dsa scale`'s measurements (docs/real-size.json) by the sha256 of each vmfb it built: the runtime at
    batch 1 on that module's target (median call, first call, peak RSS, its ratio to eager), and the whole
    `dsa compile --no-cache` (wall time, the largest stage peak and its stage; the stand-in is not an import
    stage). The runtime ran the smallest bucket, the import matrix's measured module."""
    if not path.is_file():
        return {}
    data = read_json(path)
    found: Dict[str, dict] = {}
    for subject in data.get("subjects", []):
        stages = [s for s in subject.get("stages", []) if s["stage"] != "stand-in"]
        peak = max(stages, key=lambda s: s["peak_rss_kib"]) if stages else None
        eager = subject.get("eager") or {}
        for target, modules in (subject.get("modules") or {}).items():
            runtime = (subject.get("runtime") or {}).get(target) or {}
            for i, module in enumerate(modules):
                entry = {"key": subject["key"], "date": subject.get("date", "")[:10], "target": target,
                         "source": path.name, "module": module["vmfb"]}
                if peak is not None and subject.get("import_s") is not None:
                    entry.update(import_s=subject["import_s"], import_peak_rss_kib=peak["peak_rss_kib"],
                                 import_peak_stage=peak["stage"])
                if i == 0 and "median_ms" in runtime:  # the module the runtime ran
                    entry.update(latency_ms=runtime["median_ms"], latency_runs=runtime.get("runs"),
                                 first_call_ms=runtime.get("first_call_ms"), vmhwm_kib=runtime.get("vmhwm_kib"),
                                 inputs=runtime.get("inputs"))
                    if eager.get("median_ms"):
                        entry["vs_eager"] = round(runtime["median_ms"] / eager["median_ms"], 3)
                elif i == 0 and runtime:
                    entry["not_run"] = runtime.get("not_run") or "failed"
                found[module["sha256"]] = entry
    return found


def attach_scale(row: dict, unit: Unit, scale: Dict[str, dict]) -> None:
    """row["scale"]: `dsa scale`'s measurement of the row's measured module (the smallest bucket), if any; the
    row is a real-size row (its latency is never measured here)."""
    from dsa.core.fileio import sha256_file

    row["real_size"] = True
    row["scale"] = None
    if scale and unit.modules and unit.modules[0]["vmfb"].is_file():
        row["scale"] = scale.get(sha256_file(unit.modules[0]["vmfb"]))


def _resolve(short_path: str, bin_dir: Path, workspace: Path) -> Path:
    """A runfiles short path from the policies index: a generated file (bin_dir), a source file (bin_dir under
    `bazel run`, else the workspace), or `../<repo>/...` in an external repository (the runfiles tree's
    sibling, or the output base's external/ beside bazel-bin)."""
    if short_path.startswith("../"):
        rest = short_path[3:]
        resolved = bin_dir.resolve()
        candidates = [bin_dir.parent / rest, bin_dir / "external" / rest]
        if len(resolved.parents) > 4:
            candidates.append(resolved.parents[4] / "external" / rest)  # output_base/execroot/_main/bazel-out/<cfg>/bin
    else:
        candidates = [bin_dir / short_path, workspace / short_path]
    return next((c for c in candidates if c.exists()), candidates[0])


def import_command(source: dict, out: Path, bin_dir: Path, workspace: Path) -> List[str]:
    """`dsa compile --no-cache` of one policy from the files its build used, in its build's Python environment."""
    python = _resolve(source["python"], bin_dir, workspace) if source.get("python") else Path(sys.executable)
    root = bin_dir if (bin_dir / "toolchains" / "targets").is_dir() else workspace
    cmd = [str(python), "-m", "dsa", "compile", "--manifest", str(_resolve(source["manifest"], bin_dir, workspace)),
           "--out", str(out), "--checkpoint", str(_resolve(source["checkpoint"], bin_dir, workspace)),
           "--targets-dir", str(root / "toolchains" / "targets"), "--tuning-dir", str(root / "toolchains" / "tuning"),
           "--pythonpath", str(root)]
    if source.get("policy_config"):
        cmd += ["--policy-config", str(_resolve(source["policy_config"], bin_dir, workspace))]
    if source.get("model_file"):  # frameworks onnx, stablehlo: the file the build imported
        cmd += ["--model-file", str(_resolve(source["model_file"], bin_dir, workspace))]
    # Every stage run, none taken from the compile cache: the time is an import's, not a cache hit's.
    return cmd + ["--no-cache"]


def measure_import(source: dict, bin_dir: Path, workspace: Path, work: Path, where: str) -> dict:
    """Import→vmfb: `dsa compile` of the policy, its wall time and the largest peak RSS of its stages."""
    import dsa

    out = work / "import"
    cmd = import_command(source, out, bin_dir, workspace)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(dsa.__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    result = run_measured(cmd, env=env)
    timings = out / "timings.json"
    if result["returncode"] != 0 or not timings.is_file():
        lines = [l for l in result["stderr"].strip().splitlines() if l.strip()] or [f"exit {result['returncode']}"]
        raise DsaError(where, f"dsa compile failed: {lines[-1].strip()[:300]}",
                       f"reproduce with: {shlex.join(cmd)}")
    data = json.loads(timings.read_text())
    return {"import_s": result["wall_s"], "import_peak_rss_kib": data["peak_rss_kib"],
            "import_peak_stage": data["peak_stage"]}


def measure_row(row: dict, unit: Unit, *, runs: int, threads: int, latency: bool = True) -> None:
    """Adds the measured cells to `row` (one module: the smallest bucket); failures become notes. The latency
    is not measured again where the benchmark timed this module (row["bench"]), nor without `latency` (a
    real-size row: its latency comes from docs/real-size.json, row["scale"])."""
    if not row["compile"] or not row["export"]:
        return
    module = unit.modules[0]
    name = module["vmfb"].name[: -len(".vmfb")]
    where = f"//models:{unit.name} ({name})"
    row["measured"] = {"module": name}
    with tempfile.TemporaryDirectory(prefix="dsa-import-matrix-") as tmp:
        try:
            row["measured"].update(measure_compile(module, Path(tmp), where))
        except DsaError as e:
            row["notes"].append(f"compile re-run: {e}")
        if row.get("bench") or not latency:
            return
        try:
            row["measured"].update(measure_latency(unit, module, Path(tmp), runs=runs, threads=threads,
                                                   where=where))
        except DsaError as e:
            row["notes"].append(f"latency: {e}")


def collect(models: Sequence[ModelSpec], bin_dir: Path, testlogs: Path, *, measure: bool, runs: int,
            threads: int, log=print, sources: Optional[Dict[str, dict]] = None,
            workspace: Optional[Path] = None, bench: Optional[Dict[str, dict]] = None,
            scale: Optional[Dict[str, dict]] = None) -> List[dict]:
    """The table's rows; with `measure`, each built module measured, and, for the policies in `sources`
    (read_import_sources), `dsa compile` timed from their manifest and checkpoint. `bench`
    (read_bench_latencies) gives the latency of the modules the benchmark timed. `scale`
    (read_scale_results; real-size rows): latency and import→vmfb from `dsa scale`, never measured here."""
    sources = sources or {}
    rows = []
    for spec in models:
        test = parse_test_result(test_xml_dir(testlogs, spec.test))
        for name in module_units(spec, bin_dir):
            unit = read_unit(bin_dir, name)
            row = collect_files(spec, unit, test)
            attach_bench(row, unit, bench or {})
            if scale is not None:
                attach_scale(row, unit, scale)
            if measure and unit.index is not None:
                log(f"dsa-import-matrix: //models:{name} …")
                measure_row(row, unit, runs=runs, threads=threads, latency=scale is None)
                if name in sources and row["measured"] is not None:
                    log(f"dsa-import-matrix: //models:{name}: dsa compile (import→vmfb) …")
                    with tempfile.TemporaryDirectory(prefix="dsa-import-matrix-import-") as tmp:
                        try:
                            row["measured"].update(measure_import(sources[name], bin_dir,
                                                                  workspace or bin_dir, Path(tmp),
                                                                  f"//models:{name}"))
                        except DsaError as e:
                            row["notes"].append(f"import→vmfb: {e}")
            rows.append(row)
    return rows
