"""dsa.runtime.processors equals LeRobot 0.4.4's own processor pipelines.

Runs in the LeRobot environment (torch, lerobot, transformers): each test builds LeRobot's pipelines with its own
factory (`make_pre_post_processors`), saves them with `save_pretrained`, loads the saved files with the numpy
`ProcessorPipeline` and feeds both the same raw observation (uint8 HWC frame, state, task). Outputs are compared
exactly: same keys, same dtypes, same shapes, bit-identical values (np.array_equal), except TemporalEnsembler,
which is compared within 1e-6 (torch's float32 exp is not correctly rounded; see its test).

Nothing downloads: the tokenizer is trained here with `tokenizers`, wrapped as a transformers fast tokenizer and
saved to a directory; LeRobot's TokenizerProcessorStep resolves the hub names its factories hard-code
("google/paligemma-3b-pt-224", SmolVLM2) through a patched AutoTokenizer that loads that directory.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import lerobot.processor.tokenizer_processor as lerobot_tokenizer_processor
from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
from lerobot.policies.act.configuration_act import ACTConfig
from lerobot.policies.act.modeling_act import ACTTemporalEnsembler
from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
from lerobot.policies.factory import make_pre_post_processors
from lerobot.policies.pi0.configuration_pi0 import PI0Config
from lerobot.policies.pi05.configuration_pi05 import PI05Config
from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
from lerobot.policies.utils import prepare_observation_for_inference
from lerobot.processor import AddBatchDimensionProcessorStep, PolicyProcessorPipeline, TokenizerProcessorStep
from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action

from dsa.core.errors import DsaError
from dsa.runtime.processors import (ProcessorPipeline, TemporalEnsembler, prepare_observation,
                                    read_safetensors)

CAMERA, STATE, ACTION = "observation.images.top", "observation.state", "action"
H, W, D = 12, 16, 4
# LeRobot's transition_to_batch adds these bookkeeping keys ("action" as None when there is none); the numpy
# pipeline does not (see the module's docstring).
LEROBOT_BOOKKEEPING = {"action", "next.reward", "next.done", "next.truncated", "info"}
TASKS = ["pick up the red cube", "place the_block in the bin\n", "stack zebra cups"]  # "zebra": <unk>


# -- fixtures -------------------------------------------------------------------------------------------------

def _train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = TASKS[:2] + ["Task: a, State: -1 " + " ".join(map(str, range(256))) + ";\nAction: ", "stack cups"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"]))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    return tok


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A transformers fast tokenizer (tokenizer.json + tokenizer_config.json) whose post-processor adds <bos>."""
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(), pad_token="<pad>", unk_token="<unk>",
                            bos_token="<bos>", eos_token="<eos>").save_pretrained(path)
    return path


@pytest.fixture
def offline_tokenizer(monkeypatch, tokenizer_dir):
    """LeRobot's TokenizerProcessorStep loads any tokenizer name from `tokenizer_dir`."""

    class LocalAutoTokenizer:
        @staticmethod
        def from_pretrained(name, **kwargs):
            return AutoTokenizer.from_pretrained(str(tokenizer_dir), **kwargs)

    monkeypatch.setattr(lerobot_tokenizer_processor, "AutoTokenizer", LocalAutoTokenizer)
    return tokenizer_dir


def _features():
    inputs = {CAMERA: PolicyFeature(FeatureType.VISUAL, (3, H, W)), STATE: PolicyFeature(FeatureType.STATE, (D,))}
    return inputs, {ACTION: PolicyFeature(FeatureType.ACTION, (D,))}


POLICIES = {
    "act": lambda **kw: ACTConfig(**kw),
    "diffusion": lambda **kw: DiffusionConfig(crop_shape=None, **kw),
    "smolvla": lambda **kw: SmolVLAConfig(**kw),
    "pi0": lambda **kw: PI0Config(**kw),
    "pi05": lambda **kw: PI05Config(**kw),
    # QUANTILE10 and QUANTILES are no policy's default; ACT with them exercises both.
    "act_quantiles": lambda **kw: ACTConfig(normalization_mapping={
        "VISUAL": NormalizationMode.MEAN_STD, "STATE": NormalizationMode.QUANTILE10,
        "ACTION": NormalizationMode.QUANTILES}, **kw),
}
TOKENIZER_POLICIES = {"smolvla", "pi0", "pi05"}


