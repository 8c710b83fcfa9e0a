"""DsaExport for `framework: onnx`: an ONNX model file (the manifest's model.file) → torch-dialect MLIR with its
initializers as named parameters, and an export record of the same format as a PyTorch export's.

IREE's own ONNX importer (iree-base-compiler's `iree.compiler.extras.onnx_importer`, what `iree-import-onnx`
runs) does the translation; the compile stage compiles it with `--iree-input-type=onnx` (the manifest's compile view says so), IREE's
input pipeline that converts the `onnx.*` ops to the torch dialect and on to linalg. Only the graph is read: weights stored in an external-data file
(ONNX's `external_data`, what torch's exporter writes for large models) never reach this stage, and every such
initializer becomes a parameter (`#stream.parameter.named<"model"::"name">`), whatever its size. Initializers
stored inside the .onnx file become parameters from IMPORT_THRESHOLD elements on; smaller ones (shape tensors,
scalars) stay constants, so that the compiler still sees static shapes.

The record's parameters carry where each tensor lies (`onnx`: the initializer's name, and its offset and length
in the external-data file, or `inline`), so that DsaParams reads them from the checkpoint — the external-data
file, or the .onnx file itself when its weights are inline — without the graph: a new weights file of the same
model reruns DsaParams alone, and the MLIR (hence every compile) stays byte-identical.

A bucket fixes a symbolic input dim (ONNX `dim_param`, e.g. "batch") to the bucket's size before the import.
An op IREE cannot import or lower is refused here, naming the ONNX op and node, instead of failing late in
iree-compile.
"""

from __future__ import annotations

import collections
import os
import random
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dsa.core.errors import DsaError
from dsa.core.fileio import sha256_bytes, sha256_file
from dsa.core.formats import PARAMETER_SCOPE
FUNCTION = "main"
# Initializers stored in the .onnx file with at least this many elements become parameters (IREE's default).
IMPORT_THRESHOLD = 100
# A dynamic dim's upper bound in the record (as for PyTorch exports; the runner enforces it).
DYNAMIC_DIM_MAX = 65536

# ONNX TensorProto data types → the record's dtype names (those of dsa.stages.spec.DTYPE_NAMES).
DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
          11: "float64", 16: "bfloat16"}


def _dtype(elem_type: int, where: str) -> str:
    if elem_type not in DTYPES:
        import onnx

        name = onnx.TensorProto.DataType.Name(elem_type) if elem_type in onnx.TensorProto.DataType.values() \
            else str(elem_type)
        raise DsaError(where, f"element type {name} is not supported",
                       f"use one of {', '.join(sorted(set(DTYPES.values())))}")
    return DTYPES[elem_type]


def load_graph(path: Path, where: str):
    """The ONNX model, its external data left where it is."""
    import onnx

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends
        raise DsaError(where, f"not a readable ONNX model: {type(e).__name__}: {str(e).strip()[:200]}",
                       "point model.file at an .onnx file (onnx.save / torch.onnx.export writes one)") from None


def external_info(tensor) -> Optional[Dict[str, object]]:
    """{location, offset, length} of an initializer stored in an external-data file, else None."""
    import onnx

    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    fields = {e.key: e.value for e in tensor.external_data}
    return {"location": fields.get("location", ""), "offset": int(fields.get("offset", 0)),
            "length": int(fields["length"]) if "length" in fields else None}


def _numel(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _value_dims(value_info) -> List[object]:
    """An input's or output's dims: ints, dim_param names, or None for an unnamed unknown dim."""
    dims = []
    for d in value_info.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def _graph_inputs(model) -> list:
    initializers = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in initializers]


def _fix_dim(model, dim: str, size: int) -> int:
    """Sets every input dim named `dim` to `size`; returns how many it set."""
    count = 0
    for value in _graph_inputs(model):
        for d in value.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param == dim:
                d.dim_value = size  # clears dim_param (a oneof)
                count += 1
    return count


