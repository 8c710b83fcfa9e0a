"""Every target //models:pi0 is built for: each module holds executables of the target's own format only
(read back with iree-dump-module), passes the IREE runtime's bytecode verifier (no device needed), and was
compiled with the target spec's flags; every spec file is complete and has its dsa_target; π0 is built for
exactly its manifest's targets; a GPU target whose driver this machine lacks is refused before anything is
loaded, naming the target and the driver."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dsa.core.errors import DsaError
from dsa.core.fileio import read_json
from dsa.manifest.contract import load_manifest
from dsa.runtime.host import check_host, missing_driver
from dsa.tools.testing import runfile

SPECS = runfile("toolchains/targets")
# Every spec file of toolchains/targets (//toolchains/targets:specs): each one is a target, by its file name.
NAMES = sorted(p.stem for p in SPECS.glob("*.json"))
# The dsa_target made for each spec (//toolchains/targets:index).
INDEX = read_json(runfile("toolchains/targets/index/dsa_targets.json"))
# π0's targets, its own first (manifests/pi0.yaml; //models:pi0_all_targets builds each).
PI0_TARGETS = load_manifest(runfile("manifests/pi0.yaml"), known_targets=NAMES)["targets"]
FORMATS = {"embedded-elf-x86_64", "embedded-elf-arm_64", "embedded-elf-riscv_64", "cuda-nvptx-fb",
           "rocm-hsaco-fb", "vulkan-spirv-fb"}


def _index(name: str) -> Path:
    return runfile("models/pi0.modules.json" if name == "x86_64-v3" else f"models/pi0_{name}.modules.json")


def _dump_module():
    from dsa.tools.profiler import runtime_tool_path

    return runtime_tool_path("iree-dump-module")


def test_every_spec_is_complete():
    assert NAMES, SPECS
    for name in NAMES:
        spec = read_json(SPECS / f"{name}.json")
        assert spec["name"] == name
        for key in ("description", "device", "backends", "runtime_driver", "flags", "executable_formats"):
            assert spec.get(key), (name, key)
        assert set(spec["executable_formats"]) <= FORMATS, name
        assert not any(f.startswith("--iree-hal-target-device") for f in spec["flags"]), name
        # A CPU target names the CPU its code needs (a runner refuses another); a GPU target names its driver.
        assert ("host" in spec) == (spec["device"] == "local"), name


def test_every_spec_has_its_dsa_target():
    made = {row["name"]: row["spec"] for row in INDEX["targets"]}
    assert sorted(made) == NAMES, ("a spec file of toolchains/targets without its dsa_target, or a dsa_target "
                                   "without its spec: see toolchains/targets/BUILD.bazel")
    assert all(spec == f"toolchains/targets/{name}.json" for name, spec in made.items()), made


def test_pi0_is_built_for_exactly_its_manifests_targets():
    """models/BUILD.bazel's PI0_MORE_TARGETS (through //models:pi0_all_targets) against manifests/pi0.yaml."""
    built = {"x86_64-v3"} | {p.name[len("pi0_"):-len(".modules.json")]
                             for p in runfile("models").glob("pi0_*.modules.json")}
    assert PI0_TARGETS[0] == "x86_64-v3"
    assert built == set(PI0_TARGETS), ("models/BUILD.bazel PI0_MORE_TARGETS and manifests/pi0.yaml targets "
                                       f"differ: only in the BUILD {sorted(built - set(PI0_TARGETS))}, only in "
                                       f"the manifest {sorted(set(PI0_TARGETS) - built)}")


# vulkan-adreno: IREE 3.13 cannot compile π0's 128-token bucket for it (models/BUILD.bazel, docs/targets.md),
# so π0's manifest does not list it.
BUILT = PI0_TARGETS


@pytest.mark.parametrize("name", BUILT)
def test_each_module_holds_only_the_targets_executable_format_and_verifies(name):
    import iree.runtime as rt

    index = read_json(_index(name))
    spec = read_json(_index(name).parent / index["target_spec"])
    assert spec["name"] == name
    assert len(index["modules"]) == 3  # the three prompt-length buckets, as for x86_64-v3
    instance = rt.VmInstance()
    for module in index["modules"]:
        vmfb = _index(name).parent / module["vmfb"]
        dump = subprocess.run([str(_dump_module()), str(vmfb)], capture_output=True, text=True, check=True).stdout
        formats = set(re.findall(r"`([a-z0-9_-]+)`", dump)) & FORMATS
        assert formats == set(spec["executable_formats"]), (name, module["vmfb"], formats)
        rt.VmModule.copy_buffer(instance, vmfb.read_bytes())  # the bytecode verifier runs on load
        report = read_json(vmfb.with_name(vmfb.name[:-len(".vmfb")] + ".compile_report.json"))
        assert report["target"] == name and report["runtime_driver"] == spec["runtime_driver"]
        flags = report["flags"]
        assert f"--iree-hal-target-device={spec['device']}" in flags
        assert all(f in flags for f in spec["flags"]), name


@pytest.mark.parametrize("name", [n for n in NAMES if read_json(SPECS / f"{n}.json")["device"] != "local"])
def test_a_gpu_target_without_its_driver_is_refused_naming_target_and_driver(name):
    spec = read_json(SPECS / f"{name}.json")
    if missing_driver(spec) is None:
        pytest.skip(f"this machine has a {spec['runtime_driver']} device")
    with pytest.raises(DsaError) as err:
        check_host(spec, "models/pi0.modules.json")
    text = str(err.value)
    assert f"compiled for target '{name}'" in text and f"runtime driver '{spec['runtime_driver']}'" in text, text
