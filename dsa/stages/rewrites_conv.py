"""The convolution rewrites of dsa/stages/passes.py: batch norm folded into its convolution, patchify and stem
convolutions and 1-D (transposed) convolutions as matmuls, the bias of 3×3 convolutions split off."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dsa.stages.fx_graph import PassGraph, drop_asserts, node_arguments, node_val, only_user, static_size

aten = torch.ops.aten


# -- 2. fold_batchnorm ---------------------------------------------------------------------------------

_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default)


def _is_plain_conv(node) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _CONVS:
        return False
    return not (node.target is aten.convolution.default and node_arguments(node)["transposed"])


def fold_batchnorm(g: PassGraph) -> int:
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
            a = node_arguments(node)
            if a["training"]:
                continue
            out_nodes = [node]
        elif node.target is aten._native_batch_norm_legit_no_training.default:
            a = node_arguments(node)
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
        if not _is_plain_conv(conv) or only_user(conv) is not node or mean is None or var is None:
            continue
        ca = node_arguments(conv)
        weight, bias = ca["weight"], ca["bias"]
        dtype = node_val(weight).dtype
        if any(x is not None and node_val(x).dtype != dtype for x in (bias, mean, var, gamma, beta)):
            continue
        ndim = node_val(weight).dim()
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
        drop_asserts([node, conv, *out_nodes], g.graph)
        for out in out_nodes:
            if out is not node:
                g.graph.erase_node(out)
        g.graph.erase_node(node)
        g.graph.erase_node(conv)
        count += 1
    return count


def _pair(v) -> list:
    """A 2-D convolution's stride, padding or dilation as two ints (torch allows one for both)."""
    return [int(i) for i in v] * (2 // len(v))


def _dense_conv2d(node):
    """A 2-D, ungrouped, not transposed convolution of a 4-D input: (arguments, input, weight, bias, input
    value), else None."""
    if not _is_plain_conv(node) or node_val(node.args[1]).dim() != 4:
        return None
    a = node_arguments(node)
    xv = node_val(a["input"])
    if xv.dim() != 4 or a["groups"] != 1:
        return None
    return a, a["input"], a["weight"], a["bias"], xv


# -- 3. patchify_conv_to_matmul ------------------------------------------------------------------------


def patchify_conv_to_matmul(g: PassGraph) -> int:
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
        cout, cin, kh, kw = (static_size(d) for d in node_val(weight).shape)
        b_, c, h, w = xv.shape
        c, h, w = static_size(c), static_size(h), static_size(w)
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
            if not one_by_one and static_size(b_) is not None:
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
        drop_asserts([node], g.graph)
        g.graph.erase_node(node)
        count += 1
    return count


# -- 3b. stem_conv_to_matmul -----------------------------------------------------------------------------

# A convolution reads at most this many input channels to count as an image stem (RGB, RGB-D, ...).
STEM_MAX_CHANNELS = 4


def stem_conv_to_matmul(g: PassGraph) -> int:
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
        cout, cin, kh, kw = (static_size(d) for d in node_val(weight).shape)
        b_, h, w = static_size(xv.shape[0]), static_size(xv.shape[2]), static_size(xv.shape[3])
        if None in (cout, cin, kh, kw, b_, h, w) or cin > STEM_MAX_CHANNELS or (kh, kw) == (1, 1):
            continue
        padding = a["padding"]
        if isinstance(padding, str):
            continue
        stride, padding, dilation = _pair(a["stride"]), _pair(padding), _pair(a["dilation"])
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
        drop_asserts([node], g.graph)
        g.graph.erase_node(node)
        count += 1
    return count


# -- 3b'. split_conv_bias -------------------------------------------------------------------------------


def split_conv_bias(g: PassGraph) -> int:
    """2-D 3×3 convolution with stride 1, dilation 1, groups 1 and a bias  ⇒  the convolution without a bias,
    plus the bias broadcast over [B, Cout, H', W'] (`aten.add` of `bias.reshape(1, Cout, 1, 1)`). Runs after
    stem_conv_to_matmul (which takes the few-channel ones) and after fold_batchnorm (which gives every
    batch-normalised convolution a bias).

    Why: these are the convolutions IREE can compute by Winograd (F(6×6, 3×3): `iree-linalg-ext-convert-
    conv2d-to-winograd`), which a dispatch spec's `@__dsa_preprocess` entries choose per weight shape
    (dsa/stages/dispatch_spec.py). IREE 3.13's conversion replaces the convolution by transforms around a
    batch matmul into a zero-filled tensor and drops the convolution's init, where torch-mlir puts the bias:
    measured on a biased 64-channel 3×3 convolution, every output off by its channel's bias. A spec entry
    therefore matches only a convolution whose init is a fill, and this rewrite makes ResNet's batch-normalised
    convolutions (LeRobot ACT) such convolutions. The add is an elementwise consumer that IREE fuses into the
    convolution's dispatch: the im2col and data-tiled convolution paths run the same work as before."""
    count = 0
    for node in list(g.graph.nodes):
        conv = _dense_conv2d(node)
        if conv is None:
            continue
        a, x, weight, bias, xv = conv
        if bias is None or tuple(node_val(weight).shape[2:]) != (3, 3):
            continue
        if isinstance(a["padding"], str) or _pair(a["stride"]) != [1, 1] or _pair(a["dilation"]) != [1, 1]:
            continue
        with g.graph.inserting_before(node):
            args = dict(a, bias=None)
            plain = g.emit(node.target, tuple(args.values()), node)
            shaped = g.emit(aten.reshape.default, (bias, [1, -1, 1, 1]), node)
            out = g.emit(aten.add.Tensor, (plain, shaped), node)
        node.replace_all_uses_with(out)
        drop_asserts([node], g.graph)
        g.graph.erase_node(node)
        count += 1
    return count


# -- 3c. conv1d_to_matmul -------------------------------------------------------------------------------

CONV1D_MAX_LENGTH = 64


def conv1d_to_matmul(g: PassGraph) -> int:
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
        if not _is_plain_conv(node) or node_val(node.args[1]).dim() != 3:
            continue
        a = node_arguments(node)
        xv = node_val(a["input"])
        if xv.dim() != 3 or a["groups"] != 1 or isinstance(a["padding"], str):
            continue
        cout, cin, k = (static_size(d) for d in node_val(a["weight"]).shape)
        b_, length = static_size(xv.shape[0]), static_size(xv.shape[2])
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
        drop_asserts([node], g.graph)
        g.graph.erase_node(node)
        count += 1
    return count


def conv_transpose1d_to_matmul(g: PassGraph) -> int:
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
            a = node_arguments(node)
        elif node.target is aten.convolution.default and node_arguments(node)["transposed"]:
            a = node_arguments(node)
        else:
            continue
        xv = node_val(a["input"])
        if xv.dim() != 3 or a["groups"] != 1:
            continue
        stride, padding, dilation = (int(a[n][0]) for n in ("stride", "padding", "dilation"))
        if dilation != 1 or any(int(v) for v in a["output_padding"]):
            continue
        cin, cout, k = (static_size(d) for d in node_val(a["weight"]).shape)
        b_, length = static_size(xv.shape[0]), static_size(xv.shape[2])
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
        drop_asserts([node], g.graph)
        g.graph.erase_node(node)
        count += 1
    return count