def _import(model, threshold: int):
    """(MLIR text without locations, MLIR text with locations, [(onnx initializer name, parameter name)])."""
    from iree.compiler.extras import onnx_importer
    from iree.compiler.ir import Context, StringAttr
    from iree.compiler.tools.import_onnx.importer_externalization_overrides import IREENodeImporter, ParamData

    # The importer names an unnamed initializer's parameter with `random`: seeded, the names are the same on
    # every run.
    state = random.getstate()
    random.seed(0)
    try:
        context = Context()
        info = onnx_importer.ModelInfo(model)
        module = info.create_module(context=context).operation
        data = ParamData(param_bit_threshold=None, num_elements_threshold=threshold, params_scope=PARAMETER_SCOPE,
                         data_dir="", param_path="", input_index_threshold=None)
        importer = IREENodeImporter.define_function(info.main_graph, module, data)
        importer.import_all()
        func = next(op for op in module.regions[0].blocks[0].operations
                    if op.operation.name == "func.func")
        func.attributes["sym_name"] = StringAttr.get(FUNCTION, context=context)
        module.verify()
        return (module.get_asm(enable_debug_info=False), module.get_asm(enable_debug_info=True),
                list(importer.globals))
    finally:
        random.setstate(state)


_ONNX_OP = re.compile(r'torch\.operator "onnx\.([A-Za-z0-9_]+)"')

OP_CHOICES = (
    "re-export the model with ops IREE lowers (a newer opset, another exporter setting, or the operation "
    "rewritten in the source framework), or split the model so that this part runs outside the compiled module "
    "(docs/frontends.md)"
)


def _nodes_by_name(model) -> Dict[str, object]:
    return {n.name: n for n in model.graph.node if n.name}


def check_known_ops(model, where: str) -> None:
    """Refuses a node of an operator set IREE's importer does not know (a custom domain, an op no ONNX opset
    defines) before the import, naming op and node: such a node has no types, so IREE's own error would name
    the first node that consumes its output instead."""
    import onnx.defs

    local = {(f.domain, f.name) for f in model.functions}  # model-local functions are expanded by the importer
    unknown = []
    for node in model.graph.node:
        domain = node.domain if node.domain != "ai.onnx" else ""
        if (domain, node.op_type) in local:
            continue
        if domain not in ("", "ai.onnx.ml") or not onnx.defs.has(node.op_type, domain):
            unknown.append(f"'{domain + '.' if domain else ''}{node.op_type}' (node '{node.name or '?'}')")
    if unknown:
        raise DsaError(where, f"ONNX op {', '.join(dict.fromkeys(unknown))} is not in the standard ONNX operator "
                              "sets, so IREE cannot import or lower it", OP_CHOICES)


def check_lowerable(mlir_with_locations: str, model, where: str) -> None:
    """Runs IREE's input conversion (torch → linalg, the onnx ops included); on failure names the ONNX op and
    node that stand in the way, from the failing op's location (the importer locates each op at its node)."""
    from dsa.stages.iree_tools import first_error_line, iree_compile_path

    with tempfile.TemporaryDirectory(prefix="dsa-onnx-lowering-") as tmp:
        path = Path(tmp) / "model.mlir"
        path.write_text(mlir_with_locations, encoding="utf-8")
        proc = subprocess.run(
            [iree_compile_path(), str(path), "--iree-input-type=onnx", "--compile-to=input",
             "--mlir-print-op-on-diagnostic=true", "-o", os.devnull],
            capture_output=True, text=True,
        )
    if proc.returncode == 0:
        return
    nodes = _nodes_by_name(model)
    culprits = []
    for line in proc.stderr.splitlines():
        if "error:" not in line:
            continue
        # `<unknown>:0: error: loc("node_name"): failed to legalize ...`: the importer locates ops at nodes.
        for name in re.findall(r'loc\("([^"]*)"\)', line):
            if name in nodes:
                culprits.append(f"'{nodes[name].op_type}' (node '{name}')")
        if not culprits and _ONNX_OP.search(line):
            culprits.append(f"'{_ONNX_OP.search(line).group(1)}'")
    message = first_error_line(proc.stderr).split(": %", 1)[0].split("error: ", 1)[-1].strip()
    message = re.sub(r'^loc\("[^"]*"\): ', "", message)
    if proc.returncode < 0 or "Stack dump" in proc.stderr:
        message = f"iree-compile crashed (signal {-proc.returncode})" if proc.returncode < 0 else "iree-compile crashed"
        ops = sorted({n.op_type for n in model.graph.node})
        raise DsaError(where, f"IREE's input conversion crashed on this graph (its ops: {', '.join(ops)})",
                       "run `iree-compile --iree-input-type=onnx --compile-to=input` on `iree-import-onnx`'s output "
                       "to find the op; " + OP_CHOICES)
    if not culprits:
        raise DsaError(where, f"IREE's input conversion failed: {message}",
                       "run `iree-import-onnx` and `iree-compile --iree-input-type=onnx --compile-to=input` on the "
                       "model to see why")
    raise DsaError(where, f"IREE cannot lower ONNX op {', '.join(dict.fromkeys(culprits))} (the compiler says: "
                          f"{message})", OP_CHOICES)


