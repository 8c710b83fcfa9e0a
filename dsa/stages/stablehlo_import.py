"""DsaExport for `framework: stablehlo`: a StableHLO module exported by JAX (the manifest's model.file) → the
same module with its weights as named parameters, and an export record of the same format as a PyTorch export's.

JAX's `jax.export.export(jax.jit(apply))(params_spec, obs_spec).mlir_module()` is the file this stage reads:
`module @jit_apply` with one public `func.func @main(params..., obs...)` (plus private helper functions), every
pytree leaf a function argument, dict keys sorted, each argument located at its pytree path
(`loc("params['mlp']['l1']['w']")`). Nothing is baked in: the weights are the leading arguments. This stage keeps
the module as it is and wraps it: JAX's main becomes a private function, each parameter argument a
`util.global` bound to `#flow.parameter.named<"model"::"mlp.l1.w">`, and a new public `main(obs...)` loads the
globals and calls it. The compile stage compiles the result with `--iree-input-type=stablehlo` (the manifest's
compile view says so), whose input pipeline takes the util/flow ops beside the stablehlo ones. The MLIR is
printed without locations (JAX's carry the exporting script's absolute path by default), so the same file
always gives the same bytes, and a new weights file reruns DsaParams alone.

Limits:
- Static shapes only. IREE 3.13 cannot lower the `stablehlo.dynamic_*` ops of a shape-polymorphic export
  (a symbolic batch), so a dynamic dim (`?`) in main's signature is refused, and so are buckets: export the
  model with jax.export at a fixed batch, once per size.
- The parameters are main's leading arguments whose locations are pytree paths under the first argument's
  name (`params[...]`); their names are those paths joined with '.' (`params['mlp']['l1']['w']` → `mlp.l1.w`).
  The observations are the arguments after them, named by their locations: by their keys when they are the
  leaves of one dict (`obs['state']` → `state`), else by their whole paths (`obs`, `cams['front']` →
  `cams.front`). The manifest's inputs must be among them (`state` with inputs.state.dim as its last dim, each
  camera by its name with its shape as its last three dims). A module whose arguments carry no locations (printed without debug info, or rewritten) is
  refused: write `exported.mlir_module()` unchanged.
- The checkpoint is a .safetensors file keyed by those parameter names (DsaParams reads it as for PyTorch).
- An op IREE cannot lower (a `stablehlo.custom_call` to a LAPACK or FFI kernel: jnp.linalg.eig, a jax.ffi
  call) is refused here, naming the op, its call target and JAX's location, instead of failing late in
  iree-compile.
"""

from __future__ import annotations

import ast
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dsa.core.errors import DsaError
from dsa.core.fileio import sha256_bytes
from dsa.core.formats import PARAMETER_SCOPE
from dsa.stages.onnx_import import check_inputs_agree, check_manifest_agrees, check_model_file
FUNCTION = "main"
# The name JAX's main gets in the wrapper (made unique against the module's own symbols).
JAX_MAIN = "jax_main"
# Prefix of the wrapper's parameter globals (likewise made unique).
GLOBAL_PREFIX = "dsa_param_"

# MLIR element types → the record's dtype names.
DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64", "i8": "int8",
          "i16": "int16", "i32": "int32", "i64": "int64", "ui8": "uint8", "i1": "bool"}

STATIC_HINT = ("export with static shapes: jax.export.export(jax.jit(apply))(params_spec, "
               "jax.ShapeDtypeStruct((BATCH, ...), dtype)) at a fixed batch, once per size")
LOCATIONS_HINT = ("the module needs JAX's argument locations: export with jax.export and write "
                  "`exported.mlir_module()` unchanged")
OP_CHOICES = ("compute it outside the policy (before or after the compiled module), or replace it with ops IREE "
              "lowers (docs/frontends.md)")


# -- names ---------------------------------------------------------------------------------------------------

_ROOT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# One step of a pytree path as jax.tree_util.keystr writes it: ['key'], ["key"], [0], .attr, [<flat index 0>].
_STEP = re.compile(r"""\[('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|-?\d+)\]|\.([A-Za-z_][A-Za-z0-9_]*)"""
                   r"""|\[<flat index (\d+)>\]""")


