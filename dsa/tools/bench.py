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
dispatches are listed. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import read_json, sha256_file, write_bytes_atomic, write_json_atomic
from dsa.core.runtime_flags import merge_runtime_flags
from dsa.runtime import iree_flags
from dsa.runtime.policy import read_module_index

RESULTS_FORMAT = 1
# Parity bound of every runtime against eager, as in the models' tests: |x - eager| <= REL_TOL * max(1, |eager|).
REL_TOL = 2e-4
# The goal of the performance work (issue: beat eager, close in on ONNX Runtime).
GOAL_EAGER_RATIO = 1.0
GOAL_ORT_RATIO = 1.5


# -- timing ------------------------------------------------------------------------------------------
def measure(fn: Callable[[], object], *, warmup: int, runs: int) -> dict:
    """Calls fn `warmup` times untimed, then `runs` times; median and p90 in milliseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return summarize(samples)


def measure_interleaved(fns: Dict[str, Callable[[], object]], *, warmup: int, runs: int,
                        rounds: int = 5) -> Dict[str, dict]:
    """Times several functions in alternating rounds (each round gives every function runs/rounds calls),
    so a machine slowing down or speeding up mid-measurement biases none of them; median and p90 per name."""
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    per_round = [runs // rounds + (1 if r < runs % rounds else 0) for r in range(rounds)]
    for count in per_round:
        for name, fn in fns.items():
            for _ in range(count):
                start = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: summarize(values) for name, values in samples.items()}


def summarize(samples_ms: Sequence[float]) -> dict:
    if not samples_ms:
        raise ValueError("no samples")
    ordered = sorted(samples_ms)
    p90 = float(np.percentile(ordered, 90))
    return {"median_ms": round(statistics.median(ordered), 4), "p90_ms": round(p90, 4), "runs": len(ordered)}


def parity(out: np.ndarray, ref: np.ndarray) -> dict:
    err = float(np.abs(np.asarray(out, dtype=np.float64) - ref).max()) if out.shape == ref.shape else float("inf")
    bound = REL_TOL * max(1.0, float(np.abs(ref).max()))
    return {"max_abs_err": err, "bound": bound, "ok": bool(err <= bound)}


# -- machine -----------------------------------------------------------------------------------------
def _cpuinfo(key: str) -> Optional[str]:
    """The value of the first `key` line of /proc/cpuinfo, or None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> List[str]:
    return (_cpuinfo("flags") or "").split()


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or "unknown"


def best_target(flags: Sequence[str], targets_dir: Path, arch: Optional[str] = None) -> str:
    """The most capable target of `targets_dir` (the one needing the most CPU features) that a CPU of `arch`
    (default: this machine's) with `flags` runs, by each spec's `host` requirements (dsa.runtime.host)."""
    from dsa.runtime.host import host_arch, missing_for

    specs = [read_json(p) for p in sorted(targets_dir.glob("*.json"))]
    fitting = [s for s in specs if s.get("host") and missing_for(s, arch or host_arch(), flags) is None]
    if not fitting:
        raise DsaError(str(targets_dir), "no target spec fits this machine's CPU",
                       "pass --target NAME, or add a target for this CPU (docs/architecture.md)")
    return max(fitting, key=lambda s: (len(s["host"].get("cpu_features", [])), s["name"]))["name"]


def machine_info(threads: int) -> dict:
    flags = cpu_flags()
    return {
        "cpu": cpu_model(),
        "cores_available": threads,
        "threads": threads,
        "avx512": "avx512f" in flags,
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.release()}",
    }


# -- subjects ----------------------------------------------------------------------------------------
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


# -- building variants -------------------------------------------------------------------------------
@dataclasses.dataclass
class Built:
    vmfb: Path
    record: dict
    irpa: Path
    flags: List[str]
    rewrites: Dict[str, int]
    export_s: float
    compile_s: float
    vmfb_bytes: int


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


class IreeModule:
    """One vmfb + its parameter archive, loaded with iree.runtime on the target's driver."""

    def __init__(self, built: Built, driver: str):
        import iree.runtime as rt

        instance = rt.VmInstance()
        self.device = rt.get_device(driver)
        params = rt.ParameterIndex()
        params.load(str(built.irpa))
        modules = [
            rt.create_hal_module(instance, self.device),
            rt.create_io_parameters_module(instance, params.create_provider(scope=built.record["parameter_scope"])),
        ]
        vm_module = rt.VmModule.copy_buffer(instance, built.vmfb.read_bytes())
        context = rt.VmContext(instance, modules=modules + [vm_module])
        self.invoke = rt.FunctionInvoker(context, self.device, vm_module.lookup_function(built.record["function"]))
        self.names = [s["name"] for s in built.record["inputs"]]

    def __call__(self, inputs: Dict[str, np.ndarray]) -> np.ndarray:
        result = self.invoke(*[inputs[n] for n in self.names])
        result = result[0] if isinstance(result, (list, tuple)) else result
        return np.asarray(result.to_host())


# -- quantised matmuls at OpenVLA's real sizes --------------------------------------------------------
# //models:openvla is a scaled-down stand-in (256-wide decoder): its fp32 weights (21 MB) sit in the CPU's
# caches, where packing cannot pay. OpenVLA's own decoder is Llama-2-7B's (4096 wide, 11008-wide MLP, 32
# layers: 13 GB fp32, memory-bound in every decode step). These rows time exactly the layers it is made of,
# at those sizes, as the build compiles them (dsa.stages.quant's op, the target's flags and the quantised-model
# flags of dsa.stages.compile; manifests/openvla*.yaml name no tuning family).
QUANT_LAYERS = (("attention q/k/v/o", 4096, 4096), ("MLP gate/up", 11008, 4096), ("MLP down", 4096, 11008))
QUANT_ROWS = ((1, "decode step"), (64, "prefill, 64 tokens"))
QUANT_SCHEMES = (("fp32", {"kind": "none"}), ("int8 g32", {"kind": "int8", "group_size": 32}),
                 ("int4 g32", {"kind": "int4", "group_size": 32}))
QUANT_LAYERS_SUBJECT = "quant_layers"  # its name for --models


