"""dsa.frontends.lerobot: random-init LeRobot checkpoints, the export adapters' eager parity with LeRobot, the
tensorised DDIM step against diffusers, and the refusals. Eager only (no torch.export, no IREE); small
configs so the file runs in well under two minutes."""

import hashlib
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network

import numpy as np
import pytest
import torch

import dsa.frontends.lerobot as lerobot
from dsa.frontends.lerobot.third_party import openpi_transformers as lerobot_pi
from dsa.core.errors import DsaError, run_cli

SMALL_ACT = {
    "dim_model": 64, "n_heads": 4, "dim_feedforward": 128, "n_encoder_layers": 1, "n_decoder_layers": 1,
    "n_vae_encoder_layers": 1, "latent_dim": 8, "chunk_size": 10, "n_action_steps": 10,
    "input_features": {
        "observation.images.top": {"type": "VISUAL", "shape": [3, 64, 64]},
        "observation.state": {"type": "STATE", "shape": [6]},
    },
    "output_features": {"action": {"type": "ACTION", "shape": [6]}},
}
SMALL_DIFFUSION = {
    "down_dims": [32, 64], "diffusion_step_embed_dim": 32, "spatial_softmax_num_keypoints": 8,
    "crop_shape": [28, 28], "noise_scheduler_type": "DDIM", "num_inference_steps": 10,
    "input_features": {
        "observation.image": {"type": "VISUAL", "shape": [3, 32, 32]},
        "observation.state": {"type": "STATE", "shape": [2]},
    },
    "output_features": {"action": {"type": "ACTION", "shape": [2]}},
}
SMOLVLM_SIZES = {
    "scale_factor": 2,
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
    "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 64, "max_position_embeddings": 128},
}
SMALL_SMOLVLA = {
    "chunk_size": 4, "n_action_steps": 4, "num_steps": 10, "max_state_dim": 8, "max_action_dim": 8,
    "resize_imgs_with_padding": [32, 32], "tokenizer_max_length": 6, "num_vlm_layers": 2,
    "vlm_model_name": lerobot.smolvlm_name(SMOLVLM_SIZES),
    "input_features": {
        "observation.images.top": {"type": "VISUAL", "shape": [3, 24, 40]},
        "observation.images.wrist": {"type": "VISUAL", "shape": [3, 32, 32]},
        "observation.state": {"type": "STATE", "shape": [5]},
    },
    "output_features": {"action": {"type": "ACTION", "shape": [5]}},
}
PI_VLM = {"width": 32, "depth": 2, "mlp_dim": 64, "num_heads": 8, "num_kv_heads": 1, "head_dim": 8,
          "vision": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}}
PI_EXPERT = {"width": 16, "depth": 2, "mlp_dim": 32, "num_heads": 8, "num_kv_heads": 1, "head_dim": 8}
SMALL_PI = {
    "chunk_size": 4, "n_action_steps": 4, "num_inference_steps": 10, "max_state_dim": 8, "max_action_dim": 8,
    "image_resolution": [28, 28], "tokenizer_max_length": 6,
    "paligemma_variant": lerobot_pi.gemma_name(PI_VLM), "action_expert_variant": lerobot_pi.gemma_name(PI_EXPERT),
    "input_features": {
        "observation.images.top": {"type": "VISUAL", "shape": [3, 24, 40]},
        "observation.images.wrist": {"type": "VISUAL", "shape": [3, 28, 28]},
        "observation.state": {"type": "STATE", "shape": [5]},
    },
    "output_features": {"action": {"type": "ACTION", "shape": [5]}},
}
PALIGEMMA_VOCAB = 257152
TOLERANCE = 1e-5


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def act_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("act") / "policy"
    lerobot.init_policy("act", SMALL_ACT, 0, out)
    return out


@pytest.fixture(scope="module")
def diffusion_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("diffusion") / "policy"
    lerobot.init_policy("diffusion", SMALL_DIFFUSION, 0, out)
    return out


@pytest.fixture(scope="module")
def smolvla_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("smolvla") / "policy"
    lerobot.init_policy("smolvla", SMALL_SMOLVLA, 0, out)
    return out


@pytest.fixture(scope="module")
def pi0_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("pi0") / "policy"
    lerobot.init_policy("pi0", SMALL_PI, 0, out)
    return out


@pytest.fixture(scope="module")
def pi05_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("pi05") / "policy"
    lerobot.init_policy("pi05", SMALL_PI, 0, out)
    return out


def _config(policy_dir):
    return json.loads((policy_dir / "config.json").read_text())


