"""PI0 / PI0.5 (`pi0`, `pi05`): LeRobot's PI0Policy / PI05Policy as rules_dsa models, over PaliGemma + a Gemma
action expert (dsa.frontends.lerobot.third_party.openpi_transformers). One module serves both types: they
differ in the state input only (PI0.5 writes the state into its prompt).

- PI0 / PI0.5 (`pi0`, `pi05`): inputs `*cameras (B,C,H,W)`, PI0 only `observation.state (B,D)`, the
  prompt `observation.language.tokens` / `.attention_mask` (B, tokenizer_max_length) int64 (mask 0/1; ids of
  PaliGemma's 257152-token vocabulary), `noise (B, chunk_size, max_action_dim)`, and with the kept loop an
  int64 scalar `steps`; output "action" (B, chunk_size, action_dim). PI0.5 has no state input: LeRobot's
  PI0.5 pre-processor writes the binned, normalised state into the prompt text, and
  `PI05Pytorch.sample_actions` takes no state. The manifest's `inputs.state.dim` (required by the schema) is
  still checked against config.json's observation.state feature: it is what that pre-processing tokenises.

    `kept` (default): as SmolVLA's: the prefix (images, language) runs once through PaliGemma's language
    model (`embed_prefix`, `paligemma_with_expert.forward(use_cache=True)`, as `sample_actions`), then a
    while_loop of `steps` Euler steps around the policy's own `denoise_step`, which reads the prefix KV
    cache without changing it (dsa.frontends.lerobot.third_party.openpi_transformers's read-only cache path).

    `unrolled`: `policy.predict_action_chunk(batch, noise=noise)` itself, traced for num_inference_steps.

  dsa.frontends.lerobot.third_party.openpi_transformers patches transformers 4.57.6 the way LeRobot's PI code expects (openpi's patched
  transformers, Apache-2.0; see that module) and resolves `dsa-gemma:<json>` variant names (small Gemma /
  SigLIP sizes, hermetic in config.json; `gemma_2b` / `gemma_300m` stay LeRobot's). Instance-level
  overrides for export, each checked against or equal by construction to the original: `embed_prefix` /
  `embed_suffix` with `with_constant_lists_as_ops`; `_preprocess_images` with `bilinear_resize`; the
  SigLIP position ids and the Gemma RoPE `inv_freq` computed in the graph (non-persistent buffers, in no
  checkpoint); the prefix cache a `_PrefixCache` (a DynamicCache starts from `torch.tensor([])`, a
  constant); and the tied token embedding read through `...paligemma.lm_head.weight`, the name LeRobot's
  save_pretrained keeps. The action expert's LM head is never read (`unused_parameters`). Only
  `dtype: float32` is exported. LeRobot's PI `from_pretrained` prints instead of raising when
  model.safetensors does not load; `load_pretrained` checks every saved tensor arrived.

Reference: `predict_action_chunk(batch, noise=inputs["noise"], num_steps=steps)`. The hooks of a policy
module are described in dsa.frontends.lerobot's module doc.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Dict

from dsa.core.errors import DsaError
from dsa.frontends.lerobot.common import (OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS, OBS_STATE,
                                          SharedModule, building_plain, check_manifest_agrees, decode_config,
                                          feature_shape, functional_with_bilinear_resize, no_precheck,
                                          observation_keys, torch_nn, with_constant_lists_as_ops, with_globals)

TYPES = ("pi0", "pi05")
PI_MAX_STEPS = 1000
building = building_plain
precheck = no_precheck


def classes(policy_type: str):
    """(config class, policy class); applies the openpi transformers patch first, before LeRobot builds any
    Gemma / PaliGemma."""
    from dsa.frontends.lerobot.third_party import openpi_transformers as lerobot_pi

    lerobot_pi.apply()  # before LeRobot builds any Gemma / PaliGemma
    package = f"lerobot.policies.{policy_type}"
    configuration = importlib.import_module(f"{package}.configuration_{policy_type}")
    modeling = importlib.import_module(f"{package}.modeling_{policy_type}")
    lerobot_pi.install_sizes(modeling)
    name = "PI0" if policy_type == "pi0" else "PI05"
    return getattr(configuration, f"{name}Config"), getattr(modeling, f"{name}Policy")


def no_download(values: Dict[str, Any], where: str, *, force: bool) -> None:
    """PI0 / PI0.5 build PaliGemma from configs only; nothing is downloaded."""


def _stand_in_variants(values: Dict[str, Any], where: str):
    """`dsa-gemma:` names are validated by dsa.frontends.lerobot.third_party.openpi_transformers and stand in
    for a name LeRobot accepts while draccus decodes."""
    from dsa.frontends.lerobot.third_party import openpi_transformers as lerobot_pi

    lerobot_pi.check_variants(values, where)
    with lerobot_pi.stand_in_variants(values) as (values, restore):
        pass
    return values, restore


def decode(config_cls, values: Dict[str, Any], where: str):
    """`decode_config` with the `dsa-gemma:` variant names stood in for."""
    return decode_config(config_cls, values, where, stand_in=_stand_in_variants)


def check_loaded(policy, policy_dir: Path) -> None:
    """PI0 / PI0.5's `from_pretrained` prints, instead of raising, when model.safetensors cannot be loaded
    (and returns the random-init model): every tensor of the file must be the policy's, by name."""
    import torch
    from safetensors.torch import load_file

    state = policy.state_dict()
    saved = load_file(str(Path(policy_dir) / "model.safetensors"))
    wrong = [k for k, v in saved.items() if k not in state or not torch.equal(state[k], v)]
    if wrong or not saved:
        raise DsaError(str(Path(policy_dir) / "model.safetensors"),
                       f"LeRobot's {type(policy).__name__}.from_pretrained did not load it: "
                       f"{len(wrong)} of {len(saved)} tensors differ or are missing, e.g. {wrong[:3]}")