def check_model_file(view: dict, model_file: Path, quantise_where: str, manifest_name: str) -> str:
    """What a file front end checks first: the file is the one the manifest pins (model.file.sha256), and the
    manifest asks for no quantisation (a rewrite of PyTorch graphs; an imported model is taken as it is).
    Returns the file's sha256."""
    pinned = view["model"]["file"]["sha256"]
    actual = sha256_file(model_file)
    if actual != pinned:
        raise DsaError(f"{manifest_name}: model.file.sha256",
                       f"model file {model_file} has sha256 {actual}, but the manifest pins {pinned}",
                       "if this model file is the one you mean to ship, set model.file.sha256 to the new digest")
    quant = view.get("quant_scheme", {"kind": "none"})
    if quant.get("kind", "none") != "none":
        raise DsaError(f"{manifest_name}: quant_scheme",
                       f"quant_scheme '{quant['kind']}' rewrites a PyTorch export's graph; framework "
                       f"{view.get('framework', 'onnx')} imports the model as it is",
                       f"set quant_scheme kind: none (or quantise {quantise_where})")
    return actual


def export_onnx(view: dict, model_file: Path, *, bucket: Optional[dict] = None,
                manifest_name: str = "manifest") -> Tuple[str, dict]:
    """(MLIR text, export record) of the ONNX model `model_file` for the export view (and `bucket`)."""
    import onnx

    where = f"{manifest_name}: model.file ({model_file})"
    actual = check_model_file(view, model_file, "the model before exporting it", manifest_name)
    model = load_graph(model_file, where)
    inputs, outputs = _graph_inputs(model), list(model.graph.output)
    if not outputs:
        raise DsaError(where, "the graph has no outputs")

    names = sorted({d for v in inputs for d in _value_dims(v) if isinstance(d, str)})
    if bucket is not None:
        if bucket["dim"] not in names:
            raise DsaError(f"{manifest_name}: buckets.{bucket['dim']}",
                           f"the ONNX graph has no input dim named '{bucket['dim']}' (its named dims: "
                           f"{', '.join(names) or 'none'})", "bucket only the dims the graph names (dim_param)")
        _fix_dim(model, bucket["dim"], bucket["size"])
    for value in inputs:
        if None in _value_dims(value):
            raise DsaError(where, f"input '{value.name}' has an unnamed dynamic dim: {_value_dims(value)}",
                           "give each dynamic dim a name (dim_param), e.g. torch.onnx.export(dynamic_shapes=...)")
    check_known_ops(model, where)
    try:
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as e:
        raise DsaError(where, f"ONNX shape inference failed: {str(e).strip().splitlines()[0][:200]}",
                       "check the model with onnx.checker.check_model") from None

    external = {t.name: external_info(t) for t in model.graph.initializer}
    locations = sorted({e["location"] for e in external.values() if e is not None})
    if len(locations) > 1:
        raise DsaError(where, f"the weights are in {len(locations)} external-data files ({', '.join(locations)})",
                       "save them in one: onnx.save_model(model, path, save_as_external_data=True, "
                       "all_tensors_to_one_file=True)")
    # Every externally stored initializer must become a parameter (its data is not read here).
    smallest = min((_numel(t.dims) for t in model.graph.initializer if external[t.name] is not None),
                   default=IMPORT_THRESHOLD)
    threshold = max(1, min(IMPORT_THRESHOLD, smallest))
    try:
        mlir, mlir_located, globals_ = _import(model, threshold)
    except DsaError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DsaError(where, f"IREE's ONNX importer failed: {type(e).__name__}: {first[:300]}", OP_CHOICES) from None
    check_lowerable(mlir_located, model, where)

    by_name = {t.name: t for t in model.graph.initializer}
    parameters = []
    for onnx_name, parameter in sorted(globals_, key=lambda g: g[1]):
        tensor = by_name[onnx_name]
        entry = {"name": parameter, "shape": [int(d) for d in tensor.dims],
                 "dtype": _dtype(tensor.data_type, f"{where}: initializer '{onnx_name}'"),
                 "onnx": {"initializer": onnx_name}}
        info = external[onnx_name]
        if info is None:
            entry["onnx"]["inline"] = True
        else:
            entry["onnx"].update(offset=info["offset"], length=info["length"])
        parameters.append(entry)

    # Named dims as the graph declares them (before a bucket fixed one): the runner pads a bucketed input up to
    # the bucket and cuts the outputs that carry the dim back.
    declared = load_graph(model_file, where)
    declared_values = {v.name: v for v in _graph_inputs(declared) + list(declared.graph.output)}

    def describe(value, role: str) -> dict:
        dims = _value_dims(value)
        elem = value.type.tensor_type.elem_type
        entry = {"name": value.name, "shape": dims, "dtype": _dtype(elem, f"{where}: {role} '{value.name}'")}
        if None in dims:
            raise DsaError(where, f"{role} '{value.name}' has a dim neither static nor named: {dims}",
                           "export the model with named dynamic dims (dim_param) or static shapes")
        named = {str(axis): d for axis, d in enumerate(_value_dims(declared_values[value.name]))
                 if isinstance(d, str)}
        if named:
            entry["dims"] = named
            if role == "input":
                entry["pad_value"] = 0
        return entry

    record_inputs = [describe(v, "input") for v in inputs]
    record_outputs = [describe(v, "output") for v in outputs]
    check_manifest_agrees(view, record_outputs[0], where, manifest_name)
    check_inputs_agree(view, record_inputs, where, manifest_name)
    histogram = collections.Counter(f"onnx.{n.op_type}" if not n.domain else f"{n.domain}.{n.op_type}"
                                    for n in model.graph.node)
    from importlib import metadata

    record = {
        "model_id": view["model_id"],
        "framework": "onnx",
        "function": FUNCTION,
        "parameter_scope": PARAMETER_SCOPE,
        "inputs": record_inputs,
        "outputs": record_outputs,
        "parameters": parameters,
        "parameter_count": int(sum(_numel(p["shape"]) for p in parameters)),
        "op_histogram": dict(sorted(histogram.items())),
        "onnx": {"opset": {o.domain or "ai.onnx": int(o.version) for o in model.opset_import},
                 "external_data": locations[0] if locations else None},
        "sources": {view["model"]["file"]["path"]: actual},
        "mlir_sha256": sha256_bytes(mlir.encode("utf-8")),
        "toolchain": {"onnx": metadata.version("onnx"), "iree-base-compiler": metadata.version("iree-base-compiler")},
        "rewrites": {},
    }
    static = {bucket["dim"]} if bucket is not None else set()
    record["dynamic_dims"] = {n: {"min": 1, "max": DYNAMIC_DIM_MAX} for n in names if n not in static}
    if bucket is not None:
        record["bucket"] = {"dim": bucket["dim"], "size": bucket["size"], "slot": bucket["slot"]}
    return mlir, record


