"""Reading a release bundle: every check `dsa run BUNDLE` makes before a byte of it is used, and the verified
bundle extracted (`open_bundle`, `extract_bundle`; `OpenedBundle.stages` gives each kind as its list of models).
What a robot needs: no torch, no compiler. The writer is dsa.stages.bundle (the DsaBundle action), the format
docs/bundle-format.md, the command `dsa bundle verify|list` (dsa/tools/bundle_cli.py).

A reader refuses, with one message naming what failed: an archive whose sha256 differs from the
`NAME.sha256` beside it, a truncated or padded archive, members that are not plain files with plain names,
a bundle format it does not read, and any file whose digest or size differs from bundle.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tarfile
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

# The member names (dsa.core.bundle_layout), importable from here too: what a bundle's reader looks for.
from dsa.core.bundle_layout import (  # noqa: F401
    BUILD_REPORT_JSON, BUNDLE_JSON, EXECUTORCH_KIND, INDEX_JSON, LINK_JSON, LOCK_JSON, MANIFEST_YAML, PARAMS_IRPA,
    PIPELINE_JSON, PLAIN_NAME, POLICY_PIPELINE_CONFIG_JSON, POLICY_PIPELINE_JSON, PROGRAM_PTE, PROVENANCE_JSON,
    PTE_RECORD_JSON, RUNTIME_VIEW_JSON, SHARED_MEMBERS, TARGET_SPEC_JSON)
from dsa.core.errors import DsaError
from dsa.core.fileio import canonical_json, read_json, sha256_file
from dsa.core.formats import (BUNDLE_FORMAT, BUNDLE_FORMATS, EXECUTORCH_BUNDLE_FORMAT, MULTI_TARGET_BUNDLE_FORMAT,
                              BuildReport, Lock, ModuleIndex, PteRecord)
from dsa.core.tarfiles import BLOCK, DIGEST_LINE, RECORD, sidecar_path  # noqa: F401 (sidecar_path re-exported)

# No member of a bundle may be larger (a full-size VLA's parameter archive is a few GB; the largest
# parameter archive a 64-bit IREE runtime maps is far above this, a bundle beyond it is a mistake or an attack).
MAX_MEMBER_BYTES = 64 << 30


@dataclasses.dataclass(frozen=True)
class BundleStage:
    """One model of a verified bundle: a single-model bundle has one (at the root, `name` None), a pipeline
    bundle one per stage, in run order (`<name>.<member>` files)."""

    name: Optional[str]
    model_id: str
    manifest_source: str
    manifest_path: Path
    lock_path: Path
    index_path: Path

    @property
    def lock(self) -> dict:
        return Lock.read(self.lock_path)


def _stage_tables(meta: dict) -> List[dict]:
    """bundle.json's table of each model: its stages, a multi-target bundle's targets (each with the shared
    manifest), or for a single-model bundle bundle.json itself."""
    if _is_multi_target(meta):
        return [dict(t, name=t.get("target"), model_id=meta.get("model_id"), manifest=meta.get("manifest"),
                     manifest_source=meta.get("manifest_source")) for t in meta["targets"]]
    return meta["stages"] if _is_pipeline(meta) else [meta]


@dataclasses.dataclass
class OpenedBundle:
    """A verified bundle, extracted into `root`."""

    archive: Path
    root: Path
    sha256: str
    sidecar: Optional[Path]  # the NAME.sha256 the archive was checked against, or None when there is none
    meta: dict  # bundle.json
    # A multi-target bundle seen as one target's single-model bundle (for_target), or None.
    selected: Optional[str] = None

    @property
    def is_pipeline(self) -> bool:
        return _is_pipeline(self.meta)

    @property
    def is_multi_target(self) -> bool:
        return _is_multi_target(self.meta)

    @property
    def targets(self) -> List[str]:
        """The targets the bundle holds modules for, in preference order."""
        if self.is_multi_target:
            return [t["target"] for t in self.meta["targets"]]
        return [self.meta["target"]]

    @property
    def stages(self) -> List[BundleStage]:
        named = self.is_pipeline or self.is_multi_target
        return [BundleStage(name=t.get("name") if named else None, model_id=t["model_id"],
                            manifest_source=t["manifest_source"], manifest_path=self.root / t["manifest"],
                            lock_path=self.root / t["lock"], index_path=self.root / t["index_file"])
                for t in _stage_tables(self.meta)]

    def _single(self, what: str) -> BundleStage:
        if self.is_pipeline:
            stages = ", ".join(s["name"] for s in self.meta["stages"])
            raise DsaError(str(self.archive), f"is a pipeline bundle (stages {stages}): it has one {what} per stage",
                           "run it with `bin/dsa link run --bundle`; its stages' files are "
                           "<stage>.<file> (docs/bundle-format.md)")
        if self.is_multi_target:
            if self.selected is not None:
                return next(s for s in self.stages if s.name == self.selected)
            raise DsaError(str(self.archive), f"is a multi-target bundle (targets {', '.join(self.targets)}): it "
                           f"has one {what} per target", "choose one target: --target NAME")
        return self.stages[0]

    def target_spec(self, target: str) -> dict:
        """The target spec the bundle holds for `target`."""
        if self.is_multi_target:
            table = next(t for t in self.meta["targets"] if t["target"] == target)
            return read_json(self.root / table["target_spec"])
        return read_json(self.root / self.meta["index"]["target_spec"])

    def why_not_here(self) -> Dict[str, Optional[str]]:
        """target → why this machine cannot run its modules (dsa.runtime.host), or None where it can."""
        from dsa.runtime.host import host_arch, host_cpu_features, missing_driver, missing_for

        arch, features = host_arch(), host_cpu_features()
        out = {}
        for target in self.targets:
            spec = self.target_spec(target)
            out[target] = missing_for(spec, arch, features) or missing_driver(spec)
        return out

    def select_target(self, target: Optional[str] = None) -> BundleStage:
        """The model to run: with `target`, that target's (refused when the bundle has none for it); without,
        the first target in the bundle's order that this machine can execute (its CPU, or a device of its
        runtime driver). Refuses, naming each target and what it needs, when none can run here."""
        if target is not None and target not in self.targets:
            raise DsaError(str(self.archive), f"holds no modules for target '{target}' (it holds "
                           f"{', '.join(self.targets)})", "pass one of the bundle's targets to --target")
        if not self.is_multi_target:
            return self._single("module index")
        if target is None:
            reasons = self.why_not_here()
            target = next((t for t, why in reasons.items() if why is None), None)
            if target is None:
                lines = "; ".join(f"{t} (driver {self.target_spec(t).get('runtime_driver', 'local-task')}): {why}"
                                  for t, why in reasons.items())
                raise DsaError(str(self.archive), f"has no module this machine can run: {lines}",
                               "run it on a device one of its targets names, or build a bundle that also holds "
                               "a target for this machine (dsa_bundle(modules = [...]); docs/targets.md)")
        self.selected = target
        return self._single("module index")

    @property
    def index_path(self) -> Path:
        return self._single("module index").index_path

    @property
    def pipeline_path(self) -> Path:
        if not self.is_pipeline:
            raise DsaError(str(self.archive), "is a single-model bundle, not a pipeline bundle",
                           "run it with `bin/dsa run`")
        return self.root / self.meta["pipeline_file"]

    @property
    def manifest_path(self) -> Path:
        return self._single("manifest").manifest_path

    @property
    def lock(self) -> dict:
        return self._single("recipe lock").lock

    @property
    def build_report(self) -> dict:
        return BuildReport.read(self.root / self.meta["build_report"])

    @property
    def stage_reports(self) -> List[dict]:
        """Each model's build report (with its `stage` name in a pipeline bundle; one per target in a
        multi-target bundle), in run order."""
        report = self.build_report
        if self.is_multi_target:
            return report["targets"]
        return report["stages"] if self.is_pipeline else [report]

    def for_target(self, target: str) -> "OpenedBundle":
        """A multi-target bundle seen as the single-model bundle of one of its targets: its lock, index and
        build report, and its files under their single-model names (`<target>.` dropped) with the shared ones.
        `dsa diff --target` compares two bundles this way."""
        if not self.is_multi_target:
            self.select_target(target)  # refuses another target
            return self
        stage = self.select_target(target)
        table = next(t for t in self.meta["targets"] if t["target"] == target)
        prefix = target + "."
        files = {name[len(prefix):]: entry for name, entry in self.meta["files"].items() if name.startswith(prefix)}
        files.update({name: self.meta["files"][name] for name in SHARED_MEMBERS})
        # What every target shares beyond those: a policy pipeline's spec, processor files and config.
        others = tuple(t + "." for t in self.targets)
        files.update({name: entry for name, entry in self.meta["files"].items()
                      if not name.startswith(others) and name not in (BUNDLE_JSON, BUILD_REPORT_JSON)
                      and name != self.meta["provenance"]})
        # The index as a single-target bundle holds it (its paths without the prefix), so that comparing it
        # with a single-target bundle's compares content, not the layout.
        index = dict(table["index"], target_spec=TARGET_SPEC_JSON,
                     modules=[{k: v[len(prefix):] for k, v in m.items()} for m in table["index"]["modules"]])
        text = ModuleIndex.from_json(index, table["index_file"]).text().encode("utf-8")
        files[INDEX_JSON] = {"sha256": hashlib.sha256(text).hexdigest(), "size": len(text)}
        report = next(r for r in self.build_report["targets"] if r["target"] == target)
        if "policy_pipeline" in self.build_report:
            report = dict(report, policy_pipeline=self.build_report["policy_pipeline"])
        view = tempfile.mkdtemp(prefix="target-", dir=self.root)
        (Path(view) / BUILD_REPORT_JSON).write_text(canonical_json(report), encoding="utf-8")
        meta = {"format": BUNDLE_FORMAT, "model_id": self.meta["model_id"], "target": target,
                "manifest": MANIFEST_YAML, "manifest_source": self.meta["manifest_source"],
                "lock": stage.lock_path.name, "index_file": table["index_file"], "index": index,
                "build_report": str(Path(view).name) + "/" + BUILD_REPORT_JSON,
                "provenance": self.meta["provenance"], "files": files}
        if "policy_pipeline" in self.meta:
            meta["policy_pipeline"] = self.meta["policy_pipeline"]
        return dataclasses.replace(self, meta=meta, selected=None)

    @property
    def provenance(self) -> dict:
        return read_json(self.root / self.meta["provenance"])

    def describe(self) -> str:
        checked = f"matches {self.sidecar.name}" if self.sidecar else "no .sha256 beside it"
        what = (f"pipeline {' → '.join(s.model_id for s in self.stages)}" if self.is_pipeline
                else self.meta["model_id"])
        where = (f"targets {', '.join(self.targets)}" if self.is_multi_target else self.meta["target"])
        return (f"bundle {self.archive.name}: format {self.meta['format']}, {what} for {where}, "
                f"sha256 {self.sha256} ({checked}), {len(self.meta['files'])} files verified")


def _is_pipeline(meta: dict) -> bool:
    """A pipeline bundle (several linked models) rather than one model's."""
    return meta.get("kind") == "pipeline"


