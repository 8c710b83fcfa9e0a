"""dsa-import-matrix: every model × (export, compile, parity, sizes, compile time, peak RSS, latency), generated.

    ./bazelw test //models/...                    # first: the parity cells are the models' own test results
    ./bazelw run //tools:import_matrix [-- --models act,pi0] [--no-measure] [--out-dir DIR] [--runs 10]
    ./bazelw run //tools:import_matrix -- --real-size   # also the real-size policies, as a second table
    bin/dsa import-matrix --real-size-only --real-size-bin DIR   # that table alone; the main one as committed

Writes docs/import-matrix.md (the table, how it was made, machine, CPU, date, command), docs/import-matrix.json
(the collected data the table is rendered from) and the same table into README.md between the lines
`<!-- import-matrix:begin -->` and `<!-- import-matrix:end -->`. Nothing in the table is typed by hand:

  export / compile   the module index's export records (and MLIR) / vmfbs are present in the build outputs
  parity             the model's Bazel test (bazel-testlogs/<pkg>/<test>/test.xml): passed, failed or not run
  vmfb, MLIR         summed over the model's modules (one per shape bucket); irpa: the parameter archive
  params             parameter_count of the export record
  compile, peak RSS  measured here: `iree-compile` re-run on one module's built MLIR with exactly the flags of
                     its compile report, in a child process whose peak RSS is its wait4 rusage (ru_maxrss);
                     the re-run's vmfb must be byte-identical to the built one (a mismatch is reported loudly
                     and makes the command fail after writing)
  import→vmfb        measured here: `dsa compile` of the model (its manifest, checkpoint and, for LeRobot, policy
                     config from the build, in the model's own Python environment) into a scratch directory: the
                     whole run's wall time and the largest peak RSS of its stages (each a process of its own;
                     the stage named), from its timings.json (--no-import skips it)
  latency            from the benchmark's own runs where it timed this very module (bench/results.json, matched by
                     the vmfb's sha256: the median vmfb call there, and its ratio to eager PyTorch / LeRobot);
                     otherwise measured here: `iree-benchmark-module` on the module's built vmfb and the
                     parameter archive, with deterministic sample inputs from its export record (dsa.runtime.
                     policy.sample_inputs; dynamic dims at their smallest size, bucketed dims at the module's
                     bucket, the step-count input at the manifest's flow_steps); median of --runs single-call
                     repetitions after one warm-up call

The measured module is the smallest bucket of a bucketed model (the module the runtime picks for the shortest
input). A split policy (dsa_pipeline, e.g. //models:groot) gets one row per stage. `--no-measure` renders from
the build and test outputs alone (the measured cells then read "not measured").

Real sizes (`--real-size`): the policies of //models:policies_real_size_index (tagged real_size, built by hand:
`bazel build //models:policies_real_size_index //models:pi0_full ...`), read from the bin directory they were
built in, get a second table "Real sizes" with the same columns. Their compile re-run is measured here; their
latency and import→vmfb are not (minutes a call, tens of GB): they come from `dsa scale` (docs/real-size.json,
dsa/tools/scale.py), matched by the vmfb's sha256 like the benchmark's: its median runtime call at batch 1 and
its ratio to eager, and its `dsa compile --no-cache` wall time and largest stage peak.

Outputs are read from the runfiles tree under `bazel run` (the models are this binary's data) or from --bin;
test results from the testlogs directory beside the bin directory (or --testlogs), so it works with any
--output_base and with --symlink_prefix=/.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import read_json
from dsa.core.formats import (FILE_FRONT_ENDS, POLICIES_INDEX_FORMAT,  # noqa: F401 (POLICIES_INDEX_FORMAT: API)
                              CompileReport, ExportRecord, PipelineIndex)
from dsa.runtime.host import check_host
from dsa.tools.measure import run_measured

DATA_FORMAT = 1
BEGIN_MARKER = "<!-- import-matrix:begin -->"
END_MARKER = "<!-- import-matrix:end -->"
DEFAULT_RUNS = 10
NOT_RUN = "not run"
MISSING = "–"
NOT_MEASURED = "not measured"


# -- the models --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model of models/BUILD.bazel: its dsa_vmfb (or dsa_pipeline) name and the test that checks parity."""

    name: str
    test: str                         # Bazel label of the parity test
    stages: Tuple[str, ...] = ()      # a dsa_pipeline: its stages (dsa_vmfb names) when no pipeline.json is built

    @property
    def is_pipeline(self) -> bool:
        return bool(self.stages)


# The policies index //models:policies_index writes (dsa_policies: discovered from the dsa_policy targets of
# models/BUILD.bazel, never listed by hand). Row order: the policies in BUILD order, then the pipelines; a
# policy that is a pipeline's stage is part of the pipeline's row.
POLICIES_INDEX = "models/policies_index.json"
# The real-size policies (tagged real_size: manual targets), indexed apart by the same dsa_policies call.
POLICIES_REAL_SIZE_INDEX = "models/policies_real_size_index.json"


