"""DsaExport: model code + the manifest's export view → torch-dialect MLIR with externalised parameters,
and an export record.

The MLIR names every parameter (`#flow.parameter.named<"model"::"name">`) and holds none of their values, so
a weights-only change never reaches this stage. The export record (JSON) is the stage's contract with the
next ones: entry point, inputs and outputs with shapes and dtypes, dynamic dims and their bounds (or the
bucket a specialised export is for), every parameter's name/shape/dtype, an op histogram, and the digests
of the model sources it was made from.

Without a bucket the export keeps the model's dynamic dims dynamic; with a bucket (see `dsa_bucket`) each
named dim is fixed to the bucket's size, and the parameters must equal those of the model's own export.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from dsa.stages import importer_fixes
from dsa.core.determinism import pin_math_libraries
from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import read_json, sha256_bytes, sha256_file, write_bytes_atomic
from dsa.core.formats import (FILE_FRAMEWORKS, FILE_FRONT_ENDS, PARAMETER_SCOPE,  # noqa: F401
                              RECORD_FORMAT, ExportRecord, current_entry_point)
from dsa.stages.precision import apply_precision
from dsa.stages.quant import quantize_module, scale_name
from dsa.stages.spec import DTYPE_NAMES, ExportSpec, InputSpec
from dsa.stages.weightless import Budget, ModelTooLarge, as_fake, without_weights

# Upper bound given to torch.export for a dynamic dim. IREE does not enforce it at run time; the runner does.
DYNAMIC_DIM_MAX = 65536
# Seed of the example inputs used for tracing (values never reach the artifact, only shapes do).
EXAMPLE_SEED = 0
# What building a model (without its weights) may register: the largest policies built here (OpenVLA-7B:
# 7.5e9 elements in 1,337 tensors) are far below both. A config that asks for more (a million
# layers, a width of a million) is refused as the parameters are registered, naming the config, instead of
# allocating until the machine runs out of memory.
MAX_MODEL_PARAMETER_TENSORS = 20_000
MAX_MODEL_ELEMENTS = 1 << 37
# A LeRobot policy's config.json is a few kilobytes.
MAX_POLICY_CONFIG_BYTES = 1 << 20


def load_entry_point(entry_point: str, pythonpath: Sequence[str] = ()):
    """Imports `package.module:function`, with `pythonpath` appended to sys.path (a renamed front-end entry
    point, RENAMED_ENTRY_POINTS, under its current name)."""
    for entry in pythonpath:
        if entry not in sys.path:
            sys.path.append(entry)
    entry_point = current_entry_point(entry_point)
    module_name, _, function_name = entry_point.partition(":")
    if not module_name or not function_name:
        raise DsaError("model.entry_point", f"'{entry_point}' is not of the form package.module:function")
    check_entry_point_origin(entry_point, module_name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = "add the model's py_library to the rule's `deps` (or its directory to --pythonpath)"
        if module_name.startswith("dsa.frontends."):
            front_end = module_name.split(".")[2]
            hint = (f"a front end of the rule set: add @rules_dsa//dsa:{front_end} to the dsa_model's `deps` "
                    f"(dsa_policy does so for a LeRobot policy)")
        raise DsaError("model.entry_point", f"cannot import '{module_name}': {e}", hint) from None
    try:
        function = getattr(module, function_name)
    except AttributeError:
        raise DsaError("model.entry_point", f"module '{module_name}' has no function '{function_name}'") from None
    defined_in = getattr(function, "__module__", None) or ""
    if not inspect.isfunction(function) or not (defined_in == module_name or defined_in.startswith(module_name + ".")):
        raise DsaError("model.entry_point", f"'{entry_point}' is not a Python function defined in the model's "
                       f"module (it is {type(function).__name__} from {defined_in or 'nowhere'})",
                       "name the model's own export-spec function (docs/security.md: what is code)")
    return function


# Where an entry point may come from (docs/security.md): model code on the model path, or a front end of the rule
# set. The standard library, builtins and installed packages are refused before anything is imported: a
# manifest is data, and `builtins:exec` or `os:system` would make it code.
def check_entry_point_origin(entry_point: str, module_name: str) -> None:
    top = module_name.split(".")[0]
    refuse = None
    if top == "dsa":
        if not module_name.startswith("dsa.frontends."):
            refuse = "a module of the rule set itself, not a front end (dsa.frontends.*)"
    elif top in sys.builtin_module_names or top in getattr(sys, "stdlib_module_names", ()):
        refuse = "the Python standard library"
    else:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        origin = (spec.origin or "") if spec is not None else ""
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if any(part in ("site-packages", "dist-packages") for where in [origin, *locations]
               for part in Path(where).parts):
            refuse = "an installed package, not model code"
    if refuse:
        raise DsaError("model.entry_point", f"'{entry_point}' is {refuse}",
                       "name a function of the model's own package (on the model path: the rule's deps or "
                       "--pythonpath), or a rules_dsa front end (docs/security.md)")


def model_source_files(entry_point: str, pythonpath: Sequence[str]) -> List[str]:
    """The model code behind an entry point: the .py files (relative to their pythonpath root) of its module,
    its parent packages and what they import from the pythonpath, rules_dsa's own `dsa` package excepted.
    The Bazel rules pass the same set (the model's py_library sources without //dsa) to DsaExport."""
    import modulefinder

    module_name = current_entry_point(entry_point).partition(":")[0]
    if module_name == "dsa" or module_name.startswith("dsa."):
        return []  # a front end of the rule set: recorded with the stage code, not as model sources
    finder = modulefinder.ModuleFinder(path=list(pythonpath))
    try:
        finder.import_hook(module_name)
    except ImportError as e:
        raise DsaError("model.entry_point", f"cannot find '{module_name}' on the model path {list(pythonpath)}: {e}",
                       "pass --pythonpath DIR (the directory the entry point's package is in)") from None
    files = set()
    for name, module in finder.modules.items():
        if module.__file__ and name != "dsa" and not name.startswith("dsa."):
            # Absolute but not resolved: in a runfiles tree every file is a symlink to elsewhere.
            path = Path(os.path.abspath(module.__file__))
            for root in pythonpath:
                if path.is_relative_to(os.path.abspath(root)):
                    files.add(str(path.relative_to(os.path.abspath(root))))
                    break
    return sorted(files)


def _example_size(minimum: int) -> int:
    # torch.export specialises a dim traced at size 0 or 1; trace well above the minimum.
    return max(2 * minimum, 16)


def _shape_of(value, dim_names: Dict[str, str]) -> list:
    shape = []
    for d in value.shape:
        text = str(d)
        shape.append(int(text) if text.isdigit() else dim_names.get(text, text))
    return shape


def _op_histogram(graph_module) -> Dict[str, int]:
    """Counts call_function targets in the exported graph and in every subgraph (e.g. a loop body)."""
    counts: collections.Counter = collections.Counter()
    for module in graph_module.modules():
        graph = getattr(module, "graph", None)
        if graph is None:
            continue
        for node in graph.nodes:
            if node.op == "call_function":
                name = getattr(node.target, "__name__", str(node.target))
                counts[str(getattr(node.target, "_name", name))] += 1
    return dict(sorted(counts.items()))


_UNSUPPORTED = re.compile(r'torch\.operator "([^"]+)"')
_NAMED_PARAMETER = re.compile(r'#flow\.parameter\.named<"' + PARAMETER_SCOPE + r'"::"([^"]+)">')


def _module_sites(exported, op: str) -> List[str]:
    """The model module paths (with their classes) whose forward calls `op` (e.g. "aten.linalg_eig"), from
    the exported graph's nn_module_stack."""
    sites = set()
    for module in exported.graph_module.modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if graph is not None else []:
            if node.op == "call_function" and str(node.target).startswith(op):
                stack = node.meta.get("nn_module_stack") or {}
                if stack:
                    path, kind = list(stack.values())[-1]
                    kind = getattr(kind, "__name__", str(kind)).rsplit(".", 1)[-1]
                    sites.add(f"{path or '<root>'} ({kind})")
    return sorted(sites)


def _named_with_sites(ops: Sequence[str], exported) -> str:
    named = []
    for op in ops:
        sites = _module_sites(exported, op)
        named.append(f"'{op}'" + (f" in module {', '.join(sites)}" if sites else ""))
    return "; ".join(named)


# What the model author can do about an op IREE cannot take.
OP_CHOICES = (
    "rewrite that part of the model with ops IREE lowers; or give the export a decomposition of the op "
    "(ExportSpec.decompositions; for your own kernel, a torch.library custom op with its decomposition, as "
    "models/custom_op does); or split the model so that this part runs outside the compiled module "
    "(docs/security.md, 'Ops IREE cannot compile')"
)


def check_supported_ops(mlir: str, exported, where: str) -> None:
    """An op the importer could not map to the torch dialect fails late in iree-compile; fail here instead,
    naming the op and the model module it came from."""
    ops = sorted(set(_UNSUPPORTED.findall(mlir)))
    if not ops:
        return
    # torch.operator "torch.aten.linalg_eig" → aten.linalg_eig; a custom op keeps its namespace.
    ops = [op.split(".", 1)[-1] if op.startswith("torch.") else op for op in ops]
    raise DsaError(
        where,
        f"unsupported op {_named_with_sites(ops, exported)}: IREE cannot lower it (imported as torch.operator)",
        OP_CHOICES,
    )


# A torch-dialect op in the IR a failed torch → linalg conversion leaves behind (`torch.aten.upsample_bilinear2d.vec`).
_TORCH_OP = re.compile(r"\btorch\.((?:aten|prims)\.[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?)")


def check_lowerable(mlir: str, exported, where: str) -> None:
    """An op that imports into the torch dialect but has no lowering (`aten.upsample_bilinear2d.vec` did not)
    makes iree-compile fail with a message about a constant that feeds it. Run the compiler's input
    conversion here (target-independent, about a second), and name the ops it could not convert — those of
    the model's own graph that survive in the IR at the failure — with their module paths."""
    from dsa.stages.iree_tools import first_error_line, iree_compile_path

    with tempfile.TemporaryDirectory(prefix="dsa-lowering-") as tmp:
        path = Path(tmp) / "model.mlir"
        path.write_text(mlir, encoding="utf-8")
        proc = subprocess.run(
            [iree_compile_path(), str(path), "--iree-input-type=torch", "--compile-to=input",
             "--mlir-print-ir-after-failure", "-o", os.devnull],
            capture_output=True, text=True,
        )
    if proc.returncode == 0:
        return
    graph_ops = {str(node.target) for module in exported.graph_module.modules()
                 for node in (module.graph.nodes if hasattr(module, "graph") else ()) if node.op == "call_function"}
    dump = proc.stderr.split("IR Dump After", 1)[-1]
    left = sorted({op for op in _TORCH_OP.findall(dump) if op in graph_ops})
    # "<unknown>:0: error: failed to legalize operation 'torch.constant.float': %6 = ..." → the words only.
    message = first_error_line(proc.stderr).split(": %", 1)[0].split("error: ", 1)[-1].strip()
    if not left:
        raise DsaError(where, f"IREE's input conversion failed: {message}",
                       "run `iree-compile --iree-input-type=torch --compile-to=input` on the exported MLIR")
    raise DsaError(
        where,
        f"IREE cannot lower op {_named_with_sites(left, exported)}: it imports into the torch dialect but has no "
        f"conversion (the compiler says: {message})",
        OP_CHOICES,
    )


def parameter_entries(module, mlir: str):
    """(the module's parameters as the MLIR names them — name, shape, dtype — and the names of its own tensors
    the graph never reads). The second are a training-only branch a checkpoint may hold (ACT's VAE encoder):
    the parameter stage leaves them out of the archive."""
    named = set(_NAMED_PARAMETER.findall(mlir))
    state = sorted(module.state_dict().items())
    parameters = [{"name": name, "shape": list(tensor.shape), "dtype": DTYPE_NAMES[tensor.dtype]}
                  for name, tensor in state if name in named]
    return parameters, [name for name, _ in state if name not in named]


def _dynamic_shapes(inputs: Sequence[InputSpec], minimums: Dict[str, int]):
    """torch.export dynamic_shapes for the positional inputs, or None when every shape is static."""
    import torch

    if not any(s.dynamic for s in inputs):
        return None
    objects: Dict[str, object] = {}
    for s in inputs:
        for name in s.dynamic.values():
            objects.setdefault(name, torch.export.Dim(name, min=minimums.get(name, 1), max=DYNAMIC_DIM_MAX))
    return tuple({axis: objects[name] for axis, name in s.dynamic.items()} or None for s in inputs)


def _for_signature(module, dynamic):
    """torch.export wants dynamic_shapes shaped like forward's parameters: a `*args` forward takes the
    per-input specs as one tuple."""
    if dynamic is None:
        return None
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return (dynamic,)
    return dynamic


@dataclasses.dataclass
class Traced:
    """A model traced by torch.export for one set of dims, after the manifest's graph rewrites."""

    spec: ExportSpec
    module: object            # the eval() nn.Module, parameters externalised
    exported: object          # torch.export.ExportedProgram
    traced_inputs: List[InputSpec]  # spec.inputs with the bucketed dim made static
    minimums: Dict[str, int]
    dim_names: List[str]
    static: set
    quantized: dict
    rewrites: Dict[str, int]  # rewrite pass → number of rewrites it made
    where: str
    precision: Optional[dict] = None  # the manifest's precision, when not f32


def _has_inplace_ops(exported) -> bool:
    """Whether the exported graph (or a subgraph) still calls a mutating ATen op (`relu_`, `add_`, ...).
    torch.export's training IR keeps them (torchvision's ResNets use ReLU(inplace=True)); the torch-dialect
    importer cannot take them."""
    for module in exported.graph_module.modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if graph is not None else []:
            schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
            if schema is not None and schema.is_mutable:
                return True
    return False


def load_policy_config(view: dict, path: Optional[Union[str, Path]], manifest_name: str = "manifest") -> dict:
    """A `framework: lerobot` view with its policy's config.json (checked against the manifest's digest) put
    in `view["model"]["pretrained_config"]`, where dsa.frontends.lerobot's entry point reads it. Other views pass."""
    pinned = view["model"].get("policy_config")
    if view.get("framework") != "lerobot" or pinned is None:
        return view
    where = f"{manifest_name}: model.policy_config"
    if path is None:
        raise DsaError(where, "the export was given no policy config.json",
                       "pass the policy directory's config.json (dsa_model's `policy_config`, or --policy-config)")
    path = Path(path)
    if not path.is_file():
        raise DsaError(where, f"no such file: {path}", "point model.policy_config.path at the policy's config.json")
    size = path.stat().st_size
    if size > MAX_POLICY_CONFIG_BYTES:
        raise DsaError(where, f"{path} is {size} bytes, over the {MAX_POLICY_CONFIG_BYTES}-byte limit of a policy "
                       "config", "point model.policy_config.path at the policy's config.json")
    digest = sha256_file(path)
    if digest != pinned["sha256"]:
        raise DsaError(
            f"{where}.sha256",
            f"{path} has sha256 {digest}, the manifest pins {pinned['sha256']}",
            "if the new config is intended, update model.policy_config.sha256; else restore the file",
        )
    view = dict(view, model=dict(view["model"], pretrained_config=read_json(path)))
    return view


def _largest_values(config: Any, count: int = 3) -> str:
    """The largest numbers of a config, as `field=value` (what to look at when a model is too large)."""
    found: List[Tuple[float, str]] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            found.append((abs(value), f"{path}={value}"))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, list):
            for i, item in enumerate(value[:1000]):
                walk(item, f"{path}[{i}]")

    walk(config, "")
    found.sort(key=lambda pair: -pair[0])
    return ", ".join(text for _, text in found[:count]) or "no numbers"


