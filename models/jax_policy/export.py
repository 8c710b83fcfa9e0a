"""Writes the JAX policy (policy.py) as a framework-stablehlo model: its StableHLO module, as jax.export writes
it (`exported.mlir_module()`, unchanged), and its weights as a safetensors file keyed by pytree path.

    python export.py --manifest manifests/jax_policy.yaml --seed 0 \
        --mlir model.stablehlo.mlir --params params.safetensors

The module is exported for one platform (cpu) at batch 1, with static shapes (IREE takes no symbolic dims from
JAX), and with no Python traceback in its locations, so that the bytes depend on the architecture alone: not on
the weights, the seed, the checkout path or the machine. Runs in @dsa_jax_python (requirements_jax.in).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import policy  # noqa: E402


def stablehlo_text(sizes: dict, batch: int = 1) -> str:
    """The StableHLO module of `policy.apply` at `batch`: weights the leading (pytree) argument."""
    import jax

    # Locations carry the pytree paths of the arguments (the import needs them) and, for each op, one frame of
    # policy.py by file name alone (JAX's canonicalisation regex drops the directory), never the checkout path.
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    jax.config.update("jax_hlo_source_file_canonicalization_regex", r".*/")
    params = policy.nest({n: jax.ShapeDtypeStruct(s, np.float32) for n, s in policy.param_shapes(sizes).items()})
    obs = {sizes["camera"]: jax.ShapeDtypeStruct([batch] + sizes["image"], np.float32),
           "state": jax.ShapeDtypeStruct((batch, sizes["state"]), np.float32)}

    def apply(params, obs):
        return policy.apply(params, obs, camera=sizes["camera"])

    exported = jax.export.export(jax.jit(apply), platforms=["cpu"])(params, obs)
    return exported.mlir_module()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mlir", help="write the StableHLO module here")
    parser.add_argument("--params", help="write the weights (safetensors) here")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sizes = policy.io_sizes(yaml.safe_load(Path(args.manifest).read_text(encoding="utf-8")))
    if args.mlir:
        Path(args.mlir).write_text(stablehlo_text(sizes), encoding="utf-8")
    if args.params:
        from safetensors.numpy import save_file

        save_file(policy.init_params(sizes, args.seed), args.params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
