"""A GR00T-style split policy: a VLM backbone and a DiT flow-matching action head, small or at GR00T N1.5's size.

After NVIDIA's GR00T N1 / N1.5 ("System 2" / "System 1"), as two separately exported and compiled modules
that a link (rules/private/link.bzl, dsa/stages/link.py) joins by the tensors they exchange:

* **backbone** (`backbone_spec`): a vision tower (ViT: patchify, learned positions, transformer blocks)
  whose image tokens are projected into the language model's width, the prompt's token embeddings, and the
  language model over [image tokens; prompt tokens]. As GR00T, the features are a middle layer's hidden
  states: the LM keeps only its first `lm.layers` layers (GR00T's `select_layer`). Outputs
  `backbone_features` [1, T, D] float32 and `backbone_mask` [1, T] float32 (1 = real token, 0 = padded
  prompt position), T = image tokens + prompt_len.
* **action head** (`head_spec`): a DiT. The backbone features are layer-normed (GR00T's `vlln`) and, when
  `vl_self_attention` is configured, pass through its self-attention blocks (N1.5); a state encoder turns the
  robot state into one token, an action encoder turns the noisy action chunk and the flow time into tokens;
  DiT blocks over [state token; future tokens; action tokens], each adaLN-conditioned on the flow time,
  alternate cross-attention to the backbone features (even blocks) and self-attention (odd blocks); an
  action decoder reads the action tokens back out as a velocity. Flow matching integrates from noise (t = 0)
  to an action chunk (t = 1): x ← x + dt·v(x, t), dt = 1/steps, in a `torch._higher_order_ops.while_loop`
  whose trip count is the runtime input `steps` (as π0), so one module serves any step count.
  Cross-attention keys and values of the backbone features are computed once, outside the loop.

The head's manifest names the backbone features it expects (`model.config.backbone.tokens`, `.width`);
the link checks that they are what the backbone's export record says it produces.

## model.config

Every key below the first line of each section is optional; its default reproduces the small stand-in of
manifests/groot_backbone.yaml / groot_head.yaml exactly (the same parameters, MLIR and export records).

Backbone:

* `prompt_len`: the static prompt length.
* `vision`: `width`, `depth`, `heads`, `patch_size`, `mlp_ratio` (or `mlp_hidden`: the MLP width when it is no
  integer multiple, SigLIP's 4304); `norm_eps` (1e-5; SigLIP 1e-6); `shared` (false: one tower per camera;
  true: one tower for every camera, as GR00T's VLM runs each image through the same SigLIP); `pixel_shuffle`
  (1; 2: Eagle's pixel shuffle with downsample ratio 0.5 — each 2×2 block of patches becomes one token of
  4× the width, 256 patches → 64 tokens, in Eagle's channel order).
* `projector`: `norm` (false; true: a LayerNorm first, as Eagle's `mlp1`), `gelu` ("tanh"; "exact": Eagle's
  nn.GELU()). Linear(vision width × shuffle², lm width), GELU, Linear(lm width, lm width).
* `lm`: `width`, `layers`, `heads`, `mlp_ratio` (or `mlp_hidden`); `kv_heads` (= heads; fewer: grouped-query
  attention), `head_dim` (= width / heads), `mlp` ("gelu"; "swiglu": gate/up/down), `norm` ("layernorm";
  "rmsnorm"), `norm_eps` (1e-5), `bias` (true; false: no biases in attention and MLP, as Qwen3),
  `qk_norm` (false; true: RMSNorm of each head's queries and keys, as Qwen3), `positions` ("sinusoid": added
  to the prompt embeddings; "rope": rotary, over the whole sequence, `rope_theta` 10000), `embed_scale`
  (true: prompt embeddings × sqrt(width), as Gemma; false as Qwen), `causal` (false; true: a decoder's causal
  mask, as the LLM has).
* The vocabulary is `inputs.prompt.vocab_size`, the cameras `inputs.cameras`.

Head:

* `backbone`: `tokens`, `width` (what the backbone gives).
* `dit`: `width`, `depth`, `heads`, `mlp_ratio`; `adaln` ("zero": adaLN-Zero, shift/scale/gate for attention
  and MLP; "norm": GR00T's AdaLayerNorm — scale/shift before the attention only, a plain LayerNorm before the
  MLP, no gates); `time_channels` (= width; GR00T 256: the sinusoid the time MLP reads); `output_dim` (none;
  GR00T 1024: `proj_out_2`, the DiT's output width, read by the action decoder); `future_tokens` (0; GR00T
  N1.5 32: learned tokens between the state token and the action tokens).
* `vl_self_attention`: `depth`, `heads`, `mlp_ratio` (absent: none; N1.5: 4 blocks of 32 heads over the
  2048-wide features).
* `state_encoder`, `action_decoder`: `hidden` (= DiT width), `activation` ("silu"; GR00T's
  CategorySpecificMLP: "relu").

## What differs from the real GR00T N1.5 (manifests/groot_*_full.yaml), and why

* Weights: seeded stand-ins (dsa/stages/checkpoint.py), not NVIDIA's checkpoint, which cannot be downloaded
  here. Parameter names follow this file (`attn.q`, `mlp.gate`, ...), not Hugging Face's (`self_attn.q_proj`,
  `mlp.gate_proj`): a real checkpoint needs a renaming map. RMSNorm is a LayerNorm subclass without bias, so
  the seeded stand-in initialises its weight to ones as a trained norm is near (torch's nn.RMSNorm would get
  N(0, 0.02²) and shrink every activation fifty-fold).
* One embodiment: GR00T's state encoder, action encoder and decoder are category-specific (a weight bank
  indexed by embodiment id); here they are the weights of one embodiment, which is what a deployed robot
  runs.
* Token layout: Eagle interleaves image tokens into the chat-templated prompt (its IMG_CONTEXT tokens are
  replaced by image embeddings); here the sequence is [camera 1 tokens; camera 2 tokens; prompt tokens] and
  the host's prompt holds the template's text tokens. The same computation per token; image tokens sit first.
* The images are one 224×224 tile per camera (Eagle can tile high-resolution images; GR00T feeds 224×224).
* The backbone's features are the final (RMS) norm of the last kept LM layer, with no `eagle_linear` (an
  identity when the projection width is the LM width, as in N1.5).
* Attention masks: the backbone features' padded prompt positions are masked in the head's VL self-attention
  and cross-attention (GR00T's inference passes no mask there and attends to padding); dropout is absent
  (inference).
* Flow time: t·1000 as a float (GR00T discretises to int(t·1000): the same values for 1, 2, 4, 5, 8 or 10
  steps; 3 steps differ by < 1 on a 1000 scale). Sinusoids are [sin, cos] (diffusers' Timesteps flips to
  [cos, sin] with a frequency shift): a fixed permutation a trained time MLP would absorb.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dsa.stages.loops import kept_loop
from dsa.stages.spec import ExportSpec, InputSpec
from models.pi0.pi0 import _MASKED, Attention, Block, Mlp, _sinusoid


def _section(config: dict, where: str, required, optional: dict) -> dict:
    """`config` with `optional`'s defaults filled in; refuses a missing required key or an unknown one."""
    config = dict(config or {})
    missing = [k for k in required if k not in config]
    unknown = sorted(set(config) - set(required) - set(optional))
    if missing or unknown:
        raise ValueError(f"model.config.{where}: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else [])
            + ([f"unknown {', '.join(unknown)} (known: {', '.join(sorted(set(required) | set(optional)))})"]
               if unknown else [])))
    return dict(optional, **config)


