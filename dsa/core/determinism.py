"""The same numbers on every x86 CPU, for the tools whose output is an artifact.

PyTorch's CPU build calls Intel MKL for BLAS and for vector math (erfinv, exp, log, ... behind `trunc_normal_`
and other initialisers), and MKL picks its code path by CPU: AVX-512 on Intel Xeons, a generic path on AMD.
The paths round differently in the last bit, so a seeded stand-in checkpoint (LeRobot's PI0 and PI0.5: their
SigLIP patch embedding's `trunc_normal_`) came out with one sha256 on an AMD EPYC and another on an Intel Xeon,
and the manifest's pin refused it there (on that Xeon, MKL's automatic choice, AVX-512, and its AVX2 path give
two digests; the generic path gives the pinned one). MKL's Conditional Numerical Reproducibility mode
`COMPATIBLE` runs one code path on every x86 CPU. MKL reads it when it first initialises, which is lazy:
setting it before a tool computes anything is enough, even after `import torch`.

Only the artifact-producing tools set it (their `main`, and each `dsa compile` stage process): the tests'
and the benchmark's eager PyTorch keep MKL's fastest path, so eager is timed as users run it.
"""

from __future__ import annotations

import os

# The environment every artifact-producing tool runs with (also what Bazel's actions get from those tools).
MATH_LIBRARY_ENV = {"MKL_CBWR": "COMPATIBLE"}


def pin_math_libraries() -> None:
    """Set MATH_LIBRARY_ENV in this process (overriding the caller's): call it first thing in a tool's main."""
    os.environ.update(MATH_LIBRARY_ENV)
