"""dsa-profile: profile a model's compiled dispatches and name the torch ops and model modules behind each.

    dsa profile --manifest manifests/pi0.yaml --checkpoint pi0.safetensors \\
        --target toolchains/targets/x86_64-v3.json --bucket prompt_len=32 [--top 15] [--json OUT] \\
        [-- --iree-opt-level=O3 ...]

Traces the model as the export stage does (`dsa.stages.export.trace_model`), tags every FX node with a source
location naming its module path and aten op (`"dsa-fx|expert.layers.2.attn|aten.linear":SERIAL`, set as the
node's stack trace, which iree-turbine's importer turns into MLIR `loc(...)`), and compiles the module with
the build's flags in two steps: `--compile-to=executable-sources --mlir-print-debuginfo`, whose output holds
every dispatch executable with the locations of the ops fused into it and every host-side
`stream.cmd.dispatch` with the location of the op its dispatch region was formed around; then
`--compile-from=executable-sources` to the .vmfb that is profiled. Locations change neither the dispatch
names nor, with the build's source-map stripping, a single byte of the .vmfb. The module then runs `runs`
times under `iree-benchmark-module --device_profiling_mode=...`, and `iree-profile dispatch` gives each
dispatch function's count and time.

A dispatch's source ops and module paths are those of its root op at every call site (a deduplicated
executable serves several layers: each call site names its own), then those of the other ops fused into
its body. Nodes inside a higher-order op's subgraph (the body of a `while_loop`) carry no module stack in
torch.export: their path is taken from the parameters they read, or else the common prefix of the paths of
their nearest producers and consumers, and is shown with a leading `~`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from dsa.core.errors import DsaError, run_cli
from dsa.core.runtime_flags import merge_runtime_flags

RESULT_FORMAT = 1
DEFAULT_RUNS = 10
LOC_PREFIX = "dsa-fx"
_LOC_TAG = re.compile(r'"' + LOC_PREFIX + r'\|[^"]*":(\d+):\d+')
INFERRED_MARK = "~"
ROOT_PATH = "<root>"
# Ops of a dispatch body that compute (their locations name the fused source ops); the rest of the body
# (bindings, loads/stores, index arithmetic) carries the locations of neighbouring dispatches' ops.
_COMPUTE_PREFIXES = ("linalg.", "iree_linalg_ext.", "iree_encoding.", "iree_codegen.", "tensor.")
# Ops whose location says nothing of the dispatch: constants and fills (an accumulator's initial value) are
# uniqued program-wide, so theirs is that of their first use anywhere; shape-only ops.
_UNINFORMATIVE_OPS = ("linalg.fill", "tensor.empty", "tensor.dim", "tensor.cast", "tensor.collapse_shape",
                      "tensor.expand_shape", "tensor.reshape")
# Flags this tool sets itself: an extra flag may not change them.
_OWN_FLAGS = ("-o", "--compile-to", "--compile-from", "--output-format", "--mlir-print-debuginfo",
              "--iree-hal-dump-executable-files-to", "--iree-hal-dump-executable-sources-to")


# -- source locations ------------------------------------------------------------------------------------


@dataclasses.dataclass
class SourceNode:
    """One FX node of the traced program, as a location tag names it."""

    serial: int
    graph: str      # "" for the exported graph, else the subgraph's attribute name (e.g. a while_loop body)
    name: str       # FX node name
    op: str         # aten op (aten.linear, aten.add.Tensor, ...), the higher-order op's name, or "inputs"
    path: str       # module path ("" = the top module)
    inferred: bool  # path inferred (subgraph nodes carry no nn_module_stack)
    # "op": a computation. "hop": a higher-order op (while_loop, cond, ...), whose location is the call site
    # of a subgraph. "inputs": a graph's first placeholder, whose location the importer gives the function,
    # its arguments and parameter loads. Only "op" locations name the source of a dispatch.
    kind: str = "op"

    @property
    def display_path(self) -> str:
        path = self.path or ROOT_PATH
        return INFERRED_MARK + path if self.inferred else path


def _op_name(node) -> str:
    import torch

    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = str(target)
        return name[: -len(".default")] if name.endswith(".default") else name
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return getattr(target, "__name__", str(target))


def _common_prefix(paths: Iterable[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    if not parts:
        return ""
    prefix = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        prefix.append(level[0])
    return ".".join(prefix)


def _flat_nodes(value) -> list:
    import torch.fx

    out: list = []
    torch.fx.node.map_arg(value, out.append)
    return out


def _module_path(node) -> Optional[str]:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return list(stack.values())[-1][0] or ""


def annotate_locations(exported, module=None) -> List[SourceNode]:
    """Gives every call_function node of the program (and of its subgraphs), and each graph's first
    placeholder, a stack trace that the importer turns into `loc("dsa-fx|<module path>|<op>":<serial>:0)`;
    other nodes get none (the importer then keeps the previous node's location). Returns the tagged nodes by
    serial (index = serial - 1). `module`, the traced nn.Module, tells leaf modules (Linear, LayerNorm, ...)
    apart: an op next to a leaf's own op is not inside the leaf, so it counts as evidence for its parent."""
    import torch

    leaves = set()
    if module is not None:
        leaves = {name for name, m in module.named_modules() if name and not any(True for _ in m.children())}

    root = exported.graph_module
    signature = exported.graph_signature
    state = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    # Module path of each placeholder that is a parameter or buffer (the FQN without its last name).
    root_params = {n: state[n.name].rpartition(".")[0] for n in root.graph.nodes
                   if n.op == "placeholder" and n.name in state}
    nodes: List[SourceNode] = []
    visited: set = set()

    def visit(graph_module, graph_name: str, param_paths: Dict[object, str], parent_path: str) -> None:
        graph = graph_module.graph
        calls = [n for n in graph.nodes if n.op == "call_function"]
        paths: Dict[object, Tuple[str, bool]] = {}
        for n in calls:
            path = _module_path(n)
            if path is not None:
                paths[n] = (path, False)
                continue
            read = [param_paths[a] for a in _flat_nodes((n.args, n.kwargs)) if a in param_paths]
            if read:
                paths[n] = (_common_prefix(read), True)
        # The rest: the common module path of the nearest producers and consumers that have one of their own.
        direct = dict(paths)
        users = {n: [u for u in n.users if u.op == "call_function"] for n in calls}
        for n in calls:
            if n in paths:
                continue
            evidence = []
            for neighbours in (lambda m: [a for a in _flat_nodes((m.args, m.kwargs)) if a.op == "call_function"],
                               lambda m: users[m]):
                seen, frontier = {n}, [n]
                while frontier:
                    nxt = []
                    for m in frontier:
                        for k in neighbours(m):
                            if k in seen:
                                continue
                            seen.add(k)
                            if k in direct:
                                found = direct[k][0]
                                evidence.append(found.rpartition(".")[0] if found in leaves else found)
                            else:
                                nxt.append(k)
                    frontier = nxt
            paths[n] = (_common_prefix(evidence) if evidence else parent_path, True)

        def tag(n, source: SourceNode) -> None:
            nodes.append(source)
            label = f"{LOC_PREFIX}|{source.display_path}|{source.op}"
            n.meta["stack_trace"] = f'  File "{label}", line {source.serial}, in {n.name}\n'

        first_input = next((n for n in graph.nodes if n.op == "placeholder"), None)
        for n in graph.nodes:
            if n is first_input:
                tag(n, SourceNode(len(nodes) + 1, graph_name, n.name, "inputs", parent_path, bool(graph_name),
                                  "inputs"))
                continue
            if n.op != "call_function":
                n.meta.pop("stack_trace", None)
                continue
            path, inferred = paths[n]
            hop = isinstance(n.target, torch._ops.HigherOrderOperator)
            tag(n, SourceNode(len(nodes) + 1, graph_name, n.name, _op_name(n), path, inferred,
                              "hop" if hop else "op"))
            if hop:
                # Subgraph placeholders take the op's operands in order, the subgraphs themselves
                # excepted (while_loop: carried inputs, then additional inputs).
                operands = [a for a in _flat_nodes(n.args) if a.op != "get_attr"]
                for a in _flat_nodes(n.args):
                    if a.op != "get_attr":
                        continue
                    sub = getattr(graph_module, a.target)
                    if id(sub) in visited:
                        continue
                    visited.add(id(sub))
                    holders = [p for p in sub.graph.nodes if p.op == "placeholder"]
                    mapped = operands[len(operands) - len(holders):] if len(holders) <= len(operands) else []
                    sub_params = {h: param_paths[o] for h, o in zip(holders, mapped) if o in param_paths}
                    visit(sub, a.target, sub_params, path)

    visit(root, "", root_params, "")
    return nodes


def _serials(location, noise: set) -> List[int]:
    return [s for s in (int(x) for x in _LOC_TAG.findall(str(location))) if s not in noise]


def _walk(operation):
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                yield op.operation
                yield from _walk(op.operation)


def _symbol_leaf(ref) -> str:
    return str(ref).rsplit("::", 1)[-1].lstrip("@").strip('"')


@dataclasses.dataclass
class DispatchSource:
    roots: collections.Counter   # serial → number of call sites whose root op it is
    fused: collections.Counter   # serial → number of compute ops of the executable body it tags


def map_dispatches(executable_sources: str, nodes: Sequence[SourceNode]) -> Dict[str, DispatchSource]:
    """Dispatch function name → the source nodes behind it, from `--compile-to=executable-sources` output
    printed with `--mlir-print-debuginfo`."""
    from iree.compiler import ir

    noise = {n.serial for n in nodes if n.kind != "op"}
    context = ir.Context()
    try:
        module = ir.Module.parse(executable_sources, context)
    except Exception as e:  # MLIRError: a toolchain mismatch between iree-compile and these bindings
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DsaError("executable sources", f"cannot parse the compiler's output: {first}",
                       "use iree-base-compiler's own iree-compile (same version as its Python bindings)") from None
    result: Dict[str, DispatchSource] = {}

    def entry(name: str) -> DispatchSource:
        return result.setdefault(name, DispatchSource(collections.Counter(), collections.Counter()))

    for top in module.body.operations:
        top = top.operation
        if top.name == "hal.executable":
            for variant in _walk(top):
                if variant.name != "hal.executable.variant":
                    continue
                funcs, exports = {}, []
                for op in _walk(variant):
                    if op.name == "hal.executable.export":
                        exports.append(_symbol_leaf(op.attributes["sym_name"]))
                    elif op.name == "func.func":
                        funcs[_symbol_leaf(op.attributes["sym_name"])] = op
                for name in exports:
                    if name in funcs:
                        entry(name).fused.update(_body_serials(funcs[name], noise))
            continue
        for op in _walk(top):
            if op.name == "stream.cmd.dispatch":
                serials = _serials(op.location, noise)
                for ref in op.attributes["entry_points"]:
                    entry(_symbol_leaf(ref)).roots.update(set(serials))
    return result


def _body_serials(func, noise: set) -> collections.Counter:
    """Serials tagging the compute ops of a dispatch function (all its informative ops when none compute)."""
    found: collections.Counter = collections.Counter()
    everything: collections.Counter = collections.Counter()

    def visit(operation, in_compute: bool) -> None:
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    op = op.operation
                    uninformative = op.name.endswith(".constant") or op.name in _UNINFORMATIVE_OPS
                    serials = set() if uninformative else set(_serials(op.location, noise))
                    everything.update(serials)
                    compute = not uninformative and (in_compute or op.name.startswith(_COMPUTE_PREFIXES))
                    if compute:
                        found.update(serials)
                    visit(op, compute)

    visit(func, False)
    return found or everything


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


def _profiling_mode(driver: str) -> str:
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
           f"--device_profiling_mode={_profiling_mode(driver)}", f"--device_profiling_output={profile}"]
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


