"""The compiled module is not the first line of defence: every bad input to the built π0 is refused by the
runtime with a message naming the input, before the module is called — through the Python API
(CompiledPolicy.run) and through `dsa run` (exit 2, one line, no traceback, under a time and memory limit),
observation files included (FIFOs, devices, zip bombs, pickles, strangers)."""

from __future__ import annotations

import io
import os
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from hostile_lib import cli, refused  # noqa: E402
from dsa.core.errors import DsaError  # noqa: E402
from dsa.runtime.policy import CompiledPolicy, sample_inputs  # noqa: E402
from dsa.tools.testing import bounded_memory, runfile  # noqa: E402

@pytest.fixture(autouse=True)
def _case_memory_limit():
    """Every case runs under a memory limit: at most 1 GiB more address space than the process holds."""
    with bounded_memory():
        yield


INDEX = runfile("models/pi0.modules.json")
VOCAB = 1024  # manifests/pi0.yaml: inputs.prompt.vocab_size


@pytest.fixture(scope="module")
def policy():
    return CompiledPolicy(INDEX)


@pytest.fixture
def good(policy):
    values = sample_inputs(policy.modules[0].record, {"prompt_len": 20}, np.random.default_rng(0))
    values["steps"] = np.array(2, dtype=np.int64)
    return values


def _with(values, name, value):
    return dict(values, **{name: value})


def test_the_untouched_sample_runs(policy, good):
    (actions,), _ = policy.run(good)
    assert actions.shape == (1, 16, 14) and np.all(np.isfinite(actions))


def _tokens(good, position, value):
    tokens = good["prompt_tokens"].copy()
    tokens[0, position] = value
    return tokens


API_CASES = {
    # name: (input, how to spoil it, message)
    "token_id_equal_to_the_vocabulary_size": (
        "prompt_tokens", lambda g: _tokens(g, 3, VOCAB),
        f"holds {VOCAB}, outside the supported vocabulary [0, {VOCAB - 1}] (size {VOCAB})"),
    "token_id_far_out_of_range": (
        "prompt_tokens", lambda g: _tokens(g, 0, 10 ** 12), "outside the supported vocabulary"),
    "negative_token_id": ("prompt_tokens", lambda g: _tokens(g, 5, -1), "holds -1, outside the supported"),
    "fractional_token_ids": (
        "prompt_tokens", lambda g: g["prompt_tokens"].astype(np.float64) + 0.5, "holds non-integer values"),
    "token_ids_as_strings": ("prompt_tokens", lambda g: np.array([["a"] * 20]), "holds <U1 values, not numbers"),
    "token_ids_as_objects": (
        "prompt_tokens", lambda g: np.array([[object()] * 20], dtype=object), "holds object values"),
    "mask_value_two": (
        "prompt_mask", lambda g: np.where(np.arange(20) == 4, 2, g["prompt_mask"]), "holds 2, outside"),
    "nan_in_the_state": ("state", lambda g: np.where(np.arange(14) == 3, np.nan, g["state"]).astype(np.float32),
                         "holds 1 NaN or infinite value"),
    "inf_in_the_noise": ("noise", lambda g: np.full_like(g["noise"], np.inf), "holds 224 NaN or infinite"),
    "nan_in_a_camera": ("base_rgb", lambda g: np.full_like(g["base_rgb"], np.nan), "NaN or infinite"),
    "zero_flow_steps": ("steps", lambda g: np.array(0), "holds 0, outside the supported range [1, 1000]"),
    "too_many_flow_steps": ("steps", lambda g: np.array(10 ** 6), "outside the supported range [1, 1000]"),
    "state_of_the_wrong_rank": ("state", lambda g: g["state"][0], "has rank 1"),
    "state_of_the_wrong_width": ("state", lambda g: np.zeros((1, 15), np.float32), "has shape [1, 15]"),
    "camera_as_a_string": ("wrist_rgb", lambda g: "not an image", "holds <U12 values, not numbers"),
    "mask_shorter_than_its_tokens": ("prompt_mask", lambda g: g["prompt_mask"][:, :15],
                                     "the inputs sharing prompt_len must agree"),
    "tokens_longer_than_their_mask": ("prompt_tokens", lambda g: np.concatenate([g["prompt_tokens"]] * 2, axis=1),
                                      "the inputs sharing prompt_len must agree"),
}


@pytest.mark.parametrize("case", sorted(API_CASES))
def test_a_bad_input_is_refused_by_the_runtime_naming_it(policy, good, case):
    name, spoil, message = API_CASES[case]
    with pytest.raises(DsaError) as info:
        policy.run(_with(good, name, spoil(good)))
    text = str(info.value)
    assert f"input '{name}'" in text and message in text, text


def test_nonfinite_inputs_reach_the_module_only_when_the_caller_opts_in(good):
    spoiled = _with(good, "state", np.full_like(good["state"], np.nan))
    (actions,), _ = CompiledPolicy(INDEX, allow_nonfinite=True).run(spoiled)
    assert np.isnan(actions).any()


# -- dsa run ------------------------------------------------------------------------------------------------


