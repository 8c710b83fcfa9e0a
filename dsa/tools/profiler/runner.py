"""Running IREE's tools on a module: the runtime tools' paths, `iree-benchmark-module` under the device profiler,
the inputs, the parameter archive and the flags a profile compiles with."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from dsa.core.errors import DsaError


# Flags this tool sets itself: an extra flag may not change them.
_OWN_FLAGS = ("-o", "--compile-to", "--compile-from", "--output-format", "--mlir-print-debuginfo",
              "--iree-hal-dump-executable-files-to", "--iree-hal-dump-executable-sources-to")


# -- the profiler ----------------------------------------------------------------------------------------


def runtime_tool_path(name: str) -> str:
    try:
        import iree._runtime_libs as libs

        candidate = Path(libs.__file__).parent / name
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which(name)
    if not found:
        raise DsaError("dsa-profile", f"cannot find {name}", "install iree-base-runtime (requirements_lock.txt)")
    return found


def profiling_mode_of(driver: str) -> str:
    # The CPU drivers time each dispatch on the host; devices timestamp them themselves.
    return "host-execution" if driver.startswith("local") else "dispatch-events"


def run_profiler(vmfb: Path, *, driver: str, parameters: Path, scope: str, function: str, inputs: Sequence[str],
                 runs: int, out: Path, where: str, runtime_flags: Sequence[str] = ()) -> Tuple[List[dict], dict]:
    """Runs `function` `runs` times under the HAL profiler (`inputs`: its --input flags). Returns the
    profile's per-function dispatch groups (iree-profile dispatch rows) and the benchmark's own timing (its
    google-benchmark JSON entry)."""
    profile = out / "profile.ireeprof"
    cmd = [runtime_tool_path("iree-benchmark-module"), f"--module={vmfb}", f"--device={driver}",
           f"--parameters={scope}={parameters}", f"--function={function}",
           *inputs, *runtime_flags, f"--benchmark_min_time={runs}x", "--benchmark_format=json",
           f"--device_profiling_mode={profiling_mode_of(driver)}", f"--device_profiling_output={profile}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    reproduce = f"reproduce with: {' '.join(cmd)}"
    try:
        bench = json.loads(proc.stdout[proc.stdout.index("{"):])["benchmarks"][0]
    except (ValueError, KeyError, IndexError):
        bench = None
    if bench is not None and bench.get("error_occurred"):
        raise DsaError(where, f"iree-benchmark-module failed: {bench.get('error_message', 'no message')}",
                       reproduce)
    if proc.returncode != 0 or bench is None or not profile.exists():
        lines = (proc.stderr + "\n" + proc.stdout).strip().splitlines() or ["no output"]
        message = next((l for l in lines if "error" in l.lower()), lines[-1])
        raise DsaError(where, f"iree-benchmark-module failed: {message.strip()}", reproduce)
    report = subprocess.run([runtime_tool_path("iree-profile"), "dispatch", "--format=jsonl", str(profile)],
                            capture_output=True, text=True)
    if report.returncode != 0:
        raise DsaError(where, f"iree-profile failed: {report.stderr.strip()[-300:]}")
    groups = []
    for line in report.stdout.splitlines():
        row = json.loads(line)
        if row.get("type") in ("host_dispatch_group", "dispatch_group") and row.get("total_ns") is not None:
            groups.append(row)
    if not groups:
        raise DsaError(where, "the profile holds no timed dispatches",
                       f"check the profile with: iree-profile summary {profile}")
    return groups, bench


# -- inputs, parameters, flags -----------------------------------------------------------------------------


def parse_bucket(bucket, manifest: dict, manifest_name: str) -> Optional[dict]:
    """A bucket view for `bucket`: "dim=size", (dim, size), {dim: size}, or {"dim": ..., "slot"|"size": ...}
    (a bucket view). None means the manifest's smallest bucket (of its first bucketed dim), or no bucket when
    it declares none. A size the manifest does not list is allowed (to try a bucket before adding it)."""
    buckets = manifest["buckets"]
    if bucket is None:
        if not buckets:
            return None
        bucket = {"dim": sorted(buckets)[0], "slot": 0}
    if isinstance(bucket, str):
        dim, sep, value = bucket.partition("=")
        if not sep or not value.strip().isdigit():
            raise DsaError("--bucket", f"'{bucket}' is not DIM=SIZE", "e.g. --bucket prompt_len=32")
        dim, size = dim.strip(), int(value)
    elif isinstance(bucket, Mapping) and "dim" in bucket:
        dim = bucket["dim"]
        if "size" in bucket:
            size = int(bucket["size"])
        elif dim in buckets:
            sizes = buckets[dim]
            if not 0 <= bucket.get("slot", -1) < len(sizes):
                raise DsaError(f"{manifest_name}: buckets", f"no bucket slot {bucket.get('slot')} for '{dim}'",
                               f"buckets: {dict(buckets) or 'none'}")
            size = sizes[bucket["slot"]]
        else:
            size = None  # refused below
    elif isinstance(bucket, Mapping) and len(bucket) == 1:
        (dim, size), = bucket.items()
    else:
        dim, size = bucket
    if dim not in buckets:
        raise DsaError(f"{manifest_name}: buckets", f"the manifest has no buckets for '{dim}'",
                       f"bucketed dims: {', '.join(sorted(buckets)) or 'none'}")
    sizes = list(buckets[dim])
    slot = sizes.index(size) if size in sizes else sum(s < size for s in sizes)
    return {"dim": dim, "size": int(size), "slot": slot, "count": len(sizes)}


def input_values(traced_inputs, overrides: Mapping[str, object], steps: Optional[int]) -> Dict[str, object]:
    """Each input's value: the traced example, then `steps` for the integer scalar input with a value range
    (the flow steps, as dsa run sets it), then the overrides (a number fills the input; "@FILE.npy")."""
    import numpy as np

    from dsa.stages.export import EXAMPLE_SEED

    rng = np.random.default_rng(EXAMPLE_SEED)
    values = {s.name: s.example(rng).numpy() for s in traced_inputs}
    names = [s.name for s in traced_inputs]
    overrides = dict(overrides)
    if steps is not None:
        ranged = [s.name for s in traced_inputs if s.value_range is not None]
        if len(ranged) > 1:
            raise DsaError("--steps", f"the model has {len(ranged)} integer scalar inputs with a value range "
                           f"({', '.join(ranged)})", "set each with --input NAME=VALUE")
        if ranged:
            overrides.setdefault(ranged[0], steps)
    for name, value in overrides.items():
        if name not in values:
            raise DsaError(f"--input {name}", "the model has no such input", f"inputs: {', '.join(names)}")
        spec = next(s for s in traced_inputs if s.name == name)
        if isinstance(value, str) and value.startswith("@"):
            array = np.load(value[1:])
            if list(array.shape) != list(spec.shape):
                raise DsaError(f"--input {name}", f"{value[1:]} has shape {list(array.shape)}, the traced model "
                               f"takes {list(spec.shape)}")
            values[name] = array.astype(spec.dtype)
            continue
        if np.ndim(value) > 0:
            array = np.asarray(value, dtype=spec.dtype)
            if list(array.shape) != list(spec.shape):
                raise DsaError(f"--input {name}", f"has shape {list(array.shape)}, the traced model takes "
                               f"{list(spec.shape)}")
            values[name] = array
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise DsaError(f"--input {name}", f"'{value}' is neither a number nor @FILE.npy") from None
        if spec.value_range is not None and not spec.value_range[0] <= number <= spec.value_range[1]:
            raise DsaError(f"--input {name}", f"{value} is outside the supported range {list(spec.value_range)}")
        values[name] = np.full(spec.shape, number, dtype=spec.dtype)
    return values


# IREE's element types by dtype, for scalar inputs (the tools read a 0-d .npy as shape [1]).
_IREE_ELEMENT_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int64": "i64", "int32": "i32",
                       "int8": "i8", "uint8": "ui8", "bool": "i1"}


def benchmark_input_flags(traced_inputs, values: Mapping[str, object], work: Path) -> List[str]:
    import numpy as np

    flags = []
    for i, spec in enumerate(traced_inputs):
        value = np.asarray(values[spec.name])
        if value.ndim == 0 and spec.dtype in _IREE_ELEMENT_TYPES:
            scalar = value.item()
            text = str(int(scalar)) if spec.dtype.startswith(("int", "uint", "bool")) else repr(float(scalar))
            flags.append(f"--input={_IREE_ELEMENT_TYPES[spec.dtype]}={text}")
            continue
        path = work / f"input{i}_{spec.name}.npy"
        np.save(path, np.ascontiguousarray(value))
        flags.append(f"--input=@{path}")
    return flags


def parameter_record(traced, mlir: str, view: dict) -> dict:
    """What the parameter stage reads of an export record: the parameters the module names, the tensors it
    never reads (a checkpoint may hold them), quantisation — as the export stage records them."""
    from dsa.stages.export import PARAMETER_SCOPE, parameter_entries

    parameters, unused = parameter_entries(traced.module, mlir)
    record = {"parameter_scope": PARAMETER_SCOPE, "parameters": parameters, "unused_parameters": unused}
    if traced.quantized:
        record["quantization"] = {"scheme": view["quant_scheme"], "tensors": traced.quantized}
    return record


def check_archive(irpa: Path, record: dict) -> None:
    from dsa.runtime.policy import read_archive_metadata

    try:
        entries = read_archive_metadata(irpa)
    except Exception as e:  # iree.runtime raises ValueError/RuntimeError for an unreadable file
        raise DsaError(str(irpa), f"not a readable parameter archive: {e}",
                       "pass an .irpa built for this model (or --checkpoint)") from None
    for p in record["parameters"]:
        got = entries.get(p["name"])
        if got is None or got["shape"] != p["shape"] or got["dtype"] != p["dtype"]:
            found = "missing" if got is None else f"{got['shape']} {got['dtype']}"
            raise DsaError(f"{irpa}: parameter '{p['name']}'",
                           f"is {found}, the model expects {p['shape']} {p['dtype']}",
                           "pass the parameter archive built from this manifest (or --checkpoint)")


def profile_compile_view(manifest: dict, target: dict, manifest_name: str) -> Tuple[dict, Optional[str]]:
    from dsa.manifest.contract import project

    name = target.get("name")
    if name in manifest["targets"]:
        return project(manifest, "compile", target=name), None
    view = project(manifest, "compile", target=manifest["targets"][0])
    view["target"] = name
    return view, f"target '{name}' is not among the manifest's targets ({', '.join(manifest['targets'])})"


def check_extra_flags(flags: Sequence[str]) -> List[str]:
    for flag in flags:
        if not flag.startswith("-"):
            raise DsaError("--extra-flag", f"'{flag}' is not a compiler flag",
                           "e.g. --extra-flag=--iree-opt-level=O3")
        if flag.partition("=")[0] in _OWN_FLAGS:
            raise DsaError("--extra-flag", f"'{flag}' is set by dsa-profile itself", "drop it")
    return list(flags)
