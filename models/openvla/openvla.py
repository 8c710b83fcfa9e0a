"""A scaled-down OpenVLA-architecture policy (fused ViT towers → projector → Llama decoder → action tokens).

Structure, after OpenVLA (Kim et al., 2024, `openvla/openvla-7b`):
  * a fused vision backbone: two ViT towers see the same image, a DINOv2-style one (class token, exact
    GELU) and a SigLIP-style one (no class token, tanh GELU); each embeds patches with a Linear over the
    flattened patch (what a stride-p convolution computes), adds learned positions and runs pre-norm
    transformer blocks. Their patch features are concatenated channel-wise (OpenVLA's "dinosiglip"
    fusion; the DINOv2 class token is dropped, as OpenVLA keeps patch tokens only);
  * OpenVLA's fused projector: Linear → GELU → Linear → GELU → Linear into the language model's width;
  * a Llama-style decoder over [image tokens ; prompt tokens]: RMSNorm, rotary position embeddings
    (rotate-half convention, theta 10000), causal multi-head attention without biases, SwiGLU MLP, a final
    RMSNorm and an untied lm_head over the whole vocabulary;
  * greedy decoding of `action_dim` action tokens with a KV cache: one prefill over the prompt computes every
    layer's keys/values, then each further token runs one position through the decoder and appends its
    keys/values. The count is fixed, so the 7 decode steps are unrolled at export;
  * OpenVLA's ActionTokenizer: the action tokens are the LAST 256 ids of the vocabulary; id t stands for
    discretised value d = vocab_size - t in [1, 256], bin index clip(d - 1, 0, 254), and the action is the
    centre of that bin of `np.linspace(-1, 1, 256)` (255 bins, so the two highest bin indices share a
    centre, exactly as in OpenVLA's `decode_token_ids_to_actions`). Actions stay normalised in [-1, 1]:
    OpenVLA un-normalises with per-dataset q01/q99 statistics outside the network, and so does this
    rule set (the runtime's normalisation statistics), so the policy does not model it.

Deviations from OpenVLA, all deliberate and small:
  * decoding picks the argmax over the 256 action ids only (constrained decoding). OpenVLA takes the argmax
    over the whole vocabulary and clips non-action ids to the nearest bin; a trained model puts its mass on
    action ids, but a seeded stand-in checkpoint would not, and every action would be clipped to one bin;
  * RMSNorm stores its gain as an offset from 1 (Gemma's convention: `x̂ · (1 + w)`), so that the rule set's
    seeded checkpoint (1-D parameters ~ N(0, 0.02²)) gives unit gains; a Llama gain g loads as w = g - 1;
  * token embeddings are multiplied by sqrt(width) (Gemma's normaliser), so the seeded checkpoint's
    N(0, 1/width) embeddings are on the image tokens' unit scale; with Llama's unscaled embeddings the
    seeded stand-in all but ignores the token it just decoded and repeats one token 7 times;
  * towers, decoder and vocabulary are scaled down (widths 128/256, 2 + 4 layers, 1024 ids, 64×64 images).

Every projection is an `nn.Linear`, so weight-only quantisation (`quant_scheme`, dsa/stages/quant.py) packs all of
them; embeddings, positions and norms stay float. Prompts are right-padded to a shape bucket with
`prompt_mask` = 0: padded positions are masked out of every attention and the first action token is read
at the last real prompt position, so a padded prompt gives the same tokens as the unpadded one.

`export_spec(view, dims)` is the entry point the rule set calls (see `dsa.stages.spec.ExportSpec`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsa.stages.spec import ExportSpec, InputSpec

# Finite stand-in for -inf in additive attention masks (exp() underflows to exactly 0 in fp32, no NaN).
_MASKED = -1.0e9
# OpenVLA's ActionTokenizer: 256 action ids at the end of the vocabulary, bins over [-1, 1].
N_ACTION_BINS = 256
ACTION_MIN, ACTION_MAX = -1.0, 1.0


def action_bin_centers():
    """The 255 bin centres of OpenVLA's `np.linspace(-1, 1, 256)` bins (float32)."""
    edges = torch.linspace(ACTION_MIN, ACTION_MAX, N_ACTION_BINS, dtype=torch.float64)
    return ((edges[:-1] + edges[1:]) / 2).to(torch.float32)


