"""Unit tests of the stage tools, called as functions (no Bazel): each bad input is refused with a message
naming the file and field, tensor or op at fault, and leaves no output behind."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from dsa.stages.compile import compile_module
from dsa.core.errors import DsaError
from dsa.stages.export import export_model
from dsa.core.fileio import read_json, sha256_file
from dsa.core.formats import ModuleIndex
from dsa.runtime.policy import read_archive_metadata
from dsa.stages.params import build_params


@pytest.fixture(scope="module")
def exported(tmp_path_factory, pi0_manifest):
    import copy

    from dsa.manifest.contract import project

    view = copy.deepcopy(project(pi0_manifest, "export"))
    view["model"] = {"entry_point": "tiny_models:pooled", "config": {"width": 8}}
    out = tmp_path_factory.mktemp("export")
    record = export_model(view, out / "m.mlir", out / "m.json")
    return view, out, record


def _checkpoint(path, record, transform=None):
    rng = np.random.default_rng(0)
    tensors = {p["name"]: rng.standard_normal(p["shape"]).astype(np.float32) for p in record["parameters"]}
    if transform:
        transform(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _params_view(path):
    return {"model_id": "tiny", "checkpoint": {"path": path.name, "sha256": sha256_file(path)},
            "quant_scheme": {"kind": "none"}}


def test_export_record_names_every_parameter_and_the_dynamic_dim(exported):
    view, out, record = exported
    assert {p["name"] for p in record["parameters"]} == {"embed.weight", "embed.bias", "head.weight", "head.bias"}
    assert record["dynamic_dims"] == {"seq_len": {"min": 2, "max": 65536}}
    assert record["inputs"][0]["shape"] == [1, "seq_len", 4]
    mlir = (out / "m.mlir").read_text()
    assert '#flow.parameter.named<"model"::"head.weight">' in mlir
    assert "dense_resource" not in mlir  # no weight values inlined


def test_export_is_deterministic(exported, tmp_path):
    view, out, _ = exported
    export_model(view, tmp_path / "again.mlir", tmp_path / "again.json")
    assert (tmp_path / "again.mlir").read_bytes() == (out / "m.mlir").read_bytes()
    assert (tmp_path / "again.json").read_bytes() == (out / "m.json").read_bytes()


def test_bucket_export_is_static_and_checked_against_the_model_record(exported, tmp_path):
    view, _, record = exported
    bucket = export_model(view, tmp_path / "b.mlir", tmp_path / "b.json",
                          bucket={"dim": "seq_len", "size": 8, "slot": 0}, reference_record=record)
    assert bucket["inputs"][0]["shape"] == [1, 8, 4]
    assert bucket["bucket"] == {"dim": "seq_len", "size": 8, "slot": 0}


def test_bucket_below_model_minimum_is_refused(exported, tmp_path):
    view, _, _ = exported
    with pytest.raises(DsaError, match=r"buckets\.seq_len\[0\].*below the model's minimum 2"):
        export_model(view, tmp_path / "b.mlir", tmp_path / "b.json", bucket={"dim": "seq_len", "size": 1, "slot": 0})
    assert not (tmp_path / "b.mlir").exists()


def test_unsupported_op_is_named_with_its_module_path(tiny_view, tmp_path):
    tiny_view["model"]["entry_point"] = "tiny_models:eig"
    with pytest.raises(DsaError) as err:
        export_model(tiny_view, tmp_path / "e.mlir", tmp_path / "e.json")
    assert "unsupported op" in str(err.value) and "linalg_eig" in str(err.value)
    assert "solver" in str(err.value)
    assert not (tmp_path / "e.mlir").exists()


def test_op_that_imports_but_cannot_be_lowered_is_refused_at_export_with_its_module_path(tiny_view, tmp_path):
    # aten.upsample_bilinear2d.vec imports into the torch dialect; iree-compile would fail later, blaming a
    # float constant that feeds it.
    tiny_view["model"]["entry_point"] = "tiny_models:upsample"
    with pytest.raises(DsaError) as err:
        export_model(tiny_view, tmp_path / "u.mlir", tmp_path / "u.json")
    text = str(err.value)
    assert "IREE cannot lower op 'aten.upsample_bilinear2d.vec' in module head.resize (Resize)" in text, text
    assert "decomposition" in text and "split the model" in text
    assert not (tmp_path / "u.mlir").exists() and not (tmp_path / "u.json").exists()


def test_custom_op_without_a_decomposition_is_refused_naming_op_and_module(tiny_view, tmp_path):
    tiny_view["model"]["entry_point"] = "tiny_models:custom_op_without_decomposition"
    with pytest.raises(DsaError, match=r"unsupported op 'dsa_tiny\.softsign' in module act\.softsign "
                                       r"\(_Softsign\).*ExportSpec\.decompositions"):
        export_model(tiny_view, tmp_path / "c.mlir", tmp_path / "c.json")
    assert not (tmp_path / "c.mlir").exists()


def test_custom_op_with_its_decomposition_exports_compiles_and_matches_eager(tiny_view, tmp_path, target_spec):
    import iree.runtime as rt
    import torch
    from tiny_models import SoftsignMlp

    tiny_view["model"]["entry_point"] = "tiny_models:custom_op_with_decomposition"
    record = export_model(tiny_view, tmp_path / "c.mlir", tmp_path / "c.json")
    mlir = (tmp_path / "c.mlir").read_text()
    assert 'torch.operator "' not in mlir and "torch.aten.abs" in mlir
    assert record["op_histogram"].get("aten::abs") == 1
    # The eager module (the custom op's own kernel) and the vmfb (its decomposition) agree.
    torch.manual_seed(0)
    model = SoftsignMlp().eval()
    ckpt = tmp_path / "c.safetensors"
    save_file({k: v.detach().numpy() for k, v in model.state_dict().items()}, str(ckpt))
    build_params(ckpt, _params_view(ckpt), record, tmp_path / "c.irpa")
    compile_module(tmp_path / "c.mlir", {"model_id": "tiny", "quant_scheme": {"kind": "none"},
                                         "target": target_spec["name"]}, target_spec, tmp_path / "c.vmfb")
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    instance = rt.VmInstance()
    device = rt.get_device("local-task")
    index = rt.ParameterIndex()
    index.load(str(tmp_path / "c.irpa"))
    vm_module = rt.VmModule.copy_buffer(instance, (tmp_path / "c.vmfb").read_bytes())
    context = rt.VmContext(instance, modules=[
        rt.create_hal_module(instance, device),
        rt.create_io_parameters_module(instance, index.create_provider(scope="model")), vm_module])
    got = rt.FunctionInvoker(context, device, vm_module.lookup_function("main"))(x).to_host()
    assert np.abs(got - expected).max() <= 1e-6


def test_unimportable_entry_point_names_the_field(tiny_view, tmp_path):
    tiny_view["model"]["entry_point"] = "no_such_package.models:build"
    with pytest.raises(DsaError, match=r"model\.entry_point: cannot import 'no_such_package\.models'"):
        export_model(tiny_view, tmp_path / "e.mlir", tmp_path / "e.json")


def test_params_archive_holds_every_tensor_with_shape_and_dtype(exported, tmp_path):
    _, _, record = exported
    ckpt = _checkpoint(tmp_path / "c.safetensors", record)
    build_params(ckpt, _params_view(ckpt), record, tmp_path / "p.irpa")
    meta = read_archive_metadata(tmp_path / "p.irpa")
    assert meta["head.weight"]["shape"] == [2, 11] and meta["head.weight"]["dtype"] == "float32"
    build_params(ckpt, _params_view(ckpt), record, tmp_path / "p2.irpa")
    assert (tmp_path / "p.irpa").read_bytes() == (tmp_path / "p2.irpa").read_bytes()


def test_checkpoint_sha256_mismatch_is_refused_and_writes_nothing(exported, tmp_path):
    _, _, record = exported
    ckpt = _checkpoint(tmp_path / "c.safetensors", record)
    view = _params_view(ckpt)
    view["checkpoint"]["sha256"] = "0" * 64
    with pytest.raises(DsaError, match=r"checkpoint\.sha256: checkpoint .* has sha256 [0-9a-f]{64}, but the manifest pins 0{64}"):
        build_params(ckpt, view, record, tmp_path / "p.irpa")
    assert list(tmp_path.glob("p.irpa*")) == []


def test_transposed_tensor_is_refused_by_name(exported, tmp_path):
    _, _, record = exported
    ckpt = _checkpoint(tmp_path / "c.safetensors", record,
                       lambda t: t.update({"head.weight": np.ascontiguousarray(t["head.weight"].T)}))
    with pytest.raises(DsaError, match=r"tensor 'head\.weight'.*shape \[11, 2\] float32, the exported model expects \[2, 11\]"):
        build_params(ckpt, _params_view(ckpt), record, tmp_path / "p.irpa")
    assert list(tmp_path.glob("p.irpa*")) == []


def test_missing_and_extra_tensors_are_listed(exported, tmp_path):
    _, _, record = exported
    def edit(t):
        t.pop("embed.bias")
        t["decoder.weight"] = np.zeros((2, 2), np.float32)
    ckpt = _checkpoint(tmp_path / "c.safetensors", record, edit)
    with pytest.raises(DsaError, match=r"missing 1 tensor\(s\) the model needs: embed\.bias; 1 tensor\(s\) the model does not have: decoder\.weight"):
        build_params(ckpt, _params_view(ckpt), record, tmp_path / "p.irpa")


def test_not_a_safetensors_file_is_refused(exported, tmp_path):
    _, _, record = exported
    bad = tmp_path / "c.safetensors"
    bad.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(DsaError, match="not a readable safetensors file"):
        build_params(bad, _params_view(bad), record, tmp_path / "p.irpa")


def test_compile_refuses_host_cpu(exported, target_spec, tmp_path):
    _, out, _ = exported
    spec = dict(target_spec, flags=["--iree-llvmcpu-target-cpu=host"])
    view = {"model_id": "tiny", "quant_scheme": {"kind": "none"}, "target": spec["name"]}
    with pytest.raises(DsaError, match="build machine's own CPU"):
        compile_module(out / "m.mlir", view, spec, tmp_path / "m.vmfb")
    assert not (tmp_path / "m.vmfb").exists()


def test_compile_is_reproducible_and_reports_dispatches(exported, target_spec, tmp_path):
    _, out, _ = exported
    view = {"model_id": "tiny", "quant_scheme": {"kind": "none"}, "target": target_spec["name"]}
    report = compile_module(out / "m.mlir", view, target_spec, tmp_path / "a.vmfb", tmp_path / "a.json")
    compile_module(out / "m.mlir", view, target_spec, tmp_path / "b.vmfb")
    assert (tmp_path / "a.vmfb").read_bytes() == (tmp_path / "b.vmfb").read_bytes()
    assert report["dispatch_count"] >= 1 and "--iree-llvmcpu-target-cpu=x86-64-v3" in report["flags"]
    assert read_json(tmp_path / "a.json")["vmfb_sha256"] == sha256_file(tmp_path / "a.vmfb")


def test_a_tunings_runtime_flags_reach_the_compile_report_and_the_module_index(exported, target_spec, tmp_path):
    _, out, _ = exported
    view = {"model_id": "tiny", "quant_scheme": {"kind": "none"}, "target": target_spec["name"]}
    tuning = {"format": 1, "family": "f", "target": target_spec["name"], "flags": [],
              "runtime_flags": ["--task_worker_stack_size=524288"]}
    report = compile_module(out / "m.mlir", view, target_spec, tmp_path / "a.vmfb", tmp_path / "a.json",
                            tuning=tuning)
    assert read_json(tmp_path / "a.json")["runtime_flags"] == ["--task_worker_stack_size=524288"]
    # The flag is the runner's, not the compiler's: the module's bytes are those of the same tuning without it.
    untouched = compile_module(out / "m.mlir", view, target_spec, tmp_path / "b.vmfb",
                               tuning=dict(tuning, runtime_flags=[]))
    assert "runtime_flags" not in untouched and untouched["vmfb_sha256"] == report["vmfb_sha256"]
    index = ModuleIndex(target="x86_64-v3", target_spec="t.json", parameter_archive="p.irpa",
                        parameter_scope="model", runtime_view="r.json", modules=(("a.vmfb", "a.json"),),
                        runtime_flags=tuple(report["runtime_flags"]))
    assert ModuleIndex.from_json(json.loads(index.text()), "i").runtime_flags == ("--task_worker_stack_size=524288",)
    # An index without runtime flags keeps the bytes it had before the field existed.
    assert "runtime_flags" not in ModuleIndex(**{**index.__dict__, "runtime_flags": ()}).to_json()


def test_a_module_needing_more_worker_stack_than_the_process_set_up_is_refused(monkeypatch):
    from dsa.runtime import iree_flags

    monkeypatch.setattr(iree_flags, "_in_effect", None)
    # The first module sets IREE's runtime up (the real flag: the runtime refuses a name it does not know).
    iree_flags.require(["--task_worker_stack_size=262144"], "first.modules.json")
    assert iree_flags.in_effect() == {"--task_worker_stack_size": 262144}
    iree_flags.require([], "plain.modules.json")
    iree_flags.require(["--task_worker_stack_size=131072"], "smaller.modules.json")
    with pytest.raises(DsaError, match=r"big\.modules\.json: needs the IREE runtime flags "
                                       r"--task_worker_stack_size=524288, but this process set up IREE's runtime "
                                       r"for an earlier module with --task_worker_stack_size=262144"):
        iree_flags.require(["--task_worker_stack_size=524288"], "big.modules.json")


def test_compiler_failure_leaves_no_vmfb(target_spec, tmp_path):
    bad = tmp_path / "bad.mlir"
    bad.write_text("func.func @main( {")
    view = {"model_id": "tiny", "quant_scheme": {"kind": "none"}, "target": target_spec["name"]}
    with pytest.raises(DsaError, match="iree-compile failed"):
        compile_module(bad, view, target_spec, tmp_path / "bad.vmfb")
    assert list(tmp_path.glob("bad.vmfb*")) == []


def test_cli_reports_error_without_traceback(exported, tmp_path):
    _, _, record = exported
    ckpt = _checkpoint(tmp_path / "c.safetensors", record)
    view = _params_view(ckpt)
    view["checkpoint"]["sha256"] = "f" * 64
    (tmp_path / "view.json").write_text(json.dumps(view))
    (tmp_path / "rec.json").write_text(json.dumps(record))
    proc = subprocess.run(
        [sys.executable, "-m", "dsa.stages.params", "--checkpoint", str(ckpt), "--view", str(tmp_path / "view.json"),
         "--record", str(tmp_path / "rec.json"), "--manifest-name", "manifests/tiny.yaml",
         "--out", str(tmp_path / "p.irpa")],
        capture_output=True, text=True, env={"PYTHONPATH": ":".join(sys.path)},
    )
    assert proc.returncode == 2
    assert "manifests/tiny.yaml: checkpoint.sha256" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "p.irpa").exists()


def test_sample_inputs_takes_a_dynamic_batch_at_its_smallest_size():
    """A LeRobot module's batch is dynamic (shape ['batch', ...]): `dsa run` without --observation samples it at
    its minimum instead of failing on the dim's name; an explicit size wins; a bucketed dim keeps its size."""
    from dsa.runtime.policy import sample_inputs

    record = {
        "dynamic_dims": {"batch": {"min": 1, "max": 65536}},
        "inputs": [
            {"name": "image", "dtype": "float32", "shape": ["batch", 3, 8, 8], "dims": {"0": "batch"}},
            {"name": "tokens", "dtype": "int64", "shape": ["batch", 32], "dims": {"0": "batch", "1": "prompt_len"},
             "sample_range": [1, 9]},
            {"name": "steps", "dtype": "int64", "shape": [], "value_range": [1, 100]},
        ],
    }
    values = sample_inputs(record, {}, np.random.default_rng(0))
    assert values["image"].shape == (1, 3, 8, 8) and values["tokens"].shape == (1, 32)
    assert int(values["steps"]) == 1
    assert sample_inputs(record, {"batch": 3}, np.random.default_rng(0))["image"].shape == (3, 3, 8, 8)