# ------------------------------------------------------------------------------------------------------
# Export adapter


def _exportable_pi_images(policy):
    """PI0 / PI0.5's own `_preprocess_images` on this instance, with its `resize_with_pad_torch` seeing
    `F.interpolate` = `bilinear_resize` for the bilinear resize it makes (as SmolVLA's `prepare_images`)."""
    import sys
    import types

    modeling = sys.modules[type(policy).__module__]
    resize = with_globals(modeling.resize_with_pad_torch, F=functional_with_bilinear_resize())
    prepare = with_globals(type(policy)._preprocess_images, resize_with_pad_torch=resize)
    policy._preprocess_images = types.MethodType(prepare, policy)


def _tied_embedding_by_checkpoint_name(paligemma) -> None:
    """PaliGemma ties its language model's `embed_tokens.weight` to `lm_head.weight`, and LeRobot's
    save_pretrained (safetensors' `save_model`) keeps one name of the pair: `...paligemma.lm_head.weight`.
    An exported module names a shared parameter by its first name (`...embed_tokens.weight`, not in the
    file), so on this instance `embed_tokens` becomes a module that reads `lm_head.weight` at call time: the
    adapter's state_dict is then exactly the checkpoint's tensor names, and the embedding lookup reads the
    checkpoint's (tied) tensor."""
    import torch.nn.functional as F

    nn = torch_nn()
    language = paligemma.model.language_model
    embed, head = language.embed_tokens, paligemma.lm_head
    if embed is None or embed.weight is not head.weight:
        return

    class TiedEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            object.__setattr__(self, "head", head)  # not a submodule: lm_head keeps its one name
            self.padding_idx = embed.padding_idx

        def forward(self, ids):
            return F.embedding(ids, self.head.weight, self.padding_idx)

    language.embed_tokens = TiedEmbedding()


def _rotary_in_graph(rotary) -> None:
    """On this Gemma rotary embedding *instance*: `forward` computes `inv_freq` with the module's own
    `rope_init_fn` (arange / pow, graph ops) instead of reading the non-persistent `inv_freq` buffer, which
    is in no checkpoint and would be inlined into the MLIR as a constant. Same body as transformers'
    `GemmaRotaryEmbedding.forward` (default RoPE only; checked equal to the buffer)."""
    import torch

    if getattr(rotary, "_dsa_in_graph", False):
        return
    if rotary.rope_type != "default":
        raise DsaError("Gemma rotary embedding", f"rope_type {rotary.rope_type!r} is not exported",
                       "rules_dsa exports PaliGemma/Gemma with default RoPE")
    inv_freq, scaling = rotary.rope_init_fn(rotary.config, None)
    if not torch.equal(inv_freq, rotary.inv_freq) or scaling != rotary.attention_scaling:
        raise DsaError("Gemma rotary embedding", "recomputing inv_freq does not give the module's buffer",
                       "this transformers version builds RoPE differently; update dsa/frontends/lerobot/pi.py")

    def forward(x, position_ids):
        inv_freq, scaling = rotary.rope_init_fn(rotary.config, None)
        inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq_expanded.float() @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype=x.dtype), (emb.sin() * scaling).to(dtype=x.dtype)

    rotary.forward = forward
    rotary._dsa_in_graph = True