def read_import_sources(bin_dir: Path) -> Dict[str, dict]:
    """Per policy (dsa_vmfb name): what `dsa compile` needs to build it without Bazel — its manifest,
    checkpoint, policy_config, model_file and python (None: the toolchain's) — as the policies index gives
    them."""
    index = json.loads((bin_dir / POLICIES_INDEX).read_text())
    return {p["name"]: p for p in index["policies"] if "manifest" in p}


def read_models(bin_dir: Path, index_file: str = POLICIES_INDEX) -> List[ModelSpec]:
    """The table's rows, from the policies index (or the real-size index, `index_file`) under `bin_dir`."""
    path = bin_dir / index_file
    if not path.is_file():
        target = "//models:" + Path(index_file).stem
        raise DsaError(str(path), "no policies index", f"build it: `./bazelw build {target}` "
                       + ("(it builds no model; build the real-size policies themselves by hand)"
                          if index_file == POLICIES_REAL_SIZE_INDEX else
                          "(or run `./bazelw run //tools:import_matrix`, which builds every policy)"))
    index = json.loads(path.read_text())
    if index.get("format") != POLICIES_INDEX_FORMAT:
        raise DsaError(str(path), f"policies index format {index.get('format')!r} is not supported",
                       f"this release reads format {POLICIES_INDEX_FORMAT}; rebuild //models:policies_index")
    staged = {stage for p in index["pipelines"] for stage in p["stages"]}
    rows = [ModelSpec(p["name"], p["test"]) for p in index["policies"] if p["name"] not in staged]
    rows += [ModelSpec(p["name"], p["test"], stages=tuple(p["stages"])) for p in index["pipelines"]]
    return rows


# -- test results --------------------------------------------------------------------------------------------
def test_xml_dir(testlogs: Path, label: str) -> Path:
    """bazel-testlogs/<pkg>/<name> for `//pkg:name`."""
    package, _, name = label.lstrip("/").partition(":")
    return testlogs / package / name


def parse_test_result(test_dir: Path) -> dict:
    """A Bazel test's result from its test.xml files (one per shard/run): {"status": "passed" | "failed" |
    "not run", "tests", "failures", "skipped", "date"}. JUnit XML as pytest writes it, or as Bazel writes it for
    a test that wrote none (a crash or timeout: one failed testcase)."""
    files = sorted(test_dir.rglob("test.xml")) if test_dir.is_dir() else []
    if not files:
        return {"status": NOT_RUN, "tests": 0, "failures": 0, "skipped": 0, "date": None}
    tests = failures = skipped = 0
    for path in files:
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError as e:
            raise DsaError(str(path), f"is not readable JUnit XML: {e}", "re-run the test") from None
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        for suite in suites:
            cases = list(suite.iter("testcase"))
            if cases:
                tests += len(cases)
                failures += sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
                skipped += sum(1 for c in cases if c.find("skipped") is not None)
            else:
                tests += int(suite.get("tests", 0) or 0)
                failures += int(suite.get("failures", 0) or 0) + int(suite.get("errors", 0) or 0)
                skipped += int(suite.get("skipped", 0) or 0)
    date = datetime.datetime.fromtimestamp(max(p.stat().st_mtime for p in files)).strftime("%Y-%m-%d %H:%M")
    status = "passed" if tests > 0 and failures == 0 else "failed"
    return {"status": status, "tests": tests, "failures": failures, "skipped": skipped, "date": date}


# -- build outputs -------------------------------------------------------------------------------------------
def _mlir_of(record: Path) -> Path:
    """The MLIR a module was compiled from: dsa_model's M/model.mlir beside M/export_record.json, or dsa_bucket's
    B/<stem>.mlir beside B/<stem>.export_record.json."""
    if record.name == "export_record.json":
        return record.parent / "model.mlir"
    return record.parent / (record.name[: -len(".export_record.json")] + ".mlir")


def _report_of(vmfb: Path) -> Path:
    """dsa_vmfb's compile report beside each vmfb: X/<stem>.compile_report.json."""
    return vmfb.parent / (vmfb.name[: -len(".vmfb")] + ".compile_report.json")


def _size(path: Path) -> Optional[int]:
    return path.stat().st_size if path.is_file() else None


def _sum(values: Sequence[Optional[int]]) -> Optional[int]:
    return None if not values or any(v is None for v in values) else sum(values)


