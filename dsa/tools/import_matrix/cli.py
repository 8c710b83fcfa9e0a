"""dsa-import-matrix: every model × (export, compile, parity, sizes, compile time, peak RSS, latency), generated —
the command line (the package's docstring says what the matrix is and where each cell comes from)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import read_json
from dsa.tools.import_matrix.measure import (
    DATA_FORMAT, REAL_SIZE_RESULTS, collect, read_bench_latencies, read_scale_results)
from dsa.tools.import_matrix.models import ModelSpec, POLICIES_REAL_SIZE_INDEX, read_import_sources, read_models
from dsa.tools.import_matrix.report import all_rows, render_document, render_table, replace_marked


DEFAULT_RUNS = 10


# -- entry point --------------------------------------------------------------------------------------------
def _script_root() -> Path:
    # Not resolved: under `bazel run` this file is a runfiles symlink, and the runfiles tree holds the outputs.
    return Path(os.path.abspath(__file__)).parents[3]


def workspace_root() -> Path:
    """Where the docs are written: the workspace `bazel run` was called from, else this checkout."""
    return Path(os.environ.get("BUILD_WORKSPACE_DIRECTORY") or Path(__file__).resolve().parents[3])


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
            command = shlex.join(["python3", "-m", "dsa.tools.import_matrix", *args])
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
    mismatched = [r["module"] for r in all_rows(data) if (r.get("measured") or {}).get("identical") is False]
    if mismatched:
        raise DsaError("iree-compile re-run", f"the re-compiled vmfb of {', '.join(mismatched)} is not "
                       "byte-identical to the built one", "the build is not reproducible on this machine: "
                       "compare the compile reports' flags and toolchain versions")


if __name__ == "__main__":
    run_cli(main, "dsa import-matrix")
