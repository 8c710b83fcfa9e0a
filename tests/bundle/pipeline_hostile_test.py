"""Pipeline bundles as untrusted data (docs/security.md): every file policy_pipeline.json or a processor JSON
names is a member of the bundle, every size they state is bounded, statistics are finite and ordered, sensor
readings finite and task texts bounded — each hostile case refused with one message naming the file and the
field, under a memory limit and in bounded time, before the network runs or anything is allocated.

The cases are generated: each starts from the pipeline files of a bundle the build made (ACT: normalisers with
dataset statistics; PI0.5: a tokenizer) and changes one thing. `PolicyPipeline` is what `dsa.runtime.load` and
`dsa run` build from a bundle; its network is a function that fails the test if it is ever called."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from dsa.core.errors import DsaError
from dsa.core.fileio import canonical_json
from dsa.core import tarfiles as T
from dsa.runtime import bundle as B
from dsa.runtime import processors as P
from dsa.runtime.policy_pipeline import (MAX_CHUNK, MAX_NOISE_ELEMENTS, MAX_OBS_STEPS, POLICY_PIPELINE_JSON,
                                         PolicyPipeline, read_spec)
from dsa.runtime.processors import ProcessorPipeline, read_safetensors
from dsa.tools.testing import bounded_memory, runfile

ACT_BUNDLE = runfile("models/act_pipeline_bundle.tar")
PI05_BUNDLE = runfile("models/pi05_pipeline_bundle.tar")
PRE, POST = "policy_preprocessor.json", "policy_postprocessor.json"
# Every case is refused within this time (the bound: 5 s) and under bounded_memory (1 GiB more address
# space than the process holds).
CASE_SECONDS = 5.0


@pytest.fixture(autouse=True)
def _case_memory_limit():
    with bounded_memory():
        yield


def _pipeline_files(bundle: Path, out: Path) -> Path:
    """The bundle's pipeline files (not its modules or parameters) in `out`: what PolicyPipeline reads."""
    with B.open_bundle(bundle) as opened:
        out.mkdir(parents=True, exist_ok=True)
        for path in opened.root.iterdir():
            if path.suffix in (".json", ".safetensors") and path.name != B.BUNDLE_JSON:
                shutil.copy(path, out / path.name)
    return out


@pytest.fixture(scope="module")
def act_files(tmp_path_factory) -> Path:
    return _pipeline_files(ACT_BUNDLE, tmp_path_factory.mktemp("act"))


@pytest.fixture(scope="module")
def pi05_files(tmp_path_factory) -> Path:
    return _pipeline_files(PI05_BUNDLE, tmp_path_factory.mktemp("pi05"))


def _copy(files: Path, tmp_path: Path) -> Path:
    root = tmp_path / "bundle"
    shutil.copytree(files, root)
    return root


def _json(root: Path, name: str) -> Any:
    return json.loads((root / name).read_text(encoding="utf-8"))


def _write(root: Path, name: str, data: Any) -> None:
    (root / name).write_text(json.dumps(data), encoding="utf-8")


def _never(inputs):
    raise AssertionError("the network ran on a refused pipeline")


def _load(root: Path) -> PolicyPipeline:
    return PolicyPipeline(root, read_spec(root, POLICY_PIPELINE_JSON), _never)


def _refused(fn: Callable[[], Any], *needles: str) -> str:
    start = time.monotonic()
    with pytest.raises(DsaError) as info:
        fn()
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, (needle, text)
    assert elapsed < CASE_SECONDS, (elapsed, text)
    return text


def _stats_file(root: Path, pipeline: str = PRE) -> str:
    return next(s["state_file"] for s in _json(root, pipeline)["steps"] if s.get("state_file"))


def test_the_unchanged_pipeline_files_load(act_files, pi05_files, tmp_path):
    """The baseline every case changes one thing of: it loads (the refusals below are the change's)."""
    pipeline = _load(_copy(act_files, tmp_path))
    assert pipeline.n_action_steps >= 1
    ProcessorPipeline.load(pi05_files / PRE, tokenizer_file=pi05_files / "tokenizer.json", lazy_tokenizer=True)


# -- 1. confinement: nothing outside the bundle is read -------------------------------------------------------