def _quant_layer_module(out_f: int, in_f: int, scheme: dict, weight: np.ndarray, work: Path) -> Built:
    """One linear layer (no bias) with `weight`, quantised by `scheme` as DsaParams would, exported with its
    parameters outside the module; compiled by the caller."""
    import torch
    from iree.turbine import aot

    from dsa.stages.export import PARAMETER_SCOPE
    from dsa.stages.quant import SCALE_SUFFIX, quantize_module, quantize_weight

    work.mkdir(parents=True, exist_ok=True)
    layer = torch.nn.Sequential(torch.nn.Linear(in_f, out_f, bias=False)).eval()
    if scheme["kind"] == "none":
        layer[0].weight.data.copy_(torch.from_numpy(weight))
    else:
        quantize_module(layer, scheme)
        parts = quantize_weight(weight, scheme)
        layer[0].weight.copy_(torch.from_numpy(parts[""]))
        getattr(layer[0], "weight" + SCALE_SUFFIX).copy_(torch.from_numpy(parts[SCALE_SUFFIX]))
    aot.externalize_module_parameters(layer, external_scope=PARAMETER_SCOPE)
    return layer


def bench_quant_layers(root: Path, target_name: str, work: Path, *, runs: int, warmup: int,
                       light: bool = False) -> List[dict]:
    """Each OpenVLA decoder layer shape x each row count x fp32 / int8 / int4: latency (median/p90 of
    `runs` calls, alternating the three schemes), output parity against the fp32 layer on the same
    dequantised weights, and the bytes of weights each reads. `light`: the decode step (one row) only."""
    import torch
    from iree.turbine import aot

    from dsa.stages.compile import compile_module
    from dsa.stages.export import PARAMETER_SCOPE
    from dsa.stages.quant import SCALE_SUFFIX, dequantize, quantize_weight

    target = read_json(root / "toolchains" / "targets" / f"{target_name}.json")
    rng = np.random.default_rng(0)
    rows = []
    for label, out_f, in_f in QUANT_LAYERS:
        weight = (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)
        for n_rows, what in QUANT_ROWS[:1] if light else QUANT_ROWS:
            x = rng.standard_normal((n_rows, in_f)).astype(np.float32)
            modules, weights_bytes, outputs, checks = {}, {}, {}, {}
            for name, scheme in QUANT_SCHEMES:
                sub = work / f"{out_f}x{in_f}_{n_rows}_{scheme['kind']}"
                layer = _quant_layer_module(out_f, in_f, scheme, weight, sub)
                with torch.no_grad():
                    program = torch.export.export(layer, (torch.from_numpy(x),), strict=False)
                (sub / "model.mlir").write_text(str(aot.export(program).mlir_module))
                aot.save_module_parameters(str(sub / "params.irpa"), layer)
                view = {"model_id": "layer", "quant_scheme": scheme, "target": target_name, "tuning": None}
                report = compile_module(sub / "model.mlir", view, target, sub / "model.vmfb",
                                        where=f"{label} {scheme['kind']}")
                record = {"parameter_scope": PARAMETER_SCOPE, "function": "main", "inputs": [{"name": "x"}]}
                built = Built(sub / "model.vmfb", record, sub / "params.irpa", report["flags"], {}, 0.0, 0.0,
                              report["vmfb_bytes"])
                modules[name] = IreeModule(built, target["runtime_driver"])
                weights_bytes[name] = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
                outputs[name] = modules[name]({"x": x})
                # Exactness: the same math in float64 on the weights the module holds (dequantised).
                held = weight if scheme["kind"] == "none" else dequantize(
                    *(lambda parts: (parts[""], parts[SCALE_SUFFIX]))(quantize_weight(weight, scheme)),
                    {"shape": [out_f, in_f], "kind": scheme["kind"], "group_size": scheme["group_size"]})
                checks[name] = parity(outputs[name], x.astype(np.float64) @ held.T.astype(np.float64))
            ref = x.astype(np.float64) @ weight.T.astype(np.float64)
            fns = {name: (lambda m: lambda: m({"x": x}))(m) for name, m in modules.items()}
            timings = measure_interleaved(fns, warmup=warmup, runs=runs)
            scale = float(np.abs(ref).max())
            rows.append({
                "layer": label, "shape": [out_f, in_f], "rows": n_rows, "case": what,
                "schemes": {name: dict(timings[name], parity=checks[name], weight_bytes=weights_bytes[name],
                                       rel_error=round(float(np.abs(outputs[name] - ref).max()) / scale, 6))
                            for name in modules},
            })
            del modules
    return rows


def render_quant_layers(rows: List[dict]) -> List[str]:
    lines = [
        "", "## Quantised matmuls at OpenVLA's real layer sizes", "",
        "The layers of OpenVLA's Llama-2-7B decoder at their real sizes, each as the build compiles it "
        "(fp32; `dsa.stages.quant`'s fused op for int8/int4, group 32; the target's flags), one row "
        "(a decode step at batch 1: memory-bound) and 64 rows (a prefill chunk: compute-bound), timed in "
        "alternating rounds. Each output is checked (✗) against float64 on the weights the module holds "
        "(dequantised for int8/int4); error: max |int4 out − float reference| / max |reference| on the float "
        "weights, i.e. int4's rounding (random Gaussian weights: its worst case).",
        "",
        "| layer | [out, in] | case | fp32 ms | int8 ms | int4 ms | int4 / fp32 | weights fp32 → int4 | int4 error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sc = r["schemes"]
        ratio = sc["int4 g32"]["median_ms"] / sc["fp32"]["median_ms"]
        lines.append(
            f"| {r['layer']} | {r['shape'][0]}×{r['shape'][1]} | {r['case']} | {_ms(sc['fp32'])} "
            f"| {_ms(sc['int8 g32'])} | {_ms(sc['int4 g32'])} | {ratio:.2f} "
            f"| {sc['fp32']['weight_bytes'] / 2**20:.0f} → {sc['int4 g32']['weight_bytes'] / 2**20:.1f} MiB "
            f"| {sc['int4 g32']['rel_error']:.1e} |")
    return lines


# -- the other runtimes ------------------------------------------------------------------------------
def ort_session(eager, args, names: List[str], path: Path, threads: int):
    import onnxruntime as ort
    import torch

    program = torch.onnx.export(eager, tuple(args), dynamo=True, input_names=names, verbose=False)
    program.save(str(path))
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = [i.name for i in session.get_inputs()]
    return session, feeds


def _error(e: BaseException, limit: int = 200) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:limit] if text else ''}"


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
    tuning = read_json(tuning_path) if tuning_path.exists() else None
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