def _is_multi_target(meta: dict) -> bool:
    """A multi-target bundle (one model's modules for several targets, format 2)."""
    return meta.get("kind") == "multi-target"


def _is_executorch(meta: dict) -> bool:
    return meta.get("kind") == EXECUTORCH_KIND


def check_archive_digest(archive: Path) -> Tuple[str, Optional[Path]]:
    """The archive's sha256, checked against NAME.sha256 beside it when that exists."""
    archive = Path(archive)
    if not archive.is_file():
        raise DsaError(str(archive), "no such bundle archive", "pass the NAME.tar a dsa_bundle built")
    sha = sha256_file(archive)
    sidecar = sidecar_path(archive)
    if not sidecar.is_file():
        return sha, None
    text = sidecar.read_text(encoding="utf-8", errors="replace").strip()
    match = DIGEST_LINE.match(text)
    if not match or "\n" in text:
        raise DsaError(str(sidecar), "is not one `<sha256>  <file name>` line",
                       "restore it from the release, or delete it to check the files against bundle.json only")
    if match.group(1) != sha:
        raise DsaError(str(archive), f"sha256 is {sha}, but {sidecar.name} records {match.group(1)}",
                       "the archive is corrupted or truncated; copy the release again")
    return sha, sidecar


def _read_error(archive: Path, what: str) -> DsaError:
    return DsaError(str(archive), f"is not a readable bundle archive: {what}",
                    "the archive is truncated or corrupted; copy the release again")


