"""SmolVLA at its real size (SmolVLM2-500M dimensions, two 480×640 cameras, 48-token prompt, chunk 50): the
compiled module matches eager LeRobot on one observation at the default 10 flow-matching steps, within the
tolerance of the small SmolVLA (models/vla_loop_checks.py; measured 1.1e-4 on actions of magnitude ~4), and
the export is the full-size model, not a small one. The x86-64-v4 build (//models:smolvla_full_x86_64-v4)
is checked the same way where this CPU runs it: its vision tower needs a stack limit over the compiler's
default, so its index asks the runner for a bigger task-worker stack, which the runtime sets.
"""

import json
import os
import subprocess
import sys

import pytest

from dsa.core.fileio import read_json
from dsa.core.runtime_flags import merge_runtime_flags
from dsa.runtime import iree_flags
from dsa.runtime.host import runs_here
from dsa.runtime.policy import CompiledPolicy, ModuleIndex, builds_of
from dsa.tools.testing import runfile
from models.vla_loop_checks import MASK, check_kept_loop_matches_eager

POLICY_DIR = runfile("models/smolvla_full_policy/config.json").parent
RECORD = runfile("models/smolvla_full_model/export_record.json")
INDEX = runfile("models/smolvla_full.modules.json")
BUILDS = builds_of(INDEX)  # x86_64-v3 and its level x86_64-v4 (//models:smolvla_full_x86_64-v4)
RUNNABLE = [t for t, index in BUILDS.items()
            if runs_here(read_json(index.parent / ModuleIndex.read(index).target_spec))]
# Both builds share this process's IREE runtime: it is set up once, for the one that needs the most.
iree_flags.require(merge_runtime_flags(ModuleIndex.read(BUILDS[t]).runtime_flags for t in RUNNABLE), __file__)


@pytest.fixture(scope="module", params=RUNNABLE)
def kept(request):
    return CompiledPolicy(INDEX, target=request.param)


def test_full_size_module_matches_eager_lerobot_at_ten_steps(kept):
    check_kept_loop_matches_eager(kept, POLICY_DIR, batch=1, steps=10, prompt=20, chunk=(50, 6))


def test_the_avx512_build_asks_its_runner_for_the_worker_stack_its_tuning_requires():
    index = ModuleIndex.read(BUILDS["x86_64-v4"])
    tuning = read_json(runfile("toolchains/tuning/flow_vla_full.x86_64-v4.json"))
    assert tuning["runtime_flags"] and list(index.runtime_flags) == tuning["runtime_flags"]
    assert "--iree-llvmcpu-stack-allocation-limit=262144" in tuning["flags"]
    # The portable build needs nothing of its runner.
    assert ModuleIndex.read(BUILDS["x86_64-v3"]).runtime_flags == ()


def test_inputs_are_two_480x640_cameras_state_a_48_token_prompt_and_noise():
    record = json.loads(RECORD.read_text())
    assert [(s["name"], s["shape"]) for s in record["inputs"]] == [
        ("observation.images.top", ["batch", 3, 480, 640]),
        ("observation.images.wrist", ["batch", 3, 480, 640]),
        ("observation.state", ["batch", 6]),
        ("observation.language.tokens", ["batch", 48]),
        (MASK, ["batch", 48]),
        ("noise", ["batch", 50, 32]),
        ("steps", []),
    ]


def test_the_export_holds_the_full_size_weights():
    """SmolVLM2-500M's vision encoder (~86M), 16 text layers and embeddings (~200M) and the action expert:
    ~400M parameters in use (the LM head and final norm are never read)."""
    record = json.loads(RECORD.read_text())
    assert 390e6 <= record["parameter_count"] <= 420e6, record["parameter_count"]
    config = json.loads((POLICY_DIR / "config.json").read_text())
    assert config["num_vlm_layers"] == 16 and config["resize_imgs_with_padding"] == [512, 512]


_RUN_TWO_STEPS = """
import sys
import numpy as np
from dsa.runtime import iree_flags
if sys.argv[2] == "ignore-runtime-flags":
    iree_flags.require = lambda flags, where: None
from dsa.runtime.policy import CompiledPolicy, sample_inputs
policy = CompiledPolicy(sys.argv[1])
inputs = sample_inputs(policy.modules[0].record, {"batch": 1}, np.random.default_rng(0))
inputs["steps"] = np.array(2, dtype=np.int64)
print("actions", np.asarray(policy.run(inputs)[0][0]).shape)
"""


@pytest.mark.skipif("x86_64-v4" not in RUNNABLE, reason="this CPU cannot run the x86-64-v4 build")
def test_the_worker_stack_the_avx512_builds_index_asks_for_is_what_lets_it_run():
    """In fresh processes: with the index's runtime flags the module runs; with them ignored, IREE's default
    128 KiB worker stack overflows and the process dies (SIGSEGV), which is why the index carries them."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    runs = {mode: subprocess.run([sys.executable, "-c", _RUN_TWO_STEPS, str(BUILDS["x86_64-v4"]), mode],
                                 capture_output=True, text=True, env=env, timeout=600)
            for mode in ("as-built", "ignore-runtime-flags")}
    assert runs["as-built"].returncode == 0 and "actions (1, 50, 6)" in runs["as-built"].stdout, runs["as-built"].stderr
    assert runs["ignore-runtime-flags"].returncode < 0, runs["ignore-runtime-flags"]
