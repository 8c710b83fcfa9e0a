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