def tokens_to_actions(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """OpenVLA's `decode_token_ids_to_actions`: action token ids → normalised actions (bin centres).

    Computed with arithmetic rather than a table lookup, so the compiled graph holds no constant table."""
    discretized = vocab_size - token_ids                                   # in [1, 256]
    index = torch.clamp(discretized - 1, 0, N_ACTION_BINS - 2).to(torch.float32)
    width = (ACTION_MAX - ACTION_MIN) / (N_ACTION_BINS - 1)
    return ACTION_MIN + (index + 0.5) * width


# -- vision ------------------------------------------------------------------------------------------------


class VitAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class VitBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int, gelu: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VitAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, dim * mlp_ratio)
        self.fc2 = nn.Linear(dim * mlp_ratio, dim)
        self.gelu = gelu

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate=self.gelu))


class VitTower(nn.Module):
    """One ViT: Linear patch embedding, learned positions, pre-norm blocks; returns the patch features."""

    def __init__(self, shape, patch: int, dim: int, depth: int, heads: int, mlp_ratio: int,
                 cls_token: bool, gelu: str):
        super().__init__()
        c, h, w = shape
        if h % patch or w % patch:
            raise ValueError(f"image {h}x{w} is not divisible by patch_size {patch}")
        self.patch = patch
        self.n_patches = (h // patch) * (w // patch)
        self.patch_embed = nn.Linear(c * patch * patch, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if cls_token else None
        self.pos_embed = nn.Parameter(torch.zeros(1, self.n_patches + int(cls_token), dim))
        self.blocks = nn.ModuleList([VitBlock(dim, heads, mlp_ratio, gelu) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, image):
        b, c, h, w = image.shape
        p = self.patch
        # [B, C, H, W] → [B, patches, C·p·p], each patch flattened in a stride-p convolution's (c, y, x) order.
        patches = image.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_embed(patches.reshape(b, self.n_patches, c * p * p))
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(b, -1, -1), x], dim=1)
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return x[:, 1:] if self.cls_token is not None else x


class Projector(nn.Module):
    """OpenVLA's fused-backbone projector (`FusedMLPProjector`)."""

    def __init__(self, vision_dim: int, llm_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(vision_dim, 4 * vision_dim)
        self.fc2 = nn.Linear(4 * vision_dim, llm_dim)
        self.fc3 = nn.Linear(llm_dim, llm_dim)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


# -- language model --------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm with the gain stored as an offset from 1 (see the module docstring)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def rotary(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin [..., N, head_dim] for float positions [..., N] (Llama's rotate-half layout)."""
    inv_freq = torch.exp(torch.arange(0, head_dim, 2, dtype=torch.float32) * (-math.log(theta) / head_dim))
    angles = positions.unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cos(angles), torch.sin(angles)


def apply_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def split(self, x):
        b, n, d = x.shape
        return x.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x, cos, sin, bias, cache=None):
        """x [B, N, D]; cos/sin broadcastable to [B, H, N, hd]; bias [B, 1, N, keys]; cache (k, v) or None.
        Returns the output and the keys/values including x's (the updated cache)."""
        q = apply_rotary(self.split(self.q_proj(x)), cos, sin)
        k = apply_rotary(self.split(self.k_proj(x)), cos, sin)
        v = self.split(self.v_proj(x))
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        b, h, n, hd = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, h * hd)), (k, v)