@contextlib.contextmanager
def building_model(view: dict, manifest_name: str) -> Iterator[None]:
    """Builds the model inside: without its weights, within the budget (MAX_MODEL_PARAMETER_TENSORS,
    MAX_MODEL_ELEMENTS), and with an allocation that cannot be met refused as the config's fault, naming it,
    not reported as an unexpected error."""
    lerobot = view.get("framework") == "lerobot"
    field = "model.policy_config" if lerobot else "model.config"
    config = view["model"].get("pretrained_config") if lerobot else view["model"].get("config")
    where = f"{manifest_name}: {field}"
    hint = (f"check {field} (its largest values: {_largest_values(config)}); the limits are those of "
            f"dsa.stages.export (MAX_MODEL_PARAMETER_TENSORS, MAX_MODEL_ELEMENTS)")
    try:
        with without_weights(Budget(MAX_MODEL_PARAMETER_TENSORS, MAX_MODEL_ELEMENTS)):
            yield
    except ModelTooLarge as e:
        raise DsaError(where, f"the model it describes is larger than any policy this rule set builds: {e}",
                       hint) from None
    except (MemoryError, RuntimeError) as e:
        text = str(e)
        if not isinstance(e, MemoryError) and "can't allocate memory" not in text and "not enough memory" not in text:
            raise
        tried = re.search(r"allocate (\d+) bytes", text)
        amount = f" ({int(tried.group(1)) / 2**30:,.1f} GiB at once)" if tried else ""
        raise DsaError(where, f"building the model it describes needs more memory than this process can have"
                       f"{amount}", hint) from None


