"""The IREE compiler as the stages call it: where iree-compile is, and the line of its output that says why it
failed. Shared by the export stage (its input-conversion check) and the compile stage, so that neither imports
the other: an edit to one stage reruns only that stage's actions."""

from __future__ import annotations


def iree_compile_path() -> str:
    from iree.compiler.tools.binaries import find_tool

    return find_tool("iree-compile")


def first_error_line(stderr: str) -> str:
    lines = [l for l in stderr.splitlines() if "error:" in l]
    return (lines[0] if lines else stderr.strip().splitlines()[-1] if stderr.strip() else "no message")
