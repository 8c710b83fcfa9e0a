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
"""

from __future__ import annotations

import copy
import dataclasses
import math
import operator
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from dsa.core.errors import DsaError

aten = torch.ops.aten


# -- plumbing ------------------------------------------------------------------------------------------


class _Graph:
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


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def _arguments(node: fx.Node) -> Dict[str, object]:
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


def _static(size) -> Optional[int]:
    """A dim's size as an int, or None when it is symbolic."""
    return size if isinstance(size, int) else None


def _same_dims(a, b) -> bool:
    return len(a) == len(b) and all(str(x) == str(y) for x, y in zip(a, b))


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    """The node's one user, ignoring `_assert_tensor_metadata` checks on it; None when it has several."""
    users = [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]
    return users[0] if len(users) == 1 else None


def _drop_asserts(nodes: Sequence[fx.Node], graph: fx.Graph) -> None:
    """Erases the `_assert_tensor_metadata` checks on nodes a rewrite removes (they would keep them alive)."""
    for n in nodes:
        for u in list(n.users):
            if u.target is aten._assert_tensor_metadata.default:
                graph.erase_node(u)


# -- 1. bool_and_to_logical_and ------------------------------------------------------------------------

_BOOL_BINARY = {
    aten.__and__.Tensor: aten.logical_and.default,
    aten.bitwise_and.Tensor: aten.logical_and.default,
    aten.__xor__.Tensor: aten.logical_xor.default,
    aten.bitwise_xor.Tensor: aten.logical_xor.default,
}


def bool_and_to_logical_and(g: _Graph) -> int:
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
        if not all(isinstance(x, fx.Node) and getattr(_val(x), "dtype", None) == torch.bool for x in (a, b)):
            continue
        with g.graph.inserting_before(node):
            new = g.emit(new_target, (a, b), like=node)
        node.replace_all_uses_with(new)
        g.graph.erase_node(node)
        count += 1
    return count


# -- 2. fold_batchnorm ---------------------------------------------------------------------------------

_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default)


def _is_plain_conv(node) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _CONVS:
        return False
    return not (node.target is aten.convolution.default and _arguments(node)["transposed"])