def module_units(spec: ModelSpec, bin_dir: Path) -> List[str]:
    """The dsa_vmfb names behind one model: itself, or a pipeline's stages (from its pipeline.json if built)."""
    if not spec.is_pipeline:
        return [spec.name]
    pipeline = bin_dir / "models" / f"{spec.name}.pipeline.json"
    if pipeline.is_file():
        return [stage["name"] for stage in PipelineIndex.read(pipeline)["stages"]]
    return list(spec.stages)


@dataclasses.dataclass
class Unit:
    """The build outputs of one dsa_vmfb, as its module index names them."""

    name: str
    index: Optional[dict]
    base: Path
    modules: List[dict]  # {"vmfb", "record", "mlir", "report"} as paths; the smallest bucket first


def read_unit(bin_dir: Path, name: str) -> Unit:
    from dsa.runtime.policy import read_module_index

    base = bin_dir / "models"
    path = base / f"{name}.modules.json"
    if not path.is_file():
        return Unit(name, None, base, [])
    index = read_module_index(path)
    modules = []
    for m in index["modules"]:
        vmfb, record = base / m["vmfb"], base / m["record"]
        modules.append({"vmfb": vmfb, "record": record, "mlir": _mlir_of(record), "report": _report_of(vmfb)})

    def bucket_size(m: dict) -> int:
        # As CompiledPolicy orders its modules: smallest bucket first.
        if not m["record"].is_file():
            return 0
        bucket = ExportRecord.read(m["record"]).get("bucket")
        return bucket["size"] if bucket else 0

    modules.sort(key=bucket_size)
    return Unit(name, index, base, modules)


# The manifest's framework → how the model reached IREE (docs/frontends.md).
FRONT_ENDS = {
    "pytorch": "torch.export",
    "lerobot": "LeRobot → torch.export",
    **{f.name: f.label for f in FILE_FRONT_ENDS.values()},
}


def front_end_of(base: Path, name: str) -> Optional[str]:
    """The framework of a dsa_vmfb's model, from its export view (`<name>_model/export_view.json`)."""
    view = base / f"{name}_model" / "export_view.json"
    if not view.is_file():
        return None
    return read_json(view).get("framework", "pytorch")


def collect_files(spec: ModelSpec, unit: Unit, test: dict) -> dict:
    """One table row from the build and test outputs alone (nothing measured)."""
    front_end = front_end_of(unit.base, unit.name)
    if front_end is None and unit.modules:
        # A build for a further target (<name>_<target>) shares its policy's model: <policy>_model/.
        stem = unit.modules[0]["record"].parent.name
        for suffix in ("_buckets", "_model"):
            if stem.endswith(suffix):
                front_end = front_end_of(unit.base, stem[: -len(suffix)])
    row = {
        "model": spec.name, "module": unit.name, "label": f"//models:{unit.name}", "test": spec.test,
        "front_end": front_end,
        "pipeline": spec.name if spec.is_pipeline else None,
        "parity": test, "modules": len(unit.modules), "built": unit.index is not None,
        "export": False, "compile": False, "vmfb_bytes": None, "mlir_bytes": None, "irpa_bytes": None,
        "parameter_count": None, "target": None, "measured": None, "notes": [],
    }
    if unit.index is None:
        # Not built (or not among this binary's data): the export stage may still have run on its own.
        record = unit.base / f"{unit.name}_model" / "export_record.json"
        row["export"] = record.is_file() and _mlir_of(record).is_file()
        if row["export"]:
            row["parameter_count"] = ExportRecord.read(record).get("parameter_count")
            row["mlir_bytes"] = _size(_mlir_of(record))
        row["notes"].append(f"{unit.name}.modules.json not found: not built")
        return row
    records = [m["record"] for m in unit.modules]
    row["export"] = bool(records) and all(p.is_file() and m["mlir"].is_file()
                                          for p, m in zip(records, unit.modules))
    row["compile"] = bool(unit.modules) and all(m["vmfb"].is_file() and m["report"].is_file()
                                                for m in unit.modules)
    row["vmfb_bytes"] = _sum([_size(m["vmfb"]) for m in unit.modules])
    row["mlir_bytes"] = _sum([_size(m["mlir"]) for m in unit.modules])
    row["irpa_bytes"] = _size(unit.base / unit.index["parameter_archive"])
    row["target"] = unit.index.get("target")
    if records and records[0].is_file():
        row["parameter_count"] = ExportRecord.read(records[0]).get("parameter_count")
    return row


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


# Where `dsa scale` keeps its measurements (dsa/tools/scale.py).
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


# -- rendering (pure functions of the collected data) -------------------------------------------------------
def fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return MISSING
    if n < 1000:
        return f"{n} B"
    if n < 1000 ** 2:
        return f"{n / 1000:.1f} kB"
    if n < 1000 ** 3:
        return f"{n / 1000 ** 2:.{2 if n < 10 * 1000 ** 2 else 1}f} MB"
    return f"{n / 1000 ** 3:.2f} GB"


