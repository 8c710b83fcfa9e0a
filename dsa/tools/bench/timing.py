"""Timing and judging: the timing loops (`measure`, `measure_interleaved`), their statistics (median and p90),
the parity bound every runtime's output is checked against, the goal a timing is judged by, the quiet-machine
wait, and the machine a timing was taken on. No model here: subjects.py, lerobot.py and quant.py time theirs
with these, and so does the tuner (dsa/tools/tune.py)."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Sequence

import numpy as np

from dsa.runtime.host import host_cpu_features, host_cpu_model

# Parity bound of every runtime against eager, as in the models' tests: |x - eager| <= REL_TOL * max(1, |eager|).
REL_TOL = 2e-4
# The goal of the performance work (issue: beat eager, close in on ONNX Runtime).
GOAL_EAGER_RATIO = 1.0
GOAL_ORT_RATIO = 1.5
# A LeRobot policy's shipped module where the machine runs an AVX-512 build (x86-64-v4): at most this fraction of
# eager's time and no slower than ONNX Runtime; elsewhere (x86-64-v3) no slower than eager.
POLICY_GOAL_AVX512 = {"vs_eager": 0.8, "vs_onnxruntime": 1.0}
POLICY_GOAL = {"vs_eager": GOAL_EAGER_RATIO}


def policy_goal(target: str, runtimes: Dict[str, dict]) -> dict:
    """A LeRobot policy row's goal: its vmfb's ratios to eager (and ONNX Runtime, where timed) and whether they
    are within the bounds for its target (POLICY_GOAL_AVX512 for an x86-64-v4 build, else POLICY_GOAL)."""
    bounds = POLICY_GOAL_AVX512 if target.startswith("x86_64-v4") else POLICY_GOAL
    vmfb = runtimes["vmfb"]["median_ms"]
    goal = {"vs_eager": round(vmfb / runtimes["eager"]["median_ms"], 3)}
    if "onnxruntime" in runtimes:
        goal["vs_onnxruntime"] = round(vmfb / runtimes["onnxruntime"]["median_ms"], 3)
    goal["met"] = all(goal[k] <= bound for k, bound in bounds.items() if k in goal)
    goal["bounds"] = dict(bounds)
    return goal
# The LeRobot benchmark waits (up to QUIET_WAIT_S) for the 1-minute load average to fall below this before each
# policy, and reports the load beside every number: eager PyTorch slows down far more than IREE when the
# cores are shared, so a loaded measurement flatters the vmfb.
QUIET_LOAD = 1.5
QUIET_WAIT_S = 60


def measure(fn: Callable[[], object], *, warmup: int, runs: int) -> dict:
    """Calls fn `warmup` times untimed, then `runs` times; median and p90 in milliseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return summarize(samples)


def measure_interleaved(fns: Dict[str, Callable[[], object]], *, warmup: int, runs: int,
                        rounds: int = 5) -> Dict[str, dict]:
    """Times several functions in alternating rounds (each round gives every function runs/rounds calls),
    so a machine slowing down or speeding up mid-measurement biases none of them; median and p90 per name."""
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    per_round = [runs // rounds + (1 if r < runs % rounds else 0) for r in range(rounds)]
    for count in per_round:
        for name, fn in fns.items():
            for _ in range(count):
                start = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: summarize(values) for name, values in samples.items()}


def measure_alone(make: Callable[[], Callable[[], object]], *, warmup: int, runs: int) -> dict:
    """Times a runtime that must not share the alternating rounds — one whose idle threads keep burning the
    cores, as ONNX Runtime's spin-waiting pool does (measured: beside it, a 9.4 ms module took 30.6 ms and eager
    PyTorch's p90 went from 16.5 to 42.8 ms) — after the others: `make()` builds it (a session and its call),
    it is timed on its own and released before this returns, so nothing measured later shares the machine
    with its threads."""
    fn = make()
    try:
        return measure(fn, warmup=warmup, runs=runs)
    finally:
        del fn
        gc.collect()


def summarize(samples_ms: Sequence[float]) -> dict:
    if not samples_ms:
        raise ValueError("no samples")
    ordered = sorted(samples_ms)
    p90 = float(np.percentile(ordered, 90))
    return {"median_ms": round(statistics.median(ordered), 4), "p90_ms": round(p90, 4), "runs": len(ordered)}


def parity(out: np.ndarray, ref: np.ndarray) -> dict:
    err = float(np.abs(np.asarray(out, dtype=np.float64) - ref).max()) if out.shape == ref.shape else float("inf")
    bound = REL_TOL * max(1.0, float(np.abs(ref).max()))
    return {"max_abs_err": err, "bound": bound, "ok": bool(err <= bound)}


def load_average() -> float:
    return os.getloadavg()[0]


def wait_for_quiet(limit: float = QUIET_LOAD, wait_s: float = QUIET_WAIT_S) -> dict:
    """Waits until the 1-minute load average is below `limit` (at most `wait_s`); returns what it saw."""
    start = time.monotonic()
    load = load_average()
    while load >= limit and time.monotonic() - start < wait_s:
        time.sleep(5)
        load = load_average()
    return {"load": round(load, 2), "waited_s": round(time.monotonic() - start, 1), "quiet": load < limit}


def machine_info(threads: int) -> dict:
    """The machine a run's timings were taken on (results.json's `machine`), from dsa.runtime.host's probes."""
    flags = host_cpu_features() or []
    return {
        "cpu": host_cpu_model(),
        "cores_available": threads,
        "threads": threads,
        "avx512": "avx512f" in flags,
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.release()}",
    }
