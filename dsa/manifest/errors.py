"""A problem with a manifest, located as precisely as known (file, line, field), and the field paths it names."""

from __future__ import annotations

import os
from typing import Any, Iterable, Optional, Tuple, Union



PathLike = Union[str, os.PathLike]
FieldPath = Tuple[Union[str, int], ...]


class ManifestError(Exception):
    """A problem with a manifest, located as precisely as known.

    `str()` is one line: `{file}:{line}: {field}: {message} ({hint})`; parts that are unknown (None or empty)
    are left out, e.g. `{file}: {message}` for a file that is not YAML at all.
    """

    def __init__(
        self,
        message: str,
        *,
        file: Optional[str] = None,
        line: Optional[int] = None,
        field: Optional[str] = None,
        hint: Optional[str] = None,
    ):
        super().__init__(message)
        self.message = message
        self.file = file  # the manifest path as given
        self.line = line  # 1-based
        self.field = field  # dotted path with [i] list indices, e.g. "buckets.prompt_len[1]"
        self.hint = hint  # what to do about it

    def __str__(self) -> str:
        where = ":".join(str(part) for part in (self.file, self.line) if part is not None)
        text = ": ".join(part for part in (where, self.field, self.message) if part)
        return f"{text} ({self.hint})" if self.hint else text


def format_field(path: Iterable[Union[str, int]]) -> str:
    """("buckets", "prompt_len", 1) → "buckets.prompt_len[1]"."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


def show_value(value: Any) -> str:
    """A value as an error message quotes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "an empty value"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return f"a list of {len(value)} entries" if value else "an empty list"
    return repr(value)