def _config(policy: str, **kwargs):
    inputs, outputs = _features()
    return POLICIES[policy](input_features=inputs, output_features=outputs, device="cpu", **kwargs)


def _stats(seed=0, *, degenerate=True):
    """Random stats with mean/std/min/max/q01/q99/q10/q90 per feature; the first state and action dimensions
    have max == min and equal quantiles (LeRobot's eps branch)."""
    rng = np.random.default_rng(seed)
    stats = {}
    for key, shape in ((CAMERA, (3, 1, 1)), (STATE, (D,)), (ACTION, (D,))):
        lo = rng.uniform(-3, -1, shape).astype(np.float32)
        hi = rng.uniform(1, 3, shape).astype(np.float32)
        s = {"mean": rng.normal(0, 1, shape).astype(np.float32), "std": rng.uniform(0.1, 2, shape).astype(np.float32),
             "min": lo, "max": hi, "q01": lo * np.float32(0.9), "q99": hi * np.float32(0.9),
             "q10": lo * np.float32(0.5), "q90": hi * np.float32(0.5)}
        if degenerate and key != CAMERA:
            for a, b in (("min", "max"), ("q01", "q99"), ("q10", "q90")):
                s[b][0] = s[a][0]
        stats[key] = s
    return stats


def _raw(seed=0, state_dtype=np.float32):
    rng = np.random.default_rng(100 + seed)
    return {CAMERA: rng.integers(0, 256, (H, W, 3), dtype=np.uint8),
            STATE: rng.normal(0, 1.5, (D,)).astype(state_dtype)}


def _save(pre, post, path: Path):
    pre.save_pretrained(path)
    post.save_pretrained(path)
    return path


def _load_numpy(path: Path, tokenizer_dir=None):
    tokenizer_file = tokenizer_dir / "tokenizer.json" if tokenizer_dir else None
    return (ProcessorPipeline.load(path / "policy_preprocessor.json", tokenizer_file),
            ProcessorPipeline.load(path / "policy_postprocessor.json"))


def _load_lerobot(path: Path):
    return (PolicyProcessorPipeline.from_pretrained(path, config_filename="policy_preprocessor.json"),
            PolicyProcessorPipeline.from_pretrained(path, config_filename="policy_postprocessor.json",
                                                    to_transition=policy_action_to_transition,
                                                    to_output=transition_to_policy_action))


def _assert_same(lerobot_out: dict, numpy_out: dict):
    """Same keys (less LeRobot's bookkeeping), and per key: same dtype, shape and bits, or equal strings."""
    skip = {k for k in LEROBOT_BOOKKEEPING if k != "action" or lerobot_out.get(k, 0) is None}
    assert set(lerobot_out) - skip == set(numpy_out)
    for key, expected in lerobot_out.items():
        if key in skip:
            continue
        got = numpy_out[key]
        if isinstance(expected, torch.Tensor):
            expected = expected.numpy()
            assert isinstance(got, np.ndarray), key
            assert got.dtype == expected.dtype, (key, got.dtype, expected.dtype)
            assert got.shape == expected.shape, (key, got.shape, expected.shape)
            assert np.array_equal(got, expected, equal_nan=True), key
        else:
            assert got == expected, key


def _lerobot_preprocess(pre, raw, task, robot_type="so100"):
    observation = prepare_observation_for_inference({k: v.copy() for k, v in raw.items()}, torch.device("cpu"),
                                                    task, robot_type)
    return pre(observation)


# -- the pipelines ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_numpy_pipelines_equal_lerobots_factory_and_reloaded_pipelines_bit_for_bit(policy, tmp_path, request):
    tok_dir = request.getfixturevalue("offline_tokenizer") if policy in TOKENIZER_POLICIES else None
    pre, post = make_pre_post_processors(_config(policy), dataset_stats=_stats())
    _save(pre, post, tmp_path)
    np_pre, np_post = _load_numpy(tmp_path, tok_dir)
    re_pre, re_post = _load_lerobot(tmp_path)
    for seed, task in enumerate(TASKS):
        raw = _raw(seed)
        observation = prepare_observation(raw, task=task, robot_type="so100")
        for lerobot_pre in (pre, re_pre):
            _assert_same(_lerobot_preprocess(lerobot_pre, raw, task), np_pre(observation))
    rng = np.random.default_rng(7)
    for shape in ((1, D), (2, 10, D)):  # one action, and a batch of chunks
        action = rng.normal(0, 1, shape).astype(np.float32)
        got = np_post({"action": action})
        assert set(got) == {"action"}
        for lerobot_post in (post, re_post):
            _assert_same({"action": lerobot_post(torch.from_numpy(action.copy()))}, got)