def _parse_bucket(bucket, manifest: dict, manifest_name: str) -> Optional[dict]:
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


def _input_values(traced_inputs, overrides: Mapping[str, object], steps: Optional[int]) -> Dict[str, object]:
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


def _parameter_record(traced, mlir: str, view: dict) -> dict:
    """What the parameter stage reads of an export record: the parameters the module names, the tensors it
    never reads (a checkpoint may hold them), quantisation — as the export stage records them."""
    from dsa.stages.export import PARAMETER_SCOPE, parameter_entries

    parameters, unused = parameter_entries(traced.module, mlir)
    record = {"parameter_scope": PARAMETER_SCOPE, "parameters": parameters, "unused_parameters": unused}
    if traced.quantized:
        record["quantization"] = {"scheme": view["quant_scheme"], "tensors": traced.quantized}
    return record


def _check_archive(irpa: Path, record: dict) -> None:
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


def _compile_view(manifest: dict, target: dict, manifest_name: str) -> Tuple[dict, Optional[str]]:
    from dsa.manifest.contract import project

    name = target.get("name")
    if name in manifest["targets"]:
        return project(manifest, "compile", target=name), None
    view = project(manifest, "compile", target=manifest["targets"][0])
    view["target"] = name
    return view, f"target '{name}' is not among the manifest's targets ({', '.join(manifest['targets'])})"


