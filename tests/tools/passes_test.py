"""The FX rewrites of dsa.stages.passes: each finds its pattern (and only it), and the rewritten program computes
what the eager module computes (fp32, max |difference| <= 1e-5 x max |output| unless stated); one small
model with every pattern still imports with aot.export, compiles with iree-compile and runs like eager.

Programs are exported as dsa.stages.export does: eval module, parameters externalised, strict=False."""

import math
import subprocess
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dsa.core.errors import DsaError
from dsa.stages.passes import DEFAULT_PASSES, PASSES, apply_passes

aten = torch.ops.aten
RTOL = 1e-5


def _export(module, args, dynamic_shapes=None):
    from iree.turbine import aot

    module = module.eval()
    aot.externalize_module_parameters(module, external_scope="model")
    with torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)


def _targets(program):
    return [n.target for m in program.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function"]


def _assert_matches_eager(module, program, args, rtol=RTOL):
    with torch.no_grad():
        want = module(*args)
        got = program.module()(*args)
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= rtol * scale, f"max |rewritten - eager| = {err:.3g} > {rtol} x {scale:.3g}"


def _rewrite(module, args, name, dynamic_shapes=None):
    torch.manual_seed(0)
    program = _export(module, args, dynamic_shapes)
    rewritten, counts = apply_passes(program, [name])
    assert set(counts) == {name}
    return program, rewritten, counts[name]


# -- registry ------------------------------------------------------------------------------------------


def test_unknown_rewrite_name_raises_dsa_error_naming_it_and_the_known_ones():
    program = _export(nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.raises(DsaError) as e:
        apply_passes(program, ["fold_batchnorm", "no_such_rewrite"])
    assert e.value.where == "model.rewrites"
    assert "unknown rewrite 'no_such_rewrite'" in str(e.value)
    assert all(name in e.value.hint for name in PASSES)


def test_every_pass_is_documented_and_defaults_are_registered_passes():
    for name, p in PASSES.items():
        assert p.name == name and len(p.doc) > 200, name
        assert "Why" in p.doc, name
    assert set(DEFAULT_PASSES) <= set(PASSES)
    # Measured ~10x slower on IREE 3.13 llvm-cpu: opt-in, not default.
    assert "attention_to_sdpa" not in DEFAULT_PASSES


def test_rewriting_leaves_the_input_program_and_signature_intact():
    class ConvLast(nn.Module):  # the rewritten node is the program's output
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 4, stride=4)

        def forward(self, x):
            return self.conv(x)

    module, args = ConvLast(), (torch.randn(1, 3, 8, 8),)
    program, rewritten, count = _rewrite(module, args, "patchify_conv_to_matmul")
    assert count == 1
    assert aten.conv2d.default in _targets(program)  # the input program is untouched
    assert aten.conv2d.default not in _targets(rewritten)
    assert rewritten.graph_signature.input_specs == program.graph_signature.input_specs
    assert list(rewritten.state_dict) == list(program.state_dict)
    _assert_matches_eager(module, rewritten, args)


# -- bool_and_to_logical_and ---------------------------------------------------------------------------


class BoolAnd(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x, a, b):
        return torch.where(self.op(a, b), x, -x)


@pytest.mark.parametrize("op", [lambda a, b: a & b, torch.bitwise_and, lambda a, b: a ^ b],
                         ids=["__and__", "bitwise_and", "__xor__"])
def test_bool_and_becomes_logical_and_and_matches_eager(op):
    args = (torch.randn(2, 5), torch.rand(2, 5) > 0.5, torch.rand(1, 5) > 0.5)  # broadcasting operands
    module = BoolAnd(op)
    _, rewritten, count = _rewrite(module, args, "bool_and_to_logical_and")
    assert count == 1
    targets = _targets(rewritten)
    assert aten.logical_and.default in targets or aten.logical_xor.default in targets
    assert not {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.__xor__.Tensor} & set(targets)
    _assert_matches_eager(module, rewritten, args, rtol=0)


def test_integer_and_is_left_alone():
    class IntAnd(nn.Module):
        def forward(self, a, b):
            return a & b

    args = (torch.randint(0, 16, (4,)), torch.randint(0, 16, (4,)))
    _, rewritten, count = _rewrite(IntAnd(), args, "bool_and_to_logical_and")
    assert count == 0
    assert aten.__and__.Tensor in _targets(rewritten)


def test_bool_and_inside_a_while_loop_body_is_rewritten():
    from torch._higher_order_ops.while_loop import while_loop

    class Loop(nn.Module):
        def forward(self, x, mask):
            def cond(i, y):
                return i < 3

            def body(i, y):
                keep = (y > 0) & mask
                return i + 1, torch.where(keep, y * 0.5, y + 1.0)

            return while_loop(cond, body, (torch.zeros((), dtype=torch.int64), x))[1]

    args = (torch.randn(2, 6), torch.rand(2, 6) > 0.3)
    module = Loop()
    _, rewritten, count = _rewrite(module, args, "bool_and_to_logical_and")
    assert count == 1
    assert aten.__and__.Tensor not in _targets(rewritten)
    _assert_matches_eager(module, rewritten, args, rtol=0)


# -- fold_batchnorm ------------------------------------------------------------------------------------


class ConvBN(nn.Module):
    def __init__(self, bias, kernel=3, stride=1, affine=True):
        super().__init__()
        self.conv = nn.Conv2d(4, 6, kernel, stride=stride, padding=kernel // 2, bias=bias)
        self.bn = nn.BatchNorm2d(6, affine=affine)
        with torch.no_grad():  # non-trivial statistics, as after training
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.3, 2.0)
            if affine:
                self.bn.weight.uniform_(0.5, 1.5)
                self.bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize("bias", [False, True], ids=["conv_without_bias", "conv_with_bias"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_affine"])
def test_fold_batchnorm_makes_one_conv_matching_eager(bias, affine):
    torch.manual_seed(0)
    module, args = ConvBN(bias, affine=affine), (torch.randn(2, 4, 10, 10),)
    _, rewritten, count = _rewrite(module, args, "fold_batchnorm")
    assert count == 1
    targets = _targets(rewritten)
    assert aten.batch_norm.default not in targets and targets.count(aten.conv2d.default) == 1
    _assert_matches_eager(module, rewritten, args)


def test_fold_batchnorm_with_dynamic_batch():
    torch.manual_seed(0)
    module, args = ConvBN(True, kernel=1, stride=2), (torch.randn(3, 4, 8, 8),)
    dims = ({0: torch.export.Dim("batch", min=1, max=64)},)
    _, rewritten, count = _rewrite(module, args, "fold_batchnorm", dims)
    assert count == 1
    _assert_matches_eager(module, rewritten, (torch.randn(5, 4, 8, 8),))


def test_fold_batchnorm_matches_core_aten_native_batch_norm():
    torch.manual_seed(0)
    module, args = ConvBN(False), (torch.randn(1, 4, 6, 6),)
    program = _export(module, args).run_decompositions()
    assert aten._native_batch_norm_legit_no_training.default in _targets(program)
    rewritten, counts = apply_passes(program, ["fold_batchnorm"])
    assert counts == {"fold_batchnorm": 1}
    assert aten._native_batch_norm_legit_no_training.default not in _targets(rewritten)
    _assert_matches_eager(module, rewritten, args)


def test_fold_batchnorm_skips_batch_norm_not_fed_by_a_convolution_alone():
    class Shared(nn.Module):  # the conv output is also read elsewhere; BN after a ReLU
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.bn1, self.bn2 = nn.BatchNorm2d(4), nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.conv(x)
            return self.bn1(y) + y, self.bn2(torch.relu(x))

    _, rewritten, count = _rewrite(Shared(), (torch.randn(1, 4, 5, 5),), "fold_batchnorm")
    assert count == 0
    assert _targets(rewritten).count(aten.batch_norm.default) == 2


# -- patchify_conv_to_matmul ---------------------------------------------------------------------------


class Conv(nn.Module):
    def __init__(self, cin, cout, kernel, stride, bias=True, tokens=False):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, bias=bias)
        self.tokens = tokens

    def forward(self, x):
        y = self.conv(x)
        return y.flatten(2).transpose(1, 2) if self.tokens else torch.relu(y)


@pytest.mark.parametrize(
    "kernel,stride,shape,bias",
    [
        (16, 16, (2, 3, 64, 64), True),  # ViT patch embedding
        (16, 16, (1, 3, 32, 48), False),
        (1, 2, (2, 8, 12, 12), False),  # ResNet 1x1 stride-2 downsample
        (1, 2, (1, 8, 7, 9), True),  # odd sizes: ceil(H/2) rows
        (2, 2, (1, 4, 9, 7), True),  # rows/columns the conv does not reach are dropped
        ((2, 4), (2, 4), (1, 4, 8, 8), True),  # non-square patches
    ],
    ids=["16x16s16_bias", "16x16s16_nobias", "1x1s2_nobias", "1x1s2_odd_bias", "2x2s2_ragged", "2x4s2x4"],
)
def test_patchify_conv_to_matmul_replaces_the_conv_and_matches_eager(kernel, stride, shape, bias):
    torch.manual_seed(0)
    module, args = Conv(shape[1], 16, kernel, stride, bias), (torch.randn(*shape),)
    _, rewritten, count = _rewrite(module, args, "patchify_conv_to_matmul")
    assert count == 1
    targets = _targets(rewritten)
    assert aten.conv2d.default not in targets
    assert aten.mm.default in targets or aten.matmul.default in targets
    _assert_matches_eager(module, rewritten, args)


@pytest.mark.parametrize("kernel,stride", [(16, 16), (1, 2)])
def test_patchify_with_dynamic_batch_keeps_it_dynamic(kernel, stride):
    torch.manual_seed(0)
    module = Conv(3, 8, kernel, stride, tokens=True)
    dims = ({0: torch.export.Dim("batch", min=1, max=64)},)
    _, rewritten, count = _rewrite(module, (torch.randn(2, 3, 32, 32),), "patchify_conv_to_matmul", dims)
    assert count == 1
    _assert_matches_eager(module, rewritten, (torch.randn(3, 3, 32, 32),))


def test_patchify_skips_a_conv_with_dynamic_spatial_dims():
    module = Conv(3, 8, 4, 4)
    dims = ({2: torch.export.Dim("h", min=2, max=64) * 4},)
    _, rewritten, count = _rewrite(module, (torch.randn(1, 3, 16, 16),), "patchify_conv_to_matmul", dims)
    assert count == 0
    _assert_matches_eager(module, rewritten, (torch.randn(1, 3, 24, 16),))


@pytest.mark.parametrize(
    "conv",
    [nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(4, 8, 3, stride=2), nn.Conv2d(4, 8, 1),
     nn.Conv2d(4, 8, 2, stride=2, padding=1), nn.Conv2d(4, 8, 2, stride=2, groups=2),
     nn.Conv2d(4, 8, 2, stride=1)],
    ids=["3x3s1p1", "3x3s2", "1x1s1", "2x2s2_padded", "2x2s2_grouped", "2x2s1_overlapping"],
)
def test_patchify_leaves_other_convolutions_alone(conv):
    _, rewritten, count = _rewrite(conv, (torch.randn(1, 4, 8, 8),), "patchify_conv_to_matmul")
    assert count == 0
    assert aten.conv2d.default in _targets(rewritten)


# -- stem_conv_to_matmul -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cin,kernel,stride,padding,dilation,shape,bias",
    [
        (3, 7, 2, 3, 1, (1, 3, 48, 64), False),  # ResNet-18's stem (LeRobot ACT, Diffusion Policy)
        (3, 3, 1, 1, 1, (2, 3, 16, 16), True),  # static batch of 2
        (4, 3, 2, 0, 1, (1, 4, 17, 15), True),  # RGB-D, odd sizes, no padding
        (1, (3, 5), (1, 2), (1, 2), 2, (1, 1, 20, 24), True),  # non-square, dilated
    ],
    ids=["resnet_stem", "3x3p1_batch2", "rgbd_3x3s2", "3x5_dilated"],
)
def test_stem_conv_to_matmul_makes_im2col_and_one_matmul_matching_eager(cin, kernel, stride, padding, dilation,
                                                                        shape, bias):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(cin, 16, kernel, stride=stride, padding=padding, dilation=dilation,
                                     bias=bias), nn.ReLU())
    args = (torch.randn(*shape),)
    _, rewritten, count = _rewrite(module, args, "stem_conv_to_matmul")
    assert count == 1
    targets = _targets(rewritten)
    assert aten.conv2d.default not in targets and aten.matmul.default in targets
    assert aten.index.Tensor in targets and aten.im2col.default not in targets  # IREE imports no im2col
    _assert_matches_eager(module, rewritten, args)