def test_prepare_observation_equals_prepare_observation_for_inference():
    raw = _raw(3)
    expected = prepare_observation_for_inference({k: v.copy() for k, v in raw.items()}, torch.device("cpu"),
                                                  "stack cups", None)
    got = prepare_observation(raw, task="stack cups")
    assert got["robot_type"] == expected["robot_type"] == ""
    for key in (CAMERA, STATE):
        assert got[key].dtype == expected[key].numpy().dtype and got[key].shape == tuple(expected[key].shape)
        assert np.array_equal(got[key], expected[key].numpy())
    assert got[CAMERA].shape == (1, 3, H, W) and got["task"] == "stack cups"
    assert raw[CAMERA].shape == (H, W, 3)  # the caller's dict is left alone


@pytest.mark.parametrize("policy", ["act", "diffusion", "pi05", "act_quantiles"])
def test_float64_state_is_normalised_in_float64_as_lerobot_does(policy, tmp_path, request):
    tok_dir = request.getfixturevalue("offline_tokenizer") if policy in TOKENIZER_POLICIES else None
    pre, post = make_pre_post_processors(_config(policy), dataset_stats=_stats(1))
    np_pre, _ = _load_numpy(_save(pre, post, tmp_path), tok_dir)
    raw = _raw(1, state_dtype=np.float64)
    got = np_pre(prepare_observation(raw, task="stack cups"))
    _assert_same(_lerobot_preprocess(pre, raw, "stack cups"), got)
    assert got[STATE].dtype == np.float64


def test_a_batch_of_tasks_is_padded_to_the_longest_as_smolvla_does(offline_tokenizer, tmp_path):
    pre, post = make_pre_post_processors(_config("smolvla"), dataset_stats=_stats(2))
    np_pre, _ = _load_numpy(_save(pre, post, tmp_path), offline_tokenizer)
    rng = np.random.default_rng(5)
    batch = {CAMERA: rng.uniform(0, 1, (3, 3, H, W)).astype(np.float32),
             STATE: rng.normal(0, 1, (3, D)).astype(np.float32), "task": list(TASKS)}
    got = np_pre(dict(batch))
    _assert_same(pre({k: (torch.from_numpy(v.copy()) if isinstance(v, np.ndarray) else list(v))
                      for k, v in batch.items()}), got)
    mask = got["observation.language.attention_mask"]
    assert mask.dtype == np.bool_ and not mask.all() and mask.any(axis=1).all()  # really padded, per row


@pytest.mark.parametrize("padding,padding_side,truncation,max_length", [
    ("max_length", "left", True, 8),    # left padding, and truncation of the longer tasks
    ("longest", "right", True, 5),      # truncation to 5 with the <bos> counted
    ("max_length", "right", False, 30),
    ("longest", "left", True, 64),
])
def test_tokenizer_step_matches_transformers_for_padding_side_and_truncation(
        offline_tokenizer, tmp_path, padding, padding_side, truncation, max_length):
    step = TokenizerProcessorStep(tokenizer_name="any/name", padding=padding, padding_side=padding_side,
                                  truncation=truncation, max_length=max_length)
    pre = PolicyProcessorPipeline(steps=[AddBatchDimensionProcessorStep(), step], name="policy_preprocessor")
    pre.save_pretrained(tmp_path)
    np_pre = ProcessorPipeline.load(tmp_path / "policy_preprocessor.json", offline_tokenizer / "tokenizer.json")
    state = np.zeros((len(TASKS), D), np.float32)
    subtasks = ["stack cups", "the bin", "pick up the red cube"]
    expected = pre({STATE: torch.from_numpy(state), "task": list(TASKS), "subtask": list(subtasks)})
    got = np_pre({STATE: state, "task": list(TASKS), "subtask": list(subtasks)})
    _assert_same(expected, got)
    assert got["observation.language.tokens"].dtype == np.int64
    assert "observation.subtask.tokens" in got


