"""Each stage of `dsa compile` in a process of its own, measured.

A full-size policy's export holds the traced model, its example inputs and the exported program (SmolVLA at
SmolVLM2-500M size: ~5 GB); the parameter archive holds the checkpoint's tensors. In one process the peak is
their sum plus everything the allocator kept; one process per stage makes it the largest stage's alone, and
each stage's wall time and peak RSS (wait4's rusage of the stage's process and of what it ran, iree-compile
included) can be reported: `StageRunner.timings`, which `dsa compile` writes to `timings.json` beside its
artifacts (never into them: the numbers differ run to run, the artifacts must not).

    runner = StageRunner()
    record = runner("export", export_model, view, mlir, record_path, ...)   # runs in a child; returns its result

The call (a module-level function, its arguments and its result) crosses the process boundary by pickle. A
DsaError raised in the child is raised again here, unchanged; any other failure, or a child killed by a
signal (out of memory: SIGKILL), becomes a DsaError naming the stage, with the tail of the child's stderr.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, List

from dsa.core.determinism import pin_math_libraries
from dsa.core.errors import DsaError, describe_unexpected
from dsa.tools.measure import run_measured


@dataclasses.dataclass(frozen=True)
class StageTiming:
    stage: str
    wall_s: float
    peak_rss_kib: int


def child_environment() -> dict:
    # The child imports what this process can import (dsa, the model code): this process's sys.path.
    env = dict(os.environ)
    paths = [p if p else os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _stderr_tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


class StageRunner:
    """Runs stage functions in child processes, one each, and keeps their timings in call order."""

    def __init__(self) -> None:
        self.timings: List[StageTiming] = []

    def __call__(self, stage: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with tempfile.TemporaryDirectory(prefix="dsa-stage-") as tmp:
            call, result = Path(tmp) / "call.pickle", Path(tmp) / "result.pickle"
            with open(call, "wb") as f:
                pickle.dump((fn.__module__, fn.__qualname__, args, kwargs), f)
            measured = run_measured([sys.executable, "-m", "dsa.tools.stage_process", str(call), str(result)],
                                    env=child_environment())
            self.timings.append(StageTiming(stage, measured["wall_s"], measured["peak_rss_kib"]))
            if result.exists():
                with open(result, "rb") as f:
                    kind, value = pickle.load(f)
            else:
                kind, value = "died", measured["returncode"]
        if kind == "ok":
            return value
        if kind == "dsa_error":
            raise DsaError(*value)
        tail = _stderr_tail(measured["stderr"])
        if kind == "died":
            code = value
            why = (f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}")
            hint = "SIGKILL usually means out of memory: free memory or use a larger machine" \
                if code == -signal.SIGKILL else "its stderr ends with the cause"
            raise DsaError(f"dsa compile: {stage}", f"the stage's process {why} before it finished",
                           f"{hint}\n{tail}" if tail else hint)
        if os.environ.get("DSA_TRACEBACK") == "1" and tail:
            raise DsaError(f"dsa compile: {stage}", value, f"the stage's traceback:\n{tail}")
        raise DsaError(f"dsa compile: {stage}", value)


def _child_main(call: Path, result: Path) -> int:
    pin_math_libraries()  # before any computation: dsa.core.determinism
    with open(call, "rb") as f:
        module, name, args, kwargs = pickle.load(f)
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    try:
        outcome = ("ok", fn(*args, **kwargs))
    except DsaError as e:
        outcome = ("dsa_error", (e.where, e.message, e.hint))
    except Exception as e:  # ManifestError and anything unexpected: one line (DSA_TRACEBACK=1: its traceback)
        if type(e).__name__ == "ManifestError":
            outcome = ("error", str(e))
        else:
            if os.environ.get("DSA_TRACEBACK") == "1":
                traceback.print_exc()
            outcome = ("error", describe_unexpected(e))
    tmp = result.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(outcome, f)
    os.replace(tmp, result)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(Path(sys.argv[1]), Path(sys.argv[2])))
