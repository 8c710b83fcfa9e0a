"""dsa scale: measured scale of real-size models — sizes, each stage's wall time and peak RSS, the runtime's and
eager's latency and peak memory at batch 1 — generated into docs/real-size.{json,md,png}, never typed.

    bin/dsa scale manifests/pi0_full.yaml manifests/pi05_full.yaml      # real-size subjects, by manifest
    bin/dsa scale --sweep pi0                                           # PI0 at three sizes, and the plot
    bin/dsa scale --real-size-index                                     # every manifest of //models:policies_real_size_index
    bin/dsa scale --render                                              # the docs again from docs/real-size.json
    bazel run //tools:scale -- [the same flags]

For each subject (a manifest):

  weights     a seeded stand-in made here, in a scratch directory, by the generator the Bazel rules use
              (framework lerobot: `python -m dsa.frontends.lerobot.cli init` on models/<model_id>/policy.json,
              `--weights seeded` in bf16 when the manifest stores bf16 weights; others: `python -m
              dsa.stages.checkpoint` on the manifest's export view, in bf16 and with the manifest's shards when it
              lists shards or stores bf16 weights) — itself a measured stage — or given (`--weights ID=PATH`: a
              LeRobot policy directory, a .safetensors file or a sharded checkpoint's index). When the
              manifest's sha256 pins are not those of the weights (a placeholder, another seed), the subject is
              built from a copy of the manifest pinned to them, and the data says so.
  build       `dsa compile --no-cache` for every target the manifest lists, in the subject's own Python
              environment (framework lerobot: the LeRobot environment), each stage a process of its own: every
              stage's wall time and peak RSS from its timings.json (wait4's ru_maxrss of the stage's process).
  sizes       parameter count (the export record: parameters the graph reads; and the checkpoint's), checkpoint
              bytes (every shard), .irpa bytes, vmfb bytes and sha256 per target.
  runtime     for each target this machine runs (dsa.runtime.host.runs_here): the module index in a process of
              its own (dsa.runtime.policy.CompiledPolicy, no torch) at batch 1 on the import matrix's sample
              inputs (dynamic dims at their smallest, the manifest's flow_steps): the load, the first call
              (module load and first-touch of the weights), the median of --runs further calls, and the process's
              peak resident memory, VmHWM from its own /proc/self/status at its end (not the parent's rusage: on
              Linux a child's ru_maxrss starts at its parent's RSS at fork).
  eager       the same inputs through the framework's own eager model in the subject's environment, in another
              process (LeRobot: its policy class, loaded by dsa.frontends.lerobot.load_pretrained_mapped; pytorch:
              dsa.tools.testing.eager_policy; a weight-quantised model: dsa.tools.testing.quantised_eager_policy,
              the same quantised weights dequantised one layer at a time, since its float32 weights need not fit):
              the same timings and VmHWM, and the runtime's largest deviation from it. Skipped, saying why, when
              those weights cannot fit this machine's memory.

A family sweep (`--sweep pi0`) measures the family at three sizes with the real size's recipe (the same
manifest fields — precision, buckets, targets, tuning — and stand-in generator; only the policy config and the
inputs it implies differ) and, at the small and medium sizes, the design before weightless building: the export
with the model's weights materialised (`export_model(..., weightless=False)`) and LeRobot's own random
initialisation as the stand-in. The real size is the subject of the same name (one measurement serves both).

Every measured step (stand-in, dsa compile, each runtime, eager, each old-design step) runs under an exclusive
lock on --lock (default /tmp/dsa-heavy.lock, fcntl.flock), so concurrent heavy jobs on a shared machine do not
distort the numbers; `--no-lock` turns it off. docs/real-size.json keeps every subject measured (a new
measurement of a subject replaces its entry); after each subject the docs, the plot and bench/RESULTS.md's
"Real sizes" section (between `<!-- real-size:begin -->` and `<!-- real-size:end -->`) are rendered again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from dsa.core.errors import DsaError, run_cli

DATA_FORMAT = 1
DEFAULT_LOCK = Path("/tmp/dsa-heavy.lock")
DEFAULT_RUNS = 3
DEFAULT_MAX_SCRATCH_GB = 15.0
BEGIN_MARKER = "<!-- real-size:begin -->"
END_MARKER = "<!-- real-size:end -->"
MISSING = "–"
# Memory this machine keeps for everything else while an eager reference runs.
EAGER_MEMORY_MARGIN_BYTES = 3 << 30

# The stand-in of a LeRobot policy: LeRobot's config JSON in models/<model_id>/policy.json (as dsa_policy's
# `lerobot_config` names it).
LEROBOT_CONFIG = "models/{model_id}/policy.json"

# A family sweep: the family at three sizes. `recipe` is the real size's manifest, whose RECIPE_FIELDS every
# point takes; each point is a manifest (its inputs, outputs, chunk) and the LeRobot policy config to generate
# the stand-in from, with `variants` replacing config fields. A point without changes is the subject of that
# manifest itself (its key is the manifest's model_id).
RECIPE_FIELDS = ("schema_version", "precision", "buckets", "quant_scheme", "targets", "tuning")
# PI0's medium size: the real size's inputs (three 224x224 cameras, a 48-token prompt, chunk 50) with a
# SigLIP-B-sized vision tower (768 wide, 12 layers) and a 6-layer Gemma of gemma_300m's width and heads in
# both the VLM and the action expert: 0.56B parameters the graph reads (0.82B in the checkpoint), between the
# small 16.6M and the real 3.24B on a log scale. Names as dsa.frontends.lerobot.third_party.openpi_transformers'
# gemma_name writes them (canonical JSON).
_PI0_MEDIUM_GEMMA = {"depth": 6, "head_dim": 256, "mlp_dim": 4096, "num_heads": 8, "num_kv_heads": 1, "width": 1024}
_PI0_MEDIUM_VISION = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12}


def _gemma_name(sizes: dict) -> str:
    return "dsa-gemma:" + json.dumps(sizes, sort_keys=True, separators=(",", ":"))


SWEEPS = {
    "pi0": {
        "recipe": "manifests/pi0_full.yaml",
        "points": [
            {"size": "small", "key": "pi0_small", "manifest": "manifests/pi0_lerobot.yaml",
             "config": "models/pi0_lerobot/policy.json", "variants": {}},
            {"size": "medium", "key": "pi0_medium", "manifest": "manifests/pi0_full.yaml",
             "config": "models/pi0_full/policy.json",
             "variants": {"paligemma_variant": _gemma_name(dict(_PI0_MEDIUM_GEMMA, vision=_PI0_MEDIUM_VISION)),
                          "action_expert_variant": _gemma_name(_PI0_MEDIUM_GEMMA)}},
            {"size": "real", "key": "pi0_full", "manifest": "manifests/pi0_full.yaml",
             "config": "models/pi0_full/policy.json", "variants": {}},
        ],
        # The design before weightless building, measured where it fits (at real size it was OOM-killed).
        "old_design": ["small", "medium"],
    },
}


# -- the heavy lock ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def heavy_lock(path: Optional[Path], what: str = "", log: Callable[[str], None] = print) -> Iterator[float]:
    """An exclusive fcntl.flock on `path` (created if absent) for the block; None: no lock. Yields the seconds
    waited for it. Waiting is said once on `log`."""
    if path is None:
        yield 0.0
        return
    path = Path(path)
    fd = os.open(str(path), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        start = time.monotonic()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"dsa scale: waiting for the heavy lock {path}" + (f" ({what})" if what else "") + " …")
            fcntl.flock(fd, fcntl.LOCK_EX)
        waited = time.monotonic() - start
        try:
            yield waited
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# -- peak resident memory of a process, as it sees itself -------------------------------------------------
def read_vmhwm_kib(status_text: str) -> int:
    """VmHWM (the peak resident set, KiB) from the text of /proc/<pid>/status."""
    for line in status_text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise DsaError("/proc/self/status", "has no VmHWM line", "peak memory is read on Linux only")


def own_vmhwm_kib() -> int:
    """This process's peak resident memory (KiB): its VmHWM. Unlike the rusage its parent reaps (ru_maxrss), it
    belongs to this process's own address space, made new at exec, so the parent's size at fork is not in it."""
    with open("/proc/self/status", encoding="ascii") as f:
        return read_vmhwm_kib(f.read())


def memory_total_bytes() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


# -- subjects ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Subject:
    """One model to measure: a manifest (as data; `source` is its file), the policy config its LeRobot stand-in
    is made from (variants applied), or given weights."""

    key: str
    source: Path                       # the manifest file the subject comes from
    manifest: dict                     # its data, with a sweep point's recipe fields
    lerobot_config: Optional[Path] = None
    variants: Dict[str, str] = dataclasses.field(default_factory=dict)
    weights: Optional[Path] = None     # given weights (policy dir / checkpoint file / sharded index)
    family: Optional[str] = None
    size: Optional[str] = None
    old_design: bool = False
    description: str = ""
    derived: bool = False              # a sweep point's manifest, made here: pinned to its stand-in by design

    @property
    def framework(self) -> str:
        return self.manifest.get("framework", "pytorch")

    @property
    def model_id(self) -> str:
        return self.manifest["model_id"]


def _read_manifest_data(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise DsaError(str(path), f"cannot read the manifest: {e}") from None
    if not isinstance(data, dict) or "model_id" not in data:
        raise DsaError(str(path), "is not a manifest with a model_id")
    return data


def _relative(path: Path, root: Path) -> str:
    """`path` relative to the checkout where it lies inside it (as given, else resolved), else as given."""
    for p, r in ((Path(os.path.abspath(path)), Path(os.path.abspath(root))), (Path(path).resolve(), root.resolve())):
        try:
            return str(p.relative_to(r))
        except ValueError:
            continue
    return str(path)


def manifest_subject(path: Path, root: Path, weights: Optional[Path] = None) -> Subject:
    """A subject for a manifest as it is: LeRobot's stand-in from models/<model_id>/policy.json."""
    data = _read_manifest_data(path)
    config = None
    if data.get("framework") == "lerobot" and weights is None:
        config = root / LEROBOT_CONFIG.format(model_id=data["model_id"])
        if not config.is_file():
            raise DsaError(str(path), f"framework lerobot: no policy config at {config} to make the stand-in from",
                           f"put the policy's LeRobot config there, or pass --weights {data['model_id']}=POLICY_DIR")
    return Subject(key=data["model_id"], source=Path(path), manifest=data, lerobot_config=config, weights=weights,
                   description=_relative(path, root))