OUTSIDE_NAMES = ["../outside.safetensors", "/etc/passwd", "sub/stats.safetensors", "..", ".", "",
                 "a\\b.safetensors", "x\x00.safetensors", "s" * 300, 7, ["a"]]


@pytest.mark.parametrize("name", OUTSIDE_NAMES, ids=[repr(n)[:30] for n in OUTSIDE_NAMES])
@pytest.mark.parametrize("pipeline", [PRE, POST])
def test_a_state_file_outside_the_bundle_is_refused_before_it_is_read(act_files, tmp_path, name, pipeline):
    root = _copy(act_files, tmp_path)
    (tmp_path / "outside.safetensors").write_bytes((root / _stats_file(root, pipeline)).read_bytes())
    data = _json(root, pipeline)
    step = next(s for s in data["steps"] if s.get("state_file"))
    step["state_file"] = name
    _write(root, pipeline, data)
    _refused(lambda: _load(root), pipeline, "state file", "is not a plain file name")


def test_a_missing_state_file_is_refused_naming_it(act_files, tmp_path):
    root = _copy(act_files, tmp_path)
    (root / _stats_file(root)).unlink()
    _refused(lambda: _load(root), PRE, "is missing from")


def test_a_state_file_that_is_a_directory_is_refused(act_files, tmp_path):
    root = _copy(act_files, tmp_path)
    name = _stats_file(root)
    (root / name).unlink()
    (root / name).mkdir()
    _refused(lambda: _load(root), "is not a regular file")


@pytest.mark.parametrize("field", ["preprocessor", "postprocessor", "tokenizer", "policy_config"])
@pytest.mark.parametrize("value", ["../policy_preprocessor.json", "/etc/passwd", "other.json"])
def test_policy_pipeline_json_naming_another_file_is_refused(act_files, tmp_path, field, value):
    root = _copy(act_files, tmp_path)
    spec = _json(root, POLICY_PIPELINE_JSON)
    spec[field] = value
    _write(root, POLICY_PIPELINE_JSON, spec)
    _refused(lambda: _load(root), f"policy_pipeline.json: {field}", "names only the bundle's own members")


@pytest.mark.parametrize("name", ["../policy_pipeline.json", "/etc/passwd", "other.json"])
def test_bundle_json_naming_another_policy_pipeline_is_refused(act_files, tmp_path, name):
    root = _copy(act_files, tmp_path)
    _refused(lambda: read_spec(root, name), "bundle.json policy_pipeline", "policy_pipeline.json")


# -- 2. bounds: every size a file states ---------------------------------------------------------------------

LOOP_CASES = [
    ("n_action_steps", 10 ** 9), ("n_action_steps", 0), ("n_action_steps", -1), ("n_action_steps", 1.5),
    ("n_action_steps", "8"), ("n_action_steps", True), ("n_action_steps", None),
    ("chunk_size", 10 ** 9), ("chunk_size", 0), ("chunk_size", MAX_CHUNK + 1),
    ("n_obs_steps", MAX_OBS_STEPS + 1), ("n_obs_steps", 10 ** 9), ("n_obs_steps", 0),
]


@pytest.mark.parametrize("field, value", LOOP_CASES)
def test_a_loop_count_out_of_bounds_is_refused_naming_the_field(act_files, tmp_path, field, value):
    root = _copy(act_files, tmp_path)
    spec = _json(root, POLICY_PIPELINE_JSON)
    spec["loop"][field] = value
    _write(root, POLICY_PIPELINE_JSON, spec)
    _refused(lambda: _load(root), f"loop.{field}", "not a count from 1 to")


def test_n_action_steps_beyond_the_chunk_is_refused(act_files, tmp_path):
    root = _copy(act_files, tmp_path)
    spec = _json(root, POLICY_PIPELINE_JSON)
    spec["loop"]["n_action_steps"] = spec["loop"]["chunk_size"] + 1
    _write(root, POLICY_PIPELINE_JSON, spec)
    _refused(lambda: _load(root), "loop.n_action_steps", "is more than the chunk's")