def test_gemma_tokenizer_config_add_eos_rebuilds_the_post_processor_as_transformers_does(tmp_path):
    from transformers import GemmaTokenizerFast

    tok_dir = tmp_path / "gemma"
    GemmaTokenizerFast(tokenizer_object=_train_tokenizer(), pad_token="<pad>", unk_token="<unk>",
                       bos_token="<bos>", eos_token="<eos>").save_pretrained(tok_dir)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config.update(add_bos_token=True, add_eos_token=True)  # tokenizer.json itself still adds <bos> only
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    assert type(hf).__name__ == "GemmaTokenizerFast"
    step = TokenizerProcessorStep(tokenizer=hf, padding="max_length", max_length=12)
    pre = PolicyProcessorPipeline(steps=[step], name="policy_preprocessor")
    pre.save_pretrained(tmp_path)
    np_pre = ProcessorPipeline.load(tmp_path / "policy_preprocessor.json", tok_dir / "tokenizer.json")
    state = np.zeros((1, D), np.float32)
    expected = pre({STATE: torch.from_numpy(state), "task": ["stack cups"]})
    assert expected["observation.language.tokens"][0, 3] == hf.eos_token_id
    _assert_same(expected, np_pre({STATE: state, "task": ["stack cups"]}))


# -- LeRobot's handling of missing stats -----------------------------------------------------------------------

def test_a_feature_without_stats_passes_through_unnormalised_as_in_lerobot(tmp_path):
    stats = _stats(4)
    del stats[CAMERA]  # ACT normalises VISUAL with MEAN_STD, but there are no camera stats
    pre, post = make_pre_post_processors(_config("act"), dataset_stats=stats)
    np_pre, _ = _load_numpy(_save(pre, post, tmp_path))
    raw = _raw(4)
    observation = prepare_observation(raw, task="x")
    got = np_pre(observation)
    _assert_same(_lerobot_preprocess(pre, raw, "x"), got)
    assert np.array_equal(got[CAMERA], observation[CAMERA])


def test_a_pipeline_saved_without_stats_has_no_state_file_and_is_the_identity(tmp_path):
    pre, post = make_pre_post_processors(_config("diffusion"), dataset_stats=None)
    np_pre, np_post = _load_numpy(_save(pre, post, tmp_path))
    assert all(step["state_file"] is None for step in np_pre.describe() + np_post.describe())
    raw = _raw(5)
    got = np_pre(prepare_observation(raw, task="x"))
    _assert_same(_lerobot_preprocess(pre, raw, "x"), got)
    action = np.ones((1, D), np.float32)
    assert np.array_equal(np_post({"action": action})["action"], action)


def test_stats_lacking_the_modes_pair_are_refused_as_lerobot_refuses_them(tmp_path):
    stats = {STATE: {"mean": np.zeros(D, np.float32), "std": np.ones(D, np.float32)}}  # Diffusion: MIN_MAX
    pre, post = make_pre_post_processors(_config("diffusion"), dataset_stats=stats)
    np_pre, _ = _load_numpy(_save(pre, post, tmp_path))
    with pytest.raises(ValueError, match="MIN_MAX normalization mode requires min and max"):
        _lerobot_preprocess(pre, _raw(), "x")
    with pytest.raises(DsaError, match=r"MIN_MAX normalisation of 'observation.state' needs the stats 'min'"):
        np_pre(prepare_observation(_raw(), task="x"))


def test_features_a_step_would_pass_through_for_want_of_stats_are_reported_by_file_step_and_mode(tmp_path):
    # ACT: VISUAL, STATE and ACTION all MEAN_STD. Stats for the state only: LeRobot silently leaves the camera
    # un-normalised and the action un-un-normalised; the bundle refuses what uncovered_features reports.
    stats = {STATE: {"mean": np.zeros(D, np.float32), "std": np.ones(D, np.float32)}}
    pre, post = make_pre_post_processors(_config("act"), dataset_stats=stats)
    np_pre, np_post = _load_numpy(_save(pre, post, tmp_path))
    assert np_pre.uncovered_features() == [
        ("policy_preprocessor.json step 3 (normalizer_processor)", CAMERA, "MEAN_STD")]
    assert np_post.uncovered_features() == [
        ("policy_postprocessor.json step 0 (unnormalizer_processor)", ACTION, "MEAN_STD")]
    full_pre, full_post = _load_numpy(_save(*make_pre_post_processors(_config("act"), dataset_stats=_stats()),
                                            tmp_path / "full"))
    assert full_pre.uncovered_features() == full_post.uncovered_features() == []


