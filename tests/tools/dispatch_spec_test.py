"""Dispatch specs (dsa/stages/dispatch_spec.py) and their tuner (dsa/tools/dispatch_tune.py), with the real
iree-compile, iree-opt and IREE runtime on a small data-tiled convolution: an entry sets the tiles of the op it
was written for and of no other, the tuned module computes what the untuned one does, an entry that matches
nothing is reported, and bad specs or tuning files are refused naming the file and field; preprocess entries
choose Winograd per weight shape (x86-64-v3), never for a convolution into a bias."""

import json
import shutil
from pathlib import Path
from typing import Tuple

import numpy as np
import pytest

from dsa.core.errors import DsaError
from dsa.core.fileio import sha256_file
from dsa.stages import dispatch_spec
from dsa.stages.compile import (REPRODUCIBILITY_FLAGS, compile_module, dispatch_spec_path, load_tuning,
                                run_iree_compile, target_flags)
from dsa.tools import dispatch_tune
from dsa.tools.testing import runfile

CONV = """
func.func @main(%x: tensor<1x{c}x{h2}x{w2}xf32>, %w: tensor<{c}x{c}x3x3xf32>) -> tensor<1x{c}x{h}x{w}xf32> {{
  %zero = arith.constant 0.0 : f32
  %empty = tensor.empty() : tensor<1x{c}x{h}x{w}xf32>
  %init = linalg.fill ins(%zero : f32) outs(%empty : tensor<1x{c}x{h}x{w}xf32>) -> tensor<1x{c}x{h}x{w}xf32>
  %y = linalg.conv_2d_nchw_fchw {{dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}}
      ins(%x, %w : tensor<1x{c}x{h2}x{w2}xf32>, tensor<{c}x{c}x3x3xf32>)
      outs(%init : tensor<1x{c}x{h}x{w}xf32>) -> tensor<1x{c}x{h}x{w}xf32>
  return %y : tensor<1x{c}x{h}x{w}xf32>
}}
"""


def conv_mlir(tmp_path: Path, c=32, h=10, w=20) -> Path:
    path = tmp_path / f"conv_{c}x{h}x{w}.mlir"
    path.write_text(CONV.format(c=c, h=h, w=w, h2=h + 2, w2=w + 2))
    return path


def flags():
    """The x86-64-v4 target with resnet_policy's tuning for it: IREE 3.13 data-tiles convolutions for AVX-512
    only (its Mmt4dTilingExpert convolution, the op the tuner tiles). Compiling needs no AVX-512; running does."""
    target = json.loads(runfile("toolchains/targets/x86_64-v4.json").read_text())
    tuning = json.loads(runfile("toolchains/tuning/resnet_policy.x86_64-v4.json").read_text())
    return ["--iree-input-type=none", *target_flags(target, "test"), *tuning["flags"], *REPRODUCIBILITY_FLAGS]


def compile_(mlir, extra, out):
    run_iree_compile(mlir, [*flags(), *extra], out, "test")


def configured_root(tmp_path: Path, mlir: Path) -> dict:
    out = tmp_path / (mlir.stem + ".configured.mlir")
    compile_(mlir, [f"--compile-to={dispatch_spec.CONFIGURED_PHASE}"], out)
    roots = [r for r in dispatch_spec.configured_root_ops(out.read_text()) if dispatch_tune.conv_shape(r["op"])]
    assert len(roots) == 1, [r["op"][:100] for r in roots]
    return roots[0]


def other_config(root: dict) -> str:
    """A register tile that is not IREE's: the first candidate the tuner would try."""
    candidates = dispatch_tune.conv_candidates(root["op"], root["lowering_config"], vector_registers=32)
    assert candidates, "the tuner found nothing to try for a data-tiled convolution"
    return candidates[0][1]


def avx512_host() -> bool:
    from dsa.runtime import host

    return host.runs_here(json.loads(runfile("toolchains/targets/x86_64-v4.json").read_text()))


def run(vmfb: Path, x, w):
    import iree.runtime as rt

    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb.read_bytes()))
    return np.asarray(ctx.modules.module.main(x, w))


def reference(x, w):
    import numpy as np

    c, h, wd = w.shape[0], x.shape[2] - 2, x.shape[3] - 2
    out = np.zeros((1, c, h, wd), np.float64)
    for i in range(3):
        for j in range(3):
            out[0] += np.einsum("chw,oc->ohw", x[0, :, i:i + h, j:j + wd], w[:, :, i, j])
    return out


@pytest.fixture(scope="module")
def spec_case(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec")
    mlir = conv_mlir(tmp)
    root = configured_root(tmp, mlir)
    config = other_config(root)
    spec = tmp / "resnet_policy.x86_64-v4.spec.mlir"
    dispatch_spec.write_spec_file(spec, [{"name": "conv_32x10x20x32x3x3_f32", "op": root["op"],
                                          "lowering_config": config}], ["test spec"])
    return tmp, mlir, root, config, spec


def test_spec_entry_sets_its_tiles_on_the_convolution_it_was_written_for(spec_case):
    tmp, mlir, root, config, spec = spec_case
    assert dispatch_spec.spec_entries(spec) == ["conv_32x10x20x32x3x3_f32"]
    configured = tmp / "c.mlir"
    compile_(mlir, [f"--compile-to={dispatch_spec.CONFIGURED_PHASE}"], configured)
    tuned = tmp / "t.mlir"
    counts = dispatch_spec.apply_spec(configured, spec, tuned, "test")
    assert counts == {"conv_32x10x20x32x3x3_f32": 1}
    text = tuned.read_text()
    assert dispatch_tune.parse_config(config) != dispatch_tune.parse_config(root["lowering_config"])
    after = [r for r in dispatch_spec.configured_root_ops(text) if dispatch_tune.conv_shape(r["op"])]
    assert [dispatch_tune.parse_config(r["lowering_config"]) for r in after] == [dispatch_tune.parse_config(config)]


def test_tuned_module_computes_what_the_untuned_one_does(spec_case):
    tmp, mlir, _, _, spec = spec_case
    untuned, tuned = tmp / "untuned.vmfb", tmp / "tuned.vmfb"
    compile_(mlir, [], untuned)
    counts = dispatch_spec.compile_with_spec(mlir, flags(), spec, tuned, "test",
                                             lambda m, f, o: run_iree_compile(m, f, o, "test"))
    assert counts == {"conv_32x10x20x32x3x3_f32": 1}
    assert sha256_file(untuned) != sha256_file(tuned)  # another code generation, not the same module again
    again = tmp / "tuned_again.vmfb"
    dispatch_spec.compile_with_spec(mlir, flags(), spec, again, "test",
                                    lambda m, f, o: run_iree_compile(m, f, o, "test"))
    assert sha256_file(again) == sha256_file(tuned)  # deterministic
    if not avx512_host():
        pytest.skip("the modules are compiled for x86-64-v4 (IREE data-tiles convolutions for AVX-512 only); "
                    "this CPU cannot run them")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 32, 12, 22)).astype(np.float32)
    w = rng.standard_normal((32, 32, 3, 3)).astype(np.float32)
    ref = reference(x, w)
    for vmfb in (untuned, tuned):
        got = run(vmfb, x, w)
        assert np.max(np.abs(got - ref) / np.maximum(1.0, np.abs(ref))) < 1e-4, vmfb.name