def executorch_available() -> bool:
    """Whether ExecuTorch's package imports here (the benchmark runs in the ExecuTorch environment under `bazel
    run`). Its runtime subpackage is looked up, so that a module merely named `executorch` does not count."""
    import importlib.util

    try:
        return importlib.util.find_spec("executorch.runtime") is not None
    except (ImportError, ValueError):
        return False


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
    ort_error = None
    if with_ort:
        try:
            ort = ort_session(eager, cases[0].args, names, work / f"{subject.name}.onnx", threads)
        except Exception as e:  # reported in the results, not fatal
            ort_error = _error(e)
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
            executorch_error = _error(e, limit=600)  # the lowering's reason comes last
    compiled = None
    compile_error = None
    compile_s = None
    if with_compile:
        try:
            compiled = torch.compile(eager)
        except Exception as e:
            compile_error = _error(e)

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
                    executorch_error = _error(e, limit=600)
            if compiled is not None and compile_error is None:
                try:
                    start = time.perf_counter()
                    out = compiled(*args).numpy()
                    if compile_s is None:
                        compile_s = round(time.perf_counter() - start, 2)
                    checks["torch.compile"] = parity(out, ref)
                    fns["torch.compile"] = lambda: compiled(*args)
                except Exception as e:
                    compile_error = _error(e)
            timings = measure_interleaved(fns, warmup=warmup, runs=runs)
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
            tuning=read_json(tuning_path) if tuning_path.exists() else None,
            pythonpath=[str(root)], rewrites=None,
        )
        keep = ("total_ms", "dispatch_ms", "dispatch_calls", "flags", "vmfb_sha256", "runs")
        return dict({k: result[k] for k in keep}, dispatches=result["dispatches"][:top])
    except Exception as e:  # the profile is evidence for the report; its failure must not hide the numbers
        return {"error": _error(e)}


# -- LeRobot policies: the shipped modules against eager LeRobot, in the LeRobot environment -------------
POLICIES_INDEX = "models/policies_index.json"
# The benchmark waits (up to QUIET_WAIT_S) for the 1-minute load average to fall below this before each
# policy, and reports the load beside every number: eager PyTorch slows down far more than IREE when the
# cores are shared, so a loaded measurement flatters the vmfb.
QUIET_LOAD = 1.5
QUIET_WAIT_S = 60


@dataclasses.dataclass
class Policy:
    """One LeRobot policy the repository builds: its module index and its LeRobot policy directory."""

    name: str
    index: Path
    policy_dir: Path


def lerobot_policies(root: Path) -> List[Policy]:
    """The LeRobot policies of the policies index (models/BUILD.bazel's dsa_policies), in its order."""
    path = root / POLICIES_INDEX
    if not path.is_file():
        raise DsaError(str(path), "no policies index", "run the benchmark with `bazel run //bench`, which builds it")
    rows = read_json(path)["policies"]
    return [Policy(r["name"], root / r["index"], (root / r["policy_config"]).parent)
            for r in rows if r.get("policy_config")]


def load_average() -> float:
    return os.getloadavg()[0]


def wait_for_quiet(limit: float = QUIET_LOAD, wait_s: float = QUIET_WAIT_S) -> dict:
    """Waits until the 1-minute load average is below `limit` (at most `wait_s`); returns what it saw."""
    start = time.monotonic()
    load = load_average()
    while load >= limit and time.monotonic() - start < wait_s:
        time.sleep(5)
        load = load_average()
    return {"load": round(load, 2), "waited_s": round(time.monotonic() - start, 1), "quiet": load < limit}


