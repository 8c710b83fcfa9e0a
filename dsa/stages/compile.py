"""DsaCompile: torch-dialect MLIR + the manifest's compile view + a target → .vmfb and a compile report.

The flags are composed from four reviewable sources, in this order: the input/device flags every module
needs, the target's own flags (toolchains/targets/<name>.json), the measured tuning of the model family for
that target (toolchains/tuning/<family>.<target>.json, optional; written by `bazel run //bench:tune`), and
the flags the manifest's compile view implies. Reproducibility flags come last and cannot be overridden: no
source map, no debug symbols, and never `host` as a CPU, so the same inputs give a byte-identical, portable
vmfb on any machine.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import atomic_output, read_json, sha256_file
from dsa.core.formats import REPORT_FORMAT, TUNING_FORMAT, CompileReport
from dsa.core.runtime_flags import merge_runtime_flags, runtime_flag_values
from dsa.manifest.contract import ManifestError, check_precision_for_target
from dsa.stages import dispatch_spec as specs
from dsa.stages.compile_flags import check_target_flags, check_tuning_flags
from dsa.stages.iree_tools import first_error_line, iree_compile_path  # noqa: F401 (part of this module's API)

REPRODUCIBILITY_FLAGS = [
    "--iree-vm-bytecode-module-strip-source-map=true",
    "--iree-llvmcpu-debug-symbols=false",
]


def target_flags(target: dict, where: str) -> List[str]:
    """The device flag and the target's own flags (its backend, CPU or GPU architecture, and whatever that
    backend needs), refusing anything that depends on the build host. Nothing here is specific to one backend:
    the spec owns every flag after `--iree-hal-target-device`."""
    for key in ("name", "device", "backends", "runtime_driver", "flags"):
        if key not in target:
            raise DsaError(where, f"target spec has no '{key}'", "see toolchains/targets/x86_64-v3.json")
    if not isinstance(target["device"], str) or not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", target["device"]):
        raise DsaError(where, f"target spec 'device' {str(target['device'])[:80]!r} is not a device name",
                       "set 'device' to local, cuda, hip or vulkan")
    for flag in target["flags"] if isinstance(target["flags"], list) else []:
        if isinstance(flag, str) and flag.startswith(("--iree-hal-target-device=", "--iree-hal-target-backends=")):
            raise DsaError(where, f"flag '{flag}' chooses the device, which the spec's 'device' field owns",
                           "set 'device' (local, cuda, hip, vulkan) and keep the backend's flags in 'flags'")
    check_target_flags(target["flags"], where)
    return [f"--iree-hal-target-device={target['device']}", *target["flags"]]


def tuning_flags(tuning: dict, target: dict, where: str) -> List[str]:
    """The flags of a tuning file (toolchains/tuning/<family>.<target>.json), checked against the target."""
    for key in ("format", "family", "target", "flags"):
        if key not in tuning:
            raise DsaError(where, f"tuning file has no '{key}'", "see toolchains/tuning/README.md")
    if tuning["format"] != TUNING_FORMAT:
        raise DsaError(where, f"tuning format {tuning['format']} is not supported",
                       f"this release reads format {TUNING_FORMAT}")
    if tuning["target"] != target["name"]:
        raise DsaError(where, f"tuning is for target '{tuning['target']}' but this compile is for "
                       f"'{target['name']}'", f"use toolchains/tuning/{tuning['family']}.{target['name']}.json")
    flags = check_tuning_flags(tuning["flags"], where)
    runtime_flag_values(tuning.get("runtime_flags", []), where)
    if "dispatch_spec" in tuning:
        check_dispatch_spec_field(tuning, where)
    return list(flags)


def check_dispatch_spec_field(tuning: dict, where: str) -> dict:
    """A tuning file's `dispatch_spec`: {"file": "<family>.<target>.spec.mlir" (beside it: the rules find it by
    that name), "sha256": its digest (so the tuning file, which the lock pins, pins the spec too)}."""
    field = tuning["dispatch_spec"]
    wanted = f"{tuning['family']}.{tuning['target']}.spec.mlir"
    hint = "write it with `dsa tune-dispatches` (toolchains/tuning/README.md)"
    if not isinstance(field, dict) or set(field) != {"file", "sha256"}:
        raise DsaError(f"{where}: dispatch_spec", 'is not {"file": ..., "sha256": ...}', hint)
    if field["file"] != wanted:
        raise DsaError(f"{where}: dispatch_spec.file", f"is {str(field['file'])[:100]!r}; this tuning's spec is "
                       f"named {wanted} and lies beside it", hint)
    if not isinstance(field["sha256"], str) or not re.fullmatch(r"[0-9a-f]{64}", field["sha256"]):
        raise DsaError(f"{where}: dispatch_spec.sha256", "is not a sha256 hex digest", hint)
    return field


SPEC_PATH_KEY = "dispatch_spec_path"  # set by load_tuning, never written to a file


def load_tuning(tuning_path, where: Optional[str] = None) -> dict:
    """A tuning file, with the path of the dispatch spec it names (checked: `dispatch_spec_path`) under
    SPEC_PATH_KEY, so that whoever compiles with it (compile_module, the profiler) applies the spec too."""
    tuning = read_json(tuning_path)
    spec = dispatch_spec_path(tuning, tuning_path, where or str(tuning_path)) if isinstance(tuning, dict) else None
    return dict(tuning, **{SPEC_PATH_KEY: str(spec)}) if spec is not None else tuning


def dispatch_spec_path(tuning: Optional[dict], tuning_path, where: str) -> Optional[Path]:
    """The dispatch spec a tuning file names, beside it, checked against the digest it pins; None when it
    names none."""
    if tuning is None or "dispatch_spec" not in tuning:
        return None
    field = check_dispatch_spec_field(tuning, where)
    spec = Path(tuning_path).parent / field["file"]
    if not spec.is_file():
        raise DsaError(f"{where}: dispatch_spec.file", f"names {field['file']}, which is not beside {tuning_path}",
                       "keep the spec beside its tuning file (a dsa_target's own tuning lists both)")
    digest = sha256_file(spec)
    if digest != field["sha256"]:
        raise DsaError(f"{where}: dispatch_spec.sha256", f"{spec.name} has sha256 {digest[:16]}…, the tuning file "
                       f"pins {field['sha256'][:16]}…", "a spec changed without its tuning file: run `dsa "
                       "tune-dispatches` again, or pin the new digest in the tuning file if the edit is meant")
    return spec


# What quantised weights need (dsa.stages.quant): no constant evaluation or hoisting (either would materialise
# the float weights at load time: the memory the packing saves, spent again), and aggressive dispatch fusion,
# under which IREE 3.13 puts the bit-extend dequantisation inside a one-row contraction's dispatch (the matvec
# of a decode step: the packed weight is read and unpacked in registers). Matmul-producer fusion stays blocked
# (IREE's CPU default): a many-row contraction with the dequantisation inside ran several times slower than
# dequantising first.
QUANT_FLAGS = ["--iree-opt-const-eval=false", "--iree-opt-const-expr-hoisting=false",
               "--iree-dispatch-creation-enable-aggressive-fusion"]
# On llvm-cpu, also the codegen's O3: the fused dequantise-matvec is then vectorised over the packed weight
# (OpenVLA's 4096x4096 int4 decode step, x86-64-v3: 10.9 ms without, 2.5 ms with, fp32 5.0 ms).
QUANT_LLVMCPU_FLAGS = ["--iree-llvmcpu-mlir-opt-level=O3"]


# What half-precision weights widened to f32 where read (manifest precision weights bf16/f16, compute f32;
# dsa.stages.precision) need: no constant evaluation or hoisting (either would keep a float32 copy of every
# weight in memory at load time), and on llvm-cpu matmul-producer fusion allowed, so that the widening runs
# inside the contraction's dispatch. With IREE's CPU default (blocked) each contraction's weight is widened by
# a dispatch of its own that writes the float32 weight every call: 2048x8192 bf16 weights, 64 rows, x86-64-v4:
# 270 ms blocked, 87 ms fused, float32 weights 73 ms.
WIDENED_WEIGHT_FLAGS = ["--iree-opt-const-eval=false", "--iree-opt-const-expr-hoisting=false"]
WIDENED_WEIGHT_LLVMCPU_FLAGS = ["--iree-dispatch-creation-block-matmul-producer-fusion=false"]


def manifest_flags(view: dict, target: Optional[dict] = None) -> List[str]:
    """Flags implied by the compile view: QUANT_FLAGS for a quantised model (and QUANT_LLVMCPU_FLAGS when
    the target compiles with llvm-cpu); WIDENED_WEIGHT_FLAGS for half-precision weights computed in f32."""
    cpu = target is not None and "llvm-cpu" in target.get("backends", [])
    if view["quant_scheme"]["kind"] in ("int8", "int4"):
        return list(QUANT_FLAGS) + (list(QUANT_LLVMCPU_FLAGS) if cpu else [])
    precision = view.get("precision") or {"weights": "f32", "compute": "f32"}
    if precision["weights"] != "f32" and precision["compute"] == "f32":
        return list(WIDENED_WEIGHT_FLAGS) + (list(WIDENED_WEIGHT_LLVMCPU_FLAGS) if cpu else [])
    return []


def check_tuning_family(view: dict, tuning: Optional[dict], where: str) -> None:
    """The manifest's `tuning` (a family name, in the compile view) and the tuning file must agree: a manifest
    that names a family is compiled with that family's file for the target, never with another or none."""
    family = view.get("tuning")
    if family is None:
        return
    target = view.get("target")
    wanted = f"toolchains/tuning/{family}.{target}.json"
    if tuning is None:
        raise DsaError(where, f"the manifest's tuning is '{family}', but no tuning file is given",
                       f"compile with {wanted} (a dsa_vmfb/dsa_policy `tuning`; `dsa compile` finds it itself)")
    if tuning.get("family") != family:
        raise DsaError(where, f"the manifest's tuning is '{family}', but the tuning file given is of family "
                       f"'{tuning.get('family')}'", f"compile with {wanted}, or change the manifest's tuning")