def fmt_count(n: Optional[int]) -> str:
    if n is None:
        return MISSING
    if n >= 10 ** 9:
        return f"{n / 1e9:.2f} B"
    if n >= 10 ** 6:
        return f"{n / 1e6:.2f} M"
    if n >= 10 ** 3:
        return f"{n / 1e3:.1f} k"
    return str(n)


def fmt_ms(ms: float) -> str:
    return f"{ms:.0f} ms" if ms >= 1000 else f"{ms:.1f} ms" if ms >= 100 else f"{ms:.2f} ms" if ms >= 1 \
        else f"{ms:.3f} ms"


def fmt_import(measured: dict) -> str:
    """`dsa compile`'s wall time and its largest stage peak RSS: "112 s, 4.9 GiB (export)"."""
    if "import_s" not in measured:
        return NOT_MEASURED
    peak = measured["import_peak_rss_kib"] / 1024
    peak_text = f"{peak / 1024:.1f} GiB" if peak >= 1024 else f"{peak:.0f} MiB"
    return f"{measured['import_s']:.0f} s, {peak_text} ({measured['import_peak_stage']})"


def fmt_bench(bench: dict) -> str:
    """The benchmark's median vmfb call and its ratio to eager (and to ONNX Runtime where it ran)."""
    ratios = f"{bench['vs_eager']:.2f}× eager"
    if "vs_onnxruntime" in bench:
        ratios += f", {bench['vs_onnxruntime']:.2f}× ORT"
    return f"{fmt_ms(bench['vmfb_ms'])} ({ratios})"


def fmt_scale(scale: dict) -> str:
    """`dsa scale`'s median runtime call and its ratio to eager, or why it did not run."""
    if "latency_ms" not in scale:
        return f"not run ({scale['not_run']})" if scale.get("not_run") else NOT_MEASURED
    ms = scale["latency_ms"]
    text = f"{ms / 1000:.1f} s" if ms >= 10_000 else fmt_ms(ms)  # real sizes: seconds a call
    return text + (f" ({scale['vs_eager']:.2f}× eager)" if scale.get("vs_eager") else "")


def _check(ok: bool) -> str:
    return "✓" if ok else "✗"


def fmt_parity(test: dict) -> str:
    if test["status"] == NOT_RUN:
        return NOT_RUN
    if test["status"] == "passed":
        return f"✓ {test['tests']} passed"
    return f"✗ {test['failures']} of {test['tests']} failed"


def row_cells(row: dict) -> List[str]:
    measured = row.get("measured") or {}
    model = row["model"]
    if row.get("pipeline") is not None:  # a stage of a split policy: groot › backbone
        stage = row["module"]
        model += " › " + (stage[len(model) + 1:] if stage.startswith(model + "_") else stage)
    compile_cell = _check(row["compile"])
    if row["compile"] and measured.get("identical") is False:
        compile_cell = "✗ re-run differs"
    if row["compile"] and row["modules"] > 1:
        compile_cell += f" ({row['modules']} modules)"
    bench = row.get("bench")
    if not row["compile"]:
        timing = [MISSING] * 4
    elif measured:
        timing = [f"{measured['compile_s']:.1f} s" if "compile_s" in measured else "failed",
                  f"{measured['peak_rss_kib'] / 1024:.0f} MiB" if "peak_rss_kib" in measured else "failed",
                  fmt_import(measured),
                  fmt_ms(measured["latency_ms"]) if "latency_ms" in measured else "failed"]
    else:
        timing = [NOT_MEASURED] * 4
    if row["compile"] and bench:
        timing[3] = fmt_bench(bench)
    scale = row.get("scale")
    if row["compile"] and row.get("real_size"):
        # Real sizes: latency and import→vmfb from `dsa scale` (docs/real-size.json), never measured here.
        timing[2] = fmt_import(scale) if scale else NOT_MEASURED
        timing[3] = fmt_scale(scale) if scale else NOT_MEASURED
    measured_on = MISSING
    if measured:
        measured_on = measured["module"] + (f" ({measured['inputs']})" if measured.get("inputs") else "")
    if bench:
        module = (row.get("measured") or {}).get("module") or "smallest bucket"
        measured_on = f"{module} (bench {bench['date']}: {bench['case']})"
    if scale and "latency_ms" in scale:
        module = (row.get("measured") or {}).get("module") or "smallest bucket"
        measured_on = f"{module} ({scale['source']} {scale['date']}: {scale.get('inputs') or 'static shapes'})"
    framework = row.get("front_end")
    front_end = FRONT_ENDS.get(framework, framework) if framework else MISSING
    return [f"`{model}`", front_end, _check(row["export"]), compile_cell, fmt_parity(row["parity"]),
            fmt_bytes(row["vmfb_bytes"]), fmt_bytes(row["irpa_bytes"]), fmt_bytes(row["mlir_bytes"]),
            fmt_count(row["parameter_count"]), *timing, measured_on]