def test_entry_for_another_shape_matches_nothing_and_the_report_says_so(spec_case, tmp_path, capsys):
    _, _, _, _, spec = spec_case
    other = conv_mlir(tmp_path, c=32, h=12, w=16)  # another convolution: the entry must not touch it
    configured = tmp_path / "c.mlir"
    compile_(other, [f"--compile-to={dispatch_spec.CONFIGURED_PHASE}"], configured)
    assert dispatch_spec.apply_spec(configured, spec, tmp_path / "t.mlir", "test") == {
        "conv_32x10x20x32x3x3_f32": 0}
    target = json.loads(runfile("toolchains/targets/x86_64-v4.json").read_text())
    tuning_dir = tmp_path / "tuning"
    tuning_dir.mkdir()
    shutil.copy(spec, tuning_dir / spec.name)
    tuning = json.loads(runfile("toolchains/tuning/resnet_policy.x86_64-v4.json").read_text())
    tuning["dispatch_spec"] = {"file": spec.name, "sha256": sha256_file(spec)}
    (tuning_dir / "resnet_policy.x86_64-v4.json").write_text(json.dumps(tuning))
    loaded = load_tuning(tuning_dir / "resnet_policy.x86_64-v4.json")
    view = {"model_id": "conv", "target": "x86_64-v4", "quant_scheme": {"kind": "none"}, "input_type": "none"}
    report = compile_module(other, view, target, tmp_path / "m.vmfb", where="conv", tuning=loaded)
    assert report["dispatch_spec"] == {"file": spec.name, "sha256": sha256_file(spec), "matched": {},
                                       "unmatched": ["conv_32x10x20x32x3x3_f32"]}
    err = capsys.readouterr().err
    assert "1 of 1 entries match no dispatch of this module (conv_32x10x20x32x3x3_f32)" in err


def test_tuning_file_pins_its_spec_by_name_and_digest(spec_case, tmp_path):
    _, _, _, _, spec = spec_case
    shutil.copy(spec, tmp_path / spec.name)
    tuning = json.loads(runfile("toolchains/tuning/resnet_policy.x86_64-v4.json").read_text())
    path = tmp_path / "resnet_policy.x86_64-v4.json"

    def refused(field, message):
        path.write_text(json.dumps(dict(tuning, dispatch_spec=field)))
        with pytest.raises(DsaError) as e:
            load_tuning(path)
        assert message in str(e.value) and str(path) in str(e.value), str(e.value)
        return str(e.value)

    good = {"file": spec.name, "sha256": sha256_file(spec)}
    path.write_text(json.dumps(dict(tuning, dispatch_spec=good)))
    assert dispatch_spec_path(json.loads(path.read_text()), path, "t") == tmp_path / spec.name
    assert load_tuning(path)["dispatch_spec_path"] == str(tmp_path / spec.name)
    assert "dispatch_spec.sha256" in refused(dict(good, sha256="0" * 64), "the tuning file pins")
    assert "dispatch_spec.file" in refused(dict(good, file="other.spec.mlir"), "resnet_policy.x86_64-v4.spec.mlir")
    refused({"file": spec.name}, 'is not {"file"')
    refused(dict(good, sha256="x"), "not a sha256")
    (tmp_path / spec.name).unlink()
    refused(good, "which is not beside")


@pytest.mark.parametrize("text, message", [
    ("module {}", "@__dsa_tune"),
    ("transform.named_sequence @__dsa_tune(", "no @match_<name> entry"),
    ("transform.named_sequence @__dsa_tune(\ntransform.named_sequence @match_a(\ntransform.named_sequence @match_a(",
     "entry 'a' is defined twice"),
])
def test_files_that_are_not_dispatch_specs_are_refused_naming_them(tmp_path, text, message):
    spec = tmp_path / "x.spec.mlir"
    spec.write_text(text)
    with pytest.raises(DsaError) as e:
        dispatch_spec.spec_entries(spec)
    assert message in str(e.value) and str(spec) in str(e.value)


def test_spec_that_is_not_valid_mlir_fails_the_compile_and_leaves_no_module(spec_case, tmp_path):
    _, mlir, _, _, spec = spec_case
    broken = tmp_path / "broken.spec.mlir"
    broken.write_text(spec.read_text().replace("transform.foreach_match", "transform.no_such_op", 1))
    target = json.loads(runfile("toolchains/targets/x86_64-v4.json").read_text())
    view = {"model_id": "conv", "target": "x86_64-v4", "quant_scheme": {"kind": "none"}, "input_type": "none"}
    out = tmp_path / "m.vmfb"
    tuning = json.loads(runfile("toolchains/tuning/resnet_policy.x86_64-v4.json").read_text())
    broken = broken.rename(tmp_path / "resnet_policy.x86_64-v4.spec.mlir")
    tuning["dispatch_spec"] = {"file": broken.name, "sha256": sha256_file(broken)}
    (tmp_path / "resnet_policy.x86_64-v4.json").write_text(json.dumps(tuning))
    with pytest.raises(DsaError) as e:
        compile_module(mlir, view, target, out, where="conv",
                       tuning=load_tuning(tmp_path / "resnet_policy.x86_64-v4.json"))
    assert "dispatch spec resnet_policy.x86_64-v4.spec.mlir" in str(e.value) and "iree-opt could not apply it" in str(e.value)
    assert not out.exists() and not list(tmp_path.glob(".m.vmfb*"))
    with pytest.raises(DsaError, match="not read with load_tuning"):  # read as plain JSON: refused, not ignored
        compile_module(mlir, view, target, out, where="conv", tuning=tuning)
    (tmp_path / "bin.spec.mlir").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DsaError, match="not UTF-8"):
        dispatch_spec.spec_entries(tmp_path / "bin.spec.mlir")


def test_tuner_reads_the_data_tiled_convolution_and_names_its_entries(spec_case):
    _, _, root, _, _ = spec_case
    assert dispatch_tune.conv_shape(root["op"]) == {"n": 1, "oc_o": 2, "oh": 10, "ow": 20, "oc_i": 16}
    fields = dispatch_tune.parse_config(root["lowering_config"])
    assert dispatch_tune.parse_config(dispatch_tune.format_config(fields)) == fields
    for registers in (16, 32):
        candidates = dispatch_tune.conv_candidates(root["op"], root["lowering_config"], vector_registers=registers)
        assert candidates
        for name, config in candidates:
            vcp = dispatch_tune.parse_config(config)["vector_common_parallel"]
            assert 4 <= vcp[1] * vcp[2] * vcp[3] <= registers - 4, name  # the accumulators fit the registers
    assert dispatch_tune.entry_name("main$async_dispatch_35_conv_512x15x20x512x3x3_f32") == \
        "conv_512x15x20x512x3x3_f32"
    assert dispatch_tune.conv_shape("%1 = linalg.matmul ins(%a, %b : tensor<4x4xf32>)") is None


def test_standalone_benchmark_takes_the_executable_from_the_sources():
    bench = "module {\n  util.global private @d\n  hal.executable private @e1 {\n    configured\n  }\n  util.func @bench\n}"
    sources = "module {\n  hal.executable private @e0 {\n  }\n  hal.executable private @e1 {\n    source\n  } loc(x)\n}"
    out = dispatch_tune.standalone_benchmark(bench, sources, "e1")
    assert "source" in out and "configured" not in out and "util.func @bench" in out and "@e0" not in out
    with pytest.raises(DsaError, match="no executable @e2"):
        dispatch_tune.standalone_benchmark(bench, sources, "e2")


