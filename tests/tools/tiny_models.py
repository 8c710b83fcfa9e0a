"""Tiny models for the tools' unit tests (fast to export and compile)."""

import torch
from torch import nn

from dsa.stages.spec import ExportSpec, InputSpec


class Pooled(nn.Module):
    """Mean-pools a variable-length token sequence, mixes in the state, predicts an action."""

    def __init__(self, width=8):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.head = nn.Linear(width + 3, 2)

    def forward(self, tokens, state):
        pooled = self.embed(tokens).mean(dim=1)
        return self.head(torch.cat([pooled, state], dim=-1))


def pooled(view, dims):
    return ExportSpec(
        module=Pooled(view["model"]["config"].get("width", 8)),
        inputs=[
            InputSpec("tokens", (1, dims["seq_len"], 4), "float32", dynamic={1: "seq_len"}),
            InputSpec("state", (1, 3), "float32"),
        ],
        outputs=["action"],
        dim_minimums={"seq_len": 2},
    )


class Eig(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return torch.linalg.eigvals(self.proj(x)).real


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.solver = Eig()

    def forward(self, x):
        return self.solver(x)


def eig(view, dims):
    """A model with an op IREE cannot lower (an eigen-decomposition), nested at module path `solver`."""
    return ExportSpec(module=Wrapper(), inputs=[InputSpec("x", (1, 4, 4), "float32")], outputs=["y"])


class Mlp(nn.Module):
    """A 3-layer MLP wide enough for group-wise quantisation (in_features divisible by 64)."""

    def __init__(self, width=256):
        super().__init__()
        self.fc1 = nn.Linear(64, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def mlp(view, dims):
    return ExportSpec(module=Mlp(), inputs=[InputSpec("x", (4, 64), "float32")], outputs=["y"])


class Resize(nn.Module):
    def forward(self, x):
        return torch.nn.functional.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


class UpsampleHead(nn.Module):
    """A convolution, then a bilinear 2x resize at module path `head.resize`: `aten.upsample_bilinear2d.vec`
    imports into the torch dialect, but IREE has no lowering for it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Sequential()
        self.head.add_module("resize", Resize())

    def forward(self, x):
        return self.head(self.conv(x)) * 2.0


def upsample(view, dims):
    return ExportSpec(module=UpsampleHead(), inputs=[InputSpec("x", (1, 3, 12, 12), "float32")], outputs=["y"])


@torch.library.custom_op("dsa_tiny::softsign", mutates_args=())
def softsign(x: torch.Tensor) -> torch.Tensor:
    """An opaque kernel: torch.export keeps it as one op that IREE's importer does not know."""
    return x / (1.0 + x.abs())


@softsign.register_fake
def _(x):
    return torch.empty_like(x)


class SoftsignMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.Sequential()
        self.act.add_module("softsign", _Softsign())

    def forward(self, x):
        return self.act(self.fc(x))


class _Softsign(nn.Module):
    def forward(self, x):
        return softsign(x)


def custom_op_without_decomposition(view, dims):
    return ExportSpec(module=SoftsignMlp(), inputs=[InputSpec("x", (2, 4), "float32")], outputs=["y"])


def custom_op_with_decomposition(view, dims):
    return ExportSpec(module=SoftsignMlp(), inputs=[InputSpec("x", (2, 4), "float32")], outputs=["y"],
                      decompositions={torch.ops.dsa_tiny.softsign.default: lambda x: x / (1.0 + x.abs())})


class StackHeavy(nn.Module):
    """A layer norm and an MLP over 65 tokens (π0's prefix block at the repository's size): a dispatch of it puts
    a partial tile on the stack, so a compile with a tiny stack-allocation limit fails as real policies do
    without their tuning."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(128)
        self.fc = nn.Linear(128, 512)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(self.norm(x)), approximate="tanh")


def stack_heavy(view, dims):
    return ExportSpec(module=StackHeavy(), inputs=[InputSpec("x", (1, 65, 128), "float32")], outputs=["y"])