HEADER = ["model", "front end", "export", "compile", "parity", "vmfb", "irpa", "MLIR", "params", "compile time", "peak RSS",
          "import→vmfb (peak RSS)", "latency (median)", "measured on"]
_RIGHT = {"vmfb", "irpa", "MLIR", "params", "compile time", "peak RSS", "import→vmfb (peak RSS)",
          "latency (median)"}


def _table(rows: Sequence[dict]) -> List[str]:
    lines = ["| " + " | ".join(HEADER) + " |",
             "|" + "|".join("---:" if h in _RIGHT else "---" for h in HEADER) + "|"]
    return lines + ["| " + " | ".join(row_cells(row)) + " |" for row in rows]


def render_real_size(data: dict) -> List[str]:
    """The second table, "Real sizes" (the real-size policies), when the data has it."""
    real = data.get("real_size")
    if not real:
        return []
    lines = ["", "**Real sizes** (the real-size policies, `--real-size`):", ""] + _table(real["rows"])
    made = (f" Collected {real['date']} by `{real['command']}` on {real['machine']['cpu']} "
            f"({real['machine']['threads']} threads).") if real.get("command") and real.get("machine") else ""
    lines += ["", f"Real sizes: built by hand in {real.get('bin') or 'the bin directory'}; compile time and peak RSS "
                  "measured here as above; import→vmfb and latency from `dsa scale` "
                  f"({real.get('results') or REAL_SIZE_RESULTS}, docs/real-size.md), matched by the vmfb's "
                  "sha256: its `dsa compile --no-cache` of the same manifest and stand-in, and its median runtime "
                  "call at batch 1 with the ratio to eager in the subject's environment." + made]
    notes = [(row, note) for row in real["rows"] for note in row["notes"]]
    if notes:
        lines.append("")
        lines += [f"* `{row['module']}`: {note}" for row, note in notes]
    return lines


def render_table(data: dict) -> str:
    """The matrix as a Markdown table (with a one-line caption naming the machine and the notes), and the
    real-size policies' table after it when the data has them."""
    lines = _table(data["rows"])
    machine = data["machine"]
    caption = (f"Generated {data['date']} by `{data['command']}` on {machine['cpu']} "
               f"({machine['threads']} threads, target {data['target'] or MISSING}); ")
    if data["measure"]:
        caption += ("latency: the benchmark's median call where it timed this very module (bench/results.json, "
                    "matched by sha256; with its ratio to eager in the same alternating rounds), else the median of "
                    f"{data['runs']} `iree-benchmark-module` calls of the measured module; "
                    "compile time and peak RSS: `iree-compile` re-run on its MLIR with its build flags; "
                    "import→vmfb: `dsa compile` of the model from its manifest and checkpoint, with the largest "
                    "peak RSS of its stages and the stage.")
    else:
        caption += ("rendered from build and test outputs only (`--no-measure`); latency where the benchmark "
                    "timed the module (bench/results.json).")
    lines += ["", caption]
    notes = [(row, note) for row in data["rows"] for note in row["notes"]]
    mismatched = [row for row in _all_rows(data) if (row.get("measured") or {}).get("identical") is False]
    for row in mismatched:
        notes.append((row, "**the re-compiled vmfb is not byte-identical to the built one** "
                           f"(built {row['measured']['built_sha256']}, re-run {row['measured']['vmfb_sha256']})"))
    if notes:
        lines.append("")
        lines += [f"* `{row['module']}`: {note}" for row, note in notes]
    lines += render_real_size(data)
    return "\n".join(lines) + "\n"


def _all_rows(data: dict) -> List[dict]:
    return list(data["rows"]) + list((data.get("real_size") or {}).get("rows", []))