def tuned_or_refused(tune, out: Path, evidence: Path) -> dict:
    """The tuner's result, or, where the whole model measured slower with the spec (timings decide), the
    evidence it wrote after refusing, with nothing else written."""
    try:
        return tune()
    except DsaError as e:
        assert "not faster with the spec" in str(e) and not out.exists()
        return json.loads(evidence.read_text())


def test_tuner_end_to_end_writes_a_spec_that_matches_and_pins_it_or_says_why_not(tmp_path):
    """`dsa tune-dispatches` on a profile directory of a one-convolution model: every dispatch it tries has
    evidence; a spec, when one is written, matches the whole model, is pinned in the tuning file, and compiles;
    when none is, the evidence says why (timings decide which: both outcomes are correct, neither is silent)."""
    if not avx512_host():
        pytest.skip("the tuner times x86-64-v4 modules (IREE data-tiles convolutions for AVX-512 only)")
    import subprocess

    from dsa.tools.profiler.runner import runtime_tool_path

    profile_dir = tmp_path / "profile"
    profile_dir.mkdir()
    mlir = conv_mlir(profile_dir, c=64, h=16, w=20)
    (profile_dir / "model.mlir").write_text(mlir.read_text())
    compile_(profile_dir / "model.mlir", ["--compile-to=executable-sources"], profile_dir / "executable_sources.mlir")
    functions = [l.split("@", 1)[1].split("(")[0] for l in
                 (profile_dir / "executable_sources.mlir").read_text().splitlines() if "func.func @" in l]
    rng = np.random.default_rng(0)
    np.save(profile_dir / "input0_x.npy", rng.standard_normal((1, 64, 18, 22)).astype(np.float32))
    np.save(profile_dir / "input1_w.npy", rng.standard_normal((64, 64, 3, 3)).astype(np.float32))
    (profile_dir / "profile.json").write_text(json.dumps({
        "model_id": "conv", "target": "x86_64-v4", "bucket": None, "flags": flags(),
        "inputs": {"x": [1, 64, 18, 22], "w": [64, 64, 3, 3]},
        "dispatches": [{"name": f, "total_ms": 1.0, "count": 1} for f in functions]}))
    params = tmp_path / "params.irpa"
    subprocess.run([runtime_tool_path("iree-create-parameters"), "--data=unused=4xf32", f"--output={params}"],
                   check=True, capture_output=True)
    tuning = tmp_path / "resnet_policy.x86_64-v4.json"
    shutil.copy(runfile("toolchains/tuning/resnet_policy.x86_64-v4.json"), tuning)
    tuning.write_text(json.dumps({k: v for k, v in json.loads(tuning.read_text()).items() if k != "dispatch_spec"}))
    out = tmp_path / "resnet_policy.x86_64-v4.spec.mlir"
    evidence = tmp_path / "resnet_policy.x86_64-v4.spec.evidence.json"
    result = tuned_or_refused(lambda: dispatch_tune.tune(
        profile_dir, out, evidence, params=params, top=4, rounds=2, min_time=0.05, keep_below=0.9, keep=None,
        tuning_file=tuning, log=lambda _: None), out, evidence)
    assert json.loads(evidence.read_text()) == json.loads(json.dumps(result))
    rows = result["dispatches"]
    assert len(rows) == 1 and rows[0]["entry"] == "conv_64x16x20x64x3x3_f32"  # one convolution: one row
    assert rows[0]["candidates"] > 0 and rows[0]["finalists"]
    assert ("chosen" in rows[0]) != ("kept_default" in rows[0])
    if out.exists():
        assert result["model"]["parity"] and result["model"]["matched"] == {rows[0]["entry"]: 1}
        pinned = load_tuning(tuning)
        assert pinned["dispatch_spec"] == {"file": out.name, "sha256": sha256_file(out)}
        counts = dispatch_spec.compile_with_spec(mlir, flags(), out, tmp_path / "m.vmfb", "test",
                                                 lambda m, f, o: run_iree_compile(m, f, o, "test"))
        assert counts == {rows[0]["entry"]: 1}
    else:
        assert "dispatch_spec" not in json.loads(tuning.read_text())


# -- preprocess entries: Winograd per weight shape (x86-64-v3) ---------------------------------------------

BIASED_CONV = CONV.replace(
    "%init = linalg.fill ins(%zero : f32) outs(%empty : tensor<1x{c}x{h}x{w}xf32>) -> tensor<1x{c}x{h}x{w}xf32>",
    "%b = arith.constant dense<0.5> : tensor<{c}xf32>\n"
    "  %init = linalg.broadcast ins(%b : tensor<{c}xf32>) outs(%empty : tensor<1x{c}x{h}x{w}xf32>) dimensions = [0, 2, 3]")


def v3_case(tmp_path: Path, rewrites):
    """A tuning directory holding resnet_policy's x86-64-v3 tuning with a spec of `rewrites`."""
    spec = tmp_path / "resnet_policy.x86_64-v3.spec.mlir"
    dispatch_spec.write_spec_file(spec, [], ["test spec"], rewrites)
    tuning = json.loads(runfile("toolchains/tuning/resnet_policy.x86_64-v3.json").read_text())
    tuning["dispatch_spec"] = {"file": spec.name, "sha256": sha256_file(spec)}
    path = tmp_path / "resnet_policy.x86_64-v3.json"
    path.write_text(json.dumps(tuning))
    target = json.loads(runfile("toolchains/targets/x86_64-v3.json").read_text())
    view = {"model_id": "conv", "target": "x86_64-v3", "quant_scheme": {"kind": "none"}, "input_type": "none"}
    return spec, load_tuning(path), target, view


def winograd(name, c):
    return {"name": name, "rewrite": "winograd", "weight": f"tensor<{c}x{c}x3x3xf32>"}


def test_winograd_entry_rewrites_the_convolution_of_its_weight_shape_and_computes_the_same(tmp_path, capsys):
    mlir = conv_mlir(tmp_path, c=32, h=14, w=20)
    spec, tuning, target, view = v3_case(tmp_path, [winograd("conv3x3_32x32", 32), winograd("conv3x3_64x64", 64)])
    assert dispatch_spec.spec_parts(spec) == {"preprocess": ["conv3x3_32x32", "conv3x3_64x64"], "tune": []}
    out = tmp_path / "w.vmfb"
    report = compile_module(mlir, view, target, out, where="conv", tuning=tuning)
    assert report["dispatch_spec"]["matched"] == {"conv3x3_32x32": 1}
    assert report["dispatch_spec"]["unmatched"] == ["conv3x3_64x64"]
    assert "1 of 2 entries match no dispatch of this module (conv3x3_64x64)" in capsys.readouterr().err
    assert out.read_bytes().count(b"winograd_input_transform") > 0
    again = tmp_path / "again"
    again.mkdir()
    compile_module(mlir, view, target, again / "w.vmfb", where="conv", tuning=tuning)
    assert sha256_file(again / "w.vmfb") == sha256_file(out)  # deterministic
    from dsa.runtime import host

    if not host.runs_here(target):
        pytest.skip("this CPU cannot run x86-64-v3 modules")
    # Weights scaled as a trained network's (fan-in): Winograd's rounding grows with the terms' magnitudes.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 32, 16, 22)).astype(np.float32)
    w = (rng.standard_normal((32, 32, 3, 3)) / np.sqrt(32 * 9)).astype(np.float32)
    ref = reference(x, w)
    got = run(out, x, w)
    assert np.max(np.abs(got - ref) / np.maximum(1.0, np.abs(ref))) < 2e-4  # the parity bound of every policy