def sweep_subjects(name: str, root: Path) -> List[Subject]:
    """The points of a family sweep (SWEEPS), smallest first."""
    if name not in SWEEPS:
        raise DsaError("--sweep", f"no sweep {name!r}", f"known: {', '.join(SWEEPS)}")
    sweep = SWEEPS[name]
    recipe_path = root / sweep["recipe"]
    recipe = _read_manifest_data(recipe_path)
    subjects = []
    for point in sweep["points"]:
        path = root / point["manifest"]
        data = _read_manifest_data(path)
        changed = bool(point["variants"]) or path.resolve() != recipe_path.resolve()
        if changed:
            data = {k: v for k, v in data.items() if k != "processors"}  # files beside the manifest: not built here
            for field in RECIPE_FIELDS:
                if field in recipe:
                    data[field] = recipe[field]
                else:
                    data.pop(field, None)
            data["model_id"] = point["key"]
        what = f"{point['config']}" + (" with " + ", ".join(f"{k} {v}" for k, v in point["variants"].items())
                                        if point["variants"] else "")
        if changed:
            what += f", {point['manifest']}'s inputs, {sweep['recipe']}'s recipe"
        subjects.append(Subject(key=point["key"], source=path, manifest=data, lerobot_config=root / point["config"],
                                variants=dict(point["variants"]), family=name, size=point["size"],
                                old_design=point["size"] in sweep["old_design"], description=what,
                                derived=changed))
    return subjects


def real_size_manifests(bin_dir: Path, root: Path) -> List[Path]:
    """The manifests of the real-size policies index (//models:policies_real_size_index), in its order."""
    path = bin_dir / "models" / "policies_real_size_index.json"
    if not path.is_file():
        raise DsaError(str(path), "no real-size policies index",
                       "build it: `bazel build //models:policies_real_size_index` (it builds no model), or name "
                       "the manifests")
    seen: Dict[str, Path] = {}
    for policy in json.loads(path.read_text())["policies"]:
        manifest = policy.get("manifest")
        if manifest and manifest not in seen:
            seen[manifest] = root / manifest
    return list(seen.values())


# -- environments -----------------------------------------------------------------------------------------
def lerobot_python_candidates(root: Path, bin_dir: Optional[Path]) -> List[Path]:
    """Where the LeRobot environment's interpreter may be: this binary's runfiles (`bazel run`), the output
    base of `bin_dir` (bazel-bin → <output_base>/execroot/<ws>/bazel-out/<cfg>/bin)."""
    candidates = []
    here = Path(os.path.abspath(__file__)).parents[2]
    for base in (here, root):
        candidates += [base.parent / "dsa_lerobot_python" / "bin" / "python3",
                       base / "external" / "dsa_lerobot_python" / "bin" / "python3"]
    if bin_dir is not None and bin_dir.exists():
        resolved = bin_dir.resolve()
        if len(resolved.parents) > 4:
            candidates.append(resolved.parents[4] / "external" / "dsa_lerobot_python" / "bin" / "python3")
    return candidates


def subject_python(framework: str, *, lerobot_python: Optional[Path], toolchain_python: Path) -> Path:
    """The interpreter a subject's stages run in: the LeRobot environment for framework lerobot (LeRobot and
    its pinned torch), the toolchain's for every other framework."""
    if framework == "lerobot":
        if lerobot_python is None or not Path(lerobot_python).exists():
            raise DsaError("framework lerobot", "the LeRobot environment's interpreter was not found",
                           "pass --lerobot-python PATH (or set DSA_LEROBOT_PYTHON), or run `bazel run //tools:scale`")
        return Path(lerobot_python)
    return Path(toolchain_python)


def requirements_lock_for(framework: str, root: Path) -> Path:
    """The lock the subject's environment was installed from (recorded in dsa compile's lock)."""
    lerobot = root / "requirements_lerobot_lock.txt"
    return lerobot if framework == "lerobot" and lerobot.is_file() else root / "requirements_lock.txt"


# -- the stand-in ---------------------------------------------------------------------------------------------
def stand_in_recipe(manifest: dict) -> dict:
    """How the Bazel rules' stand-in for a manifest is made, from the manifest alone: {"generator": "lerobot" |
    "checkpoint", "dtype": "float32" | "bfloat16", "shards": N (0: one file), "weights": "lerobot" | "seeded"
    (LeRobot)}. Weights stored in bf16 (precision.weights) and sharded checkpoints (published large models) are
    bf16 stand-ins; a LeRobot bf16 stand-in is seeded per tensor (LeRobot's own init saves float32 only)."""
    shards = len((manifest.get("checkpoint") or {}).get("shards") or [])
    precision = (manifest.get("precision") or {}).get("weights")
    dtype = "bfloat16" if precision == "bf16" or shards else "float32"
    if manifest.get("framework") == "lerobot":
        return {"generator": "lerobot", "dtype": dtype, "shards": 0,
                "weights": "seeded" if dtype == "bfloat16" else "lerobot"}
    return {"generator": "checkpoint", "dtype": dtype, "shards": shards}


def stand_in_command(python: Path, recipe: dict, *, out: Path, config: Optional[Path] = None,
                     view: Optional[Path] = None, pythonpath: Sequence[str] = (), seed: int = 0) -> List[str]:
    """The generator's command line (the same module and flags the Bazel actions run)."""
    if recipe["generator"] == "lerobot":
        cmd = [str(python), "-m", "dsa.frontends.lerobot.cli", "init", "--config-file", str(config),
               "--seed", str(seed), "--out-dir", str(out)]
        if recipe.get("weights") == "seeded":
            cmd += ["--weights", "seeded", "--dtype", recipe["dtype"]]
        return cmd
    cmd = [str(python), "-m", "dsa.stages.checkpoint", "--view", str(view), "--seed", str(seed),
           "--dtype", recipe["dtype"], "--out", str(out)]
    for p in pythonpath:
        cmd += ["--pythonpath", str(p)]
    if recipe["shards"]:
        cmd += ["--shards", str(recipe["shards"])]
    return cmd


def checkpoint_files(checkpoint: Path) -> List[Path]:
    """A checkpoint's files: the .safetensors file, or a sharded checkpoint's index and every shard it names."""
    checkpoint = Path(checkpoint)
    if checkpoint.name.endswith(".index.json"):
        index = json.loads(checkpoint.read_text())
        shards = sorted(set(index.get("weight_map", {}).values()))
        return [checkpoint] + [checkpoint.parent / s for s in shards]
    return [checkpoint]