def render_document(data: dict) -> str:
    """docs/import-matrix.md: the table, then how it was generated."""
    machine = data["machine"]
    return "\n".join([
        "# Import matrix",
        "",
        "<!-- Generated by dsa/tools/import_matrix.py (`bazel run //tools:import_matrix`): do not edit by hand. -->",
        "",
        "Every model in `models/BUILD.bazel` through the pipeline: its front end (torch.export → iree-turbine, "
        "or an ONNX or StableHLO import) → iree-compile → IREE runtime.",
        "",
        render_table(data),
        "## Columns",
        "",
        "* **front end**: how the model reached IREE, from its manifest's `framework` (docs/frontends.md): "
        "torch.export (pytorch), LeRobot's classes then torch.export (lerobot), IREE's ONNX importer (onnx), "
        "a jax.export StableHLO module (stablehlo).",
        "* **export**: the model's export records and MLIR are in the build outputs (dsa_model / dsa_bucket).",
        "* **compile**: every module the index lists has its vmfb and compile report (dsa_vmfb); "
        "\"re-run differs\" if the re-compiled vmfb is not byte-identical to the built one.",
        "* **parity**: the model's Bazel test (`bazel-testlogs/<pkg>/<test>/test.xml`): the compiled module "
        "against eager PyTorch (or LeRobot). \"not run\" when the test has no result in this output base.",
        "* **vmfb**, **MLIR**: summed over the model's modules (one per shape bucket); **irpa**: the parameter "
        "archive; **params**: the export record's parameter count. kB/MB/GB are powers of 1000.",
        "* **compile time**, **peak RSS**: `iree-compile` re-run on the measured module's MLIR with exactly the "
        "flags of its compile report, as a child process; peak RSS is its `wait4` rusage `ru_maxrss` (MiB; it "
        "includes the ~7 MB that the small launcher process forking it had resident). Wall time on a machine "
        "that may be shared: a rough figure, not a benchmark.",
        "* **import→vmfb (peak RSS)**: `dsa compile` of the model from the same manifest, checkpoint (and LeRobot "
        "policy config) as its build, in its own Python environment, into a scratch directory: the whole run's "
        "wall time (export, parameter archive, bucket exports, compiles for every target the manifest lists), "
        "and the largest peak RSS among its stages, each a process of its own (`timings.json`), with that "
        "stage. Not measured with `--no-import`.",
        "* **latency (median)**: where the benchmark (`./bazelw run //bench`, bench/RESULTS.md) timed this very "
        "module — matched by the vmfb's sha256 in bench/results.json — its median call, with the ratio to eager "
        "PyTorch / LeRobot (and ONNX Runtime) from the same alternating rounds; **measured on** then names the "
        "bench run's date and case. Otherwise `iree-benchmark-module` on the built vmfb and parameter archive: "
        "one untimed call, then the median of single-call repetitions; inputs from "
        "`dsa.runtime.policy.sample_inputs` (seed 0) with the sizes in **measured on** (dynamic dims at their "
        "smallest size, bucketed inputs at the module's bucket, the step-count input at the manifest's "
        "`flow_steps`).",
        "* **measured on**: the module measured (a bucketed model: its smallest bucket) and its input sizes.",
        "* **Real sizes** (`--real-size`): the real-size policies (tagged `real_size`, built by hand), with the same "
        "columns; their **import→vmfb** and **latency** are `dsa scale`'s (docs/real-size.json, docs/real-size.md: "
        "`dsa compile --no-cache` from the same manifest and stand-in, and the module at batch 1 against eager in "
        "the subject's environment), matched by the vmfb's sha256, never measured by this tool (minutes a call).",
        "",
        "## How it was generated",
        "",
        "```sh",
        "./bazelw test //models/...            # the parity cells",
        data["command"],
        "```",
        "",
        f"* date: {data['date']}",
        f"* machine: {machine['cpu']}; {machine['cores']} cores available, {machine['threads']} benchmark "
        f"threads; {machine['system']}; load average {machine['loadavg']} at the start",
        f"* target: {data['target'] or MISSING}; iree-base-compiler {data['toolchain'].get('iree-base-compiler', MISSING)}, "
        f"iree-base-runtime {data['toolchain'].get('iree-base-runtime', MISSING)}",
        f"* latency repetitions: {data['runs']}" if data["measure"] else "* not measured (`--no-measure`)",
        "",
    ])


def replace_marked(text: str, table: str) -> str:
    """`text` with everything between the import-matrix markers replaced by `table`; with no markers, an
    "Import matrix" section is added before README's "## Read next" (else at the end)."""
    block = f"{BEGIN_MARKER}\n{table.rstrip()}\n{END_MARKER}"
    begin, end = text.find(BEGIN_MARKER), text.find(END_MARKER)
    if begin >= 0 and end > begin:
        return text[:begin] + block + text[end + len(END_MARKER):]
    if begin >= 0 or end >= 0:
        raise DsaError("README.md", "has only one of the import-matrix markers",
                       f"put both {BEGIN_MARKER} and {END_MARKER} on lines of their own, or neither")
    section = ("## Import matrix\n\n"
               "Every model through export, compile, parity and the runtime, generated (never typed) by\n"
               "`./bazelw run //tools:import_matrix` after `./bazelw test //models/...`; columns, method and\n"
               "machine: [docs/import-matrix.md](docs/import-matrix.md).\n\n" + block + "\n\n")
    anchor = re.search(r"^## Read next", text, re.M)
    if anchor:
        return text[:anchor.start()] + section + text[anchor.start():]
    return text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"


# -- entry point --------------------------------------------------------------------------------------------
def _script_root() -> Path:
    # Not resolved: under `bazel run` this file is a runfiles symlink, and the runfiles tree holds the outputs.
    return Path(os.path.abspath(__file__)).parents[2]