def test_winograd_entry_leaves_a_convolution_into_a_bias_alone(tmp_path):
    """IREE's Winograd conversion drops the convolution's init: an entry must not match one that holds a bias."""
    mlir = tmp_path / "biased.mlir"
    mlir.write_text(BIASED_CONV.format(c=32, h=14, w=20, h2=16, w2=22))
    _, tuning, target, view = v3_case(tmp_path, [winograd("conv3x3_32x32", 32)])
    out = tmp_path / "b.vmfb"
    report = compile_module(mlir, view, target, out, where="conv", tuning=tuning)
    assert report["dispatch_spec"]["matched"] == {} and report["dispatch_spec"]["unmatched"] == ["conv3x3_32x32"]
    assert b"winograd_input_transform" not in out.read_bytes()
    from dsa.runtime import host

    if host.runs_here(target):
        rng = np.random.default_rng(1)
        x = rng.standard_normal((1, 32, 16, 22)).astype(np.float32)
        w = rng.standard_normal((32, 32, 3, 3)).astype(np.float32)
        ref = reference(x, w) + 0.5
        assert np.max(np.abs(run(out, x, w) - ref) / np.maximum(1.0, np.abs(ref))) < 2e-4


@pytest.mark.parametrize("rewrite, message", [
    (dict(winograd("a", 32), weight="tensor<32x32x5x5xf32>"), "is not a 3×3 convolution's weight type"),
    (dict(winograd("a", 32), rewrite="fft"), "unknown rewrite 'fft'"),
    (dict(winograd("a b", 32)), "is not a symbol"),
])
def test_preprocess_entries_that_cannot_be_written_are_refused_naming_them(rewrite, message):
    with pytest.raises(DsaError, match=message):
        dispatch_spec.write_spec([], [], [rewrite])


@pytest.mark.parametrize("text, message", [
    ("transform.named_sequence @rewrite_a(", "has preprocess entries but no transform sequence @__dsa_preprocess"),
    ("transform.named_sequence @__dsa_preprocess(", "has @__dsa_preprocess but no @rewrite_<name> entry"),
    ("transform.named_sequence @__dsa_preprocess(\ntransform.named_sequence @__dsa_tune(\n"
     "transform.named_sequence @rewrite_a(\ntransform.named_sequence @match_a(", "entry 'a' is defined twice"),
])
def test_specs_with_broken_preprocess_parts_are_refused_naming_them(tmp_path, text, message):
    spec = tmp_path / "x.spec.mlir"
    spec.write_text(text)
    with pytest.raises(DsaError) as e:
        dispatch_spec.spec_parts(spec)
    assert message in str(e.value) and str(spec) in str(e.value)


def v3_flags():
    target = json.loads(runfile("toolchains/targets/x86_64-v3.json").read_text())
    tuning = json.loads(runfile("toolchains/tuning/resnet_policy.x86_64-v3.json").read_text())
    return ["--iree-input-type=none", *target_flags(target, "test"), *tuning["flags"], *REPRODUCIBILITY_FLAGS]


def test_tuner_finds_the_winograd_candidates_by_weight_shape_and_skips_convolutions_into_a_bias(tmp_path):
    texts = []
    for name, template, c in (("fill", CONV, 32), ("fill2", CONV, 32), ("bias", BIASED_CONV, 16)):
        src = tmp_path / f"{name}.mlir"
        src.write_text(template.format(c=c, h=14, w=20, h2=16, w2=22))
        run_iree_compile(src, [*v3_flags(), f"--compile-to={dispatch_spec.INPUT_PHASE}"], tmp_path / f"{name}.in.mlir",
                         "test")
        texts.append((tmp_path / f"{name}.in.mlir").read_text())
    candidates, skipped = dispatch_tune.winograd_candidates("\n".join(texts))
    assert candidates == [{"name": "conv3x3_32x32", "weight": "tensor<32x32x3x3xf32>",
                           "input": "tensor<1x32x16x22xf32>", "output": "tensor<1x32x14x20xf32>", "count": 2}]
    assert [(s["entry"], s["convolutions"]) for s in skipped] == [("conv3x3_16x16", 1)]
    assert "not a zero fill" in skipped[0]["why"]


def test_a_winograd_entry_matching_a_dynamic_batch_is_refused_naming_it_and_the_buckets(tmp_path):
    """IREE's Winograd conversion cannot rewrite a convolution with a dynamic dimension (it fails without a
    message): the compile stops before it, naming the entry and how to give the dimension a size."""
    source = tmp_path / "dynamic.mlir"
    source.write_text(CONV.format(c=32, h=10, w=20, h2=12, w2=22).replace("tensor<1x", "tensor<?x").replace(
        "%empty = tensor.empty() :", "%c0 = arith.constant 0 : index\n  %n = tensor.dim %x, %c0 : tensor<?x32x12x22xf32>"
        "\n  %empty = tensor.empty(%n) :"))
    spec = tmp_path / "spec.mlir"
    dispatch_spec.write_spec_file(spec, [], [], [winograd("conv3x3_32x32", 32)])
    with pytest.raises(DsaError) as e:
        dispatch_spec.preprocess(source, v3_flags(), spec, tmp_path, "dynamic.mlir",
                                 lambda m, f, o: run_iree_compile(m, f, o, "test"))
    text = str(e.value)
    assert text.startswith("dynamic.mlir: dispatch spec spec.mlir: ")
    assert "entries conv3x3_32x32 match convolutions with a dynamic dimension" in text and "buckets" in text


HOIST_FLAG = "--iree-opt-const-expr-max-size-increase-threshold"


@pytest.mark.parametrize("threshold, at_load", [(None, False), (64 << 20, True)])
def test_a_winograd_filter_is_transformed_at_load_within_the_const_expr_limit_and_every_call_past_it(
        tmp_path, threshold, at_load):
    """The tuner times a convolution standalone with its weight a parameter, as the model's are: a 128-channel
    filter transforms into 4 MiB, past IREE's default const-expr limit (1 MiB), so the module transforms it on
    every call; with the limit raised in the tuning's flags, once, in the module's initializer. The standalone
    module pays what the model's does under the same flags."""
    candidate = {"name": "conv3x3_128x128", "weight": "tensor<128x128x3x3xf32>",
                 "input": "tensor<1x128x10x12xf32>", "output": "tensor<1x128x8x10xf32>"}
    source = tmp_path / "conv.mlir"
    source.write_text(dispatch_tune.STANDALONE_CONV.format(**candidate))
    spec = tmp_path / "spec.mlir"
    dispatch_spec.write_spec_file(spec, [], [], [winograd("conv3x3_128x128", 128)])
    flags = [f for f in v3_flags() if not f.startswith(HOIST_FLAG)]
    flags += [f"{HOIST_FLAG}={threshold}"] if threshold else []
    compile_ = lambda m, f, o: run_iree_compile(m, f, o, "test")
    rewritten, resume, counts = dispatch_spec.preprocess(source, flags, spec, tmp_path, "test", compile_)
    assert counts == {"conv3x3_128x128": 1}
    optimised = tmp_path / "global-opt.mlir"
    compile_(rewritten, [*flags, *resume, "--compile-to=global-optimization"], optimised)
    text = optimised.read_text()
    transform = text.index("winograd.filter_transform")
    where = max(text.rfind("util.initializer", 0, transform), text.rfind("@main(", 0, transform))
    assert text.startswith("util.initializer", where) == at_load, text[where:where + 200]


