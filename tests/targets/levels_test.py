"""Every policy the repository builds holds, in its default build (`bazel build //models:<name>`), every target
of its manifest that runs on the same machines as its own target — the x86-64 levels: x86_64-v4 (and
x86_64-v4-bf16) beside a portable x86_64-v3 — so that a user on an AVX-512 machine runs the AVX-512 modules
without asking (docs/targets.md, "Levels"). Read from the policies indexes (dsa_policies: each row's `targets`,
its own first) and the manifests' `targets`."""

import pytest

from dsa.core.fileio import read_json
from dsa.manifest.yaml_loader import parse_manifest_file
from dsa.tools.testing import runfile

TARGETS = runfile("toolchains/targets/x86_64-v3.json").parent
ROWS = [row for index in ("models/policies_index.json", "models/policies_real_size_index.json")
        for row in read_json(runfile(index))["policies"] if not row.get("build_of")]


def _machine(name):
    spec = read_json(TARGETS / f"{name}.json")
    return spec["device"], spec["runtime_driver"], spec.get("host", {}).get("arch")


def test_the_indexes_list_the_repositorys_policies():
    names = {row["name"] for row in ROWS}
    assert {"pi0", "act", "diffusion", "smolvla", "pi0_lerobot", "pi05", "pi0_full", "openvla_7b"} <= names


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row["name"])
def test_a_policys_default_build_holds_every_level_its_manifest_lists(row):
    manifest, _ = parse_manifest_file(runfile(row["manifest"]))
    own = row["targets"][0]
    same_machine = {t for t in manifest["targets"] if _machine(t) == _machine(own)}
    assert set(row["targets"]) == same_machine, (
        f"{row['label']}: its default build holds {row['targets']}; its manifest lists {sorted(same_machine)} "
        "for the same machines: name the others in dsa_policy's `levels`")
