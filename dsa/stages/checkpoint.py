"""DsaCheckpoint: a seeded, architecture-faithful checkpoint for a model whose real weights are not at hand.

The values come from NumPy's PCG64 generator, seeded per tensor from (seed, tensor name), not from torch's
initialisers, so the file is byte-identical on every machine (torch's CPU random kernels differ between
instruction sets). The result is a plain safetensors file: the rules treat it exactly like a user's own
checkpoint, pinned by `checkpoint.sha256` in the manifest.
"""

from __future__ import annotations

import argparse
import math
import zlib
from pathlib import Path
from typing import Dict, List, Optional

from dsa.core.determinism import pin_math_libraries
from dsa.core.errors import run_cli
from dsa.stages.export import NominalDims, load_entry_point
from dsa.core.fileio import atomic_output, read_json


def _init_values(module, seed: int) -> Dict[str, object]:
    """Seeded values for every state_dict entry: LayerNorm 1/0, weights N(0, 1/fan_in), others N(0, 0.02²)."""
    import numpy as np
    from torch import nn

    kinds = {}
    for prefix, sub in module.named_modules():
        for pname, _ in sub.named_parameters(recurse=False):
            kinds[f"{prefix}.{pname}" if prefix else pname] = (type(sub), pname)
    values = {}
    for name, tensor in sorted(module.state_dict().items()):
        shape = tuple(tensor.shape)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])
        owner, pname = kinds.get(name, (None, name))
        if owner is not None and issubclass(owner, nn.LayerNorm):
            arr = np.ones(shape) if pname == "weight" else np.zeros(shape)
        elif pname == "bias":
            arr = rng.standard_normal(shape) * 0.02
        elif owner is not None and issubclass(owner, nn.Embedding):
            arr = rng.standard_normal(shape) / math.sqrt(shape[-1])
        elif len(shape) >= 2 and owner is not None:
            fan_in = int(np.prod(shape[1:]))
            arr = rng.standard_normal(shape) / math.sqrt(fan_in)
        else:
            arr = rng.standard_normal(shape) * 0.02
        values[name] = np.ascontiguousarray(arr.astype(np.float32))
    return values


def make_checkpoint(view: dict, out: Path, *, seed: int, pythonpath=()) -> None:
    """Writes a seeded checkpoint for the model that the export view's entry point builds."""
    from safetensors.numpy import save_file

    spec = load_entry_point(view["model"]["entry_point"], pythonpath)(view, NominalDims())
    values = _init_values(spec.module, seed)
    with atomic_output(out) as tmp:
        # One metadata key only: safetensors writes the metadata map in hash order.
        save_file(values, str(tmp), metadata={"format": "pt"})


def main(argv: Optional[List[str]] = None) -> None:
    pin_math_libraries()  # before any computation: dsa.core.determinism
    parser = argparse.ArgumentParser(prog="dsa-checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--view", required=True, help="the manifest's export view (JSON)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pythonpath", action="append", default=[])
    parser.add_argument("--out", required=True)
    a = parser.parse_args(argv)
    make_checkpoint(read_json(a.view), Path(a.out), seed=a.seed, pythonpath=a.pythonpath)


if __name__ == "__main__":
    run_cli(main, "dsa-checkpoint")
