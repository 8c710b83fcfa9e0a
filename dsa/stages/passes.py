"""Named FX rewrites that shape an exported program for IREE, applied between `torch.export` and `aot.export`.

Each pass finds one pattern in the `ExportedProgram`'s graph (and in the graphs of its higher-order-op
subgraphs, e.g. a `while_loop` body) and replaces it by an equivalent computation that IREE compiles better
or at all. A rewrite only adds call_function nodes computing from nodes already in the graph: the program's
inputs, parameters and buffers stay as they are, so its signature, its parameter names and the parameter
archive built from the module are unchanged. Every new node carries `meta["val"]` (a FakeTensor computed in
the program's own fake mode, symbolic dims included) and `meta["tensor_meta"]`, which IREE's FX importer
reads for the MLIR types.

    program, counts = apply_passes(exported, DEFAULT_PASSES)   # counts: {pass name: rewrites made}

Passes run in registry order (`PASSES`), whatever order the names are given in. The input program is left
as it was; the returned one shares its state dict (no tensor is copied).

There is no constant-folding pass: IREE's const-eval already folds subgraphs that read no input (checked:
a sinusoid position table and a triu mask of a static length become a hoisted constant / an iota inside
the softmax dispatch, no sin/cos left in `main`); with a dynamic length they depend on an input's size, so
no graph-level pass could fold them either.

The rewrites live by kind in rewrites_conv.py and rewrites_attention.py, on the plumbing of fx_graph.py;
this module holds the registry and applies it."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Callable, Dict, Sequence, Tuple

import torch
import torch.fx as fx

from dsa.core.errors import DsaError
from dsa.stages.fx_graph import PassGraph, node_val
from dsa.stages.rewrites_attention import (
    attention_to_sdpa, blocked_softmax, decompose_attention, fence_head_split_projections)
from dsa.stages.rewrites_conv import (
    conv1d_to_matmul, conv_transpose1d_to_matmul, fold_batchnorm, patchify_conv_to_matmul, split_conv_bias,
    stem_conv_to_matmul)

aten = torch.ops.aten


# -- 1. bool_and_to_logical_and ------------------------------------------------------------------------

_BOOL_BINARY = {
    aten.__and__.Tensor: aten.logical_and.default,
    aten.bitwise_and.Tensor: aten.logical_and.default,
    aten.__xor__.Tensor: aten.logical_xor.default,
    aten.bitwise_xor.Tensor: aten.logical_xor.default,
}


def bool_and_to_logical_and(g: PassGraph) -> int:
    """`a & b` on two bool tensors (`aten.__and__.Tensor`, `aten.bitwise_and.Tensor`) → `aten.logical_and`;
    likewise `a ^ b` → `aten.logical_xor`.

    Why: IREE 3.13's torch-to-linalg has no lowering for `torch.aten.__and__.Tensor` (nor `__xor__.Tensor`)
    and fails with "failed to legalize operation 'torch.aten.__and__.Tensor'". LeRobot VLAs (pi0, SmolVLA)
    build their 2-D attention masks as `pad_2d & att_2d`. On bool operands logical_and is the same
    function, and it lowers to one elementwise op. Integer operands are left alone."""
    count = 0
    for node in list(g.graph.nodes):
        new_target = _BOOL_BINARY.get(node.target) if node.op == "call_function" else None
        if new_target is None or len(node.args) != 2:
            continue
        a, b = node.args
        if not all(isinstance(x, fx.Node) and getattr(node_val(x), "dtype", None) == torch.bool for x in (a, b)):
            continue
        with g.graph.inserting_before(node):
            new = g.emit(new_target, (a, b), like=node)
        node.replace_all_uses_with(new)
        g.graph.erase_node(node)
        count += 1
    return count


# -- registry ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pass:
    """A named rewrite: `function(graph)` rewrites one graph in place and returns how many rewrites it made."""

    name: str
    function: Callable[[PassGraph], int]

    @property
    def doc(self) -> str:
        return self.function.__doc__ or ""

    def __call__(self, graph: PassGraph) -> int:
        return self.function(graph)


PASSES: Dict[str, Pass] = {
    p.__name__: Pass(p.__name__, p)
    for p in (bool_and_to_logical_and, fold_batchnorm, patchify_conv_to_matmul, stem_conv_to_matmul,
              split_conv_bias, conv1d_to_matmul, conv_transpose1d_to_matmul, attention_to_sdpa, decompose_attention,
              fence_head_split_projections, blocked_softmax)
}

# The defaults are chosen for the llvm-cpu targets this release ships (toolchains/targets): there IREE
# 3.13's fused attention dispatch measured ~10x slower than matmul + softmax, so attention is decomposed
# (decompose_attention) and attention_to_sdpa, its inverse, is opt-in (for a backend whose fused attention
# is fast). The others measured faster or equal. blocked_softmax is opt-in: a held-out SmolVLA (vision at 224 px)
# compiled with it ran 0.11 away from eager (docs/performance.md). Numbers: docs/performance.md, bench/RESULTS.md.
DEFAULT_PASSES: Tuple[str, ...] = (
    "bool_and_to_logical_and", "fold_batchnorm", "patchify_conv_to_matmul", "stem_conv_to_matmul",
    "split_conv_bias", "conv1d_to_matmul", "conv_transpose1d_to_matmul", "decompose_attention",
    "fence_head_split_projections",
)


def apply_passes(exported: "torch.export.ExportedProgram", names: Sequence[str]):
    """Applies the named passes, in registry order, to the program's graph and to every subgraph (e.g. a
    while_loop body). Returns `(program, {name: rewrites made})`; the input program is not modified."""
    from torch.export.graph_signature import TensorArgument

    for name in names:
        if name not in PASSES:
            raise DsaError("model.rewrites", f"unknown rewrite '{name}'", f"known: {', '.join(PASSES)}")
    chosen = [p for name, p in PASSES.items() if name in set(names)]
    counts = {p.name: 0 for p in chosen}
    if not chosen:
        return exported, counts

    with warnings.catch_warnings():  # torch's pytree warns about its own LeafSpec when copied
        warnings.simplefilter("ignore", FutureWarning)
        graph_module = copy.deepcopy(exported.graph_module)
    graphs = [m for m in graph_module.modules() if isinstance(m, fx.GraphModule)]
    for p in chosen:
        for gm in graphs:
            made = p(PassGraph(gm))
            if made:
                gm.graph.eliminate_dead_code()
                gm.graph.lint()
                gm.recompile()
            counts[p.name] += made
    if not any(counts.values()):
        return exported, counts

    # A rewritten output node has a new name, and a recompiled graph renames a placeholder that shadows a
    # Python builtin (`input` → `input_1`): the signature names inputs and outputs by node.
    signature = exported.graph_signature
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    input_specs = []
    for spec, node in zip(signature.input_specs, placeholders):
        if isinstance(spec.arg, TensorArgument) and spec.arg.name != node.name:
            spec = dataclasses.replace(spec, arg=TensorArgument(name=node.name))
        input_specs.append(spec)
    outputs = next(n for n in graph_module.graph.nodes if n.op == "output").args[0]
    output_specs = []
    for spec, out in zip(signature.output_specs, outputs):
        if isinstance(spec.arg, TensorArgument) and isinstance(out, fx.Node) and out.name != spec.arg.name:
            spec = dataclasses.replace(spec, arg=TensorArgument(name=out.name))
        output_specs.append(spec)
    signature = dataclasses.replace(signature, input_specs=input_specs, output_specs=output_specs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return exported._update(graph_module, signature), counts
