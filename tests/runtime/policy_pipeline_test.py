"""A whole-pipeline bundle (docs/policy-pipeline.md) over an episode equals LeRobot's own control loop.

For each LeRobot policy with a pipeline bundle (//models:<name>_pipeline_bundle), the same sequence of raw
observations — uint8 (H, W, C) camera frames and raw state, as a robot gives them — goes through

  * LeRobot: `lerobot.utils.control_utils.predict_action` (prepare_observation_for_inference → the
    preprocessor → `policy.select_action` → the postprocessor), with the policy from
    `PolicyClass.from_pretrained(<name>_policy)` and the processors LeRobot's factory loads from the same
    processor files (`make_pre_post_processors(config, pretrained_path=...)`), `reset()` first;
  * the bundle: `dsa.runtime.load(bundle).select_action(raw observation)`, `reset()` first.

The episode is 2 × n_action_steps + 3 control steps, so the action queue is emptied and refilled (Diffusion
Policy's observation history slides across chunk boundaries). Flow / diffusion policies use the same noise:
LeRobot's noise draw is replaced by draws from the numpy generator the bundle uses, seeded alike. ACT is
also run with `temporal_ensemble_coeff` set (n_action_steps 1; the network runs every step).

The VLAs (SmolVLA, PI0, PI0.5) also get the task text, tokenised on both sides with the same tokenizer
(//models:vla_tokenizer, trained in the build: transformers' fast tokenizer in LeRobot, the `tokenizers`
library in the bundle); PI0.5's preprocessor writes the binned normalised state into that prompt.

Tolerance per step: |bundle - LeRobot| <= 1e-4 * max(1, max|LeRobot action|) (one fp32 pass or ten flow
steps; measured ~3e-6 for ACT), 1e-3 * ... for Diffusion Policy (ten DDIM steps compound the reordered
reductions; measured ~2e-5). The actions are un-normalised with the seeded statistics (std up to 2): a missed
or doubled (un)normalisation, another dataset's statistics, another prompt or an off-by-one in the queue
moves them by O(1).
"""

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dsa.runtime
from dsa.core.errors import DsaError
from dsa.frontends.lerobot import load_pretrained
from dsa.tools.testing import runfile

POLICIES = {
    "act": 1e-4,
    "diffusion": 1e-3,
    "smolvla": 1e-4,
    "pi0_lerobot": 1e-4,
    "pi05": 1e-4,
}
TOKENISING = ("smolvla", "pi0_lerobot", "pi05")
# The task texts of an episode (a policy that tokenises them reads one per step; the robot may change it).
TASKS = ["pick up the red cube and place it in the bin", "open the top drawer"]
SEED = 7


def _lerobot(name, **config_overrides):
    from lerobot.policies.factory import make_pre_post_processors

    policy = load_pretrained(runfile(f"models/{name}_policy/config.json").parent)
    for key, value in config_overrides.items():
        setattr(policy.config, key, value)
    if config_overrides.get("temporal_ensemble_coeff") is not None:
        from lerobot.policies.act.modeling_act import ACTTemporalEnsembler

        policy.temporal_ensembler = ACTTemporalEnsembler(policy.config.temporal_ensemble_coeff,
                                                         policy.config.chunk_size)
    processors = str(runfile(f"models/{name}_processors/policy_preprocessor.json").parent)
    # The saved tokenizer step names the Hub tokenizer (not downloadable here): LeRobot's own override points
    # it at the stand-in tokenizer directory the bundle pins.
    tokenizer = str(runfile("models/vla_tokenizer/tokenizer.json").parent)
    overrides = {"tokenizer_processor": {"tokenizer_name": tokenizer}} if name in TOKENISING else {}
    pre, post = make_pre_post_processors(policy.config, pretrained_path=processors,
                                         preprocessor_overrides=overrides)
    return policy, pre, post


def _same_noise(policy, shape):
    """LeRobot draws the flow / diffusion noise with torch; draw it from the bundle's numpy generator instead."""
    rng = np.random.default_rng(SEED)
    if policy.config.type == "diffusion":
        original = policy.predict_action_chunk

        def predict_action_chunk(batch, noise=None):
            return original(batch, noise=torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)))

        policy.predict_action_chunk = predict_action_chunk
    else:  # SmolVLA, PI0, PI0.5: sample_actions draws with model.sample_noise(shape, device)
        def sample_noise(noise_shape, device):
            assert list(noise_shape) == list(shape), (noise_shape, shape)
            return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))

        policy.model.sample_noise = sample_noise
    return rng


