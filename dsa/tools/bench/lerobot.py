"""LeRobot policies: each policy the repository builds, its shipped module against LeRobot's own eager
inference (and ONNX Runtime, torch.compile), and its whole-pipeline bundle end to end against LeRobot's loop.
Runs in the LeRobot environment: the benchmark's cli starts `-m dsa.tools.bench --lerobot-only` under that
interpreter. The tuner times policies on the same case (`policy_case`)."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from dsa.core.errors import DsaError, one_line
from dsa.core.fileio import read_json, sha256_file
from dsa.core.formats import PoliciesIndex
from dsa.core.lerobot_types import LEROBOT_TYPES
from dsa.core.runtime_flags import merge_runtime_flags
from dsa.runtime import iree_flags
from dsa.runtime.policy import read_module_index
from dsa.tools.bench.runtimes import ORT_SPINNING, measure_spinning_ort, ort_session, runfiles_python
from dsa.tools.bench.timing import QUIET_WAIT_S, load_average, measure_interleaved, parity, policy_goal, \
    wait_for_quiet

POLICIES_INDEX = "models/policies_index.json"


@dataclasses.dataclass
class Policy:
    """One LeRobot policy the repository builds: its module index and its LeRobot policy directory."""

    name: str
    index: Path
    policy_dir: Path
    # The policy this build is a level of (dsa_policy's `levels`: `<name>` holds it), or None.
    level_of: Optional[str] = None


def lerobot_policies(root: Path) -> List[Policy]:
    """The LeRobot policies of the policies index (models/BUILD.bazel's dsa_policies), in its order."""
    path = root / POLICIES_INDEX
    if not path.is_file():
        raise DsaError(str(path), "no policies index", "run the benchmark with `bazel run //bench`, which builds it")
    rows = PoliciesIndex.read(path)["policies"]
    return [Policy(r["name"], root / r["index"], (root / r["policy_config"]).parent, r.get("level_of"))
            for r in rows if r.get("policy_config")]


def eager_lerobot(policy, names: List[str], steps: Optional[int]):
    """LeRobot's own eager inference on one policy (what a robot runs without rules_dsa), as a torch module
    of positional tensors, so ONNX Runtime and torch.compile get exactly the same computation."""
    import torch

    from dsa.frontends.lerobot import POLICY_TYPES

    reference = POLICY_TYPES[policy.config.type].reference

    class EagerLeRobot(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.policy = policy

        def forward(self, *tensors):
            return reference(self.policy, dict(zip(names, tensors)), steps)

    return EagerLeRobot().eval()


def onnx_candidates(eager, policy, steps: Optional[int]):
    """What ONNX Runtime runs for a LeRobot policy: its eager call, exported by torch's ONNX exporter; for
    Diffusion Policy, whose eager sampling loop does not export (its scheduler indexes tables with
    data-dependent timesteps), next the front end's unrolled form of the same call (LeRobot's own
    generate_actions with the timesteps pinned as ints; equal to eager in dsa.frontends.lerobot's tests) when
    the step count is the config's — for every type of kind `denoising` (dsa.core.lerobot_types). Each is checked
    against eager in the same run."""
    yield eager
    denoising = LEROBOT_TYPES[policy.config.type].kind == "denoising"
    if denoising and steps in (None, policy.diffusion.num_inference_steps):
        yield _unrolled_with_constant_table(policy)


def _unrolled_with_constant_table(policy):
    """The front end's unrolled Diffusion Policy with its DDIM table (`alphas_cumprod`, computed in the graph
    for IREE) as a constant: torch's ONNX exporter lowers `cumprod` to `prims.prod`, which has no ONNX
    function. The constant is the same float32 table (bit-identical to diffusers'), computed once here."""
    import unittest.mock

    import torch

    from dsa.frontends.lerobot import POLICY_TYPES

    diffusion = POLICY_TYPES[policy.config.type]  # a denoising type's front end: alphas_cumprod, adapter
    cfg = policy.config
    table = diffusion.alphas_cumprod(cfg.num_train_timesteps, cfg.beta_schedule, cfg.beta_start, cfg.beta_end)
    unrolled = diffusion.adapter(policy, "unrolled").eval()

    class ConstantTable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unrolled = unrolled

        def forward(self, *args):
            with unittest.mock.patch.object(diffusion, "alphas_cumprod", lambda *schedule: table):
                return self.unrolled(*args)

    return ConstantTable().eval()


def policy_case(policy: Policy, compiled):
    """The case a LeRobot policy is timed on (the benchmark's and the tuner's): batch-1 inputs sampled from
    its smallest module's record (seeded), the runtime's default step count where the module takes one, and
    eager LeRobot on the same inputs. Returns (inputs, observation names, steps, the LeRobot policy, the
    eager module, its tensor arguments, its output as float64)."""
    import torch

    from dsa.frontends.lerobot import load_pretrained
    from dsa.runtime.policy import sample_inputs

    record = compiled.modules[0].record
    inputs = sample_inputs(record, {"batch": 1}, np.random.default_rng(0))
    names = [spec["name"] for spec in record["inputs"]]
    steps = None
    if "steps" in names:
        steps = int(compiled.runtime_view.get("flow_steps") or 10)
        inputs["steps"] = np.array(steps, dtype=np.int64)
    observation = [n for n in names if n != "steps"]
    policy_obj = load_pretrained(policy.policy_dir)
    eager = eager_lerobot(policy_obj, observation, steps)
    args = [torch.from_numpy(np.asarray(inputs[n])) for n in observation]
    with torch.no_grad():
        ref = eager(*args).numpy().astype(np.float64)
    return inputs, observation, steps, policy_obj, eager, args, ref


def bench_policy(policy: Policy, *, runs: int, warmup: int, threads: int, work: Path, with_ort: bool = True,
                 with_compile: bool = True, wait_s: float = QUIET_WAIT_S) -> dict:
    """The policy's shipped module (its smallest bucket, batch 1, the runtime's default step count) against
    eager LeRobot, ONNX Runtime and torch.compile on the same inputs, in alternating rounds."""
    import torch

    from dsa.runtime.policy import CompiledPolicy

    torch.set_num_threads(threads)
    compiled = CompiledPolicy(policy.index)
    module = compiled.modules[0]
    inputs, observation, steps, policy_obj, eager, args, ref = policy_case(policy, compiled)
    case = ", ".join(["batch=1"] + ([f"steps={steps}"] if steps is not None else []))
    errors: Dict[str, str] = {}
    fns: Dict[str, Callable[[], object]] = {"eager": lambda: eager(*args),
                                            "vmfb": lambda: compiled.run(inputs)}
    checks = {"eager": parity(ref, ref), "vmfb": parity(compiled.run(inputs)[0][0], ref)}
    spinning = None
    if with_ort:
        for candidate in onnx_candidates(eager, policy_obj, steps):
            try:
                session, feeds = ort_session(candidate, args, observation, work / f"{policy.name}.onnx", threads)
                feed = {f: np.asarray(inputs[n]) for f, n in zip(feeds, observation)}
                checks["onnxruntime"] = parity(session.run(None, feed)[0], ref)
                fns["onnxruntime"] = lambda: session.run(None, feed)
                spinning = work / f"{policy.name}.onnx"  # timed alone, after the others (measure_spinning_ort)
                errors.pop("onnxruntime", None)
                break
            except Exception as e:  # reported, not fatal: not every policy exports to ONNX
                errors.setdefault("onnxruntime", one_line(e))
    compile_s = None
    if with_compile:
        try:
            fast = torch.compile(eager)
            start = time.perf_counter()
            with torch.no_grad():
                out = fast(*args).numpy()
            compile_s = round(time.perf_counter() - start, 2)
            checks["torch.compile"] = parity(out, ref)
            fns["torch.compile"] = lambda: fast(*args)
        except Exception as e:
            errors["torch.compile"] = one_line(e)
    quiet = wait_for_quiet(wait_s=wait_s)
    with torch.no_grad():
        timings = measure_interleaved(fns, warmup=warmup, runs=runs)
    if spinning is not None:
        try:
            timings[ORT_SPINNING], checks[ORT_SPINNING] = measure_spinning_ort(
                spinning, threads, inputs, observation, ref, warmup=warmup, runs=runs)
        except Exception as e:  # reported, not fatal, as for the first session
            errors[ORT_SPINNING] = one_line(e)
    runtimes = {name: dict(timing, parity=checks[name]) for name, timing in timings.items()}
    goal = policy_goal(compiled.index["target"], runtimes)
    bucket = module.bucket
    return {
        "model": policy.name,
        "target": compiled.index["target"],
        "module": module.vmfb.name,
        # The module timed, by content: the import matrix takes this latency for the build with these bytes.
        "vmfb_sha256": sha256_file(module.vmfb),
        "bucket": {bucket["dim"]: bucket["size"]} if bucket else None,
        "case": case,
        "runtimes": runtimes,
        "goal": goal,
        "load": {"before": quiet, "after": round(load_average(), 2)},
        "errors": errors,
        "torch_compile_s": compile_s,
    }


def pipeline_bundle(root: Path, name: str) -> Optional[Path]:
    """The policy's whole-pipeline bundle (//models:<name>_pipeline_bundle) in the runfiles, if it is built."""
    path = root / "models" / f"{name}_pipeline_bundle.tar"
    return path if path.is_file() else None


def bench_end_to_end(policy: Policy, bundle: Path, *, runs: int, warmup: int, threads: int) -> dict:
    """Raw observation → raw action, one inference step (the action queue empty, so the network runs): the
    bundle's pipeline in the runtime (dsa.runtime.load: prepare, LeRobot's processors in numpy / tokenizers,
    the module, the postprocessor) against LeRobot's own loop on the same raw observation
    (`predict_action`: prepare_observation_for_inference, preprocessor, select_action, postprocessor), each
    `reset()` first, in alternating rounds."""
    import copy

    import torch

    import dsa.runtime
    from dsa.frontends.lerobot import load_pretrained
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.utils.control_utils import predict_action

    torch.set_num_threads(threads)
    ours = dsa.runtime.load(bundle, seed=0)
    try:
        spec = ours.pipeline.spec
        rng = np.random.default_rng(0)
        obs = {k: rng.integers(0, 256, size=v["shape"], dtype=np.uint8) if v["dtype"] == "uint8"
               else rng.normal(size=v["shape"]).astype(np.float32)
               for k, v in spec["observation"].items() if k != "task"}
        task = "pick up the red cube and place it in the bin" if "task" in spec["observation"] else None
        theirs = load_pretrained(policy.policy_dir)
        processors = ours.bundle.root  # the bundle's own processor files (and tokenizer)
        overrides = ({"tokenizer_processor": {"tokenizer_name": str(processors)}} if task is not None else {})
        pre, post = make_pre_post_processors(theirs.config, pretrained_path=str(processors),
                                             preprocessor_overrides=overrides)

        # The same noise on both sides (the bundle draws from np.random.default_rng(seed), restarted by reset()),
        # so the two raw actions can be compared.
        noise = spec["loop"]["noise"]
        draws = {"rng": np.random.default_rng(0)}

        def draw(*_):
            return torch.from_numpy(draws["rng"].standard_normal(noise["shape"], dtype=np.float32))

        if noise is not None and LEROBOT_TYPES[theirs.config.type].noise == "argument":
            original = theirs.predict_action_chunk
            theirs.predict_action_chunk = lambda batch, noise=None: original(batch, noise=draw())
        elif noise is not None:
            theirs.model.sample_noise = draw

        def lerobot_step():
            theirs.reset()
            draws["rng"] = np.random.default_rng(0)
            return predict_action(copy.deepcopy(obs), theirs, torch.device("cpu"), pre, post, use_amp=False,
                                  task=task, robot_type=None)

        def bundle_step():
            ours.reset()
            return ours.select_action(obs, task=task)

        with torch.no_grad():
            ref = lerobot_step().numpy().reshape(-1).astype(np.float64)
            checks = {"lerobot": parity(ref, ref), "bundle": parity(bundle_step(), ref)}
            timings = measure_interleaved({"lerobot": lerobot_step, "bundle": bundle_step}, warmup=warmup,
                                          runs=runs)
        ours.reset()
        ours.select_action(obs, task=task)
        order = [n["name"] for n in spec["nodes"]]
        nodes = [[name, round(s * 1e3, 3)] for name, s in sorted(
            ours.pipeline.timings.items(), key=lambda item: order.index(item[0]) if item[0] in order else -1)]
    finally:
        ours.close()
    return {
        "bundle": bundle.name,
        "lerobot": dict(timings["lerobot"], parity=checks["lerobot"]),
        "bundle_ms": dict(timings["bundle"], parity=checks["bundle"]),
        "ratio": round(timings["bundle"]["median_ms"] / timings["lerobot"]["median_ms"], 3),
        "nodes_ms": nodes,
    }


def policy_parameters(index: Path) -> int:
    """The parameter count of a module index's first module (its export record)."""
    from dsa.core.formats import ExportRecord, ModuleIndex

    first = ModuleIndex.read(index).modules[0][1]
    return int(ExportRecord.read(index.parent / first)["parameter_count"])


def shipped_build(index: Path) -> Path:
    """The module index a runner loads for `index` on this machine: the most capable of its levels it runs."""
    from dsa.runtime.policy import choose_level

    return choose_level(index).index


def not_runnable(index: Path) -> Optional[dict]:
    """{"target", "not_run": why} for a module index whose target this machine cannot execute (an AVX-512
    build on an AVX2 CPU), else None."""
    from dsa.core.formats import ModuleIndex
    from dsa.runtime.host import host_arch, host_cpu_features, missing_for

    spec = read_json(index.parent / ModuleIndex.read(index).target_spec)
    why = missing_for(spec, host_arch(), host_cpu_features())
    return None if why is None else {"target": spec["name"], "not_run": why}


# Light mode (CI, `--light`): every model and policy is its shipped module against eager only (no ONNX Runtime,
# no torch.compile, no ablation builds, no profile: together they took > 30 min of CI on 2 cores), and the
# quantised layers only at a decode step. A policy with at least FULL_SIZE_PARAMETERS parameters also gets only
# LIGHT_FULL_SIZE_RUNS calls (SmolVLA at SmolVLM2-500M size, ~450M: ~9 s per eager call; the threshold is above
# Diffusion Policy's 263M, whose call takes ~3 s and whose ONNX export minutes). `bazel run //bench` runs all.
FULL_SIZE_PARAMETERS = 300_000_000
LIGHT_FULL_SIZE_RUNS = 3
LIGHT_NOTE = "not measured in light mode: run `bazel run //bench`"
# ... and it does not wait for a quiet machine (on CI's 2 cores the bench itself keeps the load near 2, so
# every policy would wait the whole QUIET_WAIT_S): the load is still reported beside each row.


def run_lerobot_benchmark(root: Path, *, models: Optional[Sequence[str]], runs: int, warmup: int,
                          threads: int, light: bool = False, full_size_light: bool = False) -> List[dict]:
    """The LeRobot half of `bazel run //bench`, run in the LeRobot environment: one row per policy."""
    iree_flags.set_task_threads(threads)
    policies = lerobot_policies(root)
    # Each policy once, as a user runs it: `<name>`'s index, whose build the runner chooses among its levels
    # (the levels' own rows are measured when named).
    policies = [p for p in policies if p.name in set(models)] if models else [p for p in policies if not p.level_of]
    # One IREE runtime for every policy of this process, set up before the first device with the runtime
    # flags (a worker stack) the most demanding module that runs here needs.
    iree_flags.require(merge_runtime_flags(read_module_index(shipped_build(p.index)).get("runtime_flags", [])
                                           for p in policies if not_runnable(p.index) is None), "dsa bench")
    rows = []
    with tempfile.TemporaryDirectory(prefix="dsa-bench-lerobot-") as tmp:
        for policy in policies:
            not_here = not_runnable(policy.index)
            if not_here is not None:
                print(f"dsa-bench: {policy.name} (LeRobot): not run on this machine: {not_here['not_run']}",
                      flush=True)
                rows.append(dict(model=policy.name, **not_here))
                continue
            full_size = (light or full_size_light) and policy_parameters(policy.index) >= FULL_SIZE_PARAMETERS
            eager_only = light or full_size
            print(f"dsa-bench: {policy.name} (LeRobot{', light: vs eager only' if eager_only else ''}) …",
                  flush=True)
            row = bench_policy(policy, runs=LIGHT_FULL_SIZE_RUNS if full_size else runs,
                               warmup=min(warmup, 1) if full_size else warmup, threads=threads, work=Path(tmp),
                               with_ort=not eager_only, with_compile=not eager_only,
                               wait_s=0 if light else QUIET_WAIT_S)
            if eager_only:
                row["errors"].update({k: LIGHT_NOTE for k in ("onnxruntime", "torch.compile")})
            bundle = pipeline_bundle(root, policy.name)
            if bundle is not None:
                print(f"dsa-bench: {policy.name} end to end (raw observation → raw action) …", flush=True)
                try:
                    row["end_to_end"] = bench_end_to_end(policy, bundle, runs=runs, warmup=warmup, threads=threads)
                except Exception as e:  # reported, not fatal
                    row["errors"]["end_to_end"] = one_line(e)
            rows.append(row)
    return rows


def lerobot_python(root: Path) -> Optional[Path]:
    """The LeRobot environment's interpreter in this binary's runfiles (None outside Bazel)."""
    return runfiles_python(root, "dsa_lerobot_python")
