"""Checks shared by the tests of LeRobot's VLA policies whose flow-matching loop is kept a loop (SmolVLA, PI0,
PI0.5): the compiled module against eager LeRobot at runtime step counts with padded prompts, and the step
count being a runtime input of one module.

Tolerance: |vmfb - eager| <= 1e-4 * max(1, max|eager|). Both sides run fp32, but IREE reorders the
reductions of the vision encoder, the VLM and the action expert, demotes the float64 sinusoidal time
embedding to float32, and the exported image resize is `dsa.frontends.lerobot.bilinear_resize` (<= 3e-6 from ATen's
kernel); measured <= 3e-5 absolute on actions of magnitude ~3. A wrong step count, a wrong time or a wrong
weight moves actions by O(0.1-1).
"""

import numpy as np

from dsa.frontends.lerobot import reference_actions
from dsa.runtime.policy import sample_inputs

REL_TOL = 1e-4
MASK = "observation.language.attention_mask"


def observation(record, batch, seed, steps=None, prompt=None):
    """A sample observation; `prompt` real tokens, the rest of the tokenizer_max_length padding (mask 0)."""
    inputs = sample_inputs(record, {"batch": batch}, np.random.default_rng(seed))
    if prompt is not None:
        inputs[MASK][:, prompt:] = 0
    if steps is not None:
        inputs["steps"] = np.array(steps, dtype=np.int64)
    return inputs


def assert_close(actions, expected):
    assert actions.shape == expected.shape
    err = float(np.abs(actions - expected).max())
    assert err <= REL_TOL * max(1.0, float(np.abs(expected).max())), err


def check_kept_loop_matches_eager(policy, policy_dir, batch, steps, prompt, chunk):
    """The compiled module at `steps` runtime steps equals LeRobot's own inference on the same inputs."""
    inputs = observation(policy.modules[0].record, batch, seed=steps, steps=steps, prompt=prompt)
    (actions,), _ = policy.run(inputs)
    assert actions.shape == (batch,) + tuple(chunk)
    assert_close(actions, reference_actions(policy_dir, inputs, steps))


def check_step_count_is_a_runtime_input(policy):
    """One module per batch bucket and none per step count; its int64 `steps` input changes the actions (the
    count is not baked in)."""
    record = policy.modules[0].record
    assert set(policy.buckets()) <= {"batch"}
    assert len(policy.modules) == max(1, len(policy.buckets().get("batch", [])))
    steps = next(s for s in record["inputs"] if s["name"] == "steps")
    assert steps["shape"] == [] and steps["value_range"][0] == 1
    base = observation(record, 1, seed=7)
    outputs = [policy.run(dict(base, steps=np.array(n, dtype=np.int64)))[0][0] for n in (2, 5)]
    assert float(np.abs(outputs[0] - outputs[1]).max()) > 1e-3


def check_real_size_matches_eager(builds, policy_dir, steps=(1, 10), prompt=20, seed=3):
    """Real-size VLAs (pi0_full, pi05_full): every compiled build in `builds` (module indexes this machine
    runs) at each of `steps` equals LeRobot's own policy on the same observation. Memory decides the order:
    each compiled policy runs and is released before the next, then LeRobot's policy is loaded once
    (`load_pretrained_mapped`: no random initialisation, one copy of the weights, widened to float32 — the
    weights the compiled modules widen from the same bf16 archive) for the references. Returns the largest
    error relative to max(1, max|eager|) per build."""
    import gc

    from dsa.frontends.lerobot import load_pretrained_mapped
    from dsa.runtime.policy import CompiledPolicy, ModuleIndex

    got = {}
    inputs = None
    for build in builds:
        policy = CompiledPolicy(build, target=ModuleIndex.read(build).target)  # this build, not its levels
        record = policy.modules[0].record
        if inputs is None:
            base = observation(record, 1, seed=seed, prompt=prompt)
            inputs = {n: dict(base, steps=np.array(n, dtype=np.int64)) for n in steps}
        got[build] = {n: policy.run(inputs[n])[0][0] for n in steps}
        del policy
        gc.collect()
    eager = load_pretrained_mapped(policy_dir)
    expected = {n: reference_actions(eager, inputs[n], n) for n in steps}
    del eager
    gc.collect()
    errors = {}
    for build, outputs in got.items():
        for n in steps:
            assert_close(outputs[n], expected[n])
        errors[build] = max(float(np.abs(outputs[n] - expected[n]).max()) / max(1.0, float(np.abs(expected[n]).max()))
                            for n in steps)
    assert float(np.abs(expected[steps[0]] - expected[steps[-1]]).max()) > 1e-3  # the step count reaches the loop
    return errors