def resolve_weights(given: Path, framework: str) -> Tuple[Path, Optional[Path]]:
    """(checkpoint file, LeRobot config.json or None) of given weights: a LeRobot policy directory, a
    .safetensors file, a sharded checkpoint's index or the directory holding it."""
    given = Path(given)
    if framework == "lerobot":
        if not (given / "config.json").is_file() or not (given / "model.safetensors").is_file():
            raise DsaError("--weights", f"{given} is not a LeRobot policy directory (config.json + model.safetensors)")
        return given / "model.safetensors", given / "config.json"
    if given.is_dir():
        indexes = sorted(given.glob("*.index.json"))
        if len(indexes) != 1:
            raise DsaError("--weights", f"{given} holds {len(indexes)} checkpoint indexes", "pass the index file")
        return indexes[0], None
    if not given.is_file():
        raise DsaError("--weights", f"no checkpoint at {given}")
    return given, None


def repin(manifest: dict, checkpoint: Path, policy_config: Optional[Path]) -> Tuple[dict, List[str]]:
    """The manifest pinned to these weights: (the manifest, possibly a changed copy; the pins that changed).
    A sharded checkpoint's index and each shard listed, and a LeRobot policy's config.json."""
    from dsa.core.fileio import sha256_file

    data = json.loads(json.dumps(manifest))
    changed = []
    pins = data.setdefault("checkpoint", {})
    digest = sha256_file(checkpoint)
    if pins.get("sha256") != digest:
        pins["sha256"] = digest
        changed.append("checkpoint.sha256")
    for i, shard in enumerate(pins.get("shards") or []):
        digest = sha256_file(Path(checkpoint).parent / shard["file"])
        if shard.get("sha256") != digest:
            shard["sha256"] = digest
            changed.append(f"checkpoint.shards[{i}].sha256")
    config_pin = (data.get("model") or {}).get("policy_config")
    if policy_config is not None and config_pin is not None:
        digest = sha256_file(policy_config)
        if config_pin.get("sha256") != digest:
            config_pin["sha256"] = digest
            changed.append("model.policy_config.sha256")
    return (data if changed else manifest), changed


def pin_manifest(subject: Subject, checkpoint: Path, policy_config: Optional[Path], manifest_file: Path,
                 entry: dict) -> Path:
    """The manifest file dsa compile is given: `manifest_file` rewritten with the weights' pins where the
    subject's differ (entry["weights"]["pins"]: "match", "re-pinned" with a note, or "derived": a sweep point's
    manifest, made here, is pinned to its stand-in by design)."""
    pinned, changed = repin(subject.manifest, checkpoint, policy_config)
    entry["weights"]["pins"] = ("derived" if subject.derived else "re-pinned") if changed else "match"
    if not changed:
        return manifest_file
    if not subject.derived:
        entry["notes"].append(f"the manifest's pins ({', '.join(changed)}) are not this {entry['weights']['source']}'s:"
                              " built from a copy pinned to it")
    return write_manifest(pinned, manifest_file)


def write_manifest(data: dict, path: Path) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Written by dsa scale (a measured subject): do not edit.\n"
                    + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def estimate_scratch_bytes(manifest: dict, elements: int) -> int:
    """An upper estimate of the scratch a subject needs at once: its stand-in checkpoint and its parameter
    archive (weights as stored: bf16/f16 precision 2 bytes, else 4; int8/int4 quantisation a fraction)."""
    recipe = stand_in_recipe(manifest)
    checkpoint = elements * (2 if recipe["dtype"] == "bfloat16" else 4)
    archive_width = 2 if (manifest.get("precision") or {}).get("weights") in ("bf16", "f16") else 4
    kind = (manifest.get("quant_scheme") or {}).get("kind", "none")
    fraction = {"int8": 0.35, "int4": 0.2}.get(kind, 1.0)
    return int(checkpoint + elements * archive_width * fraction)


# -- measured children ------------------------------------------------------------------------------------
def _child_env(root: Path, pythonpath: Sequence[str]) -> dict:
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


# -- measuring one subject ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Settings:
    root: Path
    work: Path
    lock: Optional[Path]
    runs: int
    threads: int
    toolchain_python: Path
    lerobot_python: Optional[Path]
    pythonpath: List[str]
    targets: Optional[List[str]] = None
    runtime: bool = True
    eager: bool = True
    keep: bool = False
    max_scratch_bytes: Optional[int] = None
    log: Callable[[str], None] = print


def _stage_timings(path: Path) -> dict:
    from dsa.core.fileio import read_json

    return read_json(path)


def _size(paths: Sequence[Path]) -> int:
    return sum(Path(p).stat().st_size for p in paths)


def _relative_error(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        got = got.reshape(want.shape) if got.size == want.size else got
    if got.shape != want.shape:
        return float("nan")
    return float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))