def test_module_index_is_written_and_read_only_through_its_class(tmp_path):
    """ModuleIndex (dsa/core/formats.py) is every index's writer (DsaLock, dsa compile, the bundle) and reader:
    it round-trips, and refuses another format or a missing field naming the file."""
    from dsa.core.formats import INDEX_FORMAT, ModuleIndex

    index = ModuleIndex(target="x86_64-v3", target_spec="m/x86_64-v3.json", parameter_archive="m_model/params.irpa",
                        parameter_scope="model", runtime_view="m_model/runtime_view.json",
                        modules=(("m/a.vmfb", "b/a.export_record.json"),))
    path = tmp_path / "m.modules.json"
    index.write(path)
    assert ModuleIndex.read(path) == index
    data = json.loads(path.read_text())
    assert data["format"] == INDEX_FORMAT and data["modules"] == [{"vmfb": "m/a.vmfb", "record": "b/a.export_record.json"}]
    path.write_text(json.dumps(dict(data, format=INDEX_FORMAT + 1)))
    with pytest.raises(DsaError, match=f"m.modules.json: module index format {INDEX_FORMAT + 1} is not supported"):
        ModuleIndex.read(path)
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "runtime_view"}))
    with pytest.raises(DsaError, match="module index lacks runtime_view"):
        ModuleIndex.read(path)


