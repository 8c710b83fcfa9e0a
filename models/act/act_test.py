"""ACT through LeRobot: the compiled module matches eager LeRobot (`ACTPolicy.from_pretrained` on the same
policy directory, `predict_action_chunk`) at each batch size: batch is bucketed (manifests/act.yaml
`buckets.batch: [1, 4]`, static modules, the shape IREE's convolution data tiling needs); a batch between
buckets is padded up and the actions cut back to it. The modules read exactly the tensors of LeRobot's
model.safetensors.

Two builds of the same exports, both in `bazel build //models:act`: x86_64-v3 (runs on any AVX2 CPU) and its
level x86_64-v4 (AVX-512, //models:act_x86_64-v4), which the index lists. Each build is checked where this
machine can run it; where it cannot, the check is that loading it is refused with a message naming the target
and the missing CPU features (a module for a CPU the host lacks would otherwise kill the process with
SIGILL). Loaded without a target, the index runs the most capable build this machine executes.

Tolerance: |vmfb - eager| <= 1e-4 * max(1, max|eager|). Both sides run fp32; IREE reorders the reductions of
the ResNet-18 backbone and the 4+1-layer transformer: measured ~2e-6 absolute on actions of magnitude ~1.
A real defect (a wrong weight, a dropped camera, a mis-ordered input) moves the actions by O(1).
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open

from dsa.core.errors import DsaError
from dsa.core.fileio import read_json, sha256_file
from dsa.frontends.lerobot import reference_actions
from dsa.runtime.host import runs_here
from dsa.runtime.policy import CompiledPolicy, ModuleIndex, builds_of, sample_inputs
from dsa.stages.dispatch_spec import spec_entries, spec_parts
from dsa.tools.testing import runfile

INDEX = runfile("models/act.modules.json")
BUILDS = builds_of(INDEX)
POLICY_DIR = runfile("models/act_policy/config.json").parent
REL_TOL = 1e-4


def _spec(index):
    return read_json(index.parent / ModuleIndex.read(index).target_spec)


RUNNABLE = [t for t, index in BUILDS.items() if runs_here(_spec(index))]


@pytest.fixture(scope="module", params=RUNNABLE)
def policy(request):
    return CompiledPolicy(INDEX, target=request.param)


def test_the_default_build_holds_the_avx512_level_beside_the_portable_one():
    assert list(BUILDS) == ["x86_64-v3", "x86_64-v4"]
    assert BUILDS["x86_64-v4"] == runfile("models/act_x86_64-v4.modules.json")


def test_the_portable_build_runs_on_every_x86_64_machine():
    assert "x86_64-v3" in RUNNABLE


def test_without_a_target_the_most_capable_build_this_machine_runs_is_loaded():
    policy = CompiledPolicy(INDEX)
    best = "x86_64-v4" if "x86_64-v4" in RUNNABLE else "x86_64-v3"
    assert policy.choice.target == policy.index["target"] == best
    assert "most capable of its builds (x86_64-v3, x86_64-v4)" in policy.choice.why


def test_dsa_run_of_the_default_build_runs_the_most_capable_level_without_flags():
    """`bazel build //models:act` then `dsa run --index bazel-bin/models/act.modules.json`: x86_64-v4 on an
    AVX-512 machine, x86_64-v3 on an AVX2 one, and it says which and why."""
    best = "x86_64-v4" if "x86_64-v4" in RUNNABLE else "x86_64-v3"
    proc = subprocess.run([sys.executable, "-m", "dsa.runtime.run", "--index", str(INDEX), "--repeats", "1"],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    assert proc.returncode == 0, proc.stderr
    assert f"target {best} (the most capable of its builds (x86_64-v3, x86_64-v4) this machine runs" in proc.stdout
    assert f"model act on {best} (local-task)" in proc.stdout


def test_every_entry_of_the_dispatch_spec_sets_the_tiles_of_a_batch1_dispatch_of_the_avx512_build():
    """toolchains/tuning/resnet_policy.x86_64-v4.spec.mlir was measured on this build's batch-1 module (`dsa
    tune-dispatches`); the tuning file pins it and DsaCompile applies it. An entry that no longer matches (a
    compiler that configures the convolution otherwise, a changed model) fails here instead of leaving IREE's
    tiles in place unnoticed. The batch-4 module has other shapes: the spec leaves it alone, and says so."""
    spec = runfile("toolchains/tuning/resnet_policy.x86_64-v4.spec.mlir")
    tuning = read_json(runfile("toolchains/tuning/resnet_policy.x86_64-v4.json"))
    assert tuning["dispatch_spec"] == {"file": spec.name, "sha256": sha256_file(spec)}
    entries = spec_entries(spec)
    index = BUILDS["x86_64-v4"]
    reports = [read_json(index.parent / vmfb.replace(".vmfb", ".compile_report.json"))
               for vmfb, _ in ModuleIndex.read(index).modules]
    batch1, batch4 = reports
    assert batch1["dispatch_spec"]["sha256"] == sha256_file(spec)
    assert batch1["dispatch_spec"]["unmatched"] == []
    assert sorted(batch1["dispatch_spec"]["matched"]) == sorted(entries)
    assert batch4["dispatch_spec"]["matched"] == {} and sorted(batch4["dispatch_spec"]["unmatched"]) == sorted(entries)


# ResNet-18's 3×3 stride-1 convolutions by weight shape (the stride-2 ones and the stem are not Winograd's).
RESNET18_STRIDE1_CONV3X3 = {"conv3x3_64x64": 4, "conv3x3_128x128": 3, "conv3x3_256x256": 3, "conv3x3_512x512": 3}


def test_the_avx2_build_computes_the_convolutions_its_spec_names_by_winograd_in_every_bucket():
    """toolchains/tuning/resnet_policy.x86_64-v3.spec.mlir chooses Winograd per weight shape of the 3×3 stride-1
    convolutions (`dsa tune-dispatches --winograd`); each such entry matches every convolution of its shape,
    whatever the batch. They match only once split_conv_bias has split off the bias that batch-norm folding gave
    them: a build where they match nothing has lost the rewrite (and the parity tests above check what it
    computes). Its tile entries (`dsa tune-dispatches`, measured on the batch-1 module: Winograd's batch matmuls
    among them) match that module's dispatches only; the batch-4 module has other shapes and says so."""
    spec = runfile("toolchains/tuning/resnet_policy.x86_64-v3.spec.mlir")
    tuning = read_json(runfile("toolchains/tuning/resnet_policy.x86_64-v3.json"))
    assert tuning["dispatch_spec"] == {"file": spec.name, "sha256": sha256_file(spec)}
    parts = spec_parts(spec)
    rewrites, tiles = parts["preprocess"], parts["tune"]
    assert rewrites and set(rewrites) <= set(RESNET18_STRIDE1_CONV3X3)
    index = BUILDS["x86_64-v3"]
    reports = [(vmfb, read_json(index.parent / vmfb.replace(".vmfb", ".compile_report.json")))
               for vmfb, _ in ModuleIndex.read(index).modules]
    for vmfb, report in reports:
        matched = report["dispatch_spec"]["matched"]
        assert {e: matched.get(e) for e in rewrites} == {e: RESNET18_STRIDE1_CONV3X3[e] for e in rewrites}, vmfb
        assert (index.parent / vmfb).read_bytes().count(b"winograd_input_transform") >= len(rewrites), vmfb
    (_, batch1), (_, batch4) = reports
    assert batch1["dispatch_spec"]["unmatched"] == [] and set(tiles) <= set(batch1["dispatch_spec"]["matched"])
    assert sorted(batch4["dispatch_spec"]["unmatched"]) == sorted(tiles)


@pytest.mark.parametrize("target", sorted(set(BUILDS) - set(RUNNABLE)))
def test_a_build_this_cpu_cannot_execute_is_refused_before_loading(target):
    with pytest.raises(DsaError, match=rf"compiled for target '{target}' and cannot run on this machine: it needs "
                                       r"the CPU features avx512"):
        CompiledPolicy(INDEX, target=target)


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_vmfb_matches_eager_lerobot_at_each_batch_size(policy, batch):
    inputs = sample_inputs(policy.modules[0].record, {"batch": batch}, np.random.default_rng(batch))
    (actions,), module = policy.run(inputs)
    expected = reference_actions(POLICY_DIR, inputs, None)
    assert actions.shape == expected.shape == (batch, 100, 14)
    assert module.bucket["size"] == (1 if batch == 1 else 4)
    err = float(np.abs(actions - expected).max())
    assert err <= REL_TOL * max(1.0, float(np.abs(expected).max())), err


def test_batch_buckets_are_static_modules_whose_actions_are_cut_back_to_the_batch(policy):
    assert [m.bucket["size"] for m in policy.modules] == [1, 4]
    for module in policy.modules:
        record = module.record
        size = module.bucket["size"]
        assert record["dynamic_dims"] == {}
        assert all(spec["shape"][0] == size and spec["dims"] == {"0": "batch"} for spec in record["inputs"])
        assert record["outputs"] == [{"name": "action", "shape": [size, 100, 14], "dtype": "float32",
                                      "dims": {"0": "batch"}}]


def test_a_batch_over_the_largest_bucket_is_refused_naming_the_manifest_field(policy):
    inputs = sample_inputs(policy.modules[0].record, {"batch": 5}, np.random.default_rng(5))
    with pytest.raises(DsaError, match=r"batch is 5, longer than the largest bucket \(4.*buckets\.batch"):
        policy.run(inputs)


def test_the_image_stem_is_one_im2col_matmul(policy):
    """The 7x7/2 ResNet stem over 3 channels is rewritten (dsa.stages.passes.stem_conv_to_matmul)."""
    for module in policy.modules:
        assert module.record["rewrites"]["stem_conv_to_matmul"] == 1


def test_module_reads_the_tensors_of_lerobots_model_safetensors(policy):
    with safe_open(str(POLICY_DIR / "model.safetensors"), "np") as f:
        saved = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    params = {p["name"]: p["shape"] for p in policy.modules[0].record["parameters"]}
    assert params and all(saved.get(name) == shape for name, shape in params.items())