def _episode(spec, steps, seed):
    rng = np.random.default_rng(seed)
    frames = {k: rng.integers(0, 256, size=v["shape"], dtype=np.uint8)
              for k, v in spec["observation"].items() if v["dtype"] == "uint8"}
    observations = []
    for _ in range(steps):
        obs = {}
        for key, v in spec["observation"].items():
            if v["dtype"] == "uint8":  # a moving scene: the frame drifts a little every step
                frames[key] = np.clip(frames[key].astype(np.int16) + rng.integers(-8, 9, size=v["shape"]),
                                      0, 255).astype(np.uint8)
                obs[key] = frames[key].copy()
            elif v["dtype"] == "float32":
                obs[key] = rng.normal(0.0, 1.5, size=v["shape"]).astype(np.float32)
        observations.append(obs)
    return observations


def _lerobot_episode(name, spec, observations, tasks, **overrides):
    """LeRobot's own control loop over the episode: raw actions [steps, action dim]."""
    from lerobot.utils.control_utils import predict_action

    policy, pre, post = _lerobot(name, **overrides)
    if spec["loop"]["noise"] is not None:
        _same_noise(policy, spec["loop"]["noise"]["shape"])
    policy.reset()
    actions = []
    for obs, task in zip(observations, tasks):
        with torch.no_grad():
            actions.append(predict_action(copy.deepcopy(obs), policy, torch.device("cpu"), pre, post,
                                          use_amp=False, task=task, robot_type=None).numpy().reshape(-1))
    return np.stack(actions)


def _runnable_levels(name):
    """The targets of the policy's pipeline bundle (its levels: x86_64-v4, x86_64-v3) this machine runs, in the
    bundle's order."""
    from dsa.runtime.bundle import open_bundle

    with open_bundle(runfile(f"models/{name}_pipeline_bundle.tar")) as opened:
        return [t for t, why in opened.why_not_here().items() if why is None]