def _view(config, loop="kept"):
    """The export view a manifest describing this policy gives (inputs, outputs, chunk_size as config.json)."""
    features = config["input_features"]
    chunk = config["n_action_steps"] if config["type"] == "diffusion" else config["chunk_size"]
    view = {
        "model": {"pretrained_config": config, "denoising_loop": loop},
        "inputs": {
            "state": {"dim": features["observation.state"]["shape"][0]},
            "cameras": [{"name": lerobot.camera_name(k), "shape": v["shape"]}
                        for k, v in features.items() if v["type"] == "VISUAL"],
        },
        "outputs": {"action": {"dim": config["output_features"]["action"]["shape"][0]}},
        "chunk_size": chunk,
    }
    if config["type"] == "smolvla":
        view["inputs"]["prompt"] = {"vocab_size": SMOLVLM_SIZES["text_config"]["vocab_size"], "pad_id": 0}
    if config["type"] in lerobot.PI_TYPES:
        view["inputs"]["prompt"] = {"vocab_size": PALIGEMMA_VOCAB, "pad_id": 0}
    return view


def _spec(policy_dir, loop="kept", batch=2, **overrides):
    config = dict(_config(policy_dir), **overrides)
    return lerobot.export_spec(_view(config, loop), {"batch": batch})


@pytest.mark.parametrize("field, value, named", [
    ("cameras", [{"name": "wrist", "shape": [3, 64, 64]}], "inputs.cameras"),
    ("state", {"dim": 7}, "inputs.state.dim"),
])
def test_manifest_inputs_that_disagree_with_config_json_are_refused_by_field(act_dir, field, value, named):
    view = _view(_config(act_dir))
    view["inputs"][field] = value
    with pytest.raises(DsaError, match=named.replace(".", r"\.")):
        lerobot.export_spec(view, {"batch": 1})


def test_manifest_chunk_size_that_disagrees_with_config_json_is_refused(act_dir):
    view = dict(_view(_config(act_dir)), chunk_size=99)
    with pytest.raises(DsaError, match="chunk_size"):
        lerobot.export_spec(view, {"batch": 1})


def _load_checkpoint(module, policy_dir):
    from safetensors.torch import load_file

    module.load_state_dict(load_file(str(policy_dir / "model.safetensors")), strict=True)
    return module.eval()


def _inputs(spec, seed=1):
    rng = np.random.default_rng(seed)
    return {s.name: s.example(rng).numpy() for s in spec.inputs if s.name != "steps"}


def _adapter_actions(spec, inputs, steps=None):
    args = [torch.from_numpy(inputs[s.name]) for s in spec.inputs if s.name != "steps"]
    if steps is not None:
        args.append(torch.tensor(steps, dtype=torch.int64))
    with torch.no_grad():
        return spec.module(*args).numpy()


# --- init ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_type,config", [("act", SMALL_ACT), ("diffusion", SMALL_DIFFUSION)])
def test_init_writes_exactly_config_and_safetensors_with_identical_bytes_in_any_directory(
        tmp_path, policy_type, config):
    first, second = tmp_path / "a", tmp_path / "elsewhere" / "deeper" / "b"
    lerobot.init_policy(policy_type, config, 0, first)
    lerobot.init_policy(policy_type, config, 0, second)
    assert sorted(p.name for p in first.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in second.iterdir()) == ["config.json", "model.safetensors"]
    for name in lerobot.SAVED_FILES:
        assert _sha256(first / name) == _sha256(second / name), name
    saved = _config(first)
    assert saved["type"] == policy_type and saved["device"] == "cpu"
    assert saved["pretrained_backbone_weights"] is None


def test_init_seed_changes_the_weights_only(tmp_path):
    lerobot.init_policy("act", SMALL_ACT, 0, tmp_path / "s0")
    lerobot.init_policy("act", SMALL_ACT, 1, tmp_path / "s1")
    assert _sha256(tmp_path / "s0" / "config.json") == _sha256(tmp_path / "s1" / "config.json")
    assert _sha256(tmp_path / "s0" / "model.safetensors") != _sha256(tmp_path / "s1" / "model.safetensors")


def test_cli_init_gives_the_same_bytes_whichever_mkl_code_path_the_caller_asks_for(tmp_path):
    """MKL rounds PI0.5's SigLIP initialisation (trunc_normal_) differently per code path: the AVX2, AVX-512
    and generic paths give three digests. `init` runs on MKL's CPU-independent path whatever the caller set
    (dsa.core.determinism), so a stand-in pinned on an AMD EPYC holds on an Intel Xeon."""
    digests = []
    for branch in ("AVX2", "COMPATIBLE"):
        out = tmp_path / branch
        subprocess.run([sys.executable, "-m", "dsa.frontends.lerobot.cli", "init", "--type", "pi05",
                        "--config-json", json.dumps(SMALL_PI), "--out-dir", str(out)],
                       env=dict(os.environ, MKL_CBWR=branch), check=True, capture_output=True)
        digests.append(_sha256(out / "model.safetensors"))
    assert digests[0] == digests[1]


