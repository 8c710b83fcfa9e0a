"""Source locations: FX nodes tagged with their module path and aten op, and each compiled dispatch mapped back to
the ops and modules fused into it."""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError


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