# -- describe / files ------------------------------------------------------------------------------------------

def test_describe_and_files_report_each_step_its_keys_and_the_files_read(offline_tokenizer, tmp_path):
    pre, post = make_pre_post_processors(_config("pi05"), dataset_stats=_stats())
    np_pre, np_post = _load_numpy(_save(pre, post, tmp_path), offline_tokenizer)
    steps = np_pre.describe()
    json.dumps(steps)
    assert [s["registry_name"] for s in steps] == [
        "rename_observations_processor", "to_batch_processor", "normalizer_processor",
        "pi05_prepare_state_tokenizer_processor_step", "tokenizer_processor", "device_processor"]
    assert [s["implementation"] for s in steps] == ["none", "numpy", "numpy", "numpy", "tokenizers", "none"]
    assert steps[2]["state_file"] == "policy_preprocessor_step_2_normalizer_processor.safetensors"
    assert STATE in steps[2]["reads"] and steps[2]["config"]["norm_map"]["STATE"] == "QUANTILES"
    assert steps[4]["writes"][:2] == ["observation.language.tokens", "observation.language.attention_mask"]
    assert np_pre.files() == [tmp_path / steps[2]["state_file"], offline_tokenizer / "tokenizer.json",
                              offline_tokenizer / "tokenizer_config.json",
                              offline_tokenizer / "special_tokens_map.json"]
    assert np_post.files() == [tmp_path / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"]


# -- refusals --------------------------------------------------------------------------------------------------

def _saved_act(tmp_path):
    pre, post = make_pre_post_processors(_config("act"), dataset_stats=_stats())
    return _save(pre, post, tmp_path)


def test_an_unknown_registry_name_is_refused_naming_file_step_and_supported_steps(tmp_path):
    path = _saved_act(tmp_path) / "policy_preprocessor.json"
    config = json.loads(path.read_text())
    config["steps"].insert(2, {"registry_name": "my_custom_crop", "config": {}})
    path.write_text(json.dumps(config))
    with pytest.raises(DsaError) as e:
        ProcessorPipeline.load(path)
    text = str(e.value)
    for part in (str(path), "step 2", "'my_custom_crop'", "normalizer_processor", "tokenizer_processor",
                 "must be rebuilt with supported steps"):
        assert part in text, part


def test_a_missing_state_file_is_refused_by_name(tmp_path):
    _saved_act(tmp_path)
    (tmp_path / "policy_postprocessor_step_0_unnormalizer_processor.safetensors").unlink()
    with pytest.raises(DsaError, match=r"step 0 \(unnormalizer_processor\).*state file "
                                       r"policy_postprocessor_step_0_unnormalizer_processor\.safetensors is missing"):
        ProcessorPipeline.load(tmp_path / "policy_postprocessor.json")


def test_a_truncated_safetensors_file_is_refused_naming_the_file(tmp_path):
    _saved_act(tmp_path)
    state = tmp_path / "policy_preprocessor_step_3_normalizer_processor.safetensors"
    blob = state.read_bytes()
    state.write_bytes(blob[:-10])
    with pytest.raises(DsaError, match=rf"{state.name}: tensor '.*': data_offsets .* fall outside"):
        ProcessorPipeline.load(tmp_path / "policy_preprocessor.json")
    state.write_bytes(blob[:20])
    with pytest.raises(DsaError, match=rf"{state.name}: is truncated"):
        read_safetensors(state)
    state.write_bytes(blob[:4])
    with pytest.raises(DsaError, match="shorter than the 8-byte header length"):
        read_safetensors(state)


def _safetensors_bytes(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def test_a_corrupt_safetensors_header_is_refused(tmp_path):
    path = tmp_path / "bad.safetensors"
    cases = [
        (b"\x05\x00\x00\x00\x00\x00\x00\x00{nope", "header is not JSON"),
        (_safetensors_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                             "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)),
         "tensor 'b'.*overlaps tensor 'a'"),
        (_safetensors_bytes({"c": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)),
         "tensor 'c'.*unknown dtype 'C64'"),
        (_safetensors_bytes({"d": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
         "tensor 'd'.*needs 12"),
    ]
    for blob, message in cases:
        path.write_bytes(blob)
        with pytest.raises(DsaError, match=f"bad.safetensors.*{message}"):
            read_safetensors(path)


def test_read_safetensors_reads_every_dtype_as_the_safetensors_library_writes_it(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 2, generator=g), "f64": torch.randn(4, generator=g, dtype=torch.float64),
        "f16": torch.randn(5, generator=g).half(), "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "i64": torch.arange(-3, 3), "i32": torch.arange(4, dtype=torch.int32),
        "i16": torch.arange(2, dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8), "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(1.5), "empty": torch.zeros(0, 3),
    }
    save_file(tensors, str(tmp_path / "all.safetensors"))
    got = read_safetensors(tmp_path / "all.safetensors")
    assert set(got) == set(tensors)
    for name, tensor in tensors.items():
        expected = (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
        assert got[name].dtype == expected.dtype and got[name].shape == expected.shape, name
        assert np.array_equal(got[name], expected), name


@pytest.mark.parametrize("frame,seen", [
    (np.zeros((H, W, 3), np.float32), "float32 array of shape [12, 16, 3]"),
    (np.zeros((3, H, W), np.uint8), "uint8 array of shape [3, 12, 16]"),  # CHW
    (np.zeros((H, W), np.uint8), "uint8 array of shape [12, 16]"),
])
def test_a_camera_frame_that_is_not_uint8_hwc_is_refused_naming_key_dtype_and_shape(frame, seen):
    expected = f"observation '{CAMERA}': is a {seen}; a camera frame must be uint8 HWC"
    with pytest.raises(DsaError, match=re.escape(expected)):
        prepare_observation({CAMERA: frame, STATE: np.zeros(D, np.float32)})


def test_a_tokenizer_step_without_a_pinned_tokenizer_file_is_refused(offline_tokenizer, tmp_path):
    pre, post = make_pre_post_processors(_config("pi0"), dataset_stats=_stats())
    _save(pre, post, tmp_path)
    with pytest.raises(DsaError, match=r"step 3 \(tokenizer_processor\).*tokenizer.json must be pinned"):
        ProcessorPipeline.load(tmp_path / "policy_preprocessor.json")


def test_a_device_step_casting_to_other_than_float32_is_refused(tmp_path):
    path = _saved_act(tmp_path) / "policy_preprocessor.json"
    config = json.loads(path.read_text())
    config["steps"][2]["config"]["float_dtype"] = "bfloat16"
    path.write_text(json.dumps(config))
    with pytest.raises(DsaError, match=r"step 2 \(device_processor\).*float_dtype 'bfloat16'"):
        ProcessorPipeline.load(path)


# -- ACT's temporal ensembling ---------------------------------------------------------------------------------

@pytest.mark.parametrize("coeff,chunk", [(0.01, 20), (0.0, 8), (-0.05, 16), (0.3, 100)])
def test_temporal_ensembler_equals_act_temporal_ensembler_over_ten_updates(coeff, chunk):
    ours, theirs = TemporalEnsembler(coeff, chunk), ACTTemporalEnsembler(coeff, chunk)
    # exp: torch's float32 exp is within an ulp of the correctly rounded value ours uses.
    np.testing.assert_allclose(ours.ensemble_weights, theirs.ensemble_weights.numpy(), rtol=2e-7)
    exact = np.array_equal(ours.ensemble_weights, theirs.ensemble_weights.numpy())
    rng = np.random.default_rng(int(chunk))
    for _episode in range(2):
        for _ in range(10):
            actions = rng.normal(0, 1, (2, chunk, 3)).astype(np.float32)
            got, expected = ours.update(actions), theirs.update(torch.from_numpy(actions.copy())).numpy()
            assert got.dtype == np.float32 and got.shape == (2, 3)
            if exact:  # the same weights give the same float32 arithmetic, bit for bit
                assert np.array_equal(got, expected)
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
        ours.reset()
        theirs.reset()


# -- the module stays torch-free -------------------------------------------------------------------------------

def test_the_module_imports_no_torch_lerobot_safetensors_or_tokenizers():
    heavy = ("torch", "lerobot", "safetensors", "transformers", "tokenizers")
    code = f"import sys, dsa.runtime.processors; print([m for m in {heavy!r} if m in sys.modules])"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"