def test_cli_init_writes_the_policy_and_reports_bad_fields_with_exit_code_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "AVX2")  # restored after the test
    lerobot.main(["init", "--type", "act", "--config-json", json.dumps(SMALL_ACT), "--seed", "0",
                  "--out-dir", str(tmp_path / "cli")])
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == ["config.json", "model.safetensors"]
    # The stand-in's bytes must not depend on the CPU: MKL's one code path (dsa.core.determinism; PI0/PI0.5's
    # initialisation rounded differently on Intel and AMD without it).
    assert os.environ["MKL_CBWR"] == "COMPATIBLE"
    bad = dict(SMALL_ACT, dim_modle=64)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: lerobot.main(["init", "--type", "act", "--config-json", json.dumps(bad),
                                      "--out-dir", str(tmp_path / "bad")]), "dsa-lerobot")
    assert exit_info.value.code == 2
    assert "config.dim_modle" in capsys.readouterr().err
    assert not (tmp_path / "bad" / "model.safetensors").exists()


@pytest.mark.parametrize("overrides,field", [
    ({"dim_modle": 64}, "config.dim_modle"),
    ({"pretrained_backbone_weights": "ResNet18_Weights.IMAGENET1K_V1"}, "config.pretrained_backbone_weights"),
    ({"device": "cuda"}, "config.device"),
    ({"input_features": {"observation.state": {"type": "JOINTS", "shape": [6]}}},
     "config.input_features.observation.state.type"),
    ({"input_features": {"observation.state": {"type": "STATE", "shape": [0]}}},
     "config.input_features.observation.state.shape"),
])
def test_init_refuses_a_bad_config_naming_the_field(tmp_path, overrides, field):
    with pytest.raises(DsaError) as e:
        lerobot.init_policy("act", dict(SMALL_ACT, **overrides), 0, tmp_path / "out")
    assert e.value.where == field
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_init_refuses_an_unsupported_type_naming_the_supported_ones(tmp_path):
    with pytest.raises(DsaError) as e:
        lerobot.init_policy("tdmpc", {}, 0, tmp_path / "out")
    assert e.value.where == "--type" and "act, diffusion" in str(e.value)


def test_init_refuses_a_directory_holding_other_files(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.bin").write_bytes(b"x")
    with pytest.raises(DsaError, match="stale.bin"):
        lerobot.init_policy("act", SMALL_ACT, 0, tmp_path / "out")


# --- adapters --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which,loop", [("act", "kept"), ("diffusion", "kept"), ("diffusion", "unrolled"),
                                        ("smolvla", "kept"), ("smolvla", "unrolled"), ("pi0", "kept"),
                                        ("pi0", "unrolled"), ("pi05", "kept"), ("pi05", "unrolled")])
