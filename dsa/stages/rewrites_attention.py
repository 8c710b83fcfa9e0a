"""The attention rewrites of dsa/stages/passes.py: matmul-softmax-matmul to one SDPA op and back, and the
fence that keeps a head-split projection a plain matmul."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from dsa.stages.fx_graph import PassGraph, drop_asserts, node_arguments, node_val, only_user, same_dims, static_size

aten = torch.ops.aten


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


def attention_to_sdpa(g: PassGraph) -> int:
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
        sa = node_arguments(node)
        sv = node_val(node)
        if sa["dim"] not in (-1, sv.dim() - 1) or sa.get("dtype") not in (None, sv.dtype) or sa.get(
                "half_to_float"):
            continue
        # Forward from the softmax to `probs @ v`.
        chain_after = [node]
        cur = only_user(node)
        while cur is not None and cur.op == "call_function" and (
            (cur.target is aten.dropout.default and not node_arguments(cur)["train"])
            or (cur.target in (aten.to.dtype, aten.type_as.default, aten.clone.default)
                and node_val(cur).dtype == sv.dtype)
        ) and cur.args[0] is chain_after[-1]:
            chain_after.append(cur)
            cur = only_user(cur)
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
            if not isinstance(cur, fx.Node) or cur.op != "call_function" or only_user(cur) is None:
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
                if node_val(mask).dtype != sv.dtype:
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
        qv, kv, vv = node_val(q), node_val(k_t), node_val(v)
        if not all(isinstance(x, torch.Tensor) for x in (qv, kv, vv)) or not (3 <= qv.dim() <= 4):
            continue
        if not (qv.dim() == kv.dim() == vv.dim() and same_dims(qv.shape[:-2], kv.shape[:-2])
                and same_dims(qv.shape[:-2], vv.shape[:-2])):
            continue
        if not (qv.dtype == kv.dtype == vv.dtype == sv.dtype) or not qv.dtype.is_floating_point:
            continue
        if not same_dims(sv.shape, node_val(scores).shape):
            continue  # a mask broadcast the scores to more dims than q has
        if any(isinstance(m, tuple) and node_val(m[0]).dtype != torch.bool for kind, m in steps if kind == "fill"):
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
        drop_asserts(removed, g.graph)
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


def decompose_attention(g: PassGraph) -> int:
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
        a = node_arguments(node)
        q, k, v = a["query"], a["key"], a["value"]
        mask = a.get("attn_mask")
        if a.get("dropout_p", 0.0) or a.get("is_causal", False) or a.get("enable_gqa", False):
            continue
        qv = node_val(q)
        if qv is None or static_size(qv.shape[-1]) is None:
            continue
        scale = a.get("scale")
        scale = 1.0 / math.sqrt(static_size(qv.shape[-1])) if scale is None else float(scale)
        with g.graph.inserting_before(node):
            e = lambda target, *args: g.emit(target, args, like=node)  # noqa: E731
            scores = e(aten.matmul.default, e(aten.mul.Scalar, q, scale), e(aten.transpose.int, k, -2, -1))
            if mask is not None:
                if node_val(mask).dtype == torch.bool:
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
    rank = node_val(node.args[0]).dim()
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
    out = node_val(view)
    if not isinstance(out, torch.Tensor) or out.dim() < 3:
        return False
    width, head_dim = static_size(projected.shape[-1]), static_size(out.shape[-1])
    if width is None or head_dim is None or head_dim >= width or width % head_dim:
        return False
    user = only_user(view)
    return user is not None and user.op == "call_function" and user.target in _TRANSPOSES and _moves_axis(
        user, out.dim() - 2)


def fence_head_split_projections(g: PassGraph) -> int:
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
        projected = node_val(node)
        if not isinstance(projected, torch.Tensor) or not projected.dtype.is_floating_point:
            continue
        x, weight = (node.args[1], node.args[2]) if node.target is aten.addmm.default else node.args[:2]
        if not all(static_size(d) is not None for v in (projected, node_val(x)) for d in getattr(v, "shape", ())):
            continue  # a dynamic dim: IREE cannot resolve it through the barrier (and does not data-tile there)
        if not isinstance(weight, fx.Node) or getattr(node_val(weight), "ndim", 0) != 2:
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


# -- 7. blocked_softmax --------------------------------------------------------------------------------

SOFTMAX_BLOCK = 16      # one AVX-512 f32 vector
SOFTMAX_MIN_LENGTH = 128  # shorter rows: the extra dispatches cost as much as the horizontal reductions


_SCORE_STEPS = (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.add.Tensor,
                aten.masked_fill.Scalar, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.self)


def _score_matmul(x) -> Optional[fx.Node]:
    """The matmul whose result reaches `x` through single-user element-wise steps (scale, masks), if any."""
    for _ in range(16):
        if not isinstance(x, fx.Node) or x.op != "call_function" or only_user(x) is None:
            return None
        if x.target in _MATMULS:
            return x
        if x.target not in _SCORE_STEPS:
            return None
        x = next((a for a in x.args if isinstance(a, fx.Node) and _leads_to_matmul(a)), None)
    return None


def blocked_softmax(g: PassGraph) -> int:
    """A float32 softmax over the last dim of static length L ≥ 128 (`aten.softmax.int`, `aten._softmax`,
    any leading dims, static or dynamic) → the same softmax computed over blocks of 16: the row's whole
    blocks viewed as [L // 16, 16], the max and the sum reduced first across the blocks (16 partial results
    a row, element-wise) and then within the block, and combined with the max / sum of the last L % 16
    elements when there are any; the result is `exp(x - max) / sum`. When x comes from a matmul through
    element-wise steps (scale, masks: attention scores) and the shapes are static, the matmul's result is
    fenced with `dsa::optimization_barrier`: the steps no longer have one consumer (the softmax) to fuse
    into, and IREE would otherwise make them the epilogue of the data-tiled matmul, computed in its packed
    layout, whose codegen exceeds the vector-size and stack limits (SmolVLA's attention at x86-64-v4:
    "One or more operations with large vector sizes").

    Why: IREE 3.13's llvm-cpu backend reduces a softmax row along its innermost dim with one horizontal
    vector reduction per 16 elements, a serial chain of shuffles (and NaN checks for the max) whose latency
    bounds the loop, and computes the max twice (once for the sum, once for the normalisation). The masked
    attention softmaxes of LeRobot's PI0 ran at ~2 ns an element (`softmax_8x520x520` 3.8 ms a call,
    `softmax_8x51x571` 0.41 ms: 58% of the dispatch time of PI0 with two 224 px cameras). Blocked, the
    reductions over blocks are element-wise vector maxima and sums (IREE vectorises a reduction of an outer
    dim along the inner one), and one horizontal reduction per row remains: standalone 8×520×520 4.9 → 2.8
    ms, 8×51×571 0.68 → 0.29 ms (x86-64-v4, one thread); whole calls of LeRobot's PI0 at x86-64-v3 13.4 →
    8.3 ms, with two 224 px cameras at x86-64-v4 21.6 → 18.8 ms (docs/performance.md). Rows under 128:
    the extra dispatches cost what the reductions save. The order of the sum changes (partial sums per
    lane), as eager's vectorised softmax also sums in lanes: results agree to ~1e-7 relative."""
    count = 0
    for node in list(g.graph.nodes):
        if node.op != "call_function" or node.target not in _SOFTMAXES:
            continue
        x = node.args[0]
        xv, out = node_val(x), node_val(node)
        if not (isinstance(xv, torch.Tensor) and isinstance(out, torch.Tensor)):
            continue
        if xv.dtype != torch.float32 or out.dtype != torch.float32 or xv.dim() < 1:
            continue  # half precision: eager accumulates in float32; leave those to IREE's softmax
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if not isinstance(dim, int) or dim % xv.dim() != xv.dim() - 1:
            continue
        length = static_size(xv.shape[-1])
        if length is None or length < SOFTMAX_MIN_LENGTH:
            continue
        blocks, rest = divmod(length, SOFTMAX_BLOCK)
        whole = blocks * SOFTMAX_BLOCK
        scores = _score_matmul(x)
        static_scores = scores is not None and all(static_size(d) is not None for d in node_val(scores).shape)
        if static_scores and scores is not x:  # steps between them (no steps: nothing to fuse)
            from dsa.stages.custom_ops import optimization_barrier

            user = only_user(scores)
            with g.graph.inserting_after(scores):
                fenced = g.emit(optimization_barrier().default, (scores,), like=scores)
            user.replace_input_with(scores, fenced)
        with g.graph.inserting_before(node):
            e = lambda target, *args: g.emit(target, args, like=node)  # noqa: E731

            def reduce(t, op, combine):
                """`t` reduced over its last dim: over the whole blocks (first across them, element-wise,
                then within the block) and, when the row is not a whole number of blocks, the rest."""
                head = e(aten.slice.Tensor, t, -1, 0, whole) if rest else t
                tiled = e(aten.unflatten.int, head, -1, [blocks, SOFTMAX_BLOCK])
                out = e(op, e(op, tiled, [-2]), [-1], True)
                if rest:
                    out = e(combine, out, e(op, e(aten.slice.Tensor, t, -1, whole, length), [-1], True))
                return out

            row_max = reduce(x, aten.amax.default, aten.maximum.default)
            exps = e(aten.exp.default, e(aten.sub.Tensor, x, row_max))
            row_sum = reduce(exps, aten.sum.dim_IntList, aten.add.Tensor)
            new = e(aten.div.Tensor, exps, row_sum)
        node.replace_all_uses_with(new)
        drop_asserts([node], g.graph)
        g.graph.erase_node(node)
        count += 1
    return count