def _check_extra_flags(flags: Sequence[str]) -> List[str]:
    for flag in flags:
        if not flag.startswith("-"):
            raise DsaError("--extra-flag", f"'{flag}' is not a compiler flag",
                           "e.g. --extra-flag=--iree-opt-level=O3")
        if flag.partition("=")[0] in _OWN_FLAGS:
            raise DsaError("--extra-flag", f"'{flag}' is set by dsa-profile itself", "drop it")
    return list(flags)


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
    from dsa.stages.compile import compile_flags, run_iree_compile
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
    bucket_view = _parse_bucket(bucket, manifest, name)
    compile_view, note = _compile_view(manifest, target, name)
    where = f"{name} for target {target.get('name')}"
    flags = compile_flags(compile_view, target, where, **({"tuning": tuning} if tuning is not None else {}))
    flags += _check_extra_flags(tuning_flags)
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
        record = _parameter_record(traced, mlir, view)
        values = _input_values(traced.traced_inputs, inputs or {},
                               manifest.get("flow_steps") if steps is None else steps)
        timings["trace_s"] = time.monotonic() - start

        if weights.suffix == ".safetensors":
            irpa = work / "params.irpa"
            build_params(weights, project(manifest, "params"), record, irpa, manifest_name=name)
        else:
            irpa = weights
            _check_archive(irpa, record)

        start = time.monotonic()
        sources_path = work / "executable_sources.mlir"
        run_iree_compile(mlir_path, flags + ["--compile-to=executable-sources", "--mlir-print-debuginfo"],
                         sources_path, where)
        vmfb = work / "model.vmfb"
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
        "rewrites": list(rewrites) if rewrites is not None else None,
        "runs": runs,
        "profiling_mode": _profiling_mode(target["runtime_driver"]),
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