def _siglip_positions_in_graph(embeddings) -> None:
    """On this SigLIP vision embeddings *instance*: `forward` looks the position embedding up with
    `arange(num_positions)` instead of the non-persistent `position_ids` buffer (in no checkpoint; it would be
    inlined into the MLIR). Checked against the original forward on a probe image."""
    import torch

    from torch.func import functional_call

    from dsa.stages.weightless import stand_in_values

    if getattr(embeddings, "_dsa_in_graph", False):
        return
    original = embeddings.forward

    def forward(pixel_values, interpolate_pos_encoding=False):
        if interpolate_pos_encoding:
            return original(pixel_values, interpolate_pos_encoding=True)
        weight = embeddings.patch_embedding.weight
        patches = embeddings.patch_embedding(pixel_values.to(dtype=weight.dtype)).flatten(2).transpose(1, 2)
        ids = torch.arange(embeddings.num_positions, device=pixel_values.device)[None, :]
        return patches + embeddings.position_embedding(ids)

    size = embeddings.image_size
    probe = torch.linspace(-1, 1, 3 * size * size).reshape(1, 3, size, size)
    # Built without weights (the export: dsa.stages.weightless), the check runs on seeded stand-in values.
    values = stand_in_values(embeddings)
    with torch.no_grad():
        expected = functional_call(embeddings, values, (probe,))
        embeddings.forward = forward
        if not torch.equal(expected, functional_call(embeddings, values, (probe,))):
            raise DsaError("SigLIP vision embeddings", "the in-graph position lookup differs from transformers' own",
                           "this transformers version embeds patches differently; update dsa/frontends/lerobot/pi.py")
    embeddings._dsa_in_graph = True


class _PrefixCache:
    """The prefix KV cache of the exported PI0 / PI0.5: filled once by the prefix forward (`update`, as a
    fresh `DynamicCache` fills: its first update returns the new keys/values, cat'ed to an empty tensor) and
    read by the patched Gemma attention through `layers[i].keys / .values` (dsa.frontends.lerobot.third_party.openpi_transformers's read-only path).
    transformers' DynamicCache starts each layer from `torch.tensor([])`, which an export inlines as a
    constant; this one holds only the traced tensors."""

    def __init__(self):
        self.layers = []

    def update(self, keys, values, layer_idx, cache_kwargs=None):
        import types

        if layer_idx != len(self.layers):
            raise DsaError("PI prefix cache", f"layer {layer_idx} filled out of order or twice")
        self.layers.append(types.SimpleNamespace(keys=keys, values=values))
        return keys, values

    def get_seq_length(self, layer_idx=0):
        return self.layers[layer_idx].keys.shape[-2] if self.layers else 0


def make_batch(cfg, observations, tokens, mask):
    """PI0 / PI0.5's batch: cameras (and, PI0 only, the state) by their LeRobot keys, language tokens, and the
    attention mask as LeRobot's tokenizer step makes it (bool) from the int 0/1 input."""
    keys = list(cfg.image_features) + ([OBS_STATE] if cfg.type == "pi0" else [])
    batch = dict(zip(keys, observations))
    batch[OBS_LANGUAGE_TOKENS] = tokens
    batch[OBS_LANGUAGE_ATTENTION_MASK] = mask != 0
    return batch


