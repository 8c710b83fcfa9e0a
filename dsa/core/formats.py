"""The format version of each artifact the rule set writes, in one place, and the typed artifact classes.

A reader refuses a format it does not know; docs/manifest.md and docs/bundle-format.md say when a version
moves. Every writer and reader takes its version from here, so two modules can never disagree.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Tuple

from dsa.core.errors import DsaError
from dsa.core.fileio import canonical_json, read_json, write_bytes_atomic

# <name>.modules.json: the module index the runtime loads (dsa_vmfb, dsa compile).
INDEX_FORMAT = 1
# Parameter archives (.irpa): each entry's metadata is this prefix + JSON {type, dtype, shape}, as
# iree-turbine's ParameterArchiveBuilder writes it, so turbine's ParameterArchive reads ours back.
PARAMETER_METADATA_PREFIX = "PYTORCH:"
# <name>.lock.json: the recipe lock (DsaLock, dsa compile).
LOCK_FORMAT = 1
# link.json: the checked edges of a dsa_pipeline (DsaLink).
LINK_FORMAT = 1
# <name>.pipeline.json: the stages of a dsa_pipeline, in run order.
PIPELINE_INDEX_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class ModuleIndex:
    """`<name>.modules.json`: what a runner loads — the compiled modules of one model for one target, each with
    its export record, and the files they share. Paths are relative to the index's directory. The one writer
    (dsa_vmfb's DsaLock action, `dsa compile`, the bundle writer) and reader of the format INDEX_FORMAT."""

    target: str
    target_spec: str
    parameter_archive: str
    parameter_scope: str
    runtime_view: str
    modules: Tuple[Tuple[str, str], ...]  # (vmfb, export record), in the order given

    _FIELDS = ("target", "target_spec", "parameter_archive", "parameter_scope", "runtime_view")

    def to_json(self) -> dict:
        return {
            "format": INDEX_FORMAT,
            **{name: getattr(self, name) for name in self._FIELDS},
            "modules": [{"vmfb": vmfb, "record": record} for vmfb, record in self.modules],
        }

    def text(self) -> str:
        return canonical_json(self.to_json())

    def write(self, path: Path) -> None:
        write_bytes_atomic(path, self.text().encode("utf-8"))

    @classmethod
    def from_json(cls, data, where: str) -> "ModuleIndex":
        if not isinstance(data, dict):
            raise DsaError(where, "is not a module index (a JSON object)", "pass a NAME.modules.json")
        if data.get("format") != INDEX_FORMAT:
            raise DsaError(where, f"module index format {data.get('format')} is not supported",
                           f"this release reads format {INDEX_FORMAT}")
        missing = [name for name in cls._FIELDS + ("modules",) if name not in data]
        if missing:
            raise DsaError(where, f"module index lacks {', '.join(missing)}", "rebuild it")
        try:
            modules = tuple((m["vmfb"], m["record"]) for m in data["modules"])
        except (TypeError, KeyError):
            raise DsaError(where, "modules: each entry needs vmfb and record", "rebuild it") from None
        return cls(**{name: data[name] for name in cls._FIELDS}, modules=modules)

    @classmethod
    def read(cls, path: Path) -> "ModuleIndex":
        return cls.from_json(read_json(path), str(path))