def rewrite_names(view: dict) -> List[str]:
    """The graph rewrites the export view asks for (`model.rewrites`), or dsa.stages.passes' defaults."""
    from dsa.stages import passes

    names = view["model"].get("rewrites")
    return list(passes.DEFAULT_PASSES if names is None else names)


def trace_model(
    view: dict,
    *,
    bucket: Optional[dict] = None,
    pythonpath: Sequence[str] = (),
    manifest_name: str = "manifest",
    rewrites: Optional[Sequence[str]] = None,
    policy_config: Optional[Union[str, Path]] = None,
    weightless: bool = True,
) -> Traced:
    """Builds the model the export view names, traces it with torch.export (dynamic dims dynamic, a bucket's
    dim fixed) and applies the graph rewrites (`rewrites`, default: the view's). The model is built without
    its weights (`weightless`, dsa.stages.weightless); `weightless=False` builds them for real, as rules_dsa
    did before, for the test that proves both give the same MLIR."""
    import numpy as np
    import torch
    from iree.turbine import aot

    importer_fixes.apply()
    view = load_policy_config(view, policy_config, manifest_name)
    entry = load_entry_point(view["model"]["entry_point"], pythonpath)

    # A first call at a nominal size tells us the model's dynamic dims and their minimums. Both calls build the
    # model without its weights (dsa.stages.weightless): the export never needs their values.
    def building():
        return building_model(view, manifest_name) if weightless else contextlib.nullcontext()

    with building():
        probe = entry(view, NominalDims())
    minimums = dict(probe.dim_minimums)
    names = probe.dynamic_dim_names()
    del probe
    if bucket is not None:
        if bucket["dim"] not in names:
            raise DsaError(
                f"{manifest_name}: buckets.{bucket['dim']}",
                f"the model has no dynamic dim '{bucket['dim']}' (its dynamic dims: {', '.join(names) or 'none'})",
                "bucket only the dims the model declares dynamic",
            )
        if bucket["size"] < minimums.get(bucket["dim"], 1):
            raise DsaError(
                f"{manifest_name}: buckets.{bucket['dim']}[{bucket['slot']}]",
                f"bucket size {bucket['size']} is below the model's minimum {minimums[bucket['dim']]} for "
                f"'{bucket['dim']}'",
                "raise the bucket size",
            )
        dims = {name: _example_size(minimums.get(name, 1)) for name in names}
        dims[bucket["dim"]] = bucket["size"]
        static = {bucket["dim"]}
    else:
        dims = {name: _example_size(minimums.get(name, 1)) for name in names}
        static = set()

    with building():
        spec: ExportSpec = entry(view, dims)
        module = spec.module.eval()
        quantized = quantize_module(module, view.get("quant_scheme", {"kind": "none"}))
    if weightless:
        as_fake(module)  # storage-less weights: the graph and its parameters' names, shapes and dtypes only
    # The manifest's precision: weights stored in bf16 / f16 (widened where read, or computed in).
    precision = apply_precision(module, view, keep=list(quantized) + [scale_name(n) for n in quantized])
    aot.externalize_module_parameters(module, external_scope=PARAMETER_SCOPE)
    rng = np.random.default_rng(EXAMPLE_SEED)
    args = tuple(s.example(rng) for s in spec.inputs)

    # Axes of the bucketed dim are traced at the bucket's size and exported static.
    traced = [dataclasses.replace(s, dynamic={a: n for a, n in s.dynamic.items() if n not in static})
              for s in spec.inputs]
    dynamic = _dynamic_shapes(traced, minimums)

    where = f"{manifest_name}: model.entry_point ({view['model']['entry_point']})"
    try:
        with torch.no_grad():
            exported = torch.export.export(
                module, args, dynamic_shapes=_for_signature(module, dynamic), strict=False
            )
    except Exception as e:  # torch reports guard failures, unsupported Python, ... with long texts.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DsaError(where, f"torch.export failed: {type(e).__name__}: {first}",
                       "make the model traceable by torch.export (see the message above)") from None
    if _has_inplace_ops(exported):
        # Functionalise (an empty decomposition table: only in-place → out-of-place, nothing decomposed).
        exported = exported.run_decompositions({})
    if spec.decompositions:
        # The model's own decompositions only (no default table: the rest of the graph stays as traced).
        try:
            exported = exported.run_decompositions(dict(spec.decompositions))
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DsaError(f"{where}: ExportSpec.decompositions", f"a decomposition failed: {type(e).__name__}: "
                           f"{first}", "make each decomposition take the op's arguments and return its "
                           "result with traceable torch ops") from None
    names_to_apply = rewrite_names(view) if rewrites is None else list(rewrites)
    counts: Dict[str, int] = {}
    if names_to_apply:
        from dsa.stages import passes

        exported, counts = passes.apply_passes(exported, names_to_apply)
    return Traced(spec, module, exported, traced, minimums, names, static, quantized, counts, where, precision)


