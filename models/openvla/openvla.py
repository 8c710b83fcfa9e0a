"""An OpenVLA-architecture policy (fused ViT towers → projector → Llama decoder → action tokens), at a
scaled-down size (manifests/openvla.yaml) or at OpenVLA-7B's own (manifests/openvla_7b.yaml).

Structure, after OpenVLA (Kim et al., 2024, `openvla/openvla-7b`, built on prismatic-vlms):
  * a fused vision backbone: two ViT towers see the same image, a DINOv2-style one (class token, exact
    GELU) and a SigLIP-style one (no class token, tanh GELU); each embeds patches with a Linear over the
    flattened patch (what a stride-p convolution computes), adds learned positions and runs pre-norm
    transformer blocks. Their patch features are concatenated channel-wise (OpenVLA's "dinosiglip"
    fusion; the DINOv2 class and register tokens are dropped, as OpenVLA keeps patch tokens only);
  * OpenVLA's fused projector: Linear → GELU → Linear → GELU → Linear into the language model's width;
  * a Llama-style decoder over [image tokens ; prompt tokens]: RMSNorm, rotary position embeddings
    (rotate-half convention, theta 10000), causal multi-head attention without biases, SwiGLU MLP, a final
    RMSNorm and an untied lm_head over the whole vocabulary;
  * greedy decoding of `action_dim` action tokens with a KV cache: one prefill over the prompt computes every
    layer's keys/values, then each further token runs one position through the decoder and appends its
    keys/values. The count is fixed, so the 7 decode steps are unrolled at export;
  * OpenVLA's ActionTokenizer: the action tokens are the LAST 256 ids of the tokenizer's vocabulary
    (`tokenizer_vocab_size`, default the embedding's `vocab_size`; OpenVLA-7B: 32000 of a 32064-row
    embedding padded to a multiple of 64); id t stands for discretised value d = tokenizer_vocab_size - t in
    [1, 256], bin index clip(d - 1, 0, 254), and the action is the centre of that bin of
    `np.linspace(-1, 1, 256)` (255 bins, so the two highest bin indices share a centre, exactly as in
    OpenVLA's `decode_token_ids_to_actions`). Actions stay normalised in [-1, 1]: OpenVLA un-normalises
    with per-dataset q01/q99 statistics outside the network, and so does this rule set (the runtime's
    normalisation statistics), so the policy does not model it.

`model.config` (every key below the first group is optional; its default is the scaled-down model's
behaviour, so manifests written before these keys existed export the same MLIR):
  * `patch_size`; `vit_width`, `vit_depth`, `vit_heads`, `vit_mlp_ratio`: both towers' size;
    `width`, `depth`, `heads`, `mlp_hidden`, `rope_theta`: the decoder's;
  * `dino`, `siglip`: one tower's own hyper-parameters, over the shared `vit_*` ones: `width`, `depth`,
    `heads`, `mlp_hidden` (default width · vit_mlp_ratio); `registers` (register tokens after the class
    token, DINOv2-reg: default 0); `prefix_positions` (whether the class/register tokens have learned
    positions: default true; false is timm's `no_embed_class`, as DINOv2-reg's positions cover the patches
    only); `layer_scale` (DINOv2's per-channel LayerScale `ls1`/`ls2` on each residual branch: default
    false); `feature_block` (the block whose output the tower returns, a Python index: prismatic's
    `get_intermediate_layers(n={depth - 2})` is -2, the final LayerNorm then unused; default: the last
    block followed by the final LayerNorm). Blocks after the feature block are built (a checkpoint of the
    tower holds them) but never run: the export records them as unused and the archive leaves them out;
  * `projector_hidden`: the projector's first width (default 4 × the fused vision width, as prismatic's
    `FusedMLPProjector`);
  * `rms_norm_eps` (default 1e-6; Llama-2: 1e-5); `tokenizer_vocab_size` (see above);
  * `bos_before_image`: the prompt's first token (BOS) goes before the image tokens, as prismatic inserts
    the projected patches after BOS (default false: image tokens first).

Deviations from OpenVLA, all deliberate and small, and kept at the real size (the rule set's stand-in
checkpoint is seeded, not trained, at every size):
  * decoding picks the argmax over the 256 action ids only (constrained decoding). OpenVLA takes the argmax
    over the whole vocabulary and clips non-action ids to the nearest bin; a trained model puts its mass on
    action ids, but a seeded stand-in checkpoint would not, and every action would be clipped to one bin;
  * RMSNorm stores its gain as an offset from 1 (Gemma's convention: `x̂ · (1 + w)`), so that the rule set's
    seeded checkpoint (1-D parameters ~ N(0, 0.02²)) gives unit gains; a Llama gain g loads as w = g - 1;
  * token embeddings are multiplied by sqrt(width) (Gemma's normaliser), so the seeded checkpoint's
    N(0, 1/width) embeddings are on the image tokens' unit scale; with Llama's unscaled embeddings the
    seeded stand-in all but ignores the token it just decoded and repeats one token 7 times (a Llama
    embedding table loads divided by sqrt(width));
  * one 3-channel image feeds both towers: OpenVLA's processor gives each tower its own normalisation of
    the image (ImageNet mean/std for DINOv2, 0.5/0.5 for SigLIP: a 6-channel input); SigLIP's attention-
    pooling head, unused by OpenVLA, is not built;
  * the scaled-down manifests shrink towers, decoder and vocabulary (widths 128/256, 2 + 4 layers, 1024
    ids, 64×64 images).

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


class LayerScale(nn.Module):
    """DINOv2's per-channel scale of a residual branch (timm's `LayerScale`: `gamma`)."""

    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x * self.gamma


class VitBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_hidden: int, gelu: str, layer_scale: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VitAttention(dim, heads)
        self.ls1 = LayerScale(dim) if layer_scale else None
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, mlp_hidden)
        self.fc2 = nn.Linear(mlp_hidden, dim)
        self.ls2 = LayerScale(dim) if layer_scale else None
        self.gelu = gelu

    def forward(self, x):
        if self.ls1 is None:
            x = x + self.attn(self.norm1(x))
            return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate=self.gelu))
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate=self.gelu)))


# One tower's own keys in model.config (`dino`, `siglip`), over the shared vit_* keys (module docstring).
TOWER_KEYS = ("width", "depth", "heads", "mlp_hidden", "registers", "prefix_positions", "layer_scale",
              "feature_block")


def tower_config(cfg: dict, name: str) -> dict:
    """VitTower's keyword arguments for tower `name` (dino, siglip): cfg[name]'s keys over the vit_* ones."""
    own = dict(cfg.get(name) or {})
    unknown = sorted(set(own) - set(TOWER_KEYS))
    if unknown:
        raise ValueError(f"model.config.{name}: unknown key(s) {', '.join(unknown)} (known: {', '.join(TOWER_KEYS)})")

    def need(key, shared):
        if key in own:
            return own[key]
        if shared not in cfg:
            raise ValueError(f"model.config: give {name}.{key} or {shared}")
        return cfg[shared]

    width = need("width", "vit_width")
    mlp_hidden = own["mlp_hidden"] if "mlp_hidden" in own else width * need("mlp_hidden", "vit_mlp_ratio")
    config = dict(dim=width, depth=need("depth", "vit_depth"), heads=need("heads", "vit_heads"),
                  mlp_hidden=mlp_hidden, registers=own.get("registers", 0),
                  prefix_positions=own.get("prefix_positions", True), layer_scale=own.get("layer_scale", False),
                  feature_block=own.get("feature_block"))
    if config["dim"] % config["heads"]:
        raise ValueError(f"model.config.{name}: width {config['dim']} is not divisible by heads {config['heads']}")
    block = config["feature_block"]
    if block is not None and not -config["depth"] <= block < config["depth"]:
        raise ValueError(f"model.config.{name}.feature_block {block} is not a block of {config['depth']}")
    return config


class VitTower(nn.Module):
    """One ViT: Linear patch embedding, prefix tokens (class, registers), learned positions, pre-norm blocks;
    returns the patch features of its feature block (default: the last, then the final LayerNorm)."""

    def __init__(self, shape, patch: int, dim: int, depth: int, heads: int, mlp_hidden: int,
                 cls_token: bool, gelu: str, registers: int = 0, prefix_positions: bool = True,
                 layer_scale: bool = False, feature_block=None):
        super().__init__()
        c, h, w = shape
        if h % patch or w % patch:
            raise ValueError(f"image {h}x{w} is not divisible by patch_size {patch}")
        self.patch = patch
        self.n_patches = (h // patch) * (w // patch)
        self.n_prefix = int(cls_token) + registers
        self.prefix_positions = prefix_positions
        self.patch_embed = nn.Linear(c * patch * patch, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if cls_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, registers, dim)) if registers else None
        positions = self.n_patches + (self.n_prefix if prefix_positions else 0)
        self.pos_embed = nn.Parameter(torch.zeros(1, positions, dim))
        self.blocks = nn.ModuleList([VitBlock(dim, heads, mlp_hidden, gelu, layer_scale) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        # Blocks run: all, then the final norm; or up to the feature block, without the norm (prismatic).
        self.n_run = depth if feature_block is None else feature_block % depth + 1
        self.final_norm = feature_block is None

    def forward(self, image):
        b, c, h, w = image.shape
        p = self.patch
        # [B, C, H, W] → [B, patches, C·p·p], each patch flattened in a stride-p convolution's (c, y, x) order.
        patches = image.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_embed(patches.reshape(b, self.n_patches, c * p * p))
        prefix = [t.expand(b, -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if self.prefix_positions:
            if prefix:
                x = torch.cat(prefix + [x], dim=1)
            x = x + self.pos_embed
        else:  # timm's no_embed_class: positions for the patches, prefix tokens prepended after
            x = x + self.pos_embed
            if prefix:
                x = torch.cat(prefix + [x], dim=1)
        for block in self.blocks[:self.n_run]:
            x = block(x)
        if self.final_norm:
            x = self.norm(x)
        return x[:, self.n_prefix:] if self.n_prefix else x


class Projector(nn.Module):
    """OpenVLA's fused-backbone projector (`FusedMLPProjector`)."""

    def __init__(self, vision_dim: int, llm_dim: int, hidden=None):
        super().__init__()
        hidden = hidden or 4 * vision_dim
        self.fc1 = nn.Linear(vision_dim, hidden)
        self.fc2 = nn.Linear(hidden, llm_dim)
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
    def __init__(self, dim: int, heads: int, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = LlamaAttention(dim, heads)
        self.post_attention_layernorm = RMSNorm(dim, eps)
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
        # Rows of the embedding and the lm_head; the action ids end at the tokenizer's vocabulary.
        self.vocab_size = inputs["prompt"]["vocab_size"]
        self.text_vocab = cfg.get("tokenizer_vocab_size", self.vocab_size)
        if not N_ACTION_BINS < self.text_vocab <= self.vocab_size:
            raise ValueError(f"tokenizer_vocab_size {self.text_vocab} must exceed the {N_ACTION_BINS} action ids "
                             f"and be at most vocab_size {self.vocab_size}")
        self.action_dim = view["outputs"]["action"]["dim"]
        self.theta = float(cfg["rope_theta"])
        patch = cfg["patch_size"]
        dino, siglip = tower_config(cfg, "dino"), tower_config(cfg, "siglip")
        self.dino = VitTower(camera["shape"], patch, **dino, cls_token=True, gelu="none")
        self.siglip = VitTower(camera["shape"], patch, **siglip, cls_token=False, gelu="tanh")
        self.n_image_tokens = self.dino.n_patches
        self.bos_before_image = bool(cfg.get("bos_before_image", False))
        width = cfg["width"]
        self.heads = cfg["heads"]
        if width % cfg["heads"] or (width // cfg["heads"]) % 2:
            raise ValueError(f"model.config: width {width} / heads {cfg['heads']} must be an even head size")
        self.head_dim = width // cfg["heads"]
        self.projector = Projector(dino["dim"] + siglip["dim"], width, cfg.get("projector_hidden"))
        self.embed_tokens = nn.Embedding(self.vocab_size, width)
        self.embed_scale = math.sqrt(width)
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.layers = nn.ModuleList(
            [DecoderLayer(width, cfg["heads"], cfg["mlp_hidden"], eps) for _ in range(cfg["depth"])]
        )
        self.norm = RMSNorm(width, eps)
        self.lm_head = nn.Linear(width, self.vocab_size, bias=False)

    def embed(self, token_ids):
        return self.embed_tokens(token_ids) * self.embed_scale

    def action_logits(self, h):
        """Logits of the 256 action ids (the last ones of the tokenizer's vocabulary) for hidden states h
        [B, 1, D]."""
        logits = self.lm_head(self.norm(h))
        if self.text_vocab == self.vocab_size:
            return logits[..., self.vocab_size - N_ACTION_BINS:]
        return logits[..., self.text_vocab - N_ACTION_BINS:self.text_vocab]

    def forward(self, image, prompt_tokens, prompt_mask):
        b, length = prompt_tokens.shape
        n_img = self.n_image_tokens
        features = torch.cat([self.dino(image), self.siglip(image)], dim=-1)
        if self.bos_before_image:  # [BOS ; image ; rest of the prompt], as prismatic builds it
            text = self.embed(prompt_tokens)
            x = torch.cat([text[:, :1], self.projector(features), text[:, 1:]], dim=1)
        else:
            x = torch.cat([self.projector(features), self.embed(prompt_tokens)], dim=1)
        n = n_img + length

        # Prefill: causal attention over [image ; prompt], padded prompt positions masked as keys (right
        # padding: the real tokens, BOS included, are the first n_img + n_real positions either way).
        if self.bos_before_image:
            mask = prompt_mask.to(torch.float32)
            keep = torch.cat([mask[:, :1], torch.ones(b, n_img, dtype=torch.float32), mask[:, 1:]], dim=1)
        else:
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
            token = logits.argmax(dim=-1) + (self.text_vocab - N_ACTION_BINS)          # [B, 1]
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
        return tokens_to_actions(token_ids, self.text_vocab), token_ids, torch.cat(step_logits, dim=1)


def export_spec(view: dict, dims: dict) -> ExportSpec:
    """Builds the policy and its example inputs for `dims` (dim name → size: prompt_len)."""
    inputs = view["inputs"]
    prompt_len = dims["prompt_len"]
    (camera,) = inputs["cameras"]
    vocab = inputs["prompt"]["vocab_size"]
    text_vocab = view["model"]["config"].get("tokenizer_vocab_size", vocab)
    specs = [
        InputSpec(camera["name"], tuple([1] + list(camera["shape"])), "float32"),
        # Prompt ids are text ids: below the 256 action ids at the end of the tokenizer's vocabulary.
        InputSpec(
            "prompt_tokens", (1, prompt_len), "int64", dynamic={1: "prompt_len"},
            pad_value=inputs["prompt"]["pad_id"], sample_range=(1, text_vocab - N_ACTION_BINS - 1),
            value_domain=(0, vocab - 1),
        ),
        InputSpec("prompt_mask", (1, prompt_len), "int64", dynamic={1: "prompt_len"}, sample_range=(1, 1),
                  value_domain=(0, 1)),
    ]
    return ExportSpec(
        module=OpenVlaPolicy(view),
        inputs=specs,
        outputs=["action", "action_tokens", "action_logits"],
        # With BOS split off before the image, the rest of the prompt (prompt_len - 1) must stay a dynamic
        # size, which torch.export allows from 2.
        dim_minimums={"prompt_len": 3 if view["model"]["config"].get("bos_before_image") else 2},
    )
