"""dsa scale: measured scale of real-size models (the command line; the package's docstring says what is
measured and how)."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from dsa.core.errors import DsaError, run_cli
from dsa.tools.scale.children import count_child, eager_child, old_export_child, runtime_child
from dsa.tools.scale.measure import Settings, machine, measure_subject, merge, toolchain, without_work
from dsa.tools.scale.memory import DEFAULT_LOCK, heavy_lock
from dsa.tools.scale.report import real_and_points, render_build_table, render_runtime_table, write_outputs
from dsa.tools.scale.subjects import (
    SWEEPS, Subject, lerobot_python_candidates, manifest_subject, read_manifest_data, real_size_manifests,
    relative_to, sweep_subjects)


DEFAULT_RUNS = 3
DEFAULT_MAX_SCRATCH_GB = 15.0


# -- entry point ----------------------------------------------------------------------------------------------
def workspace_root() -> Path:
    """The checkout measured and written to: the workspace `bazel run` was called from, else this one."""
    return Path(os.environ.get("BUILD_WORKSPACE_DIRECTORY") or Path(__file__).resolve().parents[3])


def _weights_args(values: Sequence[str]) -> Dict[str, Path]:
    given = {}
    for value in values:
        key, sep, path = value.partition("=")
        if not sep or not path:
            raise DsaError("--weights", f"'{value}' is not MODEL_ID=PATH")
        given[key] = Path(path)
    return given


def _child_main(a: argparse.Namespace) -> bool:
    """The measured children (hidden flags): True when this process was one."""
    if a.runtime_child:
        runtime_child(Path(a.runtime_child), a.runs, a.threads, Path(a.result), Path(a.output))
    elif a.eager_child:
        framework, record = a.eager_child
        eager_child(framework, Path(record), a.flow_steps or None, a.runs, a.threads, Path(a.result),
                    Path(a.output), policy_dir=a.policy_dir and Path(a.policy_dir), view=a.view and Path(a.view),
                    checkpoint=a.checkpoint and Path(a.checkpoint))
    elif a.count_child:
        framework, view, result = a.count_child
        count_child(framework, Path(view), Path(result), config=a.config and Path(a.config), pythonpath=a.pythonpath)
    elif a.old_export_child:
        view, out_dir = a.old_export_child
        old_export_child(Path(view), Path(out_dir), a.config and Path(a.config), a.pythonpath)
    else:
        return False
    return True


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa scale", description=__doc__.splitlines()[0])
    parser.add_argument("manifests", nargs="*", type=Path, help="the subjects' manifests")
    parser.add_argument("--sweep", action="append", default=[], choices=sorted(SWEEPS),
                        help="measure a family at three sizes (and the old design where it fits), with the plot")
    parser.add_argument("--real-size-index", action="store_true",
                        help="every manifest of //models:policies_real_size_index (bazel-bin, or --bin)")
    parser.add_argument("--root", type=Path, help="the checkout whose manifests, model code, policy configs, "
                        "target specs and tuning files are used (default: the workspace `bazel run` was called "
                        "from, else this checkout)")
    parser.add_argument("--bin", type=Path, help="bazel-bin (default: <root>/bazel-bin)")
    parser.add_argument("--weights", action="append", default=[], metavar="MODEL_ID=PATH",
                        help="given weights instead of a stand-in: a LeRobot policy directory, a .safetensors file "
                        "or a sharded checkpoint's index")
    parser.add_argument("--target", action="append", default=[], dest="targets", metavar="NAME",
                        help="build only these of each manifest's targets (default: every one)")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS,
                        help=f"timed calls after the first, runtime and eager (default {DEFAULT_RUNS})")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--lock", type=Path, default=DEFAULT_LOCK,
                        help=f"the heavy-work lock held by every measured step (default {DEFAULT_LOCK})")
    parser.add_argument("--no-lock", action="store_true", help="take no lock")
    parser.add_argument("--lock-per", choices=("step", "subject"), default="step",
                        help="hold the lock for each measured step (default: other heavy jobs may run between a "
                        "subject's steps) or for a whole subject (its steps back to back)")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a new one in $TMPDIR)")
    parser.add_argument("--keep", action="store_true", help="keep each subject's scratch (stand-in, build)")
    parser.add_argument("--max-scratch-gb", type=float, default=DEFAULT_MAX_SCRATCH_GB,
                        help="refuse a subject whose stand-in and archive would need more scratch (0: no check)")
    parser.add_argument("--no-runtime", action="store_true")
    parser.add_argument("--no-eager", action="store_true")
    parser.add_argument("--only-missing", action="store_true",
                        help="skip subjects already in the data file (resume a run)")
    parser.add_argument("--lerobot-python", type=Path, default=os.environ.get("DSA_LEROBOT_PYTHON") or None,
                        help="the LeRobot environment's interpreter (default: $DSA_LEROBOT_PYTHON, the runfiles, "
                        "bazel-bin's output base)")
    parser.add_argument("--pythonpath", action="append", default=[], help="more directories with model code")
    parser.add_argument("--out-dir", type=Path, help="where real-size.{json,md,png} go (default: <workspace>/docs)")
    parser.add_argument("--results", type=Path, help="the RESULTS.md whose marked section is written "
                        "(default: <workspace>/bench/RESULTS.md; --results '' for none)")
    parser.add_argument("--render", action="store_true", help="measure nothing: render the docs from the data file")
    # The measured children (this module run again).
    parser.add_argument("--runtime-child", help=argparse.SUPPRESS)
    parser.add_argument("--eager-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--count-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--old-export-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--flow-steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--policy-dir", help=argparse.SUPPRESS)
    parser.add_argument("--view", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if _child_main(a):
        return
    if a.runs < 1:
        raise DsaError("--runs", f"{a.runs} is not a positive number of calls")
    root = Path(os.path.abspath(a.root or workspace_root()))
    bin_dir = a.bin or root / "bazel-bin"
    out_dir = a.out_dir or root / "docs"
    results = None if a.results == Path("") else (a.results or root / "bench" / "RESULTS.md")
    data_path = out_dir / "real-size.json"
    from dsa.core.fileio import read_json

    data = read_json(data_path) if data_path.is_file() else None
    if a.render:
        if data is None:
            raise DsaError(str(data_path), "does not exist", "measure first")
        for path in write_outputs(data, out_dir, results):
            print(f"dsa scale: wrote {path}")
        return

    weights = _weights_args(a.weights)
    subjects: List[Subject] = []
    for name in a.sweep:
        subjects += sweep_subjects(name, root)
    manifests = [m if m.is_absolute() else Path.cwd() / m for m in a.manifests]
    if a.real_size_index:
        manifests += real_size_manifests(bin_dir, root)
    for manifest in manifests:
        model_id = read_manifest_data(manifest)["model_id"]
        subjects.append(manifest_subject(manifest, root, weights.get(model_id)))
    unique: Dict[str, Subject] = {}
    for subject in subjects:
        unique.setdefault(subject.key, subject)
    subjects = list(unique.values())
    if not subjects:
        raise DsaError("dsa scale", "no subject", "name manifests, --sweep FAMILY or --real-size-index (or --render)")
    if a.only_missing and data:
        done = {e["key"] for e in data.get("subjects", []) if "not_measured" not in e}
        subjects = [s for s in subjects if s.key not in done]

    lerobot_python = a.lerobot_python
    if lerobot_python is None:
        lerobot_python = next((c for c in lerobot_python_candidates(root, bin_dir) if c.exists()), None)
    args = list(sys.argv[1:] if argv is None else argv)
    command = ("./bazelw run //tools:scale" + (" -- " + shlex.join(args) if args else "")
               if os.environ.get("BUILD_WORKSPACE_DIRECTORY") else "bin/dsa scale " + shlex.join(args))
    work = a.work or Path(tempfile.mkdtemp(prefix="dsa-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    lock = None if a.no_lock else a.lock
    settings = Settings(root=root, work=work, lock=lock if a.lock_per == "step" else None, runs=a.runs,
                        threads=a.threads,
                        toolchain_python=Path(sys.executable), lerobot_python=lerobot_python,
                        pythonpath=[str(Path(p).resolve()) for p in a.pythonpath], targets=a.targets or None,
                        runtime=not a.no_runtime, eager=not a.no_eager, keep=a.keep,
                        max_scratch_bytes=int(a.max_scratch_gb * 1e9) if a.max_scratch_gb > 0 else None,
                        log=lambda m: print(m, file=sys.stderr, flush=True))
    versions = toolchain(lerobot_python)
    failed = []
    for subject in subjects:
        started = time.monotonic()
        try:
            with heavy_lock(lock if a.lock_per == "subject" else None, subject.key, settings.log):
                entry = measure_subject(subject, settings, command)
        except DsaError as e:
            print(f"dsa scale: {subject.key}: not measured: {e}", file=sys.stderr, flush=True)
            failed.append(f"{subject.key}: {e}")
            shutil.rmtree(work / subject.key, ignore_errors=True)
            measured = {x["key"] for x in (data or {}).get("subjects", []) if "not_measured" not in x}
            if subject.key in measured:
                continue  # an earlier measurement stays
            entry = {"key": subject.key, "model_id": subject.model_id, "manifest": relative_to(subject.source, root),
                     "framework": subject.framework, "description": subject.description, "family": subject.family,
                     "size": subject.size, "date": time.strftime("%Y-%m-%d %H:%M"), "command": command,
                     "machine": machine(settings.threads), "notes": [], "not_measured": without_work(str(e), work)}
        data = merge(data, [entry], [n for n in a.sweep], versions)
        write_outputs(data, out_dir, results)
        print(f"dsa scale: {subject.key}: measured in {time.monotonic() - started:.0f} s; wrote {data_path}",
              file=sys.stderr, flush=True)
    if data is not None:
        real, _ = real_and_points(data)
        print(render_build_table(real))
        print(render_runtime_table(real))
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    if failed:
        raise DsaError("dsa scale", f"{len(failed)} subject(s) not measured: " + "; ".join(failed))


if __name__ == "__main__":
    run_cli(main, "dsa scale")