def test_adapter_state_dict_keys_are_exactly_the_checkpoint_tensor_names(act_dir, diffusion_dir, smolvla_dir,
                                                                         pi0_dir, pi05_dir, which, loop):
    from safetensors import safe_open

    policy_dir = {"act": act_dir, "diffusion": diffusion_dir, "smolvla": smolvla_dir, "pi0": pi0_dir,
                  "pi05": pi05_dir}[which]
    spec = _spec(policy_dir, loop)
    with safe_open(str(policy_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert set(spec.module.state_dict()) == names
    assert "policy" not in dict(spec.module.named_children())  # no "policy." prefix on any name


def test_shared_module_keeps_non_persistent_buffers_out_of_the_state_dict():
    class Policy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("kept", torch.ones(2))
            self.register_buffer("scratch", torch.ones(2), persistent=False)

    policy = Policy()
    adapter = torch.nn.Module()
    lerobot.common.SharedModule.share(adapter, policy)
    assert list(adapter.state_dict()) == list(policy.state_dict()) == ["kept", "lin.weight", "lin.bias"]
    assert adapter.policy is policy and "policy" not in dict(adapter.named_children())


def test_export_spec_inputs_have_a_dynamic_batch_and_a_bounded_steps_input(act_dir, diffusion_dir):
    act = _spec(act_dir, batch=3)
    assert [(s.name, s.shape, s.dynamic) for s in act.inputs] == [
        ("observation.images.top", (3, 3, 64, 64), {0: "batch"}),
        ("observation.state", (3, 6), {0: "batch"}),
    ]
    assert act.outputs == ["action"] and act.dim_minimums == {"batch": 1}
    kept = _spec(diffusion_dir, "kept", batch=3)
    assert [(s.name, s.shape, s.dtype) for s in kept.inputs] == [
        ("observation.image", (3, 2, 3, 32, 32), "float32"),
        ("observation.state", (3, 2, 2), "float32"),
        ("noise", (3, 16, 2), "float32"),
        ("steps", (), "int64"),
    ]
    assert kept.inputs[-1].value_range == (1, 100) and kept.inputs[-1].dynamic == {}
    assert [s.name for s in _spec(diffusion_dir, "unrolled").inputs] == [
        "observation.image", "observation.state", "noise"]


def test_act_adapter_matches_lerobot_predict_action_chunk(act_dir):
    spec = _spec(act_dir)
    _load_checkpoint(spec.module, act_dir)
    inputs = _inputs(spec)
    got = _adapter_actions(spec, inputs)
    want = lerobot.reference_actions(act_dir, inputs, None)
    assert got.shape == want.shape == (2, 10, 6)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("steps", [1, 4, 10])
def test_diffusion_kept_loop_matches_lerobot_generate_actions_for_runtime_steps(diffusion_dir, steps):
    spec = _spec(diffusion_dir, "kept")
    _load_checkpoint(spec.module, diffusion_dir)
    inputs = _inputs(spec)
    got = _adapter_actions(spec, inputs, steps)
    want = lerobot.reference_actions(diffusion_dir, inputs, steps)
    assert got.shape == want.shape == (2, 8, 2)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


def test_diffusion_unrolled_matches_lerobot_generate_actions_for_the_config_steps(diffusion_dir):
    spec = _spec(diffusion_dir, "unrolled")
    _load_checkpoint(spec.module, diffusion_dir)
    inputs = _inputs(spec)
    scheduler = spec.module.policy.diffusion.noise_scheduler
    table = scheduler.alphas_cumprod
    got = _adapter_actions(spec, inputs)
    want = lerobot.reference_actions(diffusion_dir, inputs, None)  # num_inference_steps = 10
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    assert scheduler.alphas_cumprod is table  # forward's in-graph table override is undone afterwards


def test_diffusion_onnx_baseline_exports_with_a_constant_table_and_matches_lerobot_in_onnx_runtime(
        diffusion_dir, tmp_path):
    # The benchmark's ONNX Runtime baseline for Diffusion Policy: LeRobot's eager sampling loop does not export,
    # the unrolled form (with its DDIM table as a constant) does, and ONNX Runtime then matches eager.
    from dsa.tools.bench.lerobot import eager_lerobot, onnx_candidates
    from dsa.tools.bench.runtimes import ort_session

    spec = _spec(diffusion_dir, "unrolled", batch=1)
    inputs = _inputs(spec)
    names = list(inputs)
    policy = lerobot.load_pretrained(diffusion_dir)
    eager = eager_lerobot(policy, names, None)
    args = [torch.from_numpy(inputs[n]) for n in names]
    with torch.no_grad():
        want = eager(*args).numpy()
    candidates = list(onnx_candidates(eager, policy, None))
    assert len(candidates) == 2
    session, feeds = ort_session(candidates[1], args, names, tmp_path / "diffusion.onnx", threads=1)
    got = session.run(None, {f: inputs[n] for f, n in zip(feeds, names)})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


# --- DDIM ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["linear", "squaredcos_cap_v2"])
@pytest.mark.parametrize("train_steps", [1, 7, 100, 1000])
def test_in_graph_alphas_cumprod_is_bit_identical_to_diffusers(schedule, train_steps):
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler

    want = DDIMScheduler(num_train_timesteps=train_steps, beta_schedule=schedule).alphas_cumprod
    got = lerobot.alphas_cumprod(train_steps, schedule, 0.0001, 0.02)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("schedule", ["linear", "squaredcos_cap_v2"])
@pytest.mark.parametrize("prediction_type,clip", [("epsilon", True), ("sample", True), ("epsilon", False)])
def test_tensor_ddim_loop_matches_diffusers_ddim_scheduler(schedule, prediction_type, clip):
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler

    train_steps = 100
    kwargs = dict(num_train_timesteps=train_steps, beta_start=0.0001, beta_end=0.02, beta_schedule=schedule,
                  clip_sample=clip, clip_sample_range=1.0, prediction_type=prediction_type)
    table = lerobot.alphas_cumprod(train_steps, schedule, 0.0001, 0.02)

    def model(x, t):  # a deterministic stand-in for the UNet
        return torch.tanh(1.7 * x + t.to(torch.float32) / 50.0) * 1.3

    noise = torch.randn(2, 16, 3, generator=torch.Generator().manual_seed(0))
    for steps in (1, 3, 10, 33, 100):
        sched = DDIMScheduler(**kwargs)
        sched.set_timesteps(steps)
        assert [int(t) for t in sched.timesteps] == lerobot.ddim_timesteps(train_steps, steps)
        want = noise.clone()
        for t in sched.timesteps:
            want = sched.step(model(want, t), t, want).prev_sample
        n = torch.tensor(steps)
        ratio = train_steps // n
        got = noise.clone()
        for i in range(steps):
            t = (n - 1 - i) * ratio
            got = lerobot.ddim_step(model(got, t), t, ratio, got, table, prediction_type=prediction_type,
                                    clip_sample=clip, clip_sample_range=1.0)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"steps={steps}")


# --- refusals --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loop", ["kept", "unrolled"])
def test_ddpm_is_refused_naming_noise_scheduler_type(diffusion_dir, loop):
    with pytest.raises(DsaError) as e:
        _spec(diffusion_dir, loop, noise_scheduler_type="DDPM")
    assert e.value.where == "config.json: noise_scheduler_type"
    assert "set noise_scheduler_type to DDIM" in str(e.value)


@pytest.mark.parametrize("policy_type", ["tdmpc", "sac", "pi0fast"])
def test_unsupported_policy_type_is_refused_naming_config_type(policy_type):
    view = {"model": {"pretrained_config": {"type": policy_type}}}
    with pytest.raises(DsaError) as e:
        lerobot.export_spec(view, {"batch": 1})
    assert e.value.where == "config.json: type"
    assert "act, diffusion" in str(e.value)


def test_unsupported_beta_schedule_is_refused_naming_it(diffusion_dir):
    with pytest.raises(DsaError) as e:
        _spec(diffusion_dir, "kept", beta_schedule="scaled_linear")
    assert "beta_schedule" in e.value.where


def test_unknown_denoising_loop_is_refused(diffusion_dir):
    with pytest.raises(DsaError) as e:
        _spec(diffusion_dir, "rolled")
    assert e.value.where == "model.denoising_loop"


def test_export_rebuilds_a_real_checkpoint_config_without_downloads(act_dir):
    # Hub checkpoints name ImageNet backbone weights and a CUDA device; the rebuild ignores both.
    spec = _spec(act_dir, pretrained_backbone_weights="ResNet18_Weights.IMAGENET1K_V1", device="cuda")
    assert spec.module.policy.config.pretrained_backbone_weights is None
    assert spec.module.policy.config.device == "cpu"


# --- SmolVLA ---------------------------------------------------------------------------------------------


def test_smolvla_init_is_byte_identical_anywhere_and_names_the_backbone_not_a_temporary_path(tmp_path):
    first, second = tmp_path / "a", tmp_path / "elsewhere" / "deeper" / "b"
    lerobot.init_policy("smolvla", SMALL_SMOLVLA, 0, first)
    lerobot.init_policy("smolvla", SMALL_SMOLVLA, 0, second)
    for directory in (first, second):
        assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    for name in lerobot.SAVED_FILES:
        assert _sha256(first / name) == _sha256(second / name), name
    saved = _config(first)
    assert saved["type"] == "smolvla" and saved["device"] == "cpu" and saved["load_vlm_weights"] is False
    assert saved["vlm_model_name"] == lerobot.smolvlm_name(SMOLVLM_SIZES)
    assert "dsa-smolvlm-" not in (first / "config.json").read_text()  # no temporary directory leaks in


def test_smolvla_backbone_keeps_smolvlm_architecture(smolvla_dir):
    spec = _spec(smolvla_dir, "kept")
    backbone = spec.module.policy.model.vlm_with_expert
    assert type(backbone.vlm).__name__ == "SmolVLMForConditionalGeneration"
    assert backbone.config.text_config.model_type == "llama"
    assert len(backbone.lm_expert.layers) == 2 and backbone.attention_mode == "cross_attn"
    assert backbone.expert_hidden_size == 48  # 0.75 x the VLM's 64


def test_smolvla_export_inputs(smolvla_dir):
    kept = _spec(smolvla_dir, "kept", batch=3)
    assert [(s.name, s.shape, s.dtype) for s in kept.inputs] == [
        ("observation.images.top", (3, 3, 24, 40), "float32"),
        ("observation.images.wrist", (3, 3, 32, 32), "float32"),
        ("observation.state", (3, 5), "float32"),
        ("observation.language.tokens", (3, 6), "int64"),
        ("observation.language.attention_mask", (3, 6), "int64"),
        ("noise", (3, 4, 8), "float32"),
        ("steps", (), "int64"),
    ]
    assert all(s.dynamic == {0: "batch"} for s in kept.inputs[:-1]) and kept.inputs[-1].value_range[0] == 1
    assert kept.inputs[3].sample_range == (0, 63)
    assert [s.name for s in _spec(smolvla_dir, "unrolled").inputs][-1] == "noise"


def _smolvla_inputs(spec, seed=1):
    inputs = _inputs(spec, seed)
    inputs["observation.language.attention_mask"][1, 4:] = 0  # a shorter prompt in the second sample
    return inputs


@pytest.mark.parametrize("steps", [1, 4, 10])
def test_smolvla_kept_loop_matches_lerobot_predict_action_chunk_for_runtime_steps(smolvla_dir, steps):
    spec = _spec(smolvla_dir, "kept")
    _load_checkpoint(spec.module, smolvla_dir)
    inputs = _smolvla_inputs(spec, seed=steps)
    got = _adapter_actions(spec, inputs, steps)
    want = lerobot.reference_actions(smolvla_dir, inputs, steps)
    assert got.shape == want.shape == (2, 4, 5)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


def test_smolvla_unrolled_matches_lerobot_predict_action_chunk_for_the_config_steps(smolvla_dir):
    spec = _spec(smolvla_dir, "unrolled")
    _load_checkpoint(spec.module, smolvla_dir)
    inputs = _smolvla_inputs(spec)
    got = _adapter_actions(spec, inputs)
    want = lerobot.reference_actions(smolvla_dir, inputs, None)  # num_steps = 10
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    different = lerobot.reference_actions(smolvla_dir, inputs, 3)
    assert float(np.abs(different - want).max()) > 1e-3  # the step count matters


@pytest.mark.parametrize("shape,size", [((2, 3, 96, 128), (48, 64)), ((1, 3, 64, 64), (64, 64)),
                                        ((2, 3, 50, 70), (64, 64)), ((1, 2, 30, 17), (64, 40))])
def test_bilinear_resize_matches_torch_interpolate(shape, size):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    want = torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False)
    torch.testing.assert_close(lerobot.bilinear_resize(x, size), want, rtol=0, atol=1e-5)