def parse_path(text: str) -> Tuple[str, List[str]]:
    """`params['mlp']['l1']['w']` → ("params", ["mlp", "l1", "w"]); text that is not a pytree path → (text, [])."""
    root = _ROOT.match(text)
    if root is None:
        return text, []
    keys, pos = [], root.end()
    while pos < len(text):
        step = _STEP.match(text, pos)
        if step is None:
            return text, []
        quoted, attribute, flat = step.groups()
        if attribute is not None:
            keys.append(attribute)
        elif flat is not None:
            keys.append(flat)
        elif quoted[0] in "'\"":
            keys.append(str(ast.literal_eval(quoted)))
        else:
            keys.append(quoted)
        pos = step.end()
    return root.group(0), keys


def _location_name(location) -> Optional[str]:
    """The name of a name location (`loc("obs")`, also `loc("obs"(...))`), else None."""
    try:
        return location.name_str
    except AttributeError:
        return None


def _mlir_string(text: str) -> str:
    """`text` as an MLIR string literal."""
    out = []
    for byte in text.encode("utf-8"):
        ch = chr(byte)
        out.append(ch if 0x20 <= byte < 0x7F and ch not in '"\\' else f"\\{byte:02X}")
    return '"' + "".join(out) + '"'


# -- the module ----------------------------------------------------------------------------------------------

def _parse(model_file: Path, where: str):
    from iree.compiler import ir

    context = ir.Context()
    # Shardy attributes (`#sdy.op_sharding_rule` on a custom_call) are not registered in the compiler's Python
    # context; kept opaque, they print back as they came, and iree-compile reads them.
    context.allow_unregistered_dialects = True
    data = model_file.read_bytes()
    try:
        module = ir.Module.parse(data.decode("utf-8"), context)
    except UnicodeDecodeError:
        module = None
    except Exception as e:  # ir.MLIRError
        first = next((l.strip() for l in str(e).splitlines() if "error" in l), str(e).strip()[:200])
        raise DsaError(where, f"not a readable StableHLO module: {first[:300]}",
                       "point model.file at the text JAX writes: jax.export.export(...).mlir_module()") from None
    if module is None:
        raise DsaError(where, "not a StableHLO text module (the file is binary: a serialized jax.export artifact?)",
                       "write the module's text: open(path, 'w').write(exported.mlir_module())")
    return context, module


def _functions(module) -> list:
    return [op for op in module.body.operations if op.operation.name == "func.func"]


def _string(attribute) -> str:
    from iree.compiler import ir

    return ir.StringAttr(attribute).value


def _symbols(module) -> set:
    return {_string(op.attributes["sym_name"]) for op in module.body.operations if "sym_name" in op.attributes}


def _unique(base: str, taken: set) -> str:
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    return name


def _tensor(type_, what: str, where: str) -> Tuple[List[int], str]:
    """(shape, dtype) of a ranked, static tensor type; refuses anything else, naming `what`."""
    from iree.compiler import ir

    if hasattr(type_, "maybe_downcast"):
        type_ = type_.maybe_downcast()
    if not isinstance(type_, ir.RankedTensorType):
        if isinstance(type_, ir.UnrankedTensorType):
            raise DsaError(where, f"{what} has an unranked type {type_}", STATIC_HINT)
        raise DsaError(where, f"{what} has type {type_}, not a tensor",
                       "export a function of arrays only (no tokens or effects): jax.export of jax.jit(apply)")
    tensor = type_
    if any(tensor.is_dynamic_dim(i) for i in range(tensor.rank)):
        raise DsaError(where, f"{what} has a dynamic shape {type_}: IREE 3.13 cannot compile the dynamic ops of "
                              "a shape-polymorphic JAX export", STATIC_HINT)
    element = str(tensor.element_type)
    if element not in DTYPES:
        raise DsaError(where, f"{what} has element type {element}, which is not supported",
                       f"use one of {', '.join(sorted(set(DTYPES.values())))} (mapped from "
                       f"{', '.join(DTYPES)})")
    return [int(d) for d in tensor.shape], DTYPES[element]