@pytest.mark.parametrize(
    "conv,dims",
    [(nn.Conv2d(5, 8, 3, padding=1), None), (nn.Conv2d(3, 8, 1, stride=2), None),
     (nn.Conv2d(3, 9, 3, padding=1, groups=3), None),
     (nn.Conv2d(3, 8, 3, padding=1), ({0: torch.export.Dim("batch", min=1, max=64)},))],
    ids=["5_channels", "1x1", "grouped", "dynamic_batch"],
)
def test_stem_conv_to_matmul_leaves_deep_pointwise_grouped_and_dynamic_batch_convs_alone(conv, dims):
    args = (torch.randn(2, conv.in_channels, 12, 12),)
    _, rewritten, count = _rewrite(conv, args, "stem_conv_to_matmul", dims)
    assert count == 0
    assert aten.conv2d.default in _targets(rewritten)


# -- split_conv_bias -----------------------------------------------------------------------------------


def test_split_conv_bias_leaves_a_3x3_stride_1_convolution_without_bias_plus_an_add_matching_eager():
    torch.manual_seed(0)
    # A ResNet block as LeRobot ACT has it: 3x3 conv + batch norm, folded into a biased conv first.
    module = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                           nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()).eval()
    module[1].running_mean.normal_()
    module[1].running_var.uniform_(0.5, 2.0)
    args = (torch.randn(1, 8, 12, 14),)
    program = _export(module, args)
    rewritten, counts = apply_passes(program, ["fold_batchnorm", "split_conv_bias"])
    assert counts == {"fold_batchnorm": 1, "split_conv_bias": 2}
    convs = [n for n in rewritten.graph.nodes if n.op == "call_function" and "conv" in str(n.target)]
    assert len(convs) == 2 and all(n.args[2] is None for n in convs), [n.args[:3] for n in convs]
    _assert_matches_eager(module, rewritten, args)