def adapter(policy, loop: str):
    import sys
    import types

    import torch
    from dsa.stages.loops import kept_loop

    nn = torch_nn()
    cfg = policy.config
    model = policy.model
    make_att_2d_masks = sys.modules[type(model).__module__].make_att_2d_masks
    pi0 = cfg.type == "pi0"
    n_obs = len(cfg.image_features) + (1 if pi0 else 0)
    action_dim = cfg.action_feature.shape[0]
    for name in ("embed_prefix", "embed_suffix"):  # on this instance only
        setattr(model, name, types.MethodType(with_constant_lists_as_ops(getattr(type(model), name)), model))
    _exportable_pi_images(policy)
    _tied_embedding_by_checkpoint_name(model.paligemma_with_expert.paligemma)
    _siglip_positions_in_graph(model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings)
    _rotary_in_graph(model.paligemma_with_expert.paligemma.model.language_model.rotary_emb)
    _rotary_in_graph(model.paligemma_with_expert.gemma_expert.model.rotary_emb)
    backbone = model.paligemma_with_expert
    lerobot_forward = type(backbone).forward

    def forward(self, *args, past_key_values=None, use_cache=None, **kwargs):
        # LeRobot's prefix forward (use_cache, no cache) fills a _PrefixCache instead of a DynamicCache.
        if use_cache and past_key_values is None:
            past_key_values = _PrefixCache()
        return lerobot_forward(self, *args, past_key_values=past_key_values, use_cache=use_cache, **kwargs)

    backbone.forward = types.MethodType(forward, backbone)  # on this instance only
    # sample_actions / denoise_step set these on every call; set once here so that tracing sees no change.
    model.paligemma_with_expert.paligemma.language_model.config._attn_implementation = "eager"
    model.paligemma_with_expert.gemma_expert.model.config._attn_implementation = "eager"

    class PIKeptAdapter(nn.Module):
        """forward(*cameras[, state], tokens, mask, noise, steps): the prefix (images, language) runs once
        through PaliGemma's language model and fills its KV cache (as `sample_actions`; a `_PrefixCache`);
        then a while_loop of `steps` Euler steps around the policy's own `denoise_step`, which reads the cache
        without changing it (dsa.frontends.lerobot.third_party.openpi_transformers's read-only cache; the loop body closes over it: torch lifts its
        tensors into loop inputs)."""

        def __init__(self):
            super().__init__()
            SharedModule.share(self, policy)

        def forward(self, *args):
            observations, (tokens, mask, noise, steps) = args[:n_obs], args[n_obs:]
            batch = make_batch(cfg, observations, tokens, mask)
            images, img_masks = self.policy._preprocess_images(batch)
            state = {"state": self.policy.prepare_state(batch)} if pi0 else {}
            prefix_embs, prefix_pad_masks, prefix_att_masks = model.embed_prefix(
                images, img_masks, batch[OBS_LANGUAGE_TOKENS], batch[OBS_LANGUAGE_ATTENTION_MASK])
            prefix_att_2d_masks = make_att_2d_masks(prefix_pad_masks, prefix_att_masks)
            prefix_position_ids = torch.cumsum(prefix_pad_masks, dim=1) - 1
            _, cache = model.paligemma_with_expert.forward(
                attention_mask=model._prepare_attention_masks_4d(prefix_att_2d_masks),
                position_ids=prefix_position_ids, past_key_values=None, inputs_embeds=[prefix_embs, None],
                use_cache=True)
            # sample_actions: dt = -1 / num_steps, time = 1 + step * dt in Python floats (float64), then a
            # float32 tensor; x_t + dt * v_t multiplies by dt as a float32 scalar.
            dt = -1.0 / steps.to(torch.float64)

            def step(i, x_t):
                time = (1.0 + i.to(torch.float64) * dt).to(torch.float32).expand(x_t.shape[0])
                v_t = model.denoise_step(**state, prefix_pad_masks=prefix_pad_masks, past_key_values=cache,
                                         x_t=x_t, timestep=time)
                return x_t + dt.to(torch.float32) * v_t

            x_t = kept_loop(steps, step, noise)
            return x_t[:, :, :action_dim]

    class PIUnrolledAdapter(nn.Module):
        """forward(*cameras[, state], tokens, mask, noise) = policy.predict_action_chunk(batch, noise=noise):
        LeRobot's own loop of config.num_inference_steps steps, unrolled by tracing."""

        def __init__(self):
            super().__init__()
            SharedModule.share(self, policy)

        def forward(self, *args):
            observations, (tokens, mask, noise) = args[:n_obs], args[n_obs:]
            return self.policy.predict_action_chunk(make_batch(cfg, observations, tokens, mask), noise=noise)

    return PIKeptAdapter() if loop == "kept" else PIUnrolledAdapter()


