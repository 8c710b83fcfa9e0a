"""A small ACT-style policy written in JAX (no Flax): a strided-conv image encoder, a state token, a pre-norm
transformer encoder over [state, image patches], and a decoder whose action-chunk queries cross-attend to it.
It is the StableHLO front end's example (framework stablehlo, docs/frontends.md): export.py writes its
StableHLO module with jax.export and its weights as a safetensors file keyed by pytree path; the parity test
runs this same `apply` eagerly in JAX.

Parameters are a nested dict of float32 arrays; observations a dict {camera name: [B, C, H, W], "state": [B, S]}.
"""

from __future__ import annotations

import math
from typing import Dict

import numpy as np

# The architecture; the manifest gives the I/O sizes (state dim, camera shape, chunk size, action dim).
WIDTH = 64
HEADS = 4
ENCODER_LAYERS = 2
MLP_RATIO = 4
STEM = ((32, 4), (64, 2))  # (channels, kernel = stride) of the two patchifying convolutions


def io_sizes(manifest: dict) -> dict:
    """The sizes the manifest declares: one camera, the state, the action chunk."""
    (camera,) = manifest["inputs"]["cameras"]
    return {"camera": camera["name"], "image": list(camera["shape"]), "state": manifest["inputs"]["state"]["dim"],
            "chunk": manifest["chunk_size"], "action": manifest["outputs"]["action"]["dim"]}


def _layer_shapes() -> Dict[str, tuple]:
    d, h = WIDTH, WIDTH * MLP_RATIO
    return {"ln1.g": (d,), "ln1.b": (d,), "qkv.w": (d, 3 * d), "qkv.b": (3 * d,), "proj.w": (d, d), "proj.b": (d,),
            "ln2.g": (d,), "ln2.b": (d,), "fc1.w": (d, h), "fc1.b": (h,), "fc2.w": (h, d), "fc2.b": (d,)}


def param_shapes(sizes: dict) -> Dict[str, tuple]:
    """Dotted parameter name → shape (the names jax.tree_util gives the nested dict, joined with '.')."""
    c, hgt, wid = sizes["image"]
    shapes = {}
    cin = c
    for i, (cout, k) in enumerate(STEM):
        shapes[f"stem.conv{i}.w"] = (cout, cin, k, k)
        shapes[f"stem.conv{i}.b"] = (cout,)
        cin = cout
        hgt, wid = hgt // k, wid // k
    shapes["stem.out.w"] = (cin, WIDTH)
    shapes["stem.out.b"] = (WIDTH,)
    shapes["state.w"] = (sizes["state"], WIDTH)
    shapes["state.b"] = (WIDTH,)
    shapes["pos"] = (1 + hgt * wid, WIDTH)
    for layer in range(ENCODER_LAYERS):
        for name, shape in _layer_shapes().items():
            shapes[f"encoder.l{layer}.{name}"] = shape
    shapes["decoder.queries"] = (sizes["chunk"], WIDTH)
    for name in ("ln_q.g", "ln_q.b", "ln_m.g", "ln_m.b", "ln2.g", "ln2.b"):
        shapes[f"decoder.{name}"] = (WIDTH,)
    for name, shape in (("q.w", (WIDTH, WIDTH)), ("q.b", (WIDTH,)), ("kv.w", (WIDTH, 2 * WIDTH)),
                        ("kv.b", (2 * WIDTH,)), ("proj.w", (WIDTH, WIDTH)), ("proj.b", (WIDTH,)),
                        ("fc1.w", (WIDTH, WIDTH * MLP_RATIO)), ("fc1.b", (WIDTH * MLP_RATIO,)),
                        ("fc2.w", (WIDTH * MLP_RATIO, WIDTH)), ("fc2.b", (WIDTH,))):
        shapes[f"decoder.{name}"] = shape
    shapes["head.w"] = (WIDTH, sizes["action"])
    shapes["head.b"] = (sizes["action"],)
    return shapes


def init_params(sizes: dict, seed: int) -> Dict[str, np.ndarray]:
    """Deterministic float32 weights (numpy's PCG64, not JAX's PRNG: the same bytes whatever the JAX version):
    fan-in scaled normals for matrices and kernels, ones for norm gains, small values for biases."""
    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in sorted(param_shapes(sizes).items()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "g":
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif leaf == "b":
            value = 0.02 * rng.standard_normal(shape)
        else:
            fan_in = int(np.prod(shape[1:])) if len(shape) == 4 else shape[0]
            value = rng.standard_normal(shape) / math.sqrt(fan_in)
        flat[name] = value.astype(np.float32)
    return flat


def nest(flat: Dict[str, np.ndarray]) -> dict:
    """{"a.b.c": x} → {"a": {"b": {"c": x}}}."""
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *path, leaf = name.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def apply(params: dict, obs: dict, *, camera: str):
    """The action chunk [B, chunk, action] for `obs`."""
    import jax
    import jax.numpy as jnp

    def layer_norm(x, p):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]

    def linear(x, p):
        return x @ p["w"] + p["b"]

    def attention(q, k, v):
        b, lq, _ = q.shape
        lk = k.shape[1]
        dh = WIDTH // HEADS
        q = q.reshape(b, lq, HEADS, dh).transpose(0, 2, 1, 3)
        k = k.reshape(b, lk, HEADS, dh).transpose(0, 2, 1, 3)
        v = v.reshape(b, lk, HEADS, dh).transpose(0, 2, 1, 3)
        weights = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh), axis=-1)
        return (weights @ v).transpose(0, 2, 1, 3).reshape(b, lq, WIDTH)

    x = obs[camera]
    for i in range(len(STEM)):
        conv = params["stem"][f"conv{i}"]
        k = conv["w"].shape[-1]
        x = jax.lax.conv_general_dilated(x, conv["w"], window_strides=(k, k), padding="VALID",
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
        x = jax.nn.relu(x + conv["b"][None, :, None, None])
    b, c = x.shape[:2]
    patches = linear(x.reshape(b, c, -1).transpose(0, 2, 1), params["stem"]["out"])
    state = linear(obs["state"], params["state"])[:, None, :]
    h = jnp.concatenate([state, patches], axis=1) + params["pos"][None]
    for layer in range(ENCODER_LAYERS):
        p = params["encoder"][f"l{layer}"]
        y = layer_norm(h, p["ln1"])
        q, k, v = jnp.split(linear(y, p["qkv"]), 3, axis=-1)
        h = h + linear(attention(q, k, v), p["proj"])
        h = h + linear(jax.nn.gelu(linear(layer_norm(h, p["ln2"]), p["fc1"]), approximate=True), p["fc2"])
    d = params["decoder"]
    queries = jnp.broadcast_to(d["queries"][None], (b,) + d["queries"].shape)
    memory = layer_norm(h, d["ln_m"])
    k, v = jnp.split(linear(memory, d["kv"]), 2, axis=-1)
    a = queries + linear(attention(linear(layer_norm(queries, d["ln_q"]), d["q"]), k, v), d["proj"])
    a = a + linear(jax.nn.gelu(linear(layer_norm(a, d["ln2"]), d["fc1"]), approximate=True), d["fc2"])
    return jnp.tanh(linear(a, params["head"]))