def workspace_root() -> Path:
    """Where the docs are written: the workspace `bazel run` was called from, else this checkout."""
    return Path(os.environ.get("BUILD_WORKSPACE_DIRECTORY") or Path(__file__).resolve().parents[2])


def _in_runfiles(root: Path) -> bool:
    return any(part.endswith(".runfiles") for part in root.parts)


def default_dirs(root: Path, workspace: Path) -> Tuple[Path, Path]:
    """(bin, testlogs): under `bazel run`, the runfiles tree when it holds the models (//tools:import_matrix),
    else the bin directory holding the runfiles tree (//tools:import_matrix_files: whatever this output base
    has built), and the testlogs beside that bin directory, so any --output_base and --symlink_prefix work;
    outside Bazel, the workspace's bazel-bin and bazel-testlogs."""
    if _in_runfiles(root):
        for parent in root.parents:
            if parent.name == "bin" and not _in_runfiles(parent):
                models = root / "models"
                holds = models.is_dir() and any(models.glob("*.modules.json"))
                return (root if holds else parent), parent.parent / "testlogs"
    return workspace / "bazel-bin", workspace / "bazel-testlogs"


def _toolchain() -> dict:
    from importlib import metadata

    versions = {}
    for package in ("iree-base-compiler", "iree-base-runtime"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return versions


def _machine(threads: int) -> dict:
    from dsa.runtime.host import host_cpu_model

    return {"cpu": host_cpu_model(), "cores": len(os.sched_getaffinity(0)), "threads": threads,
            "system": f"{platform.system()} {platform.release()}",
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def real_size_bin(bin_dir: Path) -> Path:
    """Where the real-size policies are: built by hand (manual targets), never this binary's data, so under
    `bazel run` the bin directory that holds the runfiles tree; else `bin_dir`."""
    if (bin_dir / POLICIES_REAL_SIZE_INDEX).is_file() or not _in_runfiles(bin_dir):
        return bin_dir
    for parent in bin_dir.parents:
        if parent.name == "bin" and not _in_runfiles(parent):
            return parent
    return bin_dir


def _shown(path: Path, workspace: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(workspace.resolve()))
    except ValueError:
        return str(path)


def select_models(names: Optional[str], models: Sequence[ModelSpec]) -> List[ModelSpec]:
    if not names:
        return list(models)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {m.name: m for m in models}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise DsaError("--models", f"no model {', '.join(unknown)}", f"known: {', '.join(known)}")
    return [m for m in models if m.name in wanted]


def main(argv: Optional[List[str]] = None) -> None:
    from dsa.core.fileio import read_json, write_bytes_atomic, write_json_atomic

    parser = argparse.ArgumentParser(prog="dsa import-matrix", description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated rows to include (default: every policy and pipeline "
                        "of the policies index, //models:policies_index)")
    parser.add_argument("--no-measure", action="store_true",
                        help="render from build and test outputs only: no compile re-run, no benchmark")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="timed benchmark repetitions")
    parser.add_argument("--no-import", action="store_true",
                        help="do not time `dsa compile` of each model (the import→vmfb column)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--bin", type=Path, help="bazel-bin (default: the runfiles tree under `bazel run`, "
                        "else <workspace>/bazel-bin)")
    parser.add_argument("--testlogs", type=Path, help="bazel-testlogs (default: beside the bin directory)")
    parser.add_argument("--out-dir", type=Path, help="where import-matrix.{md,json} go (default: <workspace>/docs)")
    parser.add_argument("--readme", type=Path, help="README to update between the markers (default: "
                        "<workspace>/README.md; --readme '' for none)")
    parser.add_argument("--from-json", type=Path, help="render a previously collected import-matrix.json")
    parser.add_argument("--bench-results", type=Path, help="the benchmark's results.json whose latencies the "
                        "table takes for the modules it timed (default: <workspace>/bench/results.json; "
                        "--bench-results '' for none)")
    parser.add_argument("--real-size", action="store_true",
                        help="also the real-size policies (//models:policies_real_size_index, built by hand), as a "
                        "second table; their latency and import→vmfb from `dsa scale` (--real-size-results)")
    parser.add_argument("--real-size-bin", type=Path, help="the bin directory the real-size policies were built in "
                        "(default: --bin, else the bin directory of this output base)")
    parser.add_argument("--real-size-results", type=Path, help=f"dsa scale's data (default: <workspace>/"
                        f"{REAL_SIZE_RESULTS})")
    parser.add_argument("--real-size-only", action="store_true",
                        help="collect the real-size table alone and keep the main table as the committed "
                        "import-matrix.json has it (the real-size policies are built apart, in tens of GB, and the "
                        "main table's latencies were measured on a quiet machine)")
    a = parser.parse_args(argv)
    if a.real_size_only:
        a.real_size = True
        if a.from_json:
            raise DsaError("--real-size-only", "collects the real-size table: it does not go with --from-json")
    if a.runs < 1:
        raise DsaError("--runs", f"{a.runs} is not a positive number of repetitions")
    workspace = workspace_root()
    bin_default, testlogs_default = default_dirs(_script_root(), workspace)
    bin_dir = a.bin or bin_default
    testlogs = a.testlogs or (a.bin.parent / "testlogs" if a.bin and a.bin.name == "bin" else testlogs_default)
    out_dir = a.out_dir or workspace / "docs"
    readme = None if a.readme == Path("") else (a.readme or workspace / "README.md")

    if a.from_json:
        data = read_json(a.from_json)
    else:
        if not (bin_dir / "models").is_dir() and not (a.real_size_only and a.real_size_bin):
            raise DsaError(str(bin_dir), "holds no models/ build outputs",
                           "build first (`./bazelw build //tools:import_matrix`), or pass --bin")
        args = list(sys.argv[1:] if argv is None else argv)
        if os.environ.get("BUILD_WORKSPACE_DIRECTORY"):
            runfiles = [p[: -len(".runfiles")] for p in _script_root().parts if p.endswith(".runfiles")]
            target = "//tools:" + (runfiles[-1] if runfiles else "import_matrix")
            command = f"./bazelw run {target}" + (" -- " + shlex.join(args) if args else "")
        else:
            command = shlex.join(["python3", "dsa/tools/import_matrix.py", *args])
        print(f"dsa import-matrix: outputs from {bin_dir}, test results from {testlogs}", flush=True)
        bench_path = None if a.bench_results == Path("") else (a.bench_results or workspace / "bench" / "results.json")
        bench = read_bench_latencies(bench_path) if bench_path is not None else {}
        committed = None
        if a.real_size_only:  # the main table as committed; only the real-size rows are collected
            committed = read_json(out_dir / "import-matrix.json")
            rows = committed["rows"]
        else:
            rows = collect(select_models(a.models, read_models(bin_dir)), bin_dir, testlogs,
                           measure=not a.no_measure, runs=a.runs, threads=a.threads, workspace=workspace,
                           sources=None if a.no_import else read_import_sources(bin_dir), bench=bench)
        real_size = None
        if a.real_size:
            real_bin = a.real_size_bin or real_size_bin(bin_dir)
            results_path = a.real_size_results or workspace / REAL_SIZE_RESULTS
            print(f"dsa import-matrix: real-size outputs from {real_bin}, dsa scale's data from {results_path}",
                  flush=True)
            real_rows = collect(read_models(real_bin, POLICIES_REAL_SIZE_INDEX), real_bin, testlogs,
                                measure=not a.no_measure, runs=a.runs, threads=a.threads, workspace=workspace,
                                bench={}, scale=read_scale_results(results_path))
            real_size = {"bin": str(real_bin), "results": _shown(results_path, workspace), "rows": real_rows,
                         "date": time.strftime("%Y-%m-%d"), "command": command,
                         "machine": _machine(a.threads), "testlogs": str(testlogs)}
        targets = sorted({r["target"] for r in rows if r["target"]})
        data = {
            "format": DATA_FORMAT,
            "date": time.strftime("%Y-%m-%d"),
            "command": command,
            "measure": not a.no_measure,
            "runs": a.runs,
            "target": ", ".join(targets) or None,
            "machine": _machine(a.threads),
            "toolchain": _toolchain(),
            "rows": rows,
        }
        if committed is not None:  # the main table's own provenance stays as it was
            data = {**committed, "real_size": real_size}
        if real_size is not None:
            data["real_size"] = real_size
        data = json.loads(json.dumps(data, default=str))  # paths → strings: what the JSON file holds
        write_json_atomic(out_dir / "import-matrix.json", data)
    document = render_document(data)
    write_bytes_atomic(out_dir / "import-matrix.md", document.encode("utf-8"))
    if readme is not None:
        text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
        write_bytes_atomic(readme, replace_marked(text, render_table(data)).encode("utf-8"))
    print(render_table(data))
    print(f"dsa-import-matrix: wrote {out_dir / 'import-matrix.md'}"
          + (f" and the marked section of {readme}" if readme is not None else ""))
    mismatched = [r["module"] for r in _all_rows(data) if (r.get("measured") or {}).get("identical") is False]
    if mismatched:
        raise DsaError("iree-compile re-run", f"the re-compiled vmfb of {', '.join(mismatched)} is not "
                       "byte-identical to the built one", "the build is not reproducible on this machine: "
                       "compare the compile reports' flags and toolchain versions")


if __name__ == "__main__":
    run_cli(main, "dsa import-matrix")
