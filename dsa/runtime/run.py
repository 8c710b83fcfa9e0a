"""dsa run: run a compiled policy on an observation (or a generated sample) and report its action chunk.

    dsa run --index bazel-bin/models/pi0.modules.json --prompt-len 20 --steps 1 5 10
    dsa run BUNDLE pi0_bundle.tar --steps 1 10     # a release bundle (dsa_bundle), verified first

The runner picks the smallest shape bucket that holds the observation, pads it, runs the requested number
of flow steps through the one compiled loop, and prints the action chunk and latency percentiles.

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


def _load_observation(path: Path) -> dict:
    if path.suffix == ".npz":
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        return load_file(str(path))
    raise DsaError(str(path), "unknown observation format", "use a .npz or .safetensors file")


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
    a = parser.parse_args(argv)

    if a.index:
        _run(a, Path(a.index))
        return
    from dsa.runtime.bundle import open_bundle, user_path  # only --bundle needs it

    with open_bundle(user_path(a.bundle)) as bundle:
        print(bundle.describe())
        _run(a, bundle.index_path)


def _run(a: argparse.Namespace, index: Path) -> None:
    policy = CompiledPolicy(index)
    runtime_view = policy.runtime_view
    record = policy.modules[0].record
    if a.observation:
        observation = _load_observation(Path(a.observation))
    else:
        sizes = {}
        if a.prompt_len is not None:
            sizes = {dim: a.prompt_len for dim in policy.buckets()}
        observation = sample_inputs(record, sizes, np.random.default_rng(a.seed))
    step_input = next((s["name"] for s in record["inputs"] if "value_range" in s), None)
    steps_list = a.steps or [runtime_view["flow_steps"]]
    print(f"model {policy.model_id} on {policy.index['target']} ({policy.driver}); "
          f"buckets {policy.buckets() or 'none'}")
    for steps in steps_list:
        if step_input:
            observation[step_input] = np.array(steps, dtype=np.int64)
        outputs, module, latencies = policy.timed_run(observation, repeats=a.repeats)
        actions = outputs[0]
        bucket = f"{module.bucket['dim']}={module.bucket['size']}" if module.bucket else "dynamic"
        p50, p90 = np.percentile(latencies, [50, 90])
        print(f"flow_steps={steps:<3d} bucket {bucket:<16s} action chunk {tuple(actions.shape)} "
              f"(execute the first {runtime_view['n_action_steps']}); latency p50 {p50:.2f} ms, "
              f"p90 {p90:.2f} ms over {len(latencies)} runs")
        print(f"  first action: {np.array2string(actions.reshape(-1, actions.shape[-1])[0], precision=3)}")


if __name__ == "__main__":
    run_cli(main, "dsa run")
