"""dsa.runtime.host: a module is loaded only on a machine that can execute it. Code for a CPU feature the host
lacks (AVX-512 on an AVX2 machine) would otherwise kill the process with SIGILL on its first instruction."""

import json

import pytest

from dsa.core.errors import DsaError
from dsa.core.fileio import read_json
from dsa.runtime import host
from dsa.runtime.policy import CompiledPolicy
from dsa.tools.testing import runfile

TARGETS = runfile("toolchains/targets/x86_64-v3.json").parent
V3_FLAGS = read_json(TARGETS / "x86_64-v3.json")["host"]["cpu_features"]


def test_every_shipped_cpu_target_names_the_host_it_needs():
    cpu_targets = [read_json(p) for p in sorted(TARGETS.glob("*.json")) if read_json(p)["device"] == "local"]
    assert len(cpu_targets) >= 6
    for spec in cpu_targets:
        assert spec["host"]["arch"], spec["name"]
        # Linux lists CPU features on x86-64 and aarch64 (/proc/cpuinfo); RISC-V says its ISA another way.
        if spec["host"]["arch"] in ("x86_64", "aarch64"):
            assert spec["host"]["cpu_features"], spec["name"]


def test_x86_64_v4_needs_everything_v3_does_and_the_avx512_subsets():
    v4 = set(read_json(TARGETS / "x86_64-v4.json")["host"]["cpu_features"])
    assert set(V3_FLAGS) < v4
    assert {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= v4 - set(V3_FLAGS)


def test_an_avx2_cpu_cannot_run_x86_64_v4_and_is_told_what_it_lacks():
    v4 = read_json(TARGETS / "x86_64-v4.json")
    why = host.missing_for(v4, "x86_64", V3_FLAGS)
    assert why == "it needs the CPU features avx512bw, avx512cd, avx512dq, avx512f, avx512vl, which this CPU lacks"
    assert host.missing_for(v4, "x86_64", V3_FLAGS + ["avx512f", "avx512bw", "avx512cd", "avx512dq",
                                                      "avx512vl"]) is None


def test_another_architecture_is_refused_whatever_its_features():
    v3 = read_json(TARGETS / "x86_64-v3.json")
    assert host.missing_for(v3, "aarch64", ["fp", "asimd"]) == \
        "its code is for x86_64 CPUs and this machine is aarch64"


def test_a_spec_without_host_requirements_and_an_unknown_feature_list_pass():
    assert host.missing_for({"name": "custom"}, "x86_64", []) is None
    v3 = read_json(TARGETS / "x86_64-v3.json")
    assert host.missing_for(v3, "x86_64", None) is None  # no /proc/cpuinfo: only the arch is checked


def test_cpu_features_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\n")
    assert host.host_cpu_features(cpuinfo) == ["fpu", "avx2", "fma"]
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert host.host_cpu_features(arm) == ["fp", "asimd", "sve"]
    assert host.host_cpu_features(tmp_path / "missing") is None


def test_cpu_model_is_read_from_cpuinfo_else_from_the_platform(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU @ 2.0GHz\nflags\t\t: fpu\n")
    assert host.host_cpu_model(cpuinfo) == "Some CPU @ 2.0GHz"
    monkeypatch.setattr(host.platform, "processor", lambda: "")
    assert host.host_cpu_model(tmp_path / "missing") == "unknown"


def test_best_target_of_a_cpu_whose_features_are_unknown_is_one_needing_none(tmp_path):
    v3 = read_json(TARGETS / "x86_64-v3.json")
    (tmp_path / "v3.json").write_text(json.dumps(v3))
    with pytest.raises(DsaError, match="no target spec fits"):
        host.best_target(tmp_path, features=[], arch="x86_64")
    assert host.best_target(tmp_path, features=v3["host"]["cpu_features"], arch="x86_64") == "x86_64-v3"


def test_compiled_policy_refuses_a_target_this_host_lacks_before_loading_anything(tmp_path):
    """A module index whose target spec needs a feature no CPU has: refused naming the index, the target and
    the feature, before the (here absent) vmfb and parameter archive are even opened."""
    spec = dict(read_json(TARGETS / "x86_64-v3.json"), name="x86_64-future")
    spec["host"] = {"arch": host.host_arch(), "cpu_features": ["dsa_no_cpu_has_this"]}
    (tmp_path / "future.json").write_text(json.dumps(spec))
    index = tmp_path / "m.modules.json"
    index.write_text(json.dumps({"format": 1, "target": "x86_64-future", "target_spec": "future.json",
                                 "parameter_archive": "absent.irpa", "parameter_scope": "model",
                                 "runtime_view": "absent.json", "modules": []}))
    with pytest.raises(DsaError, match=r"m\.modules\.json: the module is compiled for target 'x86_64-future' and "
                                       r"cannot run on this machine: it needs the CPU features dsa_no_cpu_has_this"):
        CompiledPolicy(index)