@pytest.mark.parametrize("conv", [nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.Conv2d(8, 8, 3, dilation=2),
                                  nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1, bias=False),
                                  nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.Conv2d(8, 8, (3, 5), padding=1)],
                         ids=["stride_2", "dilated", "1x1", "no_bias", "grouped", "3x5"])
def test_split_conv_bias_leaves_convolutions_winograd_does_not_take_alone(conv):
    args = (torch.randn(1, 8, 12, 12),)
    _, rewritten, count = _rewrite(conv, args, "split_conv_bias")
    assert count == 0


def test_patchify_takes_a_patch_embedding_before_the_stem_rewrite():
    torch.manual_seed(0)
    module, args = Conv(3, 16, 16, 16), (torch.randn(1, 3, 32, 32),)
    program = _export(module, args)
    rewritten, counts = apply_passes(program, ["patchify_conv_to_matmul", "stem_conv_to_matmul"])
    assert counts == {"patchify_conv_to_matmul": 1, "stem_conv_to_matmul": 0}
    _assert_matches_eager(module, rewritten, args)


# -- conv1d_to_matmul, conv_transpose1d_to_matmul --------------------------------------------------------


def _assert_conv_becomes_one_matmul(conv, shape, pass_name, op):
    """`pass_name` rewrites the one conv (followed by an activation) into a matmul: no `op` or
    aten.convolution left, and the program matches eager."""
    torch.manual_seed(0)
    module, args = nn.Sequential(conv, nn.Mish()), (torch.randn(*shape),)
    _, rewritten, count = _rewrite(module, args, pass_name)
    assert count == 1
    targets = _targets(rewritten)
    assert op not in targets and aten.convolution.default not in targets
    assert aten.matmul.default in targets
    _assert_matches_eager(module, rewritten, args)