@pytest.mark.parametrize("field, value, says", [
    ("temporal_ensemble_coeff", 1e30, "not a number from -1 to 1"),
    ("temporal_ensemble_coeff", float("nan"), "not a number from -1 to 1"),
    ("temporal_ensemble_coeff", "0.01", "not a number from -1 to 1"),
    ("prompt_pad_id", -1, "not a token id"),
    ("prompt_pad_id", 2 ** 40, "not a token id"),
    ("noise", {"input": "noise", "shape": [10 ** 6, 10 ** 6], "dtype": "float32"}, "elements"),
    ("noise", {"input": "noise", "shape": [0], "dtype": "float32"}, "elements"),
    ("noise", {"input": "noise", "shape": "big", "dtype": "float32"}, "elements"),
    ("noise", {"input": "noise", "shape": [MAX_NOISE_ELEMENTS, 2], "dtype": "float32"}, "elements"),
    ("steps", {"input": "t", "value": 10 ** 9}, "value 1..10000"),
    ("steps", {"input": "t", "value": 0}, "value 1..10000"),
])
def test_a_loop_field_out_of_bounds_is_refused_naming_it(act_files, tmp_path, field, value, says):
    root = _copy(act_files, tmp_path)
    spec = _json(root, POLICY_PIPELINE_JSON)
    spec["loop"][field] = value
    _write(root, POLICY_PIPELINE_JSON, spec)
    _refused(lambda: _load(root), f"loop.{field}", says)


@pytest.mark.parametrize("change, says", [
    (lambda s: s.update(format=2), "is not a policy pipeline of format 1"),
    (lambda s: s.update(policy_type="evil"), "policy_type"),
    (lambda s: s.update(loop=[]), "loop"),
    (lambda s: s.update(nodes=[]), "no single network node"),
    (lambda s: s.update(observation=None), "observation"),
])
def test_a_malformed_policy_pipeline_is_refused(act_files, tmp_path, change, says):
    root = _copy(act_files, tmp_path)
    spec = _json(root, POLICY_PIPELINE_JSON)
    change(spec)
    _write(root, POLICY_PIPELINE_JSON, spec)
    _refused(lambda: _load(root), says)


def test_a_policy_pipeline_json_over_its_size_limit_is_refused_before_parsing(act_files, tmp_path):
    root = _copy(act_files, tmp_path)
    with open(root / POLICY_PIPELINE_JSON, "r+b") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB declared, nothing allocated
    _refused(lambda: _load(root), "over the 4194304-byte limit")


def test_a_processor_json_over_1_mib_is_refused_before_parsing(act_files, tmp_path):
    root = _copy(act_files, tmp_path)
    data = _json(root, PRE)
    data["name"] = "x" * (2 << 20)
    _write(root, PRE, data)
    _refused(lambda: _load(root), PRE, "over the 1048576-byte limit")


@pytest.mark.parametrize("steps", [65, 2_000_000])
def test_a_processor_json_with_too_many_steps_is_refused(act_files, tmp_path, steps):
    root = _copy(act_files, tmp_path)
    data = _json(root, PRE)
    data["steps"] = [{"registry_name": "to_batch_processor"}] * steps
    (root / PRE).write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")
    _refused(lambda: _load(root), PRE, "over")


def test_a_deeply_nested_processor_json_is_refused(act_files, tmp_path):
    root = _copy(act_files, tmp_path)
    (root / PRE).write_text('{"steps": ' + "[" * 200_000 + "]" * 200_000 + "}", encoding="utf-8")
    _refused(lambda: _load(root), PRE)


def test_a_processor_json_that_is_not_utf8_is_refused(act_files, tmp_path):
    root = _copy(act_files, tmp_path)
    (root / PRE).write_bytes(b'{"steps": ["\xff\xfe"]}')
    _refused(lambda: _load(root), PRE, "not UTF-8")


def test_a_state_file_over_16_mib_is_refused_before_it_is_read(act_files, tmp_path):
    root = _copy(act_files, tmp_path)
    with open(root / _stats_file(root), "r+b") as f:
        f.truncate(1 << 30)  # sparse: a 1 GiB file that would be read whole
    _refused(lambda: _load(root), "state file", "over the 16777216-byte limit")


