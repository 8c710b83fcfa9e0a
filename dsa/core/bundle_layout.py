"""The member names of a release bundle (docs/bundle-format.md): what the writer (dsa.stages.bundle) names its
files and the reader (dsa.runtime.bundle) looks for."""

from __future__ import annotations

import re

BUNDLE_JSON = "bundle.json"
LOCK_JSON = "lock.json"
INDEX_JSON = "modules.json"
BUILD_REPORT_JSON = "build_report.json"
PROVENANCE_JSON = "provenance.intoto.json"
MANIFEST_YAML = "manifest.yaml"
RUNTIME_VIEW_JSON = "runtime_view.json"
TARGET_SPEC_JSON = "target_spec.json"
PARAMS_IRPA = "params.irpa"

LINK_JSON = "link.json"
PIPELINE_JSON = "pipeline.json"
POLICY_PIPELINE_JSON = "policy_pipeline.json"  # dsa.runtime.policy_pipeline.POLICY_PIPELINE_JSON
POLICY_PIPELINE_CONFIG_JSON = "policy_config.json"  # dsa.runtime.policy_pipeline.POLICY_CONFIG_JSON

SHARED_MEMBERS = (MANIFEST_YAML, PARAMS_IRPA, RUNTIME_VIEW_JSON)

# An ExecuTorch bundle (format 3).
PROGRAM_PTE = "program.pte"
PTE_RECORD_JSON = "pte_record.json"
EXECUTORCH_KIND = "executorch"

# A member's name: a plain file name at the archive root (also a module's, stage's or target's name).
PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