def _extract(archive: Path, dest: Path, listed: Dict[str, dict]) -> Dict[str, Tuple[str, int]]:
    """Extracts the plain-file members into `dest`; returns name → (sha256, size). Refuses links, directories,
    paths, duplicates, sparse members, a member bundle.json does not list or whose declared size is not the
    listed one (before a byte of it is written: the files' sizes are bounded by bundle.json, read first), and an
    archive that does not end exactly where the last member does."""
    found: Dict[str, Tuple[str, int]] = {}
    padding: List[Tuple[int, int]] = []  # (offset, length) of each member's zero padding
    end = 0
    try:
        with tarfile.open(archive, mode="r:") as tar:
            for member in tar:
                name = member.name
                if not member.isreg() or not PLAIN_NAME.match(name) or name in found:
                    kind = "a duplicate of an earlier member" if name in found else (
                        "not a plain file" if not member.isreg() else "not a plain file name")
                    raise DsaError(f"{archive}: member '{name}'", f"is {kind}",
                                   "bundles hold plain files at their root only; this archive was not made "
                                   "by dsa_bundle")
                if member.issparse():
                    raise DsaError(f"{archive}: member '{name}'", "is a sparse file",
                                   "bundles hold plain files only; this archive was not made by dsa_bundle")
                if name != BUNDLE_JSON:
                    if name not in listed:
                        raise DsaError(str(archive), f"holds '{name}', which bundle.json does not list",
                                       "the archive is corrupted or was not made by dsa_bundle")
                    if member.size != listed[name]["size"]:
                        raise DsaError(f"{archive}: {name}", f"declares {member.size} bytes, bundle.json records "
                                       f"{listed[name]['size']}", "the archive is corrupted; copy the release again")
                source = tar.extractfile(member)
                digest = hashlib.sha256()
                size = 0
                with open(dest / name, "wb") as f:
                    for block in iter(lambda: source.read(1 << 20), b""):
                        digest.update(block)
                        f.write(block)
                        size += len(block)
                if size != member.size:
                    raise _read_error(archive, f"member '{name}' ends after {size} of {member.size} bytes")
                found[name] = (digest.hexdigest(), size)
                padding.append((member.offset_data + size, -(-size // BLOCK) * BLOCK - size))
                end = member.offset_data + -(-size // BLOCK) * BLOCK
    except DsaError:
        raise
    except (tarfile.TarError, EOFError, OSError, UnicodeError) as e:
        raise _read_error(archive, str(e) or type(e).__name__) from None
    if not found:
        raise _read_error(archive, "no members")
    # Everything tarfile does not check must be zeros: the padding after each member's data and the
    # end-of-archive blocks, which fill the last record. (Headers carry a checksum, data is in bundle.json.)
    expected = -(-(end + 2 * BLOCK) // RECORD) * RECORD
    actual = archive.stat().st_size
    if actual < expected:
        raise _read_error(archive, f"truncated: {actual} bytes, its last member ends at byte {end} and the "
                          f"archive at {expected}")
    padding.append((end, actual - end))
    with open(archive, "rb") as raw:
        for offset, length in padding:
            raw.seek(offset)
            if raw.read(length).strip(b"\0"):
                what = ("does not end where its last member does (corrupted, or data appended)"
                        if offset == end else f"has non-zero bytes in the padding at byte {offset}")
                raise _read_error(archive, what)
    if actual != expected:
        raise _read_error(archive, f"{actual - expected} bytes of zeros after the end of the archive")
    return found


def extract_pte_bundle(archive: Path, dest: Path) -> dict:
    """Verifies an ExecuTorch bundle into `dest` (sidecar digest, structure, every file against bundle.json, the
    program against its record); returns bundle.json."""
    archive, dest = Path(archive), Path(dest)
    check_archive_digest(archive)
    meta = read_bundle_json(archive)
    if not _is_executorch(meta):
        raise DsaError(str(archive), f"is a {meta.get('kind') or 'single-model'} bundle of IREE modules, not an "
                       "ExecuTorch bundle", "run it with `dsa run`")
    listed = meta.get("files")
    if not isinstance(listed, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("size"), int)
            and not isinstance(e.get("size"), bool) and 0 <= e["size"] <= MAX_MEMBER_BYTES for e in listed.values()):
        raise DsaError(f"{archive}: {BUNDLE_JSON}", "is malformed: 'files' must map each file to its sha256 and size",
                       "this is not a bundle dsa_bundle made")
    if sorted(n for n in listed if not isinstance(n, str) or not PLAIN_NAME.match(n) or n == BUNDLE_JSON):
        raise DsaError(f"{archive}: {BUNDLE_JSON}", "lists a name that is not a plain file name",
                       "this is not a bundle dsa_bundle made")
    for key in ("program", "record", "manifest", "runtime_view", "provenance"):
        if not isinstance(meta.get(key), str) or meta[key] not in listed:
            raise DsaError(f"{archive}: {BUNDLE_JSON}", f"'{key}' names no file of the bundle",
                           "the archive is corrupted or was not made by dsa_bundle")
    dest.mkdir(parents=True, exist_ok=True)
    found = _extract(archive, dest, listed)
    missing = sorted(set(listed) - set(found))
    if missing:
        raise DsaError(str(archive), f"does not hold {', '.join(missing)}", "the archive is corrupted; copy it again")
    for name, (sha, size) in found.items():
        if name != BUNDLE_JSON and (sha, size) != (listed[name]["sha256"], listed[name]["size"]):
            raise DsaError(f"{archive}: {name}", f"has sha256 {sha} ({size} bytes), bundle.json records "
                           f"{listed[name]['sha256']} ({listed[name]['size']} bytes)",
                           "the archive is corrupted; copy the release again")
    record = PteRecord.read(dest / meta["record"])
    if record["pte_sha256"] != found[meta["program"]][0]:
        raise DsaError(f"{archive}: {meta['program']}", "is not the program its record describes",
                       "the archive was not made by dsa_bundle")
    return meta


def read_bundle_json(archive: Path) -> dict:
    """bundle.json of `archive`, after checking that this reader reads its format."""
    archive = Path(archive)
    try:
        with tarfile.open(archive, mode="r:") as tar:
            member = next((m for m in tar if m.name == BUNDLE_JSON), None)
            if member is None or not member.isreg():
                raise DsaError(str(archive), f"has no {BUNDLE_JSON}", "this is not a rules_dsa bundle")
            if member.size > 64 << 20:
                raise DsaError(f"{archive}: {BUNDLE_JSON}", f"is {member.size} bytes",
                               "this is not a rules_dsa bundle")
            data = tar.extractfile(member).read()
    except DsaError:
        raise
    except (tarfile.TarError, EOFError, OSError, UnicodeError) as e:
        raise _read_error(archive, str(e) or type(e).__name__) from None
    try:
        meta = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise DsaError(f"{archive}: {BUNDLE_JSON}", "is nested too deeply to be a bundle's table",
                       "this is not a rules_dsa bundle") from None
    except (ValueError, UnicodeError) as e:
        raise DsaError(f"{archive}: {BUNDLE_JSON}", f"is not valid JSON: {e}",
                       "the archive is corrupted; copy the release again") from None
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt not in BUNDLE_FORMATS or isinstance(fmt, bool):
        readable = ", ".join(str(f) for f in BUNDLE_FORMATS[:-1]) + f" and {BUNDLE_FORMATS[-1]}"
        raise DsaError(f"{archive}: {BUNDLE_JSON}", f"bundle format {fmt!r} is not supported: this reader "
                       f"reads formats {readable}",
                       "a newer rules_dsa wrote it: read it with that release; docs/bundle-format.md lists "
                       "the formats" if isinstance(fmt, int) and fmt > max(BUNDLE_FORMATS)
                       else "this is not a rules_dsa bundle")
    if (fmt == MULTI_TARGET_BUNDLE_FORMAT) != _is_multi_target(meta):
        raise DsaError(f"{archive}: {BUNDLE_JSON}", f"is format {fmt} with kind {meta.get('kind')!r}: format "
                       f"{MULTI_TARGET_BUNDLE_FORMAT} is exactly the multi-target bundles",
                       "the archive is corrupted or was not made by dsa_bundle")
    if (fmt == EXECUTORCH_BUNDLE_FORMAT) != _is_executorch(meta):
        raise DsaError(f"{archive}: {BUNDLE_JSON}", f"is format {fmt} with kind {meta.get('kind')!r}: format "
                       f"{EXECUTORCH_BUNDLE_FORMAT} is exactly the ExecuTorch bundles",
                       "the archive is corrupted or was not made by dsa_bundle")
    return meta


def extract_bundle(archive: Path, dest: Path) -> OpenedBundle:
    """Verifies `archive` (sidecar digest, structure, format, every file against bundle.json) into `dest`."""
    archive = Path(archive)
    dest = Path(dest)
    sha, sidecar = check_archive_digest(archive)
    # The format first: every format keeps bundle.json at the root; the rest of the layout is the format's.
    meta = read_bundle_json(archive)
    if _is_executorch(meta):
        raise DsaError(str(archive), "is an ExecuTorch bundle (format 3): it holds an ExecuTorch program, no IREE "
                       "module", "check it with `dsa bundle verify`; run it with `dsa pte run` in the ExecuTorch "
                       "environment (docs/frontends.md)")
    listed = meta.get("files")
    if not isinstance(listed, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("size"), int)
            and not isinstance(e.get("size"), bool) and 0 <= e["size"] <= MAX_MEMBER_BYTES
            for e in listed.values()) or not _has_index(meta):
        raise DsaError(f"{archive}: {BUNDLE_JSON}", "is malformed: 'files' must map each file to its sha256 "
                       f"and size (at most {MAX_MEMBER_BYTES} bytes), 'index' must be the module index "
                       "('targets' the targets' tables, each with its index, in a multi-target bundle)",
                       "this is not a bundle dsa_bundle made")
    bad_names = sorted(n for n in listed if not isinstance(n, str) or not PLAIN_NAME.match(n) or n == BUNDLE_JSON)
    if bad_names:
        raise DsaError(f"{archive}: {BUNDLE_JSON}", f"lists '{bad_names[0]}', which is not a plain file name",
                       "bundles hold plain files at their root only; this is not a bundle dsa_bundle made")
    dest.mkdir(parents=True, exist_ok=True)
    found = _extract(archive, dest, listed)
    present = set(found) - {BUNDLE_JSON}
    missing = sorted(set(listed) - present)
    extra = sorted(present - set(listed))
    if missing or extra:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unlisted {', '.join(extra)}"] if extra else [])
        raise DsaError(str(archive), f"does not hold the files bundle.json lists: {'; '.join(parts)}",
                       "the archive is corrupted; copy the release again")
    for name in sorted(listed):
        sha_f, size = found[name]
        want = listed[name]
        if size != want.get("size") or sha_f != want.get("sha256"):
            raise DsaError(f"{archive}: {name}", f"has sha256 {sha_f} ({size} bytes), bundle.json records "
                           f"{want.get('sha256')} ({want.get('size')} bytes)",
                           "the archive is corrupted; copy the release again")
    if _is_pipeline(meta):
        stages = meta.get("stages")
        if not isinstance(stages, list) or not stages or not all(isinstance(s, dict) for s in stages):
            raise DsaError(f"{archive}: {BUNDLE_JSON}", "is malformed: a pipeline bundle lists its 'stages'",
                           "the archive is corrupted or was not made by dsa_bundle")
        checks = [(meta, ("build_report", "provenance", "link", "pipeline_file"))]
        indexes = [(meta, "pipeline_file", "pipeline")]
    elif _is_multi_target(meta):
        checks = [(meta, ("build_report", "provenance", "manifest", "parameter_archive", "runtime_view") +
                   (("policy_pipeline",) if "policy_pipeline" in meta else ()))]
        checks += [(table, ("target_spec",)) for table in _stage_tables(meta)]
        indexes = []
    else:
        checks = [(meta, ("build_report", "provenance") + (("policy_pipeline",) if "policy_pipeline" in meta else ()))]
        indexes = []
    checks += [(table, ("manifest", "lock", "index_file")) for table in _stage_tables(meta)]
    indexes += [(table, "index_file", "index") for table in _stage_tables(meta)]
    for table, keys in checks:
        for key in keys:
            if not isinstance(table.get(key), str) or table[key] not in listed:
                raise DsaError(f"{archive}: {BUNDLE_JSON}", f"'{key}' names no file of the bundle",
                               "the archive is corrupted or was not made by dsa_bundle")
    for table, file_key, key in indexes:
        try:
            index = read_json(dest / table[file_key])
        except (ValueError, UnicodeError):
            index = None
        if index != table.get(key):
            raise DsaError(f"{archive}: {table[file_key]}", f"differs from the {key} in bundle.json",
                           "the archive was not made by dsa_bundle")
    if _is_pipeline(meta):
        pipeline = meta["pipeline"]
        named = [("link", pipeline.get("link"))] + [
            (f"stages[{i}].index", s.get("index") if isinstance(s, dict) else None)
            for i, s in enumerate(pipeline.get("stages") if isinstance(pipeline.get("stages"), list) else [None])]
        for field, value in named:
            if not isinstance(value, str) or value not in listed:
                raise DsaError(f"{archive}: {meta['pipeline_file']}", f"'{field}' is {value!r}, which is not a file "
                               "of the bundle", "this archive was not made by dsa_bundle")
    multi = _is_multi_target(meta)
    for table in _stage_tables(meta):
        _check_index_paths(archive, table["index_file"], table["index"], listed)
        if multi:
            _check_target_table(archive, table, meta)
        _check_against_lock(archive, dest, table, found,
                            prefix=f"{table['name']}." if _is_pipeline(meta) or multi else "",
                            shared=SHARED_MEMBERS if multi else ())
    return OpenedBundle(archive=archive, root=dest, sha256=sha, sidecar=sidecar, meta=meta)


def _has_index(meta: dict) -> bool:
    if _is_multi_target(meta):
        targets = meta.get("targets")
        return (isinstance(targets, list) and bool(targets) and all(
            isinstance(t, dict) and isinstance(t.get("target"), str) and PLAIN_NAME.match(t["target"])
            and isinstance(t.get("index"), dict) for t in targets)
            and len({t["target"] for t in targets}) == len(targets))
    return isinstance(meta.get("pipeline" if _is_pipeline(meta) else "index"), dict)


def _check_target_table(archive: Path, table: dict, meta: dict) -> None:
    """A multi-target bundle's target: its index is for that target, names that target's own spec and the
    bundle's one parameter archive and runtime view."""
    index, target = table["index"], table["target"]
    expected = {"target": target, "target_spec": table["target_spec"],
                "parameter_archive": meta["parameter_archive"], "runtime_view": meta["runtime_view"]}
    for key, value in expected.items():
        if index.get(key) != value:
            raise DsaError(f"{archive}: {table['index_file']}", f"'{key}' is {index.get(key)!r}, but the "
                           f"bundle's table of target {target} says {value!r}",
                           "the archive was not made by dsa_bundle")
    for m in index.get("modules", []):
        for key in ("vmfb", "record"):
            if not str(m.get(key, "")).startswith(target + "."):
                raise DsaError(f"{archive}: {table['index_file']}", f"module file {m.get(key)!r} is not one of "
                               f"target {target}'s files ({target}.*)", "the archive was not made by dsa_bundle")


def _index_paths(index: dict) -> List[Tuple[str, object]]:
    """(field, value) of every file a module index names."""
    paths = [(key, index.get(key)) for key in ("target_spec", "parameter_archive", "runtime_view")]
    modules = index.get("modules")
    for i, module in enumerate(modules if isinstance(modules, list) else [None]):
        for key in ("vmfb", "record"):
            paths.append((f"modules[{i}].{key}", module.get(key) if isinstance(module, dict) else None))
    return paths


def _check_index_paths(archive: Path, index_file: str, index: dict, listed: Dict[str, dict]) -> None:
    """Every file the bundle's module index names is one of the bundle's own verified files: not an absolute
    path, not `../`, nothing outside the archive (the runtime would load native code from there)."""
    for field, value in _index_paths(index):
        if not isinstance(value, str) or value not in listed:
            raise DsaError(f"{archive}: {index_file}", f"'{field}' is {value!r}, which is not a file of the bundle",
                           "a bundle's module index names only the bundle's own files; this archive was not "
                           "made by dsa_bundle")


def _check_against_lock(archive: Path, dest: Path, table: dict, found: Dict[str, Tuple[str, int]], *,
                        prefix: str, shared: Sequence[str] = ()) -> None:
    """The bundle's files are the ones its recipe lock pins: each artifact the lock lists is in the bundle with
    the lock's sha256, and so is the manifest (bundle.json alone could be rewritten to match swapped files)."""
    try:
        lock = Lock.read(dest / table["lock"])
    except DsaError as e:
        raise DsaError(f"{archive}: {table['lock']}", f"is not a readable recipe lock ({e})",
                       "the archive is corrupted or was not made by dsa_bundle") from None
    artifacts = lock.get("artifacts")
    manifest = lock.get("manifest")
    if not isinstance(artifacts, dict) or not isinstance(manifest, dict):
        raise DsaError(f"{archive}: {table['lock']}", "is malformed: it has no artifact or manifest digests",
                       "the archive is corrupted or was not made by dsa_bundle")
    pinned = {(name if name in shared else prefix + name): sha for name, sha in artifacts.items()}
    pinned[table["manifest"]] = manifest.get("sha256")
    if table.get("target") is not None and lock.get("target") != table["target"]:
        raise DsaError(f"{archive}: {table['lock']}", f"is the lock of target {lock.get('target')!r}, the bundle "
                       f"lists it for {table['target']!r}", "the archive was not made by dsa_bundle")
    if table.get("target_spec") in found:
        spec = lock.get("target_spec")
        if not isinstance(spec, dict) or found[table["target_spec"]][0] != spec.get("sha256"):
            raise DsaError(f"{archive}: {table['target_spec']}", "is not the target spec the recipe lock pins",
                           "the bundle's files are not the ones its lock was built with: it was altered; copy "
                           "the release again")
    for name, sha in sorted(pinned.items()):
        got = found.get(name, (None, 0))[0]
        if got != sha:
            held = f"has sha256 {got}" if got else "is not in the bundle"
            raise DsaError(f"{archive}: {name}", f"{held}, the recipe lock pins {sha}",
                           "the bundle's files are not the ones its lock was built with: it was altered; copy "
                           "the release again")
    _check_views_against_lock(archive, dest, table, found, lock, prefix)


def _member_json(archive: Path, dest: Path, name: str):
    """An extracted member read as JSON, or a refusal naming it."""
    try:
        return read_json(dest / name)
    except (ValueError, UnicodeError, RecursionError):
        raise DsaError(f"{archive}: {name}", "is not JSON", "copy the release again") from None


def _check_views_against_lock(archive: Path, dest: Path, table: dict, found: Dict[str, Tuple[str, int]],
                              lock: dict, prefix: str) -> None:
    """What the lock pins through the manifest: the runtime view (its digest is in the lock's `views`), and,
    from the view, a pipeline bundle's processor files and policy config (the manifest's `processors` and
    `model.policy_config` pins) and policy_pipeline.json's loop (n_action_steps, flow steps). bundle.json
    alone could be rewritten to cover a swapped n_action_steps or swapped statistics; the lock cannot be,
    short of forging the manifest's digest."""
    views = lock.get("views") if isinstance(lock.get("views"), dict) else {}
    name = next((n for n in (prefix + RUNTIME_VIEW_JSON, RUNTIME_VIEW_JSON) if n in found), None)
    if name is None or not isinstance(views.get("runtime"), str):
        return
    if found[name][0] != views["runtime"]:
        raise DsaError(f"{archive}: {name}", f"has sha256 {found[name][0]}, the recipe lock pins "
                       f"{views['runtime']}", "the bundle's files are not the ones its lock was built with: it "
                       "was altered; copy the release again")
    view = _member_json(archive, dest, name)
    procs = view.get("processors") if isinstance(view, dict) else None
    if not isinstance(procs, dict) or POLICY_PIPELINE_JSON not in found:
        return
    pins = [procs.get("preprocessor"), procs.get("postprocessor"), procs.get("tokenizer"),
            *(procs.get("files") if isinstance(procs.get("files"), list) else [])]
    pins = [(Path(str(p.get("path"))).name, p.get("sha256")) for p in pins if isinstance(p, dict)]
    config = view.get("policy_config")
    if isinstance(config, dict):
        pins.append((POLICY_PIPELINE_CONFIG_JSON, config.get("sha256")))
    for member, sha in pins:
        got = found.get(member, (None, 0))[0]
        if got is not None and got != sha:
            raise DsaError(f"{archive}: {member}", f"has sha256 {got}, the manifest the recipe lock pins says "
                           f"{sha}", "the bundle's processor files are not the ones it was built with: it was "
                           "altered; copy the release again")
    spec = _member_json(archive, dest, POLICY_PIPELINE_JSON)
    loop = spec.get("loop") if isinstance(spec, dict) and isinstance(spec.get("loop"), dict) else {}
    steps = loop.get("steps") if isinstance(loop.get("steps"), dict) else None
    for field, ours, pinned in (("loop.n_action_steps", loop.get("n_action_steps"), view.get("n_action_steps")),
                                ("loop.steps.value", steps.get("value") if steps else None, view.get("flow_steps")
                                 if steps else None)):
        if ours != pinned:
            raise DsaError(f"{archive}: {POLICY_PIPELINE_JSON}", f"{field} is {str(ours)[:40]}, the manifest the "
                           f"recipe lock pins says {pinned}", "the bundle was altered; copy the release again")


@contextlib.contextmanager
def open_bundle(archive: Path) -> Iterator[OpenedBundle]:
    """Verifies and extracts `archive` into a temporary directory, removed on exit."""
    with tempfile.TemporaryDirectory(prefix="dsa-bundle-") as tmp:
        yield extract_bundle(Path(archive), Path(tmp))


def user_path(value: str) -> Path:
    """A path from the command line: as given when it exists, else relative to the directory `bazel run` was
    started in (BUILD_WORKING_DIRECTORY; `bazel run` itself runs in the runfiles tree)."""
    path = Path(value)
    base = os.environ.get("BUILD_WORKING_DIRECTORY")
    if path.is_absolute() or path.exists() or not base:
        return path
    return Path(base) / path
