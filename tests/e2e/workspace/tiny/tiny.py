"""A tiny policy for the rules_dsa end-to-end test: an MLP refined in a loop.

forward(tokens, state, steps) → actions [1, chunk_size, action_dim]
  * tokens [1, seq_len, token_dim] (float): seq_len is a dynamic dim, mean-pooled away;
  * state [1, state_dim];
  * steps (0-d int64): how many refinement steps the kept loop (dsa.stages.loops.kept_loop) runs, so one
    compiled module serves any step count.

`export_spec(view, dims)` is the entry point the manifest names (see dsa.stages.spec).
"""

from __future__ import annotations

import torch
from torch import nn

from dsa.stages.loops import kept_loop
from dsa.stages.spec import ExportSpec, InputSpec


class TinyPolicy(nn.Module):
    def __init__(self, view: dict):
        super().__init__()
        cfg = view["model"]["config"]
        hidden = cfg["hidden"]
        self.chunk = view["chunk_size"]
        self.action_dim = view["outputs"]["action"]["dim"]
        flat = self.chunk * self.action_dim
        self.token_in = nn.Linear(cfg["token_dim"], hidden)
        self.state_in = nn.Linear(view["inputs"]["state"]["dim"], hidden)
        self.refine = nn.Sequential(nn.Linear(hidden + flat, hidden), nn.Tanh(), nn.Linear(hidden, flat))

    def forward(self, tokens, state, steps):
        context = self.token_in(tokens).mean(dim=1) + self.state_in(state)  # [1, hidden]
        start = torch.zeros(1, self.chunk * self.action_dim, dtype=torch.float32)

        x = kept_loop(steps, lambda i, x: x + 0.5 * self.refine(torch.cat([context, x], dim=-1)), start)
        return x.reshape(1, self.chunk, self.action_dim)


def export_spec(view: dict, dims: dict) -> ExportSpec:
    seq_len = dims["seq_len"]
    token_dim = view["model"]["config"]["token_dim"]
    return ExportSpec(
        module=TinyPolicy(view),
        inputs=[
            InputSpec("tokens", (1, seq_len, token_dim), "float32", dynamic={1: "seq_len"}),
            InputSpec("state", (1, view["inputs"]["state"]["dim"]), "float32"),
            InputSpec("steps", (), "int64", value_range=(1, 100)),
        ],
        outputs=["actions"],
        dim_minimums={"seq_len": 2},
    )