@pytest.mark.parametrize("config, says", [
    ({"eps": 1e30}, "eps"), ({"eps": "tiny"}, "eps"), ({"eps": -1}, "eps"),
    ({"features": []}, "features is not an object"), ({"norm_map": "MEAN_STD"}, "norm_map is not an object"),
    ({"norm_map": {"STATE": "CUBE_ROOT"}}, "unknown normalization mode"),
])
def test_a_normaliser_config_out_of_bounds_is_refused(act_files, tmp_path, config, says):
    root = _copy(act_files, tmp_path)
    data = _json(root, PRE)
    step = next(s for s in data["steps"] if s["registry_name"] == "normalizer_processor")
    step["config"].update(config)
    _write(root, PRE, data)
    _refused(lambda: _load(root), PRE, says)


def test_a_rename_map_of_thousands_of_entries_is_refused(act_files, tmp_path):
    root = _copy(act_files, tmp_path)
    data = _json(root, PRE)
    data["steps"].insert(0, {"registry_name": "rename_observations_processor",
                             "config": {"rename_map": {f"k{i}": f"v{i}" for i in range(5000)}}})
    _write(root, PRE, data)
    _refused(lambda: _load(root), "rename_map")


def _tokenizer_step(root: Path) -> dict:
    data = _json(root, PRE)
    return data, next(s for s in data["steps"] if s["registry_name"] == "tokenizer_processor")


@pytest.mark.parametrize("max_length", [10 ** 9, 0, -5, "512", True, 8193, 1.5])
def test_a_tokenizer_max_length_out_of_bounds_is_refused(pi05_files, tmp_path, max_length):
    root = _copy(pi05_files, tmp_path)
    data, step = _tokenizer_step(root)
    step["config"]["max_length"] = max_length
    _write(root, PRE, data)
    _refused(lambda: ProcessorPipeline.load(root / PRE, tokenizer_file=root / "tokenizer.json",
                                            lazy_tokenizer=True), "max_length", "not a token count from 1 to 8192")


def test_a_tokenizer_over_64_mib_is_refused_before_it_is_read(pi05_files, tmp_path):
    root = _copy(pi05_files, tmp_path)
    with open(root / "tokenizer.json", "r+b") as f:
        f.truncate(120 << 20)
    _refused(lambda: ProcessorPipeline.load(root / PRE, tokenizer_file=root / "tokenizer.json",
                                            lazy_tokenizer=True), "tokenizer file", "over the 67108864-byte limit")


@pytest.mark.parametrize("task, says", [
    ("x" * (P.MAX_TASK_CHARS + 1), "over the limit of 16384"),
    ("pick up the cube " * 3_000_000, "over the limit of 16384"),  # 50 MB: aborted the process before
    (["a"] * 100, "100 task texts"),
    (["short", "y" * (P.MAX_TASK_CHARS + 1)], "over the limit of 16384"),
])
def test_a_task_text_over_its_limit_is_refused_before_the_tokenizer_sees_it(pi05_files, tmp_path, task, says):
    pre = ProcessorPipeline.load(pi05_files / PRE, tokenizer_file=pi05_files / "tokenizer.json", lazy_tokenizer=True)
    state = {k: v for k, v in _sample(pi05_files).items() if "image" not in k}
    _refused(lambda: pre({**state, "task": task}), says)


# -- 3. statistics: finite, bounded, ordered -----------------------------------------------------------------

def _stat_names(root: Path) -> List[str]:
    return sorted(read_safetensors(root / _stats_file(root)))


def _with_stat(root: Path, name: str, change: Callable[[np.ndarray], None]) -> None:
    path = root / _stats_file(root)
    stats = read_safetensors(path)
    value = stats[name].copy()
    change(value)
    stats[name] = value
    save_file(stats, str(path))


BAD_VALUES = [("nan", float("nan"), "statistics must be finite"), ("inf", float("inf"), "statistics must be finite"),
              ("-inf", float("-inf"), "statistics must be finite"), ("1e30", 1e30, "beyond the bound of 1e+06")]