def export_model(
    view: dict,
    out_mlir: Path,
    out_record: Path,
    *,
    bucket: Optional[dict] = None,
    reference_record: Optional[dict] = None,
    sources: Union[Sequence[str], Mapping[str, str]] = (),
    pythonpath: Sequence[str] = (),
    manifest_name: str = "manifest",
    rewrites: Optional[Sequence[str]] = None,
    policy_config: Optional[Union[str, Path]] = None,
    model_file: Optional[Union[str, Path]] = None,
    weightless: bool = True,
) -> dict:
    """Exports the model that `view["model"]["entry_point"]` builds (frameworks pytorch, lerobot), or imports
    the model file (`model_file`, the manifest's model.file: frameworks onnx, stablehlo). Returns the export
    record."""
    if view["framework"] in FILE_FRAMEWORKS:
        return _import_model_file(view, out_mlir, out_record, model_file, bucket=bucket,
                                  reference_record=reference_record, manifest_name=manifest_name)
    import numpy as np
    import torch
    from iree.turbine import aot

    t = trace_model(view, bucket=bucket, pythonpath=pythonpath, manifest_name=manifest_name,
                    rewrites=rewrites, policy_config=policy_config, weightless=weightless)
    spec, module, exported, traced = t.spec, t.module, t.exported, t.traced_inputs
    minimums, names, static, quantized, where = t.minimums, t.dim_names, t.static, t.quantized, t.where

    output = aot.export(exported)
    mlir = str(output.mlir_module)
    check_supported_ops(mlir, exported, where)
    check_lowerable(mlir, exported, where)

    parameters, unused = parameter_entries(module, mlir)
    if "dense_resource<" in mlir:
        raise DsaError(where, "the MLIR inlines tensor values (dense_resource): weights were not externalised",
                       "register every weight as an nn.Parameter or persistent buffer of the exported module")

    # Dim symbols in the traced shapes (s0, s1, ...) → the model's dim names.
    symbol_names: Dict[str, str] = {}
    user_inputs = [
        n for n in exported.graph.nodes
        if n.op == "placeholder" and n.name in set(exported.graph_signature.user_inputs)
    ]
    for s, node in zip(traced, user_inputs):
        for axis, name in s.dynamic.items():
            symbol_names[str(node.meta["val"].shape[axis])] = name

    inputs = []
    for s, node in zip(spec.inputs, user_inputs):
        entry_input = {
            "name": s.name,
            "shape": _shape_of(node.meta["val"], symbol_names),
            "dtype": s.dtype,
        }
        if s.dynamic:  # named dims (dynamic, or fixed to this bucket) and how the runner pads them
            entry_input["dims"] = {str(axis): name for axis, name in sorted(s.dynamic.items())}
            entry_input["pad_value"] = s.pad_value
        if s.value_range is not None:
            entry_input["value_range"] = list(s.value_range)
        if s.sample_range is not None:
            entry_input["sample_range"] = list(s.sample_range)
        if s.value_domain is not None:
            entry_input["value_domain"] = list(s.value_domain)
        inputs.append(entry_input)
    output_node = next(n for n in exported.graph.nodes if n.op == "output")
    out_vals = [a.meta["val"] for a in output_node.args[0]]
    if len(out_vals) != len(spec.outputs):
        raise DsaError(where, f"the model returns {len(out_vals)} outputs but its spec names {len(spec.outputs)}")
    outputs = [
        {"name": name, "shape": _shape_of(v, symbol_names), "dtype": DTYPE_NAMES[v.dtype]}
        for name, v in zip(spec.outputs, out_vals)
    ]

    record = {
        "format": RECORD_FORMAT,
        "model_id": view["model_id"],
        "function": "main",
        "parameter_scope": PARAMETER_SCOPE,
        "inputs": inputs,
        "outputs": outputs,
        "parameters": parameters,
        "parameter_count": int(sum(int(np.prod(p["shape"])) for p in parameters)),
        "op_histogram": _op_histogram(exported.graph_module),
        # Model code by workspace-relative path (a mapping gives path → file to read).
        "sources": {key: sha256_file(sources[key] if isinstance(sources, Mapping) else key)
                    for key in sorted(sources)},
        "mlir_sha256": sha256_bytes(mlir.encode("utf-8")),
        "toolchain": {
            "torch": torch.__version__,
            "iree-turbine": _version("iree-turbine"),
            "iree-base-compiler": _version("iree-base-compiler"),
        },
    }
    record["rewrites"] = t.rewrites
    if unused:
        record["unused_parameters"] = unused
    if policy_config is not None and view["model"].get("policy_config"):
        record["policy_config_sha256"] = view["model"]["policy_config"]["sha256"]
    if quantized:
        record["quantization"] = {"scheme": view["quant_scheme"], "tensors": quantized}
    if t.precision is not None:  # absent for f32: existing records keep their bytes
        record["precision"] = t.precision
    if bucket is not None:
        record["bucket"] = {"dim": bucket["dim"], "size": bucket["size"], "slot": bucket["slot"]}
        if reference_record is not None:
            # Output axes that carry the bucketed dim (a batch bucket): the runner pads the inputs up to the
            # bucket and cuts these axes back to the caller's size.
            for entry_output, ref in zip(outputs, reference_record["outputs"]):
                dims = {str(axis): dim for axis, dim in enumerate(ref["shape"]) if dim == bucket["dim"]}
                if dims:
                    entry_output["dims"] = dims
        record["dynamic_dims"] = {
            n: {"min": minimums.get(n, 1), "max": DYNAMIC_DIM_MAX} for n in names if n not in static
        }
    else:
        record["dynamic_dims"] = {n: {"min": minimums.get(n, 1), "max": DYNAMIC_DIM_MAX} for n in names}

    if reference_record is not None and reference_record["parameters"] != parameters:
        raise DsaError(
            where,
            "the bucket export's parameters differ from the model export's "
            "(the model builds different weights at different sizes)",
            "make parameter shapes independent of the dynamic dims",
        )

    write_bytes_atomic(out_mlir, mlir.encode("utf-8"))
    ExportRecord.write(out_record, record)
    return record