def v3_tuner_case(tmp_path: Path):
    """(a parameter archive the tuner's model check loads, resnet_policy's x86-64-v3 tuning without its spec,
    the spec and evidence paths to write) in `tmp_path`."""
    import subprocess

    from dsa.tools.profiler.runner import runtime_tool_path

    params = tmp_path / "params.irpa"
    subprocess.run([runtime_tool_path("iree-create-parameters"), "--data=unused=4xf32", f"--output={params}"],
                   check=True, capture_output=True)
    tuning = tmp_path / "resnet_policy.x86_64-v3.json"
    tuning.write_text(json.dumps({k: v for k, v in json.loads(runfile(
        "toolchains/tuning/resnet_policy.x86_64-v3.json").read_text()).items() if k != "dispatch_spec"}))
    return (params, tuning, tmp_path / "resnet_policy.x86_64-v3.spec.mlir",
            tmp_path / "resnet_policy.x86_64-v3.spec.evidence.json")


def test_winograd_tuner_end_to_end_writes_a_spec_that_matches_and_pins_it_or_says_why_not(tmp_path):
    """`dsa tune-dispatches --winograd` on a profile directory of a one-convolution model: the weight shape is
    measured both ways; a spec, when one is written, rewrites the model's convolution, is pinned and keeps its
    outputs; when none is, the evidence says why (timings decide which: both outcomes are correct)."""
    from dsa.runtime import host

    if not host.runs_here(json.loads(runfile("toolchains/targets/x86_64-v3.json").read_text())):
        pytest.skip("the tuner times x86-64-v3 modules, which this CPU cannot run")
    profile_dir = tmp_path / "profile"
    profile_dir.mkdir()
    mlir = conv_mlir(profile_dir, c=64, h=24, w=30)
    (profile_dir / "model.mlir").write_text(mlir.read_text())
    (profile_dir / "executable_sources.mlir").write_text("")  # a profile directory's; --winograd reads model.mlir
    rng = np.random.default_rng(0)
    np.save(profile_dir / "input0_x.npy", rng.standard_normal((1, 64, 26, 32)).astype(np.float32))
    np.save(profile_dir / "input1_w.npy", (rng.standard_normal((64, 64, 3, 3)) / 24).astype(np.float32))
    (profile_dir / "profile.json").write_text(json.dumps({
        "model_id": "conv", "target": "x86_64-v3", "bucket": None, "flags": v3_flags(),
        "inputs": {"x": [1, 64, 26, 32], "w": [64, 64, 3, 3]}, "dispatches": []}))
    params, tuning, out, evidence = v3_tuner_case(tmp_path)
    result = tuned_or_refused(lambda: dispatch_tune.tune_rewrites(
        profile_dir, out, evidence, params=params, rounds=2, min_time=0.05, keep_below=0.9, keep=None,
        tuning_file=tuning, log=lambda _: None), out, evidence)
    rows = result["rewrites"]
    assert [r["entry"] for r in rows] == ["conv3x3_64x64"] and rows[0]["convolutions"] == 1
    assert rows[0]["default_us"] > 0 and rows[0]["winograd_us"] > 0
    assert ("chosen" in rows[0]) != ("kept_default" in rows[0])
    if out.exists():
        assert result["model"]["parity"] and result["model"]["matched"] == {"conv3x3_64x64": 1}
        assert load_tuning(tuning)["dispatch_spec"] == {"file": out.name, "sha256": sha256_file(out)}
        assert dispatch_spec.spec_parts(out) == {"preprocess": ["conv3x3_64x64"], "tune": []}
    else:
        assert "dispatch_spec" not in json.loads(tuning.read_text())


# -- matmul entries: the ukernel extent and the ukernels per dispatch (x86-64-v3) --------------------------

# A batch matmul whose N (16) is smaller than its M (96): IREE's CPU data tiling computes its transpose
# (batch_mmt4d with the operands swapped) and unpacks the result transposed, in the matmul's dispatch. On
# x86 the unpack ukernel has no transposing fast path; the tuner times the dispatch without it.
BMM = """
func.func @main(%a: tensor<4x96x16xf32>, %b: tensor<4x16x16xf32>) -> tensor<4x96x16xf32> {
  %zero = arith.constant 0.0 : f32
  %empty = tensor.empty() : tensor<4x96x16xf32>
  %init = linalg.fill ins(%zero : f32) outs(%empty : tensor<4x96x16xf32>) -> tensor<4x96x16xf32>
  %y = linalg.batch_matmul ins(%a, %b : tensor<4x96x16xf32>, tensor<4x16x16xf32>)
      outs(%init : tensor<4x96x16xf32>) -> tensor<4x96x16xf32>
  return %y : tensor<4x96x16xf32>
}
"""


def configured_v3(tmp: Path, name: str, text: str, kind=lambda op: True) -> Tuple[Path, str, dict]:
    """(the model file, its IR configured at x86-64-v3, its one root op that `kind` accepts)."""
    mlir = tmp / f"{name}.mlir"
    mlir.write_text(text)
    configured = tmp / f"{name}.configured.mlir"
    run_iree_compile(mlir, [*v3_flags(), f"--compile-to={dispatch_spec.CONFIGURED_PHASE}"], configured, "test")
    text = configured.read_text()
    roots = [r for r in dispatch_spec.configured_root_ops(text) if kind(r["op"])]
    assert len(roots) == 1, [r["op"][:100] for r in roots]
    return mlir, text, roots[0]