@pytest.mark.parametrize("label, value, says", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
@pytest.mark.parametrize("stat", ["observation.state.mean", "observation.state.std", "action.mean", "action.std",
                                  "observation.state.min", "action.max"])
def test_a_non_finite_or_absurd_statistic_is_refused_naming_file_feature_and_value(act_files, tmp_path, stat,
                                                                                    label, value, says):
    root = _copy(act_files, tmp_path)
    if stat not in _stat_names(root):
        pytest.skip(f"the stand-in's statistics have no {stat}")
    _with_stat(root, stat, lambda a: a.reshape(-1).__setitem__(0, value))
    _refused(lambda: _load(root), _stats_file(root), stat, says)


@pytest.mark.parametrize("feature", ["observation.state", "action"])
def test_a_negative_std_is_refused(act_files, tmp_path, feature):
    root = _copy(act_files, tmp_path)
    _with_stat(root, f"{feature}.std", lambda a: a.reshape(-1).__setitem__(0, -0.5))
    _refused(lambda: _load(root), f"{feature}.std is negative")


@pytest.mark.parametrize("low, high", [("min", "max"), ("q01", "q99"), ("q10", "q90")])
def test_an_upper_statistic_below_its_lower_is_refused(act_files, tmp_path, low, high):
    root = _copy(act_files, tmp_path)
    names = _stat_names(root)
    if f"action.{low}" not in names:
        pytest.skip(f"the stand-in's statistics have no action.{low}")
    stats = read_safetensors(root / _stats_file(root))
    _with_stat(root, f"action.{high}", lambda a: a.reshape(-1).__setitem__(
        0, stats[f"action.{low}"].reshape(-1)[0] - 1))
    _refused(lambda: _load(root), f"action.{high} is below action.{low}")


def test_statistics_of_another_shape_are_refused(act_files, tmp_path):
    root = _copy(act_files, tmp_path)
    path = root / _stats_file(root)
    stats = read_safetensors(path)
    for name in [n for n in stats if n.startswith("observation.state.") and n.rsplit(".", 1)[1] != "count"]:
        stats[name] = np.ones(stats[name].size + 3, np.float32)  # every statistic of the feature: one shape
    save_file(stats, str(path))
    _refused(lambda: _load(root), "observation.state", "does not fit the feature's shape")


def test_statistics_of_one_feature_disagreeing_in_shape_are_refused(act_files, tmp_path):
    root = _copy(act_files, tmp_path)
    path = root / _stats_file(root)
    stats = read_safetensors(path)
    stats["observation.state.std"] = np.ones(stats["observation.state.std"].size + 1, np.float32)
    save_file(stats, str(path))
    _refused(lambda: _load(root), "observation.state.std has shape")


def test_a_zero_std_is_accepted_as_lerobot_accepts_it(act_files, tmp_path):
    """LeRobot's eps rule: a feature that never moved has std 0 and is divided by std + eps."""
    root = _copy(act_files, tmp_path)
    _with_stat(root, "observation.state.std", lambda a: a.fill(0))
    _load(root)


# -- 4. observations ------------------------------------------------------------------------------------------

def _sample(root: Path) -> Dict[str, np.ndarray]:
    spec = _json(root, POLICY_PIPELINE_JSON)
    sample = {}
    for key, entry in spec["observation"].items():
        if key == "task":
            continue
        sample[key] = np.zeros(entry["shape"], dtype=entry["dtype"])
    return sample


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_sensor_reading_is_refused_before_the_network(act_files, tmp_path, value):
    pipeline = _load(_copy(act_files, tmp_path))
    observation = _sample(act_files)
    state = next(k for k in observation if "state" in k)
    observation[state].reshape(-1)[0] = value
    _refused(lambda: pipeline.select_action(observation), f"observation: {state}", "NaN or an infinity")


# -- 4b. episodes `dsa run --observation` replays ----------------------------------------------------------------

EPISODE_SPEC = {"observation": {"observation.state": {"dtype": "float32", "shape": [4]},
                                "observation.images.top": {"dtype": "uint8", "shape": [6, 8, 3]},
                                "task": {"dtype": "str", "shape": []}}}


def _episode_file(tmp_path: Path, **arrays) -> Path:
    path = tmp_path / "episode.npz"
    np.savez(path, **{k.replace(".", "__"): v for k, v in arrays.items()})
    # numpy.savez keys cannot hold dots through **kwargs: rename the members as the policy names them
    import zipfile

    fixed = tmp_path / "fixed.npz"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(fixed, "w") as dst:
        for member in src.infolist():
            dst.writestr(member.filename.replace("__", "."), src.read(member))
    return fixed


@pytest.mark.parametrize("state_steps, image_steps, says", [
    (5, 4, "mixes single observations and episodes of different lengths"),
    (5, None, "mixes single observations and episodes"),
    (0, 0, "is an episode of 0 steps"),
    (10_001, 10_001, "is an episode of 10001 steps"),
])
def test_a_ragged_empty_or_endless_episode_is_refused(tmp_path, state_steps, image_steps, says):
    from dsa.runtime.run import load_raw_episode

    def frames(steps, shape, dtype):
        return np.zeros(shape if steps is None else [steps, *shape], dtype)

    image_shape = [6, 8, 3] if image_steps != 10_001 else [1, 1, 3]
    spec = EPISODE_SPEC if image_steps != 10_001 else {"observation": {
        "observation.state": {"dtype": "float32", "shape": [4]},
        "observation.images.top": {"dtype": "uint8", "shape": image_shape}}}
    path = _episode_file(tmp_path, **{"observation.state": frames(state_steps, [4], np.float32),
                                      "observation.images.top": frames(image_steps, image_shape, np.uint8)})
    _refused(lambda: load_raw_episode(path, spec), says)


def test_an_episode_member_of_another_shape_is_refused_naming_it(tmp_path):
    from dsa.runtime.run import load_raw_episode

    path = _episode_file(tmp_path, **{"observation.state": np.zeros([3, 5], np.float32),
                                      "observation.images.top": np.zeros([3, 6, 8, 3], np.uint8)})
    _refused(lambda: load_raw_episode(path, EPISODE_SPEC), "member 'observation.state'", "has shape [3, 5]")


@settings(max_examples=100, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=st.lists(st.integers(0, 6), min_size=0, max_size=3), image=st.lists(st.integers(0, 8), max_size=4),
       keys=st.sets(st.sampled_from(["observation.state", "observation.images.top", "odd"]), min_size=1))
def test_fuzzed_episodes_are_read_only_when_every_key_agrees(tmp_path, state, image, keys):
    from dsa.runtime.run import load_raw_episode

    arrays = {"observation.state": np.zeros(state, np.float32), "observation.images.top": np.zeros(image, np.uint8),
              "odd": np.zeros([1], np.float32)}
    path = _episode_file(tmp_path, **{k: arrays[k] for k in keys})
    try:
        values = load_raw_episode(path, EPISODE_SPEC)
    except DsaError as e:
        assert "\n" not in str(e)
        return
    lengths = {v.shape[0] if v.ndim == len(EPISODE_SPEC["observation"][k]["shape"]) + 1 else None
               for k, v in values.items()}
    assert len(lengths) == 1 and (None in lengths or 1 <= next(iter(lengths)) <= 10_000)


# -- 5. fuzzing: any processor JSON or statistics file is loaded or refused with one DsaError -------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20)
_step_names = st.sampled_from(list(P.SUPPORTED_STEPS) + ["evil_step"])
_steps = st.lists(st.fixed_dictionaries(
    {"registry_name": _step_names},
    optional={"config": st.dictionaries(st.sampled_from(["eps", "features", "norm_map", "max_length", "rename_map",
                                                         "float_dtype", "padding", "task_key"]),
                                        _json_values, max_size=4),
              "state_file": st.one_of(st.sampled_from(["../x", "/etc/passwd", "stats.safetensors", ""]),
                                      _json_values)}), max_size=6)


@settings(max_examples=150, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=_steps, name=_json_values)
def test_fuzzed_processor_json_is_loaded_or_refused_with_one_line(act_files, tmp_path, steps, name):
    root = tmp_path / "fuzz"
    root.mkdir(exist_ok=True)
    shutil.copy(act_files / _stats_file(act_files), root / "stats.safetensors")
    (root / "tokenizer.json").write_text("{}", encoding="utf-8")
    (root / PRE).write_text(json.dumps({"name": name, "steps": steps}), encoding="utf-8")
    try:
        ProcessorPipeline.load(root / PRE, tokenizer_file=root / "tokenizer.json", lazy_tokenizer=True)
    except DsaError as e:
        assert "\n" not in str(e)


_arrays = st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=8)