def test_smolvla_random_init_refuses_loading_vlm_weights(tmp_path):
    with pytest.raises(DsaError) as e:
        lerobot.init_policy("smolvla", dict(SMALL_SMOLVLA, load_vlm_weights=True), 0, tmp_path / "out")
    assert e.value.where == "config.load_vlm_weights"


@pytest.mark.parametrize("name", ["dsa-smolvlm:{", "dsa-smolvlm:{\"scale_factor\": 2}"])
def test_smolvla_bad_backbone_name_is_refused_naming_the_field(tmp_path, name):
    with pytest.raises(DsaError) as e:
        lerobot.init_policy("smolvla", dict(SMALL_SMOLVLA, vlm_model_name=name), 0, tmp_path / "out")
    assert e.value.where == "config.vlm_model_name"
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_smolvla_manifest_prompt_vocab_that_disagrees_is_refused(smolvla_dir):
    view = _view(_config(smolvla_dir))
    view["inputs"]["prompt"]["vocab_size"] = 1000
    with pytest.raises(DsaError) as e:
        lerobot.export_spec(view, {"batch": 1})
    assert e.value.where == "manifest: inputs.prompt.vocab_size"


# --- PI0 / PI0.5 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_type", ["pi0", "pi05"])
def test_pi_init_is_byte_identical_anywhere_and_names_the_sizes_not_a_path(tmp_path, policy_type):
    first, second = tmp_path / "a", tmp_path / "elsewhere" / "deeper" / "b"
    lerobot.init_policy(policy_type, SMALL_PI, 0, first)
    lerobot.init_policy(policy_type, SMALL_PI, 0, second)
    for directory in (first, second):
        assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    for name in lerobot.SAVED_FILES:
        assert _sha256(first / name) == _sha256(second / name), name
    saved = _config(first)
    assert saved["type"] == policy_type and saved["device"] == "cpu"
    assert saved["paligemma_variant"] == lerobot_pi.gemma_name(PI_VLM)
    assert saved["action_expert_variant"] == lerobot_pi.gemma_name(PI_EXPERT)