def _choice(value, allowed, where):
    if value not in allowed:
        raise ValueError(f"model.config.{where} is {value!r}: one of {', '.join(map(repr, allowed))}")
    return value


def _hidden(cfg: dict, where: str) -> int:
    """An MLP's width: `mlp_hidden`, else width × `mlp_ratio`."""
    if cfg.get("mlp_hidden") is not None:
        return int(cfg["mlp_hidden"])
    if cfg.get("mlp_ratio") is None:
        raise ValueError(f"model.config.{where}: give mlp_ratio or mlp_hidden")
    return cfg["width"] * cfg["mlp_ratio"]


# ---------------------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nn.LayerNorm):
    """x / rms(x) · weight (Qwen3's RMSNorm). A LayerNorm subclass without bias so that weight-generic code
    (the seeded stand-in: ones, as for a LayerNorm) treats its weight as a norm's."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps=eps, bias=False)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(kind: str, dim: int, eps: float) -> nn.Module:
    return RMSNorm(dim, eps) if kind == "rmsnorm" else nn.LayerNorm(dim, eps=eps)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)) (Qwen3's MLP)."""

    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=bias)
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _rope(length: int, head_dim: int, theta: float):
    """cos, sin [length, head_dim] of rotary embeddings at positions 0..length-1 (the rotate-half layout)."""
    inverse = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.arange(length, dtype=torch.float32).unsqueeze(-1) * inverse
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class GroupedAttention(nn.Module):
    """Multi-head attention with `kv_heads` ≤ `heads` key/value heads (grouped-query attention), an explicit
    head dim, optional RMSNorm of queries and keys and rotary positions. With kv_heads = heads, head_dim =
    dim / heads and biases it computes exactly as models.pi0.pi0.Attention, under the same parameter names."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, bias: bool = True,
                 qk_norm: bool = False, eps: float = 1e-6):
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"heads ({heads}) is not a multiple of kv_heads ({kv_heads})")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = nn.Linear(dim, heads * head_dim, bias=bias)
        self.k = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.o = nn.Linear(heads * head_dim, dim, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        self.qk_norm = qk_norm

    def _split(self, x, heads):
        b, n, _ = x.shape
        return x.view(b, n, heads, self.head_dim).transpose(1, 2)

    def _repeat(self, x):
        """[b, kv_heads, n, d] → [b, heads, n, d]: each key/value head serves heads / kv_heads query heads."""
        b, h, n, d = x.shape
        groups = self.heads // h
        return x.unsqueeze(2).expand(b, h, groups, n, d).reshape(b, h * groups, n, d)

    def forward(self, x, bias=None, rope=None):
        q = self._split(self.q(x), self.heads)
        k = self._split(self.k(x), self.kv_heads)
        v = self._split(self.v(x), self.kv_heads)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        if self.kv_heads != self.heads:
            k, v = self._repeat(k), self._repeat(v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        b, h, n, dh = out.shape
        return self.o(out.transpose(1, 2).reshape(b, n, h * dh))


class DecoderLayer(nn.Module):
    """Pre-norm transformer layer: attention (GroupedAttention) and an MLP (GELU or SwiGLU), with LayerNorm
    or RMSNorm. Its defaults are models.pi0.pi0.Block, op for op and name for name."""

    def __init__(self, dim: int, heads: int, hidden: int, *, kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, mlp: str = "gelu", norm: str = "layernorm", eps: float = 1e-5,
                 bias: bool = True, qk_norm: bool = False):
        super().__init__()
        self.norm1 = _norm(norm, dim, eps)
        self.attn = GroupedAttention(dim, heads, kv_heads or heads, head_dim or dim // heads, bias, qk_norm, eps)
        self.norm2 = _norm(norm, dim, eps)
        if mlp == "swiglu":
            self.mlp = SwiGLU(dim, hidden, bias)
        else:
            self.mlp = Mlp(dim, hidden)
            if not bias:
                self.mlp.fc1, self.mlp.fc2 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)

    def forward(self, x, bias=None, rope=None):
        x = x + self.attn(self.norm1(x), bias, rope)
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """ViT encoder of one image (SigLIP's structure): patchify, learned positions, transformer layers, final
    norm. Its defaults are models.pi0.pi0.PatchEncoder, op for op and name for name."""

    def __init__(self, shape, vit: dict):
        super().__init__()
        c, h, w = shape
        patch, dim = vit["patch_size"], vit["width"]
        if h % patch or w % patch:
            raise ValueError(f"image {h}x{w} is not divisible by patch_size {patch}")
        self.patchify = nn.Conv2d(c, dim, kernel_size=patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, (h // patch) * (w // patch), dim))
        hidden = _hidden(vit, "vision")
        self.blocks = nn.ModuleList([DecoderLayer(dim, vit["heads"], hidden, eps=vit["norm_eps"])
                                     for _ in range(vit["depth"])])
        self.norm = nn.LayerNorm(dim, eps=vit["norm_eps"])

    def forward(self, image):
        x = self.patchify(image).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def pixel_shuffle(x, factor: int):
    """Eagle's (InternVL's) pixel shuffle with downsample ratio 1/factor, ps_version v2: [b, n, c] patch
    tokens of a square grid → [b, n / factor², c · factor²], channels in Eagle's order."""
    b, n, c = x.shape
    side = math.isqrt(n)
    x = x.reshape(b, side, side, c)  # Eagle: [N, W, H, C]
    x = x.reshape(b, side, side // factor, c * factor)
    x = x.permute(0, 2, 1, 3).contiguous()
    x = x.reshape(b, side // factor, side // factor, c * factor * factor)
    x = x.permute(0, 2, 1, 3).contiguous()
    return x.reshape(b, -1, c * factor * factor)


# ---------------------------------------------------------------------------------------------------------
# Backbone (System 2)

_VISION = (("width", "depth", "heads", "patch_size"),
           {"mlp_ratio": None, "mlp_hidden": None, "norm_eps": 1e-5, "shared": False, "pixel_shuffle": 1})
_PROJECTOR = ((), {"norm": False, "gelu": "tanh"})
_LM = (("width", "layers", "heads"),
       {"mlp_ratio": None, "mlp_hidden": None, "kv_heads": None, "head_dim": None, "mlp": "gelu",
        "norm": "layernorm", "norm_eps": 1e-5, "bias": True, "qk_norm": False, "positions": "sinusoid",
        "rope_theta": 10000.0, "embed_scale": True, "causal": False})
_BACKBONE = (("prompt_len", "vision", "lm"), {"projector": None})


def _backbone_config(view: dict):
    cfg = _section(view["model"]["config"], "(backbone)", *_BACKBONE)
    vit = _section(cfg["vision"], "vision", *_VISION)
    lm = _section(cfg["lm"], "lm", *_LM)
    projector = _section(cfg["projector"], "projector", *_PROJECTOR)
    _choice(lm["mlp"], ("gelu", "swiglu"), "lm.mlp")
    _choice(lm["norm"], ("layernorm", "rmsnorm"), "lm.norm")
    _choice(lm["positions"], ("sinusoid", "rope"), "lm.positions")
    _choice(projector["gelu"], ("tanh", "exact"), "projector.gelu")
    return cfg, vit, lm, projector


class GrootBackbone(nn.Module):
    """forward(*camera_images, prompt_tokens, prompt_mask) → (backbone_features, backbone_mask)."""

    def __init__(self, view: dict):
        super().__init__()
        cfg, vit, lm, projector = _backbone_config(view)
        inputs = view["inputs"]
        self.camera_names = [c["name"] for c in inputs["cameras"]]
        self.shuffle = vit["pixel_shuffle"]
        if vit["shared"]:  # one tower for every camera (GR00T): the cameras must share one shape
            shapes = {tuple(c["shape"]) for c in inputs["cameras"]}
            if len(shapes) != 1:
                raise ValueError(f"model.config.vision.shared: the cameras' shapes differ ({sorted(shapes)})")
            self.vision = VisionTower(inputs["cameras"][0]["shape"], vit)
        else:
            self.vision = nn.ModuleDict({c["name"]: VisionTower(c["shape"], vit) for c in inputs["cameras"]})
        self.shared = vit["shared"]
        self.width = lm["width"]
        # Vision-to-language projector (a two-layer MLP, as in Eagle/LLaVA-style VLMs; Eagle's mlp1 norms first).
        gelu = nn.GELU(approximate="tanh" if projector["gelu"] == "tanh" else "none")
        vision_out = vit["width"] * self.shuffle * self.shuffle
        layers = [nn.Linear(vision_out, lm["width"]), gelu, nn.Linear(lm["width"], lm["width"])]
        if projector["norm"]:
            layers.insert(0, nn.LayerNorm(vision_out, eps=1e-5))
        self.projector = nn.Sequential(*layers)
        self.token_embed = nn.Embedding(inputs["prompt"]["vocab_size"], lm["width"])
        # Only the first `layers` LM layers: GR00T reads a middle layer's hidden states and drops the rest.
        self.head_dim = lm["head_dim"] or lm["width"] // lm["heads"]
        self.layers = nn.ModuleList([
            DecoderLayer(lm["width"], lm["heads"], _hidden(lm, "lm"), kv_heads=lm["kv_heads"],
                         head_dim=lm["head_dim"], mlp=lm["mlp"], norm=lm["norm"], eps=lm["norm_eps"],
                         bias=lm["bias"], qk_norm=lm["qk_norm"])
            for _ in range(lm["layers"])])
        self.norm = _norm(lm["norm"], lm["width"], lm["norm_eps"])
        self.positions, self.rope_theta = lm["positions"], lm["rope_theta"]
        self.embed_scale, self.causal = lm["embed_scale"], lm["causal"]

    def _image_tokens(self, name, image):
        x = (self.vision if self.shared else self.vision[name])(image)
        if self.shuffle != 1:
            x = pixel_shuffle(x, self.shuffle)
        return self.projector(x)

    def forward(self, *args):
        n_cam = len(self.camera_names)
        images = args[:n_cam]
        prompt_tokens, prompt_mask = args[n_cam:]
        b, length = prompt_tokens.shape
        image_tokens = [self._image_tokens(name, img) for name, img in zip(self.camera_names, images)]
        if self.positions == "sinusoid":
            positions = torch.arange(length, dtype=torch.float32)
        prompt = self.token_embed(prompt_tokens)
        if self.embed_scale:
            prompt = prompt * math.sqrt(self.width)
        if self.positions == "sinusoid":
            prompt = prompt + _sinusoid(positions, self.width)
        tokens = torch.cat(image_tokens + [prompt], dim=1)
        n_img = sum(t.shape[1] for t in image_tokens)
        keep = torch.cat([torch.ones(b, n_img, dtype=torch.float32), prompt_mask.to(torch.float32)], dim=1)
        bias = ((1.0 - keep) * _MASKED).reshape(b, 1, 1, -1)
        total = tokens.shape[1]
        if self.causal:  # a decoder's mask: no token attends to a later one
            index = torch.arange(total)
            bias = bias + (index.unsqueeze(0) > index.unsqueeze(1)).to(torch.float32) * _MASKED
        rope = _rope(total, self.head_dim, self.rope_theta) if self.positions == "rope" else None
        for layer in self.layers:
            tokens = layer(tokens, bias, rope)
        return self.norm(tokens), keep


def backbone_tokens(view: dict) -> int:
    """T: image tokens of every camera (after the pixel shuffle) + the prompt length."""
    _, vit, _, _ = _backbone_config(view)
    patch, shuffle = vit["patch_size"], vit["pixel_shuffle"]
    n_img = 0
    for c in view["inputs"]["cameras"]:
        rows, cols = c["shape"][1] // patch, c["shape"][2] // patch
        if shuffle != 1 and (rows != cols or rows % shuffle):
            raise ValueError(f"camera {c['name']}: a {rows}x{cols} patch grid cannot be pixel-shuffled by {shuffle}")
        n_img += rows * cols // (shuffle * shuffle)
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
    """DiT block: attention (to the context, or to itself) and an MLP, conditioned on the flow-time
    embedding. adaln "zero": adaLN-Zero, shift/scale/gate vectors for both; "norm": GR00T's AdaLayerNorm,
    scale/shift of the attention's input only, a plain LayerNorm before the MLP, no gates."""

    def __init__(self, dim: int, context_dim: int, heads: int, mlp_ratio: int, cross: bool, adaln: str = "zero"):
        super().__init__()
        self.cross = cross
        self.adaln = adaln
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = Attention(dim, heads)
        if cross:  # keys/values come from the backbone features, in their width
            self.attn.k = nn.Linear(context_dim, dim)
            self.attn.v = nn.Linear(context_dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = Mlp(dim, dim * mlp_ratio)
        self.ada = nn.Linear(dim, (6 if adaln == "zero" else 2) * dim)

    def context_kv(self, context):
        return self.attn.split(self.attn.k(context)), self.attn.split(self.attn.v(context))

    def _attention(self, h, kv, bias):
        q = self.attn.split(self.attn.q(h))
        if self.cross:
            k, v = kv
            return self.attn.attend(q, k, v, bias)
        return self.attn.attend(q, self.attn.split(self.attn.k(h)), self.attn.split(self.attn.v(h)), None)

    def forward(self, x, temb, kv, bias):
        if self.adaln == "norm":
            scale, shift = self.ada(F.silu(temb)).unsqueeze(1).chunk(2, dim=-1)
            x = x + self._attention(_modulate(self.norm1(x), shift, scale), kv, bias)
            return x + self.mlp(self.norm2(x))
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(temb)).unsqueeze(1).chunk(6, dim=-1)
        h = _modulate(self.norm1(x), shift1, scale1)
        out = self._attention(h, kv, bias)
        x = x + gate1 * out
        return x + gate2 * self.mlp(_modulate(self.norm2(x), shift2, scale2))


_DIT = (("width", "depth", "heads", "mlp_ratio"),
        {"adaln": "zero", "time_channels": None, "output_dim": None, "future_tokens": 0})
_VL_SELF_ATTENTION = (("depth", "heads", "mlp_ratio"), {})
_MLP_IO = ((), {"hidden": None, "activation": "silu"})
_HEAD = (("backbone", "dit"), {"vl_self_attention": None, "state_encoder": None, "action_decoder": None})
_ACTIVATIONS = {"silu": nn.SiLU, "relu": nn.ReLU}


class GrootActionHead(nn.Module):
    """forward(backbone_features, backbone_mask, state, noise, steps) → action chunk [1, horizon, action_dim]."""

    def __init__(self, view: dict):
        super().__init__()
        cfg = _section(view["model"]["config"], "(head)", *_HEAD)
        backbone = _section(cfg["backbone"], "backbone", ("tokens", "width"), {})
        dit = _section(cfg["dit"], "dit", *_DIT)
        _choice(dit["adaln"], ("zero", "norm"), "dit.adaln")
        state_cfg = _section(cfg["state_encoder"], "state_encoder", *_MLP_IO)
        decoder_cfg = _section(cfg["action_decoder"], "action_decoder", *_MLP_IO)
        for where, c in (("state_encoder", state_cfg), ("action_decoder", decoder_cfg)):
            _choice(c["activation"], tuple(_ACTIVATIONS), f"{where}.activation")
        width, heads, ratio = dit["width"], dit["heads"], dit["mlp_ratio"]
        action_dim = view["outputs"]["action"]["dim"]
        self.width = width
        self.time_channels = dit["time_channels"] or width
        self.n_future = dit["future_tokens"]
        self.vl_norm = nn.LayerNorm(backbone["width"])
        self.vl_self_attention = None
        if cfg["vl_self_attention"] is not None:  # GR00T N1.5: self-attention over the features first
            vl = _section(cfg["vl_self_attention"], "vl_self_attention", *_VL_SELF_ATTENTION)
            self.vl_self_attention = nn.ModuleList(
                [Block(backbone["width"], vl["heads"], vl["mlp_ratio"]) for _ in range(vl["depth"])])
        state_hidden = state_cfg["hidden"] or width
        self.state_encoder = nn.Sequential(nn.Linear(view["inputs"]["state"]["dim"], state_hidden),
                                           _ACTIVATIONS[state_cfg["activation"]](), nn.Linear(state_hidden, width))
        # Action encoder: [noisy action embedding, time embedding] → token (GR00T's MultiEmbodimentActionEncoder).
        self.action_in = nn.Linear(action_dim, width)
        self.action_time = nn.Sequential(nn.Linear(2 * width, width), nn.SiLU(), nn.Linear(width, width))
        self.pos = nn.Parameter(torch.zeros(1, view["chunk_size"], width))
        if self.n_future:  # GR00T's future_tokens (num_target_vision_tokens)
            self.future_tokens = nn.Parameter(torch.zeros(1, self.n_future, width))
        self.time_mlp = nn.Sequential(nn.Linear(self.time_channels, width), nn.SiLU(), nn.Linear(width, width))
        self.blocks = nn.ModuleList(
            [DiTBlock(width, backbone["width"], heads, ratio, cross=(i % 2 == 0), adaln=dit["adaln"])
             for i in range(dit["depth"])]
        )
        self.norm_out = nn.LayerNorm(width, elementwise_affine=False)
        self.ada_out = nn.Linear(width, 2 * width)
        out_width = width
        if dit["output_dim"]:  # GR00T's proj_out_2: the DiT's output width
            self.proj_out = nn.Linear(width, dit["output_dim"])
            out_width = dit["output_dim"]
        self.has_proj_out = bool(dit["output_dim"])
        decoder_hidden = decoder_cfg["hidden"] or width
        self.action_decoder = nn.Sequential(nn.Linear(out_width, decoder_hidden),
                                            _ACTIVATIONS[decoder_cfg["activation"]](),
                                            nn.Linear(decoder_hidden, action_dim))

    def velocity(self, x, t, state_token, kvs, bias):
        """v(x, t): x [1, horizon, action_dim], t a 0-d float tensor in [0, 1)."""
        b, n, _ = x.shape
        # Sinusoidal embedding of the discretised time (GR00T: t * 1000).
        time = _sinusoid((t * 1000.0).reshape(1), self.width).reshape(1, self.width)
        if self.time_channels == self.width:
            temb = self.time_mlp(time)
        else:
            channels = self.time_channels
            temb = self.time_mlp(_sinusoid((t * 1000.0).reshape(1), channels).reshape(1, channels))
        tokens = self.action_time(torch.cat([self.action_in(x), time.unsqueeze(1).expand(b, n, self.width)], dim=-1))
        if self.n_future:
            h = torch.cat([state_token, self.future_tokens.expand(b, -1, -1), tokens + self.pos], dim=1)
        else:
            h = torch.cat([state_token, tokens + self.pos], dim=1)
        for block, kv in zip(self.blocks, kvs):
            h = block(h, temb, kv, bias)
        shift, scale = self.ada_out(F.silu(temb)).unsqueeze(1).chunk(2, dim=-1)
        h = _modulate(self.norm_out(h), shift, scale)
        h = h[:, 1 + self.n_future:]
        if self.has_proj_out:
            h = self.proj_out(h)
        return self.action_decoder(h)

    def forward(self, backbone_features, backbone_mask, state, noise, steps):
        b = noise.shape[0]
        context = self.vl_norm(backbone_features)
        if self.vl_self_attention is not None:
            vl_bias = ((1.0 - backbone_mask) * _MASKED).reshape(b, 1, 1, -1)
            for block in self.vl_self_attention:
                context = block(context, vl_bias)
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
