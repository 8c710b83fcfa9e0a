"""A tiny policy for the compile cache's tests: a variable-length token sequence (the bucketed dim
`prompt_len`) mean-pooled, mixed with the state, mapped to an action. Exports and compiles in seconds."""

import torch
from torch import nn

from dsa.stages.spec import ExportSpec, InputSpec


class TinyPolicy(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.head = nn.Linear(width + 3, 2)

    def forward(self, tokens, state):
        pooled = self.embed(tokens).mean(dim=1)
        return self.head(torch.cat([pooled, state], dim=-1))


def export_spec(view, dims):
    return ExportSpec(
        module=TinyPolicy(view["model"]["config"]["width"]),
        inputs=[
            InputSpec("tokens", (1, dims["prompt_len"], 4), "float32", dynamic={1: "prompt_len"}),
            InputSpec("state", (1, 3), "float32"),
        ],
        outputs=["action"],
        dim_minimums={"prompt_len": 2},
    )