def test_pi_sizes_keep_the_architecture_and_pi05_expert_norms_are_adaptive(pi0_dir, pi05_dir):
    for policy_dir, adaptive in ((pi0_dir, False), (pi05_dir, True)):
        model = _spec(policy_dir).module.policy.model.paligemma_with_expert
        vlm, expert = model.paligemma.config.text_config, model.gemma_expert.config
        assert (vlm.hidden_size, vlm.num_hidden_layers, vlm.num_attention_heads,
                vlm.num_key_value_heads) == (32, 2, 8, 1)
        assert (expert.hidden_size, expert.intermediate_size, expert.head_dim) == (16, 32, 8)
        vision = model.paligemma.config.vision_config
        assert (vision.hidden_size, vision.num_hidden_layers, vision.projection_dim) == (16, 1, 32)
        norm = model.gemma_expert.model.layers[0].input_layernorm
        assert sorted(n for n, _ in norm.named_parameters()) == (["dense.bias", "dense.weight"] if adaptive
                                                                  else ["weight"])


def test_pi_export_inputs(pi0_dir, pi05_dir):
    cameras = [("observation.images.top", (3, 3, 24, 40), "float32"),
               ("observation.images.wrist", (3, 3, 28, 28), "float32")]
    prompt = [("observation.language.tokens", (3, 6), "int64"),
              ("observation.language.attention_mask", (3, 6), "int64"),
              ("noise", (3, 4, 8), "float32"), ("steps", (), "int64")]
    pi0 = _spec(pi0_dir, "kept", batch=3)
    state = [("observation.state", (3, 5), "float32")]
    assert [(s.name, s.shape, s.dtype) for s in pi0.inputs] == cameras + state + prompt
    pi05 = _spec(pi05_dir, "kept", batch=3)  # PI0.5's state is in its prompt: no state input
    assert [(s.name, s.shape, s.dtype) for s in pi05.inputs] == cameras + prompt
    assert pi05.inputs[2].sample_range == (0, PALIGEMMA_VOCAB - 1)
    assert [s.name for s in _spec(pi05_dir, "unrolled").inputs][-1] == "noise"


