"""dsa.stages.compile_flags: a tuning file, a tuner candidate and a target spec may carry code-generation flags
(and a target spec its CPU / GPU), each with a value the rule set checks; every other iree-compile flag —
output, dumps, printing, linking, layout overrides, the rule set's own — is refused naming the file, the flag
and the allow-list. Every committed tuning, candidate list and target spec passes the same check."""

import json
from pathlib import Path

import pytest

from dsa.core.errors import DsaError
from dsa.core.runtime_flags import runtime_flag_values
from dsa.stages.compile import target_flags, tuning_flags
from dsa.stages.compile_flags import CODEGEN_FLAGS, TARGET_FLAGS, check_target_flags, check_tuning_flags
from dsa.tools.testing import runfile
from dsa.tools.tune import load_candidates

TARGETS = runfile("toolchains/targets/x86_64-v3.json").parent
TUNINGS = runfile("toolchains/tuning/candidates.json").parent
V3 = json.loads((TARGETS / "x86_64-v3.json").read_text())


def _tuning(*flags):
    return {"format": 1, "family": "f", "target": "x86_64-v3", "flags": list(flags)}


# Flags that write files, print, link differently or override the layout: none may come from a tuning.
WRITES_OR_OVERRIDES = [
    "--iree-hal-dump-executable-files-to=/etc",
    "--iree-hal-dump-executable-sources-to=/tmp/x",
    "--iree-hal-dump-executable-binaries-to=/tmp/x",
    "--iree-hal-dump-executable-benchmarks-to=/tmp/x",
    "--iree-hal-dump-executable-intermediates-to=/tmp/x",
    "--iree-hal-dump-executable-configurations-to=/tmp/x",
    "--dump-compilation-phases-to=/tmp/x",
    "--iree-flow-dump-dispatch-graph-output-file=/tmp/g.dot",
    "--mlir-print-ir-after-all",
    "--mlir-print-ir-before-all",
    "--mlir-print-debuginfo",
    "--mlir-elide-elementsattrs-if-larger=1",
    "--iree-llvmcpu-link-embedded=false",
    "--iree-llvmcpu-link-static",
    "--iree-llvmcpu-static-library-output-path=/tmp/x.o",
    "--iree-llvmcpu-target-data-layout=e-m:e",
    "--iree-llvmcpu-keep-linker-artifacts",
    "--iree-hal-executable-debug-level=3",
    "--iree-codegen-tuning-spec-path=/etc/passwd",
    "--iree-llvmcpu-embedded-linker-path=/bin/sh",
    "--iree-llvmcpu-system-linker-path=/bin/sh",
    "--iree-vm-target-index-bits=32",
    "--pass-pipeline=builtin.module()",
    "--iree-opt-import-parameters=/etc/shadow",
    "--iree-opt-export-parameters=/tmp/p.irpa",
    "--iree-opt-splat-parameters=/tmp/p.irpa",
    "--iree-scheduling-dump-statistics-file=/tmp/s",
    "--iree-no-such-flag",
]


@pytest.mark.parametrize("flag", WRITES_OR_OVERRIDES)
def test_a_tuning_may_not_set_output_dump_print_link_or_layout_flags(flag):
    with pytest.raises(DsaError) as e:
        tuning_flags(_tuning("--iree-opt-level=O3", flag), V3, "toolchains/tuning/f.x86_64-v3.json")
    text = str(e.value)
    assert text.startswith("toolchains/tuning/f.x86_64-v3.json: ")
    assert f"tuning flag '{flag}' is not allowed" in text
    assert "--iree-opt-level" in text and "dsa/stages/compile_flags.py" in text  # the allow-list, and where


@pytest.mark.parametrize("flag", WRITES_OR_OVERRIDES)
def test_a_target_spec_may_not_set_them_either(flag):
    spec = dict(V3, flags=[*V3["flags"], flag])
    with pytest.raises(DsaError, match=r"my-targets/x\.json: target spec flag '.*' is not allowed"):
        target_flags(spec, "my-targets/x.json")


@pytest.mark.parametrize("flag", [
    "--iree-llvmcpu-target-cpu=znver4", "--iree-llvmcpu-target-cpu-features=+avx512f",
    "--iree-llvmcpu-target-triple=x86_64-unknown-linux-gnu", "--iree-hal-local-target-device-backends=vmvx",
    "--iree-input-type=none", "--iree-vm-bytecode-module-strip-source-map=false",
    "--iree-llvmcpu-debug-symbols=true", "--compile-to=vm", "--output-format=vm-asm",
    "--iree-hal-target-device=cuda",
])
def test_a_tuning_may_not_choose_the_cpu_device_input_or_reproducibility(flag):
    with pytest.raises(DsaError, match=r"own the device, CPU, input, output and reproducibility flags"):
        tuning_flags(_tuning(flag), V3, "t.json")


