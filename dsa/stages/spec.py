"""The contract between model code and the rule set.

A model package exposes an entry point `export_spec(view, dims) -> ExportSpec`, named in the manifest as
`model.entry_point: package.module:function`. `view` is the manifest's export view (a dict); `dims` maps each
named dynamic dimension to the size to export at (a bucket size, or a representative size).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One positional input of the exported entry point."""

    name: str
    shape: Tuple[int, ...]
    dtype: str
    # axis → dynamic dim name, for the axes whose size varies (e.g. {1: "prompt_len"}).
    dynamic: Dict[int, str] = dataclasses.field(default_factory=dict)
    # Inclusive range of values an integer scalar input may take (e.g. flow steps).
    value_range: Optional[Tuple[int, int]] = None
    # Inclusive range of plausible values of an integer tensor input (token ids, a 0/1 mask), used for
    # example and sample inputs.
    sample_range: Optional[Tuple[int, int]] = None
    # Inclusive range every value of an integer tensor input must lie in (token ids: [0, vocab - 1], a mask:
    # [0, 1]): the runtime refuses any other value before it calls the module, where an embedding lookup
    # outside its table would read out of bounds or crash.
    value_domain: Optional[Tuple[int, int]] = None
    # Value that fills the padded part of a dynamic axis when the runner pads up to a shape bucket.
    pad_value: float = 0

    def example(self, rng: np.random.Generator) -> torch.Tensor:
        """A deterministic example value (used for tracing and parity inputs)."""
        if self.value_range is not None:
            lo, hi = self.value_range
            return torch.tensor(min(max(2, lo), hi), dtype=DTYPES[self.dtype]).reshape(self.shape)
        if self.dtype.startswith("float"):
            arr = rng.standard_normal(self.shape).astype(np.float32)
            return torch.from_numpy(arr).to(DTYPES[self.dtype])
        if self.dtype == "bool":
            return torch.ones(self.shape, dtype=torch.bool)
        lo, hi = self.sample_range or (0, 1)
        return torch.from_numpy(rng.integers(lo, hi + 1, size=self.shape)).to(DTYPES[self.dtype])


@dataclasses.dataclass
class ExportSpec:
    module: torch.nn.Module
    inputs: List[InputSpec]
    outputs: List[str]
    # The smallest size each dynamic dim may be exported at (buckets below it are refused).
    dim_minimums: Dict[str, int] = dataclasses.field(default_factory=dict)
    # Decompositions applied to the exported program before import: op overload (for example a
    # `torch.library.custom_op`'s `torch.ops.ns.name.default`, or an ATen op IREE cannot lower) → a function of
    # the op's arguments written with ops IREE lowers. Eager PyTorch keeps calling the op's own kernel; the
    # compiled module computes the decomposition (models/custom_op is the example).
    decompositions: Dict[object, Callable] = dataclasses.field(default_factory=dict)

    def dynamic_dim_names(self) -> List[str]:
        names = []
        for spec in self.inputs:
            for name in spec.dynamic.values():
                if name not in names:
                    names.append(name)
        return names
