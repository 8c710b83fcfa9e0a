"""The measured child processes: a stage, the runtime, eager, the parameter count and the old design's export,
each in a process of its own so that its peak memory is its own."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError
from dsa.tools.scale.memory import own_vmhwm_kib
from dsa.tools.scale.subjects import checkpoint_elements


# -- measured children ------------------------------------------------------------------------------------
def child_env(root: Path, pythonpath: Sequence[str]) -> dict:
    paths = [str(root)] + [str(p) for p in pythonpath]
    extra = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(paths + ([extra] if extra else []))))


def _tail(text: str, lines: int = 12) -> str:
    kept = [l for l in text.strip().splitlines() if l.strip()]
    return "\n".join(kept[-lines:])


def failure_cause(stderr: str) -> str:
    """The line of a failed command's stderr that says why: its last error line, else its last line."""
    kept = [l.strip() for l in stderr.strip().splitlines() if l.strip()]
    errors = [l for l in kept if "error" in l.lower()]
    return ((errors or kept or ["no message"])[-1])[:500]


def run_stage(cmd: List[str], env: dict, what: str) -> dict:
    """A measured command (dsa.tools.measure.run_measured: wall time, wait4 peak RSS); DsaError on failure."""
    from dsa.tools.measure import run_measured

    result = run_measured(cmd, env=env)
    if result["returncode"] != 0:
        code = result["returncode"]
        why = f"was killed by signal {-code}" + (" (SIGKILL: out of memory?)" if code == -9 else "") if code < 0 \
            else f"exited with {code}"
        raise DsaError(what, f"{why}: {failure_cause(result['stderr'])}", f"reproduce with: {shlex.join(cmd)}")
    return result


def run_child(cmd: List[str], env: dict, result: Path, what: str) -> dict:
    """A child that writes its own measurement (JSON) to `result`."""
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0 or not result.is_file():
        why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        raise DsaError(what, f"failed ({why}): {failure_cause(proc.stderr)}", f"reproduce with: {shlex.join(cmd)}")
    return json.loads(result.read_text())


def eager_weight_bytes(record: dict, checkpoint_elements: int) -> int:
    """What the eager reference's weights take: float32 for every tensor, or, for a weight-quantised model
    (its export record's `quantization`), the quantised reference's integers and scales
    (dsa.tools.testing.quantised_eager_policy) beside float32 for the rest."""
    if record.get("quantization"):
        from dsa.tools.testing import quantised_eager_bytes

        return quantised_eager_bytes(record, checkpoint_elements)
    return checkpoint_elements * 4


def _timed_calls(call: Callable[[], object], runs: int) -> Tuple[float, List[float], object]:
    start = time.perf_counter()
    out = call()
    first = (time.perf_counter() - start) * 1e3
    calls = []
    for _ in range(runs):
        start = time.perf_counter()
        out = call()
        calls.append((time.perf_counter() - start) * 1e3)
    return first, calls, out


def _timing(load_s: float, first_ms: float, calls: List[float], threads: int, described: str) -> dict:
    return {"load_s": round(load_s, 3), "first_call_ms": round(first_ms, 3),
            "median_ms": round(statistics.median(calls), 3) if calls else None,
            "calls_ms": [round(c, 3) for c in calls], "runs": len(calls), "threads": threads, "inputs": described,
            "vmhwm_kib": own_vmhwm_kib()}


def runtime_child(index: Path, runs: int, threads: int, result: Path, output: Path) -> None:
    """In a process of its own (no torch): the module index at batch 1 on the sample inputs."""
    import numpy as np

    from dsa.runtime import iree_flags
    from dsa.runtime.policy import CompiledPolicy
    from dsa.tools.import_matrix import sample_values

    iree_flags.set_task_threads(threads)
    start = time.perf_counter()
    policy = CompiledPolicy(index)
    load_s = time.perf_counter() - start
    module = policy.modules[0]
    values, described = sample_values(module.record, policy.runtime_view.get("flow_steps"))
    first, calls, out = _timed_calls(lambda: policy.run(values)[0][0], runs)
    np.save(output, np.asarray(out))
    data = _timing(load_s, first, calls, threads, described or "static shapes")
    data["module"] = module.vmfb.name
    result.write_text(json.dumps(data))


def eager_child(framework: str, record_path: Path, flow_steps: Optional[int], runs: int, threads: int,
                result: Path, output: Path, *, policy_dir: Optional[Path] = None, view: Optional[Path] = None,
                checkpoint: Optional[Path] = None) -> None:
    """In a process of its own, in the subject's environment: the eager model on the runtime's inputs."""
    import numpy as np
    import torch

    from dsa.core.fileio import read_json
    from dsa.tools.import_matrix import sample_sizes, sample_values

    torch.set_num_threads(threads)
    record = read_json(record_path)
    values, described = sample_values(record, flow_steps)
    start = time.perf_counter()
    if framework == "lerobot":
        from dsa.frontends.lerobot import load_pretrained_mapped, reference_actions

        policy = load_pretrained_mapped(policy_dir)
        load_s = time.perf_counter() - start
        steps = int(values["steps"]) if "steps" in values else None
        observation = {k: v for k, v in values.items() if k != "steps"}

        def call():
            return reference_actions(policy, observation, steps)
    else:
        from dsa.tools.testing import eager_policy, quantised_eager_policy

        dims = sample_sizes(record)
        if record.get("bucket"):
            dims[record["bucket"]["dim"]] = record["bucket"]["size"]
        if record.get("quantization"):
            # The same quantised weights as the module (its float32 weights may not fit: OpenVLA-7B's are 30 GB).
            module, spec = quantised_eager_policy(read_json(view), record, Path(checkpoint), dims)
        else:
            module, spec = eager_policy(read_json(view), dims, checkpoint)
        load_s = time.perf_counter() - start
        args = [torch.from_numpy(np.asarray(values[s.name])) for s in spec.inputs]

        def call():
            with torch.no_grad():
                out = module(*args)
            return (out[0] if isinstance(out, (tuple, list)) else out).numpy()
    first, calls, out = _timed_calls(call, runs)
    np.save(output, np.asarray(out))
    result.write_text(json.dumps(_timing(load_s, first, calls, threads, described or "static shapes")))


def count_child(framework: str, view: Path, result: Path, *, config: Optional[Path] = None,
                pythonpath: Sequence[str] = ()) -> None:
    """The stand-in's size before it is made: its tensors' element count (the model built without weights)."""
    import torch

    from dsa.core.fileio import read_json
    from dsa.stages.weightless import without_weights

    if framework == "lerobot":
        from dsa.frontends.lerobot import policy_from_config

        with torch.no_grad(), without_weights():
            model = policy_from_config(json.loads(Path(config).read_text()), str(config))
        tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()  # tied: once
    else:
        from dsa.stages.export import NominalDims, load_entry_point

        with without_weights():
            model = load_entry_point(read_json(view)["model"]["entry_point"], list(pythonpath))(read_json(view),
                                                                                                NominalDims()).module
        tensors = model.state_dict(keep_vars=True).values()
    result.write_text(json.dumps({"elements": int(sum(t.numel() for t in tensors))}))


def old_export_child(view: Path, out_dir: Path, policy_config: Optional[Path], pythonpath: Sequence[str]) -> None:
    """The export as it was before weightless building: the model built with its (random) weights."""
    from dsa.core.fileio import read_json
    from dsa.stages.export import export_model

    export_model(read_json(view), out_dir / "model.mlir", out_dir / "export_record.json", pythonpath=list(pythonpath),
                 manifest_name="old design", policy_config=policy_config, weightless=False)