@pytest.mark.parametrize(
    "conv,shape",
    [
        (nn.Conv1d(32, 48, 5, padding=2), (1, 32, 16)),  # Diffusion Policy's U-Net block (kernel 5, 'same')
        (nn.Conv1d(16, 24, 3, stride=2, padding=1), (2, 16, 9)),  # its downsampling conv, odd length, batch 2
        (nn.Conv1d(8, 8, 3, dilation=2, bias=False), (1, 8, 12)),  # dilated, no padding, no bias
        (nn.Conv1d(8, 4, 4, padding=3, stride=3), (1, 8, 10)),  # stride > 1 with taps the stride skips
    ],
    ids=["k5_same", "k3s2_batch2", "k3_dilated_nobias", "k4s3_padded"],
)
def test_conv1d_to_matmul_makes_shifted_columns_and_one_matmul_matching_eager(conv, shape):
    _assert_conv_becomes_one_matmul(conv, shape, "conv1d_to_matmul", aten.conv1d.default)


@pytest.mark.parametrize(
    "conv,shape,dims",
    [(nn.Conv1d(8, 8, 3, padding=1), (2, 8, 16), ({0: torch.export.Dim("batch", min=1, max=64)},)),
     (nn.Conv1d(8, 8, 3, padding=1), (1, 8, 128), None),  # longer than CONV1D_MAX_LENGTH: columns too big
     (nn.Conv1d(8, 8, 3, padding=1, groups=2), (1, 8, 16), None),
     (nn.Conv1d(8, 8, 1), (1, 8, 16), None),  # pointwise: already a matmul for IREE
     (nn.Conv1d(8, 8, 3, padding="same"), (1, 8, 16), None)],
    ids=["dynamic_batch", "long_sequence", "grouped", "pointwise", "string_padding"],
)
def test_conv1d_to_matmul_leaves_dynamic_long_grouped_and_pointwise_convs_alone(conv, shape, dims):
    _, rewritten, count = _rewrite(conv, (torch.randn(*shape),), "conv1d_to_matmul", dims)
    assert count == 0
    _assert_matches_eager(conv, rewritten, (torch.randn(*shape),))


@pytest.mark.parametrize(
    "conv,shape",
    [
        (nn.ConvTranspose1d(32, 32, 4, stride=2, padding=1), (1, 32, 8)),  # Diffusion Policy's upsampling
        (nn.ConvTranspose1d(16, 8, 3, stride=1, padding=1, bias=False), (2, 16, 5)),
        (nn.ConvTranspose1d(8, 12, 5, stride=3, padding=0), (1, 8, 4)),  # taps overlap nothing, no padding
    ],
    ids=["k4s2p1_unet", "k3s1_nobias_batch2", "k5s3"],
)
def test_conv_transpose1d_to_matmul_makes_one_matmul_and_col2im_matching_eager(conv, shape):
    _assert_conv_becomes_one_matmul(conv, shape, "conv_transpose1d_to_matmul", aten.conv_transpose1d.default)


@pytest.mark.parametrize(
    "conv,dims",
    [(nn.ConvTranspose1d(8, 8, 4, stride=2, padding=1), ({0: torch.export.Dim("batch", min=1, max=64)},)),
     (nn.ConvTranspose1d(8, 8, 4, stride=2, padding=1, output_padding=1), None),
     (nn.ConvTranspose1d(8, 8, 3, dilation=2), None),
     (nn.ConvTranspose1d(8, 8, 4, stride=2, groups=2), None)],
    ids=["dynamic_batch", "output_padding", "dilated", "grouped"],
)
def test_conv_transpose1d_to_matmul_leaves_dynamic_padded_dilated_and_grouped_convs_alone(conv, dims):
    args = (torch.randn(2, 8, 8),)
    _, rewritten, count = _rewrite(conv, args, "conv_transpose1d_to_matmul", dims)
    assert count == 0
    _assert_matches_eager(conv, rewritten, args)