@settings(max_examples=150, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stats=st.dictionaries(st.sampled_from(["observation.state.mean", "observation.state.std", "action.mean",
                                               "action.std", "action.min", "action.max", "action.q01",
                                               "action.q99", "observation.state.count", "odd"]),
                             _arrays, max_size=6))
def test_fuzzed_statistics_are_accepted_only_when_finite_bounded_and_ordered(act_files, tmp_path, stats):
    arrays = {k: np.asarray(v, dtype=np.float32) for k, v in stats.items()}
    nested = P.nest_stats(arrays)
    try:
        P.check_statistics(nested, "stats.safetensors")
    except DsaError as e:
        assert "\n" not in str(e) and "stats.safetensors" in str(e)
        return
    for values in arrays.values():
        assert np.isfinite(values).all() and (np.abs(values) <= P.MAX_STAT_MAGNITUDE).all()
    for feature in nested.values():
        if "std" in feature:
            assert (feature["std"] >= 0).all()
        for low, high in (("min", "max"), ("q01", "q99")):
            if low in feature and high in feature:
                assert (feature[high] >= feature[low]).all()


# -- 6. end to end: forged bundles through `dsa run` and dsa.runtime.load; the honest path through the bundle tool --

def _forge(bundle: Path, out: Path, files: Dict[str, bytes]) -> Path:
    """The bundle with `files` replaced and bundle.json's digests recomputed to match (what an attacker with write
    access to the archive can do; the recipe lock and the manifest it pins are what they cannot)."""
    with B.open_bundle(bundle) as opened:
        meta = json.loads(json.dumps(opened.meta))
        contents = {p.name: p.read_bytes() for p in opened.root.iterdir() if p.name != B.BUNDLE_JSON}
    contents.update(files)
    for name, data in contents.items():
        if name in meta["files"]:
            meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    with tarfile.open(out, "w", format=T.TAR_FORMAT) as tar:
        table = canonical_json(meta).encode()
        tar.addfile(T.tarinfo(B.BUNDLE_JSON, len(table)), io.BytesIO(table))
        for name in sorted(contents):
            tar.addfile(T.tarinfo(name, len(contents[name])), io.BytesIO(contents[name]))
    return out


