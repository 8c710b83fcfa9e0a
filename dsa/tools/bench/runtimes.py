"""The runtimes a benchmark times, ready to call: a built vmfb through iree.runtime (`Built`, `IreeModule`),
ONNX Runtime on torch's ONNX export (`ort_session`), and where the other environments are (ExecuTorch in this
process, an interpreter in the runfiles). Shared by subjects.py, lerobot.py, quant.py and the tuner."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np


@dataclasses.dataclass
class Built:
    """A compiled module to time: its vmfb, export record (function, inputs, parameter scope) and parameter
    archive, with how it was built (flags, rewrites made, seconds, size)."""

    vmfb: Path
    record: dict
    irpa: Path
    flags: List[str]
    rewrites: Dict[str, int]
    export_s: float
    compile_s: float
    vmfb_bytes: int


class IreeModule:
    """One vmfb + its parameter archive, loaded with iree.runtime on the target's driver."""

    def __init__(self, built: Built, driver: str):
        import iree.runtime as rt

        instance = rt.VmInstance()
        self.device = rt.get_device(driver)
        params = rt.ParameterIndex()
        params.load(str(built.irpa))
        modules = [
            rt.create_hal_module(instance, self.device),
            rt.create_io_parameters_module(instance, params.create_provider(scope=built.record["parameter_scope"])),
        ]
        vm_module = rt.VmModule.copy_buffer(instance, built.vmfb.read_bytes())
        context = rt.VmContext(instance, modules=modules + [vm_module])
        self.invoke = rt.FunctionInvoker(context, self.device, vm_module.lookup_function(built.record["function"]))
        self.names = [s["name"] for s in built.record["inputs"]]

    def __call__(self, inputs: Dict[str, np.ndarray]) -> np.ndarray:
        result = self.invoke(*[inputs[n] for n in self.names])
        result = result[0] if isinstance(result, (list, tuple)) else result
        return np.asarray(result.to_host())


# The runtime name of ONNX Runtime with its default spin-waiting threads, timed beside "onnxruntime" (threads
# that sleep between calls: the bar).
ORT_SPINNING = "onnxruntime:spinning"


def ort_session(eager, args, names: List[str], path: Path, threads: int):
    """torch's ONNX export of `eager`, saved at `path`, in an ONNX Runtime session whose threads do not spin
    between calls (the bar: a spinning pool keeps burning the cores after a call returns, which steals the next
    runtime's CPU in alternating rounds and flatters ORT); `ort_file_session(path, threads, spinning=True)` gives
    ORT's default, which the benchmark reports beside it, timed alone after the others (measure_spinning_ort)."""
    import torch

    program = torch.onnx.export(eager, tuple(args), dynamo=True, input_names=names, verbose=False)
    program.save(str(path))
    return ort_file_session(path, threads, spinning=False)


def ort_file_session(path: Path, threads: int, spinning: bool):
    """(session, input names) of a saved ONNX file on the CPU, `threads` intra-op threads; `spinning`: whether
    idle pool threads spin-wait (ORT's default) or sleep."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    flag = "1" if spinning else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", flag)
    options.add_session_config_entry("session.inter_op.allow_spinning", flag)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = [i.name for i in session.get_inputs()]
    return session, feeds


def measure_spinning_ort(path: Path, threads: int, inputs: Dict[str, np.ndarray], names: List[str], ref,
                         *, warmup: int, runs: int) -> Tuple[dict, dict]:
    """ORT's default (spin-waiting threads) on the saved ONNX file, timed on its own after the alternating rounds
    (timing.measure_alone: its pool burns the cores while the session lives) and released. `inputs` by
    observation name, `names` in the file's input order. Returns (timing, parity against `ref`)."""
    from dsa.tools.bench.timing import measure_alone, parity

    checked = {}

    def session_call():
        session, feeds = ort_file_session(path, threads, spinning=True)
        feed = {f: np.asarray(inputs[n]) for f, n in zip(feeds, names)}
        checked["parity"] = parity(session.run(None, feed)[0], ref)
        return lambda: session.run(None, feed)

    timing = measure_alone(session_call, warmup=warmup, runs=runs)
    return timing, checked["parity"]


def executorch_available() -> bool:
    """Whether ExecuTorch's package imports here (the benchmark runs in the ExecuTorch environment under `bazel
    run`). Its runtime subpackage is looked up, so that a module merely named `executorch` does not count."""
    import importlib.util

    try:
        return importlib.util.find_spec("executorch.runtime") is not None
    except (ImportError, ValueError):
        return False


def runfiles_python(root: Path, repository: str) -> Optional[Path]:
    """The interpreter of the Python environment `repository` (@dsa_lerobot_python, @dsa_executorch_python) in
    this binary's runfiles, or None (outside Bazel, or not a data dependency)."""
    for candidate in (root.parent / repository / "bin" / "python3", root / "external" / repository / "bin" / "python3"):
        if candidate.exists():
            return candidate
    return None