# -- attention_to_sdpa ---------------------------------------------------------------------------------


class Attention(nn.Module):
    """Decomposed multi-head attention over x[B, L, D] with an optional mask input, in several spellings."""

    def __init__(self, mask, spelling="div", d=32, heads=4):
        super().__init__()
        self.mask, self.spelling, self.heads = mask, spelling, heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, m=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        hd = d // self.heads
        if self.spelling == "div":
            s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(hd)
        elif self.spelling == "mul":
            s = (q @ k.transpose(2, 3)) * hd ** -0.5
        else:  # "mask_then_scale": mask first, scale after
            s = q @ k.permute(0, 1, 3, 2)
        if self.mask == "bool_masked_fill":
            s = s.masked_fill(~m[:, None], float("-inf"))
        elif self.mask == "bool_where":
            s = torch.where(m[:, None], s, torch.finfo(s.dtype).min)
        elif self.mask == "float":
            s = s + m[:, None]
        elif self.mask == "bool_and":  # LeRobot style: pad & causal, filled with a finite big negative
            causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
            s = torch.where((causal[None] & m[:, None, :])[:, None], s, -2.3819763e38)
        if self.spelling == "mask_then_scale":
            s = s * hd ** -0.5
        p = F.dropout(torch.softmax(s, dim=-1), 0.1, self.training)
        return self.out((p @ v).transpose(1, 2).reshape(b, n, d))


def _mask(kind, b, n):
    g = torch.Generator().manual_seed(1)
    if kind == "float":
        return torch.randn(b, n, n, generator=g)
    if kind == "bool_and":
        keep = torch.ones(b, n, dtype=torch.bool)
        keep[:, -2:] = False
        return keep
    m = torch.rand(b, n, n, generator=g) > 0.4
    m[..., 0] = True  # no fully-masked row (eager gives NaN there with -inf)
    return m


@pytest.mark.parametrize(
    "mask,spelling",
    [("none", "div"), ("none", "mul"), ("bool_masked_fill", "div"), ("bool_where", "mul"), ("float", "div"),
     ("float", "mask_then_scale"), ("bool_masked_fill", "mask_then_scale"), ("bool_and", "div")],
)
def test_attention_to_sdpa_makes_one_sdpa_matching_eager(mask, spelling):
    torch.manual_seed(0)
    module = Attention(mask, spelling)
    x = torch.randn(2, 8, 32)
    args = (x,) if mask == "none" else (x, _mask(mask, 2, 8))
    _, rewritten, count = _rewrite(module, args, "attention_to_sdpa")
    assert count == 1
    targets = _targets(rewritten)
    assert aten.scaled_dot_product_attention.default in targets
    assert aten.softmax.int not in targets and aten.matmul.default not in targets
    _assert_matches_eager(module, rewritten, args)


def test_attention_to_sdpa_with_dynamic_sequence_length():
    torch.manual_seed(0)
    module = Attention("bool_masked_fill")
    seq = torch.export.Dim("seq", min=2, max=256)
    dims = ({1: seq}, {1: seq, 2: seq})
    args = (torch.randn(1, 8, 32), _mask("bool_masked_fill", 1, 8))
    _, rewritten, count = _rewrite(module, args, "attention_to_sdpa", dims)
    assert count == 1
    _assert_matches_eager(module, rewritten, (torch.randn(1, 13, 32), _mask("bool_masked_fill", 1, 13)))


def test_attention_whose_weights_are_also_returned_is_left_alone():
    class Both(nn.Module):
        def forward(self, q, k, v):
            p = torch.softmax(q @ k.transpose(-2, -1) * 0.5, dim=-1)
            return p @ v, p

    args = tuple(torch.randn(1, 2, 4, 8) for _ in range(3))
    _, rewritten, count = _rewrite(Both(), args, "attention_to_sdpa")
    assert count == 0
    assert aten.softmax.int in _targets(rewritten)


def test_softmax_over_a_non_last_dim_is_left_alone():
    class Cols(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v

    args = tuple(torch.randn(1, 2, 4, 8) for _ in range(3))
    _, _, count = _rewrite(Cols(), args, "attention_to_sdpa")
    assert count == 0


# -- decompose_attention ---------------------------------------------------------------------------------


class Sdpa(nn.Module):
    def __init__(self, mask, scale=None, causal=False):
        super().__init__()
        self.mask, self.scale, self.causal = mask, scale, causal
        self.qkv = nn.Linear(32, 96)

    def forward(self, x, keep):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        mask = None
        if self.mask == "float":
            mask = ((1.0 - keep.float()) * -1e9).reshape(b, 1, 1, n)
        elif self.mask == "bool":
            mask = keep.reshape(b, 1, 1, n)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, is_causal=self.causal)


