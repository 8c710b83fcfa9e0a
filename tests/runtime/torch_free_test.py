"""A release bundle runs where only IREE's runtime, numpy, tokenizers and cryptography are installed
(@dsa_runtime_python):
the deployment API keeps LeRobot's action queue (`select_action` runs the module once per n_action_steps calls
and returns the chunk's actions in order; `reset` empties it), gives the build tree's actions, and refuses a
tampered bundle; `dsa run BUNDLE` works there too; a whole-pipeline bundle takes raw frames and task text.
Nothing here may import torch (or transformers): //tests/runtime:policy_pipeline_test runs `dsa run` of
pipeline bundles in this environment against LeRobot's own loop."""

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tarfile

import numpy as np
import pytest

import dsa.runtime
from dsa.core.errors import DsaError
from dsa.runtime.policy import CompiledPolicy, sample_inputs
from dsa.tools.testing import runfile  # torch-free at import

BUNDLE = runfile("models/pi0_bundle.tar")
FLEET = runfile("models/pi0_fleet_bundle.tar")
INDEX = runfile("models/pi0.modules.json")
LOCK = runfile("requirements_runtime_lock.txt")
PIPELINE = runfile("models/pi05_pipeline_bundle.tar")


def _canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_environment_holds_the_runtime_lock_and_nothing_else():
    pinned = {_canon(line.split("==")[0]) for line in LOCK.read_text().splitlines() if "==" in line}
    installed = {_canon(d.metadata["Name"]) for d in importlib.metadata.distributions()} - {"pip", "setuptools"}
    assert installed == pinned
    for absent in ("torch", "transformers", "huggingface_hub", "yaml", "jsonschema", "safetensors",
                   "iree.compiler"):
        assert importlib.util.find_spec(absent) is None, absent


def _observation(seed=0):
    """A sample observation without the step-count input (the policy sets it to the manifest's flow_steps)."""
    record = CompiledPolicy(INDEX).modules[0].record
    obs = sample_inputs(record, {"prompt_len": 20}, np.random.default_rng(seed))
    for spec in record["inputs"]:
        if "value_range" in spec:
            del obs[spec["name"]]
    return obs


def test_the_runtime_classes_import_from_dsa_runtime_without_torch():
    """`from dsa.runtime import CompiledPolicy` (what a user tries first) works, in this torch-free environment."""
    from dsa.runtime import CompiledPolicy, DeployedPolicy, PolicyPipeline, ProcessorPipeline
    from dsa.runtime.policy import CompiledPolicy as defined

    assert CompiledPolicy is defined and {DeployedPolicy.__name__, PolicyPipeline.__name__,
                                          ProcessorPipeline.__name__} == {"DeployedPolicy", "PolicyPipeline",
                                                                          "ProcessorPipeline"}
    assert "torch" not in sys.modules
    with pytest.raises(ImportError):
        from dsa.runtime import NoSuchThing  # noqa: F401


def test_select_action_returns_the_chunk_one_action_per_step_and_runs_again_when_it_is_used_up():
    obs = _observation()
    with dsa.runtime.load(BUNDLE) as policy:
        n = policy.n_action_steps
        chunk = policy.predict_action_chunk(obs)
        policy.reset()
        got = [policy.select_action(obs) for _ in range(n)]
        assert policy.queued == 0
        for i, action in enumerate(got):
            assert action.shape == (1, chunk.shape[-1])
            np.testing.assert_array_equal(action, chunk[:, i])
        # The next call runs the module again, on the observation it is given.
        other = _observation(seed=1)
        fresh = policy.select_action(other)
        assert policy.queued == n - 1
        np.testing.assert_array_equal(fresh, policy.predict_action_chunk(other)[:, 0])
        # reset() drops the queue: the next action is the first of a new chunk.
        policy.reset()
        np.testing.assert_array_equal(policy.select_action(obs), chunk[:, 0])