def measure_subject(subject: Subject, s: Settings, command: str) -> dict:
    """Everything the tables need about one subject (see the module doc); failures of a runtime or eager
    step become notes, a failed build raises."""
    from dsa.core.fileio import read_json, sha256_file, write_json_atomic
    from dsa.core.formats import ExportRecord, ModuleIndex
    from dsa.manifest.contract import load_manifest, project
    from dsa.runtime.host import host_arch, host_cpu_features, missing_driver, missing_for

    log = s.log
    work = s.work / subject.key
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    python = subject_python(subject.framework, lerobot_python=s.lerobot_python, toolchain_python=s.toolchain_python)
    env = _child_env(s.root, s.pythonpath)
    targets_dir = s.root / "toolchains" / "targets"
    known_targets = sorted(p.stem for p in targets_dir.glob("*.json"))
    entry = {
        "key": subject.key, "model_id": subject.model_id, "manifest": _relative(subject.source, s.root),
        "framework": subject.framework, "description": subject.description, "family": subject.family,
        "size": subject.size, "date": time.strftime("%Y-%m-%d %H:%M"), "command": command,
        "machine": machine(s.threads), "environment": _env_name(python, s),
        "notes": [],
    }
    recipe = stand_in_recipe(subject.manifest)

    # The manifest as measured (written: its file is what dsa compile reads).
    manifest_file = write_manifest(subject.manifest, work / "manifest" / f"{subject.model_id}.yaml")
    manifest = load_manifest(manifest_file, known_targets=known_targets)
    view_file = work / "export_view.json"
    write_json_atomic(view_file, project(manifest, "export"))

    config = subject.lerobot_config
    if config is not None and subject.variants:
        values = json.loads(config.read_text())
        values.update(subject.variants)
        config = work / "policy.json"
        config.write_text(json.dumps(values, indent=2) + "\n")

    # -- weights
    if subject.weights is None:
        if s.max_scratch_bytes:
            counted = work / "count.json"
            log(f"dsa scale: {subject.key}: sizing the stand-in …")
            cmd = [str(python), "-m", "dsa.tools.scale", "--count-child", subject.framework, str(view_file),
                   str(counted)] + (["--config", str(config)] if config else []) + \
                  [a for p in s.pythonpath for a in ("--pythonpath", p)]
            elements = run_child(cmd, env, counted, f"{subject.key}: sizing the stand-in")["elements"]
            needed = estimate_scratch_bytes(subject.manifest, elements)
            free = shutil.disk_usage(s.work).free
            if needed > s.max_scratch_bytes or needed > free:
                raise DsaError(subject.key, f"needs about {needed / 1e9:.1f} GB of scratch for its stand-in "
                               f"({elements / 1e9:.2f} B values) and parameter archive; the limit is "
                               f"{s.max_scratch_bytes / 1e9:.1f} GB (--max-scratch-gb), {free / 1e9:.1f} GB free",
                               "raise --max-scratch-gb where the disk allows, or pass --weights")
        out = work / "stand_in"
        target_out = out
        if recipe["generator"] == "checkpoint" and not recipe["shards"]:
            out.mkdir(parents=True, exist_ok=True)
            target_out = out / "model.safetensors"
        cmd = stand_in_command(python, recipe, out=target_out, config=config, view=view_file,
                               pythonpath=[str(s.root)] + s.pythonpath)
        with heavy_lock(s.lock, f"{subject.key}: stand-in", log) as waited:
            log(f"dsa scale: {subject.key}: stand-in ({recipe['generator']}, {recipe['dtype']}"
                + (f", {recipe['shards']} shards" if recipe["shards"] else "") + ") …")
            made = run_stage(cmd, env, f"{subject.key}: stand-in")
        if recipe["generator"] == "lerobot":
            checkpoint, policy_config = out / "model.safetensors", out / "config.json"
        else:
            checkpoint = out / "model.safetensors.index.json" if recipe["shards"] else target_out
            policy_config = None
        stand_in_stage = {"stage": "stand-in", "wall_s": round(made["wall_s"], 3), "peak_rss_kib": made["peak_rss_kib"],
                          "lock_wait_s": round(waited, 1)}
        entry["weights"] = dict(recipe, source="stand-in", command="python " + _shown_command(_portable(cmd[1:], work, s.root)))
    else:
        checkpoint, policy_config = resolve_weights(subject.weights, subject.framework)
        stand_in_stage = None
        entry["weights"] = {"source": "given", "path": str(subject.weights)}
    files = checkpoint_files(checkpoint)
    entry["checkpoint_bytes"] = _size(files)
    entry["checkpoint_files"] = len(files) - (1 if checkpoint.name.endswith(".index.json") else 0)
    entry["checkpoint_parameters"] = checkpoint_elements(checkpoint)

    # -- pins
    manifest_file = pin_manifest(subject, checkpoint, policy_config, manifest_file, entry)

    # -- build: dsa compile --no-cache
    out_dir = work / "build"
    # `dsa compile` (the cli runs this module): the same flags, output and exit codes.
    cmd = [str(python), "-m", "dsa.tools.pipeline", "--manifest", str(manifest_file), "--out", str(out_dir),
           "--checkpoint", str(checkpoint), "--targets-dir", str(targets_dir),
           "--tuning-dir", str(s.root / "toolchains" / "tuning"),
           "--requirements-lock", str(requirements_lock_for(subject.framework, s.root)), "--no-cache"]
    for p in [str(s.root)] + s.pythonpath:
        cmd += ["--pythonpath", p]
    if policy_config is not None:
        cmd += ["--policy-config", str(policy_config)]
    model_file = (subject.manifest.get("model") or {}).get("file")
    if model_file:
        cmd += ["--model-file", str(subject.source.parent / model_file["path"])]
    targets = [t for t in manifest["targets"] if not s.targets or t in s.targets]
    if s.targets:
        if not targets:
            raise DsaError(subject.key, f"lists none of the targets {', '.join(s.targets)}",
                           f"its targets: {', '.join(manifest['targets'])}")
        for t in targets:
            cmd += ["--target", t]
    with heavy_lock(s.lock, f"{subject.key}: dsa compile", log) as waited:
        log(f"dsa scale: {subject.key}: dsa compile --no-cache ({', '.join(targets)}) …")
        built = run_stage(cmd, env, f"{subject.key}: dsa compile")
    timings = _stage_timings(out_dir / "timings.json")
    stages = ([stand_in_stage] if stand_in_stage else []) + [
        {"stage": t["stage"], "wall_s": t["wall_s"], "peak_rss_kib": t["peak_rss_kib"]} for t in timings["stages"]]
    entry["stages"] = stages
    entry["import_s"] = round(built["wall_s"], 3)
    entry["build_lock_wait_s"] = round(waited, 1)
    entry["compile_command"] = "dsa compile " + _shown_command(_portable(cmd[3:], work, s.root))
    entry["targets"] = targets

    record = ExportRecord.read(out_dir / "export_record.json")
    entry["parameter_count"] = record.get("parameter_count")
    entry["irpa_bytes"] = (out_dir / "params.irpa").stat().st_size
    entry["mlir_bytes"] = _size([p for p in [out_dir / "model.mlir", *sorted((out_dir / "buckets").glob("*.mlir"))]
                                 if p.is_file()])
    entry["modules"], entry["vmfb_bytes"], entry["runtime"] = {}, {}, {}
    runnable = []
    for target in targets:
        index_path = out_dir / f"{target}.modules.json"
        index = ModuleIndex.read(index_path)
        modules = []
        for vmfb, rec in index.modules:
            bucket = read_json(out_dir / rec).get("bucket")
            modules.append({"vmfb": vmfb, "bytes": (out_dir / vmfb).stat().st_size,
                            "sha256": sha256_file(out_dir / vmfb),
                            "bucket": {"dim": bucket["dim"], "size": bucket["size"]} if bucket else None})
        modules.sort(key=lambda m: (m["bucket"] or {}).get("size", 0))  # as CompiledPolicy: smallest first
        entry["modules"][target] = modules
        entry["vmfb_bytes"][target] = sum(m["bytes"] for m in modules)
        spec = read_json(out_dir / index.target_spec)
        why = missing_for(spec, host_arch(), host_cpu_features()) or missing_driver(spec)
        if why is not None:
            entry["runtime"][target] = {"not_run": why}
        else:
            runnable.append((target, index_path))

    # -- runtime, each target in a process of its own
    outputs = {}
    if s.runtime:
        for target, index_path in runnable:
            result, output = work / f"runtime.{target}.json", work / f"runtime.{target}.npy"
            cmd = [str(s.toolchain_python), "-m", "dsa.tools.scale", "--runtime-child", str(index_path),
                   "--runs", str(s.runs), "--threads", str(s.threads), "--result", str(result), "--output", str(output)]
            with heavy_lock(s.lock, f"{subject.key}: runtime {target}", log):
                log(f"dsa scale: {subject.key}: runtime {target} (1 + {s.runs} calls) …")
                try:
                    entry["runtime"][target] = run_child(cmd, env, result, f"{subject.key}: runtime {target}")
                    outputs[target] = output
                except DsaError as e:
                    entry["runtime"][target] = {"error": str(e)[:500]}
                    entry["notes"].append(f"runtime {target}: {e}")
    else:
        for target, _ in runnable:
            entry["runtime"][target] = {"not_run": "--no-runtime"}

    # -- eager, in the subject's environment
    entry["eager"] = None
    if s.eager:
        record_rel = ModuleIndex.read(out_dir / f"{targets[0]}.modules.json").modules
        smallest = min(record_rel, key=lambda m: (read_json(out_dir / m[1]).get("bucket") or {}).get("size", 0))
        needed = eager_weight_bytes(record, int(entry["checkpoint_parameters"] or 0))
        available = memory_total_bytes() - EAGER_MEMORY_MARGIN_BYTES
        if needed > available:
            entry["eager"] = {"not_run": f"its weights alone need {needed / 2**30:.1f} GiB; this machine has "
                                         f"{memory_total_bytes() / 2**30:.1f} GiB"}
        else:
            result, output = work / "eager.json", work / "eager.npy"
            cmd = [str(python), "-m", "dsa.tools.scale", "--eager-child", subject.framework,
                   str(out_dir / smallest[1]), "--flow-steps", str(manifest.get("flow_steps") or 0),
                   "--runs", str(s.runs), "--threads", str(s.threads), "--result", str(result),
                   "--output", str(output)]
            if subject.framework == "lerobot":
                cmd += ["--policy-dir", str(Path(checkpoint).parent)]
            else:
                cmd += ["--view", str(view_file), "--checkpoint", str(checkpoint)]
            with heavy_lock(s.lock, f"{subject.key}: eager", log):
                log(f"dsa scale: {subject.key}: eager {subject.framework} (1 + {s.runs} calls) …")
                try:
                    entry["eager"] = run_child(cmd, env, result, f"{subject.key}: eager")
                except DsaError as e:
                    entry["eager"] = {"error": str(e)[:500]}
                    entry["notes"].append(f"eager: {e}")
            if output.is_file():
                import numpy as np

                want = np.load(output)
                for target, path in outputs.items():
                    entry["runtime"][target]["error_vs_eager"] = _relative_error(np.load(path), want)
    else:
        entry["eager"] = {"not_run": "--no-eager"}

    # -- the design before weightless building (sweeps, small and medium only)
    if subject.old_design:
        entry["old_design"] = measure_old_design(subject, s, work, python, env, view_file, config, manifest_file)

    if not s.keep:
        shutil.rmtree(work, ignore_errors=True)
    return entry


def _portable(args: Sequence[str], work: Path, root: Path) -> List[str]:
    """A command's arguments as the docs show them: scratch paths as <scratch>/..., the checkout's relative."""
    shown = []
    for arg in args:
        if arg.startswith(str(work)):
            arg = "<scratch>" + arg[len(str(work)):]
        elif arg == str(root):
            arg = "."
        elif arg.startswith(str(root) + os.sep):
            arg = arg[len(str(root)) + 1:]
        shown.append(arg)
    return shown


def _without(text: str, work: Path) -> str:
    return text.replace(str(work), "<scratch>")