def _run_both(name, tolerance, steps=None, target=None, **overrides):
    from lerobot.utils.control_utils import predict_action

    bundle = runfile(f"models/{name}_pipeline_bundle.tar")
    with dsa.runtime.load(bundle, target, seed=SEED,
                          temporal_ensemble_coeff=overrides.get("temporal_ensemble_coeff")) as ours:
        spec = ours.pipeline.spec
        policy, pre, post = _lerobot(name, **overrides)
        noise = spec["loop"]["noise"]
        if noise is not None:
            _same_noise(policy, noise["shape"])
        n = steps or 2 * ours.pipeline.n_action_steps + 3
        observations = _episode(spec, n, seed=11)
        ours.reset()
        policy.reset()
        worst = 0.0
        text = "task" in spec["observation"]
        for step, obs in enumerate(observations):
            task = TASKS[(step // 4) % len(TASKS)] if text else None
            with torch.no_grad():
                theirs = predict_action(copy.deepcopy(obs), policy, torch.device("cpu"), pre, post, use_amp=False,
                                        task=task, robot_type=None).numpy().reshape(-1)
            mine = ours.select_action(obs, task=task)
            assert mine.shape == theirs.shape and mine.dtype == np.float32
            bound = tolerance * max(1.0, float(np.abs(theirs).max()))
            err = float(np.abs(mine - theirs).max())
            worst = max(worst, err)
            assert err <= bound, f"{name} step {step}: |bundle - LeRobot| = {err:.3g} > {bound:.3g}"
        print(f"{name}: {n} steps, worst |bundle - LeRobot| = {worst:.3g}")
        return observations


@pytest.mark.parametrize("name,target", [(name, target) for name in sorted(POLICIES) for target in _runnable_levels(name)])
def test_an_episode_of_raw_observations_gives_lerobots_raw_actions(name, target):
    _run_both(name, POLICIES[name], target=target)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_pipeline_bundle_holds_every_level_and_load_takes_the_most_capable_this_machine_runs(name):
    with dsa.runtime.load(runfile(f"models/{name}_pipeline_bundle.tar")) as ours:
        assert ours.bundle.targets == ["x86_64-v4", "x86_64-v3"]  # most capable first
        assert ours.target == _runnable_levels(name)[0]
        assert ours.compiled.index["target"] == ours.target


def test_act_with_temporal_ensembling_gives_lerobots_ensembled_actions():
    _run_both("act", POLICIES["act"], steps=6, temporal_ensemble_coeff=0.01, n_action_steps=1)


def test_temporal_ensembling_is_refused_for_a_policy_that_is_not_act():
    with pytest.raises(DsaError, match="ACT's; this bundle's policy is diffusion"):
        dsa.runtime.load(runfile("models/diffusion_pipeline_bundle.tar"), temporal_ensemble_coeff=0.01)


def test_a_frame_of_the_wrong_layout_is_refused_naming_the_camera():
    with dsa.runtime.load(runfile("models/act_pipeline_bundle.tar")) as ours:
        obs = _episode(ours.pipeline.spec, 1, seed=0)[0]
        key = next(k for k in obs if "image" in k)
        obs[key] = np.ascontiguousarray(obs[key].transpose(2, 0, 1))  # CHW, not the camera's HWC
        with pytest.raises(DsaError, match=key.replace(".", r"\.") + ".*uint8"):
            ours.select_action(obs)


def test_a_tokenising_policy_refuses_an_observation_without_its_task_text():
    with dsa.runtime.load(runfile("models/smolvla_pipeline_bundle.tar")) as ours:
        obs = _episode(ours.pipeline.spec, 1, seed=0)[0]
        with pytest.raises(DsaError, match="task.*tokenises"):
            ours.select_action(obs)


def test_a_signed_pipeline_bundle_is_checked_in_the_lerobot_environment(tmp_path):
    """The LeRobot environment holds `cryptography` too: a LeRobot user loads a signed release as the robot does,
    and another model's release is refused."""
    import shutil

    from dsa.runtime import signing

    private, public = signing.generate_key(tmp_path / "release")
    bundle = tmp_path / "act_pipeline_bundle.tar"
    shutil.copyfile(runfile("models/act_pipeline_bundle.tar"), bundle)
    signing.sign_bundle(bundle, private, release=2)
    with dsa.runtime.load(bundle, require_signature=public, expect_model="act", min_release=2) as ours:
        assert ours.pipeline is not None
    with pytest.raises(DsaError, match="not the expected 'pi05'"):
        dsa.runtime.load(bundle, require_signature=public, expect_model="pi05")


RUNTIME_PYTHON = runfile("../dsa_runtime_python/bin/python3")


@pytest.mark.parametrize("name", ["diffusion", "pi05"])
def test_dsa_run_in_the_torch_free_environment_gives_lerobots_episode(name, tmp_path):
    """`dsa run BUNDLE --observation episode.npz` in @dsa_runtime_python (IREE's runtime, numpy, tokenizers:
    //tests/runtime:torch_free_test checks it holds nothing else) against LeRobot's loop here."""
    bundle = runfile(f"models/{name}_pipeline_bundle.tar")
    with dsa.runtime.load(bundle) as ours:
        spec = ours.pipeline.spec
        k = ours.pipeline.n_action_steps
        n = 2 * k + 1
    observations = _episode(spec, n, seed=5)
    task = TASKS[0] if "task" in spec["observation"] else None
    episode = tmp_path / "episode.npz"
    np.savez(episode, **{k: np.stack([o[k] for o in observations]) for k in observations[0]})
    out = tmp_path / "actions.npy"
    sources = [p for p in sys.path if (Path(p) / "dsa" / "runtime" / "run.py").is_file()]
    command = [str(RUNTIME_PYTHON), "-m", "dsa.runtime.run", "--bundle", str(bundle), "--observation", str(episode),
               "--seed", str(SEED), "--out", str(out), "--profile"] + (["--task", task] if task else [])
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sources), PYTHONNOUSERSITE="1"))
    assert proc.returncode == 0, proc.stderr
    assert f"{n} control steps" in proc.stdout
    for node in ("prepare_observation", "network", "postprocessor[0] unnormalizer_processor"):
        assert node in proc.stdout, proc.stdout
    # The profile's last column counts the steps a node ran in: the network once per chunk of k actions.
    network = next(line.split() for line in proc.stdout.splitlines() if line.split()[:1] == ["network"])
    assert network[-1] == f"{-(-n // k)}/{n}", proc.stdout
    mine = np.load(out)
    theirs = _lerobot_episode(name, spec, observations, [task] * n)
    assert mine.shape == theirs.shape
    err = float(np.abs(mine - theirs).max())
    assert err <= POLICIES[name] * max(1.0, float(np.abs(theirs).max())), err
