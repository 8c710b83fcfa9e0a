"""What LeRobot's PI0 / PI0.5 need from transformers, over stock transformers 4.57.6, plus hermetic small sizes.

THIRD-PARTY-DERIVED CODE. The patch below reproduces, against the transformers 4.57.6 API, the behaviour of
openpi's patched transformers (`src/openpi/models_pytorch/transformers_replace/` of
Physical-Intelligence/openpi: modified copies of transformers 4.53.2's `models/gemma/modeling_gemma.py`,
`models/paligemma/modeling_paligemma.py`, `models/siglip/modeling_siglip.py` and a new
`models/siglip/check.py`). Those files are Copyright 2024 Google Inc. and the HuggingFace Inc. team, modified
by Physical Intelligence, licensed under the Apache License, Version 2.0
(http://www.apache.org/licenses/LICENSE-2.0). This module is a modified re-implementation for transformers
4.57.6: the classes and functions below follow those files' logic, rewritten for 4.57.6's signatures (cache
kwarg `past_key_values`, `DynamicCache.layers`, decoder layers returning a tensor). It is distributed under
the same licence.

LeRobot 0.4.4's `pi0` / `pi05` modeling code expects a transformers with openpi's changes; stock 4.57.6 lacks:

* `transformers.models.siglip.check.check_whether_transformers_replace_is_installed_correctly()`, which
  `PI0Pytorch.__init__` / `PI05Pytorch.__init__` call (ValueError without it);
* Gemma RMS norms that return `(x, gate)` and take an optional condition: plain norms return gate None;
  adaptive (adaRMS) norms have no `weight` but `dense: Linear(cond_dim, 3 * dim)` → scale, shift, gate.
  PI0.5's action expert uses them (`use_adarms=[False, True]`); LeRobot unpacks the tuple everywhere;
* `modeling_gemma._gated_residual(x, y, gate)` (x + y, or x + y * gate), called by LeRobot directly;
* a read-only KV cache: `GemmaAttention` with a cache and `use_cache=False` reads the prefix keys/values and
  concatenates, without appending (stock appends on every call, so the second denoising step fails with a
  mask/key length mismatch);
* `GemmaModel.forward` without the `hidden_states * sqrt(hidden_size)` embedding scaling (LeRobot scales
  language embeddings itself), with an `adarms_cond` argument, and a bf16 cast when the layers are bf16;
* `PaliGemmaModel.get_image_features` without the division by sqrt(text hidden size);
* `SiglipVisionTransformer.forward` casting patch embeddings to bf16 when the encoder layers are bf16.

`apply()` installs exactly those (idempotent), for transformers 4.57.6 and lerobot 0.4.4 only (DsaError
otherwise). It replaces attributes of transformers' gemma / paligemma / siglip modules process-wide; no file
is edited. SmolVLA (llama / SmolVLM / its own SigLIP-style vision model) does not use the patched classes.
Differences from openpi's files that do not matter for rules_dsa (compiled vs eager in one environment):
random init fills plain norms' `weight` with 0 (4.57.6) instead of 1 (4.53.2), and `GemmaForCausalLM.forward`
passes no `adarms_cond` (LeRobot calls `.model.forward`).

Hermetic small sizes (rules_dsa's own mechanism, not from openpi). LeRobot's PI0/PI0.5 configs name the Gemma
sizes by variant only (`paligemma_variant`, `action_expert_variant`: "gemma_2b" / "gemma_300m") and hard-code
SigLIP-So400m. A variant `dsa-gemma:<canonical JSON>` (`gemma_name`) names a small Gemma of the same
architecture: `{"width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"}` and, for the PaliGemma
variant only, `"vision": {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"[,
"patch_size"]}` (the SigLIP tower; its projection goes to `width`). `install_sizes(module)` replaces, in
LeRobot's `modeling_pi0` / `modeling_pi05` module namespace, `get_gemma_config` (the name → sizes lookup:
`dsa-gemma:` names resolved here, any other name to LeRobot's own), and wraps the
`PaliGemmaWithExpertModel` / `PaliGemmaForConditionalGeneration` names so the vision sizes of a `dsa-gemma:`
PaliGemma variant are applied to the config LeRobot builds. LeRobot's config validation accepts only its two
names, so `decode_config` validates with a stand-in name and puts the `dsa-gemma:` name back on the config
object (save_pretrained writes it; config.json never holds a path or a size table elsewhere). Real
checkpoints (`gemma_2b` / `gemma_300m`) go through LeRobot's own lookup unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import sys
import types
from typing import Any, Dict, Mapping, Optional

from dsa.core.errors import DsaError

TRANSFORMERS_VERSION = "4.57.6"
LEROBOT_VERSION = "0.4.4"
GEMMA_SCHEME = "dsa-gemma:"
GEMMA_KEYS = ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim")
VISION_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
VISION_OPTIONAL = ("patch_size",)
VARIANT_FIELDS = ("paligemma_variant", "action_expert_variant")
_STAND_IN = "gemma_300m"

_applied = False


def check_versions() -> None:
    import transformers
    from importlib.metadata import version

    found = (transformers.__version__, version("lerobot"))
    if found != (TRANSFORMERS_VERSION, LEROBOT_VERSION):
        raise DsaError(
            "dsa.frontends.lerobot.third_party.openpi_transformers",
            f"LeRobot PI0/PI0.5 support is written for transformers {TRANSFORMERS_VERSION} and lerobot "
            f"{LEROBOT_VERSION}; found transformers {found[0]} and lerobot {found[1]}",
            "use the rules_dsa LeRobot environment (requirements_lerobot_lock.txt) or update dsa/frontends/lerobot/third_party/openpi_transformers.py",
        )


def apply() -> None:
    """Installs the transformers patch described in the module doc (once; later calls do nothing)."""
    global _applied
    if _applied:
        return
    check_versions()
    _patch = _make_patch()
    _patch()
    _applied = True


def _make_patch():
    import torch
    from torch import nn
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast, BaseModelOutputWithPooling
    from transformers.models.gemma import modeling_gemma as mg
    from transformers.models.paligemma import modeling_paligemma as mp
    from transformers.models.siglip import modeling_siglip as ms

    class AdaRMSNorm(nn.Module):
        """Gemma RMSNorm returning (y, gate); adaptive (scale/shift/gate from `cond`) when cond_dim is set."""

        def __init__(self, dim, eps=1e-6, cond_dim=None):
            super().__init__()
            self.eps = eps
            self.dim = dim
            self.cond_dim = cond_dim
            if cond_dim is not None:
                self.dense = nn.Linear(cond_dim, dim * 3, bias=True)
                nn.init.zeros_(self.dense.weight)
            else:
                self.weight = nn.Parameter(torch.zeros(dim, dtype=torch.bfloat16))
                self.dense = None

        def _norm(self, x):
            var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
            return x * torch.rsqrt(var + self.eps)

        def forward(self, x, cond=None):
            dtype = x.dtype
            normed = self._norm(x)
            if cond is None or self.dense is None:
                normed = normed * (1.0 + self.weight.float())
                return normed.to(dtype), None
            if cond.shape[-1] != self.cond_dim:
                raise ValueError(f"Expected cond dimension {self.cond_dim}, got {cond.shape[-1]}")
            mod = self.dense(cond)
            if x.dim() == 3:
                mod = mod.unsqueeze(1)
            scale, shift, gate = torch.chunk(mod, 3, dim=-1)
            normed = normed * (1 + scale.to(torch.float32)) + shift.to(torch.float32)
            return normed.to(dtype), gate.to(dtype)

        def extra_repr(self):
            return f"{self.dim}, eps={self.eps}, cond_dim={self.cond_dim}"

    def _gated_residual(x, y, gate):
        if x is None and y is None:
            return None
        if x is None or y is None:
            return x if x is not None else y
        if gate is None:
            return x + y
        return x + y * gate

    def _cond_dim(config):
        return getattr(config, "adarms_cond_dim", None) if getattr(config, "use_adarms", False) else None

    def attn_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                     cache_position=None, **kwargs):
        use_cache = kwargs.pop("use_cache", False)
        kwargs.pop("position_ids", None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = mg.apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            if use_cache:
                k, v = past_key_values.update(k, v, self.layer_idx,
                                              {"sin": sin, "cos": cos, "cache_position": cache_position})
            else:  # read-only use of the prefix cache
                layer = past_key_values.layers[self.layer_idx]
                k = torch.cat([layer.keys, k], dim=2)
                v = torch.cat([layer.values, v], dim=2)
        interface = mg.eager_attention_forward
        if self.config._attn_implementation != "eager":
            interface = mg.ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, weights = interface(self, q, k, v, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout,
                                 scaling=self.scaling, **kwargs)
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights

    original_layer_init = mg.GemmaDecoderLayer.__init__

    def layer_init(self, config, layer_idx):
        original_layer_init(self, config, layer_idx)
        cond = _cond_dim(config)
        self.input_layernorm = AdaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, cond_dim=cond)
        self.post_attention_layernorm = AdaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, cond_dim=cond)

    def layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                      use_cache=False, cache_position=None, position_embeddings=None, adarms_cond=None, **kwargs):
        residual = hidden_states
        hidden_states, gate = self.input_layernorm(hidden_states, adarms_cond)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          past_key_values=past_key_values, use_cache=use_cache,
                                          cache_position=cache_position, position_embeddings=position_embeddings,
                                          **kwargs)
        hidden_states = _gated_residual(residual, hidden_states, gate)
        residual = hidden_states
        hidden_states, gate = self.post_attention_layernorm(hidden_states, adarms_cond)
        hidden_states = self.mlp(hidden_states)
        return _gated_residual(residual, hidden_states, gate)

    def model_init(self, config):
        mg.GemmaPreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([mg.GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = AdaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, cond_dim=_cond_dim(config))
        self.rotary_emb = mg.GemmaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def model_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                      inputs_embeds=None, use_cache=None, cache_position=None, adarms_cond=None, **kwargs):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if cache_position is None:
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            cache_position = torch.arange(seen, seen + inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        causal_mask = create_causal_mask(config=self.config, input_embeds=inputs_embeds,
                                         attention_mask=attention_mask, cache_position=cache_position,
                                         past_key_values=past_key_values, position_ids=position_ids)
        hidden_states = inputs_embeds
        if len(self.layers) > 0 and self.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16:
            hidden_states = hidden_states.to(torch.bfloat16)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        # No `hidden_states * sqrt(hidden_size)`: LeRobot scales the language embeddings itself.
        for layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = layer(hidden_states, attention_mask=causal_mask, position_ids=position_ids,
                                  past_key_values=past_key_values, use_cache=use_cache,
                                  cache_position=cache_position, position_embeddings=position_embeddings,
                                  adarms_cond=adarms_cond, **kwargs)
        hidden_states, _ = self.norm(hidden_states, adarms_cond)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states,
                                       past_key_values=past_key_values if use_cache else None)

    def init_weights(self, module):
        # 4.57.6 zeroes `weight` of any class named *RMSNorm*; the adaptive norm has none.
        mg.PreTrainedModel._init_weights(self, module)
        if isinstance(module, AdaRMSNorm) and hasattr(module, "weight"):
            module.weight.data.zero_()

    def get_image_features(self, pixel_values):
        image_outputs = self.vision_tower(pixel_values)
        return self.multi_modal_projector(image_outputs.last_hidden_state)  # no / sqrt(hidden_size)

    def siglip_vision_forward(self, pixel_values, interpolate_pos_encoding=False, **kwargs):
        hidden_states = self.embeddings(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)
        if len(self.encoder.layers) > 0 and self.encoder.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16:
            hidden_states = hidden_states.to(torch.bfloat16)
        encoded = self.encoder(inputs_embeds=hidden_states, **kwargs)
        last = self.post_layernorm(encoded.last_hidden_state)
        pooled = self.head(last) if self.use_head else None
        return BaseModelOutputWithPooling(last_hidden_state=last, pooler_output=pooled)

    def install():
        check = types.ModuleType("transformers.models.siglip.check")
        check.__doc__ = "Installed by dsa.frontends.lerobot.third_party.openpi_transformers: the openpi-equivalent Gemma/PaliGemma/SigLIP patch is applied."
        check.check_whether_transformers_replace_is_installed_correctly = lambda: True
        sys.modules[check.__name__] = check
        mg.GemmaRMSNorm = AdaRMSNorm
        mg._gated_residual = _gated_residual
        mg.GemmaAttention.forward = attn_forward
        mg.GemmaDecoderLayer.__init__ = layer_init
        mg.GemmaDecoderLayer.forward = layer_forward
        mg.GemmaModel.__init__ = model_init
        mg.GemmaModel.forward = model_forward
        mg.GemmaPreTrainedModel._init_weights = init_weights
        mp.PaliGemmaModel.get_image_features = get_image_features
        ms.SiglipVisionTransformer.forward = siglip_vision_forward

    return install


# ------------------------------------------------------------------------------------------------------
# Hermetic small sizes


def gemma_name(sizes: Mapping[str, Any]) -> str:
    """The variant name of a small Gemma (and, for the PaliGemma variant, SigLIP) of PI0's architecture:
    `dsa-gemma:` + canonical JSON of the sizes (see the module doc)."""
    return GEMMA_SCHEME + json.dumps(dict(sizes), sort_keys=True, separators=(",", ":"))


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def gemma_sizes(name: str, where: str, *, vision: Optional[bool]) -> Dict[str, Any]:
    """The sizes of a `dsa-gemma:` name, checked; `vision` says whether a "vision" table is required (the
    PaliGemma variant), refused (the action expert) or either (None)."""
    try:
        sizes = json.loads(name[len(GEMMA_SCHEME):])
    except json.JSONDecodeError as e:
        raise DsaError(where, f"{GEMMA_SCHEME} must be followed by a JSON object: {e}") from None
    if vision is None:
        vision = isinstance(sizes, dict) and "vision" in sizes
    want = set(GEMMA_KEYS) | ({"vision"} if vision else set())
    if not isinstance(sizes, dict) or set(sizes) != want:
        raise DsaError(where, f"{GEMMA_SCHEME} needs exactly the keys {', '.join(sorted(want))}, got "
                       f"{sorted(sizes) if isinstance(sizes, dict) else type(sizes).__name__}")
    for key in GEMMA_KEYS:
        if not _positive_int(sizes[key]):
            raise DsaError(f"{where}: {key}", f"must be a positive int, got {sizes[key]!r}")
    if sizes["num_heads"] % sizes["num_kv_heads"]:
        raise DsaError(f"{where}: num_kv_heads", f"{sizes['num_kv_heads']} does not divide num_heads "
                       f"{sizes['num_heads']}")
    if vision:
        table = sizes["vision"]
        if not isinstance(table, dict) or not set(VISION_KEYS) <= set(table) or not set(table) <= set(
                VISION_KEYS + VISION_OPTIONAL):
            raise DsaError(f"{where}: vision", f"needs the keys {', '.join(VISION_KEYS)} (optional "
                           f"{', '.join(VISION_OPTIONAL)}), got {table!r}")
        for key, value in table.items():
            if not _positive_int(value):
                raise DsaError(f"{where}: vision.{key}", f"must be a positive int, got {value!r}")
        if table["hidden_size"] % table["num_attention_heads"]:
            raise DsaError(f"{where}: vision.num_attention_heads", "must divide vision.hidden_size")
    return sizes


def _is_hermetic(name) -> bool:
    return isinstance(name, str) and name.startswith(GEMMA_SCHEME)


def check_variants(values: Mapping[str, Any], where: str) -> None:
    """Checks the `dsa-gemma:` names among a config dict's variant fields (other names are LeRobot's)."""
    for field in VARIANT_FIELDS:
        if _is_hermetic(values.get(field)):
            gemma_sizes(values[field], f"{where}.{field}", vision=field == "paligemma_variant")
    if _is_hermetic(values.get("action_expert_variant")) != _is_hermetic(values.get("paligemma_variant")):
        raise DsaError(f"{where}.action_expert_variant",
                       "paligemma_variant and action_expert_variant must both be dsa-gemma: names or both "
                       "LeRobot's (gemma_2b / gemma_300m)")


@contextlib.contextmanager
def stand_in_variants(values: Dict[str, Any]):
    """While LeRobot validates a config dict: `dsa-gemma:` variant names replaced by a name LeRobot accepts.
    Yields a function that puts the names back on the decoded config object."""
    names = {f: values[f] for f in VARIANT_FIELDS if _is_hermetic(values.get(f))}
    decoded = dict(values, **{f: _STAND_IN for f in names})

    def restore(cfg):
        for field, name in names.items():
            setattr(cfg, field, name)
        return cfg

    yield decoded, restore


_vision = contextvars.ContextVar("dsa_pi_vision", default=None)


def install_sizes(module) -> None:
    """Makes LeRobot's `modeling_pi0` / `modeling_pi05` module resolve `dsa-gemma:` variant names (see the
    module doc); LeRobot's own names go to its own `get_gemma_config`. Idempotent."""
    if getattr(module, "_dsa_sizes", False):
        return
    lerobot_lookup = module.get_gemma_config
    lerobot_expert_model = module.PaliGemmaWithExpertModel
    lerobot_paligemma = module.PaliGemmaForConditionalGeneration

    def get_gemma_config(variant):
        if not _is_hermetic(variant):
            return lerobot_lookup(variant)
        sizes = gemma_sizes(variant, "config.json: variant", vision=None)
        config = module.GemmaConfig(**{k: sizes[k] for k in GEMMA_KEYS})
        config.dsa_vision = sizes.get("vision")
        return config

    class PaliGemmaWithExpertModel(lerobot_expert_model):
        __doc__ = lerobot_expert_model.__doc__

        def __init__(self, vlm_config, *args, **kwargs):
            token = _vision.set(getattr(vlm_config, "dsa_vision", None))
            try:
                super().__init__(vlm_config, *args, **kwargs)
            finally:
                _vision.reset(token)

    def paligemma(config):
        sizes = _vision.get()
        if sizes is not None:
            vision = config.vision_config
            for key, value in sizes.items():
                setattr(vision, key, value)
            vision.projection_dim = config.text_config.hidden_size
        return lerobot_paligemma(config=config)

    module.get_gemma_config = get_gemma_config
    module.PaliGemmaWithExpertModel = PaliGemmaWithExpertModel
    module.PaliGemmaForConditionalGeneration = paligemma
    module._dsa_sizes = True