def _import_model_file(view: dict, out_mlir: Path, out_record: Path, model_file, *, bucket, reference_record,
                       manifest_name: str) -> dict:
    """DsaExport of a framework whose model is a file (its importer: dsa.core.formats.FILE_FRONT_ENDS): the same
    outputs and record checks as a PyTorch export."""
    if model_file is None:
        raise DsaError(f"{manifest_name}: model.file",
                       f"framework '{view['framework']}' imports a model file, and none was given",
                       "pass the manifest's model.file (dsa_model(model_file = ...), --model-file)")
    model_file = Path(model_file)
    if not model_file.is_file():
        raise DsaError(f"{manifest_name}: model.file", f"no such file: {model_file}",
                       "build or copy the model file next to the manifest")
    front_end = FILE_FRONT_ENDS[view["framework"]]
    if model_file.suffix not in front_end.suffixes:
        raise DsaError(f"{manifest_name}: model.file ({model_file})",
                       f"framework '{front_end.name}' imports {' or '.join(front_end.suffixes)} files, "
                       f"not {model_file.suffix or 'a file without a suffix'}",
                       "pass the model file the framework reads, or correct the manifest's framework")
    module, _, function = front_end.importer.partition(":")
    importer = getattr(importlib.import_module(module), function)
    mlir, record = importer(view, model_file, bucket=bucket, manifest_name=manifest_name)
    record = dict(format=RECORD_FORMAT, **record)
    if reference_record is not None and reference_record["parameters"] != record["parameters"]:
        raise DsaError(f"{manifest_name}: model.file ({model_file})",
                       "the bucket import's parameters differ from the model import's",
                       "make the model's weights independent of its dynamic dims")
    write_bytes_atomic(out_mlir, mlir.encode("utf-8"))
    ExportRecord.write(out_record, record)
    return record


