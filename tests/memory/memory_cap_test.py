"""A model whose weights are twice the memory its build actions get is built anyway: 2 GiB of float32 weights
(32 layers of 4096 x 4096), each stage — the seeded checkpoint, the export, the parameter archive, the compile —
run as its Bazel action runs it (`python -m dsa.stages.<stage>`, one process) in a memory cgroup capped at
1 GiB, the way a CI runner or a container bounds a build. Every stage must finish without the kernel's OOM
killer, and the module must then compute what eager PyTorch computes. It would fail again if any stage went
back to holding the whole model (the controls below show the cap kills exactly that)."""

import atexit  # noqa: F401 (used by the launcher text)
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dsa.core.fileio import sha256_file, write_json_atomic
from dsa.manifest.contract import load_manifest, project
from dsa.tools.testing import runfile

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cgroup  # noqa: E402

CAP = 1 << 30  # bytes each stage may use: the weights are twice that
WIDTH, LAYERS = 4096, 32
ROOT = Path(os.path.abspath(runfile("dsa/__init__.py"))).parents[1]  # the runfiles tree (or the checkout)

MANIFEST = """\
schema_version: "1.7.0"
model_id: big_mlp
framework: pytorch
model:
  entry_point: big_mlp:export_spec
  config: {{width: {width}, layers: {layers}}}
checkpoint:
  path: big_mlp.safetensors
  sha256: "{sha256}"
inputs:
  state: {{dim: {width}}}
  cameras: []
outputs:
  action: {{dim: {width}}}
chunk_size: 1
n_action_steps: 1
flow_steps: 1
buckets: {{}}
quant_scheme: {{kind: none}}
targets: [x86_64-v3]
power_profile: balanced
"""

# Runs a stage module as its action does, then prints its own peak resident memory (VmHWM, kiB).
LAUNCHER = textwrap.dedent("""
    import atexit, runpy, sys
    def report():
        with open("/proc/self/status") as f:
            hwm = [l.split()[1] for l in f if l.startswith("VmHWM")][0]
        sys.stderr.write(f"\\nVmHWM_KIB={hwm}\\n")
    atexit.register(report)
    module = sys.argv[1]
    sys.argv = [module] + sys.argv[2:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
""")


def _stage(cap, module, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]), OMP_NUM_THREADS="1")
    proc = cap.run([sys.executable, "-c", LAUNCHER, module, *map(str, args)], env=env, timeout=1800)
    hwm = [line for line in proc.stderr.splitlines() if line.startswith("VmHWM_KIB=")]
    return proc, int(hwm[-1].split("=")[1]) * 1024 if hwm else None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    why = cgroup.available()
    if why:
        pytest.fail(f"this test caps memory with a cgroup and cannot here: {why} (run as root, or in a "
                    "container with a delegated memory cgroup)")
    out = tmp_path_factory.mktemp("big")
    manifest = out / "big_mlp.yaml"
    manifest.write_text(MANIFEST.format(width=WIDTH, layers=LAYERS, sha256="0" * 64))
    write_json_atomic(out / "export_view.json", project(load_manifest(manifest), "export"))
    stages = {}
    with cgroup.MemoryCap(CAP) as cap:
        stages["checkpoint"] = _stage(cap, "dsa.stages.checkpoint", "--view", out / "export_view.json",
                                      "--pythonpath", HERE, "--out", out / "big_mlp.safetensors")
    assert stages["checkpoint"][0].returncode == 0, stages["checkpoint"][0].stderr[-3000:]
    manifest.write_text(MANIFEST.format(width=WIDTH, layers=LAYERS, sha256=sha256_file(out / "big_mlp.safetensors")))
    loaded = load_manifest(manifest)
    write_json_atomic(out / "params_view.json", project(loaded, "params"))
    write_json_atomic(out / "compile_view.json", project(loaded, "compile", target="x86_64-v3"))
    caps = {}
    for name, module, args in [
        ("export", "dsa.stages.export", ["--view", out / "export_view.json", "--pythonpath", HERE,
                                         "--out-mlir", out / "model.mlir", "--out-record", out / "record.json"]),
        ("params", "dsa.stages.params", ["--checkpoint", out / "big_mlp.safetensors", "--view",
                                         out / "params_view.json", "--record", out / "record.json",
                                         "--out", out / "params.irpa"]),
        ("compile", "dsa.stages.compile", ["--mlir", out / "model.mlir", "--view", out / "compile_view.json",
                                           "--target", runfile("toolchains/targets/x86_64-v3.json"),
                                           "--out", out / "model.vmfb", "--report", out / "report.json"]),
    ]:
        with cgroup.MemoryCap(CAP) as cap:
            stages[name] = _stage(cap, module, *args)
            caps[name] = (cap.oom_killed(), cap.peak_bytes())
    return out, stages, caps