def compile_flags(view: dict, target: dict, where: str, tuning: Optional[dict] = None) -> List[str]:
    if view.get("target") != target["name"]:
        raise DsaError(
            where,
            f"compile view is for target '{view.get('target')}' but the target spec is '{target['name']}'",
            "pass the matching toolchains/targets spec",
        )
    if view.get("precision"):  # compute in bf16 / f16 only where the target has that arithmetic
        try:
            check_precision_for_target(view, target["name"], target, where)
        except ManifestError as e:
            raise DsaError(where, f"{e.field}: {e.message}", e.hint) from None
    tuned = tuning_flags(tuning, target, f"{where} (tuning)") if tuning is not None else []
    return [f"--iree-input-type={view.get('input_type', 'torch')}", *target_flags(target, where), *tuned,
            *manifest_flags(view, target), *REPRODUCIBILITY_FLAGS]


def compiler_version() -> str:
    from importlib import metadata

    return metadata.version("iree-base-compiler")


# The families whose tuning raises the CPU stack-allocation limit (toolchains/tuning/README.md), for the hint of a
# compile that exceeded it.
STACK_TUNING_FAMILIES = ("LeRobot's ACT and Diffusion Policy (ResNet-18 backbones): resnet_policy; VLAs at "
                         "their real size: flow_vla_full (SmolVLA), pi_full (PI0, PI0.5), groot_full, openvla_full")