def _op_histogram(functions) -> Dict[str, int]:
    """Ops of every function (nested regions included), without func.* and region terminators."""
    from iree.compiler import ir

    counts: collections.Counter = collections.Counter()

    def visit(op):
        name = op.name
        if not name.startswith("func.") and name != "stablehlo.return":
            counts[name] += 1
        return ir.WalkResult.ADVANCE

    for function in functions:
        for region in function.operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    op.operation.walk(visit)
    return dict(sorted(counts.items()))


def _split_arguments(arguments, where: str):
    """(parameters, observations): [(argument index, name)] each, from the arguments' name locations."""
    names = [_location_name(a.location) for a in arguments]
    if not any(names):
        raise DsaError(where, f"main's {len(arguments)} argument(s) carry no name locations, so the parameters "
                              "cannot be told from the observations", LOCATIONS_HINT)
    if names[0] is None:
        raise DsaError(where, "main's first argument (%arg0) carries no name location: it must be a parameter "
                              "located at its pytree path (params[...])", LOCATIONS_HINT)
    paths = [parse_path(n) if n is not None else None for n in names]
    roots = [p[0] if p is not None else None for p in paths]
    # The parameter group: the first argument's root name (`params`); when every argument shares one root
    # (a function of *args: `args[0]['w']`, `args[1]`), the root and its first key.
    depth = 1 if len(arguments) > 1 and len(set(roots)) == 1 and all(paths[0][1] and p[1] for p in paths) else 0

    def group(path):
        return (path[0], *path[1][:depth]) if path is not None else None

    key = group(paths[0])
    count = 0
    while count < len(arguments) and paths[count] is not None and group(paths[count]) == key:
        count += 1
    if count == len(arguments):
        raise DsaError(where, f"every argument of main is under '{paths[0][0]}', so nothing is left for the "
                              "observations (or, if these are the observations, the weights are baked into the "
                              "module as constants)", "export a function apply(params, obs) whose first argument "
                                                      "holds the weights and the rest the observations")
    parameters = []
    for i in range(count):
        root, keys = paths[i]
        rest = keys[depth:]
        parameters.append((i, ".".join(rest) if rest else ".".join([root, *keys])))
    # One observation argument holding a dict (`obs['state']`, `obs['front']`): the inputs are named by their
    # keys (`state`, `front`), as the manifest names them; otherwise by their whole paths.
    rest = paths[count:]
    by_key = (all(p is not None and p[1] for p in rest) and len({p[0] for p in rest}) == 1)
    observations = []
    for i in range(count, len(arguments)):
        if paths[i] is None:
            observations.append((i, f"input_{i - count}"))
        else:
            root, keys = paths[i]
            observations.append((i, ".".join(keys if by_key else [root, *keys])))
    for i, name in parameters:
        # IREE prints a parameter's key without escaping it: a quote or backslash would not parse back.
        if any(ch in name for ch in '"\\') or any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in name):
            raise DsaError(where, f"argument %arg{i} ({names[i]}) gives parameter name {name!r}, which holds a "
                                  "quote, backslash or control character", "rename that pytree key")
    for kind, entries in (("parameter", parameters), ("input", observations)):
        seen: Dict[str, int] = {}
        for i, name in entries:
            if name in seen:
                raise DsaError(where, f"arguments %arg{seen[name]} ({names[seen[name]]}) and %arg{i} ({names[i]}) "
                                      f"get the same {kind} name '{name}'",
                               "rename the pytree keys so that their paths joined with '.' differ")
            seen[name] = i
    return parameters, observations


