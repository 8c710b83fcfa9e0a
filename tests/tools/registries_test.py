"""The one-owner tables and the policies index: every LeRobot policy type (dsa.core.lerobot_types) names a front-end
module that serves it and processor steps the torch-free runtime implements; every file front end
(dsa.core.formats.FILE_FRONT_ENDS) is in the manifest schema's `framework` enum and names an importer, a weights
reader and its input type; a malformed policies index is refused naming the file and the field, by the reader
and by the benchmark."""

import ast
import copy
import json
import re
from pathlib import Path

import pytest

import dsa
from dsa.core import lerobot_types
from dsa.core.errors import DsaError
from dsa.core.formats import FILE_FRAMEWORKS, FILE_FRONT_ENDS, PoliciesIndex
from dsa.core.lerobot_types import LEROBOT_TYPES, LeRobotType
from dsa.manifest.contract import INPUT_TYPES, SCHEMA

PACKAGE = Path(dsa.__file__).parent


# -- LeRobot policy types -----------------------------------------------------------------------------------------

def _module_types(frontend: str):
    """The TYPES tuple a front-end module declares, read from its source (no LeRobot or torch here)."""
    tree = ast.parse((PACKAGE / "frontends" / "lerobot" / f"{frontend}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TYPES" for t in node.targets):
            return ast.literal_eval(node.value)
    return ()


@pytest.mark.parametrize("name", sorted(LEROBOT_TYPES))
def test_each_lerobot_type_names_a_front_end_module_that_serves_it(name):
    record = LEROBOT_TYPES[name]
    module = PACKAGE / "frontends" / "lerobot" / f"{record.frontend}.py"
    assert module.is_file(), f"LeRobot type {name!r}: no front-end module {module}"
    assert name in _module_types(record.frontend), f"{module}: TYPES does not list {name!r}"


@pytest.mark.parametrize("name", sorted(LEROBOT_TYPES))
def test_each_lerobot_types_processor_steps_are_implemented_by_the_runtime(name):
    from dsa.runtime.processors import SUPPORTED_STEPS

    missing = [s for s in LEROBOT_TYPES[name].processor_steps if s not in SUPPORTED_STEPS]
    assert not missing, f"LeRobot type {name!r}: dsa/runtime/processors.py implements no step {missing}"


def test_the_pipeline_runtime_reads_the_table():
    from dsa.runtime.policy_pipeline import POLICY_TYPES

    assert POLICY_TYPES == tuple(LEROBOT_TYPES) == ("act", "diffusion", "smolvla", "pi0", "pi05")
    assert [t.name for t in LEROBOT_TYPES.values() if t.tokenises] == ["smolvla", "pi0", "pi05"]
    assert [t.name for t in LEROBOT_TYPES.values() if t.temporal_ensemble] == ["act"]
    assert [t.name for t in LEROBOT_TYPES.values() if t.obs_steps_field] == ["diffusion"]


def test_a_type_registered_twice_or_with_an_unknown_kind_is_refused(monkeypatch):
    monkeypatch.setattr(lerobot_types, "LEROBOT_TYPES", dict(LEROBOT_TYPES))
    with pytest.raises(ValueError, match="'act' is registered twice"):
        lerobot_types.register(LeRobotType("act", frontend="act", kind="single_pass"))
    with pytest.raises(ValueError, match="kind 'loop' is not one of single_pass, denoising, flow"):
        LeRobotType("new", frontend="new", kind="loop")
    with pytest.raises(ValueError, match="'new': a flow policy takes noise from the runtime"):
        LeRobotType("new", frontend="new", kind="flow")


# -- file front ends ----------------------------------------------------------------------------------------------

def test_every_file_front_end_is_in_the_schemas_framework_enum():
    enum = SCHEMA["properties"]["framework"]["enum"]
    missing = [f for f in FILE_FRAMEWORKS if f not in enum]
    assert not missing, (f"dsa/manifest/schema/manifest.schema.json: the framework enum lacks {missing}, "
                         "registered in dsa.core.formats.FILE_FRONT_ENDS: add them (then `dsa schema-doc`)")


@pytest.mark.parametrize("name", sorted(FILE_FRONT_ENDS))
def test_every_file_front_end_names_an_importer_a_weights_reader_and_an_input_type(name):
    from dsa.stages.params import SAFETENSORS, weights_reader
    from dsa.stages.tensor_files import TensorSource

    front_end = FILE_FRONT_ENDS[name]
    module, _, function = front_end.importer.partition(":")
    assert module.startswith("dsa.stages.") and function, front_end.importer
    source = PACKAGE / "stages" / f"{module.rsplit('.', 1)[1]}.py"
    assert source.is_file(), f"{name}: no importer module {source}"
    assert f"def {function}(" in source.read_text(), f"{source}: no function {function}"
    if front_end.weights != SAFETENSORS:
        reader_module = front_end.weights.partition(":")[0]
        assert reader_module.startswith("dsa.stages.") and reader_module.endswith("_weights"), (
            f"{name}: weights {front_end.weights!r} is neither 'safetensors' nor a dsa/stages/<name>_weights.py reader")
        reader = weights_reader(front_end.weights)
        assert isinstance(reader, type) and issubclass(reader, TensorSource), f"{name}: {front_end.weights} is no TensorSource"
    assert INPUT_TYPES[name] == front_end.input_type
    assert front_end.suffixes and all(s.startswith(".") for s in front_end.suffixes)


@pytest.mark.parametrize("name", sorted(FILE_FRONT_ENDS))
def test_a_model_file_of_another_suffix_is_refused_naming_the_suffixes_the_framework_reads(name, tmp_path):
    from dsa.stages.export import export_model

    wrong = tmp_path / "model.txt"
    wrong.write_text("not a model")
    with pytest.raises(DsaError) as refused:
        export_model({"framework": name, "model_id": "m"}, tmp_path / "out.mlir", tmp_path / "out.json",
                     manifest_name="m.yaml", model_file=wrong)
    message = str(refused.value)
    assert "m.yaml: model.file" in message and ".txt" in message
    assert all(suffix in message for suffix in FILE_FRONT_ENDS[name].suffixes)
    assert not (tmp_path / "out.mlir").exists() and not (tmp_path / "out.json").exists()


def test_the_registry_gives_todays_input_types():
    assert INPUT_TYPES == {"onnx": "onnx", "stablehlo": "stablehlo"}
    assert FILE_FRAMEWORKS == ("onnx", "stablehlo")


# -- the policies index -------------------------------------------------------------------------------------------

INDEX = {
    "format": 1,
    "pipelines": [{"index": "models/groot.pipeline.json", "label": "//models:groot", "name": "groot",
                   "stages": ["groot_backbone", "groot_head"], "test": "//models/groot:groot_test"}],
    "policies": [
        {"checkpoint": "models/act_policy/model.safetensors", "index": "models/act.modules.json",
         "label": "//models:act", "manifest": "manifests/act.yaml", "model_file": None, "name": "act",
         "policy_config": "models/act_policy/config.json", "python": "lerobot", "test": "//models/act:act_test"},
        {"checkpoint": "models/pi0.safetensors", "index": "models/pi0.modules.json", "label": "//models:pi0",
         "manifest": "manifests/pi0.yaml", "model_file": None, "name": "pi0", "policy_config": None,
         "python": None, "test": "//models/pi0:pi0_test"},
    ],
}


def _write(tmp_path, data) -> Path:
    path = tmp_path / "models" / "policies_index.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def test_a_well_formed_policies_index_is_read(tmp_path):
    assert PoliciesIndex.read(_write(tmp_path, INDEX)) == INDEX
    untested = _broken(lambda d: d["policies"][1].update(test=""))  # a dsa_policy without a test target
    assert PoliciesIndex.read(_write(tmp_path, untested)) == untested


def _broken(edit):
    data = copy.deepcopy(INDEX)
    edit(data)
    return data


@pytest.mark.parametrize("edit, where, what", [
    (lambda d: d.update(format=2), "", "policies index format 2 is not supported"),
    (lambda d: d.pop("pipelines"), "", "policies index lacks pipelines"),
    (lambda d: d.update(policies={}), ": policies", "is dict, not a list of rows"),
    (lambda d: d["policies"].__setitem__(1, "pi0"), ": policies[1]", "is str, not an object"),
    (lambda d: d["policies"][1].pop("index"), ": policies[1].index", "is missing"),
    (lambda d: d["policies"][0].update(manifest=None), ": policies[0].manifest", "not a non-empty string"),
    (lambda d: d["policies"][0].update(policy_config=3), ": policies[0].policy_config",
     "is '3', not a non-empty string or null"),
    (lambda d: d["policies"][1].update(test=None), ": policies[1].test", "is 'None', not a string"),
    (lambda d: d["pipelines"][0].update(stages="groot_head"), ": pipelines[0].stages",
     "not a non-empty list of dsa_vmfb names"),
])
def test_a_malformed_policies_index_is_refused_naming_the_file_and_field(tmp_path, edit, where, what):
    path = _write(tmp_path, _broken(edit))
    with pytest.raises(DsaError) as e:
        PoliciesIndex.read(path)
    assert e.value.where == f"{path}{where}"
    assert what in e.value.message


def test_the_benchmark_reads_the_policies_index_through_the_checked_reader(tmp_path):
    from dsa.tools.bench.lerobot import lerobot_policies

    _write(tmp_path, INDEX)
    assert [(p.name, p.index, p.policy_dir) for p in lerobot_policies(tmp_path)] == [
        ("act", tmp_path / "models/act.modules.json", tmp_path / "models/act_policy")]
    path = _write(tmp_path, _broken(lambda d: d["policies"][0].pop("policy_config")))
    with pytest.raises(DsaError, match=f"{path}: policies\\[0\\].policy_config: is missing"):
        lerobot_policies(tmp_path)
