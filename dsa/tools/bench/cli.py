"""Latency benchmark: each model's vmfb (iree.runtime) against eager PyTorch, ONNX Runtime and torch.compile.

    bazel run //bench -- [--models pi0 transformer] [--runs 30] [--target auto|x86_64-v3|x86_64-v4]

For every subject in bench/subjects.json (one per model in models/) it exports and compiles the model with
the rule set's own stage code (dsa.stages.export, dsa.stages.params, dsa.stages.compile: the same bytes a Bazel build makes) in
several variants —

    default     no graph rewrites, the target's flags only ("compiled the obvious way")
    rewrites    the default graph rewrites (dsa.stages.passes), the target's flags only
    tuned       the rewrites and the family's tuning file for the target (toolchains/tuning): what ships
    -<pass>     tuned without one rewrite that fired: that rewrite's before/after line

— and runs each, eager PyTorch, ONNX Runtime (the same model through torch's ONNX exporter) and
torch.compile on the same inputs with the same thread count: warm-up, then `runs` timed calls; median and
p90. Every runtime's output is checked against eager in the same run. Results go to bench/RESULTS.md,
bench/results.json and bench/results.png, with the machine, CPU target and flags; for a model short of the
goal (vmfb ≤ eager; pi0 and the transformer control within 1.5x of ONNX Runtime) the profiler's top
dispatches are listed. Timings are reported, never asserted. RESULTS.md keeps the latest run of each class of
CPU (AVX-512 or not: the x86-64-v4 builds run only on the one): a run that replaces one from the other class
keeps it as bench/results.<class>.json, rendered as its own section; sections other tools own (`dsa scale`'s
real sizes) stay.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import read_json, write_bytes_atomic, write_json_atomic
from dsa.core.runtime_flags import merge_runtime_flags
from dsa.runtime import iree_flags
from dsa.runtime.host import best_target
from dsa.tools.bench.lerobot import (FULL_SIZE_PARAMETERS, LIGHT_FULL_SIZE_RUNS, lerobot_policies, lerobot_python,
                                     run_lerobot_benchmark)
from dsa.tools.bench.quant import QUANT_LAYERS_SUBJECT, bench_quant_layers
from dsa.tools.bench.report import (RESULTS_FORMAT, machine_class, merge_results, render_chart, render_markdown,
                                    render_other_class, with_current_goals, with_kept_blocks,
                                    workspace_root)
from dsa.tools.bench.runtimes import executorch_available, runfiles_python
from dsa.tools.bench.subjects import bench_subject, load_subjects
from dsa.tools.bench.timing import machine_info


def write_results(out_dir: Path, results: dict) -> str:
    """Writes results.json and RESULTS.md; returns the markdown. The run it replaces, when it was measured on the
    other class of CPU (report.machine_class: AVX-512 or not), is kept as results.<class>.json and rendered as
    its own section; the sections other tools own in RESULTS.md (`dsa scale`'s) are kept."""
    this = machine_class(results)
    if (out_dir / "results.json").is_file():
        before = read_json(out_dir / "results.json")
        if machine_class(before) != this:
            write_json_atomic(out_dir / f"results.{machine_class(before)}.json", before)
    (out_dir / f"results.{this}.json").unlink(missing_ok=True)  # this class's latest run is results.json now
    write_json_atomic(out_dir / "results.json", results)
    text = render_markdown(results)
    for other in sorted(out_dir.glob("results.*.json")):
        text = text.rstrip("\n") + "\n\n" + render_other_class(read_json(other))
    old = out_dir / "RESULTS.md"
    text = with_kept_blocks(text, old.read_text(encoding="utf-8") if old.is_file() else None)
    write_bytes_atomic(old, text.encode("utf-8"))
    return text


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa bench", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="subjects to run (default: all in bench/subjects.json)")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--target", default="auto", help="CPU target (default: the best this machine runs)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out-dir", type=Path, help="default: <workspace>/bench")
    parser.add_argument("--root", type=Path, help="checkout to read models and toolchains from")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-lerobot", action="store_true",
                        help="skip the LeRobot policies (measured in the LeRobot environment)")
    parser.add_argument("--no-quant-layers", action="store_true",
                        help="skip the quantised matmuls at OpenVLA's real layer sizes")
    parser.add_argument("--light", action="store_true",
                        help="CI's light run: each shipped module against eager only (no ONNX Runtime, "
                             "torch.compile, ablation builds or profile), full-size policies 3 calls, "
                             "quantised layers at a decode step only")
    parser.add_argument("--full-size-light", action="store_true",
                        help=f"full-size policies (>= {FULL_SIZE_PARAMETERS // 10**6}M parameters) only: "
                             f"{LIGHT_FULL_SIZE_RUNS} calls against eager (their ONNX export and torch.compile take "
                             "over 30 min on 2 cores)")
    parser.add_argument("--update", action="store_true",
                        help="with --models: re-measure only those and replace their rows in the existing "
                             "results.json (the other rows stay as measured; each replaced row records its date), "
                             "then render RESULTS.md again")
    parser.add_argument("--lerobot-only", type=Path, metavar="OUT_JSON",
                        help=argparse.SUPPRESS)  # the LeRobot half, run by this tool in the LeRobot environment
    parser.add_argument("--no-executorch", action="store_true",
                        help="do not time the ExecuTorch Plan B (the benchmark otherwise runs in the ExecuTorch "
                             "environment, a superset of the toolchain's, when it is in the runfiles)")
    parser.add_argument("--render", action="store_true",
                        help="measure nothing: render RESULTS.md and results.png again from the results files in "
                             "--out-dir, the policies' goals computed by the current criteria")
    a = parser.parse_args(argv)
    if a.render:
        out_dir = a.out_dir or workspace_root() / "bench"
        if not (out_dir / "results.json").is_file():
            raise DsaError(str(out_dir / "results.json"), "does not exist", "measure first: bazel run //bench")
        for other in sorted(out_dir.glob("results.*.json")):
            write_json_atomic(other, with_current_goals(read_json(other)))
        results = with_current_goals(read_json(out_dir / "results.json"))
        write_results(out_dir, results)
        render_chart(results, out_dir / "results.png")
        print(f"dsa-bench: wrote {out_dir / 'RESULTS.md'}, results.json, results.png (rendered again)")
        return
    # Not resolved: under `bazel run` this file is a runfiles symlink, and the runfiles tree (not the source
    # tree it points into) holds the generated checkpoints.
    root = a.root or Path(os.path.abspath(__file__)).parents[3]
    executorch_python = None if a.no_executorch or a.lerobot_only else runfiles_python(root, "dsa_executorch_python")
    if executorch_python is not None and not executorch_available():
        # Everything the toolchain's environment has plus ExecuTorch: the same run, with the Plan B beside
        # the vmfb in one process (alternating rounds).
        pythonpath = [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join(pythonpath)
        args = list(sys.argv[1:] if argv is None else argv)
        os.execv(str(executorch_python), [str(executorch_python), "-m", "dsa.tools.bench", *args])
    if a.lerobot_only:
        rows = run_lerobot_benchmark(root, models=a.models, runs=a.runs, warmup=a.warmup, threads=a.threads,
                                     light=a.light, full_size_light=a.full_size_light)
        write_json_atomic(a.lerobot_only, {"format": RESULTS_FORMAT, "policies": rows})
        return
    if a.runs < 30:
        print(f"dsa-bench: note: {a.runs} runs per measurement (the published tables use >= 30)")
    out_dir = a.out_dir or workspace_root() / "bench"
    previous = None
    if a.update:
        if not a.models:
            raise DsaError("--update", "needs --models: the subjects or policies to measure again")
        if not (out_dir / "results.json").is_file():
            raise DsaError("--update", f"no {out_dir / 'results.json'} to update", "run the whole benchmark first")
        previous = read_json(out_dir / "results.json")
    target = best_target(root / "toolchains" / "targets") if a.target == "auto" else a.target
    if not (root / "toolchains" / "targets" / f"{target}.json").exists():
        raise DsaError("--target", f"unknown target '{target}'",
                       f"choose one of {sorted(p.stem for p in (root / 'toolchains' / 'targets').glob('*.json'))}")
    subjects = load_subjects(root / "bench" / "subjects.json", root)
    every_build = [] if a.no_lerobot else lerobot_policies(root)
    # Each policy once, as `bazel build //models:<name>` ships it (the runner takes the most capable of its
    # levels); a level's own row only when named.
    policies = [p.name for p in every_build if not p.level_of]
    quant_layers = not a.no_quant_layers
    if a.models:
        quant_layers = quant_layers and QUANT_LAYERS_SUBJECT in a.models
        policies = [p.name for p in every_build]
        known = [s.name for s in subjects] + policies + [QUANT_LAYERS_SUBJECT]
        unknown = sorted(set(a.models) - set(known))
        if unknown:
            raise DsaError("--models", f"no bench subject {', '.join(unknown)}", f"known: {', '.join(known)}")
        subjects = [s for s in subjects if s.name in a.models]
        policies = [p for p in policies if p in a.models]
    python = lerobot_python(root) if policies else None
    if policies and python is None:
        raise DsaError("dsa bench", "the LeRobot environment is not in this binary's runfiles",
                       "run `bazel run //bench`, or pass --no-lerobot")
    iree_flags.set_task_threads(a.threads)
    # The project's subjects are compiled with their families' tunings for the target: the runtime is set up
    # once, before the first device, with what the most demanding of them requires.
    iree_flags.require(merge_runtime_flags(read_json(t).get("runtime_flags", [])
                                           for t in (root / "toolchains" / "tuning").glob(f"*.{target}.json")),
                       "dsa bench")
    results = {
        "format": RESULTS_FORMAT,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(a.threads),
        "target": target,
        "runs": a.runs,
        "warmup": a.warmup,
        "light": a.light,
        "full_size_light": a.full_size_light,
        "models": [],
        "policies": [],
        "quant_layers": [],
    }
    with tempfile.TemporaryDirectory(prefix="dsa-bench-") as tmp:
        for subject in subjects:
            print(f"dsa-bench: {subject.name} …", flush=True)
            results["models"].append(bench_subject(
                subject, target_name=target, root=root, work=Path(tmp) / subject.name, runs=a.runs,
                warmup=a.warmup, threads=a.threads, profile_top=0 if a.no_profile else 8, light=a.light))
        if policies:
            # The LeRobot policies run in their own environment (LeRobot and its pinned torch): this tool
            # again, under that interpreter, with the same import roots (as a module: run as a script, this
            # package's directory would be first on sys.path, and its lerobot.py would shadow LeRobot's).
            out = Path(tmp) / "lerobot.json"
            cmd = [str(python), "-m", "dsa.tools.bench", "--lerobot-only", str(out), "--root", str(root),
                   "--runs", str(a.runs), "--warmup", str(a.warmup), "--threads", str(a.threads),
                   *(["--light"] if a.light else []), *(["--full-size-light"] if a.full_size_light else []),
                   "--models", *policies]
            pythonpath = [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath)))
            if proc.returncode != 0:
                raise DsaError("dsa bench", f"the LeRobot benchmark failed (exit {proc.returncode})",
                               f"rerun it alone: {' '.join(cmd)}")
            results["policies"] = read_json(out)["policies"]
        if quant_layers:
            print("dsa-bench: quantised matmuls at OpenVLA's layer sizes …", flush=True)
            results["quant_layers"] = bench_quant_layers(root, target, Path(tmp) / "quant_layers", runs=a.runs,
                                                         warmup=a.warmup, light=a.light)
    if previous is not None:
        results = merge_results(previous, results, target)
    text = write_results(out_dir, results)
    render_chart(results, out_dir / "results.png")
    print(text)
    print(f"dsa-bench: wrote {out_dir / 'RESULTS.md'}, results.json, results.png")


if __name__ == "__main__":
    run_cli(main, "dsa bench")