def _wrapper_ops(callee: str, argument_types, result_types, parameters, observations, globals_) -> str:
    """A module holding a declaration of `callee`, the parameter globals and the new public main. Every op is
    at an unknown location: inlined into main, JAX's ops then keep their own names in the compiler's errors
    (`loc("jit(apply)/eig")`), not this text's line numbers."""
    arg_types = [str(t) for t in argument_types]
    res_types = [str(t) for t in result_types]
    results = ", ".join(res_types)
    unknown = "loc(unknown)"
    lines = ["module {", f"  func.func private @{callee}({', '.join(arg_types)}) -> ({results}) {unknown}"]
    for (index, name), symbol in zip(parameters, globals_):
        lines.append(f"  util.global private @{symbol} = #flow.parameter.named<{_mlir_string(PARAMETER_SCOPE)}::"
                     f"{_mlir_string(name)}> : {arg_types[index]} {unknown}")
    signature = ", ".join(f"%arg{n}: {arg_types[i]} {unknown}" for n, (i, _) in enumerate(observations))
    lines.append(f"  func.func @{FUNCTION}({signature}) -> ({results}) {{")
    operands = {}
    for n, ((index, _), symbol) in enumerate(zip(parameters, globals_)):
        lines.append(f"    %p{n} = util.global.load @{symbol} : {arg_types[index]} {unknown}")
        operands[index] = f"%p{n}"
    for n, (index, _) in enumerate(observations):
        operands[index] = f"%arg{n}"
    call = f"func.call @{callee}({', '.join(operands[i] for i in range(len(arg_types)))}) : " \
           f"({', '.join(arg_types)}) -> ({results}) {unknown}"
    if len(res_types) == 1:
        lines += [f"    %r = {call}", f"    return %r : {results} {unknown}"]
    else:
        lines += [f"    %r:{len(res_types)} = {call}",
                  f"    return {', '.join(f'%r#{k}' for k in range(len(res_types)))} : {results} {unknown}"]
    lines += [f"  }} {unknown}", "}"]
    return "\n".join(lines) + "\n"


def _wrap(context, module, main, parameters, observations, where: str) -> Tuple[str, str]:
    """(wrapper MLIR without locations, the same with them): JAX's main renamed to a private function, the
    parameter globals and a new public main(observations...)."""
    from iree.compiler import ir

    taken = _symbols(module)
    callee = _unique(JAX_MAIN, taken)
    taken.add(callee)
    globals_ = []
    for n in range(len(parameters)):
        symbol = _unique(f"{GLOBAL_PREFIX}{n}", taken)
        taken.add(symbol)
        globals_.append(symbol)
    function_type = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    text = _wrapper_ops(callee, function_type.inputs, function_type.results, parameters, observations, globals_)
    main.attributes["sym_name"] = ir.StringAttr.get(callee, context=context)
    main.attributes["sym_visibility"] = ir.StringAttr.get("private", context=context)
    # The vmfb's module name is the MLIR module's: without JAX's (`jit_apply`) it is `module`, as for the other
    # frameworks' exports.
    if "sym_name" in module.operation.attributes:
        del module.operation.attributes["sym_name"]
    wrapper = ir.Operation.parse(text, source_name="dsa-stablehlo-wrapper", context=context)
    ops = list(wrapper.regions[0].blocks[0].operations)[1:]  # without the declaration of the callee
    end = ir.InsertionPoint(module.body)
    for op in ops:
        end.insert(op.operation.detach_from_parent())
    try:
        module.operation.verify()
    except Exception as e:
        raise DsaError(where, f"the wrapped module does not verify: {str(e).strip().splitlines()[0][:300]}",
                       "check the module with `iree-compile --iree-input-type=stablehlo --compile-to=input`") from None
    return (module.operation.get_asm(enable_debug_info=False),
            module.operation.get_asm(enable_debug_info=True))


# -- the lowering check --------------------------------------------------------------------------------------

_ILLEGAL = re.compile(r"failed to legalize operation '([^']+)'")
_OP_ERROR = re.compile(r"'([a-z_][a-z0-9_]*\.[a-z0-9_.]+)' op\b")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'call_target_name = "((?:[^"\\]|\\.)*)"')


def _balanced(text: str, start: int) -> str:
    """The text inside the parenthesis that opens at text[start]."""
    depth, quoted, i = 0, False, start
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == "\\":
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return text[start + 1:]