def _shown_command(args: Sequence[str]) -> str:
    """shlex.join, leaving <scratch>/... unquoted (it is a placeholder, not a shell redirection to run)."""
    return " ".join(a if re.fullmatch(r"[\w@%+=:,./<>-]+", a) else shlex.quote(a) for a in args)


def measure_old_design(subject: Subject, s: Settings, work: Path, python: Path, env: dict, view_file: Path,
                       config: Optional[Path], manifest_file: Path) -> dict:
    """LeRobot's own initialisation as the stand-in, and the export with weights materialised."""
    from dsa.core.fileio import write_json_atomic
    from dsa.manifest.contract import load_manifest, project

    log = s.log
    old = {}
    old_dir = work / "old_design"
    old_dir.mkdir(parents=True, exist_ok=True)
    if subject.framework == "lerobot":
        cmd = stand_in_command(python, {"generator": "lerobot", "weights": "lerobot", "dtype": "float32"},
                               out=old_dir / "policy", config=config)
        with heavy_lock(s.lock, f"{subject.key}: old stand-in", log):
            log(f"dsa scale: {subject.key}: stand-in, old design (LeRobot's init, float32) …")
            try:
                made = run_stage(cmd, env, f"{subject.key}: old-design stand-in")
                old["stand-in"] = {"wall_s": round(made["wall_s"], 3), "peak_rss_kib": made["peak_rss_kib"],
                                   "how": "LeRobot's random initialisation and save_pretrained (float32)"}
            except DsaError as e:
                old["stand-in"] = {"error": str(e)[:500]}
        shutil.rmtree(old_dir / "policy", ignore_errors=True)
    # The export view of the pinned manifest (the config's pin must be the one passed).
    view = old_dir / "export_view.json"
    write_json_atomic(view, project(load_manifest(manifest_file, known_targets=sorted(
        p.stem for p in (s.root / "toolchains" / "targets").glob("*.json"))), "export"))
    policy_config = work / "stand_in" / "config.json" if subject.framework == "lerobot" else None
    cmd = [str(python), "-m", "dsa.tools.scale", "--old-export-child", str(view), str(old_dir)]
    if policy_config is not None:
        cmd += ["--config", str(policy_config)]
    for p in [str(s.root)] + s.pythonpath:
        cmd += ["--pythonpath", p]
    with heavy_lock(s.lock, f"{subject.key}: old export", log):
        log(f"dsa scale: {subject.key}: export, old design (weights materialised) …")
        try:
            made = run_stage(cmd, env, f"{subject.key}: old-design export")
            old["export"] = {"wall_s": round(made["wall_s"], 3), "peak_rss_kib": made["peak_rss_kib"],
                             "how": "export_model(..., weightless=False): the model built with its weights"}
        except DsaError as e:
            old["export"] = {"error": str(e)[:500]}
    return old


def checkpoint_elements(checkpoint: Path) -> Optional[int]:
    """The number of values in a checkpoint (every shard), from the safetensors headers."""
    import struct

    total = 0
    for path in checkpoint_files(checkpoint):
        if path.name.endswith(".json"):
            continue
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in info["shape"]:
                count *= d
            total += count
    return total


def _env_name(python: Path, s: Settings) -> str:
    if s.lerobot_python is not None and Path(python) == Path(s.lerobot_python):
        return "LeRobot environment"
    return "toolchain environment"