def fold_batchnorm(g: _Graph) -> int:
    """convolution → eval-mode batch norm  ⇒  one convolution with weight `w * s` and bias
    `(b - running_mean) * s + beta`, where `s = gamma / sqrt(running_var + eps)` (per output channel).

    Matches `aten.batch_norm(..., training=False)` (what torch.export, strict=False, leaves for an eval
    `nn.BatchNorm2d`) and `aten._native_batch_norm_legit_no_training` (after core-ATen decomposition), when
    the convolution's only user is the batch norm and the statistics are tracked. The folded weight and
    bias are computed in the graph from the parameters and buffers, which stay named parameters; since the
    expressions read nothing else, IREE hoists them into module initialisers (checked in the flow IR with
    externalised parameters: `_initializer_*` dispatches compute them, `main` reads `__hoisted_tensor_*`
    globals and runs one convolution dispatch).

    Why: without it IREE keeps the per-channel scale/shift as an epilogue of every convolution dispatch
    (it already hoists rsqrt(var + eps) * gamma). Measured gain is within noise (ResNet-18 trunk 96×96:
    11.8 → 11.7 ms; 1×1 conv+BN 120×160: 20.3 → 20.0 ms); it is a default because it never measured
    slower, removes work per call, and lets the convolution rewrites see a plain convolution."""
    count = 0
    for node in list(g.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.batch_norm.default:
            a = _arguments(node)
            if a["training"]:
                continue
            out_nodes = [node]
        elif node.target is aten._native_batch_norm_legit_no_training.default:
            a = _arguments(node)
            users = list(node.users)
            if not all(u.target is operator.getitem for u in users):
                continue
            if any(u.args[1] != 0 and u.users for u in users):
                continue  # the saved statistics are read: not a plain normalisation
            out_nodes = [u for u in users if u.args[1] == 0]
        else:
            continue
        conv = a["input"]
        mean, var, gamma, beta, eps = a["running_mean"], a["running_var"], a["weight"], a["bias"], a["eps"]
        if not _is_plain_conv(conv) or _only_user(conv) is not node or mean is None or var is None:
            continue
        ca = _arguments(conv)
        weight, bias = ca["weight"], ca["bias"]
        dtype = _val(weight).dtype
        if any(x is not None and _val(x).dtype != dtype for x in (bias, mean, var, gamma, beta)):
            continue
        ndim = _val(weight).dim()
        with g.graph.inserting_before(node):
            inv = g.emit(aten.rsqrt.default, (g.emit(aten.add.Tensor, (var, float(eps)), node),), node)
            scale = g.emit(aten.mul.Tensor, (inv, gamma), node) if gamma is not None else inv
            w = g.emit(aten.mul.Tensor,
                       (weight, g.emit(aten.reshape.default, (scale, [-1] + [1] * (ndim - 1)), node)), node)
            shifted = g.emit(aten.sub.Tensor, (bias, mean), node) if bias is not None else \
                g.emit(aten.neg.default, (mean,), node)
            b = g.emit(aten.mul.Tensor, (shifted, scale), node)
            if beta is not None:
                b = g.emit(aten.add.Tensor, (b, beta), node)
            args = dict(ca, weight=w, bias=b)
            new = g.emit(conv.target, tuple(args.values()), conv)
        for out in out_nodes:
            out.replace_all_uses_with(new)
        _drop_asserts([node, conv, *out_nodes], g.graph)
        for out in out_nodes:
            if out is not node:
                g.graph.erase_node(out)
        g.graph.erase_node(node)
        g.graph.erase_node(conv)
        count += 1
    return count


def _dense_conv2d(node):
    """A 2-D, ungrouped, not transposed convolution of a 4-D input: (arguments, input, weight, bias, input
    value), else None."""
    if not _is_plain_conv(node) or _val(node.args[1]).dim() != 4:
        return None
    a = _arguments(node)
    xv = _val(a["input"])
    if xv.dim() != 4 or a["groups"] != 1:
        return None
    return a, a["input"], a["weight"], a["bias"], xv


# -- 3. patchify_conv_to_matmul ------------------------------------------------------------------------


def patchify_conv_to_matmul(g: _Graph) -> int:
    """2-D convolution over non-overlapping patches (kernel == stride, padding 0, groups 1, not transposed)
    ⇒ im2col by reshape/permute and one matmul with `weight.reshape(Cout, C*kh*kw)`, plus bias.

    kh×kw kernel, static batch: x[B,C,H,W] → reshape [B,C,H',kh,W',kw] → permute/reshape to columns
    [C*kh*kw, B*H'*W'] → `mm(W2, cols)` (+ bias[:, None]) → [Cout,B,H',W'] → permute to NCHW.
    1×1 kernel, stride s: `x[:, :, ::s, ::s]` → reshape [B, C, H'*W'] → `matmul(W2, ·)` → [B,Cout,H',W'];
    the reshape of the strided slice makes IREE materialise it (one memcpy dispatch) before a real matmul.
    A 1×1 stride-1 convolution is left alone (IREE already makes it a matmul). Spatial dims must be static;
    rows/columns the convolution would not reach are sliced off first. With a dynamic batch the k×k form
    keeps B as a batch-matmul dim: collapsing it into the columns crashes IREE 3.13 ("'affine.delinearize_
    index' op no basis element may be statically non-positive") when a conv+bias producer fuses into it.

    Why: IREE compiles these as generic convolutions with poor tiling (a ViT 16×16/16 patch embedding was
    the top dispatch of a pi0-style policy; LeRobot ACT's 1×1 stride-2 downsampling convs took ~45% of its
    time at 0.4 GFLOP/s). Measured (llvm-cpu x86-64-v4, O3, data tiling, local-task on 2 loaded cores):
    1×1/2 conv 64→128 on 120×160: 20.3 → 0.95 ms; at 24×24: 0.44 → 0.07 ms; ViT patch embed B=2 64×64
    width 128: 0.52 → 0.20 ms; ResNet-18 trunk 96×96: 11.8 → 11.3 ms. The token-major form the ViT
    literature uses ([B*H'*W', K] @ W2.T then permute) was no faster for the 1×1 conv: IREE propagates
    the permutes back into a strided generic "matmul_like" dispatch as slow as the convolution."""
    count = 0
    for node in list(g.graph.nodes):
        conv = _dense_conv2d(node)
        if conv is None:
            continue
        a, x, weight, bias, xv = conv
        cout, cin, kh, kw = (_static(d) for d in _val(weight).shape)
        b_, c, h, w = xv.shape
        c, h, w = _static(c), _static(h), _static(w)
        if None in (cout, cin, kh, kw, c, h, w):
            continue
        stride = list(a["stride"]) * (2 // len(a["stride"]))
        padding = a["padding"]
        if isinstance(padding, str) or any(p != 0 for p in padding):
            continue
        dilation = list(a["dilation"]) * (2 // len(a["dilation"]))
        one_by_one = (kh, kw) == (1, 1)
        if one_by_one:
            if stride == [1, 1]:
                continue
        elif stride != [kh, kw] or dilation != [1, 1]:
            continue
        ho, wo = (h - kh) // stride[0] + 1, (w - kw) // stride[1] + 1
        if ho <= 0 or wo <= 0:
            continue
        k = cin * kh * kw
        with g.graph.inserting_before(node):
            e = lambda target, *args: g.emit(target, args, node)  # noqa: E731
            w2 = e(aten.reshape.default, weight, [cout, k])
            if one_by_one:
                if stride[0] > 1:
                    x = e(aten.slice.Tensor, x, 2, 0, h, stride[0])
                if stride[1] > 1:
                    x = e(aten.slice.Tensor, x, 3, 0, w, stride[1])
                cols = e(aten.reshape.default, x, [-1, c, ho * wo])  # materialises the strided slice
            else:
                if ho * kh != h:
                    x = e(aten.slice.Tensor, x, 2, 0, ho * kh)
                if wo * kw != w:
                    x = e(aten.slice.Tensor, x, 3, 0, wo * kw)
                x = e(aten.reshape.default, x, [-1, c, ho, kh, wo, kw])
            if not one_by_one and _static(b_) is not None:
                # [C*kh*kw, B*H'*W'] columns: one 2-D matmul for the whole batch.
                cols = e(aten.reshape.default, e(aten.permute.default, x, [1, 3, 5, 0, 2, 4]), [k, -1])
                out = e(aten.mm.default, w2, cols)
                if bias is not None:
                    out = e(aten.add.Tensor, out, e(aten.reshape.default, bias, [cout, 1]))
                out = e(aten.permute.default, e(aten.reshape.default, out, [cout, -1, ho, wo]), [1, 0, 2, 3])
            else:
                if not one_by_one:  # dynamic batch: keep it a separate (batch-matmul) dim
                    cols = e(aten.reshape.default, e(aten.permute.default, x, [0, 1, 3, 5, 2, 4]),
                             [-1, k, ho * wo])
                out = e(aten.matmul.default, w2, cols)
                if bias is not None:
                    out = e(aten.add.Tensor, out, e(aten.reshape.default, bias, [cout, 1]))
                out = e(aten.reshape.default, out, [-1, cout, ho, wo])
        node.replace_all_uses_with(out)
        _drop_asserts([node], g.graph)
        g.graph.erase_node(node)
        count += 1
    return count


# -- 3b. stem_conv_to_matmul -----------------------------------------------------------------------------

# A convolution reads at most this many input channels to count as an image stem (RGB, RGB-D, ...).
STEM_MAX_CHANNELS = 4


def stem_conv_to_matmul(g: _Graph) -> int:
    """2-D k×k convolution over an image's few channels (C ≤ STEM_MAX_CHANNELS, groups 1, not transposed,
    kernel larger than 1×1) ⇒ im2col (unfold: [B, C*kh*kw, H'*W'] columns, the convolution's own stride,
    padding and dilation; written as pad + gather, torch's decomposition of `aten.im2col`) and one matmul with `weight.reshape(Cout, C*kh*kw)`, plus bias, reshaped
    to [B, Cout, H', W']. Runs after patchify_conv_to_matmul, which takes the kernel == stride patches.
    Static shapes only (a batch bucket): the gather's shape would specialise a dynamic batch.

    Why: with 3 input channels the convolution is too thin for IREE's convolution tiling on llvm-cpu (data
    tiling packs the 3 channels to a full vector tile; im2col preprocessing materialises the columns in a
    separate slow dispatch). ResNet-18's 7×7/2 stem on a 480×640 camera (LeRobot ACT, Diffusion Policy) was
    the top dispatch of the whole policy. Measured (llvm-cpu x86-64-v4, O3, data tiling incl. convolutions,
    ukernels, local-task 2 threads), the stem alone: 46.4 → 20.7 ms; (x86-64-v4 with im2col for convs:
    23.4 → 13.0 ms). Deeper convolutions (64+ channels) stay convolutions: IREE tiles them well."""
    count = 0
    for node in list(g.graph.nodes):
        conv = _dense_conv2d(node)
        if conv is None:
            continue
        a, x, weight, bias, xv = conv
        cout, cin, kh, kw = (_static(d) for d in _val(weight).shape)
        b_, h, w = _static(xv.shape[0]), _static(xv.shape[2]), _static(xv.shape[3])
        if None in (cout, cin, kh, kw, b_, h, w) or cin > STEM_MAX_CHANNELS or (kh, kw) == (1, 1):
            continue
        padding = a["padding"]
        if isinstance(padding, str):
            continue
        pair = lambda v: [int(i) for i in v] * (2 // len(v))  # noqa: E731
        stride, padding, dilation = pair(a["stride"]), pair(padding), pair(a["dilation"])
        ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        if ho <= 0 or wo <= 0:
            continue
        with g.graph.inserting_before(node):
            e = lambda target, *args: g.emit(target, args, node)  # noqa: E731
            # im2col as torch's own decomposition of aten.im2col writes it (IREE's importer has no im2col):
            # pad, gather the [kh, H', 1, 1] × [kw, W'] windows, [B, C, kh, kw, H', W'] → [B, C*kh*kw, H'*W'].
            if any(padding):
                x = e(aten.constant_pad_nd.default, x, [padding[1], padding[1], padding[0], padding[0]], 0.0)

            def windows(k: int, out: int, axis: int) -> fx.Node:
                starts = e(aten.unsqueeze.default, e(aten.arange.start_step, 0, out * stride[axis], stride[axis]), 0)
                taps = e(aten.unsqueeze.default, e(aten.arange.start_step, 0, k * dilation[axis], dilation[axis]), -1)
                return e(aten.add.Tensor, starts, taps)  # [k, out]: row (or column) of each window tap

            rows = e(aten.unsqueeze.default, e(aten.unsqueeze.default, windows(kh, ho, 0), -1), -1)
            gathered = e(aten.index.Tensor, x, [None, None, rows, windows(kw, wo, 1)])  # [B, C, kh, H', kw, W']
            cols = e(aten.reshape.default, e(aten.permute.default, gathered, [0, 1, 2, 4, 3, 5]),
                     [b_, cin * kh * kw, ho * wo])
            out = e(aten.matmul.default, e(aten.reshape.default, weight, [cout, cin * kh * kw]), cols)
            if bias is not None:
                out = e(aten.add.Tensor, out, e(aten.reshape.default, bias, [cout, 1]))
            out = e(aten.reshape.default, out, [-1, cout, ho, wo])
        node.replace_all_uses_with(out)
        _drop_asserts([node], g.graph)
        g.graph.erase_node(node)
        count += 1
    return count


# -- 3c. conv1d_to_matmul -------------------------------------------------------------------------------

CONV1D_MAX_LENGTH = 64


def conv1d_to_matmul(g: _Graph) -> int:
    """1-D convolution over a short sequence (groups 1, not transposed, kernel > 1, output length ≤
    CONV1D_MAX_LENGTH, static shapes) ⇒ the kernel's K shifted (strided, dilated) slices of the padded input
    stacked into [B, Cin*K, L'] columns and one matmul with `weight.reshape(Cout, Cin*K)`, plus bias.

    Why: a temporal U-Net at batch 1 (Diffusion Policy's: 512→2048 channels, kernel 5, horizon 16 → 4)
    convolves sequences of 4-16 steps; IREE's convolution tiling on llvm-cpu vectorises along that short
    length and ran its 2048-channel convolutions at ~5 GFLOP/s. As a matmul (M = Cout, N = L', K = Cin*K)
    data tiling packs the weight once and the ukernel streams it. The columns are K × the input: tiny for
    short sequences, hence the length limit. Static shapes only (a batch bucket)."""
    count = 0
    for node in list(g.graph.nodes):
        if not _is_plain_conv(node) or _val(node.args[1]).dim() != 3:
            continue
        a = _arguments(node)
        xv = _val(a["input"])
        if xv.dim() != 3 or a["groups"] != 1 or isinstance(a["padding"], str):
            continue
        cout, cin, k = (_static(d) for d in _val(a["weight"]).shape)
        b_, length = _static(xv.shape[0]), _static(xv.shape[2])
        if None in (cout, cin, k, b_, length) or k == 1:
            continue
        (stride,), (padding,), (dilation,) = ([int(v) for v in a[n]][:1] for n in ("stride", "padding", "dilation"))
        out_len = (length + 2 * padding - dilation * (k - 1) - 1) // stride + 1
        if out_len <= 0 or out_len > CONV1D_MAX_LENGTH:
            continue
        x, weight, bias = a["input"], a["weight"], a["bias"]
        with g.graph.inserting_before(node):
            e = lambda target, *args: g.emit(target, args, node)  # noqa: E731
            if padding:
                x = e(aten.constant_pad_nd.default, x, [padding, padding], 0.0)
            taps = [e(aten.slice.Tensor, x, 2, t * dilation, t * dilation + stride * (out_len - 1) + 1, stride)
                    for t in range(k)]
            cols = e(aten.reshape.default, e(aten.stack.default, taps, 2), [b_, cin * k, out_len])
            out = e(aten.matmul.default, e(aten.reshape.default, weight, [cout, cin * k]), cols)
            if bias is not None:
                out = e(aten.add.Tensor, out, e(aten.reshape.default, bias, [cout, 1]))
        node.replace_all_uses_with(out)
        _drop_asserts([node], g.graph)
        g.graph.erase_node(node)
        count += 1
    return count


def conv_transpose1d_to_matmul(g: _Graph) -> int:
    """1-D transposed convolution over a short sequence (groups 1, dilation 1, no output padding, output
    length ≤ CONV1D_MAX_LENGTH, static shapes) ⇒ one matmul of the input's [B, L, Cin] with
    `weight.reshape(Cin, Cout*K)` (the weight as stored: no per-call transpose or flip), then col2im: tap k
    of step i lands at output position i*stride + k - padding, summed over the K taps (pads and adds on the
    [B, Cout, ~stride*L] result).

    Why: Diffusion Policy's U-Net upsamples with ConvTranspose1d(C, C, 4, 2, 1); IREE lowers it to a
    convolution over a materialised flipped weight (a 16 MB copy per call at 1024 channels) and runs the
    convolution at the same short-length vectorisation as conv1d_to_matmul's."""
    count = 0
    for node in list(g.graph.nodes):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            continue
        if node.target is aten.conv_transpose1d.default:
            a = _arguments(node)
        elif node.target is aten.convolution.default and _arguments(node)["transposed"]:
            a = _arguments(node)
        else:
            continue
        xv = _val(a["input"])
        if xv.dim() != 3 or a["groups"] != 1:
            continue
        stride, padding, dilation = (int(a[n][0]) for n in ("stride", "padding", "dilation"))
        if dilation != 1 or any(int(v) for v in a["output_padding"]):
            continue
        cin, cout, k = (_static(d) for d in _val(a["weight"]).shape)
        b_, length = _static(xv.shape[0]), _static(xv.shape[2])
        if None in (cin, cout, k, b_, length):
            continue
        full = (length - 1) * stride + k
        out_len = full - 2 * padding
        if out_len <= 0 or out_len > CONV1D_MAX_LENGTH:
            continue
        x, weight, bias = a["input"], a["weight"], a["bias"]
        with g.graph.inserting_before(node):
            e = lambda target, *args: g.emit(target, args, node)  # noqa: E731
            z = e(aten.matmul.default, e(aten.permute.default, x, [0, 2, 1]),
                  e(aten.reshape.default, weight, [cin, cout * k]))                  # [B, L, Cout*K]
            z = e(aten.permute.default, e(aten.reshape.default, z, [b_, length, cout, k]), [0, 2, 3, 1])
            spread = (length - 1) * stride + 1  # tap k's L values, `stride` apart
            out = None
            for t in range(k):
                tap = e(aten.select.int, z, 2, t)                                   # [B, Cout, L]
                if stride > 1:  # interleave stride-1 zeros after each value
                    tap = e(aten.constant_pad_nd.default, e(aten.unsqueeze.default, tap, -1), [0, stride - 1], 0.0)
                    tap = e(aten.slice.Tensor, e(aten.reshape.default, tap, [b_, cout, length * stride]), 2, 0, spread)
                tap = e(aten.constant_pad_nd.default, tap, [t, full - t - spread], 0.0)  # [B, Cout, full]
                out = tap if out is None else e(aten.add.Tensor, out, tap)
            if padding:
                out = e(aten.slice.Tensor, out, 2, padding, padding + out_len)
            if bias is not None:
                out = e(aten.add.Tensor, out, e(aten.reshape.default, bias, [cout, 1]))
        node.replace_all_uses_with(out)
        _drop_asserts([node], g.graph)
        g.graph.erase_node(node)
        count += 1
    return count


# -- 4. attention_to_sdpa ------------------------------------------------------------------------------

_MATMULS = (aten.matmul.default, aten.bmm.default)
_SOFTMAXES = (aten.softmax.int, aten._softmax.default)


def _scalar(x) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _finite_fill(value: float, dtype: torch.dtype) -> float:
    """The additive mask value for a bool mask filled with `value`: the model's own value when finite,
    else a large finite negative. Not -inf: IREE's attention is an online softmax over tiles of keys, and a
    query row (or tile) whose keys are all masked would compute exp(-inf - (-inf)) = NaN; with -inf eager
    gives NaN for a fully-masked row too, and the finite value makes it finite instead. masked_fill sets a
    score to the value where the additive form gives score + value: the same (zero) weight in any row
    with an unmasked key, and in a fully-masked row the same uniform weights whenever |value| swamps the
    scores in float (the fp32 spacing at 1e9 is 64), as for -1e9 or finfo.min."""
    if math.isfinite(value):
        return value
    return -1e9 if torch.finfo(dtype).max > 1e9 else torch.finfo(dtype).min / 2


def attention_to_sdpa(g: _Graph) -> int:
    """Decomposed attention `softmax(q @ k^T * scale + mask) @ v` ⇒
    `aten.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask, scale=scale)`.

    Matches, between the score matmul (`matmul`/`bmm`, k^T any tensor: k is its last-two-dims transpose)
    and the last-dim softmax, any sequence of: multiplication or division by a Python number (the scale),
    an additive float mask (`add`), and a bool mask (`masked_fill(mask, value)`, `where(mask, s, value)` /
    `where(mask, value, s)`); after the softmax, no-op casts and eval dropout; then `probs @ v`. Each
    intermediate result must have no other user (attention weights returned by the model: not matched), and
    q, k^T, v must have the same batch dims and dtype. A bool mask becomes the additive mask
    `where(mask, value', 0)` with value' the fill value, or -1e9 when the fill is -inf (see `_finite_fill`:
    a fully-masked row would be NaN in IREE's online softmax); scales applied after a mask scale it too.

    Why: IREE fuses SDPA into one attention dispatch (online softmax, scores never written to memory); a
    decomposed masked softmax was ~94% of a LeRobot pi0's time. Not a default: on IREE 3.13 llvm-cpu
    (x86-64-v4, O3) the attention dispatch measured far slower than matmul + softmax + matmul: 4 heads,
    L=64, d=64: 0.12 → 1.0 ms; L=256: 1.5 → 23 ms (dynamic L: 1.1 → 17 ms); 8 heads L=1024: 74 → 497 ms;
    2-layer d=256 transformer: 1.3 → 2.7 ms. Opt in per manifest (e.g. for a GPU target)."""
    count = 0
    for node in list(g.graph.nodes):
        if node.op != "call_function" or node.target not in _SOFTMAXES:
            continue
        sa = _arguments(node)
        sv = _val(node)
        if sa["dim"] not in (-1, sv.dim() - 1) or sa.get("dtype") not in (None, sv.dtype) or sa.get(
                "half_to_float"):
            continue
        # Forward from the softmax to `probs @ v`.
        chain_after = [node]
        cur = _only_user(node)
        while cur is not None and cur.op == "call_function" and (
            (cur.target is aten.dropout.default and not _arguments(cur)["train"])
            or (cur.target in (aten.to.dtype, aten.type_as.default, aten.clone.default)
                and _val(cur).dtype == sv.dtype)
        ) and cur.args[0] is chain_after[-1]:
            chain_after.append(cur)
            cur = _only_user(cur)
        final = cur
        if final is None or final.target not in _MATMULS or final.args[0] is not chain_after[-1]:
            continue
        v = final.args[1]
        # Backward from the softmax input to `q @ kT`, collecting scale and masks.
        steps: List[Tuple[str, object]] = []
        chain_before: List[fx.Node] = []
        cur = node.args[0]
        ok = True
        while True:
            if not isinstance(cur, fx.Node) or cur.op != "call_function" or _only_user(cur) is None:
                ok = False
                break
            if cur.target in _MATMULS:
                break
            t, args = cur.target, cur.args
            if t in (aten.mul.Tensor, aten.mul.Scalar) and _scalar(args[1]) is not None:
                steps.append(("scale", _scalar(args[1])))
                nxt = args[0]
            elif t is aten.mul.Tensor and _scalar(args[0]) is not None:
                steps.append(("scale", _scalar(args[0])))
                nxt = args[1]
            elif t in (aten.div.Tensor, aten.div.Scalar) and _scalar(args[1]) not in (None, 0.0) \
                    and not cur.kwargs:
                steps.append(("scale", 1.0 / _scalar(args[1])))
                nxt = args[0]
            elif t is aten.add.Tensor and len(args) == 2 and not cur.kwargs and all(
                    isinstance(x, fx.Node) for x in args):
                # One operand continues the chain (it leads back to a matmul), the other is the mask.
                i = 0 if _leads_to_matmul(args[0]) else 1
                mask = args[1 - i]
                if _val(mask).dtype != sv.dtype:
                    ok = False
                    break
                steps.append(("add", mask))
                nxt = args[i]
            elif t is aten.masked_fill.Scalar and _scalar(args[2]) is not None:
                steps.append(("fill", (args[1], _scalar(args[2]), True)))
                nxt = args[0]
            elif t is aten.where.ScalarOther and _scalar(args[2]) is not None:
                steps.append(("fill", (args[0], _scalar(args[2]), False)))  # fills where the mask is False
                nxt = args[1]
            elif t is aten.where.ScalarSelf and _scalar(args[1]) is not None:
                steps.append(("fill", (args[0], _scalar(args[1]), True)))
                nxt = args[2]
            else:
                ok = False
                break
            chain_before.append(cur)
            cur = nxt
        if not ok:
            continue
        scores = cur
        q, k_t = scores.args
        qv, kv, vv = _val(q), _val(k_t), _val(v)
        if not all(isinstance(x, torch.Tensor) for x in (qv, kv, vv)) or not (3 <= qv.dim() <= 4):
            continue
        if not (qv.dim() == kv.dim() == vv.dim() and _same_dims(qv.shape[:-2], kv.shape[:-2])
                and _same_dims(qv.shape[:-2], vv.shape[:-2])):
            continue
        if not (qv.dtype == kv.dtype == vv.dtype == sv.dtype) or not qv.dtype.is_floating_point:
            continue
        if not _same_dims(sv.shape, _val(scores).shape):
            continue  # a mask broadcast the scores to more dims than q has
        if any(isinstance(m, tuple) and _val(m[0]).dtype != torch.bool for kind, m in steps if kind == "fill"):
            continue

        with g.graph.inserting_before(final):
            e = lambda target, *args: g.emit(target, args, node)  # noqa: E731
            scale = 1.0
            terms: List[Tuple[fx.Node, float]] = []  # additive masks and the factor still to apply
            for kind, item in reversed(steps):  # from the matmul outwards
                if kind == "scale":
                    scale *= item
                    terms = [(m, f * item) for m, f in terms]
                elif kind == "add":
                    terms.append((item, 1.0))
                else:
                    bool_mask, value, fill_where_true = item
                    fill = _finite_fill(value, sv.dtype)
                    zeros = g.emit(aten.zeros_like.default, (bool_mask,), node, {"dtype": sv.dtype})
                    where = bool_mask if fill_where_true else e(aten.logical_not.default, bool_mask)
                    additive = e(aten.masked_fill.Scalar, zeros, where, fill)
                    # masked_fill sets the score to `fill`; the additive form gives score + fill, the same
                    # softmax weight (0) unless the whole row is masked.
                    terms.append((additive, 1.0))
            mask = None
            for m, f in terms:
                if f != 1.0:
                    m = e(aten.mul.Tensor, m, f)
                mask = m if mask is None else e(aten.add.Tensor, mask, m)
            if len(terms) > 1:  # two very negative terms must not overflow to -inf
                mask = e(aten.clamp_min.default, mask, torch.finfo(sv.dtype).min)
            k = e(aten.transpose.int, k_t, -2, -1)
            new = g.emit(aten.scaled_dot_product_attention.default, (q, k, v, mask), node, {"scale": scale})
        final.replace_all_uses_with(new)
        removed = [final, *chain_after, *chain_before, scores]
        _drop_asserts(removed, g.graph)
        for n in removed:
            if not n.users:
                g.graph.erase_node(n)
        count += 1
    return count


def _leads_to_matmul(x) -> bool:
    """Whether following first operands / chain operands from `x` reaches a matmul before anything else."""
    seen = 0
    while isinstance(x, fx.Node) and x.op == "call_function" and seen < 16:
        if x.target in _MATMULS:
            return True
        if x.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,
                        aten.masked_fill.Scalar):
            x = x.args[1] if x.target is aten.mul.Tensor and _scalar(x.args[0]) is not None else x.args[0]
        elif x.target is aten.where.ScalarOther:
            x = x.args[1]
        elif x.target is aten.where.ScalarSelf:
            x = x.args[2]
        elif x.target is aten.add.Tensor:
            return _leads_to_matmul(x.args[0]) or _leads_to_matmul(x.args[1])
        else:
            return False
        seen += 1
    return False


# -- 5. decompose_attention -----------------------------------------------------------------------------

# Additive value for the positions a bool attention mask excludes (see _finite_fill for why not -inf).
_MASKED_SCORE = -1.0e9


def decompose_attention(g: _Graph) -> int:
    """`scaled_dot_product_attention(q, k, v, attn_mask, scale)` → `softmax((q·scale) @ kᵀ + mask) @ v`:
    two matmuls and a softmax. The bool mask becomes an additive one (0 / -1e9, finite for the reason
    _finite_fill gives). Causal, dropout and grouped-query attention are left fused.

    Why: IREE 3.13's llvm-cpu backend lowers the fused attention op (iree_linalg_ext.attention) to an online
    softmax that runs at ~2 GFLOP/s here — measured with `dsa profile` on the transformer control, one
    attention_8x129x64x64x129 dispatch took 16 ms, 70% of the model; the same attention decomposed took
    ~1 ms (matmuls IREE data-tiles, a softmax dispatch). The scale is applied to q (L×E elements) rather than
    to the scores (L×S). This is the inverse of attention_to_sdpa: choose per target family."""
    count = 0
    for node in list(g.graph.nodes):
        if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
            continue
        a = _arguments(node)
        q, k, v = a["query"], a["key"], a["value"]
        mask = a.get("attn_mask")
        if a.get("dropout_p", 0.0) or a.get("is_causal", False) or a.get("enable_gqa", False):
            continue
        qv = _val(q)
        if qv is None or _static(qv.shape[-1]) is None:
            continue
        scale = a.get("scale")
        scale = 1.0 / math.sqrt(_static(qv.shape[-1])) if scale is None else float(scale)
        with g.graph.inserting_before(node):
            e = lambda target, *args: g.emit(target, args, like=node)  # noqa: E731
            scores = e(aten.matmul.default, e(aten.mul.Scalar, q, scale), e(aten.transpose.int, k, -2, -1))
            if mask is not None:
                if _val(mask).dtype == torch.bool:
                    scores = e(aten.masked_fill.Scalar, scores, e(aten.logical_not.default, mask), _MASKED_SCORE)
                else:
                    scores = e(aten.add.Tensor, scores, mask)
            out = e(aten.matmul.default, e(aten._softmax.default, scores, -1, False), v)
        node.replace_all_uses_with(out)
        g.graph.erase_node(node)
        count += 1
    return count


# -- 6. fence_head_split_projections -------------------------------------------------------------------

_PROJECTIONS = (aten.linear.default, aten.matmul.default, aten.mm.default, aten.addmm.default)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_TRANSPOSES = (aten.transpose.int, aten.permute.default)


def _moves_axis(node: fx.Node, axis: int) -> bool:
    """Whether a transpose/permute node moves `axis` of its input."""
    rank = _val(node.args[0]).dim()
    if node.target is aten.transpose.int:
        a, b = (d % rank for d in node.args[1:3])
        return a != b and axis in (a, b)
    return [d % rank for d in node.args[1]][axis] != axis


def _is_head_split(view: fx.Node, projected: torch.Tensor) -> bool:
    """Whether `view` splits the projection's last dim into [heads, head_dim] (heads > 1; the leading dims as
    they were, or regrouped as torch's multi_head_attention_forward does, [S, B*heads, d]) and its only user
    is a transpose/permute that moves the heads axis."""
    if view.op != "call_function" or view.target not in _VIEWS:
        return False
    out = _val(view)
    if not isinstance(out, torch.Tensor) or out.dim() < 3:
        return False
    width, head_dim = _static(projected.shape[-1]), _static(out.shape[-1])
    if width is None or head_dim is None or head_dim >= width or width % head_dim:
        return False
    user = _only_user(view)
    return user is not None and user.op == "call_function" and user.target in _TRANSPOSES and _moves_axis(
        user, out.dim() - 2)


def fence_head_split_projections(g: _Graph) -> int:
    """A projection (`linear`, `matmul`, `mm`, `addmm` with a 2-D weight) whose result is split into attention
    heads — `view/reshape [..., H·d] → [..., H, d]`, then a transpose/permute of the heads axis — is fenced on
    both sides with `dsa::optimization_barrier` (IREE's `util.optimization_barrier`, dsa.stages.custom_ops):
    the projection compiles as a plain matmul, the head split as a copy dispatch of its own, and the
    projection's input as it was. Other users of the projection read it unfenced. Static shapes only (a bucket):
    IREE 3.13 cannot resolve a dynamic dim through the barrier ("'tensor.dim' op unexpected during shape
    cleanup"), and a dynamic module is not data-tiled, where the fold does its harm.

    Why: IREE 3.13 propagates the split's transpose into the contraction (global optimisation's transpose
    propagation, on by default), turning an [S, K] × [K, H·d] matmul into a batch matmul over heads with a
    broadcast LHS and N = d (`matmul_like_8x302x64x512` in ACT, `matmul_like_12x1024x64x768` in SmolVLA's
    vision tower), which data tiling and the ukernels serve badly (docs/upstream/head_split_projection.mlir).
    The fence on the input is needed too: without it the matmul's packed LHS fuses with a preceding layer
    norm, whose codegen then fails ("One or more operations with large vector sizes"), the same failure that
    rules out `--iree-global-opt-propagate-transposes=false` for a whole model. Measured (x86-64-v3, O3, data
    tiling, ukernels, 2 threads): SmolVLA at its real size 6.96 → 5.03 s per 10-step call, ACT 463 → 437 ms;
    docs/performance.md."""
    from dsa.stages.custom_ops import optimization_barrier

    barrier = optimization_barrier().default  # registered before a node refers to it
    fenced_inputs: Dict[fx.Node, fx.Node] = {}
    count = 0
    for node in list(g.graph.nodes):
        if node.op != "call_function" or node.target not in _PROJECTIONS:
            continue
        projected = _val(node)
        if not isinstance(projected, torch.Tensor) or not projected.dtype.is_floating_point:
            continue
        x, weight = (node.args[1], node.args[2]) if node.target is aten.addmm.default else node.args[:2]
        if not all(_static(d) is not None for v in (projected, _val(x)) for d in getattr(v, "shape", ())):
            continue  # a dynamic dim: IREE cannot resolve it through the barrier (and does not data-tile there)
        if not isinstance(weight, fx.Node) or getattr(_val(weight), "ndim", 0) != 2:
            continue  # two activations (an attention score or value matmul), not a projection
        splits = [u for u in node.users if _is_head_split(u, projected)]
        if not splits:
            continue
        with g.graph.inserting_after(node):
            fenced = g.emit(barrier, (node,), like=node)
        for view in splits:
            view.replace_input_with(node, fenced)
        if isinstance(x, fx.Node):
            if x not in fenced_inputs:  # one fence per input, shared by the projections that read it
                with g.graph.inserting_before(node):
                    fenced_inputs[x] = g.emit(barrier, (x,), like=node)
            node.replace_input_with(x, fenced_inputs[x])
        count += 1
    return count


# -- registry ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pass:
    """A named rewrite: `function(graph)` rewrites one graph in place and returns how many rewrites it made."""

    name: str
    function: Callable[[_Graph], int]

    @property
    def doc(self) -> str:
        return self.function.__doc__ or ""

    def __call__(self, graph: _Graph) -> int:
        return self.function(graph)


PASSES: Dict[str, Pass] = {
    p.__name__: Pass(p.__name__, p)
    for p in (bool_and_to_logical_and, fold_batchnorm, patchify_conv_to_matmul, stem_conv_to_matmul,
              conv1d_to_matmul, conv_transpose1d_to_matmul, attention_to_sdpa, decompose_attention,
              fence_head_split_projections)
}

# The defaults are chosen for the llvm-cpu targets this release ships (toolchains/targets): there IREE
# 3.13's fused attention dispatch measured ~10x slower than matmul + softmax, so attention is decomposed
# (decompose_attention) and attention_to_sdpa, its inverse, is opt-in (for a backend whose fused attention
# is fast). The others measured faster or equal. Numbers: docs/performance.md, bench/RESULTS.md.
DEFAULT_PASSES: Tuple[str, ...] = (
    "bool_and_to_logical_and", "fold_batchnorm", "patchify_conv_to_matmul", "stem_conv_to_matmul",
    "conv1d_to_matmul", "conv_transpose1d_to_matmul", "decompose_attention", "fence_head_split_projections",
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
            made = p(_Graph(gm))
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
