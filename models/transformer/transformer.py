"""The transformer control: a plain 4-layer pre-norm transformer encoder (width 512, 8 heads, 128 tokens).

It is the reference point of the performance work (bench/): a model with nothing but dense matmuls,
attention, layer norm and GELU, on which eager PyTorch, ONNX Runtime and IREE are compared. As a policy
it reads a 128-token prompt and the robot state, and regresses an action chunk from the state token:

    tokens = [prompt embeddings + sinusoidal positions, state token]
    h      = 4 × Block(tokens)                 # padded prompt positions masked out of every attention
    action = Linear(LayerNorm(h[:, -1]))  → [B, chunk_size, action_dim]

The blocks are π0's (models/pi0), so the two models share their attention and MLP code.
`export_spec(view, dims)` is the entry point the rule set calls (see dsa.stages.spec.ExportSpec).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsa.stages.spec import ExportSpec, InputSpec
from models.pi0.pi0 import _MASKED, Block, _sinusoid


class TransformerPolicy(nn.Module):
    """forward(prompt_tokens, prompt_mask, state) → action chunk [B, chunk_size, action_dim]."""

    def __init__(self, view: dict):
        super().__init__()
        cfg = view["model"]["config"]
        inputs = view["inputs"]
        width = cfg["width"]
        self.width = width
        self.chunk = view["chunk_size"]
        self.action_dim = view["outputs"]["action"]["dim"]
        self.token_embed = nn.Embedding(inputs["prompt"]["vocab_size"], width)
        self.state_in = nn.Linear(inputs["state"]["dim"], width)
        self.blocks = nn.ModuleList(
            [Block(width, cfg["heads"], cfg["mlp_ratio"]) for _ in range(cfg["depth"])]
        )
        self.norm = nn.LayerNorm(width)
        self.action_out = nn.Linear(width, self.chunk * self.action_dim)

    def forward(self, prompt_tokens, prompt_mask, state):
        b, length = prompt_tokens.shape
        positions = torch.arange(length, dtype=torch.float32)
        prompt = self.token_embed(prompt_tokens) * math.sqrt(self.width) + _sinusoid(positions, self.width)
        h = torch.cat([prompt, self.state_in(state).unsqueeze(1)], dim=1)
        keep = torch.cat([prompt_mask.to(torch.float32), torch.ones(b, 1, dtype=torch.float32)], dim=1)
        bias = ((1.0 - keep) * _MASKED).reshape(b, 1, 1, -1)
        for block in self.blocks:
            h = block(h, bias)
        return self.action_out(self.norm(h[:, -1])).reshape(b, self.chunk, self.action_dim)


def export_spec(view: dict, dims: dict) -> ExportSpec:
    """The control has no dynamic dims: its prompt length is the manifest's `model.config.seq_len`."""
    inputs = view["inputs"]
    seq = view["model"]["config"]["seq_len"]
    specs = [
        InputSpec("prompt_tokens", (1, seq), "int64", pad_value=inputs["prompt"]["pad_id"],
                  sample_range=(1, inputs["prompt"]["vocab_size"] - 1),
                  value_domain=(0, inputs["prompt"]["vocab_size"] - 1)),
        InputSpec("prompt_mask", (1, seq), "int64", sample_range=(1, 1), value_domain=(0, 1)),
        InputSpec("state", (1, inputs["state"]["dim"]), "float32"),
    ]
    return ExportSpec(module=TransformerPolicy(view), inputs=specs, outputs=["actions"])
