"""The manifest's `precision` (schema 1.7) in the exported graph: how float weights are stored, and in which
precision the policy computes.

* `weights: bf16 | f16` with `compute: f32` (the default compute): every float32 parameter and persistent
  buffer of the model is stored in the half-precision type — the export record says so, and the parameter
  stage (dsa.stages.params) rounds the checkpoint's tensors to it — and is widened back to float32 where
  the model reads it: `module.weight` reads `weight.to(float32)`, so every op computes as before and any
  target runs the module. Half the bytes on disk and in memory; the compiler decides whether the widening
  is fused into its consumer (a matrix-vector product) or is a dispatch of its own (a many-row matmul, on
  IREE 3.13's CPU backend: docs/performance.md).
* `compute: bf16 | f16` (= the weights' precision): the whole model computes in that type — its float
  weights and buffers are converted, the float inputs are cast to it on entry and the float outputs back to
  float32 on exit, so the module's interface is unchanged. Only targets whose spec lists the precision
  under `precisions` (hardware with that arithmetic) may compile it (dsa.manifest.contract.
  check_precision_for_target); elsewhere it would be emulated, and slower than f32.

Integer weights of a `quant_scheme` and their float32 scales are never converted.
"""

from __future__ import annotations

import types
from typing import Dict, Iterable, Optional

# Manifest precision name → torch dtype name (dsa.stages.spec.DTYPES).
DTYPE_OF = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def precision_of_view(view: dict) -> Dict[str, str]:
    """The export (or params) view's precision with its defaults: {"weights", "compute"}."""
    precision = view.get("precision") or {"weights": "f32"}
    return {"weights": precision["weights"], "compute": precision.get("compute", "f32")}


def _widening_class(cls):
    """`cls` with attribute reads of the names in `self._dsa_widened` widened to float32 (same class name, so
    module paths in messages read as before)."""
    import torch

    def __getattr__(self, name):
        value = cls.__getattr__(self, name)
        if name in self.__dict__.get("_dsa_widened", ()):
            return value.to(torch.float32)
        return value

    return type(cls.__name__, (cls,), {"__getattr__": __getattr__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _stored(module, keep: Iterable[str]):
    """(submodule, attribute name, qualified name, tensor) of every float32 parameter and persistent buffer,
    except the qualified names in `keep`."""
    import torch

    keep = set(keep)
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(sub, kind).items():
                if tensor is None or (kind == "_buffers" and name in sub._non_persistent_buffers_set):
                    continue
                qualified = f"{prefix}.{name}" if prefix else name
                if tensor.dtype != torch.float32 or qualified in keep:
                    continue
                yield sub, kind, name, tensor


def apply_precision(module, view: dict, keep: Iterable[str] = ()) -> Optional[Dict[str, str]]:
    """Applies the view's precision to `module` (built without its weights: every weight is a fake or meta
    tensor, so the conversions cost nothing) in place. `keep`: qualified names never converted (a
    quant_scheme's packed weights and scales). Returns the record's `precision` entry, or None for f32."""
    import torch
    from torch import nn

    precision = precision_of_view(view)
    if precision["weights"] == "f32":
        return None
    dtype = getattr(torch, DTYPE_OF[precision["weights"]])
    converted: Dict[int, object] = {}  # id(original) → converted: a tied tensor stays one tensor

    def convert(tensor, kind):
        if id(tensor) not in converted:
            new = tensor.detach().to(dtype)
            converted[id(tensor)] = nn.Parameter(new, requires_grad=False) if kind == "_parameters" else new
        return converted[id(tensor)]

    if precision["compute"] == "f32":
        widened = {}
        for sub, kind, name, tensor in list(_stored(module, keep)):
            getattr(sub, kind)[name] = convert(tensor, kind)
            widened.setdefault(id(sub), (sub, set()))[1].add(name)
        for sub, names in widened.values():
            if "_dsa_widened" not in sub.__dict__:
                sub.__class__ = _widening_class(type(sub))
                sub.__dict__["_dsa_widened"] = set()
            sub.__dict__["_dsa_widened"] |= names
    else:
        for sub, kind, name, tensor in list(_stored(module, keep)):
            getattr(sub, kind)[name] = convert(tensor, kind)
        for sub in module.modules():  # non-persistent float buffers (RoPE tables, ...) compute in it too
            for name in list(sub._non_persistent_buffers_set):
                buffer = sub._buffers.get(name)
                if buffer is not None and buffer.dtype == torch.float32:
                    sub._buffers[name] = buffer.to(dtype)
        _compute_in(module, dtype)
    return dict(precision)


def _contractions():
    import torch
    import torch.nn.functional as F

    return {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm,
            torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.baddbmm, torch.einsum, F.linear,
            F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
            F.scaled_dot_product_attention}


def _contraction_mode_class():
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils import _pytree as pytree

    class ContractionsIn(TorchFunctionMode):
        """While tracing: every contraction (matmul, linear, convolution, attention) takes its float operands
        in `dtype` — what autocast does — so that a float32 activation (a mask, a sinusoidal embedding, a
        softmax kept in float32) meets a half-precision weight in the precision the weight is stored in."""

        def __init__(self, dtype):
            super().__init__()
            self.dtype = dtype
            self.ops = _contractions()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in self.ops:
                args, kwargs = pytree.tree_map_only(
                    torch.Tensor, lambda v: v.to(self.dtype) if v.is_floating_point() else v, (args, kwargs))
            return func(*args, **kwargs)

    return ContractionsIn


def _compute_in(module, dtype) -> None:
    """On this instance: float inputs cast to `dtype` on entry, float outputs back to float32 on exit, every
    contraction in `dtype` (ContractionsIn)."""
    import torch
    from torch.utils import _pytree as pytree

    forward = module.forward
    mode = _contraction_mode_class()

    def cast(value, to):
        return value.to(to) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def computed_in(self, *args, **kwargs):
        args, kwargs = pytree.tree_map(lambda v: cast(v, dtype), (args, kwargs))
        with mode(dtype):
            out = forward(*args, **kwargs)
        return pytree.tree_map(lambda v: cast(v, torch.float32), out)

    module.forward = types.MethodType(computed_in, module)
