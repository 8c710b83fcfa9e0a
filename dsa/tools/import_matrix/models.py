"""The models of the matrix (the policies index the build writes), their build outputs and test results."""

from __future__ import annotations

import dataclasses
import datetime
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError
from dsa.core.fileio import read_json
from dsa.core.formats import (FILE_FRONT_ENDS, POLICIES_INDEX_FORMAT,  # noqa: F401 (POLICIES_INDEX_FORMAT: API)
                              ExportRecord, PipelineIndex)


NOT_RUN = "not run"


# -- the models --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model of models/BUILD.bazel: its dsa_vmfb (or dsa_pipeline) name and the test that checks parity."""

    name: str
    test: str                         # Bazel label of the parity test
    stages: Tuple[str, ...] = ()      # a dsa_pipeline: its stages (dsa_vmfb names) when no pipeline.json is built

    @property
    def is_pipeline(self) -> bool:
        return bool(self.stages)


# The policies index //models:policies_index writes (dsa_policies: discovered from the dsa_policy targets of
# models/BUILD.bazel, never listed by hand). Row order: the policies in BUILD order, then the pipelines; a
# policy that is a pipeline's stage is part of the pipeline's row.
POLICIES_INDEX = "models/policies_index.json"
# The real-size policies (tagged real_size: manual targets), indexed apart by the same dsa_policies call.
POLICIES_REAL_SIZE_INDEX = "models/policies_real_size_index.json"


def read_import_sources(bin_dir: Path) -> Dict[str, dict]:
    """Per policy (dsa_vmfb name): what `dsa compile` needs to build it without Bazel — its manifest,
    checkpoint, policy_config, model_file and python (None: the toolchain's) — as the policies index gives
    them."""
    index = json.loads((bin_dir / POLICIES_INDEX).read_text())
    return {p["name"]: p for p in index["policies"] if "manifest" in p}


def read_models(bin_dir: Path, index_file: str = POLICIES_INDEX) -> List[ModelSpec]:
    """The table's rows, from the policies index (or the real-size index, `index_file`) under `bin_dir`."""
    path = bin_dir / index_file
    if not path.is_file():
        target = "//models:" + Path(index_file).stem
        raise DsaError(str(path), "no policies index", f"build it: `./bazelw build {target}` "
                       + ("(it builds no model; build the real-size policies themselves by hand)"
                          if index_file == POLICIES_REAL_SIZE_INDEX else
                          "(or run `./bazelw run //tools:import_matrix`, which builds every policy)"))
    index = json.loads(path.read_text())
    if index.get("format") != POLICIES_INDEX_FORMAT:
        raise DsaError(str(path), f"policies index format {index.get('format')!r} is not supported",
                       f"this release reads format {POLICIES_INDEX_FORMAT}; rebuild //models:policies_index")
    staged = {stage for p in index["pipelines"] for stage in p["stages"]}
    rows = [ModelSpec(p["name"], p["test"]) for p in index["policies"] if p["name"] not in staged]
    rows += [ModelSpec(p["name"], p["test"], stages=tuple(p["stages"])) for p in index["pipelines"]]
    return rows


# -- test results --------------------------------------------------------------------------------------------
def test_xml_dir(testlogs: Path, label: str) -> Path:
    """bazel-testlogs/<pkg>/<name> for `//pkg:name`."""
    package, _, name = label.lstrip("/").partition(":")
    return testlogs / package / name


def parse_test_result(test_dir: Path) -> dict:
    """A Bazel test's result from its test.xml files (one per shard/run): {"status": "passed" | "failed" |
    "not run", "tests", "failures", "skipped", "date"}. JUnit XML as pytest writes it, or as Bazel writes it for
    a test that wrote none (a crash or timeout: one failed testcase)."""
    files = sorted(test_dir.rglob("test.xml")) if test_dir.is_dir() else []
    if not files:
        return {"status": NOT_RUN, "tests": 0, "failures": 0, "skipped": 0, "date": None}
    tests = failures = skipped = 0
    for path in files:
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError as e:
            raise DsaError(str(path), f"is not readable JUnit XML: {e}", "re-run the test") from None
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        for suite in suites:
            cases = list(suite.iter("testcase"))
            if cases:
                tests += len(cases)
                failures += sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
                skipped += sum(1 for c in cases if c.find("skipped") is not None)
            else:
                tests += int(suite.get("tests", 0) or 0)
                failures += int(suite.get("failures", 0) or 0) + int(suite.get("errors", 0) or 0)
                skipped += int(suite.get("skipped", 0) or 0)
    date = datetime.datetime.fromtimestamp(max(p.stat().st_mtime for p in files)).strftime("%Y-%m-%d %H:%M")
    status = "passed" if tests > 0 and failures == 0 else "failed"
    return {"status": status, "tests": tests, "failures": failures, "skipped": skipped, "date": date}


# -- build outputs -------------------------------------------------------------------------------------------
def _mlir_of(record: Path) -> Path:
    """The MLIR a module was compiled from: dsa_model's M/model.mlir beside M/export_record.json, or dsa_bucket's
    B/<stem>.mlir beside B/<stem>.export_record.json."""
    if record.name == "export_record.json":
        return record.parent / "model.mlir"
    return record.parent / (record.name[: -len(".export_record.json")] + ".mlir")