def test_a_dispatch_over_the_stack_limit_names_the_tuning_field_and_the_families_that_raise_it(exported, target_spec,
                                                                                              tmp_path):
    """iree-compile's `exceeded stack allocation limit` (an ACT compile without `tuning: resnet_policy`): the
    refusal says the bytes needed and allowed, the manifest field to set and the families whose tuning raises
    the limit, not only the compiler's line."""
    export_view = dict(exported[0], model={"entry_point": "tiny_models:stack_heavy", "config": {}})
    export_model(export_view, tmp_path / "s.mlir", tmp_path / "s.json")
    view = {"model_id": "tiny", "quant_scheme": {"kind": "none"}, "target": target_spec["name"], "tuning": "f"}
    tuning = {"format": 1, "family": "f", "target": target_spec["name"],
              "flags": ["--iree-llvmcpu-stack-allocation-limit=1"]}
    with pytest.raises(DsaError) as info:
        compile_module(tmp_path / "s.mlir", view, target_spec, tmp_path / "m.vmfb", tuning=tuning)
    text = str(info.value)
    assert "exceeded stack allocation limit" in text and "\n" not in text
    assert re.search(r"a dispatch needs \d+ bytes of stack; the manifest's tuning 'f' allows 1 bytes", text), text
    assert "Set the manifest's `tuning:`" in text and "resnet_policy" in text and "pi_full" in text
    assert list(tmp_path.glob("m.vmfb*")) == []
