"""dsa-profile: profile a model's compiled dispatches and name the torch ops and model modules behind each —
the command line and the profile's text output (the package's docstring says how a profile is made)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from dsa.core.errors import run_cli
from dsa.stages.compile import load_tuning
from dsa.tools.profiler.model import DEFAULT_RUNS, profile_model
from dsa.tools.profiler.sources import INFERRED_MARK


# -- output --------------------------------------------------------------------------------------------------


def _shorten(items: Sequence[str], keep: int = 3) -> str:
    if not items:
        return "?"
    shown = ", ".join(items[:keep])
    return shown + (f" +{len(items) - keep} more" if len(items) > keep else "")


def _ms(value: float) -> str:
    return f"{value:.1f}" if value >= 100 else f"{value:.3f}" if value >= 1 else f"{value:.4f}"


def _count(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def format_profile(result: dict, top: Optional[int] = None) -> str:
    top = result.get("top", 15) if top is None else top
    rows = [("#", "dispatch", "count", "ms", "%", "source ops", "module paths")]
    for d in result["dispatches"][:top]:
        rows.append((str(d["rank"]), d["name"], _count(d["count"]), _ms(d["total_ms"]), f"{d['percent']:.1f}",
                     _shorten(d["ops"]), _shorten(d["module_paths"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    right = {0, 2, 3, 4}
    lines = []
    bucket = result["bucket"]
    lines.append(f"{result['model_id']} on {result['target']}"
                 + (f", {bucket['dim']}={bucket['size']}" if bucket else "")
                 + f": {result['runs']} run(s), profiling mode {result['profiling_mode']}; times per run")
    if result.get("note"):
        lines.append(f"note: {result['note']}")
    for r in rows:
        cells = [r[i].rjust(widths[i]) if i in right else r[i].ljust(widths[i]) for i in range(len(widths))]
        lines.append("  ".join(cells + [r[-1]]).rstrip())
    total, summed = result["total_ms"], result["dispatch_ms"]
    shown = result["dispatches"][:top]
    lines.append(f"total: {total:.3f} ms per run (wall); dispatches: {summed:.3f} ms "
                 f"({100.0 * summed / total if total else 0:.1f}% of total) in {_count(result['dispatch_calls'])} "
                 f"calls of {len(result['dispatches'])} dispatch functions; top {len(shown)}: "
                 f"{sum(d['total_ms'] for d in shown):.3f} ms")
    if any(p.startswith(INFERRED_MARK) for d in result["dispatches"][:top] for p in d["module_paths"]):
        lines.append(f"{INFERRED_MARK}path: inferred from the parameters or neighbours of ops inside a "
                     "higher-order op's subgraph (torch.export records no module stack there)")
    if result["unmapped"]:
        lines.append(f"no source found for: {', '.join(result['unmapped'])}")
    spec = result.get("dispatch_spec")
    if spec is not None:
        unmatched = [n for n, c in spec.items() if not c]
        lines.append(f"dispatch spec: {len(spec) - len(unmatched)} of {len(spec)} entries matched {sum(spec.values())} "
                     "op(s) (set tiles or rewrote)" + (f"; matching none: {', '.join(unmatched)}" if unmatched else ""))
    lines.append(f"vmfb sha256 {result['vmfb_sha256']} (the build's, for the same flags and rewrites)")
    return "\n".join(lines)


def _input_override(text: str) -> Tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"'{text}' is not NAME=VALUE or NAME=@FILE.npy")
    return name, value


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: List[str] = []
    if "--" in argv:  # everything after `--` goes to iree-compile
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="dsa profile", description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", required=True, type=Path)
    weights = parser.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", type=Path, help="the model's .safetensors checkpoint")
    weights.add_argument("--params", type=Path, help="a built parameter archive (.irpa)")
    parser.add_argument("--target", required=True, type=Path, help="target spec (toolchains/targets/NAME.json)")
    parser.add_argument("--tuning", type=Path, help="tuning file (toolchains/tuning/<family>.<target>.json; "
                        "default: the manifest's tuning family's file for the target)")
    parser.add_argument("--policy-config", type=Path, help="framework lerobot: the policy's config.json (default: "
                        "model.policy_config.path, relative to the manifest)")
    parser.add_argument("--extra-flag", action="append", default=[], metavar="FLAG",
                        help="iree-compile flag after the build's, as --extra-flag=--iree-opt-level=O3 "
                             "(or put flags after `--`)")
    parser.add_argument("--bucket", help="DIM=SIZE (default: the manifest's smallest bucket)")
    parser.add_argument("--input", action="append", default=[], type=_input_override, metavar="NAME=VALUE",
                        help="an input's value (a number fills it) or NAME=@FILE.npy")
    parser.add_argument("--steps", type=int, help="value of the model's integer scalar input (flow steps)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="calls to profile (times are per call)")
    parser.add_argument("--pythonpath", action="append", default=None,
                        help="directory holding the model code (default: the current directory)")
    parser.add_argument("--json", type=Path, help="write the whole profile (every dispatch) as JSON")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep the MLIR, executable sources, vmfb and profile there")
    parser.add_argument("--rewrites", metavar="NAMES",
                        help="comma-separated graph rewrites to trace with, '' for none (default: the "
                        "manifest's, as the build applies them)")
    a = parser.parse_args(argv)
    rewrites = None if a.rewrites is None else [n for n in a.rewrites.split(",") if n]
    from dsa.core.fileio import read_json, write_json_atomic

    tuning = a.tuning
    if tuning is None:
        # As the build compiles it: the tuning family the manifest names, for this target.
        import yaml

        family = (yaml.safe_load(Path(a.manifest).read_text(encoding="utf-8")) or {}).get("tuning")
        target_name = read_json(a.target).get("name")
        candidate = Path(__file__).resolve().parents[3] / "toolchains" / "tuning" / f"{family}.{target_name}.json"
        if family and candidate.is_file():
            tuning = candidate
    result = profile_model(
        a.manifest, a.checkpoint or a.params, a.target, bucket=a.bucket, steps=a.steps, top=a.top,
        tuning_flags=a.extra_flag + passthrough, runs=a.runs, inputs=dict(a.input),
        tuning=load_tuning(tuning) if tuning else None, pythonpath=a.pythonpath or ["."], keep_dir=a.keep,
        rewrites=rewrites, policy_config=a.policy_config)
    print(format_profile(result))
    if a.json:
        write_json_atomic(a.json, result)


if __name__ == "__main__":
    run_cli(main, "dsa profile")
