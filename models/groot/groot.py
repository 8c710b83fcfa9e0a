"""A scaled-down GR00T-style split policy: a VLM backbone and a DiT flow-matching action head.

After NVIDIA's GR00T N1 ("System 2" / "System 1"), as two separately exported and compiled modules that
a link (rules/private/link.bzl, dsa/stages/link.py) joins by the tensors they exchange:

* **backbone** (`backbone_spec`): a vision tower (ViT: patchify, learned positions, transformer blocks)
  whose image tokens are projected into a small language model's width, the prompt's token embeddings,
  and the language model over [image tokens; prompt tokens]. As GR00T, the features are a middle layer's
  hidden states: the LM keeps only its first `lm_layers` layers (GR00T's `select_layer`). Outputs
  `backbone_features` [1, T, D] float32 and `backbone_mask` [1, T] float32 (1 = real token, 0 = padded
  prompt position), T = image tokens + prompt_len.
* **action head** (`head_spec`): a DiT. The backbone features are layer-normed (GR00T's `vlln`); a state
  encoder turns the robot state into one token, an action encoder turns the noisy action chunk and the
  flow time into tokens; DiT blocks over [state token; action tokens], each adaLN-conditioned on the
  flow time, alternate cross-attention to the backbone features (even blocks) and self-attention (odd
  blocks); an action decoder reads the action tokens back out as a velocity. Flow matching integrates
  from noise (t = 0) to an action chunk (t = 1): x ← x + dt·v(x, t), dt = 1/steps, in a
  `torch._higher_order_ops.while_loop` whose trip count is the runtime input `steps` (as π0), so one
  module serves any step count. Cross-attention keys and values of the backbone features are computed
  once, outside the loop.

The head's manifest names the backbone features it expects (`model.config.backbone.tokens`, `.width`);
the link checks that they are what the backbone's export record says it produces.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsa.stages.loops import kept_loop
from dsa.stages.spec import ExportSpec, InputSpec
from models.pi0.pi0 import _MASKED, Attention, Block, Mlp, PatchEncoder, _sinusoid


# ---------------------------------------------------------------------------------------------------------
# Backbone (System 2)


class GrootBackbone(nn.Module):
    """forward(*camera_images, prompt_tokens, prompt_mask) → (backbone_features, backbone_mask)."""

    def __init__(self, view: dict):
        super().__init__()
        cfg = view["model"]["config"]
        inputs = view["inputs"]
        vit, lm = cfg["vision"], cfg["lm"]
        self.camera_names = [c["name"] for c in inputs["cameras"]]
        self.vision = nn.ModuleDict(
            {
                c["name"]: PatchEncoder(c["shape"], vit["patch_size"], vit["width"], vit["depth"], vit["heads"],
                                        vit["mlp_ratio"])
                for c in inputs["cameras"]
            }
        )
        self.width = lm["width"]
        # Vision-to-language projector (a two-layer MLP, as in Eagle/LLaVA-style VLMs).
        self.projector = nn.Sequential(nn.Linear(vit["width"], lm["width"]), nn.GELU(approximate="tanh"),
                                       nn.Linear(lm["width"], lm["width"]))
        self.token_embed = nn.Embedding(inputs["prompt"]["vocab_size"], lm["width"])
        # Only the first `layers` LM layers: GR00T reads a middle layer's hidden states and drops the rest.
        self.layers = nn.ModuleList([Block(lm["width"], lm["heads"], lm["mlp_ratio"]) for _ in range(lm["layers"])])
        self.norm = nn.LayerNorm(lm["width"])

    def forward(self, *args):
        n_cam = len(self.camera_names)
        images = args[:n_cam]
        prompt_tokens, prompt_mask = args[n_cam:]
        b, length = prompt_tokens.shape
        image_tokens = [self.projector(self.vision[name](img)) for name, img in zip(self.camera_names, images)]
        positions = torch.arange(length, dtype=torch.float32)
        prompt = self.token_embed(prompt_tokens) * math.sqrt(self.width) + _sinusoid(positions, self.width)
        tokens = torch.cat(image_tokens + [prompt], dim=1)
        n_img = sum(t.shape[1] for t in image_tokens)
        keep = torch.cat([torch.ones(b, n_img, dtype=torch.float32), prompt_mask.to(torch.float32)], dim=1)
        bias = ((1.0 - keep) * _MASKED).reshape(b, 1, 1, -1)
        for layer in self.layers:
            tokens = layer(tokens, bias)
        return self.norm(tokens), keep


def backbone_tokens(view: dict) -> int:
    """T: image tokens of every camera + the prompt length."""
    vit = view["model"]["config"]["vision"]
    patch = vit["patch_size"]
    n_img = sum((c["shape"][1] // patch) * (c["shape"][2] // patch) for c in view["inputs"]["cameras"])
    return n_img + view["model"]["config"]["prompt_len"]


def backbone_spec(view: dict, dims: dict) -> ExportSpec:
    """The backbone and its example inputs (static prompt length: `model.config.prompt_len`)."""
    inputs = view["inputs"]
    length = view["model"]["config"]["prompt_len"]
    specs = [InputSpec(c["name"], tuple([1] + list(c["shape"])), "float32") for c in inputs["cameras"]]
    specs += [
        InputSpec("prompt_tokens", (1, length), "int64", pad_value=inputs["prompt"]["pad_id"],
                  sample_range=(1, inputs["prompt"]["vocab_size"] - 1),
                  value_domain=(0, inputs["prompt"]["vocab_size"] - 1)),
        InputSpec("prompt_mask", (1, length), "int64", sample_range=(1, 1), value_domain=(0, 1)),
    ]
    return ExportSpec(module=GrootBackbone(view), inputs=specs, outputs=["backbone_features", "backbone_mask"])


# ---------------------------------------------------------------------------------------------------------
# Action head (System 1)


def _modulate(x, shift, scale):
    return x * (1.0 + scale) + shift


class DiTBlock(nn.Module):
    """adaLN-Zero-style DiT block: attention (to the context, or to itself) and an MLP, each modulated by
    shift/scale/gate vectors from the flow-time embedding."""

    def __init__(self, dim: int, context_dim: int, heads: int, mlp_ratio: int, cross: bool):
        super().__init__()
        self.cross = cross
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = Attention(dim, heads)
        if cross:  # keys/values come from the backbone features, in their width
            self.attn.k = nn.Linear(context_dim, dim)
            self.attn.v = nn.Linear(context_dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = Mlp(dim, dim * mlp_ratio)
        self.ada = nn.Linear(dim, 6 * dim)

    def context_kv(self, context):
        return self.attn.split(self.attn.k(context)), self.attn.split(self.attn.v(context))

    def forward(self, x, temb, kv, bias):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(temb)).unsqueeze(1).chunk(6, dim=-1)
        h = _modulate(self.norm1(x), shift1, scale1)
        q = self.attn.split(self.attn.q(h))
        if self.cross:
            k, v = kv
            out = self.attn.attend(q, k, v, bias)
        else:
            out = self.attn.attend(q, self.attn.split(self.attn.k(h)), self.attn.split(self.attn.v(h)), None)
        x = x + gate1 * out
        return x + gate2 * self.mlp(_modulate(self.norm2(x), shift2, scale2))


class GrootActionHead(nn.Module):
    """forward(backbone_features, backbone_mask, state, noise, steps) → action chunk [1, horizon, action_dim]."""

    def __init__(self, view: dict):
        super().__init__()
        cfg = view["model"]["config"]
        dit, backbone = cfg["dit"], cfg["backbone"]
        width, heads, ratio = dit["width"], dit["heads"], dit["mlp_ratio"]
        action_dim = view["outputs"]["action"]["dim"]
        self.width = width
        self.vl_norm = nn.LayerNorm(backbone["width"])
        self.state_encoder = nn.Sequential(nn.Linear(view["inputs"]["state"]["dim"], width), nn.SiLU(),
                                           nn.Linear(width, width))
        # Action encoder: [noisy action embedding, time embedding] → token (GR00T's MultiEmbodimentActionEncoder).
        self.action_in = nn.Linear(action_dim, width)
        self.action_time = nn.Sequential(nn.Linear(2 * width, width), nn.SiLU(), nn.Linear(width, width))
        self.pos = nn.Parameter(torch.zeros(1, view["chunk_size"], width))
        self.time_mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.blocks = nn.ModuleList(
            [DiTBlock(width, backbone["width"], heads, ratio, cross=(i % 2 == 0)) for i in range(dit["depth"])]
        )
        self.norm_out = nn.LayerNorm(width, elementwise_affine=False)
        self.ada_out = nn.Linear(width, 2 * width)
        self.action_decoder = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, action_dim))

    def velocity(self, x, t, state_token, kvs, bias):
        """v(x, t): x [1, horizon, action_dim], t a 0-d float tensor in [0, 1)."""
        b, n, _ = x.shape
        # Sinusoidal embedding of the discretised time (GR00T: t * 1000).
        time = _sinusoid((t * 1000.0).reshape(1), self.width).reshape(1, self.width)
        temb = self.time_mlp(time)
        tokens = self.action_time(torch.cat([self.action_in(x), time.unsqueeze(1).expand(b, n, self.width)], dim=-1))
        h = torch.cat([state_token, tokens + self.pos], dim=1)
        for block, kv in zip(self.blocks, kvs):
            h = block(h, temb, kv, bias)
        shift, scale = self.ada_out(F.silu(temb)).unsqueeze(1).chunk(2, dim=-1)
        h = _modulate(self.norm_out(h), shift, scale)
        return self.action_decoder(h[:, 1:])

    def forward(self, backbone_features, backbone_mask, state, noise, steps):
        b = noise.shape[0]
        context = self.vl_norm(backbone_features)
        # Loop invariants: the context's keys/values per cross-attention block, the state token, the bias.
        kvs = [block.context_kv(context) if block.cross else None for block in self.blocks]
        bias = ((1.0 - backbone_mask) * _MASKED).reshape(b, 1, 1, -1)
        state_token = self.state_encoder(state).unsqueeze(1)
        dt = 1.0 / steps.to(torch.float32)

        def step(i, x):
            t = i.to(torch.float32) * dt
            return x + dt * self.velocity(x, t, state_token, kvs, bias)

        return kept_loop(steps, step, noise)


def head_spec(view: dict, dims: dict) -> ExportSpec:
    """The action head and its example inputs; the backbone features' shape comes from
    `model.config.backbone` (tokens, width), which the link checks against the backbone's record."""
    backbone = view["model"]["config"]["backbone"]
    horizon, action_dim = view["chunk_size"], view["outputs"]["action"]["dim"]
    specs = [
        InputSpec("backbone_features", (1, backbone["tokens"], backbone["width"]), "float32"),
        InputSpec("backbone_mask", (1, backbone["tokens"]), "float32"),
        InputSpec("state", (1, view["inputs"]["state"]["dim"]), "float32"),
        InputSpec("noise", (1, horizon, action_dim), "float32"),
        InputSpec("steps", (), "int64", value_range=(1, 1000)),
    ]
    return ExportSpec(module=GrootActionHead(view), inputs=specs, outputs=["action"])