@pytest.fixture(scope="module")
def bmm_case(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bmm")
    mlir, text, root = configured_v3(tmp, "bmm", BMM, dispatch_tune.mmt4d_shape)
    first, last, lines = dispatch_tune.executable_block(text, root["function"].rsplit("_matmul", 1)[0], "test")
    return tmp, mlir, root, dispatch_tune.variant_target("\n".join(lines[first:last + 1]), "test")


def _ukernel_calls(dump: Path, name: str) -> int:
    return sum(f.read_text().count(f"call i32 @iree_uk_{name}(") for f in dump.glob("*.codegen.ll"))


def test_tuner_reads_the_data_tiled_matmul_and_its_transposed_unpack(bmm_case):
    _, _, root, target = bmm_case
    assert dispatch_tune.mmt4d_shape(root["op"]) == {"batched": 1, "b": 4, "m1": 2, "k1": 16, "m0": 8, "k0": 1,
                                                     "n1": 12, "n0": 8}  # the transpose: M is B's 16 columns
    candidates = dispatch_tune.mmt4d_candidates(root["op"], root["lowering_config"])
    default = dispatch_tune.parse_config(root["lowering_config"])
    assert candidates
    for _, config in candidates:  # the ukernel's extent (m1 x n1 tiles per call), a workgroup holding whole calls
        fields = dispatch_tune.parse_config(config)
        vcp, dist = fields["vector_common_parallel"], fields["distribution"]
        assert vcp[0] == 1 and vcp[3:] == default["vector_common_parallel"][3:] and vcp[1:3] != [1, 1]
        assert dist[1] % vcp[1] == 0 and dist[2] % vcp[2] == 0
    for _, config in dispatch_tune.mmt4d_distribution_candidates(root["op"], root["lowering_config"]):
        d = dispatch_tune.parse_config(config)["distribution"]
        assert 4 * -(-2 // d[1]) * -(-12 // d[2]) >= dispatch_tune.MIN_WORKGROUPS
    assert 'ukernels = "all"' in target
    assert dispatch_tune.ukernel_alternatives(f'ukernels = "all"\n{root["op"]}\n%u = linalg.unpack %x') == ["mmt4d,pack"]
    assert dispatch_tune.ukernel_alternatives(f'ukernels = "mmt4d"\n%u = linalg.unpack %x') == []


def test_a_ukernels_entry_lowers_its_dispatch_without_the_unpack_ukernel_and_computes_the_same(bmm_case):
    """An entry may set the ukernels its dispatch is lowered with: it annotates the dispatch function with the
    variant's target but those ukernels, which IREE's codegen looks up before the variant's. The transposed
    unpack is then vectorised instead of calling the ukernel's element-by-element path; the results agree."""
    tmp, mlir, root, target = bmm_case
    compile_ = lambda m, f, o: run_iree_compile(m, f, o, "test")
    spec = tmp / "uk.spec.mlir"
    entry = {"name": "bmm_96x16", "op": root["op"], "lowering_config": root["lowering_config"],
             "ukernels": "mmt4d,pack", "target": target}
    dispatch_spec.write_spec_file(spec, [entry], ["test spec"])
    untuned_dump, tuned_dump = tmp / "untuned", tmp / "tuned"
    compile_(mlir, [*v3_flags(), f"--iree-hal-dump-executable-intermediates-to={untuned_dump}"], tmp / "u.vmfb")
    counts = dispatch_spec.compile_with_spec(
        mlir, [*v3_flags(), f"--iree-hal-dump-executable-intermediates-to={tuned_dump}"], spec, tmp / "t.vmfb",
        "test", compile_)
    assert counts == {"bmm_96x16": 1}
    assert _ukernel_calls(untuned_dump, "unpack") >= 1 and _ukernel_calls(untuned_dump, "mmt4d") == 1
    assert _ukernel_calls(tuned_dump, "unpack") == 0 and _ukernel_calls(tuned_dump, "mmt4d") == 1
    from dsa.runtime import host

    if not host.runs_here(json.loads(runfile("toolchains/targets/x86_64-v3.json").read_text())):
        pytest.skip("this CPU cannot run x86-64-v3 modules")
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 96, 16)).astype(np.float32)
    b = rng.standard_normal((4, 16, 16)).astype(np.float32)
    expected = np.einsum("bmk,bkn->bmn", a.astype(np.float64), b.astype(np.float64))
    for vmfb in (tmp / "u.vmfb", tmp / "t.vmfb"):
        np.testing.assert_allclose(run(vmfb, a, b), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ukernels, target, message", [
    ("mmt4d;pack", '#hal.executable.target<"llvm-cpu", "x", {ukernels = "all"}>', "not a set of IREE's CPU ukernels"),
    ("mmt4d,pack", '#hal.executable.target<"llvm-cpu", "x", {cpu = "x86-64-v3"}>', "cannot set the ukernels"),
    ("mmt4d,pack", '<"llvm-cpu", "x", {ukernels = "all"}>', "cannot set the ukernels"),
])
def test_ukernels_entries_that_cannot_be_written_are_refused_naming_them(bmm_case, ukernels, target, message):
    _, _, root, _ = bmm_case
    entry = {"name": "bmm", "op": root["op"], "lowering_config": root["lowering_config"], "ukernels": ukernels,
             "target": target}
    with pytest.raises(DsaError, match=message):
        dispatch_spec.write_spec([entry])


def test_preprocess_entries_read_back_as_written_and_a_foreign_one_is_refused(tmp_path):
    rewrites = [winograd("conv3x3_64x64", 64), winograd("conv3x3_128x128", 128)]
    spec = tmp_path / "s.spec.mlir"
    dispatch_spec.write_spec_file(spec, [], ["h"], rewrites)
    assert dispatch_spec.spec_rewrites(spec) == rewrites
    spec.write_text(spec.read_text().replace("transform.iree.match.cast_compatible_type %w = tensor<128x128x3x3xf32>",
                                             "transform.match.operation_name %w [\"x\"]"))
    with pytest.raises(DsaError, match="preprocess entry 'conv3x3_128x128' is not one"):
        dispatch_spec.spec_rewrites(spec)


def test_the_tile_tuner_keeps_the_preprocess_entries_a_profile_was_taken_with_or_asks_for_them(tmp_path):
    """Profiled with a spec's Winograd entries, the model's executables exist only with them (they hold
    Winograd's ops): the tile tuner carries the entries (and their evidence) into the spec it writes, from the
    spec the tuning file pins, and refuses to go on without that tuning file instead of writing a spec that
    would lose them. A profile without rewritten ops (an AVX-512 one, tile entries only) needs neither."""
    spec, _, _, _ = v3_case(tmp_path, [winograd("conv3x3_64x64", 64)])
    tuning = tmp_path / "resnet_policy.x86_64-v3.json"
    (tmp_path / "resnet_policy.x86_64-v3.spec.evidence.json").write_text(json.dumps(
        {"rewrites": [{"entry": "conv3x3_64x64", "chosen": "winograd"}], "model": {"parity": True}}))
    sources = "%1 = iree_linalg_ext.winograd.input_transform output_tile_size(6) ..."
    profile = {"dispatch_spec": {"conv3x3_64x64": 4}}
    with pytest.raises(DsaError, match="profiled with a dispatch spec's winograd entries.*pass --tuning"):
        dispatch_tune.carried_rewrites(profile, sources, None, "profile")
    rewrites, evidence = dispatch_tune.carried_rewrites(profile, sources, tuning, "p")
    assert rewrites == [winograd("conv3x3_64x64", 64)]
    assert evidence["entries"] == ["conv3x3_64x64"] and evidence["sha256"] == sha256_file(spec)
    assert evidence["rewrites"] == [{"entry": "conv3x3_64x64", "chosen": "winograd"}] and evidence["model"]["parity"]
    with pytest.raises(DsaError, match="entries conv3x3_32x32 that .* does not have"):
        dispatch_tune.carried_rewrites({"dispatch_spec": {"conv3x3_32x32": 1}}, sources, tuning, "p")
    no_spec = tmp_path / "no_spec.json"
    no_spec.write_text(json.dumps({k: v for k, v in json.loads(tuning.read_text()).items() if k != "dispatch_spec"}))
    with pytest.raises(DsaError, match="pins no dispatch spec with preprocess entries"):
        dispatch_tune.carried_rewrites(profile, sources, no_spec, "p")
    tiles_only = {"dispatch_spec": {"conv_512x15x20x512x3x3_f32": 1}}
    assert dispatch_tune.carried_rewrites(tiles_only, "%1 = linalg.generic", None, "p") == ([], None)


def tiny_profile(tmp_path: Path, model_id: str, text: str, inputs: dict) -> Path:
    """A `dsa profile` directory (x86-64-v3) of a one-dispatch model `text` with `inputs` (name → shape), its
    dispatches listed."""
    profile_dir = tmp_path / "profile"
    profile_dir.mkdir()
    (profile_dir / "model.mlir").write_text(text)
    run_iree_compile(profile_dir / "model.mlir", [*v3_flags(), "--compile-to=executable-sources"],
                     profile_dir / "executable_sources.mlir", "test")
    functions = [l.split("@", 1)[1].split("(")[0] for l in
                 (profile_dir / "executable_sources.mlir").read_text().splitlines() if "func.func @" in l]
    rng = np.random.default_rng(0)
    for i, (name, shape) in enumerate(inputs.items()):
        np.save(profile_dir / f"input{i}_{name}.npy", rng.standard_normal(shape).astype(np.float32))
    (profile_dir / "profile.json").write_text(json.dumps({
        "model_id": model_id, "target": "x86_64-v3", "bucket": None, "flags": v3_flags(), "inputs": inputs,
        "dispatches": [{"name": f, "total_ms": 1.0, "count": 1} for f in functions]}))
    return profile_dir


