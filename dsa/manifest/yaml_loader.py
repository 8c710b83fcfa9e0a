"""Reading a manifest file: bounded in size before it is read, YAML parsed by a safe loader that refuses tags,
duplicate keys and alias bombs, and every value's line kept for the messages that name it."""

from __future__ import annotations

import math
import os
import stat
from typing import Any, Dict, Optional, Tuple

import yaml

from dsa.manifest.errors import FieldPath, ManifestError, PathLike, format_field, show_value


# Refuse documents whose aliases expand to more values than this (YAML "billion laughs").
_MAX_VALUES = 100_000
# A manifest is a few kilobytes; a larger file is refused by its size, before it is read or parsed (a 10 MB YAML
# document takes minutes and gigabytes to parse).
MAX_MANIFEST_BYTES = 1 << 20


# ---------------------------------------------------------------------------------------------------------
# YAML


_YAML_TAG_PREFIX = "tag:yaml.org,2002:"
_SAFE_CONSTRUCTORS = yaml.SafeLoader.yaml_constructors


def _construct_checked_scalar(loader: "_Loader", node: yaml.ScalarNode) -> Any:
    """Constructs a null/bool/int/float, refusing values an explicit tag cannot hold and non-finite floats."""
    kind = node.tag[len(_YAML_TAG_PREFIX):]
    try:
        value = _SAFE_CONSTRUCTORS[node.tag](loader, node)
    except (ValueError, KeyError):
        shown = node.value if len(node.value) <= 80 else f"{node.value[:40]}...({len(node.value)} characters)"
        raise loader.problem(
            node, f"{shown!r} is not a valid {kind}", f"fix the value or drop the !!{kind} tag"
        ) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise loader.problem(node, f"non-finite number {node.value!r} is not allowed", "use a finite number")
    return value


def _refuse_tag(loader: "_Loader", node: yaml.Node) -> None:
    tag = node.tag.replace(_YAML_TAG_PREFIX, "!!", 1) if node.tag.startswith(_YAML_TAG_PREFIX) else node.tag
    raise loader.problem(
        node,
        f"YAML tag '{tag}' is not allowed",
        "a manifest holds plain data only: strings, numbers, booleans, null, lists and mappings",
    )


class _Loader(yaml.SafeLoader):
    """A SafeLoader that builds JSON-compatible data and records where every field is.

    Differences from SafeLoader: only the null/bool/int/float/str/seq/map tags are constructed (anything else,
    `!!python/...` included, is refused before construction); dates stay strings; NaN and infinities,
    duplicate keys, non-string keys and recursive aliases are refused. `locate()` must run on the composed
    node before `construct_document()`; it fills `lines` (field path → 1-based line of its key or list item).
    """

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != _YAML_TAG_PREFIX + "timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    yaml_constructors = {
        _YAML_TAG_PREFIX + name: _SAFE_CONSTRUCTORS[_YAML_TAG_PREFIX + name] for name in ("str", "seq", "map")
    }
    yaml_constructors.update(
        {_YAML_TAG_PREFIX + name: _construct_checked_scalar for name in ("null", "bool", "int", "float")}
    )
    yaml_constructors[None] = _refuse_tag

    def __init__(self, text: str, source: str):
        super().__init__(text)
        self.source = source
        self.lines: Dict[FieldPath, int] = {}
        self._paths: Dict[int, FieldPath] = {}  # id(node) → field path of its first occurrence
        self._sizes: Dict[int, int] = {}  # id(node) → number of values it expands to
        self._open: set = set()  # id()s of the nodes being located (to catch recursive aliases)

    def problem(
        self, node: yaml.Node, message: str, hint: str, path: Optional[FieldPath] = None
    ) -> ManifestError:
        """A ManifestError located at `node` (and its field path, if known)."""
        path = self._paths.get(id(node), ()) if path is None else path
        return ManifestError(
            message, file=self.source, line=node.start_mark.line + 1, field=format_field(path), hint=hint
        )

    def locate(self, node: yaml.Node, path: FieldPath = ()) -> int:
        """Records the field paths and lines under `node`, refusing bad keys; returns its expanded size."""
        if id(node) in self._open:
            raise self.problem(node, "recursive YAML alias", "a manifest cannot refer to itself", path)
        if id(node) in self._sizes:
            return self._sizes[id(node)]
        self._paths[id(node)] = path
        self._open.add(id(node))
        size = 1
        if isinstance(node, yaml.MappingNode):
            first_line: Dict[str, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _YAML_TAG_PREFIX + "merge":
                    size += self.locate(value_node, path)
                    continue
                line = key_node.start_mark.line + 1
                name = self.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode) else None
                if not isinstance(name, str):
                    raise self.problem(
                        key_node, "field names must be strings", "write the key as a plain or quoted string", path
                    )
                field = path + (name,)
                if name in first_line:
                    raise self.problem(
                        key_node,
                        f"duplicate field '{name}' (first defined on line {first_line[name]})",
                        "YAML would silently keep the last value; remove one of them",
                        field,
                    )
                first_line[name] = line
                self.lines[field] = line
                size += self.locate(value_node, field)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.lines[path + (i,)] = item.start_mark.line + 1
                size += self.locate(item, path + (i,))
        self._open.discard(id(node))
        if size > _MAX_VALUES:
            raise self.problem(
                node, f"expands to over {_MAX_VALUES} values through YAML aliases", "remove the aliases", path
            )
        self._sizes[id(node)] = size
        return size


