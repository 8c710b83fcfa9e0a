"""Helpers for tests of compiled policies: locate build outputs in runfiles, build the eager reference."""

from __future__ import annotations

import os
from pathlib import Path

from dsa.stages.export import load_entry_point


def runfile(short_path: str) -> Path:
    """A workspace-relative path inside the test's runfiles tree (or the cwd outside Bazel)."""
    srcdir = os.environ.get("TEST_SRCDIR")
    if srcdir:
        return Path(srcdir) / os.environ["TEST_WORKSPACE"] / short_path
    return Path(short_path)


def eager_policy(export_view: dict, dims: dict, checkpoint: Path):
    """The model as eager PyTorch, with the checkpoint's weights: the reference compiled modules must match."""
    from safetensors.torch import load_file

    spec = load_entry_point(export_view["model"]["entry_point"])(export_view, dims)
    module = spec.module.eval()
    module.load_state_dict(load_file(str(checkpoint)), strict=True)
    return module, spec
