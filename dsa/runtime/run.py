"""dsa run: run a compiled policy on an observation (or a generated sample) and report its action chunk.

    dsa run --index bazel-bin/models/pi0.modules.json --prompt-len 20 --steps 1 5 10
    dsa run BUNDLE pi0_bundle.tar --steps 1 10     # a release bundle (dsa_bundle), verified first
    dsa run pi0_fleet_bundle.tar [--target x86_64-v3]   # a multi-target bundle: the first target that runs here

The runner picks the smallest shape bucket that holds the observation, pads it, runs the requested number
of flow steps through the one compiled loop, and prints the action chunk and latency percentiles.

A bundle with the policy's whole pipeline (docs/policy-pipeline.md) runs raw observations to raw actions:

    dsa run act_pipeline_bundle.tar --observation episode.npz [--task TEXT] [--profile] [--out actions.npy]

`--observation` holds the raw observation (camera frames uint8 (H, W, C), the raw state), or an episode:
the same arrays with a leading step axis, run step by step through the action queue; without it a sample
episode of 2 x n_action_steps steps is generated. `--profile` prints each pipeline node's time per control
step (mean and p90 over the steps); `--out` writes the raw actions ([steps, action dim], .npy).

With --bundle it first verifies the archive (its sha256 against NAME.sha256 beside it when present, its
format, every file against bundle.json; see dsa/runtime/bundle.py), extracts it to a temporary directory and runs
the bundle's own module index; a corrupted, truncated or unsupported bundle is refused (exit 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional

import numpy as np

from dsa.core.errors import DsaError, run_cli
from dsa.runtime.policy import CompiledPolicy, sample_inputs


# No observation input may be larger than this, whatever its record allows (a dynamic batch is exported with a
# bound of 65536): a robot's observation is megabytes, and an input this size is a mistake or an attack.
MAX_INPUT_BYTES = 1 << 30
NPY_HEADER_BYTES = 1 << 16   # room for a .npy header (numpy writes 128 bytes; allow a long one)


def input_bounds(policy: CompiledPolicy) -> dict:
    """name → the most bytes the policy's largest module takes for that input (dynamic dims at their exported
    maximum, bucketed dims at the largest bucket), capped at MAX_INPUT_BYTES."""
    module = policy.modules[-1]
    dynamic = module.record.get("dynamic_dims") or {}
    bounds = {}
    for spec in module.record["inputs"]:
        count = 1
        for dim in spec["shape"]:
            count *= int(dim) if not isinstance(dim, str) else int(dynamic.get(dim, {}).get("max", 1))
        bounds[spec["name"]] = min(count * np.dtype(spec["dtype"]).itemsize, MAX_INPUT_BYTES)
    return bounds


def load_observation(path: Path, policy: CompiledPolicy) -> dict:
    """An observation file (.npz or .safetensors, one array per input), bounded before anything is read into
    memory: a regular file (not a FIFO or device, which would block or never end), no member but the policy's
    inputs, each member's declared size within what the policy takes for it (an .npz member's size is its
    uncompressed size, so a small archive cannot expand to gigabytes), no pickled objects."""
    import stat
    import zipfile

    where = str(path)
    try:
        info = path.stat()
    except OSError as e:
        raise DsaError(where, f"cannot be read: {e.strerror}", "pass an existing .npz or .safetensors file") from None
    if not stat.S_ISREG(info.st_mode):
        raise DsaError(where, "is not a regular file", "pass an .npz or .safetensors file")
    bounds = input_bounds(policy)
    expected = ", ".join(bounds)

    def check_member(name: str, nbytes: int, slack: int) -> None:
        if name not in bounds:
            raise DsaError(where, f"holds '{name}', which is not an input of {policy.model_id}",
                           f"the inputs are: {expected}")
        if nbytes > bounds[name] + slack:
            raise DsaError(where, f"member '{name}' is {nbytes} bytes, more than the {bounds[name]} bytes the "
                           f"input takes at its largest", "pass one observation at the model's input shapes")

    if path.suffix == ".npz":
        try:
            archive = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as e:
            raise DsaError(where, f"is not a readable .npz archive: {e}", "write it with numpy.savez") from None
        with archive:
            members = [(m.filename[:-4] if m.filename.endswith(".npy") else m.filename, m)
                       for m in archive.infolist()]
            for name, member in members:  # every declared size first: nothing is decompressed yet
                check_member(name, member.file_size, NPY_HEADER_BYTES)
            values = {}
            for name, member in members:
                try:
                    with archive.open(member) as f:
                        values[name] = _read_npy(f, bounds[name])
                except DsaError as e:
                    raise DsaError(f"{where}: member '{name}'", e.message, e.hint) from None
                except (ValueError, OSError, zipfile.BadZipFile, EOFError, RuntimeError) as e:
                    raise DsaError(f"{where}: member '{name}'", f"is not a plain numeric array: {e}",
                                   "write plain arrays with numpy.savez (no objects, no pickles)") from None
            return values
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        if info.st_size > sum(bounds.values()) + NPY_HEADER_BYTES:
            raise DsaError(where, f"is {info.st_size} bytes, more than the policy's inputs take",
                           "pass one observation at the model's input shapes")
        try:
            with safe_open(str(path), framework="numpy") as f:
                values = {}
                for name in f.keys():
                    check_member(name, 0, 0)
                    values[name] = f.get_tensor(name)
                return values
        except (SafetensorError, ValueError, OSError) as e:
            raise DsaError(where, f"is not a readable .safetensors file: {e}", "write it with safetensors") from None
    raise DsaError(where, "unknown observation format", "use a .npz or .safetensors file")


def _read_npy(f, bound: int) -> np.ndarray:
    """One .npy array from a stream, its header checked before its data is read or allocated: a plain numeric
    dtype (no objects: no pickles) and at most `bound` bytes (a header may declare any shape)."""
    version = np.lib.format.read_magic(f)
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in readers:
        raise DsaError("", f"is .npy format {version[0]}.{version[1]}, not 1.0 or 2.0", "write it with numpy.savez")
    shape, fortran, dtype = readers[version](f)
    if dtype.hasobject or dtype.kind not in "biuf":
        raise DsaError("", f"holds {dtype} values (objects or pickles are never loaded)",
                       "write plain numeric arrays with numpy.savez")
    count = 1
    for n in shape:
        count *= int(n)
    nbytes = count * dtype.itemsize
    if nbytes > bound:
        raise DsaError("", f"declares shape {list(shape)}: {nbytes} bytes, more than the {bound} bytes the input "
                       "takes at its largest", "pass one observation at the model's input shapes")
    data = f.read(nbytes)
    if len(data) != nbytes:
        raise DsaError("", f"ends after {len(data)} of its {nbytes} bytes", "write it again with numpy.savez")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C").copy()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa run", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--index", help="module index (NAME.modules.json) from dsa_vmfb")
    source.add_argument("--bundle", help="release bundle (NAME.tar) from dsa_bundle; verified before use")
    parser.add_argument("--observation", help=".npz or .safetensors with one array per input")
    parser.add_argument("--prompt-len", type=int, help="length of the generated sample's bucketed dim")
    parser.add_argument("--steps", type=int, nargs="+", default=None, help="flow steps to run (default: "
                        "the manifest's flow_steps)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs after one warm-up run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated sample")
    parser.add_argument("--require-signature", metavar="KEY.pub.pem",
                        help="with --bundle: refuse it unless NAME.dsse.json beside it is a valid signature of "
                             "this archive by this public key (dsa sign)")
    from dsa.runtime.signing import add_expectations

    add_expectations(parser)
    parser.add_argument("--target", help="run this target's modules (default: with --index, the most capable of the "
                        "index's builds — it and its `levels` — this machine executes; with --bundle, the first of "
                        "the bundle's targets this machine can execute)")
    parser.add_argument("--allow-nonfinite", action="store_true",
                        help="pass NaN/Inf in float inputs to the module (refused by default)")
    pipeline = parser.add_argument_group("bundles with the policy's pipeline (raw observations)")
    pipeline.add_argument("--task", help="the task text (policies that tokenise it)")
    pipeline.add_argument("--profile", action="store_true", help="print each pipeline node's time per control step")
    pipeline.add_argument("--out", help="write the raw actions, [steps, action dim], to this .npy file")
    pipeline.add_argument("--temporal-ensemble-coeff", type=float,
                          help="ACT: ensemble overlapping chunks (runs the network every step)")
    a = parser.parse_args(argv)
    if a.repeats < 1 or a.repeats > 100000:
        raise DsaError("--repeats", f"{a.repeats} is not a number of runs in [1, 100000]")
    if a.prompt_len is not None and a.prompt_len < 1:
        raise DsaError("--prompt-len", f"{a.prompt_len} is not a positive length")

    from dsa.runtime.signing import check_expectations

    check_expectations(a, a.require_signature, "--require-signature")
    if a.index:
        if a.require_signature:
            raise DsaError("--require-signature", "applies to --bundle only: a build tree is not signed",
                           "run the signed release bundle")
        _run(a, Path(a.index), target=a.target)
        return
    from dsa.runtime.bundle import open_bundle, user_path  # only --bundle needs it

    archive = user_path(a.bundle)
    statement = None
    if a.require_signature:  # before the archive is extracted or anything in it is loaded
        from dsa.runtime.signing import describe_signed, signature_path, verify_signature

        statement = verify_signature(archive, user_path(a.require_signature), expect_model=a.expect_model,
                                     min_release=a.min_release)
        print(f"signature {signature_path(archive).name}: verified with {a.require_signature}"
              f"{describe_signed(statement)}")
    with open_bundle(archive) as bundle:
        if statement is not None:
            from dsa.runtime.signing import check_identity

            check_identity(statement, bundle, archive)
        print(bundle.describe())
        if bundle.meta.get("policy_pipeline"):
            _run_policy_pipeline(a, archive)
            return
        pipeline_only = [f for f in ("task", "profile", "out", "temporal_ensemble_coeff")
                         if getattr(a, f) not in (None, False)]
        if pipeline_only:
            raise DsaError(f"--{pipeline_only[0].replace('_', '-')}", "applies to bundles with the policy's pipeline; "
                           f"{archive.name} holds the network only", "build the bundle with processors "
                           "(docs/policy-pipeline.md)")
        stage = bundle.select_target(a.target)
        if bundle.is_multi_target:
            skipped = bundle.targets[:bundle.targets.index(bundle.selected)]
            why = bundle.why_not_here() if skipped and not a.target else {}
            print(f"target {bundle.selected}" + (" (chosen with --target)" if a.target else
                  " (the first of the bundle's targets this machine runs" +
                  "".join(f"; {t}: {why[t]}" for t in skipped) + ")"))
        _run(a, stage.index_path, target=bundle.selected or bundle.targets[0])


# An episode `dsa run` replays: at most this many control steps (16 minutes at 10 Hz).
MAX_EPISODE_STEPS = 10_000


def load_raw_episode(path: Path, spec: dict) -> dict:
    """Raw observation arrays (.npz) for a policy pipeline: each member one of the pipeline's observation keys,
    of its dtype and shape, or with a leading step axis (an episode); checked before anything is decompressed."""
    import stat
    import zipfile

    where = str(path)
    try:
        info = path.stat()
    except OSError as e:
        raise DsaError(where, f"cannot be read: {e.strerror}", "pass an existing .npz file") from None
    if not stat.S_ISREG(info.st_mode) or path.suffix != ".npz":
        raise DsaError(where, "is not an .npz file", "write the raw observation with numpy.savez")
    wanted = {k: v for k, v in spec["observation"].items() if k != "task"}
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise DsaError(where, f"is not a readable .npz archive: {e}", "write it with numpy.savez") from None
    values = {}
    with archive:
        members = [(m.filename[:-4] if m.filename.endswith(".npy") else m.filename, m) for m in archive.infolist()]
        for name, member in members:
            if name not in wanted:
                raise DsaError(where, f"holds '{name}', which the policy does not observe",
                               f"the observation keys are: {', '.join(sorted(wanted))}")
            if member.file_size > MAX_INPUT_BYTES + NPY_HEADER_BYTES:
                raise DsaError(f"{where}: member '{name}'", f"is {member.file_size} bytes", "pass a shorter episode")
        if len({name for name, _ in members}) != len(members):
            raise DsaError(where, "holds a member twice", "write it with numpy.savez")
        total = sum(member.file_size for _, member in members)
        if total > MAX_INPUT_BYTES + NPY_HEADER_BYTES * len(members):
            raise DsaError(where, f"declares {total} bytes once decompressed, over the {MAX_INPUT_BYTES}-byte limit "
                           "of an episode", "pass a shorter episode")
        for name, member in members:
            try:
                with archive.open(member) as f:
                    values[name] = _read_npy(f, MAX_INPUT_BYTES)
            except DsaError as e:
                raise DsaError(f"{where}: member '{name}'", e.message, e.hint) from None
    missing = sorted(set(wanted) - set(values))
    if missing:
        raise DsaError(where, f"lacks {', '.join(missing)}", f"the policy observes {', '.join(sorted(wanted))}")
    steps = set()
    for name, value in values.items():
        shape = list(wanted[name]["shape"])
        if list(value.shape) == shape:
            steps.add(None)
        elif list(value.shape[1:]) == shape and value.ndim == len(shape) + 1:
            steps.add(int(value.shape[0]))
        else:
            raise DsaError(f"{where}: member '{name}'", f"has shape {list(value.shape)}: the policy observes "
                           f"{shape}, or an episode of them [steps, {', '.join(map(str, shape))}]",
                           "write one observation or one episode")
    if len(steps) > 1:
        raise DsaError(where, "mixes single observations and episodes of different lengths "
                       f"({', '.join(sorted('one observation' if s is None else f'{s} steps' for s in steps))})",
                       "give every key the same number of steps")
    count = next(iter(steps))
    if count is not None and not 1 <= count <= MAX_EPISODE_STEPS:
        raise DsaError(where, f"is an episode of {count} steps; an episode holds 1 to {MAX_EPISODE_STEPS}",
                       "split it")
    return values


def _run_policy_pipeline(a: argparse.Namespace, archive: Path) -> None:
    """`dsa run` of a bundle with the policy's pipeline: raw observations (one, or an episode) → raw actions."""
    import time

    from dsa.runtime.deploy import load

    if a.prompt_len is not None or a.steps is not None:
        raise DsaError("--prompt-len/--steps", "do not apply to a policy pipeline: its preprocessor sizes the prompt "
                       "and the manifest's flow_steps is its step count", "leave them out")
    with load(archive, a.target, allow_nonfinite=a.allow_nonfinite, seed=a.seed,
              temporal_ensemble_coeff=a.temporal_ensemble_coeff) as policy:
        if policy.bundle.is_multi_target:
            print(f"target {policy.target}" + (" (chosen with --target)" if a.target else
                                               " (the first of the bundle's targets this machine runs)"))
        pipe = policy.pipeline
        spec = pipe.spec
        keys = {k: v for k, v in spec["observation"].items() if k != "task"}
        if a.observation:
            values = load_raw_episode(Path(a.observation), spec)
            first = next(iter(keys))
            episode = values[first].ndim == len(keys[first]["shape"]) + 1
            steps = values[first].shape[0] if episode else 1
            observations = [{k: (v[i] if episode else v) for k, v in values.items()} for i in range(steps)]
        else:
            rng = np.random.default_rng(a.seed)
            steps = 2 * pipe.n_action_steps
            observations = [{k: (rng.integers(0, 256, size=v["shape"], dtype=np.uint8) if v["dtype"] == "uint8"
                                 else rng.normal(size=v["shape"]).astype(np.float32)) for k, v in keys.items()}
                            for _ in range(steps)]
        task = a.task if a.task is not None else ("pick up the cube" if "task" in spec["observation"] else None)
        nodes = ", ".join(f"{n['name']} ({n['implementation']})" for n in spec["nodes"])
        print(f"policy pipeline of {spec['model_id']} ({spec['policy_type']}): {nodes}")
        policy.reset()
        actions, per_step, timings = [], [], []
        for obs in observations:
            start = time.perf_counter()
            actions.append(policy.select_action(obs, task=task))
            per_step.append((time.perf_counter() - start) * 1e3)
            timings.append(dict(pipe.timings))
        actions = np.stack(actions)
        p50, p90 = np.percentile(per_step, [50, 90])
        print(f"{len(observations)} control steps{' (task: ' + repr(task) + ')' if task else ''}: raw actions "
              f"{tuple(actions.shape)}; step latency p50 {p50:.2f} ms, p90 {p90:.2f} ms")
        print(f"  first action: {np.array2string(actions[0], precision=3)}")
        if a.profile:
            order = [n["name"] for n in spec["nodes"]]
            names = sorted({n for t in timings for n in t}, key=lambda n: order.index(n) if n in order else -1)
            width = max(len(n) for n in names)
            # Per control step (a node that runs every few steps, like the network behind an action queue, is
            # averaged over all of them) and per run of the node (the steps where it ran).
            print(f"  {'node':<{width}s}  mean ms/step   p90 ms  mean ms/run  steps run")
            for name in names:
                values = [t.get(name, 0.0) * 1e3 for t in timings]
                ran = [t[name] * 1e3 for t in timings if name in t]
                print(f"  {name:<{width}s} {np.mean(values):12.3f} {np.percentile(values, 90):8.3f} "
                      f"{np.mean(ran) if ran else 0.0:12.3f}  {len(ran)}/{len(timings)}")
        if a.out:
            out = Path(a.out)
            np.save(out, actions)
            print(f"wrote {out}")


