"""What the benchmark times of the project's own models: the subjects (every manifest, with options from
bench/subjects.json), each built by the rule set's stage code in several variants (default, rewrites, tuned,
one per rewrite left out), their reference cases (eager PyTorch on seeded inputs), and one subject timed
against eager, ONNX Runtime, torch.compile and ExecuTorch (`bench_subject`), judged by the goal and profiled
where it falls short. The tuner builds and checks its candidates with the same functions."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from dsa.core.errors import DsaError, one_line
from dsa.core.fileio import read_json, sha256_file
from dsa.stages.compile import load_tuning
from dsa.tools.bench.runtimes import (ORT_SPINNING, Built, IreeModule, executorch_available, measure_spinning_ort,
                                      ort_session)
from dsa.tools.bench.timing import GOAL_EAGER_RATIO, GOAL_ORT_RATIO, measure_interleaved, parity


@dataclasses.dataclass
class Subject:
    name: str
    manifest: Path
    checkpoint: Path
    family: str
    bucket: Optional[dict]          # {"dim": ..., "slot": ...} or None
    cases: List[dict]               # input overrides per timed case, e.g. [{"steps": 1}, {"steps": 10}]
    ort_goal: bool                  # whether the 1.5x-of-ONNX-Runtime goal applies

    def dims(self, manifest: dict) -> Dict[str, int]:
        """The timed bucket's size by dim name ({} without buckets)."""
        if self.bucket is None:
            return {}
        return {self.bucket["dim"]: manifest["buckets"][self.bucket["dim"]][self.bucket["slot"]]}

    def case_name(self, case: dict) -> str:
        return ", ".join(f"{k}={v}" for k, v in case.items()) or "-"


def load_subjects(path: Path, root: Path) -> List[Subject]:
    """The subjects: those bench/subjects.json gives options for, then every other manifest under
    `root/manifests` with the defaults (default_subject), except the ones subjects.json says are not
    benchmarked here, and why. So a new model is benchmarked without an entry of its own."""
    data = read_json(path)
    subjects = []
    for entry in data["subjects"]:
        subjects.append(Subject(
            name=entry["model"],
            manifest=root / entry["manifest"],
            checkpoint=root / entry["checkpoint"],
            family=entry["family"],
            bucket=entry.get("bucket"),
            cases=entry.get("cases") or [{}],
            ort_goal=bool(entry.get("ort_goal", False)),
        ))
    covered = {s.manifest.name for s in subjects} | set(data.get("not_benchmarked", {}))
    for manifest in sorted((root / "manifests").glob("*.yaml")):
        if manifest.name not in covered:
            subjects.append(default_subject(manifest, root))
    return subjects


