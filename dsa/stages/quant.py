"""Weight-only quantisation (manifest `quant_scheme`): int8 per-channel or group-wise, int4 group-wise.

Two halves that must agree, kept in this one module:

* export (`quantize_module`): every `nn.Linear` becomes a `QuantLinear` whose weight is an integer buffer
  plus float scales, dequantised in the graph right before the matmul, so the compiled module reads packed
  weights from the parameter archive and IREE can fuse the dequantisation into the matmul;
* parameters (`quantize_weight`): DsaParams turns the checkpoint's float weight into exactly those
  buffers (symmetric, round-half-to-even, deterministic).

Layouts, for a weight W of shape [out, in] and group size g (per-channel: g = in):
  int8: `<name>` int8 [out, in] = round(W / s), `<name>_scale` float32 [out, in/g], s = max|W_group| / 127
  int4: `<name>` uint8 [out, in/2], two 4-bit values per byte (low nibble first), each q + 8 with
        q = round(W / s) in [-8, 7], `<name>_scale` float32 [out, in/g], s = max|W_group| / 7
Checkpoints stay float: the same checkpoint builds every scheme.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np

SCALE_SUFFIX = "_scale"
_QMAX = {"int8": 127, "int4": 7}


def group_size_for(scheme: dict, in_features: int) -> int:
    g = scheme.get("group_size") or in_features
    return g if in_features % g == 0 else 0


def quantize_weight(weight: np.ndarray, scheme: dict) -> Dict[str, np.ndarray]:
    """Float [out, in] weight → {"": packed integer weight, "_scale": scales} (keys are name suffixes)."""
    kind = scheme["kind"]
    out_f, in_f = weight.shape
    g = group_size_for(scheme, in_f)
    groups = weight.astype(np.float32).reshape(out_f, in_f // g, g)
    scale = np.abs(groups).max(axis=2) / _QMAX[kind]
    scale = np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)
    q = np.clip(np.rint(groups / scale[:, :, None]), -_QMAX[kind] - (kind == "int4"), _QMAX[kind])
    q = q.reshape(out_f, in_f)
    if kind == "int8":
        packed = q.astype(np.int8)
    else:
        nibbles = (q + 8).astype(np.uint8).reshape(out_f, in_f // 2, 2)
        packed = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).astype(np.uint8)
    return {"": np.ascontiguousarray(packed), SCALE_SUFFIX: np.ascontiguousarray(scale)}


def quantized_shapes(out_f: int, in_f: int, scheme: dict):
    """(dtype, shape) of the packed weight and of its scales."""
    g = group_size_for(scheme, in_f)
    packed = ("int8", [out_f, in_f]) if scheme["kind"] == "int8" else ("uint8", [out_f, in_f // 2])
    return packed, ("float32", [out_f, in_f // g])


def _quant_linear_class():
    import torch
    from torch import nn

    class QuantLinear(nn.Module):
        """nn.Linear with a packed integer weight, dequantised in the graph before the matmul."""

        def __init__(self, linear: nn.Linear, scheme: dict):
            super().__init__()
            out_f, in_f = linear.weight.shape
            self.kind = scheme["kind"]
            self.group = group_size_for(scheme, in_f)
            (wdtype, wshape), (_, sshape) = quantized_shapes(out_f, in_f, scheme)
            self.register_buffer("weight", torch.zeros(wshape, dtype=getattr(torch, wdtype)))
            self.register_buffer("weight" + SCALE_SUFFIX, torch.ones(sshape, dtype=torch.float32))
            self.bias = linear.bias
            self.in_features, self.out_features = in_f, out_f

        def dequantized(self):
            out_f, n_groups = self.out_features, self.in_features // self.group
            scale = getattr(self, "weight" + SCALE_SUFFIX)
            if self.kind == "int8":
                groups = self.weight.to(torch.float32).reshape(out_f, n_groups, self.group)
                return (groups * scale.unsqueeze(-1)).reshape(out_f, self.in_features)
            # Both nibbles of each byte by one broadcast over a [1, 16] divisor, in float arithmetic (IREE
            # lowers floor/sub, not aten's uint8 shifts): one elementwise dispatch per weight, where
            # unpacking low and high separately and stacking them took four. The divisor is built from
            # arange: a literal tensor constant does not import.
            byte = self.weight.to(torch.float32).reshape(out_f, n_groups, self.group // 2, 1)
            divisor = 1.0 + 15.0 * torch.arange(2, dtype=torch.float32)
            nibbles = torch.floor(byte / divisor) - 16.0 * torch.floor(byte / (16.0 * divisor))
            return ((nibbles - 8.0) * scale.reshape(out_f, n_groups, 1, 1)).reshape(out_f, self.in_features)

        def forward(self, x):
            return torch.nn.functional.linear(x, self.dequantized(), self.bias)

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
    """The float weight a packed one stands for (for accuracy checks)."""
    out_f, in_f = info["shape"]
    if info["kind"] == "int8":
        q = packed.astype(np.float32)
    else:
        q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(out_f, in_f).astype(np.float32) - 8
    g = info["group_size"]
    return (q.reshape(out_f, in_f // g, g) * scale[:, :, None]).reshape(out_f, in_f)


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def source_of(name: str, quantized: Dict[str, dict]) -> Optional[str]:
    """The quantised weight a scale tensor belongs to, or None."""
    if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in quantized:
        return name[: -len(SCALE_SUFFIX)]
    return None