def test_the_weights_are_twice_the_cap(built):
    out, _, _ = built
    record = json.loads((out / "record.json").read_text())
    assert record["parameter_count"] * 4 >= 2 * CAP
    assert (out / "big_mlp.safetensors").stat().st_size >= 2 * CAP
    assert (out / "params.irpa").stat().st_size >= 2 * CAP


@pytest.mark.parametrize("stage", ["checkpoint", "export", "params", "compile"])
def test_each_stage_succeeds_under_a_cap_of_half_the_weights(built, stage):
    _, stages, caps = built
    proc, hwm = stages[stage]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hwm is not None and hwm < CAP, (stage, hwm)
    if stage in caps:
        assert not caps[stage][0], f"{stage}: the kernel's OOM killer ran in its cgroup"


def test_the_capped_build_computes_what_eager_pytorch_computes(built):
    import iree.runtime as rt
    import torch

    from dsa.tools.testing import eager_policy

    out, _, _ = built
    x = np.random.default_rng(0).standard_normal((1, WIDTH)).astype(np.float32)
    index = rt.ParameterIndex()
    index.load(str(out / "params.irpa"))
    config = rt.Config("local-task")
    context = rt.SystemContext(vm_modules=[
        rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope="model")),
        rt.create_hal_module(config.vm_instance, config.device),
        rt.VmModule.copy_buffer(config.vm_instance, (out / "model.vmfb").read_bytes())], config=config)
    got = context.modules.module["main"](x).to_host()
    del context, index
    view = json.loads((out / "export_view.json").read_text())
    sys.path.insert(0, str(HERE))
    module, _ = eager_policy(view, {}, out / "big_mlp.safetensors")
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    assert np.abs(got - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())


def test_the_cap_kills_a_process_that_holds_more_than_it(tmp_path):
    """The control: memory the process touches is charged and refused — the cap is real."""
    with cgroup.MemoryCap(CAP) as cap:
        proc = cap.run([sys.executable, "-c", "import numpy as np; a = np.ones(3 << 29, dtype=np.uint8); "
                        "print(int(a.sum()))"], timeout=300)
        assert proc.returncode != 0 and cap.oom_killed()


def test_the_export_as_it_was_holding_every_weight_is_killed_by_the_cap(built):
    """The regression this test guards against: the export building the model with its weights (as rules_dsa
    did before dsa.stages.weightless) does not fit under the cap."""
    out, _, _ = built
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(HERE)!r})
        from dsa.stages.export import export_model
        view = json.load(open({str(out / 'export_view.json')!r}))
        export_model(view, {str(out / 'old.mlir')!r}, {str(out / 'old.json')!r}, pythonpath=[{str(HERE)!r}],
                     weightless=False)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]), OMP_NUM_THREADS="1")
    with cgroup.MemoryCap(CAP) as cap:
        proc = cap.run([sys.executable, "-c", code], env=env, timeout=1800)
        assert proc.returncode != 0 and cap.oom_killed(), proc.stderr[-2000:]
    assert not (out / "old.mlir").exists()