def _dsa_run(forged: Path, tmp_path: Path) -> str:
    """`dsa run` of a forged bundle: exit 2, one error line, no traceback, and no extraction left behind."""
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TMPDIR=str(scratch))
    proc = subprocess.run([sys.executable, "-m", "dsa", "run", str(forged)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    assert list(scratch.iterdir()) == []  # the extracted bundle is removed on the refusal too
    return errors[0]


def test_statistics_shifted_by_100_with_bundle_json_rewritten_are_refused_by_the_lock(act_files, tmp_path):
    """The attack the issue saw run with rc 0 and actions shifted by +100."""
    name = _stats_file(act_files)
    stats = read_safetensors(act_files / name)
    shifted = tmp_path / name
    save_file({k: (v + 100 if k.endswith(".mean") else v).astype(np.float32) for k, v in stats.items()},
              str(shifted))
    line = _dsa_run(_forge(ACT_BUNDLE, tmp_path / "forged.tar", {name: shifted.read_bytes()}), tmp_path)
    assert name in line and "the manifest the recipe lock pins says" in line, line


def test_a_processor_json_naming_an_outside_state_file_with_bundle_json_rewritten_is_refused(act_files, tmp_path):
    data = _json(act_files, PRE)
    next(s for s in data["steps"] if s.get("state_file"))["state_file"] = "../../../../tmp/shifted.safetensors"
    line = _dsa_run(_forge(ACT_BUNDLE, tmp_path / "forged.tar", {PRE: json.dumps(data).encode()}), tmp_path)
    assert PRE in line and "the manifest the recipe lock pins says" in line, line


@pytest.mark.parametrize("field", ["n_action_steps", "chunk_size"])
def test_policy_pipeline_json_with_another_loop_and_bundle_json_rewritten_is_refused(act_files, tmp_path, field):
    spec = _json(act_files, POLICY_PIPELINE_JSON)
    spec["loop"][field] = 10 ** 9
    line = _dsa_run(_forge(ACT_BUNDLE, tmp_path / "forged.tar", {POLICY_PIPELINE_JSON: json.dumps(spec).encode()}),
                    tmp_path)
    assert POLICY_PIPELINE_JSON in line and f"loop.{field}" in line, line


def test_a_runtime_view_with_another_n_action_steps_and_bundle_json_rewritten_is_refused(act_files, tmp_path):
    with B.open_bundle(ACT_BUNDLE) as opened:
        view = json.loads((opened.root / B.RUNTIME_VIEW_JSON).read_text())
    view["n_action_steps"] = 1
    line = _dsa_run(_forge(ACT_BUNDLE, tmp_path / "forged.tar",
                           {B.RUNTIME_VIEW_JSON: json.dumps(view).encode()}), tmp_path)
    assert B.RUNTIME_VIEW_JSON in line and "the recipe lock pins" in line, line


def test_a_forged_bundle_is_refused_by_the_python_api_and_leaves_nothing_behind(act_files, tmp_path, monkeypatch):
    import tempfile

    name = _stats_file(act_files)
    stats = read_safetensors(act_files / name)
    stats["action.std"] = np.full_like(stats["action.std"], np.nan)
    work = tmp_path / name
    save_file(stats, str(work))
    forged = _forge(ACT_BUNDLE, tmp_path / "forged.tar", {name: work.read_bytes()})
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    from dsa.runtime import load

    _refused(lambda: load(forged), name, "the manifest the recipe lock pins says")
    assert list(scratch.iterdir()) == []


def _rebuild(tmp_path: Path, change: Callable[[Path], None]) -> Path:
    """The honest path: the ACT pipeline bundle's own files, `change`d, with the manifest's pins, the runtime view
    and the lock following them, made into a bundle by the bundle tool (what DsaBundle runs)."""
    from dsa.core.fileio import sha256_file

    if str(Path(__file__).resolve().parent) not in sys.path:  # bundle_testlib sits beside the tests
        sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bundle_testlib import rebundle_pipeline

    with B.open_bundle(ACT_BUNDLE) as opened:
        work = tmp_path / "files"
        shutil.copytree(opened.root, work)
        source = opened.meta["manifest_source"]
    before = {p.name: sha256_file(p) for p in work.iterdir()}
    change(work)
    text = (work / B.MANIFEST_YAML).read_text(encoding="utf-8")
    for path in work.iterdir():
        if path.name in before and before[path.name] != sha256_file(path):
            text = text.replace(before[path.name], sha256_file(path))
    (work / B.MANIFEST_YAML).write_text(text, encoding="utf-8")
    processors = [p for p in work.iterdir() if p.name.startswith("policy_p") and p.name != POLICY_PIPELINE_JSON]
    return rebundle_pipeline(work, tmp_path / "act_pipeline_bundle.tar", source, processors)


def test_the_bundle_tool_builds_the_unchanged_files(tmp_path):
    """The baseline of the two cases below: the same files, rebuilt, make a bundle."""
    assert _rebuild(tmp_path, lambda work: None).is_file()


def test_the_bundle_tool_refuses_nan_statistics_the_manifest_pins(tmp_path):
    """`dsa bundle create` refuses what `dsa run` would: statistics with NaN, even pinned by the manifest."""
    def spoil(work):  # every statistics file (the stand-in's pre- and postprocessor share one content)
        for path in work.glob("policy_*processor_step_*.safetensors"):
            stats = read_safetensors(path)
            if "observation.state.std" in stats:
                stats["observation.state.std"] = np.full_like(stats["observation.state.std"], np.nan)
                save_file(stats, str(path))

    _refused(lambda: _rebuild(tmp_path, spoil), "observation.state.std", "statistics must be finite")
    assert not (tmp_path / "act_pipeline_bundle.tar").exists()


def test_the_bundle_tool_refuses_a_processor_json_naming_a_file_outside(tmp_path):
    def escape(work):
        data = _json(work, PRE)
        next(s for s in data["steps"] if s.get("state_file"))["state_file"] = "../elsewhere.safetensors"
        _write(work, PRE, data)

    _refused(lambda: _rebuild(tmp_path, escape), "state file", "is not a plain file name")
    assert not (tmp_path / "act_pipeline_bundle.tar").exists()
