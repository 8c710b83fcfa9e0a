"""What the FX rewrites (dsa/stages/passes.py) share: a graph with its program's fake mode, where new nodes get
their `meta["val"]` and `meta["tensor_meta"]`, and small readers of nodes."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.fx as fx

aten = torch.ops.aten


# -- plumbing ------------------------------------------------------------------------------------------


class PassGraph:
    """One graph being rewritten: emits nodes whose FakeTensor value is computed in the program's fake mode."""

    def __init__(self, graph_module: fx.GraphModule):
        from torch._guards import detect_fake_mode

        self.graph_module = graph_module
        self.graph = graph_module.graph
        vals = [n.meta.get("val") for n in self.graph.nodes if n.op == "placeholder"]
        self.fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])

    def emit(self, target, args: tuple, like: fx.Node, kwargs: Optional[dict] = None) -> fx.Node:
        """Inserts `target(*args, **kwargs)` at the graph's current insertion point, with `like`'s source
        metadata and its value computed on the arguments' FakeTensors."""
        kwargs = kwargs or {}
        node = self.graph.call_function(target, tuple(args), kwargs)
        fake_args, fake_kwargs = fx.node.map_arg((tuple(args), kwargs), lambda n: n.meta["val"])
        with torch.no_grad():
            if self.fake_mode is not None:
                with self.fake_mode:
                    val = target(*fake_args, **fake_kwargs)
            else:
                val = target(*fake_args, **fake_kwargs)
        node.meta["val"] = val
        if isinstance(val, torch.Tensor):
            from torch.fx.passes.shape_prop import _extract_tensor_metadata

            node.meta["tensor_meta"] = _extract_tensor_metadata(val)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "torch_fn"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
        return node


def node_val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def node_arguments(node: fx.Node) -> Dict[str, object]:
    """The node's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def static_size(size) -> Optional[int]:
    """A dim's size as an int, or None when it is symbolic."""
    return size if isinstance(size, int) else None


def same_dims(a, b) -> bool:
    return len(a) == len(b) and all(str(x) == str(y) for x, y in zip(a, b))


def only_user(node: fx.Node) -> Optional[fx.Node]:
    """The node's one user, ignoring `_assert_tensor_metadata` checks on it; None when it has several."""
    users = [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]
    return users[0] if len(users) == 1 else None


def drop_asserts(nodes: Sequence[fx.Node], graph: fx.Graph) -> None:
    """Erases the `_assert_tensor_metadata` checks on nodes a rewrite removes (they would keep them alive)."""
    for n in nodes:
        for u in list(n.users):
            if u.target is aten._assert_tensor_metadata.default:
                graph.erase_node(u)