# -- the data file --------------------------------------------------------------------------------------------
def machine(threads: int) -> dict:
    from dsa.runtime.host import host_cpu_features, host_cpu_model

    flags = host_cpu_features() or []
    return {"cpu": host_cpu_model(), "cores": len(os.sched_getaffinity(0)), "threads": threads,
            "memory_gib": round(memory_total_bytes() / 2 ** 30, 1), "avx512": "avx512f" in flags,
            "system": f"{platform.system()} {platform.release()}",
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def toolchain(lerobot_python: Optional[Path]) -> dict:
    from importlib import metadata

    versions = {}
    for package in ("iree-base-compiler", "iree-base-runtime", "iree-turbine", "torch"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    if lerobot_python is not None and Path(lerobot_python).exists():
        code = ("import json; from importlib import metadata as m; "
                "print(json.dumps({p: m.version(p) for p in ('lerobot', 'torch', 'transformers')}))")
        try:
            proc = subprocess.run([str(lerobot_python), "-c", code], capture_output=True, text=True, timeout=120)
            versions["lerobot environment"] = json.loads(proc.stdout)
        except (subprocess.SubprocessError, ValueError):
            pass
    return versions


def merge(data: Optional[dict], entries: Sequence[dict], sweeps: Sequence[str], toolchain_versions: dict) -> dict:
    """The data file with `entries` put in place of the same keys (new keys at the end)."""
    data = dict(data or {"format": DATA_FORMAT, "subjects": [], "sweeps": {}})
    if data.get("format") != DATA_FORMAT:
        raise DsaError("docs/real-size.json", f"format {data.get('format')!r} is not {DATA_FORMAT}",
                       "measure again into a new file")
    subjects = list(data.get("subjects", []))
    keys = [e["key"] for e in subjects]
    for entry in entries:
        if entry["key"] in keys:
            subjects[keys.index(entry["key"])] = entry
        else:
            subjects.append(entry)
            keys.append(entry["key"])
    data["subjects"] = subjects
    data["sweeps"] = dict(data.get("sweeps", {}))
    for name in sweeps:
        sweep = SWEEPS[name]
        data["sweeps"][name] = {"recipe": sweep["recipe"], "old_design": sweep["old_design"],
                                "points": [{"size": p["size"], "key": p["key"], "config": p["config"],
                                            "variants": p["variants"]} for p in sweep["points"]]}
    if entries:
        data["date"] = time.strftime("%Y-%m-%d")
        data["toolchain"] = toolchain_versions
    return data


# -- rendering (pure functions of the data) -------------------------------------------------------------------
def _fmt_bytes(n) -> str:
    from dsa.tools.import_matrix import fmt_bytes

    return fmt_bytes(n)


def _fmt_count(n) -> str:
    from dsa.tools.import_matrix import fmt_count

    return fmt_count(n)


def fmt_rss(kib: Optional[int]) -> str:
    if not kib:
        return MISSING
    mib = kib / 1024
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


def fmt_seconds(s: Optional[float]) -> str:
    if s is None:
        return MISSING
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def fmt_ms(ms: Optional[float]) -> str:
    if ms is None:
        return MISSING
    if ms >= 10_000:
        return f"{ms / 1000:.1f} s"
    if ms >= 1000:
        return f"{ms / 1000:.2f} s"
    return f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def stage_kinds(entry: dict) -> Dict[str, dict]:
    """The subject's stages by kind (stand-in, export, params, bucket export, compile <target>, ...): wall time
    summed, peak the largest, in order."""
    kinds: Dict[str, dict] = {}
    for stage in entry.get("stages", []):
        name = stage["stage"]
        if name.startswith("export "):
            kind = "bucket export"
        elif name.startswith("compile "):
            kind = "compile " + name.rsplit(" ", 1)[-1]
        else:
            kind = name
        k = kinds.setdefault(kind, {"wall_s": 0.0, "peak_rss_kib": 0, "count": 0})
        k["wall_s"] += stage["wall_s"]
        k["peak_rss_kib"] = max(k["peak_rss_kib"], stage["peak_rss_kib"])
        k["count"] += 1
    return kinds


def _cell(stage: Optional[dict]) -> str:
    if not stage:
        return MISSING
    return f"{fmt_seconds(stage['wall_s'])}, {fmt_rss(stage['peak_rss_kib'])}"


def _targets(entries: Sequence[dict]) -> List[str]:
    seen: Dict[str, None] = {}
    for e in entries:
        for t in e.get("targets", []):
            seen[t] = None
    return list(seen)


def _label(entry: dict) -> str:
    if entry.get("size") in (None, "real"):
        return f"`{entry['key']}`"
    return f"`{entry['key']}` ({entry['family']}, {entry['size']})"


def render_build_table(entries: Sequence[dict]) -> str:
    targets = _targets(entries)
    header = (["model", "params (graph / checkpoint)", "checkpoint", "irpa", "vmfb", "stand-in", "export", "params",
               "bucket export"] + [f"compile {t}" for t in targets] + ["dsa compile, all"])
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for e in entries:
        if "not_measured" in e:
            lines.append("| " + " | ".join([_label(e), f"not measured: {e['not_measured'][:300]}"]
                                           + [""] * (len(header) - 2)) + " |")
            continue
        kinds = stage_kinds(e)
        vmfb = ", ".join(_fmt_bytes(e["vmfb_bytes"][t]) for t in e.get("targets", []) if t in e.get("vmfb_bytes", {}))
        peak = max((st for st in e.get("stages", []) if st["stage"] != "stand-in"),
                   key=lambda st: st["peak_rss_kib"], default=None)
        total = (f"{fmt_seconds(e['import_s'])}, peak {fmt_rss(peak['peak_rss_kib'])} ({peak['stage']})"
                 if peak and e.get("import_s") is not None else MISSING)
        cells = [_label(e), f"{_fmt_count(e.get('parameter_count'))} / {_fmt_count(e.get('checkpoint_parameters'))}",
                 _fmt_bytes(e.get("checkpoint_bytes")) + (f" ({e['checkpoint_files']} shards)"
                                                          if (e.get("checkpoint_files") or 1) > 1 else ""),
                 _fmt_bytes(e.get("irpa_bytes")), vmfb or MISSING, _cell(kinds.get("stand-in")),
                 _cell(kinds.get("export")), _cell(kinds.get("params")), _cell(kinds.get("bucket export"))]
        cells += [_cell(kinds.get(f"compile {t}")) for t in targets]
        cells.append(total)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _runtime_rows(entry: dict) -> List[Tuple[str, dict]]:
    rows = [(f"IREE {t}", entry.get("runtime", {}).get(t) or {"not_run": "not measured"})
            for t in entry.get("targets", [])]
    eager = entry.get("eager") or {"not_run": "not measured"}
    rows.append(("eager LeRobot" if entry.get("framework") == "lerobot" else "eager PyTorch", eager))
    return rows


def render_runtime_table(entries: Sequence[dict]) -> str:
    header = ["model", "runtime", "latency (median)", "first call", "load", "peak RSS (VmHWM)", "vs eager",
              "max deviation from eager", "inputs"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for e in entries:
        if "not_measured" in e:
            continue
        eager_ms = (e.get("eager") or {}).get("median_ms")
        for name, r in _runtime_rows(e):
            if "median_ms" not in r:
                why = r.get("not_run") or ("failed: " + r.get("error", "")[:120])
                lines.append(f"| {_label(e)} | {name} | {why} | | | | | | |")
                continue
            ratio = f"{r['median_ms'] / eager_ms:.2f}×" if eager_ms and not name.startswith("eager") else MISSING
            deviation = f"{r['error_vs_eager']:.1e}" if r.get("error_vs_eager") is not None else MISSING
            lines.append(f"| {_label(e)} | {name} | {fmt_ms(r['median_ms'])} (of {r['runs']}) | "
                         f"{fmt_ms(r['first_call_ms'])} | {fmt_seconds(r['load_s'])} | {fmt_rss(r['vmhwm_kib'])} | "
                         f"{ratio} | {deviation} | {r.get('inputs', '')} |")
    return "\n".join(lines) + "\n"


SWEEP_STAGES = ["stand-in", "export", "params", "bucket export", "compile", "runtime", "eager"]


def sweep_series(data: dict, name: str) -> dict:
    """The sweep's points as {"points": [(size, parameter count, entry)], "series": {line: [peak KiB or None]},
    "old": {line: [...]}} for the table and the plot. compile and runtime: the largest over targets."""
    by_key = {e["key"]: e for e in data.get("subjects", [])}
    sweep = data["sweeps"][name]
    points = [(p["size"], by_key[p["key"]]) for p in sweep["points"]
              if p["key"] in by_key and "not_measured" not in by_key[p["key"]]]
    series: Dict[str, List[Optional[int]]] = {k: [] for k in SWEEP_STAGES}
    old: Dict[str, List[Optional[int]]] = {"stand-in": [], "export": []}
    for _, e in points:
        kinds = stage_kinds(e)
        for k in SWEEP_STAGES:
            if k == "compile":
                values = [v["peak_rss_kib"] for kk, v in kinds.items() if kk.startswith("compile ")]
            elif k == "runtime":
                values = [r["vmhwm_kib"] for r in (e.get("runtime") or {}).values() if "vmhwm_kib" in r]
            elif k == "eager":
                values = [(e.get("eager") or {}).get("vmhwm_kib")] if (e.get("eager") or {}).get("vmhwm_kib") else []
            else:
                values = [kinds[k]["peak_rss_kib"]] if k in kinds else []
            series[k].append(max(values) if values else None)
        for k in old:
            value = ((e.get("old_design") or {}).get(k) or {}).get("peak_rss_kib")
            old[k].append(value)
    return {"points": [(size, e.get("parameter_count"), e) for size, e in points], "series": series, "old": old}


def render_sweep_table(data: dict, name: str) -> str:
    s = sweep_series(data, name)
    header = ["size", "params (graph)", "stand-in", "stand-in, old design", "export", "export, old design", "params",
              "bucket export", "compile", "runtime", "eager"]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for i, (size, count, e) in enumerate(s["points"]):
        def old(k):
            o = ((e.get("old_design") or {}).get(k)) or {}
            if "error" in o:
                return "failed"
            if not o:
                return "not run" + (" (OOM-killed before weightless building)" if size == "real" and k == "export"
                                    else "")
            return fmt_rss(o["peak_rss_kib"])
        cells = [f"{size} (`{e['key']}`)", _fmt_count(count), fmt_rss(s["series"]["stand-in"][i]), old("stand-in"),
                 fmt_rss(s["series"]["export"][i]), old("export"), fmt_rss(s["series"]["params"][i]),
                 fmt_rss(s["series"]["bucket export"][i]), fmt_rss(s["series"]["compile"][i]),
                 fmt_rss(s["series"]["runtime"][i]), fmt_rss(s["series"]["eager"][i])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_plot(data: dict, name: str, path: Path) -> bool:
    """Peak RSS per stage against the parameter count, one line per stage (old design dashed). False when the
    sweep has fewer than two measured points."""
    s = sweep_series(data, name)
    if len(s["points"]) < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsa.core.fileio import write_bytes_atomic

    xs = [count for _, count, _ in s["points"]]
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    markers = "osD^v<>p"
    for i, (stage, values) in enumerate(s["series"].items()):
        pts = [(x, v / 2 ** 20) for x, v in zip(xs, values) if v]
        if pts:
            ax.plot(*zip(*pts), marker=markers[i % len(markers)], label=stage)
    for stage, values in s["old"].items():
        pts = [(x, v / 2 ** 20) for x, v in zip(xs, values) if v]
        if pts:
            ax.plot(*zip(*pts), linestyle="--", marker="x", label=f"{stage}, old design")
    memory = memory_of(data) / 2 ** 30 or 23.5
    ax.axhline(memory, color="grey", linewidth=0.8, linestyle=":")
    ax.text(xs[0], memory * 0.98, f"machine memory ({memory:.1f} GiB)", fontsize=8, color="grey", va="top")
    sizes = [size for size, _, _ in s["points"]]
    if "real" in sizes and "real" not in data["sweeps"][name].get("old_design", []):
        ax.annotate("old-design export:\nOOM-killed", (xs[sizes.index("real")], memory), fontsize=8, color="grey",
                    ha="right", va="top", xytext=(-6, -4), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{size}\n{_fmt_count(count)}" for size, count, _ in s["points"]], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel(f"parameters the graph reads ({name.upper()}, LeRobot)")
    ax.set_ylabel("peak RSS (GiB)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    first = s["points"][-1][2].get("machine", {})
    ax.set_title(f"{name.upper()}: peak memory per stage — {first.get('cpu', '')}, {first.get('cores', '')} cores",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plot.png"
        fig.savefig(out, metadata={"Software": None})  # no version or date in the PNG
        write_bytes_atomic(path, out.read_bytes())
    plt.close(fig)
    return True


def memory_of(data: dict) -> int:
    for e in data.get("subjects", []):
        gib = (e.get("machine") or {}).get("memory_gib")
        if gib:
            return int(gib * 2 ** 30)
    return 0


def _notes(entries: Sequence[dict]) -> List[str]:
    return [f"* `{e['key']}`: {note}" for e in entries for note in e.get("notes", [])]


def _subjects(data: dict) -> Tuple[List[dict], List[dict]]:
    """(real-size subjects, sweep-only points): a sweep's real point is a subject of its own."""
    entries = data.get("subjects", [])
    return [e for e in entries if e.get("size") in (None, "real")], [e for e in entries if e.get("size") not in (None, "real")]


def render_document(data: dict, plot: Optional[str] = None) -> str:
    real, points = _subjects(data)
    dates = sorted({e["date"] for e in data.get("subjects", [])})
    machines = sorted({f"{e['machine']['cpu']}, {e['machine']['cores']} cores, {e['machine']['memory_gib']} GiB, "
                       f"AVX-512 {'yes' if e['machine'].get('avx512') else 'no'}" for e in data.get("subjects", [])})
    commands = list(dict.fromkeys(e["command"] for e in data.get("subjects", [])))
    lines = [
        "# Real sizes: time and memory per stage, runtime and eager",
        "",
        "<!-- Generated by dsa/tools/scale.py (`bazel run //tools:scale`) from docs/real-size.json: do not edit "
        "by hand. -->",
        "",
        "Every real-size model through the pipeline as a user without Bazel builds it (`dsa compile --no-cache` "
        "from its manifest and a seeded stand-in checkpoint), each stage a process of its own, then the compiled "
        "modules and the framework's own eager model at batch 1. Numbers from one shared machine: rough figures, "
        "not a benchmark.",
        "",
        "## Build: wall time and peak RSS per stage",
        "",
        render_build_table(real),
        "* **params**: what the compiled graph reads (the export record's parameter count) / the values in the "
        "checkpoint (a LeRobot PI0 checkpoint also holds the action expert's unused LM head).",
        "* **stand-in**: the seeded checkpoint made by the rules' own generator (`weights` in the JSON: generator, "
        "dtype, shards); **export**, **params**, **bucket export**, **compile**: the stages of `dsa compile` "
        "(`timings.json`: each stage's process's wall time and peak RSS, wait4's `ru_maxrss`; a bucket export or a "
        "compile per bucket summed, the peak the largest); **dsa compile, all**: its whole run, with the largest "
        "stage peak.",
        "* kB/MB/GB are powers of 1000; MiB/GiB of 1024.",
        "",
        "## Runtime at batch 1",
        "",
        render_runtime_table(real),
        "* **IREE &lt;target&gt;**: the module index in a process of its own (`dsa.runtime.policy.CompiledPolicy`, "
        "no torch); **eager**: LeRobot's own policy class (`load_pretrained_mapped`: one copy of the weights, "
        "widened to float32) or the PyTorch model (`eager_policy`), in the subject's environment, in another "
        "process. Each: the load, the first call (module load, first touch of the weights), then the median of "
        "further calls; **peak RSS** is the process's own VmHWM (`/proc/self/status` at its end), not its "
        "parent's rusage. Both sides use every core (torch threads and IREE's task workers = cores).",
        "* **max deviation from eager**: max |IREE − eager| / max(1, max |eager|) on the same inputs.",
        "",
    ]
    for name in data.get("sweeps", {}):
        sweep = data["sweeps"][name]
        lines += [
            f"## {name.upper()} at three sizes: peak RSS per stage against the parameter count",
            "",
            render_sweep_table(data, name),
            f"Each size is built with {sweep['recipe']}'s recipe (precision, buckets, targets, tuning, the "
            "seeded bf16 stand-in); only the policy config and the inputs it implies differ:",
            "",
        ]
        by_key = {e["key"]: e for e in data.get("subjects", [])}
        for p in sweep["points"]:
            described = by_key[p["key"]]["description"] if p["key"] in by_key else "not measured"
            lines.append(f"* {p['size']} (`{p['key']}`): {described}")
        lines += [
            "",
            "**old design**: the same size built as before weightless building — the stand-in by LeRobot's "
            "own random initialisation and `save_pretrained` (float32, the whole model in memory), the export "
            "with the model's weights materialised (`export_model(..., weightless=False)`); measured at "
            f"{' and '.join(sweep['old_design'])} size only (at real size that export was OOM-killed on this "
            "24 GiB machine). compile and runtime: the largest over the targets.",
            "",
        ]
        if plot:
            lines += [f"![peak RSS per stage against parameter count]({plot})", ""]
        if points:
            lines += ["Build and runtime of the smaller sizes:", "", render_build_table(points),
                      render_runtime_table(points)]
    notes = _notes(data.get("subjects", []))
    if notes:
        lines += ["## Notes", "", *notes, ""]
    toolchain_versions = data.get("toolchain", {})
    lerobot_env = toolchain_versions.get("lerobot environment", {})
    lines += [
        "## How it was made",
        "",
        "```sh",
        *commands,
        "```",
        "",
        f"* dates: {', '.join(dates) or MISSING}",
        f"* machine: {'; '.join(machines) or MISSING}",
        f"* toolchain: iree-base-compiler {toolchain_versions.get('iree-base-compiler', MISSING)}, iree-base-runtime "
        f"{toolchain_versions.get('iree-base-runtime', MISSING)}, iree-turbine {toolchain_versions.get('iree-turbine', MISSING)}, "
        f"torch {toolchain_versions.get('torch', MISSING)}"
        + (f"; LeRobot environment: lerobot {lerobot_env.get('lerobot')}, torch {lerobot_env.get('torch')}, "
           f"transformers {lerobot_env.get('transformers')}" if lerobot_env else ""),
        "* every measured step held the machine's heavy-work lock (`--lock`), so no other heavy job ran beside it;"
        " the per-subject commands are in docs/real-size.json (`compile_command`, `weights.command`).",
        "",
    ]
    return "\n".join(lines)


def render_results_section(data: dict) -> str:
    """bench/RESULTS.md's "Real sizes" section (between the markers)."""
    real, _ = _subjects(data)
    dates = sorted({e["date"][:10] for e in real})
    return "\n".join([
        "## Real sizes",
        "",
        f"Real-size models built by `dsa compile --no-cache` from a seeded stand-in, each stage a process of its "
        f"own, then run at batch 1 against eager — rendered by `dsa scale` (dsa/tools/scale.py) from "
        f"docs/real-size.json ({', '.join(dates) or MISSING}); method, the PI0 size sweep and its plot: "
        "[docs/real-size.md](../docs/real-size.md).",
        "",
        render_build_table(real),
        render_runtime_table(real),
    ])


def replace_marked(text: str, section: str) -> str:
    """`text` with the real-size markers' content replaced by `section`; with no markers, the marked section
    is put before "## Quantised matmuls" (else at the end)."""
    block = f"{BEGIN_MARKER}\n{section.rstrip()}\n{END_MARKER}"
    begin, end = text.find(BEGIN_MARKER), text.find(END_MARKER)
    if begin >= 0 and end > begin:
        return text[:begin] + block + text[end + len(END_MARKER):]
    if begin >= 0 or end >= 0:
        raise DsaError("bench/RESULTS.md", "has only one of the real-size markers",
                       f"put both {BEGIN_MARKER} and {END_MARKER} on lines of their own, or neither")
    anchor = re.search(r"^## Quantised matmuls", text, re.M)
    if anchor:
        return text[:anchor.start()] + block + "\n\n" + text[anchor.start():]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def write_outputs(data: dict, out_dir: Path, results: Optional[Path]) -> List[Path]:
    from dsa.core.fileio import write_bytes_atomic, write_json_atomic

    written = [out_dir / "real-size.json"]
    write_json_atomic(out_dir / "real-size.json", data)
    plot = None
    for name in data.get("sweeps", {}):
        if render_plot(data, name, out_dir / "real-size-rss.png"):
            plot = "real-size-rss.png"
            written.append(out_dir / plot)
    write_bytes_atomic(out_dir / "real-size.md", render_document(data, plot).encode("utf-8"))
    written.append(out_dir / "real-size.md")
    if results is not None:
        text = results.read_text(encoding="utf-8") if results.is_file() else ""
        write_bytes_atomic(results, replace_marked(text, render_results_section(data)).encode("utf-8"))
        written.append(results)
    return written


# -- entry point ----------------------------------------------------------------------------------------------
def workspace_root() -> Path:
    """The checkout measured and written to: the workspace `bazel run` was called from, else this one."""
    return Path(os.environ.get("BUILD_WORKSPACE_DIRECTORY") or Path(__file__).resolve().parents[2])


def _weights_args(values: Sequence[str]) -> Dict[str, Path]:
    given = {}
    for value in values:
        key, sep, path = value.partition("=")
        if not sep or not path:
            raise DsaError("--weights", f"'{value}' is not MODEL_ID=PATH")
        given[key] = Path(path)
    return given


def _child_main(a: argparse.Namespace) -> bool:
    """The measured children (hidden flags): True when this process was one."""
    if a.runtime_child:
        runtime_child(Path(a.runtime_child), a.runs, a.threads, Path(a.result), Path(a.output))
    elif a.eager_child:
        framework, record = a.eager_child
        eager_child(framework, Path(record), a.flow_steps or None, a.runs, a.threads, Path(a.result),
                    Path(a.output), policy_dir=a.policy_dir and Path(a.policy_dir), view=a.view and Path(a.view),
                    checkpoint=a.checkpoint and Path(a.checkpoint))
    elif a.count_child:
        framework, view, result = a.count_child
        count_child(framework, Path(view), Path(result), config=a.config and Path(a.config), pythonpath=a.pythonpath)
    elif a.old_export_child:
        view, out_dir = a.old_export_child
        old_export_child(Path(view), Path(out_dir), a.config and Path(a.config), a.pythonpath)
    else:
        return False
    return True


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa scale", description=__doc__.splitlines()[0])
    parser.add_argument("manifests", nargs="*", type=Path, help="the subjects' manifests")
    parser.add_argument("--sweep", action="append", default=[], choices=sorted(SWEEPS),
                        help="measure a family at three sizes (and the old design where it fits), with the plot")
    parser.add_argument("--real-size-index", action="store_true",
                        help="every manifest of //models:policies_real_size_index (bazel-bin, or --bin)")
    parser.add_argument("--root", type=Path, help="the checkout whose manifests, model code, policy configs, "
                        "target specs and tuning files are used (default: the workspace `bazel run` was called "
                        "from, else this checkout)")
    parser.add_argument("--bin", type=Path, help="bazel-bin (default: <root>/bazel-bin)")
    parser.add_argument("--weights", action="append", default=[], metavar="MODEL_ID=PATH",
                        help="given weights instead of a stand-in: a LeRobot policy directory, a .safetensors file "
                        "or a sharded checkpoint's index")
    parser.add_argument("--target", action="append", default=[], dest="targets", metavar="NAME",
                        help="build only these of each manifest's targets (default: every one)")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS,
                        help=f"timed calls after the first, runtime and eager (default {DEFAULT_RUNS})")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--lock", type=Path, default=DEFAULT_LOCK,
                        help=f"the heavy-work lock held by every measured step (default {DEFAULT_LOCK})")
    parser.add_argument("--no-lock", action="store_true", help="take no lock")
    parser.add_argument("--lock-per", choices=("step", "subject"), default="step",
                        help="hold the lock for each measured step (default: other heavy jobs may run between a "
                        "subject's steps) or for a whole subject (its steps back to back)")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a new one in $TMPDIR)")
    parser.add_argument("--keep", action="store_true", help="keep each subject's scratch (stand-in, build)")
    parser.add_argument("--max-scratch-gb", type=float, default=DEFAULT_MAX_SCRATCH_GB,
                        help="refuse a subject whose stand-in and archive would need more scratch (0: no check)")
    parser.add_argument("--no-runtime", action="store_true")
    parser.add_argument("--no-eager", action="store_true")
    parser.add_argument("--only-missing", action="store_true",
                        help="skip subjects already in the data file (resume a run)")
    parser.add_argument("--lerobot-python", type=Path, default=os.environ.get("DSA_LEROBOT_PYTHON") or None,
                        help="the LeRobot environment's interpreter (default: $DSA_LEROBOT_PYTHON, the runfiles, "
                        "bazel-bin's output base)")
    parser.add_argument("--pythonpath", action="append", default=[], help="more directories with model code")
    parser.add_argument("--out-dir", type=Path, help="where real-size.{json,md,png} go (default: <workspace>/docs)")
    parser.add_argument("--results", type=Path, help="the RESULTS.md whose marked section is written "
                        "(default: <workspace>/bench/RESULTS.md; --results '' for none)")
    parser.add_argument("--render", action="store_true", help="measure nothing: render the docs from the data file")
    # The measured children (this module run again).
    parser.add_argument("--runtime-child", help=argparse.SUPPRESS)
    parser.add_argument("--eager-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--count-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--old-export-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--flow-steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--policy-dir", help=argparse.SUPPRESS)
    parser.add_argument("--view", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if _child_main(a):
        return
    if a.runs < 1:
        raise DsaError("--runs", f"{a.runs} is not a positive number of calls")
    root = Path(os.path.abspath(a.root or workspace_root()))
    bin_dir = a.bin or root / "bazel-bin"
    out_dir = a.out_dir or root / "docs"
    results = None if a.results == Path("") else (a.results or root / "bench" / "RESULTS.md")
    data_path = out_dir / "real-size.json"
    from dsa.core.fileio import read_json

    data = read_json(data_path) if data_path.is_file() else None
    if a.render:
        if data is None:
            raise DsaError(str(data_path), "does not exist", "measure first")
        for path in write_outputs(data, out_dir, results):
            print(f"dsa scale: wrote {path}")
        return

    weights = _weights_args(a.weights)
    subjects: List[Subject] = []
    for name in a.sweep:
        subjects += sweep_subjects(name, root)
    manifests = [m if m.is_absolute() else Path.cwd() / m for m in a.manifests]
    if a.real_size_index:
        manifests += real_size_manifests(bin_dir, root)
    for manifest in manifests:
        model_id = _read_manifest_data(manifest)["model_id"]
        subjects.append(manifest_subject(manifest, root, weights.get(model_id)))
    unique: Dict[str, Subject] = {}
    for subject in subjects:
        unique.setdefault(subject.key, subject)
    subjects = list(unique.values())
    if not subjects:
        raise DsaError("dsa scale", "no subject", "name manifests, --sweep FAMILY or --real-size-index (or --render)")
    if a.only_missing and data:
        done = {e["key"] for e in data.get("subjects", []) if "not_measured" not in e}
        subjects = [s for s in subjects if s.key not in done]

    lerobot_python = a.lerobot_python
    if lerobot_python is None:
        lerobot_python = next((c for c in lerobot_python_candidates(root, bin_dir) if c.exists()), None)
    args = list(sys.argv[1:] if argv is None else argv)
    command = ("./bazelw run //tools:scale" + (" -- " + shlex.join(args) if args else "")
               if os.environ.get("BUILD_WORKSPACE_DIRECTORY") else "bin/dsa scale " + shlex.join(args))
    work = a.work or Path(tempfile.mkdtemp(prefix="dsa-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    lock = None if a.no_lock else a.lock
    settings = Settings(root=root, work=work, lock=lock if a.lock_per == "step" else None, runs=a.runs,
                        threads=a.threads,
                        toolchain_python=Path(sys.executable), lerobot_python=lerobot_python,
                        pythonpath=[str(Path(p).resolve()) for p in a.pythonpath], targets=a.targets or None,
                        runtime=not a.no_runtime, eager=not a.no_eager, keep=a.keep,
                        max_scratch_bytes=int(a.max_scratch_gb * 1e9) if a.max_scratch_gb > 0 else None,
                        log=lambda m: print(m, file=sys.stderr, flush=True))
    versions = toolchain(lerobot_python)
    failed = []
    for subject in subjects:
        started = time.monotonic()
        try:
            with heavy_lock(lock if a.lock_per == "subject" else None, subject.key, settings.log):
                entry = measure_subject(subject, settings, command)
        except DsaError as e:
            print(f"dsa scale: {subject.key}: not measured: {e}", file=sys.stderr, flush=True)
            failed.append(f"{subject.key}: {e}")
            shutil.rmtree(work / subject.key, ignore_errors=True)
            measured = {x["key"] for x in (data or {}).get("subjects", []) if "not_measured" not in x}
            if subject.key in measured:
                continue  # an earlier measurement stays
            entry = {"key": subject.key, "model_id": subject.model_id, "manifest": _relative(subject.source, root),
                     "framework": subject.framework, "description": subject.description, "family": subject.family,
                     "size": subject.size, "date": time.strftime("%Y-%m-%d %H:%M"), "command": command,
                     "machine": machine(settings.threads), "notes": [], "not_measured": _without(str(e), work)}
        data = merge(data, [entry], [n for n in a.sweep], versions)
        write_outputs(data, out_dir, results)
        print(f"dsa scale: {subject.key}: measured in {time.monotonic() - started:.0f} s; wrote {data_path}",
              file=sys.stderr, flush=True)
    if data is not None:
        real, _ = _subjects(data)
        print(render_build_table(real))
        print(render_runtime_table(real))
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    if failed:
        raise DsaError("dsa scale", f"{len(failed)} subject(s) not measured: " + "; ".join(failed))


if __name__ == "__main__":
    run_cli(main, "dsa scale")