def export(view: dict, policy, loop: str, batch: int):
    """PI0 / PI0.5's export: inputs `*cameras (B,C,H,W)`, PI0 only `observation.state (B,D)`, the language
    prompt `observation.language.tokens` / `.attention_mask` (B, tokenizer_max_length) int64 (mask 0/1),
    `noise (B, chunk_size, max_action_dim)` and, with the kept loop, the int64 scalar `steps`.

    PI0.5 takes no state input: its pre-processor writes the (normalised, binned) state into the prompt text,
    and `PI05Pytorch.sample_actions` has no state argument. The manifest's `inputs.state.dim` (required by the
    schema) is still checked against config.json's observation.state feature, which is what the runtime's
    pre-processing must turn into prompt tokens."""
    from dsa.stages.spec import ExportSpec, InputSpec

    cfg = policy.config
    where = "config.json"
    if cfg.empty_cameras:
        raise DsaError(f"{where}: empty_cameras", f"is {cfg.empty_cameras}: the export takes the real cameras only",
                       "set empty_cameras to 0")
    if cfg.rtc_config is not None:
        raise DsaError(f"{where}: rtc_config", "real-time chunking needs the previous chunk; not exported",
                       "set rtc_config to null")
    if cfg.n_obs_steps != 1:
        raise DsaError(f"{where}: n_obs_steps", f"is {cfg.n_obs_steps}; {cfg.type} reads one observation step",
                       "set n_obs_steps to 1")
    if cfg.dtype != "float32":
        raise DsaError(f"{where}: dtype", f"is {cfg.dtype!r}; rules_dsa exports PI0 / PI0.5 in float32",
                       "set dtype to \"float32\"")
    keys = [k for k in observation_keys(cfg) if k in cfg.image_features or (k == OBS_STATE and cfg.type == "pi0")]
    vocab = policy.model.paligemma_with_expert.paligemma.config.text_config.vocab_size
    check_manifest_agrees(view, cfg, list(cfg.image_features) + [OBS_STATE], cfg.action_feature.shape[0],
                          vocab=vocab, backbone="PaliGemma")
    pad_id = view["inputs"]["prompt"]["pad_id"]
    dyn = {0: "batch"}
    length = cfg.tokenizer_max_length
    inputs = [InputSpec(k, (batch,) + feature_shape(cfg, k), "float32", dynamic=dyn) for k in keys]
    inputs += [
        InputSpec(OBS_LANGUAGE_TOKENS, (batch, length), "int64", dynamic=dyn, sample_range=(0, vocab - 1),
                  value_domain=(0, vocab - 1), pad_value=pad_id),
        InputSpec(OBS_LANGUAGE_ATTENTION_MASK, (batch, length), "int64", dynamic=dyn, sample_range=(1, 1),
                  value_domain=(0, 1)),
        InputSpec("noise", (batch, cfg.chunk_size, cfg.max_action_dim), "float32", dynamic=dyn),
    ]
    if loop == "kept":
        inputs.append(InputSpec("steps", (), "int64", value_range=(1, PI_MAX_STEPS)))
    return ExportSpec(module=adapter(policy, loop), inputs=inputs, outputs=["action"],
                      dim_minimums={"batch": 1})


def reference(policy, tensors, steps):
    """LeRobot's eager `predict_action_chunk(batch, noise=tensors["noise"], num_steps=steps)`, under
    torch.no_grad."""
    cfg = policy.config
    keys = list(cfg.image_features) + ([OBS_STATE] if cfg.type == "pi0" else [])  # PI0.5's state is in its prompt
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise DsaError("reference_actions: inputs", f"missing {', '.join(missing)}")
    for name in (OBS_LANGUAGE_TOKENS, OBS_LANGUAGE_ATTENTION_MASK, "noise"):
        if name not in tensors:
            raise DsaError("reference_actions: inputs", f"missing {name}")
    batch = make_batch(cfg, [tensors[k] for k in keys], tensors[OBS_LANGUAGE_TOKENS],
                       tensors[OBS_LANGUAGE_ATTENTION_MASK])
    return policy.predict_action_chunk(batch, noise=tensors["noise"], num_steps=steps)