def _yaml_syntax_error(err: yaml.MarkedYAMLError, source: str) -> ManifestError:
    """Words PyYAML's error as one line, located where the problem was noticed."""
    where = err.problem_mark or err.context_mark
    parts = [err.context, err.problem]
    if err.context_mark and err.problem_mark and err.context_mark.line != err.problem_mark.line:
        parts[0] = f"{err.context} (line {err.context_mark.line + 1})"
    return ManifestError(
        "invalid YAML: " + ", ".join(part for part in parts if part),
        file=source,
        line=where.line + 1 if where else None,
        hint="check indentation and quoting",
    )


def parse_manifest_file(path: PathLike) -> Tuple[Any, Dict[FieldPath, int]]:
    """Reads and parses a manifest file; returns (document, field path → line)."""
    source = str(path)
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):  # a FIFO or a device would block or never end
            raise ManifestError("not a regular file", file=source, hint="pass a YAML manifest file")
        if info.st_size > MAX_MANIFEST_BYTES:  # checked before anything is read or parsed
            raise ManifestError(
                f"the file is {info.st_size} bytes; a manifest is at most {MAX_MANIFEST_BYTES} bytes",
                file=source, hint="a manifest is a few kilobytes of fields: is this the right file?")
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as err:
        raise ManifestError(f"cannot read manifest: {err.strerror}", file=source, hint="check the path") from None
    if len(data) > MAX_MANIFEST_BYTES:  # grew while being read
        raise ManifestError(f"the file is over {MAX_MANIFEST_BYTES} bytes", file=source,
                            hint="a manifest is a few kilobytes of fields: is this the right file?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ManifestError(
            f"not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})",
            file=source,
            line=data.count(b"\n", 0, err.start) + 1,
            hint="a manifest is a YAML text file; is this a binary file?",
        ) from None
    empty = ManifestError("manifest is empty", file=source, hint="see manifests/pi0.yaml for a complete manifest")
    if not text.strip():
        raise empty
    try:
        loader = _Loader(text, source)  # rejects non-printable characters up front
    except yaml.reader.ReaderError as err:
        raise ManifestError(
            f"not a text file: control character 0x{err.character:02x}",
            file=source,
            line=text.count("\n", 0, err.position) + 1,
            hint="a manifest is a YAML text file; is this a binary file?",
        ) from None
    try:
        node = loader.get_single_node()
        if node is None:
            raise empty
        loader.locate(node)
        document = loader.construct_document(node)
    except yaml.MarkedYAMLError as err:
        raise _yaml_syntax_error(err, source) from None
    except RecursionError:
        raise ManifestError("YAML nesting is too deep", file=source, hint="flatten the document") from None
    finally:
        loader.dispose()
    if not isinstance(document, dict):
        raise ManifestError(
            f"the top level must be a mapping of fields, got {show_value(document)}",
            file=source,
            line=node.start_mark.line + 1,
            hint="see manifests/pi0.yaml for a complete manifest",
        )
    return document, loader.lines