# -- output --------------------------------------------------------------------------------------------------


def _shorten(items: Sequence[str], keep: int = 3) -> str:
    if not items:
        return "?"
    shown = ", ".join(items[:keep])
    return shown + (f" +{len(items) - keep} more" if len(items) > keep else "")


def _ms(value: float) -> str:
    return f"{value:.1f}" if value >= 100 else f"{value:.3f}" if value >= 1 else f"{value:.4f}"


def _count(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def format_profile(result: dict, top: Optional[int] = None) -> str:
    top = result.get("top", 15) if top is None else top
    rows = [("#", "dispatch", "count", "ms", "%", "source ops", "module paths")]
    for d in result["dispatches"][:top]:
        rows.append((str(d["rank"]), d["name"], _count(d["count"]), _ms(d["total_ms"]), f"{d['percent']:.1f}",
                     _shorten(d["ops"]), _shorten(d["module_paths"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    right = {0, 2, 3, 4}
    lines = []
    bucket = result["bucket"]
    lines.append(f"{result['model_id']} on {result['target']}"
                 + (f", {bucket['dim']}={bucket['size']}" if bucket else "")
                 + f": {result['runs']} run(s), profiling mode {result['profiling_mode']}; times per run")
    if result.get("note"):
        lines.append(f"note: {result['note']}")
    for r in rows:
        cells = [r[i].rjust(widths[i]) if i in right else r[i].ljust(widths[i]) for i in range(len(widths))]
        lines.append("  ".join(cells + [r[-1]]).rstrip())
    total, summed = result["total_ms"], result["dispatch_ms"]
    shown = result["dispatches"][:top]
    lines.append(f"total: {total:.3f} ms per run (wall); dispatches: {summed:.3f} ms "
                 f"({100.0 * summed / total if total else 0:.1f}% of total) in {_count(result['dispatch_calls'])} "
                 f"calls of {len(result['dispatches'])} dispatch functions; top {len(shown)}: "
                 f"{sum(d['total_ms'] for d in shown):.3f} ms")
    if any(p.startswith(INFERRED_MARK) for d in result["dispatches"][:top] for p in d["module_paths"]):
        lines.append(f"{INFERRED_MARK}path: inferred from the parameters or neighbours of ops inside a "
                     "higher-order op's subgraph (torch.export records no module stack there)")
    if result["unmapped"]:
        lines.append(f"no source found for: {', '.join(result['unmapped'])}")
    lines.append(f"vmfb sha256 {result['vmfb_sha256']} (the build's, for the same flags and rewrites)")
    return "\n".join(lines)


def _input_override(text: str) -> Tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"'{text}' is not NAME=VALUE or NAME=@FILE.npy")
    return name, value


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: List[str] = []
    if "--" in argv:  # everything after `--` goes to iree-compile
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="dsa profile", description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", required=True, type=Path)
    weights = parser.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", type=Path, help="the model's .safetensors checkpoint")
    weights.add_argument("--params", type=Path, help="a built parameter archive (.irpa)")
    parser.add_argument("--target", required=True, type=Path, help="target spec (toolchains/targets/NAME.json)")
    parser.add_argument("--tuning", type=Path, help="tuning file (toolchains/tuning/<family>.<target>.json; "
                        "default: the manifest's tuning family's file for the target)")
    parser.add_argument("--policy-config", type=Path, help="framework lerobot: the policy's config.json (default: "
                        "model.policy_config.path, relative to the manifest)")
    parser.add_argument("--extra-flag", action="append", default=[], metavar="FLAG",
                        help="iree-compile flag after the build's, as --extra-flag=--iree-opt-level=O3 "
                             "(or put flags after `--`)")
    parser.add_argument("--bucket", help="DIM=SIZE (default: the manifest's smallest bucket)")
    parser.add_argument("--input", action="append", default=[], type=_input_override, metavar="NAME=VALUE",
                        help="an input's value (a number fills it) or NAME=@FILE.npy")
    parser.add_argument("--steps", type=int, help="value of the model's integer scalar input (flow steps)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="calls to profile (times are per call)")
    parser.add_argument("--pythonpath", action="append", default=None,
                        help="directory holding the model code (default: the current directory)")
    parser.add_argument("--json", type=Path, help="write the whole profile (every dispatch) as JSON")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep the MLIR, executable sources, vmfb and profile there")
    parser.add_argument("--rewrites", metavar="NAMES",
                        help="comma-separated graph rewrites to trace with, '' for none (default: the "
                        "manifest's, as the build applies them)")
    a = parser.parse_args(argv)
    rewrites = None if a.rewrites is None else [n for n in a.rewrites.split(",") if n]
    from dsa.core.fileio import read_json, write_json_atomic

    tuning = a.tuning
    if tuning is None:
        # As the build compiles it: the tuning family the manifest names, for this target.
        import yaml

        family = (yaml.safe_load(Path(a.manifest).read_text(encoding="utf-8")) or {}).get("tuning")
        target_name = read_json(a.target).get("name")
        candidate = Path(__file__).resolve().parents[2] / "toolchains" / "tuning" / f"{family}.{target_name}.json"
        if family and candidate.is_file():
            tuning = candidate
    result = profile_model(
        a.manifest, a.checkpoint or a.params, a.target, bucket=a.bucket, steps=a.steps, top=a.top,
        tuning_flags=a.extra_flag + passthrough, runs=a.runs, inputs=dict(a.input),
        tuning=read_json(tuning) if tuning else None, pythonpath=a.pythonpath or ["."], keep_dir=a.keep,
        rewrites=rewrites, policy_config=a.policy_config)
    print(format_profile(result))
    if a.json:
        write_json_atomic(a.json, result)


if __name__ == "__main__":
    run_cli(main, "dsa profile")
