"""SmolVLA (`smolvla`): LeRobot's SmolVLAPolicy as a rules_dsa model, with a hermetic SmolVLM backbone.

- SmolVLA: inputs `*cameras (B,C,H,W)`, `observation.state (B,D)`, `observation.language.tokens` and
  `observation.language.attention_mask` (B, tokenizer_max_length) int64 (mask 0/1; LeRobot's bool mask is
  `mask != 0`), `noise (B, chunk_size, max_action_dim)`, and with the kept loop an int64 scalar `steps`;
  output "action" (B, chunk_size, action_dim).

    `kept` (default): the prefix (images, language, state) runs once through the VLM with LeRobot's own
    `embed_prefix` and `vlm_with_expert.forward(fill_kv_cache=True)`, as `sample_actions` does; then a
    while_loop of `steps` Euler steps (dt = -1/steps, time = 1 + i*dt, as sample_actions computes them in
    float64) calls the policy's own `VLAFlowMatching.denoise_step`. The KV cache (one key and one value
    tensor per VLM layer) is closed over by the loop body; torch lifts those tensors into loop inputs.

    `unrolled`: `policy.predict_action_chunk(batch, noise=noise)` itself, traced for config.num_steps.

  Three overrides on the *policy instance* (no file of LeRobot or transformers is edited), each checked or
  tested against the original: (1) the SmolVLM vision embeddings' forward for the full patch mask SmolVLA
  always uses (transformers' own loops over the batch and sizes aranges by mask sums); (2) SmolVLA's
  `embed_prefix` / `embed_suffix` run with `torch.tensor(<flat list>)` made by `torch.full`/`torch.cat`
  (a constant would be inlined in the MLIR, and torch 2.14 cannot functionalise a while_loop body that
  creates one); (3) `prepare_images` resizes with `bilinear_resize` (IREE lowers neither
  `aten.upsample_bilinear2d` nor its decomposition; <= 3e-6 from ATen's kernel).

  SmolVLA's VLM backbone is named by `vlm_model_name`. `dsa-smolvlm:<json of SmolVLMConfig sizes>`
  (`smolvlm_name`) is a hermetic SmolVLM: whenever LeRobot builds the policy (init, export,
  `reference_actions`) dsa.frontends.lerobot.smolvla writes its config.json and processor files (a synthetic tokenizer of
  text_config.vocab_size ids) into a temporary directory and points LeRobot at it, so the policy
  directory stays config.json + model.safetensors and config.json holds the name, never a path. Any other
  name is LeRobot's: a real checkpoint's `HuggingFaceTB/SmolVLM2-500M-Video-Instruct` works offline when
  the HF cache holds that repo's config and processor files (HF_HUB_OFFLINE=1; the VLM weights are never
  downloaded: `load_vlm_weights` is forced false, the weights come from model.safetensors). Random init
  refuses `load_vlm_weights: true`. The VLM's LM head and final norm are never read at inference: they
  are the export record's `unused_parameters`.

Reference: `predict_action_chunk(batch, noise=inputs["noise"])` with `steps` flow-matching steps (None: the
config's num_steps). The hooks of a policy module are described in dsa.frontends.lerobot's module doc.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Mapping

from dsa.core.errors import DsaError
from dsa.frontends.lerobot.common import (OBS_ENV_STATE, OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS,
                                          OBS_STATE, SharedModule, check_manifest_agrees, decode_plain,
                                          feature_shape, functional_with_bilinear_resize, loaded_as_is,
                                          no_precheck, observation_keys, torch_nn, with_constant_lists_as_ops,
                                          with_globals)
from dsa.frontends.lerobot.common import no_download as _no_download

TYPES = ("smolvla",)
# SmolVLA's `vlm_model_name` scheme for a hermetic SmolVLM backbone (see `smolvlm_name`).
SMOLVLM_SCHEME = "dsa-smolvlm:"
SMOLVLM_KEYS = ("scale_factor", "text_config", "vision_config")
SMOLVLA_MAX_STEPS = 1000
decode = decode_plain
check_loaded = loaded_as_is
precheck = no_precheck


def classes(policy_type: str):
    """(config class, policy class)."""
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    return SmolVLAConfig, SmolVLAPolicy


def no_download(values: Dict[str, Any], where: str, *, force: bool) -> None:
    """`load_vlm_weights` must be false: the VLM weights come from model.safetensors (random init: none)."""
    _no_download(values, where, force=force, field="load_vlm_weights", off=False, what="VLM")


# ------------------------------------------------------------------------------------------------------
# SmolVLA's hermetic SmolVLM backbone


def smolvlm_name(sizes: Mapping[str, Any]) -> str:
    """The `vlm_model_name` of a hermetic SmolVLM backbone: `dsa-smolvlm:` + canonical JSON of
    `{"scale_factor": int, "text_config": {...}, "vision_config": {...}}` (transformers' `SmolVLMConfig`
    arguments; text_config is a llama config). dsa.frontends.lerobot writes that backbone's config.json and processor
    files into a temporary directory whenever LeRobot builds the policy, so the policy directory stays
    exactly config.json + model.safetensors and config.json holds this name, not a path."""
    return SMOLVLM_SCHEME + json.dumps(dict(sizes), sort_keys=True, separators=(",", ":"))


def _smolvlm_sizes(name: str, where: str) -> Dict[str, Any]:
    text = name[len(SMOLVLM_SCHEME):]
    try:
        sizes = json.loads(text)
    except json.JSONDecodeError as e:
        raise DsaError(where, f"{SMOLVLM_SCHEME} must be followed by a JSON object: {e}") from None
    if not isinstance(sizes, dict) or set(sizes) != set(SMOLVLM_KEYS):
        raise DsaError(where, f"{SMOLVLM_SCHEME} needs exactly the keys {', '.join(SMOLVLM_KEYS)}, got "
                       f"{sorted(sizes) if isinstance(sizes, dict) else type(sizes).__name__}")
    if not isinstance(sizes["text_config"], dict) or not isinstance(sizes["vision_config"], dict):
        raise DsaError(where, "text_config and vision_config must be JSON objects")
    if sizes["text_config"].get("model_type", "llama") != "llama":
        raise DsaError(f"{where}: text_config.model_type", "SmolVLM's text model is llama")
    vocab = sizes["text_config"].get("vocab_size")
    if not isinstance(vocab, int) or vocab < len(_SMOLVLM_SPECIALS) + 2:
        raise DsaError(f"{where}: text_config.vocab_size",
                       f"must be an int of at least {len(_SMOLVLM_SPECIALS) + 2}, got {vocab!r}")
    return sizes


# The synthetic tokenizer's special tokens (SmolVLM's own strings); the rest of its vocabulary is w0, w1, ...
_SMOLVLM_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
                     "<global-img>", "<end_of_utterance>", "<unk>")


def write_smolvlm(sizes: Mapping[str, Any], out_dir: Path) -> None:
    """A SmolVLM backbone directory LeRobot's `SmolVLMWithExpertModel` accepts as `model_id` (no weights:
    LeRobot builds it with `SmolVLMForConditionalGeneration(AutoConfig.from_pretrained(dir))` when
    load_vlm_weights is false): `SmolVLMConfig(**sizes)` and a `SmolVLMProcessor` whose tokenizer is a
    synthetic word-level one of text_config.vocab_size ids with SmolVLM's special tokens (LeRobot reads
    `fake_image_token_id` and `global_image_token_id` from it). Token ids are the policy's interface; text is
    never tokenised by the exported module."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (PreTrainedTokenizerFast, SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor,
                              SmolVLMVideoProcessor)

    out_dir = Path(out_dir)
    text_config = dict(sizes["text_config"], model_type="llama")
    vocab_size = text_config["vocab_size"]
    words = [f"w{i}" for i in range(vocab_size - len(_SMOLVLM_SPECIALS))]
    vocab = {token: i for i, token in enumerate(list(_SMOLVLM_SPECIALS) + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<|endoftext|>", bos_token="<|im_start|>",
        eos_token="<end_of_utterance>", model_max_length=text_config.get("max_position_embeddings", 8192),
        extra_special_tokens={"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                              "end_of_utterance_token": "<end_of_utterance>", "global_image_token": "<global-img>"})
    vision = sizes["vision_config"]
    side = vision.get("image_size", 224) // vision.get("patch_size", 32)
    image_seq_len = max(1, side * side // (sizes["scale_factor"] ** 2))
    processor = SmolVLMProcessor(image_processor=SmolVLMImageProcessor(), video_processor=SmolVLMVideoProcessor(),
                                 tokenizer=tokenizer, image_seq_len=image_seq_len)
    processor.save_pretrained(str(out_dir))
    config = SmolVLMConfig(image_token_id=vocab["<image>"], scale_factor=sizes["scale_factor"],
                           pad_token_id=vocab["<|endoftext|>"], vision_config=dict(vision),
                           text_config=text_config)
    config.save_pretrained(str(out_dir))


@contextlib.contextmanager
def _vlm_source(cfg, where: str = "config.json: vlm_model_name"):
    """While LeRobot builds a SmolVLA policy from `cfg`: a `dsa-smolvlm:` name is replaced by a temporary
    directory holding that backbone (`write_smolvlm`), and put back afterwards (so `save_pretrained` writes
    the name, never the path). Any other name (a hub id such as HuggingFaceTB/SmolVLM2-500M-Video-Instruct,
    found offline in the HF cache, or a local directory) is left to LeRobot/transformers."""
    name = getattr(cfg, "vlm_model_name", None)
    if not isinstance(name, str) or not name.startswith(SMOLVLM_SCHEME):
        yield
        return
    sizes = _smolvlm_sizes(name, where)
    tmp = Path(tempfile.mkdtemp(prefix="dsa-smolvlm-"))
    try:
        try:
            write_smolvlm(sizes, tmp)
        except DsaError:
            raise
        except Exception as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DsaError(where, f"cannot make the SmolVLM backbone: {type(e).__name__}: {text}") from None
        cfg.vlm_model_name = str(tmp)
        yield
    finally:
        cfg.vlm_model_name = name
        shutil.rmtree(tmp, ignore_errors=True)


building = _vlm_source


# ------------------------------------------------------------------------------------------------------
# Export adapter


def _full_mask_vision_embeddings(policy) -> None:
    """Replaces, on this policy's SmolVLM vision embeddings *instance* (no file of transformers is edited),
    `forward` by its value for a full patch mask, which is what SmolVLA always passes (`embed_image` calls the
    vision model with patch_attention_mask=None → all ones). transformers' own forward loops over the batch
    (`for p_attn_mask in patch_attention_mask`) and sizes `arange`s by mask sums, which torch.export cannot
    trace for a dynamic batch; with a full mask and the image as large as the vision config's image_size
    (SmolVLA resizes every camera to resize_imgs_with_padding) its position ids depend on static sizes
    only; they are computed with the same float ops, `bucketize(x, b, right=True)` written as the count of
    boundaries <= x. Checked against the original forward on a probe image."""
    import torch

    from torch.func import functional_call

    from dsa.stages.weightless import stand_in_values

    vision = policy.model.vlm_with_expert.get_vlm_model().vision_model
    emb = vision.embeddings
    if getattr(emb, "_dsa_full_mask", False):
        return
    cfg = policy.config
    size = tuple(cfg.resize_imgs_with_padding or ())
    if size != (emb.image_size, emb.image_size):
        raise DsaError("config.json: resize_imgs_with_padding",
                       f"is {list(size) or None}; the export needs every camera resized to the vision encoder's "
                       f"image_size ({emb.image_size}x{emb.image_size})",
                       f"set resize_imgs_with_padding to [{emb.image_size}, {emb.image_size}]")
    original = emb.forward

    def forward(pixel_values, patch_attention_mask=None):
        patches = emb.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        side_h, side_w = pixel_values.shape[2] // emb.patch_size, pixel_values.shape[3] // emb.patch_size
        per_side = emb.num_patches_per_side
        boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side, device=pixel_values.device)

        def buckets(n):  # transformers' fractional coords, bucketize(right=True) as a count of boundaries <= x
            coords = torch.arange(n, device=pixel_values.device, dtype=pixel_values.dtype) / n * (1 - 1e-6)
            return (boundaries[None, :] <= coords[:, None]).sum(-1)

        ids = (buckets(side_h)[:, None] * per_side + buckets(side_w)).flatten()[None, :]
        return patches + emb.position_embedding(ids)

    probe = torch.linspace(-1, 1, 3 * emb.image_size ** 2).reshape(1, 3, emb.image_size, emb.image_size)
    side = emb.image_size // emb.patch_size
    # Built without weights (the export: dsa.stages.weightless), the check runs on seeded stand-in values.
    values = stand_in_values(emb)
    with torch.no_grad():
        want = functional_call(emb, values, (), {"pixel_values": probe,
                                                 "patch_attention_mask": torch.ones(1, side, side, dtype=torch.bool)})
        emb.forward = forward
        got = functional_call(emb, values, (probe,))
        emb.forward = original
    if not torch.equal(want, got):
        raise DsaError("SmolVLM vision embeddings", "the full-mask embedding differs from transformers' own",
                       "this transformers version embeds patches differently; update dsa/frontends/lerobot/smolvla.py")
    emb.forward = forward
    emb._dsa_full_mask = True


def _exportable_prepare_images(policy):
    """SmolVLA's own `prepare_images` on this instance, with its `resize_with_pad` seeing `F.interpolate` =
    `bilinear_resize` for the bilinear resize it makes (anything else goes to torch's interpolate)."""
    import types

    from lerobot.policies.smolvla import modeling_smolvla

    resize = with_globals(modeling_smolvla.resize_with_pad, F=functional_with_bilinear_resize())
    prepare = with_globals(type(policy).prepare_images, resize_with_pad=resize)
    policy.prepare_images = types.MethodType(prepare, policy)


def make_batch(cfg, observations, tokens, mask):
    """SmolVLA's batch: cameras and state by their LeRobot keys, language tokens, and the attention mask as
    LeRobot's tokenizer step makes it (bool) from the int 0/1 input."""
    batch = dict(zip(list(cfg.image_features) + [OBS_STATE], observations))
    batch[OBS_LANGUAGE_TOKENS] = tokens
    batch[OBS_LANGUAGE_ATTENTION_MASK] = mask != 0
    return batch


def adapter(policy, loop: str):
    import types

    import torch
    from dsa.stages.loops import kept_loop
    from lerobot.policies.smolvla.modeling_smolvla import make_att_2d_masks

    nn = torch_nn()
    cfg = policy.config
    model = policy.model
    n_obs = len(cfg.image_features) + 1
    action_dim = cfg.action_feature.shape[0]
    _full_mask_vision_embeddings(policy)
    for name in ("embed_prefix", "embed_suffix"):  # on this instance only
        setattr(model, name, types.MethodType(with_constant_lists_as_ops(getattr(type(model), name)), model))
    _exportable_prepare_images(policy)

    class SmolVLAKeptAdapter(nn.Module):
        """forward(*cameras, state, tokens, mask, noise, steps): the prefix (images, language, state) runs
        once through the VLM and fills LeRobot's KV cache (`fill_kv_cache=True`, as `sample_actions`); then a
        while_loop of `steps` Euler steps around the policy's own `VLAFlowMatching.denoise_step`, which reads
        the cache (closed over by the loop body: torch lifts its tensors into loop inputs)."""

        def __init__(self):
            super().__init__()
            SharedModule.share(self, policy)

        def forward(self, *args):
            observations, (tokens, mask, noise, steps) = args[:n_obs], args[n_obs:]
            batch = self.policy._prepare_batch(make_batch(cfg, observations, tokens, mask))
            images, img_masks = self.policy.prepare_images(batch)
            state = self.policy.prepare_state(batch)
            prefix_embs, prefix_pad_masks, prefix_att_masks = model.embed_prefix(
                images, img_masks, batch[OBS_LANGUAGE_TOKENS], batch[OBS_LANGUAGE_ATTENTION_MASK], state=state)
            prefix_att_2d_masks = make_att_2d_masks(prefix_pad_masks, prefix_att_masks)
            prefix_position_ids = torch.cumsum(prefix_pad_masks, dim=1) - 1
            _, cache = model.vlm_with_expert.forward(
                attention_mask=prefix_att_2d_masks, position_ids=prefix_position_ids, past_key_values=None,
                inputs_embeds=[prefix_embs, None], use_cache=True, fill_kv_cache=True)
            layers = sorted(cache)
            keys = [cache[i]["key_states"] for i in layers]
            values = [cache[i]["value_states"] for i in layers]
            # sample_actions: dt = -1 / num_steps, time = 1 + step * dt in Python floats (float64), then a
            # float32 tensor; x_t + dt * v_t multiplies by dt as a float32 scalar.
            dt = -1.0 / steps.to(torch.float64)

            def step(i, x_t):
                time = (1.0 + i.to(torch.float64) * dt).to(torch.float32).expand(x_t.shape[0])
                past = {n: {"key_states": k, "value_states": v} for n, k, v in zip(layers, keys, values)}
                v_t = model.denoise_step(x_t=x_t, prefix_pad_masks=prefix_pad_masks, past_key_values=past,
                                         timestep=time)
                return x_t + dt.to(torch.float32) * v_t

            x_t = kept_loop(steps, step, noise)
            actions = x_t[:, :, :action_dim]
            if cfg.adapt_to_pi_aloha:
                actions = self.policy._pi_aloha_encode_actions(actions)
            return actions

    class SmolVLAUnrolledAdapter(nn.Module):
        """forward(*cameras, state, tokens, mask, noise) = policy.predict_action_chunk(batch, noise=noise):
        LeRobot's own loop of config.num_steps steps, unrolled by tracing."""

        def __init__(self):
            super().__init__()
            SharedModule.share(self, policy)

        def forward(self, *args):
            observations, (tokens, mask, noise) = args[:n_obs], args[n_obs:]
            self.policy.reset()
            return self.policy.predict_action_chunk(make_batch(cfg, observations, tokens, mask), noise=noise)

    return SmolVLAKeptAdapter() if loop == "kept" else SmolVLAUnrolledAdapter()


def export(view: dict, policy, loop: str, batch: int):
    """SmolVLA's export: inputs `*cameras (B,C,H,W)`, `observation.state (B,D)`, the language prompt
    `observation.language.tokens` / `.attention_mask` (B, tokenizer_max_length) int64 (mask 0/1), `noise
    (B, chunk_size, max_action_dim)` and, with the kept loop, the int64 scalar `steps`."""
    from dsa.stages.spec import ExportSpec, InputSpec

    cfg = policy.config
    where = "config.json"
    if cfg.empty_cameras:
        raise DsaError(f"{where}: empty_cameras", f"is {cfg.empty_cameras}: the export takes the real cameras only",
                       "set empty_cameras to 0")
    if not cfg.use_cache:
        raise DsaError(f"{where}: use_cache", "is false: SmolVLA samples actions from the prefix KV cache",
                       "set use_cache to true")
    if cfg.rtc_config is not None:
        raise DsaError(f"{where}: rtc_config", "real-time chunking needs the previous chunk; not exported",
                       "set rtc_config to null")
    if cfg.n_obs_steps != 1:
        raise DsaError(f"{where}: n_obs_steps", f"is {cfg.n_obs_steps}; SmolVLA reads one observation step",
                       "set n_obs_steps to 1")
    keys = [k for k in observation_keys(cfg) if k != OBS_ENV_STATE]  # SmolVLA reads no environment state
    vocab = policy.model.vlm_with_expert.config.text_config.vocab_size
    check_manifest_agrees(view, cfg, keys, cfg.action_feature.shape[0], vocab=vocab, backbone="SmolVLM")
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
        inputs.append(InputSpec("steps", (), "int64", value_range=(1, SMOLVLA_MAX_STEPS)))
    return ExportSpec(module=adapter(policy, loop), inputs=inputs, outputs=["action"],
                      dim_minimums={"batch": 1})


def reference(policy, tensors, steps):
    """LeRobot's eager `predict_action_chunk(batch, noise=tensors["noise"])` with `steps` flow-matching steps
    (None: the config's num_steps), under torch.no_grad."""
    cfg = policy.config
    keys = observation_keys(cfg)
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise DsaError("reference_actions: inputs", f"missing {', '.join(missing)}")
    for name in (OBS_LANGUAGE_TOKENS, OBS_LANGUAGE_ATTENTION_MASK, "noise"):
        if name not in tensors:
            raise DsaError("reference_actions: inputs", f"missing {name}")
    if steps is not None:
        cfg.num_steps = int(steps)  # read by VLAFlowMatching.sample_actions
    keys = [k for k in keys if k != OBS_ENV_STATE]
    batch = make_batch(cfg, [tensors[k] for k in keys], tensors[OBS_LANGUAGE_TOKENS],
                       tensors[OBS_LANGUAGE_ATTENTION_MASK])
    return policy.predict_action_chunk(batch, noise=tensors["noise"])