def check_inputs_agree(view: dict, inputs: list, where: str, manifest_name: str) -> None:
    """The model's inputs are those the manifest declares: an input named `state` (or ending in `.state`) whose
    last dim is inputs.state.dim, and one input per camera, named as the camera, whose last three dims are its
    shape. Other inputs (token ids, masks, noise) are the model's own."""
    by_name = {i["name"].rsplit(".", 1)[-1]: i for i in inputs}
    listed = ", ".join(f"'{i['name']}' {i['shape']}" for i in inputs) or "none"
    declared = view.get("inputs", {})
    wanted = []
    if "state" in declared:
        wanted.append(("inputs.state.dim", "state", [declared["state"]["dim"]]))
    for k, camera in enumerate(declared.get("cameras", [])):
        wanted.append((f"inputs.cameras[{k}].shape", camera["name"], list(camera["shape"])))
    for field, name, tail in wanted:
        found = by_name.get(name)
        if found is None:
            raise DsaError(f"{manifest_name}: {field}",
                           f"the manifest declares input '{name}', but the model has no input of that name (its "
                           f"inputs: {listed})", "name the model's input as the manifest does, or fix the manifest")
        if found["shape"][-len(tail):] != tail:
            raise DsaError(f"{manifest_name}: {field}",
                           f"input '{found['name']}' of {where} has shape {found['shape']}, but the manifest "
                           f"declares {tail} for its last {len(tail)} dim(s)",
                           "make the manifest's sizes those of the model's input")


def check_manifest_agrees(view: dict, action: dict, where: str, manifest_name: str) -> None:
    """The graph's first output is the action chunk: [..., chunk_size, action dim]."""
    want = [view["chunk_size"], view["outputs"]["action"]["dim"]]
    got = action["shape"][-2:]
    if got != want:
        raise DsaError(where, f"the graph's first output '{action['name']}' has shape {action['shape']}, but "
                              f"{manifest_name} declares chunk_size {want[0]} and outputs.action.dim {want[1]}",
                       "make the manifest's chunk_size and outputs.action.dim those of the model's action output "
                       "(its last two dims)")
