"""The rule set's own torch ops (the `dsa` library), each expanded by iree-turbine into IREE's IR at import.

One library per process: `library()` defines `torch.ops.dsa` once, and every op of the rule set registers
into it — the quantised matmuls (dsa.stages.quant) and `optimization_barrier` below, which the graph
rewrites (dsa.stages.passes) insert. Registering is lazy: importing this module needs no iree-turbine.
"""

from __future__ import annotations

from typing import Dict

_STATE: Dict[str, object] = {}


def library():
    """The `dsa` torch library (torch.ops.dsa), defined once per process."""
    if "library" not in _STATE:
        from iree.turbine.runtime.op_reg import def_library

        from dsa.stages import importer_fixes

        importer_fixes.apply()  # iree-turbine's custom-op expansion needs the MLIR bindings' old isinstance API
        _STATE["library"] = def_library("dsa")
    return _STATE["library"]


def optimization_barrier():
    """`torch.ops.dsa.optimization_barrier(x) -> x`: the value unchanged, imported as IREE's
    `util.optimization_barrier`, which no fusion, folding or layout propagation crosses. Eager: a copy.

    The graph rewrites place it where IREE 3.13 would otherwise fold a data movement into a contraction and
    make the contraction slow (see dsa.stages.passes.split_heads_after_projection)."""
    if "optimization_barrier" not in _STATE:
        from iree.compiler.ir import Operation
        from iree.turbine.runtime.op_reg import CustomOp

        class optimization_barrier(CustomOp):  # noqa: N801 (the op's name)
            signature = "optimization_barrier(Tensor x) -> Tensor"

            def select(self, ksel):
                x = ksel.arg_tensor(0)
                static = [i for i, s in enumerate(x.t.shape) if isinstance(s, int)]
                x.specialize_dims(*static)
                ksel.return_tensor(x.t).specialize_dims(*static)

            def eager_execute(self, x):
                return x.clone()

            def generate(self, ksel, kb):
                x = kb.arg_bindings[0]
                barrier = Operation.create("util.optimization_barrier", results=[x.type], operands=[x])
                kb.yield_results(barrier.result)

        _STATE["optimization_barrier"] = CustomOp.register(library=library())(optimization_barrier)
    return _STATE["optimization_barrier"]