_STACK_LIMIT_FLAG = "--iree-llvmcpu-stack-allocation-limit="


def stack_limit_hint(message: str, flags: Sequence[str], view: Optional[dict]) -> str:
    """What to do when a dispatch needs more stack than the compile allows: the manifest field to set and the
    families that raise the limit, with the bytes needed and allowed."""
    needed = re.search(r"Got (\d+) bytes", message)
    limit = next((f[len(_STACK_LIMIT_FLAG):] for f in reversed(list(flags)) if f.startswith(_STACK_LIMIT_FLAG)),
                 None)
    allowed = f"{limit} bytes (the tuning's limit)" if limit else "32768 bytes (IREE's default)"
    family = (view or {}).get("tuning")
    now = f"the manifest's tuning '{family}' allows" if family else "the manifest sets no tuning, so the compile allows"
    return (f"a dispatch needs {needed.group(1) + ' bytes of' if needed else 'more'} stack; {now} {allowed}. Set "
            f"the manifest's `tuning:` to a family whose tuning file for this target raises "
            f"{_STACK_LIMIT_FLAG.rstrip('=')} ({STACK_TUNING_FAMILIES}; toolchains/tuning/README.md)")


def run_iree_compile(mlir: Path, flags: List[str], output: Path, where: str, view: Optional[dict] = None) -> str:
    """Runs iree-compile; returns its stderr. Raises DsaError, naming the failing op, on failure (and, for a
    dispatch over the stack-allocation limit, the manifest field that fixes it: `view` is the compile view)."""
    proc = subprocess.run([iree_compile_path(), str(mlir), *flags, "-o", str(output)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        message = first_error_line(proc.stderr)
        hint = "see the compiler's message; run `iree-compile` with the same flags to reproduce"
        if "failed to legalize operation" in message:
            hint = "the model uses an op IREE cannot lower for this target: rewrite or decompose it"
        elif "exceeded stack allocation limit" in message:
            hint = stack_limit_hint(message, flags, view)
        raise DsaError(where, f"iree-compile failed: {message.strip()}", hint)
    return proc.stderr


def compile_module(
    mlir: Path,
    view: dict,
    target: dict,
    out_vmfb: Path,
    out_report: Optional[Path] = None,
    *,
    where: str = "compile",
    tuning: Optional[dict] = None,
) -> dict:
    """Compiles `mlir`. A tuning file's dispatch spec (found and checked by `load_tuning`) is applied after
    input conversion (its rewrites) and between configuration and code generation (its tile sizes):
    dsa/stages/dispatch_spec.py."""
    flags = compile_flags(view, target, where, tuning)
    dispatch_spec = None
    if tuning is not None and "dispatch_spec" in tuning:
        if not tuning.get(SPEC_PATH_KEY):  # never compiled without the spec its tuning file names
            raise DsaError(where, "the tuning names a dispatch_spec but was not read with load_tuning, which finds "
                           "the spec", "read tuning files with dsa.stages.compile.load_tuning")
        dispatch_spec = Path(tuning[SPEC_PATH_KEY])
    spec_counts = None
    with tempfile.TemporaryDirectory(prefix="dsa-compile-") as tmp:
        stats_path = Path(tmp) / "statistics.json"
        stats_flags = ["--iree-scheduling-dump-statistics-format=json",
                       f"--iree-scheduling-dump-statistics-file={stats_path}"]
        with atomic_output(out_vmfb) as tmp_vmfb:
            if dispatch_spec is None:
                run_iree_compile(mlir, flags + stats_flags, tmp_vmfb, where, view)
            else:
                spec_counts = specs.compile_with_spec(
                    mlir, flags, dispatch_spec, tmp_vmfb, where,
                    lambda m, f, o: run_iree_compile(m, f, o, where, view), start_flags=stats_flags)
            stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
            vmfb_size = tmp_vmfb.stat().st_size
            vmfb_sha = sha256_file(tmp_vmfb)
    aggregate = stats.get("stream-aggregate", {})
    report = {
        "format": REPORT_FORMAT,
        "model_id": view["model_id"],
        "target": target["name"],
        "runtime_driver": target["runtime_driver"],
        "tuning": None if tuning is None else {"family": tuning["family"], "flags": tuning["flags"]},
        "flags": flags,
        "dispatch_count": aggregate.get("execution", {}).get("dispatch-count"),
        "executable_count": aggregate.get("executable", {}).get("executable-count"),
        "mlir_sha256": sha256_file(mlir),
        "vmfb_sha256": vmfb_sha,
        "vmfb_bytes": vmfb_size,
        "iree_base_compiler": compiler_version(),
    }
    if spec_counts is not None:
        report["dispatch_spec"] = specs.spec_report(dispatch_spec, spec_counts)
        unmatched = report["dispatch_spec"]["unmatched"]
        if unmatched:  # said, not hidden: the module keeps IREE's own configuration for these
            sys.stderr.write(f"{where}: dispatch spec {dispatch_spec.name}: {len(unmatched)} of {len(spec_counts)} "
                             f"entries match no dispatch of this module ({', '.join(unmatched)}); they were tuned "
                             "for other shapes or another compiler (the compile report lists them)\n")
    runtime_flags = [] if tuning is None else merge_runtime_flags([tuning.get("runtime_flags", [])])
    if runtime_flags:
        # What the module needs of its runner (absent when nothing: reports of untouched tunings keep their bytes).
        report["runtime_flags"] = runtime_flags
    if out_report is not None:
        CompileReport.write(out_report, report)
    return report


def compile_to_phase(mlir: Path, view: dict, target: dict, phase: str, where: str = "compile",
                     tuning: Optional[dict] = None) -> str:
    """The module's IR after `phase` (e.g. "flow"), as text: used to inspect what the compiler keeps."""
    with tempfile.TemporaryDirectory(prefix="dsa-phase-") as tmp:
        out = Path(tmp) / f"{phase}.mlir"
        run_iree_compile(mlir, compile_flags(view, target, where, tuning) + [f"--compile-to={phase}"], out,
                         where)
        return out.read_text()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa-compile-module", description=__doc__.splitlines()[0])
    parser.add_argument("--mlir", required=True)
    parser.add_argument("--view", required=True, help="the manifest's compile view (JSON)")
    parser.add_argument("--target", required=True, help="target spec (toolchains/targets/NAME.json)")
    parser.add_argument("--tuning", help="tuning file (toolchains/tuning/<family>.<target>.json)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--report", required=True)
    a = parser.parse_args(argv)
    where = f"{a.mlir} for target {Path(a.target).stem}"
    tuning = None
    if a.tuning:
        where = f"{where} with {a.tuning}"
        tuning = load_tuning(a.tuning, where)
    view = read_json(a.view)
    # What ships (a dsa_vmfb) is compiled with the tuning its manifest names; experiments (the benchmark's
    # untuned variants) call compile_module directly.
    check_tuning_family(view, tuning, where)
    compile_module(Path(a.mlir), view, read_json(a.target), Path(a.out), Path(a.report),
                   where=where, tuning=tuning)


if __name__ == "__main__":
    run_cli(main, "dsa-compile-module")