def _npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def _observation(good):
    return {k: v for k, v in good.items()}


def test_dsa_run_takes_a_good_observation_file(tmp_path, good):
    path = _npz(tmp_path / "obs.npz", **_observation(good))
    proc = cli("dsa.runtime.run", "--index", INDEX, "--observation", path, "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    assert "bucket prompt_len=32" in proc.stdout


def _fifo(tmp_path, good):
    path = tmp_path / "obs.npz"
    os.mkfifo(path)  # opening it for reading would block until a writer comes: it must not be opened
    return path


def _zip_bomb(tmp_path, good):
    # 1 GiB of zeros as the 'state' member (56 bytes at its true shape): about 1 MB on disk.
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        with archive.open("state.npy", "w", force_zip64=True) as f:
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                          "shape": (1, 1 << 28)})
            f.write(header.getvalue())
            block = bytes(1 << 24)
            for _ in range(64):
                f.write(block)
    assert path.stat().st_size < (8 << 20)
    return path


def _pickled(tmp_path, good):
    path = tmp_path / "pickle.npz"
    np.savez(path, **dict(_observation(good), state=np.array([{"x": 1}], dtype=object)), allow_pickle=True)
    return path


def _huge_header(tmp_path, good):
    # A 100-byte member whose .npy header declares 1 TB: numpy's own reader would allocate it first.
    path = tmp_path / "header.npz"
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                  "shape": (1, 250_000_000_000)})
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("state.npy", header.getvalue() + bytes(16))
    return path


def _stranger(tmp_path, good):
    return _npz(tmp_path / "extra.npz", **dict(_observation(good), extra=np.zeros(3)))


def _not_a_zip(tmp_path, good):
    path = tmp_path / "garbage.npz"
    path.write_bytes(b"this is not a zip archive" * 10)
    return path


def _garbage_safetensors(tmp_path, good):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(b"\xff" * 64)
    return path


def _token_out_of_vocabulary(tmp_path, good):
    return _npz(tmp_path / "oov.npz", **dict(_observation(good), prompt_tokens=_tokens(good, 2, VOCAB)))


def _nan_state(tmp_path, good):
    return _npz(tmp_path / "nan.npz", **dict(_observation(good), state=np.full((1, 14), np.nan, np.float32)))


OBSERVATION_CASES = {
    "a_fifo_is_refused_without_blocking": (_fifo, "is not a regular file"),
    "dev_zero_is_refused_without_reading_forever": (lambda t, g: Path("/dev/zero"), "is not a regular file"),
    "a_directory_is_refused": (lambda t, g: t, "is not a regular file"),
    "a_missing_file_is_refused": (lambda t, g: t / "absent.npz", "cannot be read"),
    "a_zip_bomb_is_refused_before_decompression": (_zip_bomb, "more than the 56 bytes the input takes"),
    "a_pickled_object_is_refused": (_pickled, "objects or pickles are never loaded"),
    "a_header_declaring_a_terabyte_is_refused_before_allocating": (_huge_header, "declares shape [1, 250000000000]"),
    "an_unknown_member_is_refused": (_stranger, "holds 'extra', which is not an input"),
    "a_non_zip_npz_is_refused": (_not_a_zip, "is not a readable .npz archive"),
    "a_garbage_safetensors_is_refused": (_garbage_safetensors, "is not a readable .safetensors file"),
    "an_out_of_vocabulary_token_exits_2_naming_the_vocabulary": (
        _token_out_of_vocabulary, f"input 'prompt_tokens': holds {VOCAB}, outside the supported vocabulary"),
    "a_nan_state_exits_2": (_nan_state, "input 'state': holds 14 NaN or infinite values"),
}


@pytest.mark.parametrize("case", sorted(OBSERVATION_CASES))
def test_dsa_run_refuses_a_hostile_observation_file(tmp_path, good, case):
    make, message = OBSERVATION_CASES[case]
    path = make(tmp_path, good)
    refused(cli("dsa.runtime.run", "--index", INDEX, "--observation", path, "--repeats", "1"), message)


FLAG_CASES = {
    "prompt_len_of_a_billion_is_refused_before_allocating": (["--prompt-len", 10 ** 9], "longer than the largest"),
    "negative_prompt_len": (["--prompt-len", -5], "is not a positive length"),
    "steps_of_thirty_digits": (["--steps", 10 ** 30], "outside the supported range [1, 1000]"),
    "zero_steps": (["--steps", 0], "outside the supported range"),
    "zero_repeats": (["--repeats", 0], "is not a number of runs"),
    "a_billion_repeats": (["--repeats", 10 ** 9], "is not a number of runs"),
}


@pytest.mark.parametrize("case", sorted(FLAG_CASES))
def test_dsa_run_refuses_a_bad_flag_before_work(case):
    args, message = FLAG_CASES[case]
    refused(cli("dsa.runtime.run", "--index", INDEX, *args), message)


def test_the_case_memory_limit_stops_an_allocation_beyond_it():
    # The autouse limit is real: asking for 2 GiB inside a case fails.
    with pytest.raises(MemoryError):
        bytearray(2 << 30)