def _report_of(vmfb: Path) -> Path:
    """dsa_vmfb's compile report beside each vmfb: X/<stem>.compile_report.json."""
    return vmfb.parent / (vmfb.name[: -len(".vmfb")] + ".compile_report.json")


def _size(path: Path) -> Optional[int]:
    return path.stat().st_size if path.is_file() else None


def _sum(values: Sequence[Optional[int]]) -> Optional[int]:
    return None if not values or any(v is None for v in values) else sum(values)


def module_units(spec: ModelSpec, bin_dir: Path) -> List[str]:
    """The dsa_vmfb names behind one model: itself, or a pipeline's stages (from its pipeline.json if built)."""
    if not spec.is_pipeline:
        return [spec.name]
    pipeline = bin_dir / "models" / f"{spec.name}.pipeline.json"
    if pipeline.is_file():
        return [stage["name"] for stage in PipelineIndex.read(pipeline)["stages"]]
    return list(spec.stages)


@dataclasses.dataclass
class Unit:
    """The build outputs of one dsa_vmfb, as its module index names them."""

    name: str
    index: Optional[dict]
    base: Path
    modules: List[dict]  # {"vmfb", "record", "mlir", "report"} as paths; the smallest bucket first


def read_unit(bin_dir: Path, name: str) -> Unit:
    from dsa.runtime.policy import read_module_index

    base = bin_dir / "models"
    path = base / f"{name}.modules.json"
    if not path.is_file():
        return Unit(name, None, base, [])
    index = read_module_index(path)
    modules = []
    for m in index["modules"]:
        vmfb, record = base / m["vmfb"], base / m["record"]
        modules.append({"vmfb": vmfb, "record": record, "mlir": _mlir_of(record), "report": _report_of(vmfb)})

    def bucket_size(m: dict) -> int:
        # As CompiledPolicy orders its modules: smallest bucket first.
        if not m["record"].is_file():
            return 0
        bucket = ExportRecord.read(m["record"]).get("bucket")
        return bucket["size"] if bucket else 0

    modules.sort(key=bucket_size)
    return Unit(name, index, base, modules)


# The manifest's framework → how the model reached IREE (docs/frontends.md).
FRONT_ENDS = {
    "pytorch": "torch.export",
    "lerobot": "LeRobot → torch.export",
    **{f.name: f.label for f in FILE_FRONT_ENDS.values()},
}


def front_end_of(base: Path, name: str) -> Optional[str]:
    """The framework of a dsa_vmfb's model, from its export view (`<name>_model/export_view.json`)."""
    view = base / f"{name}_model" / "export_view.json"
    if not view.is_file():
        return None
    return read_json(view).get("framework", "pytorch")


def collect_files(spec: ModelSpec, unit: Unit, test: dict) -> dict:
    """One table row from the build and test outputs alone (nothing measured)."""
    front_end = front_end_of(unit.base, unit.name)
    if front_end is None and unit.modules:
        # A build for a further target (<name>_<target>) shares its policy's model: <policy>_model/.
        stem = unit.modules[0]["record"].parent.name
        for suffix in ("_buckets", "_model"):
            if stem.endswith(suffix):
                front_end = front_end_of(unit.base, stem[: -len(suffix)])
    row = {
        "model": spec.name, "module": unit.name, "label": f"//models:{unit.name}", "test": spec.test,
        "front_end": front_end,
        "pipeline": spec.name if spec.is_pipeline else None,
        "parity": test, "modules": len(unit.modules), "built": unit.index is not None,
        "export": False, "compile": False, "vmfb_bytes": None, "mlir_bytes": None, "irpa_bytes": None,
        "parameter_count": None, "target": None, "measured": None, "notes": [],
    }
    if unit.index is None:
        # Not built (or not among this binary's data): the export stage may still have run on its own.
        record = unit.base / f"{unit.name}_model" / "export_record.json"
        row["export"] = record.is_file() and _mlir_of(record).is_file()
        if row["export"]:
            row["parameter_count"] = ExportRecord.read(record).get("parameter_count")
            row["mlir_bytes"] = _size(_mlir_of(record))
        row["notes"].append(f"{unit.name}.modules.json not found: not built")
        return row
    records = [m["record"] for m in unit.modules]
    row["export"] = bool(records) and all(p.is_file() and m["mlir"].is_file()
                                          for p, m in zip(records, unit.modules))
    row["compile"] = bool(unit.modules) and all(m["vmfb"].is_file() and m["report"].is_file()
                                                for m in unit.modules)
    row["vmfb_bytes"] = _sum([_size(m["vmfb"]) for m in unit.modules])
    row["mlir_bytes"] = _sum([_size(m["mlir"]) for m in unit.modules])
    row["irpa_bytes"] = _size(unit.base / unit.index["parameter_archive"])
    row["target"] = unit.index.get("target")
    if records and records[0].is_file():
        row["parameter_count"] = ExportRecord.read(records[0]).get("parameter_count")
    return row
