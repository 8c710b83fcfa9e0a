"""`profile_model`: trace, tag, compile in two steps, run under the profiler and join dispatches to sources."""

from __future__ import annotations

import collections
import re
import tempfile
import time
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Union

from dsa.core.errors import DsaError
from dsa.core.runtime_flags import merge_runtime_flags
from dsa.tools.profiler.runner import (
    benchmark_input_flags, check_archive, check_extra_flags, input_values, parameter_record, parse_bucket,
    profile_compile_view, profiling_mode_of, run_profiler)
from dsa.tools.profiler.sources import DispatchSource, INFERRED_MARK, ROOT_PATH, annotate_locations, map_dispatches


RESULT_FORMAT = 1
DEFAULT_RUNS = 10


# -- profile_model -----------------------------------------------------------------------------------------


def profile_model(
    manifest_path: Union[str, Path],
    checkpoint_or_params: Union[str, Path],
    target_spec_path: Union[str, Path],
    *,
    bucket=None,
    steps: Optional[int] = None,
    top: int = 15,
    tuning_flags: Sequence[str] = (),
    runs: int = DEFAULT_RUNS,
    inputs: Optional[Mapping[str, object]] = None,
    tuning: Optional[dict] = None,
    pythonpath: Sequence[str] = (".",),
    rewrites: Optional[Sequence[str]] = None,
    keep_dir: Optional[Union[str, Path]] = None,
    policy_config: Optional[Union[str, Path]] = None,
) -> dict:
    """Traces, compiles and profiles the manifest's model for a target; returns the profile (see
    `format_profile`). `checkpoint_or_params`: a .safetensors checkpoint (checked against the manifest's pin
    and turned into a parameter archive) or a built .irpa. `bucket`: "dim=size" (default: the manifest's
    smallest bucket). `tuning_flags`: extra iree-compile flags, after the build's; `tuning`: a tuning file
    (toolchains/tuning/...json) as the build applies it. `rewrites`: the graph rewrites to trace with
    (None: the manifest's). `keep_dir`: keep the MLIR, executable sources, .vmfb and profile there.
    `policy_config`: framework lerobot, the policy's config.json (default: the manifest's
    model.policy_config.path, relative to the manifest)."""
    from dsa.stages.compile import SPEC_PATH_KEY, compile_flags, run_iree_compile
    from dsa.stages.export import PARAMETER_SCOPE, check_supported_ops, trace_model
    from dsa.core.fileio import read_json, sha256_file
    from dsa.manifest.contract import load_manifest, project
    from dsa.stages.params import build_params

    if runs < 1:
        raise DsaError("--runs", f"{runs} is not a positive number of runs")
    manifest_path, target_spec_path = Path(manifest_path), Path(target_spec_path)
    weights = Path(checkpoint_or_params)
    name = str(manifest_path)
    manifest = load_manifest(manifest_path)
    if not target_spec_path.is_file():
        raise DsaError(str(target_spec_path), "no such target spec", "see toolchains/targets/")
    target = read_json(target_spec_path)
    if not weights.is_file():
        raise DsaError(str(weights), "no such file", "pass a .safetensors checkpoint or a built .irpa")
    if weights.suffix not in (".irpa", ".safetensors"):
        raise DsaError(str(weights), "is neither a .safetensors checkpoint nor an .irpa parameter archive")
    view = project(manifest, "export")
    if policy_config is None and "policy_config" in manifest["model"]:
        policy_config = manifest_path.parent / manifest["model"]["policy_config"]["path"]
    if policy_config is not None and not Path(policy_config).is_file():
        raise DsaError(f"{name}: model.policy_config.path", f"no policy config.json at {policy_config}",
                       "pass the policy directory's config.json with --policy-config")
    bucket_view = parse_bucket(bucket, manifest, name)
    compile_view, note = profile_compile_view(manifest, target, name)
    where = f"{name} for target {target.get('name')}"
    flags = compile_flags(compile_view, target, where, **({"tuning": tuning} if tuning is not None else {}))
    flags += check_extra_flags(tuning_flags)
    timings = {}

    with tempfile.TemporaryDirectory(prefix="dsa-profile-") as tmp:
        work = Path(keep_dir) if keep_dir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        traced = trace_model(view, bucket=bucket_view, pythonpath=list(pythonpath), manifest_name=name,
                             rewrites=rewrites, policy_config=policy_config)
        nodes = annotate_locations(traced.exported, traced.module)
        from iree.turbine import aot

        mlir = aot.export(traced.exported).mlir_module.operation.get_asm(enable_debug_info=True)
        check_supported_ops(mlir, traced.exported, traced.where)
        mlir_path = work / "model.mlir"
        mlir_path.write_text(mlir)
        record = parameter_record(traced, mlir, view)
        values = input_values(traced.traced_inputs, inputs or {},
                               manifest.get("flow_steps") if steps is None else steps)
        timings["trace_s"] = time.monotonic() - start

        if weights.suffix == ".safetensors":
            irpa = work / "params.irpa"
            build_params(weights, project(manifest, "params"), record, irpa, manifest_name=name)
        else:
            irpa = weights
            check_archive(irpa, record)

        start = time.monotonic()
        sources_path = work / "executable_sources.mlir"
        spec = (tuning or {}).get(SPEC_PATH_KEY)
        source, resume, pre_counts = mlir_path, [], {}
        if spec:  # as the build compiles it: the spec's rewrites after input conversion (locations kept)
            from dsa.stages.dispatch_spec import preprocess

            source, resume, pre_counts = preprocess(mlir_path, flags, Path(spec), work, where,
                                                    lambda m, f, o: run_iree_compile(m, f, o, where), debuginfo=True)
        run_iree_compile(source, flags + resume + ["--compile-to=executable-sources", "--mlir-print-debuginfo"],
                         sources_path, where)
        vmfb = work / "model.vmfb"
        spec_counts = None
        if spec:  # ... and its tile sizes between configuration and codegen
            from dsa.stages.dispatch_spec import compile_with_spec

            spec_counts = dict(pre_counts, **compile_with_spec(
                sources_path, flags, Path(spec), vmfb, where, lambda m, f, o: run_iree_compile(m, f, o, where),
                start_flags=["--compile-from=executable-sources"], preprocessed=True))
        else:
            run_iree_compile(sources_path, flags + ["--compile-from=executable-sources"], vmfb, where)
        vmfb_sha256 = sha256_file(vmfb)
        timings["compile_s"] = time.monotonic() - start
        sources = map_dispatches(sources_path.read_text(), nodes)

        input_flags = benchmark_input_flags(traced.traced_inputs, values, work)
        start = time.monotonic()
        # The runtime flags the tuning requires of a runner (a worker stack), as the build's index carries them.
        runtime_flags = merge_runtime_flags([(tuning or {}).get("runtime_flags", [])])
        groups, bench = run_profiler(vmfb, driver=target["runtime_driver"], parameters=irpa, scope=PARAMETER_SCOPE,
                                     function="main", inputs=input_flags, runs=runs, out=work, where=where,
                                     runtime_flags=runtime_flags)
        timings["profile_s"] = time.monotonic() - start

    unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}.get(bench.get("time_unit", "ns"), 1e-6)
    total_ms = float(bench["real_time"]) * unit
    by_serial = {n.serial: n for n in nodes}
    dispatches = []
    for group in groups:
        source = sources.get(group["key"])
        dispatches.append(_dispatch_row(group, source, by_serial, runs))
    dispatches.sort(key=lambda d: (-d["total_ms"], d["name"]))
    dispatch_ms = sum(d["total_ms"] for d in dispatches)
    for rank, d in enumerate(dispatches, 1):
        d["rank"] = rank
        d["percent"] = 100.0 * d["total_ms"] / total_ms if total_ms > 0 else 0.0
    return {
        "format": RESULT_FORMAT,
        "model_id": manifest["model_id"],
        "target": target["name"],
        "bucket": None if bucket_view is None else {"dim": bucket_view["dim"], "size": bucket_view["size"]},
        "inputs": {s.name: (values[s.name].tolist() if values[s.name].ndim == 0 else list(values[s.name].shape))
                   for s in traced.traced_inputs},
        "flags": flags,
        # Locations change no byte of the module: this is the build's vmfb_sha256 for the same flags.
        "vmfb_sha256": vmfb_sha256,
        # The tuning's dispatch spec, when it names one: each entry's count of dispatches it set the tiles of.
        "dispatch_spec": spec_counts,
        "rewrites": list(rewrites) if rewrites is not None else None,
        "runs": runs,
        "profiling_mode": profiling_mode_of(target["runtime_driver"]),
        "total_ms": total_ms,
        "dispatch_ms": dispatch_ms,
        "dispatch_calls": sum(d["count"] for d in dispatches),
        "dispatches": dispatches,
        "unmapped": [d["name"] for d in dispatches if not d["module_paths"]],
        "top": top,
        "note": note,
        "timings": timings,
    }


