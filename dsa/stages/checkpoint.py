"""DsaCheckpoint: a seeded, architecture-faithful checkpoint for a model whose real weights are not at hand.

The values come from NumPy's PCG64 generator, seeded per tensor from (seed, tensor name), not from torch's
initialisers, so the file is byte-identical on every machine (torch's CPU random kernels differ between
instruction sets). The result is a plain safetensors file: the rules treat it exactly like a user's own
checkpoint, pinned by `checkpoint.sha256` in the manifest. It is generated and written one tensor at a time
(the header first, from each state_dict entry's name and shape), so a multi-billion-parameter stand-in needs
the memory of its largest tensor, not of the model; the model itself is only asked for its structure.
"""

from __future__ import annotations

import argparse
import math
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dsa.core.determinism import pin_math_libraries
from dsa.core.errors import DsaError, run_cli
from dsa.stages.export import NominalDims, load_entry_point
from dsa.core.fileio import read_json
from dsa.stages.tensor_files import numpy_dtype, plan_shards, write_safetensors, write_sharded_safetensors


def _owners(module) -> Dict[str, Tuple[Optional[type], str]]:
    """Each parameter's owning module type and its attribute name, by state_dict name (meta tensors work:
    nothing here reads a value)."""
    kinds = {}
    for prefix, sub in module.named_modules():
        for pname, _ in sub.named_parameters(recurse=False):
            kinds[f"{prefix}.{pname}" if prefix else pname] = (type(sub), pname)
    return kinds


_CHUNK = 1 << 22  # values drawn at a time: 32 MiB of float64


def init_value(name: str, shape: Tuple[int, ...], owner, pname: str, seed: int, chunk: int = _CHUNK):
    """One tensor's seeded values: LayerNorm 1/0, weights N(0, 1/fan_in), others N(0, 0.02²), as float32.

    The normals are drawn in float64 and scaled there, then stored as float32, `chunk` values at a time into
    the float32 result: NumPy's generator gives the same stream whatever the draws' sizes, so the values are
    those of one draw of the whole tensor, and a 2 GB embedding needs 2 GB (not 10: a float64 draw, its
    scaled copy and the float32 cast)."""
    import numpy as np
    from torch import nn

    if owner is not None and issubclass(owner, nn.LayerNorm):
        return (np.ones if pname == "weight" else np.zeros)(shape, dtype=np.float32)
    if pname == "bias":
        scale, divide = 0.02, False
    elif owner is not None and issubclass(owner, nn.Embedding):
        scale, divide = math.sqrt(shape[-1]), True
    elif len(shape) >= 2 and owner is not None:
        scale, divide = math.sqrt(int(np.prod(shape[1:]))), True
    else:
        scale, divide = 0.02, False
    rng = np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])
    out = np.empty(shape, dtype=np.float32)
    flat = out.reshape(-1)
    for start in range(0, flat.size, chunk):
        values = rng.standard_normal(min(chunk, flat.size - start))
        if divide:
            values /= scale
        else:
            values *= scale
        flat[start:start + values.size] = values
    return out


def init_plan(module) -> Dict[str, Tuple[Tuple[int, ...], Optional[type], str]]:
    """{state_dict name: (shape, owning module type, attribute name)}, in name order: what `init_value`
    needs, taken from the module's structure only (its tensors may be on the meta device)."""
    kinds = _owners(module)
    plan = {}
    for name, tensor in sorted(module.state_dict(keep_vars=True).items()):
        owner, pname = kinds.get(name, (None, name))
        plan[name] = (tuple(tensor.shape), owner, pname)
    return plan


def init_values(module, seed: int) -> Dict[str, object]:
    """Seeded values for every state_dict entry, all at once (small models and tests; `make_checkpoint`
    generates them one at a time)."""
    return {name: init_value(name, shape, owner, pname, seed)
            for name, (shape, owner, pname) in init_plan(module).items()}


# The float dtypes a seeded checkpoint can be written in (values drawn in float32, then rounded).
CHECKPOINT_DTYPES = ("float32", "bfloat16")


def make_checkpoint(view: dict, out: Path, *, seed: int, pythonpath=(), dtype: str = "float32",
                    shards: int = 0) -> Path:
    """Writes a seeded checkpoint for the model that the export view's entry point builds, one tensor at a
    time (dsa.stages.tensor_files.write_safetensors: the same bytes as safetensors' save_file of all of them).
    The model is built without its weights (dsa.stages.weightless): only its structure is read. `dtype`:
    bfloat16 rounds every float tensor (as large models are saved). `shards` > 0: a sharded checkpoint in the
    directory `out` (Hugging Face's model-0000i-of-0000N.safetensors and model.safetensors.index.json, the
    tensors split in name order into `shards` files of about equal size). Returns the file to pin: `out`, or
    the index."""
    import numpy as np

    from dsa.stages.weightless import without_weights

    if dtype not in CHECKPOINT_DTYPES:
        raise DsaError("--dtype", f"is {dtype!r}", f"use one of {', '.join(CHECKPOINT_DTYPES)}")
    with without_weights():
        spec = load_entry_point(view["model"]["entry_point"], pythonpath)(view, NominalDims())
        plan = init_plan(spec.module)
    del spec  # the values never come from the model's own tensors

    def produce(name: str):
        shape, owner, pname = plan[name]
        value = init_value(name, shape, owner, pname, seed)
        return value if dtype == "float32" else value.astype(numpy_dtype(dtype))

    entries = [(name, dtype, shape) for name, (shape, _, _) in plan.items()]
    # One metadata key only: safetensors writes the metadata map in hash order.
    if not shards:
        write_safetensors(out, entries, produce, metadata={"format": "pt"})
        return Path(out)
    sizes = [math.prod(shape) * np.dtype(numpy_dtype(dtype)).itemsize for _, _, shape in entries]
    low, high = -(-sum(sizes) // shards), max(sum(sizes), 1)
    while low < high:  # the smallest shard size that splits the tensors into at most `shards` files
        middle = (low + high) // 2
        if len(plan_shards(entries, middle)) <= shards:
            high = middle
        else:
            low = middle + 1
    if len(plan_shards(entries, low)) != shards:
        raise DsaError("--shards", f"the model's {len(entries)} tensors cannot be split into {shards} shards of "
                       "about equal size", "ask for fewer shards")
    return write_sharded_safetensors(out, entries, produce, low, metadata={"format": "pt"})


def main(argv: Optional[List[str]] = None) -> None:
    pin_math_libraries()  # before any computation: dsa.core.determinism
    parser = argparse.ArgumentParser(prog="dsa-checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--view", required=True, help="the manifest's export view (JSON)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pythonpath", action="append", default=[])
    parser.add_argument("--dtype", choices=CHECKPOINT_DTYPES, default="float32", help="float dtype of the weights")
    parser.add_argument("--shards", type=int, default=0,
                        help="write a sharded checkpoint of this many shards into the directory --out")
    parser.add_argument("--out", required=True, help="the .safetensors file (a directory with --shards)")
    a = parser.parse_args(argv)
    if a.shards < 0:
        raise DsaError("--shards", f"is {a.shards}", "give a positive number of shards, or none")
    make_checkpoint(read_json(a.view), Path(a.out), seed=a.seed, pythonpath=a.pythonpath, dtype=a.dtype,
                    shards=a.shards)


if __name__ == "__main__":
    run_cli(main, "dsa-checkpoint")