class SwiGlu(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = LlamaAttention(dim, heads)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = SwiGlu(dim, hidden)

    def forward(self, x, cos, sin, bias, cache=None):
        h, cache = self.self_attn(self.input_layernorm(x), cos, sin, bias, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


# -- the policy ------------------------------------------------------------------------------------------


class OpenVlaPolicy(nn.Module):
    """forward(image, prompt_tokens, prompt_mask) → (action [B, action_dim] float32, the action token ids
    [B, action_dim] int64, the logits of the 256 action ids at each decode step [B, action_dim, 256])."""

    def __init__(self, view: dict):
        super().__init__()
        cfg = view["model"]["config"]
        inputs = view["inputs"]
        (camera,) = inputs["cameras"]  # OpenVLA reads one third-person image
        self.vocab_size = inputs["prompt"]["vocab_size"]
        if self.vocab_size <= N_ACTION_BINS:
            raise ValueError(f"vocab_size {self.vocab_size} must exceed the {N_ACTION_BINS} action ids")
        self.action_dim = view["outputs"]["action"]["dim"]
        self.theta = float(cfg["rope_theta"])
        vit = dict(shape=camera["shape"], patch=cfg["patch_size"], dim=cfg["vit_width"], depth=cfg["vit_depth"],
                   heads=cfg["vit_heads"], mlp_ratio=cfg["vit_mlp_ratio"])
        self.dino = VitTower(**vit, cls_token=True, gelu="none")
        self.siglip = VitTower(**vit, cls_token=False, gelu="tanh")
        self.n_image_tokens = self.dino.n_patches
        width = cfg["width"]
        self.heads = cfg["heads"]
        self.head_dim = width // cfg["heads"]
        self.projector = Projector(2 * cfg["vit_width"], width)
        self.embed_tokens = nn.Embedding(self.vocab_size, width)
        self.embed_scale = math.sqrt(width)
        self.layers = nn.ModuleList(
            [DecoderLayer(width, cfg["heads"], cfg["mlp_hidden"]) for _ in range(cfg["depth"])]
        )
        self.norm = RMSNorm(width)
        self.lm_head = nn.Linear(width, self.vocab_size, bias=False)

    def embed(self, token_ids):
        return self.embed_tokens(token_ids) * self.embed_scale

    def action_logits(self, h):
        """Logits of the 256 action ids (the last ones of the vocabulary) for hidden states h [B, 1, D]."""
        return self.lm_head(self.norm(h))[..., self.vocab_size - N_ACTION_BINS:]

    def forward(self, image, prompt_tokens, prompt_mask):
        b, length = prompt_tokens.shape
        n_img = self.n_image_tokens
        features = torch.cat([self.dino(image), self.siglip(image)], dim=-1)
        x = torch.cat([self.projector(features), self.embed(prompt_tokens)], dim=1)
        n = n_img + length

        # Prefill: causal attention over [image ; prompt], padded prompt positions masked as keys.
        keep = torch.cat([torch.ones(b, n_img, dtype=torch.float32), prompt_mask.to(torch.float32)], dim=1)
        key_bias = ((1.0 - keep) * _MASKED).reshape(b, 1, 1, n)
        idx = torch.arange(n)
        causal = (idx.unsqueeze(0) > idx.unsqueeze(1)).to(torch.float32) * _MASKED
        cos, sin = rotary(idx.to(torch.float32), self.head_dim, self.theta)
        bias = key_bias + causal
        caches = []
        for layer in self.layers:
            x, cache = layer(x, cos, sin, bias)
            caches.append(cache)

        # The first action token is predicted at the last real prompt position (prompts are right-padded).
        n_real = prompt_mask.to(torch.int64).sum(dim=1)                               # [B]
        last = (n_img + n_real - 1).reshape(b, 1, 1).expand(b, 1, x.shape[-1])
        logits = self.action_logits(torch.gather(x, 1, last))                          # [B, 1, 256]

        tokens, step_logits = [], []
        for step in range(self.action_dim):
            token = logits.argmax(dim=-1) + (self.vocab_size - N_ACTION_BINS)          # [B, 1]
            tokens.append(token)
            step_logits.append(logits)
            if step == self.action_dim - 1:
                break
            # Decode one position: the token just chosen, at the position after the last real one.
            position = (n_img + n_real + step).to(torch.float32).reshape(b, 1, 1)      # [B, 1, N=1]
            cos, sin = rotary(position, self.head_dim, self.theta)                     # [B, 1, 1, hd]
            key_bias = torch.cat([key_bias, torch.zeros(b, 1, 1, 1, dtype=torch.float32)], dim=3)
            h = self.embed(token)
            for i, layer in enumerate(self.layers):
                h, caches[i] = layer(h, cos, sin, key_bias, caches[i])
            logits = self.action_logits(h)

        token_ids = torch.cat(tokens, dim=1)                                           # [B, action_dim]
        return tokens_to_actions(token_ids, self.vocab_size), token_ids, torch.cat(step_logits, dim=1)


def export_spec(view: dict, dims: dict) -> ExportSpec:
    """Builds the policy and its example inputs for `dims` (dim name → size: prompt_len)."""
    inputs = view["inputs"]
    prompt_len = dims["prompt_len"]
    (camera,) = inputs["cameras"]
    vocab = inputs["prompt"]["vocab_size"]
    specs = [
        InputSpec(camera["name"], tuple([1] + list(camera["shape"])), "float32"),
        # Prompt ids are text ids: below the 256 action ids at the end of the vocabulary.
        InputSpec(
            "prompt_tokens", (1, prompt_len), "int64", dynamic={1: "prompt_len"},
            pad_value=inputs["prompt"]["pad_id"], sample_range=(1, vocab - N_ACTION_BINS - 1),
            value_domain=(0, vocab - 1),
        ),
        InputSpec("prompt_mask", (1, prompt_len), "int64", dynamic={1: "prompt_len"}, sample_range=(1, 1),
                  value_domain=(0, 1)),
    ]
    return ExportSpec(
        module=OpenVlaPolicy(view),
        inputs=specs,
        outputs=["action", "action_tokens", "action_logits"],
        dim_minimums={"prompt_len": 2},
    )