def _ordered(counter: collections.Counter, key) -> List[str]:
    """Distinct values of `key(serial)`, most frequent first."""
    weights: collections.Counter = collections.Counter()
    for serial, count in counter.items():
        weights[key(serial)] += count
    return [v for v, _ in sorted(weights.items(), key=lambda kv: (-kv[1], kv[0]))]


def _dispatch_row(group: dict, source: Optional[DispatchSource], by_serial, runs: int) -> dict:
    row = {"name": group["key"], "count": group["count"] / runs, "total_ms": group["total_ns"] / runs / 1e6,
           "avg_us": group["total_ns"] / max(group["count"], 1) / 1e3, "ops": [], "module_paths": [],
           "root_ops": [], "root_paths": []}
    if source is None:
        return row
    roots = collections.Counter({s: c for s, c in source.roots.items() if s in by_serial})
    fused = collections.Counter({s: c for s, c in source.fused.items() if s in by_serial})
    op = lambda s: by_serial[s].op
    path = lambda s: by_serial[s].display_path
    row["root_ops"] = _ordered(roots, op)
    row["root_paths"] = _ordered(roots, path)
    row["ops"] = row["root_ops"] + [o for o in _ordered(fused, op) if o not in row["root_ops"]]
    # The call sites' roots, then the other ops fused into the body; each most specific (deepest) first.
    depth = lambda p: -1 if p.lstrip(INFERRED_MARK) == ROOT_PATH else p.count(".") + 1
    key = lambda p: (-depth(p), [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", p)])
    others = {path(s) for s in fused} - set(row["root_paths"])
    row["module_paths"] = sorted(row["root_paths"], key=key) + sorted(others, key=key)
    return row