@pytest.mark.parametrize("mask", [None, "float", "bool"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_decompose_attention_replaces_sdpa_by_matmul_softmax_matmul_matching_eager(mask, scale):
    torch.manual_seed(0)
    module = Sdpa(mask, scale).eval()
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[0, -4:] = False
    args = (torch.randn(2, 12, 32), keep)
    _, rewritten, count = _rewrite(module, args, "decompose_attention")
    assert count == 1
    targets = _targets(rewritten)
    assert aten.scaled_dot_product_attention.default not in targets
    assert targets.count(aten.matmul.default) == 2 and aten._softmax.default in targets
    _assert_matches_eager(module, rewritten, args)


def test_decompose_attention_with_dynamic_sequence_length():
    torch.manual_seed(0)
    module = Sdpa("float").eval()
    seq = torch.export.Dim("seq", min=2, max=64)
    args = (torch.randn(1, 16, 32), torch.ones(1, 16, dtype=torch.bool))
    _, rewritten, count = _rewrite(module, args, "decompose_attention", dynamic_shapes=({1: seq}, {1: seq}))
    assert count == 1
    longer = (torch.randn(1, 40, 32), torch.ones(1, 40, dtype=torch.bool))
    _assert_matches_eager(module, rewritten, longer)


def test_decompose_attention_leaves_causal_attention_fused():
    module = Sdpa(None, causal=True).eval()
    _, rewritten, count = _rewrite(module, (torch.randn(1, 8, 32), torch.ones(1, 8, dtype=torch.bool)),
                                   "decompose_attention")
    assert count == 0 and aten.scaled_dot_product_attention.default in _targets(rewritten)


# -- fence_head_split_projections -----------------------------------------------------------------------


def _barriers(program):
    return [n for m in program.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function" and "optimization_barrier" in str(n.target)]


class CrossAttention(nn.Module):
    """torch's own multi_head_attention_forward with distinct query, key and value (ACT's encoder and decoder):
    three projections, each `linear → view [L, B*H, d] → transpose(0, 1)`."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads)

    def forward(self, x, pos):
        qk = x + pos
        return self.attn(qk, qk, x, need_weights=False)[0]


def test_head_split_projections_are_fenced_on_both_sides_and_match_eager():
    module, args = CrossAttention(), (torch.randn(10, 1, 32), torch.randn(10, 1, 32))
    _, rewritten, count = _rewrite(module, args, "fence_head_split_projections")
    assert count == 3  # q, k, v
    fences = _barriers(rewritten)
    # One after each projection, one before: q and k read the same `x + pos` (one shared fence), v reads x.
    assert len(fences) == 3 + 2
    projections = [n for n in rewritten.graph.nodes if n.target is aten.linear.default]
    for p in projections[:3]:
        assert "optimization_barrier" in str(p.args[0].target)
        if any(u.target is aten.view.default for u in p.users):
            pytest.fail(f"{p.name} still feeds its head split directly")
    _assert_matches_eager(module, rewritten, args, rtol=0)


def test_packed_qkv_head_split_is_fenced():
    module, args = Attention(None), (torch.randn(2, 6, 32),)
    _, rewritten, count = _rewrite(module, args, "fence_head_split_projections")
    assert count == 1  # the packed qkv projection; the output projection reads merged heads and stays as it is
    assert len(_barriers(rewritten)) == 2
    _assert_matches_eager(module, rewritten, args, rtol=0)


class NotASplit(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, y):
        flat = self.a(x).reshape(2, 4, 4)             # split, no transpose
        moved = self.b(x).transpose(0, 1)             # transpose, no split
        scores = torch.matmul(x, y.transpose(0, 1))   # two activations
        return flat.sum() + moved.sum() + scores.sum()


def test_projections_without_a_head_split_and_activation_matmuls_are_left_alone():
    _, rewritten, count = _rewrite(NotASplit(), (torch.randn(2, 16), torch.randn(2, 16)),
                                   "fence_head_split_projections")
    assert count == 0 and not _barriers(rewritten)


def test_head_split_with_a_dynamic_dim_is_left_unfenced():
    module, args = Attention(None), (torch.randn(2, 6, 32),)
    batch = torch.export.Dim("batch", min=1, max=64)
    _, rewritten, count = _rewrite(module, args, "fence_head_split_projections", dynamic_shapes=({0: batch},))
    assert count == 0 and not _barriers(rewritten)


def test_fenced_projection_imports_as_optimization_barriers(tmp_path):
    from iree.turbine import aot

    from dsa.stages import importer_fixes

    importer_fixes.apply()
    _, rewritten, _ = _rewrite(CrossAttention(), (torch.randn(10, 1, 32), torch.randn(10, 1, 32)),
                               "fence_head_split_projections")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mlir = str(aot.export(rewritten).mlir_module)
    assert mlir.count("util.optimization_barrier") == 5
    assert 'torch.operator "' not in mlir


# -- blocked_softmax -------------------------------------------------------------------------------------


class MaskedSoftmax(nn.Module):
    """Scores scaled and masked with a finite fill (as LeRobot's PI0 does), softmax over the last dim."""

    def forward(self, scores, keep):
        return torch.softmax(torch.where(keep, scores * 0.25, -2.3819763e38), dim=-1)


def _masked_softmax_args(rows, length, batch=2):
    scores, keep = torch.randn(batch, 4, rows, length) * 8, torch.rand(batch, 1, rows, length) > 0.3
    keep[0, 0, 0] = False  # a fully-masked row: every score the same finite fill, uniform weights in eager
    return scores, keep


@pytest.mark.parametrize("length", [128, 150, 571])  # a whole number of blocks, and two rows with a rest
def test_blocked_softmax_reduces_over_blocks_of_16_and_the_rest_and_matches_eager_with_masked_rows(length):
    module, args = MaskedSoftmax(), _masked_softmax_args(7, length)
    program, rewritten, count = _rewrite(module, args, "blocked_softmax")
    assert count == 1
    targets = _targets(rewritten)
    assert aten._softmax.default not in targets and aten.softmax.int not in targets
    assert (aten.slice.Tensor in targets) == (length % 16 != 0)  # the rest of the row, reduced apart
    unflattens = [n for n in rewritten.graph.nodes if n.target is aten.unflatten.int]
    assert [n.args[2] for n in unflattens] == [[length // 16, 16]] * 2
    with torch.no_grad():
        got, want = rewritten.module()(*args), module(*args)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[0, 0, 0], torch.full((length,), 1.0 / length), rtol=1e-5, atol=0)


class MaskedScores(nn.Module):
    """q @ kᵀ, scaled and masked, then the softmax: the score matmul is what the rewrite fences."""

    def forward(self, q, k, keep):
        return torch.softmax(torch.where(keep, q @ k.transpose(-1, -2) * 0.125, -1e9), dim=-1)


def test_blocked_softmax_fences_a_scaled_and_masked_score_matmul_of_static_shapes_only():
    """With static shapes the score matmul's result is fenced: its data-tiled dispatch then does not take the
    scale and mask as an epilogue in the packed layout, where IREE 3.13's codegen exceeds its vector and
    stack limits (SmolVLA's attention at x86-64-v4 with data tiling: "One or more operations with large
    vector sizes"). A dynamic dim cannot pass the barrier, and a dynamic module is not data-tiled."""
    module = MaskedScores()
    args = (torch.randn(2, 4, 9, 8), torch.randn(2, 4, 140, 8), torch.rand(2, 1, 9, 140) > 0.3)
    _, rewritten, count = _rewrite(module, args, "blocked_softmax")
    assert count == 1
    [barrier] = _barriers(rewritten)
    assert barrier.args[0].target in (aten.matmul.default, aten.bmm.default)
    with torch.no_grad():
        torch.testing.assert_close(rewritten.module()(*args), module(*args), rtol=1e-5, atol=1e-7)

    batch = torch.export.Dim("batch", min=1, max=8)
    _, rewritten, count = _rewrite(module, args, "blocked_softmax", ({0: batch}, {0: batch}, {0: batch}))
    assert count == 1 and not _barriers(rewritten)


class PlainScores(nn.Module):
    def forward(self, q, k):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1)


def test_blocked_softmax_reading_a_matmul_directly_is_not_fenced():
    """No steps between the matmul and the softmax: nothing could become the matmul's epilogue."""
    _, rewritten, count = _rewrite(PlainScores(), (torch.randn(2, 9, 8), torch.randn(2, 140, 8)), "blocked_softmax")
    assert count == 1 and not _barriers(rewritten)


def test_blocked_softmax_with_dynamic_leading_dims():
    module, args = MaskedSoftmax(), _masked_softmax_args(5, 150, batch=3)
    batch, rows = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("rows", min=2, max=64)
    _, rewritten, count = _rewrite(module, args, "blocked_softmax", ({0: batch, 2: rows}, {0: batch, 2: rows}))
    assert count == 1
    other = _masked_softmax_args(9, 150, batch=2)
    with torch.no_grad():
        torch.testing.assert_close(rewritten.module()(*other), module(*other), rtol=1e-5, atol=1e-7)


class OtherSoftmaxes(nn.Module):
    def forward(self, x):
        short = torch.softmax(x[..., :100], dim=-1)        # a row under SOFTMAX_MIN_LENGTH
        columns = torch.softmax(x, dim=-2)                 # not the last dim
        half = torch.softmax(x.to(torch.bfloat16), dim=-1).float()  # half precision: eager sums in float
        wide = torch.softmax(x, dim=-1, dtype=torch.float64).float()  # a result in another dtype
        return short.sum() + columns.sum() + half.sum() + wide.sum()


def test_blocked_softmax_leaves_short_rows_other_dims_and_other_dtypes_alone():
    _, _, count = _rewrite(OtherSoftmaxes(), (torch.randn(2, 8, 160),), "blocked_softmax")
    assert count == 0


def test_blocked_softmax_with_a_dynamic_row_length_is_left_alone():
    length = torch.export.Dim("length", min=128, max=512)
    _, _, count = _rewrite(nn.Softmax(dim=-1), (torch.randn(2, 150),), "blocked_softmax", ({1: length},))
    assert count == 0


def test_blocked_softmax_of_rows_with_a_rest_compiles_and_runs_like_eager(tmp_path):
    module, args = MaskedSoftmax(), _masked_softmax_args(7, 150)
    _, rewritten, count = _rewrite(module, args, "blocked_softmax")
    assert count == 1
    mlir = _compile(tmp_path, rewritten, module)
    assert "torch.aten.unflatten" in mlir and "torch.aten._softmax" not in mlir and "torch.aten.softmax" not in mlir
    got = _run(tmp_path, *(a.numpy() for a in args))
    with torch.no_grad():
        want = module(*args).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got[0, 0, 0], np.full(150, 1 / 150, np.float32), rtol=1e-5)


# -- end to end ----------------------------------------------------------------------------------------


def _compile(tmp_path, rewritten, module) -> str:
    """Imports the program with aot.export and compiles it for x86-64-v3 into tmp_path (m.vmfb, p.irpa)."""
    from iree.compiler.tools.binaries import find_tool
    from iree.turbine import aot

    from dsa.stages import importer_fixes

    importer_fixes.apply()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mlir = str(aot.export(rewritten).mlir_module)
    assert 'torch.operator "' not in mlir
    (tmp_path / "m.mlir").write_text(mlir)
    aot.save_module_parameters(str(tmp_path / "p.irpa"), module)
    flags = ["--iree-input-type=torch", "--iree-hal-target-device=local",
             "--iree-hal-local-target-device-backends=llvm-cpu",
             "--iree-llvmcpu-target-triple=x86_64-unknown-linux-gnu", "--iree-llvmcpu-target-cpu=x86-64-v3",
             "--iree-vm-bytecode-module-strip-source-map=true", "--iree-llvmcpu-debug-symbols=false"]
    proc = subprocess.run([find_tool("iree-compile"), str(tmp_path / "m.mlir"), *flags, "-o",
                           str(tmp_path / "m.vmfb")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return mlir


def _run(tmp_path, *args):
    """Runs the module _compile wrote, with its parameters, on numpy arguments."""
    import iree.runtime as rt

    config = rt.Config("local-task")
    index = rt.ParameterIndex()
    index.load(str(tmp_path / "p.irpa"))
    params = rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope="model"))
    vm_module = rt.VmModule.copy_buffer(config.vm_instance, (tmp_path / "m.vmfb").read_bytes())
    context = rt.SystemContext(vm_modules=[params, vm_module], config=config)
    return context.modules.module["main"](*args).to_host()


class Policy(nn.Module):
    """Every pattern once: 3-channel stem conv + BN, a biased 3x3 conv, 1x1 stride-2 conv, patch embedding,
    bool-& masked attention (whose softmax rows are long enough to be blocked)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.body = nn.Conv2d(8, 8, 3, padding=1)
        self.down = nn.Conv2d(8, 16, 1, stride=2)
        self.patch = nn.Conv2d(16, 32, 4, stride=4)
        self.attn = Attention("bool_and", "div")
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, image, keep):
        y = self.patch(self.down(self.body(torch.relu(self.bn(self.stem(image))))))
        tokens = y.flatten(2).transpose(1, 2)
        return self.attn(tokens, keep)


def test_rewritten_program_imports_compiles_and_runs_like_eager(tmp_path):
    torch.manual_seed(0)
    module = Policy().eval()
    # 96x96 → 12x12 = 144 tokens: the attention's softmax rows are long enough for blocked_softmax.
    image, keep = torch.randn(1, 3, 96, 96), torch.ones(1, 144, dtype=torch.bool)
    keep[:, -3:] = False
    with torch.no_grad():
        want = module(image, keep).numpy()
    program = _export(module, (image, keep))
    rewritten, counts = apply_passes(program, list(PASSES))
    # attention_to_sdpa makes one SDPA; decompose_attention (its inverse, later in the order) takes it apart.
    # The 3-channel stem (its batch norm folded first) becomes im2col + matmul; the 3x3 body conv's bias is
    # split off; the packed qkv projection is fenced from its head split; the decomposed softmax is blocked.
    assert counts == {"bool_and_to_logical_and": 1, "fold_batchnorm": 1, "patchify_conv_to_matmul": 2,
                      "stem_conv_to_matmul": 1, "split_conv_bias": 1, "conv1d_to_matmul": 0,
                      "conv_transpose1d_to_matmul": 0, "attention_to_sdpa": 1, "decompose_attention": 1,
                      "fence_head_split_projections": 1, "blocked_softmax": 1}

    mlir = _compile(tmp_path, rewritten, module)
    assert '#flow.parameter.named<"model"::"bn.running_var">' in mlir and "dense_resource" not in mlir
    got = _run(tmp_path, image.numpy(), keep.numpy())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