def bmm_profile(tmp_path: Path) -> Path:
    """A `dsa profile` directory (x86-64-v3) of the one-batch-matmul model BMM, its one dispatch listed."""
    return tiny_profile(tmp_path, "bmm", BMM, {"a": [4, 96, 16], "b": [4, 16, 16]})


def test_matmul_tuner_end_to_end_searches_extents_and_ukernels_and_pins_a_spec_or_says_why_not(tmp_path):
    """`dsa tune-dispatches` on a profile directory of a one-batch-matmul model (x86-64-v3): the dispatch is
    timed with other ukernel extents and without the unpack ukernel; a spec, when one is written, matches the
    whole model, keeps its outputs and is pinned; when none is, the evidence says why (timings decide which)."""
    from dsa.runtime import host

    if not host.runs_here(json.loads(runfile("toolchains/targets/x86_64-v3.json").read_text())):
        pytest.skip("the tuner times x86-64-v3 modules, which this CPU cannot run")
    profile_dir = bmm_profile(tmp_path)
    params, tuning, out, evidence = v3_tuner_case(tmp_path)
    result = tuned_or_refused(lambda: dispatch_tune.tune(
        profile_dir, out, evidence, params=params, top=4, rounds=2, min_time=0.05, keep_below=0.9, keep=None,
        tuning_file=tuning, log=lambda _: None), out, evidence)
    rows = result["dispatches"]
    assert [r["entry"] for r in rows] == ["matmul_like_4x96x16x16_f32"]
    assert "carried_rewrites" not in result
    assert rows[0]["candidates"] > 0 and rows[0]["finalists"]
    assert ("chosen" in rows[0]) != ("kept_default" in rows[0])
    if out.exists():
        assert result["model"]["parity"] and result["model"]["matched"] == {rows[0]["entry"]: 1}
        assert load_tuning(tuning)["dispatch_spec"] == {"file": out.name, "sha256": sha256_file(out)}
        assert dispatch_spec.spec_parts(out) == {"preprocess": [], "tune": [rows[0]["entry"]]}
        assert ('ukernels = "mmt4d,pack"' in out.read_text()) == ("chosen_ukernels" in rows[0])
    else:
        assert "dispatch_spec" not in json.loads(tuning.read_text())


def test_a_search_that_keeps_nothing_leaves_the_pinned_spec_and_its_evidence_as_they_were(tmp_path):
    """A search that writes no spec (here: no candidate may be kept, --keep-below 0) beside a spec its tuning
    file pins leaves that spec, its evidence and the tuning file byte for byte as they were, and writes its own
    evidence in the work directory instead (a pinned spec's evidence must keep describing it: the performance
    test reads its whole-model parity)."""
    from dsa.runtime import host

    if not host.runs_here(json.loads(runfile("toolchains/targets/x86_64-v3.json").read_text())):
        pytest.skip("the tuner times x86-64-v3 modules, which this CPU cannot run")
    profile_dir = bmm_profile(tmp_path)
    params, tuning, out, evidence = v3_tuner_case(tmp_path)
    out.write_text("// the pinned spec\n")
    evidence.write_text(json.dumps({"model": {"parity": True}}))
    tuning.write_text(json.dumps(dict(json.loads(tuning.read_text()),
                                      dispatch_spec={"file": out.name, "sha256": sha256_file(out)})))
    before = {p: p.read_bytes() for p in (out, evidence, tuning)}
    work = tmp_path / "work"
    said = []
    result = dispatch_tune.tune(profile_dir, out, evidence, params=params, top=4, rounds=2, min_time=0.05,
                                keep_below=0.0, keep=work, tuning_file=tuning, log=said.append)
    assert result["model"] is None and "kept_default" in result["dispatches"][0]
    assert {p: p.read_bytes() for p in before} == before
    assert json.loads((work / evidence.name).read_text()) == json.loads(json.dumps(result))
    assert f"{work / evidence.name} ({out.name} and {evidence.name} are unchanged)" in said[-1]


def test_a_candidate_that_fails_to_run_is_dropped_and_recorded_and_iree_own_failing_stops_the_search(bmm_case):
    """A tile IREE compiles may still crash when run (measured: a 8x32-tile ukernel extent of ACT's stem
    matmul): the search drops that candidate, says why in the evidence, and goes on; when IREE's own
    configuration cannot run, there is nothing to compare against and the search stops, naming the command."""
    from dsa.runtime import host

    if not host.runs_here(json.loads(runfile("toolchains/targets/x86_64-v3.json").read_text())):
        pytest.skip("this CPU cannot run x86-64-v3 modules")
    tmp, _, root, _ = bmm_case
    configured = (tmp / "bmm.configured.mlir").read_text()
    work = tmp / "bench"
    work.mkdir(exist_ok=True)
    bench = dispatch_tune.Bench(configured, root["lowering_config"], work, "local-task", "bmm",
                                inputs=["--input=4x96x16xf32=1", "--input=4x16x16xf32=1"])
    assert bench.compile("default", root["lowering_config"])
    broken = work / "broken.vmfb"
    broken.write_bytes(b"not a module")
    bench.modules["broken"] = broken
    result = bench.rounds(["broken"], 2, 0.01, seed=0)
    assert set(result) == {"default"} and bench.failed["broken"].startswith("failed to run: ")
    assert "iree-benchmark-module" in bench.failed["broken"]
    bench.modules["default"] = broken
    with pytest.raises(DsaError, match="iree-benchmark-module failed"):
        bench.rounds([], 1, 0.01, seed=0)


SOFTMAX = """
func.func @main(%x: tensor<4x40x70xf32>) -> tensor<4x40x70xf32> {
  %empty = tensor.empty() : tensor<4x40x70xf32>
  %y = linalg.softmax dimension(2) ins(%x : tensor<4x40x70xf32>) outs(%empty : tensor<4x40x70xf32>)
      -> tensor<4x40x70xf32>
  return %y : tensor<4x40x70xf32>
}
"""


@pytest.fixture(scope="module")
def softmax_case(tmp_path_factory):
    """(work dir, the softmax model, its configured IR's text, its root op) at x86-64-v3."""
    tmp = tmp_path_factory.mktemp("softmax")
    return (tmp, *configured_v3(tmp, "softmax", SOFTMAX))