def eager_lerobot(policy, names: List[str], steps: Optional[int]):
    """LeRobot's own eager inference on one policy (what a robot runs without rules_dsa), as a torch module
    of positional tensors, so ONNX Runtime and torch.compile get exactly the same computation."""
    import torch

    from dsa.frontends.lerobot import POLICY_TYPES

    reference = POLICY_TYPES[policy.config.type].reference

    class EagerLeRobot(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.policy = policy

        def forward(self, *tensors):
            return reference(self.policy, dict(zip(names, tensors)), steps)

    return EagerLeRobot().eval()


def onnx_candidates(eager, policy, steps: Optional[int]):
    """What ONNX Runtime runs for a LeRobot policy: its eager call, exported by torch's ONNX exporter; for
    Diffusion Policy, whose eager sampling loop does not export (its scheduler indexes tables with
    data-dependent timesteps), next the front end's unrolled form of the same call (LeRobot's own
    generate_actions with the timesteps pinned as ints; equal to eager in dsa.frontends.lerobot's tests) when
    the step count is the config's. Each is checked against eager in the same run."""
    yield eager
    if policy.config.type == "diffusion" and steps in (None, policy.diffusion.num_inference_steps):
        yield _unrolled_with_constant_table(policy)


def _unrolled_with_constant_table(policy):
    """The front end's unrolled Diffusion Policy with its DDIM table (`alphas_cumprod`, computed in the graph
    for IREE) as a constant: torch's ONNX exporter lowers `cumprod` to `prims.prod`, which has no ONNX
    function. The constant is the same float32 table (bit-identical to diffusers'), computed once here."""
    import unittest.mock

    import torch

    from dsa.frontends.lerobot import diffusion

    cfg = policy.config
    table = diffusion.alphas_cumprod(cfg.num_train_timesteps, cfg.beta_schedule, cfg.beta_start, cfg.beta_end)
    unrolled = diffusion.adapter(policy, "unrolled").eval()

    class ConstantTable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unrolled = unrolled

        def forward(self, *args):
            with unittest.mock.patch.object(diffusion, "alphas_cumprod", lambda *schedule: table):
                return self.unrolled(*args)

    return ConstantTable().eval()


def policy_case(policy: Policy, compiled):
    """The case a LeRobot policy is timed on (the benchmark's and the tuner's): batch-1 inputs sampled from
    its smallest module's record (seeded), the runtime's default step count where the module takes one, and
    eager LeRobot on the same inputs. Returns (inputs, observation names, steps, the LeRobot policy, the
    eager module, its tensor arguments, its output as float64)."""
    import torch

    from dsa.frontends.lerobot import load_pretrained
    from dsa.runtime.policy import sample_inputs

    record = compiled.modules[0].record
    inputs = sample_inputs(record, {"batch": 1}, np.random.default_rng(0))
    names = [spec["name"] for spec in record["inputs"]]
    steps = None
    if "steps" in names:
        steps = int(compiled.runtime_view.get("flow_steps") or 10)
        inputs["steps"] = np.array(steps, dtype=np.int64)
    observation = [n for n in names if n != "steps"]
    policy_obj = load_pretrained(policy.policy_dir)
    eager = eager_lerobot(policy_obj, observation, steps)
    args = [torch.from_numpy(np.asarray(inputs[n])) for n in observation]
    with torch.no_grad():
        ref = eager(*args).numpy().astype(np.float64)
    return inputs, observation, steps, policy_obj, eager, args, ref


def bench_policy(policy: Policy, *, runs: int, warmup: int, threads: int, work: Path, with_ort: bool = True,
                 with_compile: bool = True, wait_s: float = QUIET_WAIT_S) -> dict:
    """The policy's shipped module (its smallest bucket, batch 1, the runtime's default step count) against
    eager LeRobot, ONNX Runtime and torch.compile on the same inputs, in alternating rounds."""
    import torch

    from dsa.runtime.policy import CompiledPolicy

    torch.set_num_threads(threads)
    compiled = CompiledPolicy(policy.index)
    module = compiled.modules[0]
    inputs, observation, steps, policy_obj, eager, args, ref = policy_case(policy, compiled)
    case = ", ".join(["batch=1"] + ([f"steps={steps}"] if steps is not None else []))
    errors: Dict[str, str] = {}
    fns: Dict[str, Callable[[], object]] = {"eager": lambda: eager(*args),
                                            "vmfb": lambda: compiled.run(inputs)}
    checks = {"eager": parity(ref, ref), "vmfb": parity(compiled.run(inputs)[0][0], ref)}
    if with_ort:
        for candidate in onnx_candidates(eager, policy_obj, steps):
            try:
                session, feeds = ort_session(candidate, args, observation, work / f"{policy.name}.onnx", threads)
                feed = {f: np.asarray(inputs[n]) for f, n in zip(feeds, observation)}
                checks["onnxruntime"] = parity(session.run(None, feed)[0], ref)
                fns["onnxruntime"] = lambda: session.run(None, feed)
                errors.pop("onnxruntime", None)
                break
            except Exception as e:  # reported, not fatal: not every policy exports to ONNX
                errors.setdefault("onnxruntime", _error(e))
    compile_s = None
    if with_compile:
        try:
            fast = torch.compile(eager)
            start = time.perf_counter()
            with torch.no_grad():
                out = fast(*args).numpy()
            compile_s = round(time.perf_counter() - start, 2)
            checks["torch.compile"] = parity(out, ref)
            fns["torch.compile"] = lambda: fast(*args)
        except Exception as e:
            errors["torch.compile"] = _error(e)
    quiet = wait_for_quiet(wait_s=wait_s)
    with torch.no_grad():
        timings = measure_interleaved(fns, warmup=warmup, runs=runs)
    runtimes = {name: dict(timing, parity=checks[name]) for name, timing in timings.items()}
    vmfb = runtimes["vmfb"]["median_ms"]
    goal = {"vs_eager": round(vmfb / runtimes["eager"]["median_ms"], 3)}
    goal["met"] = goal["vs_eager"] <= GOAL_EAGER_RATIO
    if "onnxruntime" in runtimes:
        goal["vs_onnxruntime"] = round(vmfb / runtimes["onnxruntime"]["median_ms"], 3)
    bucket = module.bucket
    return {
        "model": policy.name,
        "target": compiled.index["target"],
        "module": module.vmfb.name,
        # The module timed, by content: the import matrix takes this latency for the build with these bytes.
        "vmfb_sha256": sha256_file(module.vmfb),
        "bucket": {bucket["dim"]: bucket["size"]} if bucket else None,
        "case": case,
        "runtimes": runtimes,
        "goal": goal,
        "load": {"before": quiet, "after": round(load_average(), 2)},
        "errors": errors,
        "torch_compile_s": compile_s,
    }


def pipeline_bundle(root: Path, name: str) -> Optional[Path]:
    """The policy's whole-pipeline bundle (//models:<name>_pipeline_bundle) in the runfiles, if it is built."""
    path = root / "models" / f"{name}_pipeline_bundle.tar"
    return path if path.is_file() else None


def bench_end_to_end(policy: Policy, bundle: Path, *, runs: int, warmup: int, threads: int) -> dict:
    """Raw observation → raw action, one inference step (the action queue empty, so the network runs): the
    bundle's pipeline in the runtime (dsa.runtime.load: prepare, LeRobot's processors in numpy / tokenizers,
    the module, the postprocessor) against LeRobot's own loop on the same raw observation
    (`predict_action`: prepare_observation_for_inference, preprocessor, select_action, postprocessor), each
    `reset()` first, in alternating rounds."""
    import copy

    import torch

    import dsa.runtime
    from dsa.frontends.lerobot import load_pretrained
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.utils.control_utils import predict_action

    torch.set_num_threads(threads)
    ours = dsa.runtime.load(bundle, seed=0)
    try:
        spec = ours.pipeline.spec
        rng = np.random.default_rng(0)
        obs = {k: rng.integers(0, 256, size=v["shape"], dtype=np.uint8) if v["dtype"] == "uint8"
               else rng.normal(size=v["shape"]).astype(np.float32)
               for k, v in spec["observation"].items() if k != "task"}
        task = "pick up the red cube and place it in the bin" if "task" in spec["observation"] else None
        theirs = load_pretrained(policy.policy_dir)
        processors = ours.bundle.root  # the bundle's own processor files (and tokenizer)
        overrides = ({"tokenizer_processor": {"tokenizer_name": str(processors)}} if task is not None else {})
        pre, post = make_pre_post_processors(theirs.config, pretrained_path=str(processors),
                                             preprocessor_overrides=overrides)

        # The same noise on both sides (the bundle draws from np.random.default_rng(seed), restarted by reset()),
        # so the two raw actions can be compared.
        noise = spec["loop"]["noise"]
        draws = {"rng": np.random.default_rng(0)}

        def draw(*_):
            return torch.from_numpy(draws["rng"].standard_normal(noise["shape"], dtype=np.float32))

        if noise is not None and theirs.config.type == "diffusion":
            original = theirs.predict_action_chunk
            theirs.predict_action_chunk = lambda batch, noise=None: original(batch, noise=draw())
        elif noise is not None:
            theirs.model.sample_noise = draw

        def lerobot_step():
            theirs.reset()
            draws["rng"] = np.random.default_rng(0)
            return predict_action(copy.deepcopy(obs), theirs, torch.device("cpu"), pre, post, use_amp=False,
                                  task=task, robot_type=None)

        def bundle_step():
            ours.reset()
            return ours.select_action(obs, task=task)

        with torch.no_grad():
            ref = lerobot_step().numpy().reshape(-1).astype(np.float64)
            checks = {"lerobot": parity(ref, ref), "bundle": parity(bundle_step(), ref)}
            timings = measure_interleaved({"lerobot": lerobot_step, "bundle": bundle_step}, warmup=warmup,
                                          runs=runs)
        ours.reset()
        ours.select_action(obs, task=task)
        order = [n["name"] for n in spec["nodes"]]
        nodes = [[name, round(s * 1e3, 3)] for name, s in sorted(
            ours.pipeline.timings.items(), key=lambda item: order.index(item[0]) if item[0] in order else -1)]
    finally:
        ours.close()
    return {
        "bundle": bundle.name,
        "lerobot": dict(timings["lerobot"], parity=checks["lerobot"]),
        "bundle_ms": dict(timings["bundle"], parity=checks["bundle"]),
        "ratio": round(timings["bundle"]["median_ms"] / timings["lerobot"]["median_ms"], 3),
        "nodes_ms": nodes,
    }


def policy_parameters(index: Path) -> int:
    """The parameter count of a module index's first module (its export record)."""
    from dsa.core.formats import ExportRecord, ModuleIndex

    first = ModuleIndex.read(index).modules[0][1]
    return int(ExportRecord.read(index.parent / first)["parameter_count"])


def not_runnable(index: Path) -> Optional[dict]:
    """{"target", "not_run": why} for a module index whose target this machine cannot execute (an AVX-512
    build on an AVX2 CPU), else None."""
    from dsa.core.formats import ModuleIndex
    from dsa.runtime.host import host_arch, host_cpu_features, missing_for

    spec = read_json(index.parent / ModuleIndex.read(index).target_spec)
    why = missing_for(spec, host_arch(), host_cpu_features())
    return None if why is None else {"target": spec["name"], "not_run": why}


# Light mode (CI, `--light`): every model and policy is its shipped module against eager only (no ONNX Runtime,
# no torch.compile, no ablation builds, no profile: together they took > 30 min of CI on 2 cores), and the
# quantised layers only at a decode step. A policy with at least FULL_SIZE_PARAMETERS parameters also gets only
# LIGHT_FULL_SIZE_RUNS calls (SmolVLA at SmolVLM2-500M size, ~450M: ~9 s per eager call; the threshold is above
# Diffusion Policy's 263M, whose call takes ~3 s and whose ONNX export minutes). `bazel run //bench` runs all.
FULL_SIZE_PARAMETERS = 300_000_000
LIGHT_FULL_SIZE_RUNS = 3
LIGHT_NOTE = "not measured in light mode: run `bazel run //bench`"
# ... and it does not wait for a quiet machine (on CI's 2 cores the bench itself keeps the load near 2, so
# every policy would wait the whole QUIET_WAIT_S): the load is still reported beside each row.


def run_lerobot_benchmark(root: Path, out: Path, *, models: Optional[Sequence[str]], runs: int, warmup: int,
                          threads: int, light: bool = False, full_size_light: bool = False) -> None:
    """The LeRobot half of `bazel run //bench`, run in the LeRobot environment: writes its rows to `out`."""
    set_iree_threads(threads)
    policies = lerobot_policies(root)
    if models:
        policies = [p for p in policies if p.name in set(models)]
    # One IREE runtime for every policy of this process, set up before the first device with the runtime
    # flags (a worker stack) the most demanding module that runs here needs.
    iree_flags.require(merge_runtime_flags(read_module_index(p.index).get("runtime_flags", [])
                                           for p in policies if not_runnable(p.index) is None), "dsa bench")
    rows = []
    with tempfile.TemporaryDirectory(prefix="dsa-bench-lerobot-") as tmp:
        for policy in policies:
            not_here = not_runnable(policy.index)
            if not_here is not None:
                print(f"dsa-bench: {policy.name} (LeRobot): not run on this machine: {not_here['not_run']}",
                      flush=True)
                rows.append(dict(model=policy.name, **not_here))
                continue
            full_size = (light or full_size_light) and policy_parameters(policy.index) >= FULL_SIZE_PARAMETERS
            eager_only = light or full_size
            print(f"dsa-bench: {policy.name} (LeRobot{', light: vs eager only' if eager_only else ''}) …",
                  flush=True)
            row = bench_policy(policy, runs=LIGHT_FULL_SIZE_RUNS if full_size else runs,
                               warmup=min(warmup, 1) if full_size else warmup, threads=threads, work=Path(tmp),
                               with_ort=not eager_only, with_compile=not eager_only,
                               wait_s=0 if light else QUIET_WAIT_S)
            if eager_only:
                row["errors"].update({k: LIGHT_NOTE for k in ("onnxruntime", "torch.compile")})
            bundle = pipeline_bundle(root, policy.name)
            if bundle is not None:
                print(f"dsa-bench: {policy.name} end to end (raw observation → raw action) …", flush=True)
                try:
                    row["end_to_end"] = bench_end_to_end(policy, bundle, runs=runs, warmup=warmup, threads=threads)
                except Exception as e:  # reported, not fatal
                    row["errors"]["end_to_end"] = _error(e)
            rows.append(row)
    write_json_atomic(out, {"format": RESULTS_FORMAT, "policies": rows})


def lerobot_python(root: Path) -> Optional[Path]:
    """The LeRobot environment's interpreter in this binary's runfiles (None outside Bazel)."""
    return _runfiles_python(root, "dsa_lerobot_python")


def _runfiles_python(root: Path, repository: str) -> Optional[Path]:
    for candidate in (root.parent / repository / "bin" / "python3", root / "external" / repository / "bin" / "python3"):
        if candidate.exists():
            return candidate
    return None


# -- reports -----------------------------------------------------------------------------------------
def _ms(entry: Optional[dict]) -> str:
    if not entry:
        return "—"
    mark = "" if entry["parity"]["ok"] else " ✗"
    return f"{entry['median_ms']:.2f} / {entry['p90_ms']:.2f}{mark}"


def _short(items: Sequence[str], keep: int = 3) -> str:
    if not items:
        return "—"
    shown = ", ".join(f"`{i}`" for i in items[:keep])
    return shown + (f" +{len(items) - keep} more" if len(items) > keep else "")


def _measured_note(results: dict) -> str:
    """Which rows were measured again later (`--update`), if any."""
    dates: Dict[str, List[str]] = {}
    for section in ("models", "policies"):
        for r in results.get(section, []):
            if r.get("measured"):
                dates.setdefault(r["measured"], []).append(r["model"])
    if len(dates) <= 1:
        return ""
    return " Rows measured in separate runs: " + "; ".join(
        f"{date}: {', '.join(names)}" for date, names in sorted(dates.items())) + "."


def render_markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# Benchmark results",
        "",
        f"Generated by `bazel run //bench` (dsa/tools/bench.py) on {results['date']}; do not edit by hand."
        + _measured_note(results),
        "",
        f"Machine: {m['cpu']}, {m['threads']} threads (AVX-512: {'yes' if m['avx512'] else 'no'}), "
        f"{m['system']}, Python {m['python']}. CPU target: **{results['target']}**. Batch 1; every runtime "
        f"uses {m['threads']} threads; {results['warmup']} warm-up calls, then {results['runs']} timed calls.",
        "Cells are median / p90 in ms; ✗ marks an output outside the parity bound "
        f"(|x − eager| ≤ {REL_TOL:g}·max(1, |eager|)).",
        *(["Light run (`--light`, what CI prints): each shipped module against eager only (no ONNX Runtime, "
           "torch.compile, ablation builds or profile), full-size policies (≥ "
           f"{FULL_SIZE_PARAMETERS // 10**6}M parameters) {LIGHT_FULL_SIZE_RUNS} calls, quantised layers at a "
           "decode step only, no wait for a quiet machine (the load is beside each policy); `bazel run //bench` "
           "runs everything."] if results.get("light") else []),
        *([f"`--full-size-light`: full-size policies (≥ {FULL_SIZE_PARAMETERS // 10**6}M parameters) get "
           f"{LIGHT_FULL_SIZE_RUNS} calls against eager only (their ONNX export and torch.compile take over "
           "30 min on 2 cores)."] if results.get("full_size_light") and not results.get("light") else []),
        "",
        "## Latency",
        "",
        "| model | case | eager | vmfb default | vmfb rewrites | vmfb tuned | ONNX Runtime | torch.compile "
        "| ExecuTorch (XNNPACK) | tuned / eager | tuned / ORT | tuned / ExecuTorch | goal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["models"]:
        for row in r["cases"]:
            rt = row["runtimes"]
            g = r["goal"][row["case"]]
            ort_ratio = f"{g['vs_onnxruntime']:.2f}" if "vs_onnxruntime" in g else "—"
            et = rt.get("executorch")
            et_ratio = f"{rt['vmfb:tuned']['median_ms'] / et['median_ms']:.2f}" if et and "vmfb:tuned" in rt else "—"
            lines.append(
                f"| {r['model']} | {row['case']} | {_ms(rt.get('eager'))} | {_ms(rt.get('vmfb:default'))} "
                f"| {_ms(rt.get('vmfb:rewrites'))} | {_ms(rt.get('vmfb:tuned'))} | {_ms(rt.get('onnxruntime'))} "
                f"| {_ms(rt.get('torch.compile'))} | {_ms(et)} | {g['vs_eager']:.2f} | {ort_ratio} | {et_ratio} "
                f"| {'met' if g['met'] else '**not met**'} |")
    lines += [
        "",
        f"Goal: vmfb tuned / eager ≤ {GOAL_EAGER_RATIO}; for pi0 and the transformer control also "
        f"tuned / ONNX Runtime ≤ {GOAL_ORT_RATIO}. ExecuTorch is the Plan B (dsa_pte: the same model and "
        "checkpoint lowered to an XNNPACK .pte, docs/frontends.md); tuned / ExecuTorch < 1 means the vmfb is "
        "faster.",
    ]
    for r in results["models"]:
        if r.get("errors", {}).get("executorch"):
            lines.append(f"{r['model']}: ExecuTorch {r['errors']['executorch']}")
    if results.get("policies"):
        lines += [
            "",
            "## LeRobot policies: the shipped modules",
            "",
            "Each LeRobot policy the repository builds, as `bazel build //models:<name>` ships it (its own "
            "target and tuning; the smallest bucket, batch 1, the manifest's step count) against LeRobot's "
            "own eager inference on the same policy directory (`PolicyClass.from_pretrained`, "
            "`predict_action_chunk` / `generate_actions`), ONNX Runtime and torch.compile of that same eager "
            "call, in the LeRobot environment, timed in alternating rounds. `load` is the 1-minute load "
            f"average before (after waiting up to {QUIET_WAIT_S} s for it to fall below {QUIET_LOAD}) and after.",
            "",
            "| policy | target | module | case | eager LeRobot | vmfb | ONNX Runtime | torch.compile "
            "| vmfb / eager | vmfb / ORT | load | goal |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results["policies"]:
            if "not_run" in r:
                lines.append(f"| {r['model']} | {r['target']} | — | — | — | — | — | — | — | — | — "
                             f"| not run on this machine: {r['not_run']} |")
                continue
            rt, g = r["runtimes"], r["goal"]
            ort_ratio = f"{g['vs_onnxruntime']:.2f}" if "vs_onnxruntime" in g else "—"
            lines.append(
                f"| {r['model']} | {r['target']} | `{r['module']}` | {r['case']} | {_ms(rt.get('eager'))} "
                f"| {_ms(rt.get('vmfb'))} | {_ms(rt.get('onnxruntime'))} | {_ms(rt.get('torch.compile'))} "
                f"| {g['vs_eager']:.2f} | {ort_ratio} | {r['load']['before']['load']:.1f} → {r['load']['after']:.1f} "
                f"| {'met' if g['met'] else '**not met**'} |")
        ends = [r for r in results["policies"] if r.get("end_to_end")]
        if ends:
            lines += [
                "",
                "### End to end: raw observation → raw action",
                "",
                "The whole-pipeline bundle (`//models:<name>_pipeline_bundle`, docs/policy-pipeline.md) run by "
                "`dsa.runtime.load` — LeRobot's processor steps in numpy (and `tokenizers`), the module, the "
                "un-normalisation — against LeRobot's own loop (`predict_action`: its preprocessor, "
                "`select_action`, its postprocessor) on the same raw observation (uint8 camera frames, raw "
                "state, task text), one inference step each (`reset()` first, so the network runs), in "
                "alternating rounds. `nodes` is one bundle step's time per pipeline node.",
                "",
                "| policy | LeRobot loop | bundle | bundle / LeRobot | nodes (ms) |",
                "|---|---|---|---|---|",
            ]
            for r in ends:
                e = r["end_to_end"]
                nodes = ", ".join(f"{n} {v:.2f}" for n, v in e["nodes_ms"])
                lines.append(f"| {r['model']} | {_ms(e['lerobot'])} | {_ms(e['bundle_ms'])} | {e['ratio']:.2f} "
                             f"| {nodes} |")
        for r in results["policies"]:
            if r.get("errors"):
                lines.append("")
                lines.append(f"{r['model']}: " + "; ".join(f"{k} not measured ({v})" for k, v in r["errors"].items()))
    if results.get("quant_layers"):
        lines += render_quant_layers(results["quant_layers"])
    lines += [
        "",
        "## Graph rewrites: before / after",
        "",
        "Each line compares the shipped (tuned) module with the same module built without one rewrite "
        "(dsa/stages/passes.py), or, for a default rewrite the model's manifest opts out of, with it. Rewrites that "
        "found nothing to rewrite in a model have no line.",
        "",
        "| model | case | rewrite | rewrites made | without (ms) | with (ms) | change |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["models"]:
        fired = {k: v for k, v in r["variants"]["tuned"]["rewrites"].items() if v}
        opted_out = {k[1:]: r["variants"][k]["rewrites"][k[1:]] for k in r["variants"] if k.startswith("+")}
        for row in r["cases"]:
            rt = row["runtimes"]
            pairs = [(name, count, rt.get(f"vmfb:-{name}"), rt["vmfb:tuned"], "") for name, count in fired.items()]
            pairs += [(name, count, rt["vmfb:tuned"], rt.get(f"vmfb:+{name}"), " (not used: manifest opts out)")
                      for name, count in opted_out.items()]
            for name, count, without, with_, note in pairs:
                if without is None or with_ is None:
                    continue
                change = (with_["median_ms"] - without["median_ms"]) / without["median_ms"] * 100
                lines.append(f"| {r['model']} | {row['case']} | `{name}`{note} | {count} "
                             f"| {without['median_ms']:.2f} | {with_['median_ms']:.2f} | {change:+.1f}% |")
    lines += ["", "## Builds", "", "| model | variant | export s | compile s | vmfb bytes | flags beyond the target's |",
              "|---|---|---|---|---|---|"]
    for r in results["models"]:
        # Flags beyond the target's: those the default build (target flags only) does not pass; a light run
        # builds no default to compare with.
        base = set(r["variants"]["default"]["flags"]) if "default" in r["variants"] else None
        for name, v in r["variants"].items():
            extra = ("(light run: no default build)" if base is None
                     else " ".join(f"`{f}`" for f in v["flags"] if f not in base) or "—")
            lines.append(f"| {r['model']} | {name} | {v['export_s']} | {v['compile_s']} | {v['vmfb_bytes']} | {extra} |")
    for r in results["models"]:
        if r.get("errors"):
            lines += ["", f"{r['model']}: not measured — " + "; ".join(f"{k}: {v}" for k, v in r["errors"].items())]
    short = [r for r in results["models"] if "profile" in r]
    if short:
        lines += ["", "## Where models fall short", ""]
        for r in short:
            lines += [f"### {r['model']} (tuned, {r['target']})", ""]
            prof = r["profile"]
            if "error" in prof:
                lines += [f"Profile unavailable: {prof['error']}", ""]
                continue
            lines += ["| # | dispatch | share | total ms | source ops | module paths |", "|---|---|---|---|---|---|"]
            for i, d in enumerate(prof.get("dispatches", []), 1):
                lines.append(f"| {i} | `{d['name']}` | {d.get('percent', 0):.1f}% | {d.get('total_ms', 0):.3f} "
                             f"| {_short(d.get('ops', []))} | {_short(d.get('module_paths', []))} |")
            lines += ["", f"Profiled wall time {prof['total_ms']:.2f} ms per call, of which dispatches "
                      f"{prof['dispatch_ms']:.2f} ms in {prof['dispatch_calls']:.0f} calls (IREE host-execution "
                      "profiling; `~` marks a module path inferred inside a loop body).", ""]
    lines.append("")
    return "\n".join(lines)


def render_chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, series = [], {}
    keys = [("eager", "eager PyTorch"), ("vmfb:default", "vmfb default"), ("vmfb:tuned", "vmfb tuned"),
            ("onnxruntime", "ONNX Runtime"), ("torch.compile", "torch.compile")]
    rows = [(f"{r['model']}\n{row['case']}", row["runtimes"]) for r in results["models"] for row in r["cases"]]
    # A LeRobot policy's shipped module is its tuned vmfb (it has no default/rewrites variants).
    rows += [(f"{r['model']}\n{r['case']}", dict(r["runtimes"], **{"vmfb:tuned": r["runtimes"]["vmfb"]}))
             for r in results.get("policies", []) if "runtimes" in r]
    for label, runtimes in rows:
        labels.append(label)
        for key, _ in keys:
            series.setdefault(key, []).append(runtimes.get(key, {}).get("median_ms", 0.0))
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(labels)), 4), dpi=100)
    width = 0.8 / len(keys)
    for i, (key, title) in enumerate(keys):
        xs = [x + (i - len(keys) / 2 + 0.5) * width for x in range(len(labels))]
        ax.bar(xs, series[key], width, label=title)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("median latency (ms), batch 1")
    ax.set_title(f"{results['machine']['cpu']}, {results['machine']['threads']} threads, target {results['target']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "chart.png"
        # A fixed metadata dict keeps the PNG free of the software version and date.
        fig.savefig(out, metadata={"Software": None})
        write_bytes_atomic(path, out.read_bytes())
    plt.close(fig)


# -- entry point -------------------------------------------------------------------------------------
def workspace_root() -> Path:
    """Where results are written: the workspace `bazel run` was called from, else this checkout."""
    return Path(os.environ.get("BUILD_WORKSPACE_DIRECTORY") or Path(__file__).resolve().parents[2])


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
    a = parser.parse_args(argv)
    # Run as a script, this file's directory (dsa/tools/) is first on sys.path, and its executorch.py would
    # shadow ExecuTorch's package: the package root stays on the path, the tools directory does not.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    # Not resolved: under `bazel run` this file is a runfiles symlink, and the runfiles tree (not the source
    # tree it points into) holds the generated checkpoints.
    root = a.root or Path(os.path.abspath(__file__)).parents[2]
    executorch_python = None if a.no_executorch or a.lerobot_only else _runfiles_python(root, "dsa_executorch_python")
    if executorch_python is not None and not executorch_available():
        # Everything the toolchain's environment has plus ExecuTorch: the same run, with the Plan B beside
        # the vmfb in one process (alternating rounds).
        pythonpath = [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join(pythonpath)
        args = list(sys.argv[1:] if argv is None else argv)
        os.execv(str(executorch_python), [str(executorch_python), "-m", "dsa.tools.bench", *args])
    if a.lerobot_only:
        run_lerobot_benchmark(root, a.lerobot_only, models=a.models, runs=a.runs, warmup=a.warmup,
                              threads=a.threads, light=a.light, full_size_light=a.full_size_light)
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
    target = best_target(cpu_flags(), root / "toolchains" / "targets") if a.target == "auto" else a.target
    if not (root / "toolchains" / "targets" / f"{target}.json").exists():
        raise DsaError("--target", f"unknown target '{target}'",
                       f"choose one of {sorted(p.stem for p in (root / 'toolchains' / 'targets').glob('*.json'))}")
    subjects = load_subjects(root / "bench" / "subjects.json", root)
    policies = [] if a.no_lerobot else [p.name for p in lerobot_policies(root)]
    quant_layers = not a.no_quant_layers
    if a.models:
        quant_layers = quant_layers and QUANT_LAYERS_SUBJECT in a.models
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
    set_iree_threads(a.threads)
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
            # again, under that interpreter, with the same import roots.
            out = Path(tmp) / "lerobot.json"
            cmd = [str(python), os.path.abspath(__file__), "--lerobot-only", str(out), "--root", str(root),
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
    write_json_atomic(out_dir / "results.json", results)
    text = render_markdown(results)
    write_bytes_atomic(out_dir / "RESULTS.md", text.encode("utf-8"))
    render_chart(results, out_dir / "results.png")
    print(text)
    print(f"dsa-bench: wrote {out_dir / 'RESULTS.md'}, results.json, results.png")


def merge_results(previous: dict, fresh: dict, target: str) -> dict:
    """`previous` with the rows `fresh` re-measured put in their place (in the previous order; new ones at the
    end), each stamped with the date it was measured. The run settings must be the same, so that the table
    stays one comparison."""
    for key in ("target", "runs", "warmup", "light", "full_size_light"):
        if previous.get(key) != fresh.get(key):
            raise DsaError("--update", f"the existing results were measured with {key}={previous.get(key)!r}, "
                           f"this run with {fresh.get(key)!r}", "run with the same settings, or the whole benchmark")
    if previous.get("machine", {}).get("cpu") != fresh["machine"]["cpu"]:
        raise DsaError("--update", "the existing results are from another CPU", "run the whole benchmark here")
    merged = dict(previous, date=fresh["date"])
    stamp = time.strftime("%Y-%m-%d %H:%M")
    for section in ("models", "policies", "quant_layers"):
        rows = [dict(r, measured=r.get("measured", previous["date"])) for r in previous.get(section, [])]
        for row in fresh.get(section, []):
            row = dict(row, measured=f"{stamp} (--update)")
            key = row.get("model", row.get("layer", "")) + "|" + str(row.get("case", ""))
            keys = [r.get("model", r.get("layer", "")) + "|" + str(r.get("case", "")) for r in rows]
            if section != "quant_layers" and row.get("model") in [r.get("model") for r in rows]:
                rows[[r.get("model") for r in rows].index(row["model"])] = row
            elif key in keys:
                rows[keys.index(key)] = row
            else:
                rows.append(row)
        merged[section] = rows
    return merged


def set_iree_threads(threads: int) -> None:
    """IREE's local-task driver: one worker per requested thread, like torch and ONNX Runtime."""
    import iree.runtime as rt

    try:
        rt.flags.parse_flags(f"--task_topology_max_group_count={threads}")
    except Exception:  # flag absent in this runtime: it then uses one worker per core
        pass


if __name__ == "__main__":
    run_cli(main, "dsa bench")
