"""A scaled-down π0-architecture policy (vision-language prefix + flow-matching action expert).

Structure, after Physical Intelligence's π0:
  * a ViT-style patch encoder for each camera named in the manifest,
  * prompt token embeddings (with sinusoidal positions, so the prompt length can vary),
  * a bidirectional transformer "prefix" over [image tokens, prompt tokens, robot state],
  * an action expert: a smaller transformer whose tokens are the noisy action chunk, mixed with the
    flow time; in every layer its queries attend jointly to per-layer keys/values of the prefix (computed
    once, outside the loop, like π0's KV cache) and to the action tokens themselves,
  * flow-matching integration from noise (t = 1) to an action chunk (t = 0): x ← x + dt·v(x, t), dt = -1/steps.

The integration is a `torch._higher_order_ops.while_loop` whose trip count is the runtime input `steps`, so
one compiled module serves 1, 5 or 10 flow steps and the compiled IR keeps a loop.

Padded prompt positions (prompt_mask == 0) are excluded from every attention with an additive bias, so a
prompt padded up to a shape bucket gives the same actions as the unpadded prompt.

`export_spec(view, dims)` is the entry point the rule set calls (see `dsa.stages.spec.ExportSpec`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsa.stages.loops import kept_loop
from dsa.stages.spec import ExportSpec, InputSpec

# Finite stand-in for -inf in additive attention masks: exp() underflows to exactly 0 in fp32 and it
# never produces NaN for a row whose keys are all masked.
_MASKED = -1.0e9


def _sinusoid(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of positions (any float tensor) → [..., dim]."""
    half = dim // 2
    freqs = torch.exp(
        torch.arange(half, dtype=torch.float32) * (-math.log(10000.0) / half)
    )
    angles = positions.unsqueeze(-1) * freqs
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Attention(nn.Module):
    """Multi-head attention; keys/values may come from a longer sequence than the queries."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def split(self, x):
        b, n, d = x.shape
        return x.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def attend(self, q, k, v, bias):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        b, h, n, dh = out.shape
        return self.o(out.transpose(1, 2).reshape(b, n, h * dh))

    def forward(self, x, bias=None):
        return self.attend(self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x)), bias)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, dim * mlp_ratio)

    def forward(self, x, bias=None):
        x = x + self.attn(self.norm1(x), bias)
        return x + self.mlp(self.norm2(x))


class PatchEncoder(nn.Module):
    """ViT-style encoder of one camera: patchify, learned positions, transformer blocks."""

    def __init__(self, shape, patch: int, dim: int, depth: int, heads: int, mlp_ratio: int):
        super().__init__()
        c, h, w = shape
        if h % patch or w % patch:
            raise ValueError(f"image {h}x{w} is not divisible by patch_size {patch}")
        self.patchify = nn.Conv2d(c, dim, kernel_size=patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, (h // patch) * (w // patch), dim))
        self.blocks = nn.ModuleList([Block(dim, heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, image):
        x = self.patchify(image).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class ExpertLayer(nn.Module):
    """Action-expert layer: joint attention over [prefix keys/values, action tokens], then an MLP."""

    def __init__(self, prefix_dim: int, dim: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        # Per-layer projections of the prefix into this layer's key/value space (π0's shared attention).
        self.prefix_k = nn.Linear(prefix_dim, dim)
        self.prefix_v = nn.Linear(prefix_dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, dim * mlp_ratio)

    def prefix_kv(self, prefix):
        return self.attn.split(self.prefix_k(prefix)), self.attn.split(self.prefix_v(prefix))

    def forward(self, x, pk, pv, bias):
        h = self.norm1(x)
        q = self.attn.split(self.attn.q(h))
        k = torch.cat([pk, self.attn.split(self.attn.k(h))], dim=2)
        v = torch.cat([pv, self.attn.split(self.attn.v(h))], dim=2)
        x = x + self.attn.attend(q, k, v, bias)
        return x + self.mlp(self.norm2(x))


class ActionExpert(nn.Module):
    def __init__(self, prefix_dim, dim, depth, heads, mlp_ratio, action_dim, chunk_size):
        super().__init__()
        self.dim = dim
        self.action_in = nn.Linear(action_dim, dim)
        # π0's action-time MLP: [action embedding, time embedding] → token.
        self.action_time = nn.Sequential(nn.Linear(2 * dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.pos = nn.Parameter(torch.zeros(1, chunk_size, dim))
        self.layers = nn.ModuleList(
            [ExpertLayer(prefix_dim, dim, heads, mlp_ratio) for _ in range(depth)]
        )
        self.norm = nn.LayerNorm(dim)
        self.action_out = nn.Linear(dim, action_dim)

    def velocity(self, x, t, prefix_kv, bias):
        """v(x, t): x [B, chunk, action_dim], t a 0-d float tensor."""
        b, n, _ = x.shape
        time = _sinusoid(t.reshape(1), self.dim).reshape(1, 1, self.dim).expand(b, n, self.dim)
        h = self.action_time(torch.cat([self.action_in(x), time], dim=-1)) + self.pos
        for layer, (pk, pv) in zip(self.layers, prefix_kv):
            h = layer(h, pk, pv, bias)
        return self.action_out(self.norm(h))


class Pi0Policy(nn.Module):
    """forward(*camera_images, prompt_tokens, prompt_mask, state, noise, steps) → action chunk."""

    def __init__(self, view: dict):
        super().__init__()
        cfg = view["model"]["config"]
        inputs, outputs = view["inputs"], view["outputs"]
        width, heads, ratio = cfg["width"], cfg["heads"], cfg["mlp_ratio"]
        self.camera_names = [c["name"] for c in inputs["cameras"]]
        self.encoders = nn.ModuleDict(
            {
                c["name"]: PatchEncoder(c["shape"], cfg["patch_size"], width, cfg["vit_depth"], heads, ratio)
                for c in inputs["cameras"]
            }
        )
        self.width = width
        self.token_embed = nn.Embedding(inputs["prompt"]["vocab_size"], width)
        self.state_in = nn.Linear(inputs["state"]["dim"], width)
        self.prefix = nn.ModuleList([Block(width, heads, ratio) for _ in range(cfg["depth"])])
        self.prefix_norm = nn.LayerNorm(width)
        self.expert = ActionExpert(
            width, cfg["expert_width"], cfg["expert_depth"], heads, ratio,
            outputs["action"]["dim"], view["chunk_size"],
        )

    def forward(self, *args):
        n_cam = len(self.camera_names)
        images = args[:n_cam]
        prompt_tokens, prompt_mask, state, noise, steps = args[n_cam:]
        b, length = prompt_tokens.shape

        image_tokens = [self.encoders[name](img) for name, img in zip(self.camera_names, images)]
        positions = torch.arange(length, dtype=torch.float32)
        prompt = self.token_embed(prompt_tokens) * math.sqrt(self.width) + _sinusoid(positions, self.width)
        tokens = torch.cat(image_tokens + [prompt, self.state_in(state).unsqueeze(1)], dim=1)

        # Additive key bias [B, 1, 1, keys]: 0 for real tokens, _MASKED for padded prompt positions.
        n_img = sum(t.shape[1] for t in image_tokens)
        keep = torch.cat(
            [
                torch.ones(b, n_img, dtype=torch.float32),
                prompt_mask.to(torch.float32),
                torch.ones(b, 1, dtype=torch.float32),
            ],
            dim=1,
        )
        prefix_bias = ((1.0 - keep) * _MASKED).reshape(b, 1, 1, -1)
        for block in self.prefix:
            tokens = block(tokens, prefix_bias)
        prefix = self.prefix_norm(tokens)

        # Loop invariants: per-layer prefix keys/values and the joint attention bias.
        prefix_kv = [layer.prefix_kv(prefix) for layer in self.expert.layers]
        chunk = noise.shape[1]
        expert_bias = torch.cat(
            [prefix_bias, torch.zeros(b, 1, 1, chunk, dtype=torch.float32)], dim=3
        )
        dt = -1.0 / steps.to(torch.float32)

        def step(i, x):
            t = 1.0 + i.to(torch.float32) * dt
            return x + dt * self.expert.velocity(x, t, prefix_kv, expert_bias)

        return kept_loop(steps, step, noise)


def export_spec(view: dict, dims: dict) -> ExportSpec:
    """Builds the policy and its example inputs for `dims` (dim name → size, e.g. prompt_len)."""
    inputs = view["inputs"]
    prompt_len = dims["prompt_len"]
    chunk, action_dim = view["chunk_size"], view["outputs"]["action"]["dim"]
    specs = [InputSpec(c["name"], tuple([1] + list(c["shape"])), "float32") for c in inputs["cameras"]]
    specs += [
        InputSpec(
            "prompt_tokens", (1, prompt_len), "int64", dynamic={1: "prompt_len"},
            pad_value=inputs["prompt"]["pad_id"], sample_range=(1, inputs["prompt"]["vocab_size"] - 1),
            value_domain=(0, inputs["prompt"]["vocab_size"] - 1),
        ),
        InputSpec("prompt_mask", (1, prompt_len), "int64", dynamic={1: "prompt_len"}, sample_range=(1, 1),
                  value_domain=(0, 1)),
        InputSpec("state", (1, inputs["state"]["dim"]), "float32"),
        InputSpec("noise", (1, chunk, action_dim), "float32"),
        InputSpec("steps", (), "int64", value_range=(1, 1000)),
    ]
    return ExportSpec(
        module=Pi0Policy(view),
        inputs=specs,
        outputs=["actions"],
        dim_minimums={"prompt_len": 2},
    )