def _pi_dir(request, policy_type):
    return request.getfixturevalue("pi0_dir" if policy_type == "pi0" else "pi05_dir")


@pytest.mark.parametrize("policy_type,steps", [("pi0", 1), ("pi0", 4), ("pi05", 1), ("pi05", 10)])
def test_pi_kept_loop_matches_lerobot_predict_action_chunk_for_runtime_steps(request, policy_type, steps):
    policy_dir = _pi_dir(request, policy_type)
    spec = _spec(policy_dir, "kept")
    _load_checkpoint(spec.module, policy_dir)
    inputs = _smolvla_inputs(spec, seed=steps)
    got = _adapter_actions(spec, inputs, steps)
    want = lerobot.reference_actions(policy_dir, inputs, steps)
    assert got.shape == want.shape == (2, 4, 5)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("policy_type", ["pi0", "pi05"])
def test_pi_unrolled_matches_lerobot_predict_action_chunk_for_the_config_steps(request, policy_type):
    policy_dir = _pi_dir(request, policy_type)
    spec = _spec(policy_dir, "unrolled")
    _load_checkpoint(spec.module, policy_dir)
    inputs = _smolvla_inputs(spec)
    got = _adapter_actions(spec, inputs)
    want = lerobot.reference_actions(policy_dir, inputs, None)  # num_inference_steps = 10
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    assert float(np.abs(lerobot.reference_actions(policy_dir, inputs, 3) - want).max()) > 1e-3


def test_pi_prefix_cache_is_read_only_so_denoise_steps_repeat(pi0_dir):
    policy = lerobot.load_pretrained(pi0_dir)
    inputs = _smolvla_inputs(_spec(pi0_dir, "kept"))
    batch = lerobot.pi.make_batch(policy.config, [torch.from_numpy(inputs[k]) for k in (
        "observation.images.top", "observation.images.wrist", "observation.state")],
        torch.from_numpy(inputs["observation.language.tokens"]),
        torch.from_numpy(inputs["observation.language.attention_mask"]))
    model = policy.model
    images, img_masks = policy._preprocess_images(batch)
    with torch.no_grad():
        embs, pad, att = model.embed_prefix(images, img_masks, batch["observation.language.tokens"],
                                            batch["observation.language.attention_mask"])
        from lerobot.policies.pi0.modeling_pi0 import make_att_2d_masks

        _, cache = model.paligemma_with_expert.forward(
            attention_mask=model._prepare_attention_masks_4d(make_att_2d_masks(pad, att)),
            position_ids=torch.cumsum(pad, dim=1) - 1, past_key_values=None, inputs_embeds=[embs, None],
            use_cache=True)
        length = cache.get_seq_length()
        args = dict(state=policy.prepare_state(batch), prefix_pad_masks=pad, past_key_values=cache,
                    x_t=torch.from_numpy(inputs["noise"]), timestep=torch.full((2,), 0.7))
        first, second = model.denoise_step(**args), model.denoise_step(**args)
    assert cache.get_seq_length() == length == pad.shape[1]
    assert torch.equal(first, second)


@pytest.mark.parametrize("field,name", [
    ("paligemma_variant", "dsa-gemma:{"),
    ("paligemma_variant", lerobot_pi.gemma_name(PI_EXPERT)),  # the PaliGemma variant needs its vision sizes
    ("action_expert_variant", lerobot_pi.gemma_name(dict(PI_EXPERT, width=0))),
    ("action_expert_variant", "gemma_300m"),  # one hermetic name and one of LeRobot's
])
def test_pi_bad_variant_names_are_refused_naming_the_field(tmp_path, field, name):
    with pytest.raises(DsaError) as e:
        lerobot.init_policy("pi0", dict(SMALL_PI, **{field: name}), 0, tmp_path / "out")
    assert e.value.where.startswith(f"config.{field}")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_pi_lerobot_names_still_go_to_lerobots_lookup():
    _, policy_cls = lerobot.policy_classes("pi0", "type")
    modeling = __import__(policy_cls.__module__, fromlist=["get_gemma_config"])
    config = modeling.get_gemma_config("gemma_300m")
    assert (config.width, config.depth, config.head_dim) == (1024, 18, 256)
    with pytest.raises(ValueError, match="Unknown variant"):
        modeling.get_gemma_config("gemma_7b")


