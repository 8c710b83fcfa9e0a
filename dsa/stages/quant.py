"""Weight-only quantisation (manifest `quant_scheme`): int8 per-channel or group-wise, int4 group-wise.

Two halves that must agree, kept in this one module:

* export (`quantize_module`): every `nn.Linear` becomes a `QuantLinear` whose weight is an integer buffer
  plus float scales; its forward is one op, `dsa::int4_matmul` / `dsa::int8_matmul` (an iree-turbine custom op,
  `_kernel_ops`), that the import expands into two linalg ops over the weight as stored, grouped
  [out, groups, ...]: a bit-extend (i4 or i8 → f32, minus the int4 offset, times the group's scale) and a
  contraction over (groups, group) with the activation expanded to [rows, groups, group]. Nothing reshapes
  the weight on its way, so IREE 3.13 (with aggressive fusion: dsa.stages.compile.QUANT_FLAGS) puts the
  bit-extend inside a one-row contraction's dispatch (the matvec of every autoregressive decode step at batch
  1, memory-bound: it then reads an eighth of fp32's bytes); a many-row contraction (a prefill) keeps it a
  dispatch of its own, as IREE blocks matmul-producer fusion on CPU (measured: fused, its codegen ran such
  matmuls several times slower);
* parameters (`quantize_weight`): DsaParams turns the checkpoint's float weight into exactly those
  buffers (symmetric, round-half-to-even, deterministic).

Layouts, for a weight W of shape [out, in] and group size g (per-channel: g = in), grouped in the archive so
that the compiled module reads them without a reshape:
  int8: `<name>` int8 [out, in/g, g] = round(W / s), `<name>_scale` float32 [out, in/g], s = max|W_group| / 127
  int4: `<name>` uint8 [out, in/g, g/2], two 4-bit values per byte (low nibble first: IREE's own i4 layout),
        each q + 8 with q = round(W / s) in [-8, 7], `<name>_scale` float32 [out, in/g], s = max|W_group| / 7
Checkpoints stay float: the same checkpoint builds every scheme.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np

SCALE_SUFFIX = "_scale"
QMAX = {"int8": 127, "int4": 7}


def group_size_for(scheme: dict, in_features: int) -> int:
    g = scheme.get("group_size") or in_features
    return g if in_features % g == 0 else 0


# Weights quantised at a time by quantize_weight: its float32 temporaries (a copy, |w|, w / s, the rounded and
# clipped values: ~6 of them) are bounded by this many values, 16 MiB each, whatever the tensor's size.
_CHUNK_VALUES = 1 << 22


def quantize_weight(weight: np.ndarray, scheme: dict, chunk_values: int = _CHUNK_VALUES) -> Dict[str, np.ndarray]:
    """Float [out, in] weight (any float dtype: converted to float32 here) → {"": packed integer weight,
    "_scale": scales} (keys are name suffixes), in the layouts above.

    Quantised a block of whole rows at a time (about `chunk_values` weights; every value depends only on its
    own row's groups), written into the preallocated outputs: memory is the outputs plus a few chunk-sized
    temporaries, not ~6 float32 copies of the tensor (OpenVLA-7B's 32064 x 4096 lm_head: 0.5 GB each)."""
    kind = scheme["kind"]
    out_f, in_f = weight.shape
    g = group_size_for(scheme, in_f)
    (_, packed_shape), (_, scale_shape) = quantized_shapes(out_f, in_f, dict(scheme, group_size=g))
    packed = np.empty(packed_shape, dtype=np.int8 if kind == "int8" else np.uint8)
    scale = np.empty(scale_shape, dtype=np.float32)
    rows = max(1, chunk_values // max(in_f, 1))
    for start in range(0, out_f, rows):
        stop = min(out_f, start + rows)
        packed[start:stop], scale[start:stop] = _quantize_rows(weight[start:stop], kind, g)
    return {"": packed, SCALE_SUFFIX: scale}


def _quantize_rows(weight: np.ndarray, kind: str, g: int):
    """(packed, scale) of a block of rows: the whole computation, row-independent."""
    out_f, in_f = weight.shape
    groups = weight.astype(np.float32).reshape(out_f, in_f // g, g)
    scale = np.abs(groups).max(axis=2) / QMAX[kind]
    scale = np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)
    q = np.clip(np.rint(groups / scale[:, :, None]), -QMAX[kind] - (kind == "int4"), QMAX[kind])
    if kind == "int8":
        packed = q.astype(np.int8)
    else:
        nibbles = (q + 8).astype(np.uint8).reshape(out_f, in_f // g, g // 2, 2)
        packed = (nibbles[..., 0] | (nibbles[..., 1] << 4)).astype(np.uint8)
    return packed, scale


def quantized_shapes(out_f: int, in_f: int, scheme: dict):
    """(dtype, shape) of the packed weight and of its scales."""
    g = group_size_for(scheme, in_f)
    packed = ("int8", [out_f, in_f // g, g]) if scheme["kind"] == "int8" else ("uint8", [out_f, in_f // g, g // 2])
    return packed, ("float32", [out_f, in_f // g])


# -- the fused dequantise-matmul ops (export side) ---------------------------------------------------------
# Written as MLIR (linalg) rather than traced from torch: torch.export decomposes any grouped matmul into a
# matmul over a reshaped [out, in] weight, and IREE cannot fuse a bit-extend across that reshape (the
# dequantisation becomes a dispatch of its own that writes the whole float weight every call: int4 OpenVLA ran
# 1.6x slower than fp32). `%x` is the activation [rows, in] (rows dynamic), `{w_type}` the packed weight as
# stored in the parameter archive, `{unpack}` turns it into `{q_type}` = [out, groups, group] integers.
_KERNEL = """
module {{
util.func private @{name}(%x: tensor<?x{in_f}xf32>, %w: {w_type}, %s: tensor<{out_f}x{groups}xf32>)
    -> tensor<?x{out_f}xf32> {{
  %c0 = arith.constant 0 : index
  %rows = tensor.dim %x, %c0 : tensor<?x{in_f}xf32>
  %xg = tensor.expand_shape %x [[0], [1, 2]] output_shape [%rows, {groups}, {group}]
      : tensor<?x{in_f}xf32> into tensor<?x{groups}x{group}xf32>
  {unpack}
  %deq_init = tensor.empty() : tensor<{out_f}x{groups}x{group}xf32>
  %deq = linalg.generic {{
      indexing_maps = [affine_map<(o, g, k) -> (o, g, k)>, affine_map<(o, g, k) -> (o, g)>,
                       affine_map<(o, g, k) -> (o, g, k)>],
      iterator_types = ["parallel", "parallel", "parallel"]}}
      ins({q_value}, %s : {q_type}, tensor<{out_f}x{groups}xf32>) outs(%deq_init : tensor<{out_f}x{groups}x{group}xf32>) {{
    ^bb0(%qv: {q_elem}, %sv: f32, %unused: f32):
      {to_float}
      %w_f = arith.mulf %centred, %sv : f32
      linalg.yield %w_f : f32
  }} -> tensor<{out_f}x{groups}x{group}xf32>
  %zero = arith.constant 0.0 : f32
  %y_init = tensor.empty(%rows) : tensor<?x{out_f}xf32>
  %y_zero = linalg.fill ins(%zero : f32) outs(%y_init : tensor<?x{out_f}xf32>) -> tensor<?x{out_f}xf32>
  %y = linalg.generic {{
      indexing_maps = [affine_map<(m, o, g, k) -> (m, g, k)>, affine_map<(m, o, g, k) -> (o, g, k)>,
                       affine_map<(m, o, g, k) -> (m, o)>],
      iterator_types = ["parallel", "parallel", "reduction", "reduction"]}}
      ins(%xg, %deq : tensor<?x{groups}x{group}xf32>, tensor<{out_f}x{groups}x{group}xf32>)
      outs(%y_zero : tensor<?x{out_f}xf32>) {{
    ^bb0(%xv: f32, %wv: f32, %acc: f32):
      %p = arith.mulf %xv, %wv : f32
      %r = arith.addf %acc, %p : f32
      linalg.yield %r : f32
  }} -> tensor<?x{out_f}xf32>
  util.return %y : tensor<?x{out_f}xf32>
}}
}}
"""

# int4: two values per byte, low nibble first — IREE's own layout of i4 in memory, so the stored bytes are
# reinterpreted (flow.tensor.bitcast), not unpacked by arithmetic; each value is q + 8, unsigned.
_INT4_UNPACK = "%q = flow.tensor.bitcast %w : {w_type} -> {q_type}"
_INT4_TO_FLOAT = ("%eight = arith.constant 8.0 : f32\n"
                  "      %u = arith.uitofp %qv : i4 to f32\n"
                  "      %centred = arith.subf %u, %eight : f32")
_INT8_UNPACK = ""  # int8 weights are read as stored
_INT8_TO_FLOAT = "%centred = arith.sitofp %qv : i8 to f32"


def kernel_mlir(kind: str, out_f: int, in_f: int, group: int) -> str:
    """The MLIR module of one fused dequantise-matmul (one function, named after kind and shape)."""
    groups = in_f // group
    fields = dict(out_f=out_f, in_f=in_f, group=group, groups=groups)
    if kind == "int4":
        fields.update(q_elem="i4", w_type=f"tensor<{out_f}x{groups}x{group // 2}xi8>", unpack=_INT4_UNPACK,
                      to_float=_INT4_TO_FLOAT, q_value="%q")
    else:
        fields.update(q_elem="i8", w_type=f"tensor<{out_f}x{groups}x{group}xi8>", unpack=_INT8_UNPACK,
                      to_float=_INT8_TO_FLOAT, q_value="%w")
    fields["q_type"] = f"tensor<{out_f}x{groups}x{group}x{fields['q_elem']}>"
    fields["unpack"] = fields["unpack"].format(**fields)
    fields["name"] = f"dsa_{kind}_matmul_{out_f}x{in_f}_g{group}"
    return _KERNEL.format(**fields)


def reference_matmul(kind: str, x, weight, scale):
    """What the kernel computes, in plain torch: x [rows, in] @ dequantised(weight)ᵀ → [rows, out]. The ops'
    eager implementation (the compiled module is checked against the float model, not against this)."""
    import torch

    out_f, groups = scale.shape
    if kind == "int4":
        byte = weight.to(torch.int32) & 255
        q = torch.stack([byte & 15, byte >> 4], dim=-1).reshape(out_f, groups, -1).to(torch.float32) - 8.0
    else:
        q = weight.to(torch.float32)
    w = (q * scale.unsqueeze(-1)).reshape(out_f, -1)
    return x @ w.t()


_KERNEL_OPS: Dict[str, object] = {}


def _kernel_ops() -> Dict[str, object]:
    """{"int4": op, "int8": op}: the custom ops (x, weight, scale) → x @ dequantised(weight)ᵀ, registered once
    per process in the `dsa` torch library."""
    if _KERNEL_OPS:
        return _KERNEL_OPS
    import torch
    from iree.turbine.runtime.op_reg import CustomOp, impl_helper
    from iree.turbine.runtime.op_reg.impl_helper import TemplateLoader

    from dsa.stages.custom_ops import library

    class _Text(TemplateLoader):  # the "template" is the MLIR text itself
        def load_template(self, kb, name, **kwargs):
            return self._parse_module_asm(kb, name)

    loader = _Text()

    def make(kind: str):
        class _Op(CustomOp):
            signature = f"{kind}_matmul(Tensor x, Tensor weight, Tensor scale) -> (Tensor)"

            def select(self, ksel):
                x, w, s = ksel.arg_tensor(0), ksel.arg_tensor(1), ksel.arg_tensor(2)
                x.specialize_dims(1)
                w.specialize_all_dims()
                s.specialize_all_dims()
                ksel.return_new_tensor([x.t.shape[0], w.t.shape[0]], torch.float32).specialize_dims(1)

            def eager_execute(self, x, weight, scale):
                return reference_matmul(kind, x, weight, scale)

            def generate(self, ksel, kb):
                x, w, s = (d.t for d in ksel.arg_descs)
                in_f = int(x.shape[1])
                group = in_f // int(s.shape[1])  # the weight is [out, groups, group (int8) or group/2 (int4)]
                text = kernel_mlir(kind, int(w.shape[0]), in_f, group)
                name = f"dsa_{kind}_matmul_{int(w.shape[0])}x{in_f}_g{group}"
                function = loader.inline_template_function(kb, text, name)
                kb.yield_results(*impl_helper.call_function(function, *kb.arg_bindings))

        _Op.__name__ = f"{kind}_matmul"
        return CustomOp.register(library=library())(_Op)

    _KERNEL_OPS.update({kind: make(kind) for kind in ("int4", "int8")})
    return _KERNEL_OPS


def _quant_linear_class():
    import torch
    from torch import nn

    ops = _kernel_ops()

    class QuantLinear(nn.Module):
        """nn.Linear with a packed integer weight: one fused dequantise-matmul op (see `_KERNEL`)."""

        def __init__(self, linear: nn.Linear, scheme: dict):
            super().__init__()
            out_f, in_f = linear.weight.shape
            self.kind = scheme["kind"]
            self.group = group_size_for(scheme, in_f)
            (wdtype, wshape), (_, sshape) = quantized_shapes(out_f, in_f, scheme)
            # On the float weight's device: meta when the export builds the model without weights
            # (dsa.stages.weightless: a 7B model's packed weights are never allocated there).
            device = linear.weight.device
            self.register_buffer("weight", torch.zeros(wshape, dtype=getattr(torch, wdtype), device=device))
            self.register_buffer("weight" + SCALE_SUFFIX, torch.ones(sshape, dtype=torch.float32, device=device))
            self.bias = linear.bias
            self.in_features, self.out_features = in_f, out_f

        def forward(self, x):
            rows = x.reshape(-1, self.in_features)
            y = ops[self.kind](rows, self.weight, getattr(self, "weight" + SCALE_SUFFIX))
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias

    return QuantLinear


def quantize_module(module, scheme: dict) -> Dict[str, dict]:
    """Replaces every quantisable nn.Linear of `module` in place. Returns {weight name: {"shape": float
    shape, "kind", "group_size"}} for the export record; an empty dict for kind none."""
    from torch import nn

    if scheme["kind"] == "none":
        return {}
    QuantLinear = _quant_linear_class()
    quantized = {}
    for name, child in list(module.named_modules()):
        for attr, sub in list(child.named_children()):
            if not isinstance(sub, nn.Linear):
                continue
            out_f, in_f = sub.weight.shape
            if group_size_for(scheme, in_f) == 0 or (scheme["kind"] == "int4" and in_f % 2):
                continue  # a layer whose width the group does not divide stays float
            setattr(child, attr, QuantLinear(sub, scheme))
            full = f"{name}.{attr}" if name else attr
            quantized[f"{full}.weight"] = {
                "shape": [out_f, in_f],
                "kind": scheme["kind"],
                "group_size": group_size_for(scheme, in_f),
            }
    return dict(sorted(quantized.items()))


def dequantize(packed: np.ndarray, scale: np.ndarray, info: dict) -> np.ndarray:
    """The float [out, in] weight a packed one stands for (for accuracy checks)."""
    out_f, in_f = info["shape"]
    if info["kind"] == "int8":
        q = packed.astype(np.float32)
    else:
        q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(scale.shape + (-1,)).astype(np.float32) - 8
    return (q.reshape(scale.shape + (-1,)) * scale[:, :, None]).reshape(out_f, in_f)


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def source_of(name: str, quantized: Dict[str, dict]) -> Optional[str]:
    """The quantised weight a scale tensor belongs to, or None."""
    if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in quantized:
        return name[: -len(SCALE_SUFFIX)]
    return None