def _error_location(line: str) -> str:
    """JAX's location of the op an error line is about: `error: loc("jit(apply)/eig"): ...` → jit(apply)/eig;
    `loc(callsite("fft" at "jit(f)/jit(fft)"))` → fft (called from jit(f)/jit(fft))."""
    at = line.find("error: loc(")
    if at < 0:
        return ""
    body = _balanced(line, at + len("error: loc"))
    whole = re.fullmatch(r'"((?:[^"\\]|\\.)*)"', body)
    if whole:
        return whole.group(1)
    call = re.fullmatch(r'callsite\(\s*"((?:[^"\\]|\\.)*)"\s+at\s+"((?:[^"\\]|\\.)*)"\s*\)', body)
    if call:
        return f"{call.group(1)} (called from {call.group(2)})"
    return " ".join(_QUOTED.findall(body)) or body


def check_lowerable(mlir_with_locations: str, where: str) -> None:
    """Runs IREE's StableHLO input conversion; on failure names the op, its call target (a custom_call) and
    JAX's location of it (`jit(apply)/eig`)."""
    from dsa.stages.iree_tools import first_error_line, iree_compile_path

    with tempfile.TemporaryDirectory(prefix="dsa-stablehlo-lowering-") as tmp:
        path = Path(tmp) / "model.mlir"
        path.write_text(mlir_with_locations, encoding="utf-8")
        proc = subprocess.run(
            [iree_compile_path(), str(path), "--iree-input-type=stablehlo", "--compile-to=input", "-o", os.devnull],
            capture_output=True, text=True,
        )
    if proc.returncode == 0:
        return
    if proc.returncode < 0 or "Stack dump" in proc.stderr:
        raise DsaError(where, "IREE's StableHLO input conversion crashed on this module",
                       "run `iree-compile --iree-input-type=stablehlo --compile-to=input` on the module to find the "
                       "op; " + OP_CHOICES)
    culprits = []
    for line in proc.stderr.splitlines():
        if "error:" not in line:
            continue
        op = _ILLEGAL.search(line) or _OP_ERROR.search(line)
        if op is None:
            continue
        text = f"'{op.group(1)}'"
        target = _TARGET.search(line)
        if target is not None:
            text += f' (call_target_name "{target.group(1)}")'
        location = _error_location(line)
        if location:
            text += f" at {location}"
        culprits.append(text)
    message = first_error_line(proc.stderr).split(": %", 1)[0].split("error: ", 1)[-1].strip()
    if message.startswith("loc("):
        message = message[len(_balanced(message, 3)) + 5:].lstrip(": ").strip()
    if not culprits:
        raise DsaError(where, f"IREE's StableHLO input conversion failed: {message[:300]}",
                       "run `iree-compile --iree-input-type=stablehlo --compile-to=input` on the module to see why")
    said = "" if message.startswith("failed to legalize operation") else f" (the compiler says: {message[:200]})"
    raise DsaError(where, f"IREE cannot lower StableHLO op {'; '.join(dict.fromkeys(culprits))}{said}", OP_CHOICES)


# -- the stage -----------------------------------------------------------------------------------------------