def test_the_bundle_gives_the_build_trees_actions():
    obs = _observation()
    steps = next(s["name"] for s in CompiledPolicy(INDEX).modules[0].record["inputs"] if "value_range" in s)
    with dsa.runtime.load(BUNDLE) as policy:
        # The build tree's modules of the bundle's target (pi0_bundle holds π0's own, not its levels).
        (want, *_), _ = CompiledPolicy(INDEX, target=policy.target).run(
            dict(obs, **{steps: np.array(policy.flow_steps, np.int64)}))
        np.testing.assert_array_equal(policy.predict_action_chunk(obs), want)


def test_a_multi_target_bundle_loads_the_first_target_this_machine_runs():
    with dsa.runtime.load(FLEET) as policy:
        assert policy.target in ("x86_64-v4", "x86_64-v3")  # Orin's GPU and CPU do not run here
        assert policy.select_action(_observation()).shape[0] == 1


def test_a_tampered_bundle_is_refused_before_anything_loads(tmp_path):
    data = bytearray(BUNDLE.read_bytes())
    with tarfile.open(BUNDLE) as tar:
        member = next(m for m in tar if m.name.endswith(".vmfb"))
    data[member.offset_data + 100] ^= 0xFF
    broken = tmp_path / "pi0_bundle.tar"
    broken.write_bytes(bytes(data))
    with pytest.raises(DsaError, match="sha256"):
        dsa.runtime.load(broken)


def test_dsa_run_runs_the_bundle_here():
    proc = subprocess.run([sys.executable, "-m", "dsa.runtime.run", "--bundle", str(BUNDLE), "--steps", "1",
                           "--repeats", "1"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 0, proc.stderr
    assert "action chunk (1, " in proc.stdout
    assert "torch" not in sys.modules


def test_a_signed_release_is_checked_here_model_and_release_included(tmp_path):
    """The robot-side environment holds `cryptography`: `dsa run --require-signature` and dsa.runtime.load with
    require_signature work here, and refuse another model or an older release."""
    import shutil

    from dsa.runtime import signing

    private, public = signing.generate_key(tmp_path / "release")
    copy = tmp_path / BUNDLE.name
    shutil.copyfile(BUNDLE, copy)
    signing.sign_bundle(copy, private, release=5)
    with dsa.runtime.load(copy, require_signature=public, expect_model="pi0", min_release=5) as policy:
        assert policy.model_id == "pi0"
    with pytest.raises(DsaError, match="not the expected 'act'"):
        dsa.runtime.load(copy, require_signature=public, expect_model="act")
    proc = subprocess.run([sys.executable, "-m", "dsa.runtime.run", "--bundle", str(copy), "--require-signature",
                           str(public), "--min-release", "6"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 2 and "older than the floor 6 (a rollback)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "torch" not in sys.modules


def test_a_pipeline_bundle_takes_raw_frames_state_and_task_text_here():
    rng = np.random.default_rng(3)
    with dsa.runtime.load(PIPELINE, seed=3) as policy:
        spec = policy.pipeline.spec
        obs = {k: rng.integers(0, 256, size=v["shape"], dtype=np.uint8) if v["dtype"] == "uint8"
               else rng.normal(size=v["shape"]).astype(np.float32)
               for k, v in spec["observation"].items() if k != "task"}
        steps = policy.pipeline.n_action_steps + 1  # the queue empties and the network runs again
        first = [policy.select_action(obs, task="open the top drawer") for _ in range(steps)]
        policy.reset()  # the noise restarts from the seed: the same episode again
        again = [policy.select_action(obs, task="open the top drawer") for _ in range(steps)]
        policy.reset()
        other_task = policy.select_action(obs, task="fold the towel in half")
    assert first[0].shape == tuple(spec["action"]["shape"]) and first[0].dtype == np.float32
    np.testing.assert_array_equal(np.stack(first), np.stack(again))
    assert not np.array_equal(first[0], other_task)  # the prompt reaches the network
    assert "tokenizers" in sys.modules and "torch" not in sys.modules and "transformers" not in sys.modules
