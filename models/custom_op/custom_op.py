"""A policy with a kernel of its own: how a model that calls a `torch.library` custom op reaches IREE.

The model normalises its hidden state with `dsa_examples::rms_norm`, a custom op. In eager PyTorch the op
runs its registered kernel (here plain torch; in a real model often a fused C++/CUDA kernel); torch.export
keeps it as one opaque op, which IREE's importer does not know and the export refuses, naming the op and
its module path. The model's ExportSpec therefore also gives the op's **decomposition** — the same
computation in ops IREE lowers — and the export applies it before import, so the compiled module computes
the decomposition while eager keeps calling the kernel. models/custom_op/custom_op_test.py checks that the
two agree.

    h      = gelu(rms_norm(state_in(state), weight))       # rms_norm: the custom op
    action = action_out(h) → [B, chunk_size, action_dim]

`export_spec(view, dims)` is the entry point the rule set calls (see dsa.stages.spec.ExportSpec).
"""

from __future__ import annotations

import torch
from torch import nn

from dsa.stages.spec import ExportSpec, InputSpec

EPS = 1e-6


@torch.library.custom_op("dsa_examples::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel eager PyTorch runs (opaque to torch.export)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@rms_norm.register_fake
def _(x, weight, eps):
    # Shapes only: what torch.export needs to trace through the op.
    return torch.empty_like(x)


def rms_norm_decomposition(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What the compiled module computes instead: the same arithmetic in ATen ops IREE lowers."""
    variance = torch.mean(x * x, dim=-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * weight


class RmsNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return rms_norm(x, self.weight, EPS)


class CustomOpPolicy(nn.Module):
    """forward(state) → action chunk [B, chunk_size, action_dim]."""

    def __init__(self, view: dict):
        super().__init__()
        width = view["model"]["config"]["width"]
        self.chunk = view["chunk_size"]
        self.action_dim = view["outputs"]["action"]["dim"]
        self.state_in = nn.Linear(view["inputs"]["state"]["dim"], width)
        self.norm = RmsNorm(width)
        self.action_out = nn.Linear(width, self.chunk * self.action_dim)

    def forward(self, state):
        h = torch.nn.functional.gelu(self.norm(self.state_in(state)))
        return self.action_out(h).reshape(state.shape[0], self.chunk, self.action_dim)


def export_spec(view: dict, dims: dict) -> ExportSpec:
    """Batch 1, static; the custom op's decomposition is applied at export."""
    specs = [InputSpec("state", (1, view["inputs"]["state"]["dim"]), "float32")]
    return ExportSpec(module=CustomOpPolicy(view), inputs=specs, outputs=["actions"],
                      decompositions={torch.ops.dsa_examples.rms_norm.default: rms_norm_decomposition})