def export_stablehlo(view: dict, model_file: Path, *, bucket: Optional[dict] = None,
                     manifest_name: str = "manifest") -> Tuple[str, dict]:
    """(MLIR text, export record) of the JAX StableHLO module `model_file` for the export view."""
    from importlib import metadata

    from iree.compiler import ir

    model_file = Path(model_file)
    where = f"{manifest_name}: model.file ({model_file})"
    actual = check_model_file(dict(view, framework="stablehlo"), model_file, "in JAX", manifest_name)
    static_hint = ("StableHLO from JAX is imported at the shapes it was exported with; export once per size "
                   "(jax.export at a fixed batch), one manifest each, and remove buckets")
    if bucket is not None:
        raise DsaError(f"{manifest_name}: buckets.{bucket['dim']}",
                       f"framework stablehlo has no dynamic dims to bucket ('{bucket['dim']}')", static_hint)
    if view.get("bucket_dims"):
        raise DsaError(f"{manifest_name}: buckets",
                       f"framework stablehlo has no dynamic dims to bucket ({', '.join(view['bucket_dims'])})",
                       static_hint)
    context, module = _parse(model_file, where)
    functions = _functions(module)
    mains = [f for f in functions if _string(f.attributes["sym_name"]) == FUNCTION
             and ("sym_visibility" not in f.attributes or _string(f.attributes["sym_visibility"]) == "public")]
    if not mains:
        found = [_string(f.attributes["sym_name"]) for f in functions]
        raise DsaError(where, f"the module has no public function 'main' (its functions: "
                              f"{', '.join(found) or 'none'})",
                       "export with jax.export.export(jax.jit(apply)) and write exported.mlir_module()")
    main = mains[0]
    if not main.regions[0].blocks:
        raise DsaError(where, "main is a declaration without a body", LOCATIONS_HINT)
    arguments = list(main.regions[0].blocks[0].arguments)

    def label(i: int) -> str:
        name = _location_name(arguments[i].location)
        return f"argument %arg{i}" + (f" ('{name}')" if name else "")

    # Shapes first: a shape-polymorphic export's main has no argument locations either, and this says why.
    described = [_tensor(a.type, label(i), where) for i, a in enumerate(arguments)]
    function_type = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    if not function_type.results:
        raise DsaError(where, "main returns nothing", "return the action chunk from the exported function")
    result_shapes = [_tensor(t, f"result {k}", where) for k, t in enumerate(function_type.results)]
    if "arg_attrs" in main.attributes:
        for i, attrs in enumerate(ir.ArrayAttr(main.attributes["arg_attrs"])):
            attrs = ir.DictAttr(attrs)
            if "jax.global_constant" in attrs:
                raise DsaError(where, f"{label(i)} is a JAX global constant ({attrs['jax.global_constant']}): the "
                                      "module was exported for several platforms or with symbolic dims",
                               "export for one platform, jax.export.export(..., platforms=['cpu']), at static "
                               "shapes")

    result_names = []
    if "res_attrs" in main.attributes:
        for attrs in ir.ArrayAttr(main.attributes["res_attrs"]):
            attrs = ir.DictAttr(attrs)
            info = _string(attrs["jax.result_info"]) if "jax.result_info" in attrs else None
            # `result`, `result[0]`, `result['action']` → result, result.0, result.action
            if info:
                root, keys = parse_path(info)
                info = ".".join([root, *keys])
            result_names.append(info)
    result_names += [None] * (len(result_shapes) - len(result_names))
    outputs = [{"name": name or f"output_{k}", "shape": shape, "dtype": dtype}
               for k, ((shape, dtype), name) in enumerate(zip(result_shapes, result_names))]
    check_manifest_agrees(view, outputs[0], where, manifest_name)

    parameters, observations = _split_arguments(arguments, where)
    check_inputs_agree(view, [{"name": name, "shape": described[i][0]} for i, name in observations], where,
                       manifest_name)
    histogram = _op_histogram(functions)
    mlir, mlir_located = _wrap(context, module, main, parameters, observations, where)
    check_lowerable(mlir_located, where)

    inputs = [{"name": name, "shape": described[i][0], "dtype": described[i][1]} for i, name in observations]
    record_parameters = sorted(({"name": name, "shape": described[i][0], "dtype": described[i][1]}
                                for i, name in parameters), key=lambda p: p["name"])
    count = 0
    for p in record_parameters:
        n = 1
        for d in p["shape"]:
            n *= d
        count += n
    record = {
        "model_id": view["model_id"],
        "framework": "stablehlo",
        "function": FUNCTION,
        "parameter_scope": PARAMETER_SCOPE,
        "inputs": inputs,
        "outputs": outputs,
        "parameters": record_parameters,
        "parameter_count": count,
        "op_histogram": histogram,
        "sources": {view["model"]["file"]["path"]: actual},
        "mlir_sha256": sha256_bytes(mlir.encode("utf-8")),
        "toolchain": {"iree-base-compiler": metadata.version("iree-base-compiler")},
        "rewrites": {},
        "dynamic_dims": {},
    }
    return mlir, record