def test_tuner_reads_a_decomposed_softmax_as_a_reduction_with_the_ops_that_share_its_row(softmax_case):
    """IREE decomposes a softmax into a max, a sum of exponentials (the root op, with the distribution) and a
    normalisation, each with its own vector tile along the row: the tuner varies the row's tile of all of
    them (r: both reductions, p: the normalisation) and the rows per workgroup (multiples of the vector
    tile, or IREE's own)."""
    _, _, text, root = softmax_case
    fields, extent, sizes = dispatch_tune._reduction_fields(root["op"], root["lowering_config"])
    assert (extent, sizes) == (70, [4, 40, 70])
    siblings = dispatch_tune.reduction_siblings(text, root["lowering_config"])
    assert len(siblings) == 2 and {("vector_reduction" in s) for s in siblings} == {True, False}
    candidates = dispatch_tune.reduction_candidates(root["op"], root["lowering_config"], text)
    names = [c[0] for c in candidates]
    assert "r64p64" in names and not any("128" in n for n in names)  # no tile past the row (70)
    name, config, sib = candidates[names.index("r64p64")]
    assert "vector_reduction = [0, 0, 64]" in config and {new for _, new in sib} == {
        dispatch_tune._retile(s, 64) for s in siblings}
    for _, dist in dispatch_tune.reduction_distribution_candidates(root["op"], config):
        d = dispatch_tune.parse_config(dist)["distribution"]
        assert d[2] == 0 and all(x % v == 0 or x == own for x, v, own in
                                 zip(d, fields["vector_common_parallel"], fields["distribution"]) if v)
    assert dispatch_tune.search_space(root["op"], root["lowering_config"], 16, text) is not None


def test_a_sibling_entry_sets_the_row_tiles_of_its_whole_softmax_and_computes_the_same(softmax_case):
    """A spec entry with siblings sets its root op's config and the configs of the ops IREE configured with
    each sibling's `from` in the same dispatch; the module computes the same softmax as the one without."""
    tmp, mlir, text, root = softmax_case
    name, config, sib = next(c for c in dispatch_tune.reduction_candidates(root["op"], root["lowering_config"], text)
                             if c[0] == "r32p64")
    spec = tmp / "softmax.spec.mlir"
    dispatch_spec.write_spec_file(spec, [{"name": "softmax_4x40x70", "op": root["op"], "lowering_config": config,
                                          "siblings": [{"from": a, "to": b} for a, b in sib]}], ["test"])
    configured = tmp / "softmax.configured.mlir"
    tuned = tmp / "softmax.tuned.mlir"
    assert dispatch_spec.apply_spec(configured, spec, tuned, "test") == {"softmax_4x40x70": 1}
    out = tuned.read_text()
    assert out.count("vector_reduction = [0, 0, 32]") == 2 and "vector_inner_parallel = [0, 0, 64]" in out
    assert "vector_reduction = [0, 0, 8]" not in out and "vector_reduction = [0, 0, 16]" not in out
    run_iree_compile(tmp / "softmax.tuned.mlir", [f"--compile-from={dispatch_spec.CONFIGURED_PHASE}"],
                     tmp / "tuned.vmfb", "test")
    run_iree_compile(mlir, v3_flags(), tmp / "untuned.vmfb", "test")
    import iree.runtime as rt

    x = np.random.default_rng(0).standard_normal((4, 40, 70)).astype(np.float32) * 4
    want = np.exp(x - x.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    for vmfb in ("tuned.vmfb", "untuned.vmfb"):
        config = rt.Config("local-task")
        ctx = rt.SystemContext(config=config)
        ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, (tmp / vmfb).read_bytes()))
        np.testing.assert_allclose(np.asarray(ctx.modules.module.main(x)), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sibling, message", [
    ({"from": "vector_reduction = [0, 0, 8]", "to": "#iree_cpu.lowering_config<vector_reduction = [0, 0, 16]>"},
     "sibling from"),
    ({"from": "#iree_cpu.lowering_config<vector_reduction = [0, 0, 8]>", "to": "64"}, "sibling to"),
])
def test_sibling_entries_that_cannot_be_written_are_refused_naming_them(softmax_case, sibling, message):
    _, _, _, root = softmax_case
    with pytest.raises(DsaError, match=message):
        dispatch_spec.write_spec([{"name": "softmax_4x40x70", "op": root["op"],
                                   "lowering_config": root["lowering_config"], "siblings": [sibling]}])


def test_softmax_tuner_end_to_end_searches_the_row_tiles_and_pins_a_spec_or_says_why_not(tmp_path):
    """`dsa tune-dispatches` on a profile directory of a one-softmax model (x86-64-v3): the softmax's row tiles
    are searched with the ops that share its row; a spec, when one is written, sets them all, matches the whole
    model, keeps its outputs and is pinned; when none is, the evidence says why (timings decide which)."""
    from dsa.runtime import host

    if not host.runs_here(json.loads(runfile("toolchains/targets/x86_64-v3.json").read_text())):
        pytest.skip("the tuner times x86-64-v3 modules, which this CPU cannot run")
    profile_dir = tiny_profile(tmp_path, "softmax", SOFTMAX, {"x": [4, 40, 70]})
    params, tuning, out, evidence = v3_tuner_case(tmp_path)
    result = tuned_or_refused(lambda: dispatch_tune.tune(
        profile_dir, out, evidence, params=params, top=4, rounds=2, min_time=0.05, keep_below=0.9, keep=None,
        tuning_file=tuning, log=lambda _: None), out, evidence)
    rows = result["dispatches"]
    assert len(rows) == 1 and rows[0]["entry"].startswith("softmax_4x40x70")
    assert rows[0]["candidates"] > 0 and rows[0]["finalists"]
    assert all(f.get("siblings") or f["name"].startswith("default_") for f in rows[0]["finalists"])
    assert ("chosen" in rows[0]) != ("kept_default" in rows[0])
    if out.exists():
        assert result["model"]["parity"] and result["model"]["matched"] == {rows[0]["entry"]: 1}
        assert load_tuning(tuning)["dispatch_spec"] == {"file": out.name, "sha256": sha256_file(out)}
        assert (f"@dsa_set_{rows[0]['entry']}" in out.read_text()) == ("chosen_siblings" in rows[0])
    else:
        assert "dispatch_spec" not in json.loads(tuning.read_text())


MASKED_SUM = """%8 = linalg.generic {indexing_maps = [affine_map<(d0, d1) -> (d0, d1)>, affine_map<(d0, d1) -> (d0)>, affine_map<(d0, d1) -> (d0)>], iterator_types = ["parallel", "reduction"]} ins(%2, %6 : tensor<4x8xf32>, tensor<4xf32>) outs(%7 : tensor<4xf32>) attrs =  {lowering_config = #iree_cpu.lowering_config<distribution = [1, 0], vector_common_parallel = [1, 0], vector_reduction = [0, 8]>} {
^bb0(%in: f32, %in_1: f32, %out: f32):
%10 = arith.addf %in, %cst_0 : f32
%11 = arith.subf %10, %in_1 : f32
%12 = arith.addf %11, %out : f32
linalg.yield %12 : f32
} -> tensor<4xf32>"""


def test_a_root_op_whose_body_uses_a_value_from_outside_is_skipped_and_no_entry_is_written_for_it():
    """A masked softmax's sum (SmolVLA) adds a constant of the dispatch function inside its region: no matcher
    can name it (a spec with one failed to parse; one that defined the constant itself matched nothing), so the
    tuner skips such a root op and writing an entry for it is refused naming the value."""
    assert dispatch_spec.captured_values(MASKED_SUM) == ["%cst_0"]
    own = MASKED_SUM.replace("%cst_0", "%in_1")
    assert dispatch_spec.captured_values(own) == [] and "^bb0" in dispatch_spec.dag_pattern(own)
    with pytest.raises(DsaError, match="%cst_0, defined outside it"):
        dispatch_spec.write_spec([{"name": "masked", "op": MASKED_SUM,
                                   "lowering_config": "#iree_cpu.lowering_config<distribution = [2, 0]>"}])
