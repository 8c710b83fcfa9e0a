"""Corrections to IREE's FX importer that the rule set needs, applied before any import.

while_loop with additional inputs
---------------------------------
In torch >= 2.5 the `while_loop` higher-order op's arguments are `(cond_fn, body_fn, carried_inputs,
additional_inputs)`: loop-invariant tensors the body reads (closed-over tensors, module parameters) travel
in `additional_inputs` and are passed to cond/body *after* the carries, but are not returned by the body.
IREE's importer (iree-base-compiler 3.13) flattens both tuples into loop carries, so the `torch.prim.Loop`
it builds has more iter-args than the body returns and fails verification ("region branch point has N
operands, but region successor needs 2 inputs"). The handler below keeps only `carried_inputs` as loop
state and passes `additional_inputs` as extra operands of every cond/body call; they are defined outside
the loop and are visible inside its region.

The MLIR bindings' `isinstance` API for iree-turbine's custom ops
-----------------------------------------------------------------
iree-turbine 3.9 expands its custom ops (dsa.stages.quant's fused dequantise-matmuls) with calls such as
`IntegerType.isinstance(t)`; the MLIR Python bindings of iree-base-compiler 3.13 dropped those static methods
(Python's own `isinstance` works on their auto-downcast objects), so every custom-op expansion failed with
"type object 'IntegerType' has no attribute 'isinstance'". `_restore_isinstance` puts back, on exactly the
classes turbine calls it on, a static method with the old meaning: the object is of the class, or casts to it.
"""

from __future__ import annotations

import torch
from iree.compiler.extras import fx_importer as _fx
from iree.compiler.ir import Block, FlatSymbolRefAttr, InsertionPoint, Operation

_APPLIED = False


def _import_hop_while_loop(self, loc, node, hop):
    cond_fn_node, body_fn_node, carried, *rest = node.args
    additional = rest[0] if rest else ()
    root = node.graph.owning_module
    names = self.fx_importer._graph_module_to_func_name
    cond_name = names[id(getattr(root, cond_fn_node.target))]
    body_name = names[id(getattr(root, body_fn_node.target))]

    carry_values = [self._import_argument(loc, c) for c in carried]
    invariant_values = [self._import_argument(loc, a) for a in additional]

    node_val = node.meta.get("val")
    if isinstance(node_val, (list, tuple)):
        result_types = [self._cc.value_info_to_type(v) for v in node_val]
    else:
        result_types = [self._cc.node_val_to_type(node)]
    cond_type = self._cc.get_vtensor_type(torch.Size([]), torch.bool)

    def call(callee, operands, results):
        return Operation.create(
            "func.call",
            attributes={"callee": FlatSymbolRefAttr.get(callee)},
            results=results,
            operands=operands,
            loc=loc,
        )

    def to_bool(value):
        return Operation.create(
            "torch.aten.Bool.Tensor", results=[self._cc.torch_bool_type], operands=[value], loc=loc
        ).result

    first_cond = to_bool(call(cond_name, carry_values + invariant_values, [cond_type]).result)
    with loc:
        max_iter = _fx._make_constant_op(
            "torch.constant.int",
            self._cc.integer_attr(torch.iinfo(torch.int64).max, 64),
            self._cc.torch_int_type,
        )
    loop = Operation.create(
        "torch.prim.Loop",
        results=result_types,
        operands=[max_iter.results[0], first_cond] + carry_values,
        regions=1,
        loc=loc,
    )
    with loc:
        block = Block.create_at_start(loop.regions[0], [self._cc.torch_int_type] + result_types)
    with InsertionPoint(block):
        body = call(body_name, list(block.arguments[1:]) + invariant_values, result_types)
        next_values = list(body.results)
        again = to_bool(call(cond_name, next_values + invariant_values, [cond_type]).result)
        Operation.create(
            "torch.prim.Loop.condition", results=[], operands=[again] + next_values, loc=loc
        )

    if len(result_types) > 1:
        self._multi_result_nodes.add(node)
        for i, value in enumerate(loop.results):
            self.bind_node_value(node, value, i)
    else:
        self.bind_node_value(node, loop.results[0])


# The classes iree-turbine 3.9 calls `.isinstance` on (grep of its sources).
_TURBINE_ISINSTANCE_CLASSES = ("BlockArgument", "IndexType", "IntegerType", "MemRefType", "OpResult",
                               "RankedTensorType", "ShapedType", "Type", "VectorType")


def _restore_isinstance() -> None:
    from iree.compiler import ir

    for name in _TURBINE_ISINSTANCE_CLASSES:
        cls = getattr(ir, name)
        if hasattr(cls, "isinstance"):
            continue

        def check(obj, _cls=cls) -> bool:
            if isinstance(obj, _cls):
                return True
            try:
                _cls(obj)  # the bindings' casting constructor: raises for an object of another kind
            except (TypeError, ValueError):
                return False
            return True

        cls.isinstance = staticmethod(check)


def apply() -> None:
    """Installs the corrections (idempotent)."""
    global _APPLIED
    if not _APPLIED:
        _fx.GraphNodeImporter._import_hop_while_loop = _import_hop_while_loop
        _restore_isinstance()
        _APPLIED = True