def _run(a: argparse.Namespace, index: Path, target: Optional[str] = None) -> None:
    policy = CompiledPolicy(index, allow_nonfinite=a.allow_nonfinite, target=target)
    if policy.choice.why:
        print(f"target {policy.choice.target} ({policy.choice.why})")
    runtime_view = policy.runtime_view
    record = policy.modules[0].record
    if a.observation:
        observation = load_observation(Path(a.observation), policy)
    else:
        sizes = {}
        if a.prompt_len is not None:
            buckets = policy.buckets()
            largest = max((max(sizes) for sizes in buckets.values()), default=None)
            if largest is None:
                raise DsaError("--prompt-len", f"{policy.model_id} has no shape buckets to size",
                               "leave --prompt-len out")
            if a.prompt_len > largest:  # before the sample is allocated
                raise DsaError("--prompt-len", f"{a.prompt_len} is longer than the largest bucket ({largest}; "
                               f"buckets: {buckets})", f"pass at most {largest}")
            sizes = {dim: a.prompt_len for dim in buckets}
        observation = sample_inputs(record, sizes, np.random.default_rng(a.seed))
    step_input = next((s["name"] for s in record["inputs"] if "value_range" in s), None)
    steps_list = a.steps or [runtime_view["flow_steps"]]
    print(f"model {policy.model_id} on {policy.index['target']} ({policy.driver}); "
          f"buckets {policy.buckets() or 'none'}")
    if step_input:
        lo, hi = next(s["value_range"] for s in record["inputs"] if s["name"] == step_input)
        for steps in steps_list:
            if not lo <= steps <= hi:
                raise DsaError("--steps", f"{steps} is outside the supported range [{lo}, {hi}]",
                               f"pass flow steps in [{lo}, {hi}]")
    for steps in steps_list:
        if step_input:
            observation[step_input] = np.array(steps, dtype=np.int64)
        outputs, module, latencies = policy.timed_run(observation, repeats=a.repeats)
        actions = outputs[0]
        bucket = (f"{module.bucket['dim']}={module.bucket['size']}" if module.bucket
                  else "dynamic" if module.record.get("dynamic_dims") else "static")
        p50, p90 = np.percentile(latencies, [50, 90])
        print(f"flow_steps={steps:<3d} bucket {bucket:<16s} action chunk {tuple(actions.shape)} "
              f"(execute the first {runtime_view['n_action_steps']}); latency p50 {p50:.2f} ms, "
              f"p90 {p90:.2f} ms over {len(latencies)} runs")
        print(f"  first action: {np.array2string(actions.reshape(-1, actions.shape[-1])[0], precision=3)}")


if __name__ == "__main__":
    run_cli(main, "dsa run")