def default_subject(manifest: Path, root: Path) -> Subject:
    """A manifest without options in subjects.json: its seeded checkpoint (models/<model_id>.safetensors, as
    dsa_policy names it; made here when absent), the tuning family named after the model (target flags only
    until one is measured), the smallest bucket of its first bucketed dim, one case with the sample inputs, and
    the ONNX Runtime goal."""
    import yaml

    data = yaml.safe_load(manifest.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or "model_id" not in data:
        raise DsaError(str(manifest), "is not a manifest with a model_id",
                       "fix it, or list it under not_benchmarked in bench/subjects.json")
    if data.get("framework", "pytorch") != "pytorch":
        raise DsaError(str(manifest), f"framework '{data.get('framework')}' is not benchmarked in this environment",
                       "list it under not_benchmarked in bench/subjects.json, saying why")
    buckets = data.get("buckets") or {}
    dim = sorted(buckets)[0] if buckets else None
    return Subject(
        name=data["model_id"],
        manifest=manifest,
        checkpoint=root / "models" / f"{data['model_id']}.safetensors",
        family=data["model_id"],
        bucket={"dim": dim, "slot": 0} if dim else None,
        cases=[{}],
        ort_goal=True,
    )


def build_variant(subject: Subject, manifest: dict, target: dict, tuning: Optional[dict],
                  rewrites: Sequence[str], work: Path, pythonpath: Sequence[str]) -> Built:
    """Exports (with `rewrites`), packs the parameters and compiles, with the stages' own functions."""
    from dsa.stages.compile import compile_module
    from dsa.stages.export import export_model
    from dsa.manifest.contract import project
    from dsa.stages.params import build_params

    work.mkdir(parents=True, exist_ok=True)
    export_view = project(manifest, "export")
    bucket = None
    if subject.bucket is not None:
        bucket = project(manifest, "bucket", bucket=(subject.bucket["dim"], subject.bucket["slot"]))
    start = time.perf_counter()
    record = export_model(export_view, work / "model.mlir", work / "record.json", bucket=bucket,
                          pythonpath=pythonpath, manifest_name=str(subject.manifest), rewrites=rewrites)
    export_s = time.perf_counter() - start
    irpa = work / "params.irpa"
    build_params(subject.checkpoint, project(manifest, "params"), record, irpa,
                 manifest_name=str(subject.manifest))
    compile_view = dict(project(manifest, "compile", target=manifest["targets"][0]), target=target["name"])
    start = time.perf_counter()
    report = compile_module(work / "model.mlir", compile_view, target, work / "model.vmfb",
                            where=f"{subject.name} for {target['name']}", tuning=tuning)
    compile_s = time.perf_counter() - start
    return Built(work / "model.vmfb", record, irpa, report["flags"], record.get("rewrites", {}),
                 round(export_s, 2), round(compile_s, 2), report["vmfb_bytes"])


# -- reference cases ---------------------------------------------------------------------------------
def load_subject_manifest(subject: Subject, root: Path, work: Path) -> dict:
    """The subject's manifest. Outside Bazel the seeded checkpoint is not built: make the same one
    dsa_checkpoint(seed = 0) makes."""
    from dsa.manifest.contract import load_manifest, project

    manifest = load_manifest(subject.manifest)
    if not subject.checkpoint.exists():
        from dsa.stages.checkpoint import make_checkpoint

        subject.checkpoint = work / "checkpoint.safetensors"
        make_checkpoint(project(manifest, "export"), subject.checkpoint, seed=0, pythonpath=[str(root)])
    return manifest


@dataclasses.dataclass
class Case:
    name: str
    inputs: Dict[str, np.ndarray]   # by input name, for the vmfb
    args: list                      # torch tensors in the entry point's order, for eager / ORT / torch.compile
    ref: np.ndarray                 # eager PyTorch's output, float64


def reference_cases(subject: Subject, manifest: dict, record: dict):
    """(eager module, input names, one Case per subject case): deterministic sample inputs at the subject's
    bucket, each case's overrides applied, and eager PyTorch's output on them."""
    import torch

    from dsa.manifest.contract import project
    from dsa.runtime.policy import sample_inputs
    from dsa.tools.testing import eager_policy

    dims = subject.dims(manifest)
    base = sample_inputs(record, dims, np.random.default_rng(0))
    eager, spec = eager_policy(project(manifest, "export"), dims, subject.checkpoint)
    names = [s.name for s in spec.inputs]
    cases = []
    for case in subject.cases:
        inputs = dict(base)
        for key, value in case.items():
            inputs[key] = np.array(value, dtype=np.asarray(base[key]).dtype)
        args = [torch.from_numpy(np.asarray(inputs[n])) for n in names]
        with torch.no_grad():
            ref = eager(*args).numpy().astype(np.float64)
        cases.append(Case(subject.case_name(case), inputs, args, ref))
    return eager, names, cases


# -- one subject ---------------------------------------------------------------------------------------
def bench_subject(subject: Subject, *, target_name: str, root: Path, work: Path, runs: int, warmup: int,
                  threads: int, with_ort: bool = True, with_compile: bool = True,
                  profile_top: int = 8, light: bool = False) -> dict:
    """One project model: its default, rewritten and tuned builds, and one build per fired rewrite left out
    (and per opted-out default rewrite put back), against eager PyTorch, ONNX Runtime and torch.compile.
    `light` (CI): the shipped (tuned) build against eager only, no profile."""
    import torch

    from dsa.stages import passes

    torch.set_num_threads(threads)
    manifest = load_subject_manifest(subject, root, work)
    target = read_json(root / "toolchains" / "targets" / f"{target_name}.json")
    tuning_path = root / "toolchains" / "tuning" / f"{subject.family}.{target_name}.json"
    tuning = load_tuning(tuning_path) if tuning_path.exists() else None
    pythonpath = [str(root)]
    defaults = list(manifest["model"].get("rewrites", passes.DEFAULT_PASSES))

    variants: Dict[str, Built] = {}
    if light:
        with_ort = with_compile = False
        profile_top = 0
        variants["tuned"] = build_variant(subject, manifest, target, tuning, defaults, work / "tuned", pythonpath)
    else:
        _ablation_variants(variants, subject, manifest, target, tuning, defaults, work, pythonpath)
    return _time_subject(subject, manifest, target_name, target, tuning, tuning_path, root, variants, work=work,
                         runs=runs, warmup=warmup, threads=threads, with_ort=with_ort, with_compile=with_compile,
                         profile_top=profile_top)


def _ablation_variants(variants: Dict[str, Built], subject: Subject, manifest: dict, target: dict,
                       tuning: Optional[dict], defaults: List[str], work: Path, pythonpath: List[str]) -> None:
    from dsa.stages import passes

    variants["default"] = build_variant(subject, manifest, target, None, [], work / "default", pythonpath)
    variants["rewrites"] = build_variant(subject, manifest, target, None, defaults, work / "rewrites", pythonpath)
    variants["tuned"] = (build_variant(subject, manifest, target, tuning, defaults, work / "tuned", pythonpath)
                         if tuning is not None else variants["rewrites"])
    fired = [name for name, count in variants["tuned"].rewrites.items() if count > 0]
    for name in fired:
        rest = [n for n in defaults if n != name]
        variants[f"-{name}"] = build_variant(subject, manifest, target, tuning, rest, work / f"minus-{name}",
                                             pythonpath)
    # A default rewrite the manifest opted out of: the evidence for that choice.
    for name in passes.DEFAULT_PASSES:
        if name not in defaults:
            more = [n for n in passes.PASSES if n in defaults or n == name]
            built = build_variant(subject, manifest, target, tuning, more, work / f"plus-{name}", pythonpath)
            if built.rewrites.get(name):
                variants[f"+{name}"] = built


def executorch_program(subject: Subject, manifest: dict, work: Path, threads: int, pythonpath: List[str]):
    """The subject's ExecuTorch Plan B, built by the DsaPte stage's own function at the timed bucket."""
    from dsa.manifest.contract import project
    from dsa.stages.pte import build_pte
    from dsa.tools.executorch import PteProgram

    bucket = None
    if subject.bucket is not None:
        bucket = project(manifest, "bucket", bucket=(subject.bucket["dim"], subject.bucket["slot"]))
    work.mkdir(parents=True, exist_ok=True)
    record = build_pte(project(manifest, "export"), subject.checkpoint, work / "model.pte", work / "model.json",
                       params_view=project(manifest, "params"), bucket=bucket, pythonpath=pythonpath,
                       manifest_name=str(subject.manifest))
    return PteProgram(work / "model.pte", record, threads)


def _time_subject(subject: Subject, manifest: dict, target_name: str, target: dict, tuning: Optional[dict],
                  tuning_path: Path, root: Path, variants: Dict[str, Built], *, work: Path, runs: int,
                  warmup: int, threads: int, with_ort: bool, with_compile: bool, profile_top: int) -> dict:
    import torch

    eager, names, cases = reference_cases(subject, manifest, variants["tuned"].record)
    dims = subject.dims(manifest)

    modules = {name: IreeModule(built, target["runtime_driver"]) for name, built in variants.items()}
    ort = None
    ort_spin = None
    ort_error = None
    if with_ort:
        try:
            ort = ort_session(eager, cases[0].args, names, work / f"{subject.name}.onnx", threads)
            ort_spin = work / f"{subject.name}.onnx"  # timed alone per case, after the others (measure_spinning_ort)
        except Exception as e:  # reported in the results, not fatal
            ort_error = one_line(e)
    executorch = None
    executorch_error = None
    skipped = {}
    if not executorch_available():
        skipped["executorch"] = ("ExecuTorch is not installed in this environment (`bazel run //bench` runs in "
                                 "@dsa_executorch_python)")
    else:
        try:
            executorch = executorch_program(subject, manifest, work / "executorch", threads, [str(root)])
        except Exception as e:  # reported in the results, not fatal: not every model lowers to ExecuTorch
            executorch_error = one_line(e, limit=600)  # the lowering's reason comes last
    compiled = None
    compile_error = None
    compile_s = None
    if with_compile:
        try:
            compiled = torch.compile(eager)
        except Exception as e:
            compile_error = one_line(e)

    rows = []
    for case in cases:
        inputs, args, ref = case.inputs, case.args, case.ref
        with torch.no_grad():
            row = {"case": case.name, "runtimes": {}}
            fns: Dict[str, Callable[[], object]] = {"eager": lambda: eager(*args)}
            checks = {"eager": parity(ref, ref)}
            for name, module in modules.items():
                checks[f"vmfb:{name}"] = parity(module(inputs), ref)
                fns[f"vmfb:{name}"] = (lambda m: lambda: m(inputs))(module)
            if ort is not None:
                session, feeds = ort
                feed = {f: np.asarray(inputs[n]) for f, n in zip(feeds, names)}
                checks["onnxruntime"] = parity(session.run(None, feed)[0], ref)
                fns["onnxruntime"] = lambda: session.run(None, feed)
            if executorch is not None:
                try:
                    pte_args = executorch.arguments(inputs)
                    checks["executorch"] = parity(executorch.run_prepared(pte_args)[0], ref)
                    fns["executorch"] = (lambda p, a: lambda: p.run_prepared(a))(executorch, pte_args)
                except Exception as e:
                    executorch_error = one_line(e, limit=600)
            if compiled is not None and compile_error is None:
                try:
                    start = time.perf_counter()
                    out = compiled(*args).numpy()
                    if compile_s is None:
                        compile_s = round(time.perf_counter() - start, 2)
                    checks["torch.compile"] = parity(out, ref)
                    fns["torch.compile"] = lambda: compiled(*args)
                except Exception as e:
                    compile_error = one_line(e)
            timings = measure_interleaved(fns, warmup=warmup, runs=runs)
            if ort_spin is not None:
                try:
                    timings[ORT_SPINNING], checks[ORT_SPINNING] = measure_spinning_ort(
                        ort_spin, threads, inputs, names, ref, warmup=warmup, runs=runs)
                except Exception as e:  # reported, not fatal, as for the first session
                    ort_error = one_line(e)
            for name, timing in timings.items():
                row["runtimes"][name] = dict(timing, parity=checks[name])
        rows.append(row)

    result = {
        "model": subject.name,
        "family": subject.family,
        "target": target_name,
        "tuning": str(tuning_path.relative_to(root)) if tuning is not None else None,
        "ort_goal": subject.ort_goal,
        "bucket": dims or None,
        "variants": {
            name: {"flags": b.flags, "rewrites": b.rewrites, "export_s": b.export_s, "compile_s": b.compile_s,
                   "vmfb_bytes": b.vmfb_bytes, "vmfb_sha256": sha256_file(b.vmfb)}
            for name, b in variants.items()
        },
        "cases": rows,
        "errors": {k: v for k, v in {"onnxruntime": ort_error, "torch.compile": compile_error,
                                     "executorch": executorch_error}.items() if v},
        "torch_compile_s": compile_s,
        "not_measured": skipped,
    }
    result["goal"] = goal_status(result)
    if profile_top and not all(g["met"] for g in result["goal"].values()):
        result["profile"] = _profile(subject, variants["tuned"], target, root, case=subject.cases[-1],
                                     top=profile_top)
    return result


def goal_status(result: dict) -> dict:
    """Per case: vmfb (tuned) / eager ≤ 1.0, and / ONNX Runtime ≤ 1.5 where that goal applies."""
    status = {}
    for row in result["cases"]:
        rt = row["runtimes"]
        vmfb = rt["vmfb:tuned"]["median_ms"]
        eager_ratio = vmfb / rt["eager"]["median_ms"]
        entry = {"vs_eager": round(eager_ratio, 3), "met": eager_ratio <= GOAL_EAGER_RATIO}
        if "onnxruntime" in rt:
            ort_ratio = vmfb / rt["onnxruntime"]["median_ms"]
            entry["vs_onnxruntime"] = round(ort_ratio, 3)
            if result["ort_goal"]:
                entry["met"] = entry["met"] and ort_ratio <= GOAL_ORT_RATIO
        status[row["case"]] = entry
    return status


def _profile(subject: Subject, built: Built, target: dict, root: Path, *, case: dict, top: int):
    """The profiler's top dispatches of the shipped variant, with the source op and module path."""
    try:
        from dsa.tools import profiler as profile
    except ImportError:
        return {"error": "dsa.tools.profiler is not available"}
    try:
        tuning_path = root / "toolchains" / "tuning" / f"{subject.family}.{target['name']}.json"
        result = profile.profile_model(
            subject.manifest, built.irpa, root / "toolchains" / "targets" / f"{target['name']}.json",
            bucket=subject.bucket, inputs=case, top=top,
            tuning=load_tuning(tuning_path) if tuning_path.exists() else None,
            pythonpath=[str(root)], rewrites=None,
        )
        keep = ("total_ms", "dispatch_ms", "dispatch_calls", "flags", "vmfb_sha256", "runs")
        return dict({k: result[k] for k in keep}, dispatches=result["dispatches"][:top])
    except Exception as e:  # the profile is evidence for the report; its failure must not hide the numbers
        return {"error": one_line(e)}