@pytest.mark.parametrize("flag, takes", [
    ("--iree-opt-level=O9", "one of O0, O1, O2, O3"),
    ("--iree-opt-level", "one of O0"),
    ("--iree-opt-data-tiling=maybe", "a boolean"),
    ("--iree-opt-outer-dim-concat=sometimes", "a boolean"),
    ("--iree-llvmcpu-vector-pproc-strategy=unroll", "one of peel, mask, none"),
    ("--iree-llvmcpu-stack-allocation-limit=9223372036854775807", "a byte count from 1 to 8388608"),
    ("--iree-llvmcpu-stack-allocation-limit=0", "a byte count"),
    ("--iree-llvmcpu-stack-allocation-limit=" + "9" * 3000, "a byte count"),
    ("--iree-llvmcpu-matmul-tile-bytes=-1", "a byte count from 1 to 16777216"),
    ("--iree-opt-const-expr-max-size-increase-threshold=1073741824", "a byte count from 1 to 268435456"),
    ("--iree-llvmcpu-enable-ukernels=all;rm", "none, default, all or a comma-separated list"),
    ("--iree-dispatch-creation-experimental-set-data-tiling-ops=attention", "a comma-separated list of matmul"),
    ("--iree-preprocessing-pass-pipeline=builtin.module(iree-dump-dispatch-graph{output-file=/etc/x})",
     "no pass options"),
    ("--iree-preprocessing-pass-pipeline=builtin.module(util.func(iree-linalg-ext-decompose-attention,"
     "iree-flow-dump-dispatch-graph))", "PASS one of iree-linalg-ext-convert-attention-to-online-attention"),
])
def test_an_allowed_flag_with_a_value_out_of_its_range_is_refused_naming_what_it_takes(flag, takes):
    with pytest.raises(DsaError) as e:
        tuning_flags(_tuning(flag), V3, "t.json")
    assert "has a value this rule set does not take" in str(e.value) and takes in str(e.value)
    assert len(str(e.value)) < 2000  # a 3000-digit value is not echoed back whole


@pytest.mark.parametrize("flags", [
    "--iree-opt-level=O3", ["--iree-opt-level=O3", 3], [None], [["--iree-opt-level=O3"]],
    ["iree-opt-level=O3"], ["--iree-opt-level=O3\n--iree-hal-dump-executable-files-to=/etc"],
])
def test_flags_that_are_not_a_list_of_flag_strings_are_refused(flags):
    with pytest.raises(DsaError, match=r"t\.json: tuning"):
        tuning_flags(_tuning() | {"flags": flags}, V3, "t.json")


@pytest.mark.parametrize("flag", [
    "--iree-llvmcpu-target-cpu=host", "--iree-llvmcpu-target-cpu-features=host",
    "--iree-llvmcpu-target-cpu-features=+avx2,host",
])
def test_a_target_spec_naming_the_host_cpu_is_refused(flag):
    spec = dict(V3, flags=[flag])
    with pytest.raises(DsaError, match="build machine's own CPU"):
        target_flags(spec, "x.json")


@pytest.mark.parametrize("device", ["local --iree-hal-dump-executable-files-to=/etc", "", 3, "LOCAL"])
def test_a_target_spec_device_that_is_not_a_device_name_is_refused(device):
    with pytest.raises(DsaError, match="is not a device name"):
        target_flags(dict(V3, device=device), "x.json")


def test_every_allowed_flag_value_used_by_a_committed_tuning_or_target_passes():
    for path in sorted(TARGETS.glob("*.json")):
        spec = json.loads(path.read_text())
        assert target_flags(spec, str(path))[0] == f"--iree-hal-target-device={spec['device']}"
    tunings = [p for p in sorted(TUNINGS.glob("*.json"))
               if not p.name.endswith(".evidence.json") and p.name != "candidates.json"]
    assert len(tunings) >= 20
    for path in tunings:
        data = json.loads(path.read_text())
        spec = json.loads((TARGETS / f"{data['target']}.json").read_text())
        assert tuning_flags(data, spec, str(path)) == data["flags"]


def test_every_committed_tuner_candidate_passes_and_a_bad_candidate_is_refused(tmp_path):
    candidates = TUNINGS / "candidates.json"
    assert load_candidates(candidates)
    data = json.loads(candidates.read_text())
    data["candidates"].append({"name": "evil", "flags": ["--iree-hal-dump-executable-files-to=/etc"]})
    bad = tmp_path / "candidates.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(DsaError, match=r"candidates\.json: 'candidates': candidate 'evil' flag "
                                       r"'--iree-hal-dump-executable-files-to=/etc' is not allowed"):
        load_candidates(bad)


def test_the_allow_lists_hold_no_flag_that_writes_a_file_or_names_a_path():
    for name in [*CODEGEN_FLAGS, *TARGET_FLAGS]:
        assert not any(word in name for word in ("dump", "path", "file", "output", "print", "link", "layout"))
    assert not set(CODEGEN_FLAGS) & set(TARGET_FLAGS)


def test_target_flags_are_allowed_in_a_spec_but_codegen_flags_too():
    check_target_flags(["--iree-llvmcpu-target-cpu=x86-64-v4", "--iree-opt-level=O3"], "x.json")
    with pytest.raises(DsaError, match="is not allowed"):
        check_tuning_flags(["--iree-llvmcpu-target-cpu=x86-64-v4"], "t.json")


@pytest.mark.parametrize("flag", [
    "--task_worker_stack_size=9223372036854775807", "--task_worker_stack_size=" + "9" * 5000,
    "--task_worker_stack_size=0", "--task_worker_stack_size=67108865",
])
def test_a_runtime_flag_past_64_mib_or_not_a_byte_count_is_refused(flag):
    with pytest.raises(DsaError, match=r"needs a positive byte count of at most 67108864"):
        runtime_flag_values([flag], "t.json")
    assert runtime_flag_values(["--task_worker_stack_size=67108864"], "t.json")
