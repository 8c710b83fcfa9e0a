"""π0: the compiled modules match eager PyTorch, and the flow loop survives compilation as a loop.

Tolerance: |vmfb - eager| <= 2e-4 * max(1, max|eager|), elementwise max. Both sides run fp32; IREE fuses and
reorders the reductions of ~30 layers (matmul, softmax, layer norm) and the integration adds up to 10
velocity evaluations, so results differ by rounding: measured ~1.5e-5 relative on x86-64-v3. The bound
leaves 10x headroom for other CPUs' vector widths while a real defect (a wrong mask, a missed step, a
transposed weight) moves the actions by O(1).
"""

import numpy as np
import pytest
import torch

from dsa.stages.compile import compile_to_phase
from dsa.core.fileio import read_json
from dsa.manifest.contract import load_manifest, project
from dsa.runtime.policy import CompiledPolicy, sample_inputs
from dsa.tools.testing import eager_policy, runfile

MANIFEST = runfile("manifests/pi0.yaml")
INDEX = runfile("models/pi0.modules.json")
CHECKPOINT = runfile("models/pi0.safetensors")
REL_TOL = 2e-4


@pytest.fixture(scope="module")
def manifest():
    return load_manifest(MANIFEST)


@pytest.fixture(scope="module")
def policy():
    return CompiledPolicy(INDEX)


def observation(record, prompt_len, steps, seed):
    values = sample_inputs(record, {"prompt_len": prompt_len}, np.random.default_rng(seed))
    values["steps"] = np.array(steps, dtype=np.int64)
    return values


@pytest.mark.parametrize("steps", [1, 5, 10])
@pytest.mark.parametrize("slot", [0, 1, 2])
def test_vmfb_matches_eager_for_each_bucket_and_flow_steps(manifest, policy, slot, steps):
    bucket = manifest["buckets"]["prompt_len"][slot]
    # A prompt shorter than the bucket (padded and masked by the runner) and one that fills it.
    for prompt_len in (bucket - 5, bucket):
        obs = observation(policy.modules[0].record, prompt_len, steps, seed=slot * 100 + prompt_len)
        (actions,), module = policy.run(obs)
        assert module.bucket == {"dim": "prompt_len", "size": bucket, "slot": slot}
        eager, spec = eager_policy(project(manifest, "export"), {"prompt_len": prompt_len}, CHECKPOINT)
        with torch.no_grad():
            expected = eager(*[torch.from_numpy(np.asarray(obs[s.name])) for s in spec.inputs]).numpy()
        assert actions.shape == expected.shape == (1, manifest["chunk_size"], manifest["outputs"]["action"]["dim"])
        err = float(np.abs(actions - expected).max())
        assert err <= REL_TOL * max(1.0, float(np.abs(expected).max())), (prompt_len, steps, err)


def test_flow_steps_is_a_runtime_input_of_one_module(policy):
    """The same module gives different action chunks for 1, 5 and 10 steps: steps are not baked in."""
    chunks = {}
    for steps in (1, 5, 10):
        (actions,), module = policy.run(observation(policy.modules[0].record, 20, steps, seed=7))
        chunks[steps] = (actions, module.vmfb)
    assert len({str(vmfb) for _, vmfb in chunks.values()}) == 1
    assert not np.allclose(chunks[1][0], chunks[10][0])
    assert not np.allclose(chunks[5][0], chunks[10][0])


def test_compiled_ir_keeps_one_flow_loop(manifest, policy):
    """After IREE's flow phase the integration is still one scf.while whose body holds the action
    expert's dispatches once: the dispatch count is that of one step, whatever `steps` is at run time."""
    index = read_json(INDEX)
    target = read_json(INDEX.parent / index["target_spec"])
    mlir = runfile("models/pi0_buckets/prompt_len_0.mlir")
    report = read_json(runfile("models/pi0/prompt_len_0.compile_report.json"))
    # The build's own tuning (recorded in its compile report), so the dispatch counts are comparable.
    tuning = report["tuning"] and dict(report["tuning"], format=1, target=target["name"])
    flow = compile_to_phase(mlir, project(manifest, "compile", target=target["name"]), target, "flow",
                            tuning=tuning)
    assert flow.count("scf.while") == 1
    loop_body = flow[flow.index("scf.while"):]
    in_loop = loop_body.count("flow.dispatch @")
    total = flow.count("flow.dispatch @")
    expert_layers = manifest["model"]["config"]["expert_depth"]
    assert in_loop >= expert_layers  # the expert's layers run inside the loop ...
    assert total - in_loop > in_loop  # ... and the prefix (vision + language) runs once, outside it
    # The build's count is per step too; data tiling adds its layout-encoding dispatches after the flow
    # phase, so it is at least the flow phase's count (and bounded: nothing unrolled).
    assert total <= report["dispatch_count"] < 2 * total


def test_prompt_longer_than_largest_bucket_is_refused(policy):
    from dsa.core.errors import DsaError

    with pytest.raises(DsaError, match=r"prompt_len is 129, longer than the largest bucket \(128"):
        policy.run(observation(policy.modules[0].record, 129, 1, seed=0))