def _version(dist: str) -> str:
    from importlib import metadata

    return metadata.version(dist)


class NominalDims(dict):
    """A dims mapping for calls that only need the model's structure: any dim name gets a nominal size."""

    def __missing__(self, key):
        return 16


def main(argv: Optional[List[str]] = None) -> None:
    pin_math_libraries()  # before any computation: dsa.core.determinism
    parser = argparse.ArgumentParser(prog="dsa-export", description=__doc__.splitlines()[0])
    parser.add_argument("--view", required=True, help="the manifest's export view (JSON)")
    parser.add_argument("--bucket-view", help="a bucket view (JSON): export with that dim fixed")
    parser.add_argument("--bucket-count", type=int, help="bucket count the build declares for the dim")
    parser.add_argument("--bucket-target", default="the dsa_bucket target", help="its label, for messages")
    parser.add_argument("--reference-record", help="the model export's record, checked against a bucket's")
    parser.add_argument("--source", action="append", default=[], help="model source file to digest")
    parser.add_argument("--pythonpath", action="append", default=[], help="directory holding model code")
    parser.add_argument("--manifest-name", default="manifest", help="manifest path, for messages")
    parser.add_argument("--policy-config", help="framework lerobot: the policy's config.json")
    parser.add_argument("--model-file", help="frameworks onnx, stablehlo: the manifest's model.file")
    parser.add_argument("--out-mlir", required=True)
    parser.add_argument("--out-record", required=True)
    a = parser.parse_args(argv)
    bucket = read_json(a.bucket_view) if a.bucket_view else None
    if bucket is not None and a.bucket_count is not None and bucket["count"] != a.bucket_count:
        raise DsaError(
            f"{a.manifest_name}: buckets.{bucket['dim']}",
            f"the manifest lists {bucket['count']} bucket(s) but {a.bucket_target} declares count = "
            f"{a.bucket_count}",
            f"set count = {bucket['count']} on {a.bucket_target}",
        )
    export_model(
        read_json(a.view),
        Path(a.out_mlir),
        Path(a.out_record),
        bucket=bucket,
        reference_record=read_json(a.reference_record) if a.reference_record else None,
        sources=a.source,
        pythonpath=a.pythonpath,
        manifest_name=a.manifest_name,
        policy_config=a.policy_config,
        model_file=a.model_file,
    )


if __name__ == "__main__":
    run_cli(main, "dsa-export")