def test_pi_manifest_prompt_vocab_and_bfloat16_are_refused(pi05_dir):
    view = _view(_config(pi05_dir))
    view["inputs"]["prompt"]["vocab_size"] = 1024
    with pytest.raises(DsaError) as e:
        lerobot.export_spec(view, {"batch": 1})
    assert e.value.where == "manifest: inputs.prompt.vocab_size"
    with pytest.raises(DsaError) as e:
        _spec(pi05_dir, dtype="bfloat16")
    assert e.value.where == "config.json: dtype"


def test_pi05_manifest_state_dim_is_checked_against_config_json(pi05_dir):
    view = _view(_config(pi05_dir))
    view["inputs"]["state"]["dim"] = 7
    with pytest.raises(DsaError) as e:
        lerobot.export_spec(view, {"batch": 1})
    assert e.value.where == "manifest: inputs.state.dim"


def test_pi_patch_refuses_other_transformers_versions(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.53.2")
    with pytest.raises(DsaError, match="transformers 4.57.6 and lerobot 0.4.4; found transformers 4.53.2"):
        lerobot_pi.check_versions()


def test_smolvla_outputs_are_the_same_before_and_after_the_pi_patch(smolvla_dir):
    """A fresh interpreter: SmolVLA's eager actions, then the PI patch, then SmolVLA built again."""
    script = (
        "import sys, numpy as np\n"
        "import dsa.frontends.lerobot as lerobot\n"
        "from dsa.frontends.lerobot.third_party import openpi_transformers as lerobot_pi\n"
        "d = sys.argv[1]; rng = np.random.default_rng(0)\n"
        "x = {'observation.images.top': rng.random((1, 3, 24, 40), dtype=np.float32),\n"
        "     'observation.images.wrist': rng.random((1, 3, 32, 32), dtype=np.float32),\n"
        "     'observation.state': rng.standard_normal((1, 5), dtype=np.float32),\n"
        "     'observation.language.tokens': rng.integers(0, 64, (1, 6)),\n"
        "     'observation.language.attention_mask': np.ones((1, 6), dtype=np.int64),\n"
        "     'noise': rng.standard_normal((1, 4, 8), dtype=np.float32)}\n"
        "before = lerobot.reference_actions(d, x, 3)\n"
        "assert not lerobot_pi._applied\n"
        "lerobot_pi.apply()\n"
        "after = lerobot.reference_actions(d, x, 3)\n"
        "print('max|diff|', float(np.abs(before - after).max()))\n"
        "assert np.array_equal(before, after)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", script, str(smolvla_dir)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_entry_point_of_1x_manifests_still_loads_the_lerobot_front_end():
    """A 1.x manifest names `dsa.lerobot:export_spec` (the front end before the package was layered): it loads
    the current front end's function, not a refusal that leaves the user to guess the new name."""
    from dsa.stages.export import load_entry_point, model_source_files

    assert load_entry_point("dsa.lerobot:export_spec") is load_entry_point("dsa.frontends.lerobot:export_spec")
    assert model_source_files("dsa.lerobot:export_spec", []) == []  # the rule set's own code, not model sources


def test_dsa_lerobot_init_writes_a_policy_directory(tmp_path):
    """The command `bin/dsa --help` shows (`dsa lerobot init`) is the rules' generator: config.json +
    model.safetensors."""
    from dsa.tools.testing import runfile

    proc = subprocess.run([sys.executable, "-m", "dsa", "lerobot", "init", "--type", "act", "--config-json",
                           json.dumps(SMALL_ACT), "--out-dir", str(tmp_path / "act")],
                          capture_output=True, text=True, cwd=runfile("."),
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "act").iterdir()) == ["config.json", "model.safetensors"]


def test_a_verified_pi0_load_prints_nothing_and_a_failed_one_shows_lerobots_account(pi0_dir, tmp_path, capsys):
    """PI0's from_pretrained prints its key remapping ("Could not remap state dict keys ...") even when the
    load is complete: that chatter is held back when check_loaded verifies every tensor, and shown, with the
    refusal, when it does not."""
    import shutil

    from safetensors.torch import load_file, save_file

    lerobot.load_pretrained(pi0_dir)
    assert capsys.readouterr().out == ""
    broken = tmp_path / "broken"
    shutil.copytree(pi0_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros_like(tensors[name]) + 1.0  # a tensor LeRobot loads but that is not the file's
    tensors["not.a.policy.tensor"] = torch.zeros(1)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(Exception):
        lerobot.load_pretrained(broken)
    assert capsys.readouterr().out != ""
