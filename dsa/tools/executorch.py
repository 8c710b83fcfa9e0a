"""dsa pte: run the ExecuTorch Plan B (dsa_pte's program, or an ExecuTorch bundle) with ExecuTorch's runtime.

    dsa pte run BUNDLE.tar [--observation OBS.npz] [--repeats N]   verify the bundle, run its program
    dsa pte run PROGRAM.pte [--observation OBS.npz]               a dsa_pte output (its record beside it)

Runs in the ExecuTorch environment (@dsa_executorch_python: `DSA_PYTHON=.../bin/python3 bin/dsa pte run ...`).
Without --observation it runs a deterministic sample of the record's input shapes. Inputs are checked against
the program record (names, shapes, dtypes) before the program is called.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from dsa.core.errors import DsaError, run_cli
from dsa.core.formats import PteRecord

_TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


class PteProgram:
    """One ExecuTorch program and its record: `run({name: array}) -> [array]`."""

    def __init__(self, pte: Path, record: dict, threads: Optional[int] = None):
        try:
            from executorch.runtime import Runtime
        except ImportError as e:
            raise DsaError("dsa pte", f"ExecuTorch's runtime does not import here ({(e.__cause__ or e)})",
                           "run in the ExecuTorch environment (@dsa_executorch_python: requirements_executorch.in)"
                           ) from None
        if threads:
            from executorch.extension.pybindings import portable_lib

            portable_lib._unsafe_reset_threadpool(threads)
        self.record = record
        try:
            self.program = Runtime.get().load_program(Path(pte).read_bytes())
            self.method = self.program.load_method(record["method"])
        except RuntimeError as e:
            raise DsaError(str(pte), f"is not a loadable ExecuTorch program: {str(e).strip()[:200]}",
                           "rebuild it with dsa_pte, or copy the release again") from None

    def arguments(self, inputs: Dict[str, np.ndarray]) -> list:
        import torch

        args = []
        for spec in self.record["inputs"]:
            if spec["name"] not in inputs:
                raise DsaError(f"{self.record['model_id']}: input", f"missing input '{spec['name']}'",
                               f"provide: {', '.join(s['name'] for s in self.record['inputs'])}")
            value = np.asarray(inputs[spec["name"]])
            if list(value.shape) != spec["shape"]:
                raise DsaError(f"{self.record['model_id']}: input '{spec['name']}'",
                               f"has shape {list(value.shape)}, the program takes {spec['shape']}",
                               "an ExecuTorch program is built at static shapes (dsa_pte's bucket)")
            if spec["dtype"] not in _TORCH_DTYPES:
                raise DsaError(f"{self.record['model_id']}: input '{spec['name']}'", f"dtype {spec['dtype']}")
            args.append(torch.from_numpy(np.ascontiguousarray(value.astype(spec["dtype"], copy=False))))
        return args

    def run_prepared(self, args: list) -> List[np.ndarray]:
        return [np.asarray(o) for o in self.method.execute(args)]

    def run(self, inputs: Dict[str, np.ndarray]) -> List[np.ndarray]:
        return self.run_prepared(self.arguments(inputs))


def sample(record: dict, seed: int = 0) -> Dict[str, np.ndarray]:
    """Deterministic inputs of the record's shapes: floats standard-normal, integers 0/1."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in record["inputs"]:
        if spec["dtype"].startswith(("float", "bfloat")):
            out[spec["name"]] = rng.standard_normal(spec["shape"]).astype(np.float32).astype(
                "float32" if spec["dtype"] == "bfloat16" else spec["dtype"])
        else:
            out[spec["name"]] = rng.integers(0, 2, size=spec["shape"]).astype(spec["dtype"])
    return out


def open_program(path: Path, work: Path, threads: Optional[int] = None) -> PteProgram:
    """A .pte (its record beside it) or an ExecuTorch bundle (verified first)."""
    path = Path(path)
    if path.suffix == ".tar":
        from dsa.runtime.bundle import extract_pte_bundle

        meta = extract_pte_bundle(path, work)
        return PteProgram(work / meta["program"], PteRecord.read(work / meta["record"]), threads)
    record = path.with_name(path.name[:-len(".pte")] + ".pte_record.json") if path.name.endswith(".pte") else None
    if record is None or not path.is_file() or not record.is_file():
        raise DsaError(str(path), "is neither an ExecuTorch bundle (.tar) nor a .pte with its .pte_record.json",
                       "pass what dsa_pte or dsa_bundle(pte = ...) built")
    return PteProgram(path, PteRecord.read(record), threads)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa pte", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run an ExecuTorch program or bundle")
    r.add_argument("program", type=Path, help="BUNDLE.tar (an ExecuTorch bundle) or PROGRAM.pte")
    r.add_argument("--observation", type=Path, help=".npz with one array per input (default: a sample)")
    r.add_argument("--repeats", type=int, default=10, help="timed calls after one warm-up")
    r.add_argument("--threads", type=int, default=2)
    a = parser.parse_args(argv)
    if not 1 <= a.repeats <= 10000:
        raise DsaError("--repeats", f"{a.repeats} is not between 1 and 10000")
    with tempfile.TemporaryDirectory(prefix="dsa-pte-") as tmp:
        program = open_program(a.program, Path(tmp), a.threads)
        if a.observation:
            import types

            from dsa.runtime.run import load_observation

            # The observation loader's bounds come from a policy's records: the program's record serves as one.
            record = dict(program.record, dynamic_dims={})
            shaped = types.SimpleNamespace(model_id=record["model_id"],
                                           modules=[types.SimpleNamespace(record=record)])
            inputs = load_observation(a.observation, shaped)
        else:
            inputs = sample(program.record)
        args = program.arguments(inputs)
        outputs = program.run_prepared(args)
        times = []
        for _ in range(a.repeats):
            start = time.perf_counter()
            program.run_prepared(args)
            times.append((time.perf_counter() - start) * 1e3)
    print(f"{program.record['model_id']} (ExecuTorch, {program.record.get('backend')}): outputs "
          f"{[list(o.shape) for o in outputs]}; latency median {np.median(times):.2f} ms over {a.repeats} calls")
    first = outputs[0].reshape(-1)
    print("first values:", " ".join(f"{v:.4g}" for v in first[:8]))


if __name__ == "__main__":
    run_cli(main, "dsa pte")
