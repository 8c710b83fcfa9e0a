"""Compile-flag tuner: measures candidate flag sets on a model and writes the winner as the family's tuning.

    bazel run //bench:tune -- pi0 [more models of pi0's family] [--target auto|x86_64-v3|x86_64-v4] [--runs 30]

Each model (all of one family) is exported once (with its graph rewrites); every candidate flag set of
toolchains/tuning/candidates.json is compiled for the target, checked against eager PyTorch (a candidate
whose output leaves the parity bound, or that does not compile, for any model is disqualified, with the
reason recorded) and timed in alternating rounds (`runs` calls after warm-up, every case of the model's
bench subject). The winner — lowest score, the mean over models of its median latency relative to the
fastest candidate's — is written to toolchains/tuning/<family>.<target>.json, the file dsa_vmfb's `tuning`
attribute names, and the measurements to toolchains/tuning/<family>.<target>.evidence.json. The flags
already in the tuning file stay unless the winner beats them by --min-gain (default 5%), and the file is
rewritten only when its flags change, so re-tuning on a noisy machine does not churn it and recompile.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from dsa.tools import bench
from dsa.stages.compile import TUNING_FORMAT
from dsa.core.errors import DsaError, run_cli
from dsa.core.fileio import read_json, write_json_atomic


def load_candidates(path: Path) -> List[dict]:
    data = read_json(path)
    candidates = data.get("candidates")
    if not isinstance(candidates, list) or not candidates:
        raise DsaError(str(path), "has no 'candidates' list", "list named flag sets: {name, flags}")
    names = set()
    for c in candidates:
        if not isinstance(c, dict) or "name" not in c or not isinstance(c.get("flags"), list):
            raise DsaError(str(path), f"candidate {c!r} is not {{name, flags: [...]}}")
        if c["name"] in names:
            raise DsaError(str(path), f"candidate name '{c['name']}' appears twice")
        names.add(c["name"])
    return candidates


def pick_winner(measured: List[dict]) -> dict:
    """The qualified candidate with the lowest score; ties go to the fewer flags, then the earlier."""
    qualified = [m for m in measured if m.get("qualified")]
    if not qualified:
        reasons = "; ".join(f"{m['name']}: {m.get('reason')}" for m in measured)
        raise DsaError("tune", f"no candidate qualified ({reasons})", "check the candidates file")
    return min(enumerate(qualified), key=lambda im: (im[1]["score"], len(im[1]["flags"]), im[0]))[1]


def keep_incumbent(measured: List[dict], incumbent: Optional[List[str]], min_gain: float) -> dict:
    """The winner, unless the flags already in the tuning file are a qualified candidate within `min_gain`
    (a fraction) of it: then those. Timings on a shared machine move by several percent run to run; without
    this margin every re-tune would churn the file and recompile every module that uses it."""
    best = pick_winner(measured)
    current = next((m for m in measured if m["flags"] == incumbent and m.get("qualified")), None)
    if current is not None and current["score"] <= best["score"] * (1.0 + min_gain):
        return current
    return best


def score_candidates(measured: List[dict], models: List[str]) -> None:
    """score = mean over models of (candidate's total median / the fastest qualified candidate's total), so
    each model of the family weighs the same whatever its absolute latency. Qualified: every model compiled
    and matched eager."""
    for m in measured:
        per = m["models"]
        failed = [f"{model}: {per[model]['reason']}" for model in models if not per[model].get("qualified")]
        m["qualified"] = not failed
        if failed:
            m["reason"] = "; ".join(failed)
    best = {model: min(m["models"][model]["total_median_ms"] for m in measured if m["qualified"])
            for model in models} if any(m["qualified"] for m in measured) else {}
    for m in measured:
        if not m["qualified"]:
            continue
        per = m["models"]
        m["score"] = round(sum(per[model]["total_median_ms"] / best[model] for model in models) / len(models), 4)


def _measure_model(model: str, subject, *, root: Path, target: dict, candidates: List[dict], runs: int,
                   warmup: int, work: Path) -> Dict[str, dict]:
    """Compiles every candidate for one model, checks parity against eager and times it: name → result."""
    from dsa.stages import passes
    from dsa.stages.compile import compile_module
    from dsa.manifest.contract import project

    manifest = bench.load_subject_manifest(subject, root, work)
    rewrites = list(manifest["model"].get("rewrites", passes.DEFAULT_PASSES))
    base = bench.build_variant(subject, manifest, target, None, rewrites, work / "base", [str(root)])
    _, _, cases = bench.reference_cases(subject, manifest, base.record)

    compile_view = dict(project(manifest, "compile", target=manifest["targets"][0]), target=target["name"])
    results = {}
    modules = {}
    for cand in candidates:
        entry: dict = {}
        tuning = {"format": TUNING_FORMAT, "family": subject.family, "target": target["name"],
                  "flags": cand["flags"]}
        vmfb = work / f"{cand['name']}.vmfb"
        start = time.perf_counter()
        try:
            report = compile_module(base.vmfb.with_name("model.mlir"), compile_view, target, vmfb,
                                    where=f"{model} candidate {cand['name']}", tuning=tuning)
        except DsaError as e:
            entry.update(qualified=False, reason=f"does not compile: {e}")
            results[cand["name"]] = entry
            print(f"dsa-tune: {model} {cand['name']}: does not compile", flush=True)
            continue
        entry["compile_s"] = round(time.perf_counter() - start, 2)
        entry["vmfb_bytes"] = report["vmfb_bytes"]
        modules[cand["name"]] = bench.IreeModule(
            bench.Built(vmfb, base.record, base.irpa, report["flags"], base.rewrites, 0, 0, report["vmfb_bytes"]),
            target["runtime_driver"])
        entry["cases"] = {}
        results[cand["name"]] = entry
    # Every compiled candidate is timed in alternating rounds (see bench.measure_interleaved).
    for case in cases:
        checks = {name: bench.parity(module(case.inputs), case.ref) for name, module in modules.items()}
        timings = bench.measure_interleaved(
            {name: (lambda m: lambda: m(case.inputs))(module) for name, module in modules.items()},
            warmup=warmup, runs=runs)
        for name in modules:
            results[name]["cases"][case.name] = dict(timings[name], parity=checks[name])
    for name in modules:
        entry = results[name]
        entry["total_median_ms"] = round(sum(c["median_ms"] for c in entry["cases"].values()), 4)
        entry["qualified"] = all(c["parity"]["ok"] for c in entry["cases"].values())
        if not entry["qualified"]:
            entry["reason"] = "output outside the parity bound"
        print(f"dsa-tune: {model} {name}: {entry['total_median_ms']:.2f} ms"
              f"{'' if entry['qualified'] else ' (parity FAILED)'}", flush=True)
    return results


def tune(models: List[str], *, root: Path, target_name: str, runs: int, warmup: int, threads: int,
         work: Path, write_root: Path, min_gain: float = 0.05) -> dict:
    import torch

    subjects = {s.name: s for s in bench.load_subjects(root / "bench" / "subjects.json", root)}
    for model in models:
        if model not in subjects:
            raise DsaError("tune", f"no bench subject '{model}'", f"known: {', '.join(sorted(subjects))}")
    families = sorted({subjects[m].family for m in models})
    if len(families) != 1:
        raise DsaError("tune", f"models {', '.join(models)} belong to families {', '.join(families)}",
                       "tune one family at a time: its tuning file serves all of its models")
    family = families[0]
    torch.set_num_threads(threads)
    target = read_json(root / "toolchains" / "targets" / f"{target_name}.json")
    candidates = load_candidates(root / "toolchains" / "tuning" / "candidates.json")
    per_model = {m: _measure_model(m, subjects[m], root=root, target=target, candidates=candidates, runs=runs,
                                   warmup=warmup, work=work / m) for m in models}
    measured = [{"name": c["name"], "flags": c["flags"], "models": {m: per_model[m][c["name"]] for m in models}}
                for c in candidates]
    score_candidates(measured, models)
    tuning_path = write_root / "toolchains" / "tuning" / f"{family}.{target_name}.json"
    incumbent = read_json(tuning_path)["flags"] if tuning_path.exists() else None
    winner = keep_incumbent(measured, incumbent, min_gain)
    tuning_doc = {
        "format": TUNING_FORMAT,
        "family": family,
        "target": target_name,
        "flags": winner["flags"],
        "chosen": f"candidate '{winner['name']}', measured by `bazel run //bench:tune -- {' '.join(models)} "
                  f"--target {target_name}`; evidence in {tuning_path.stem}.evidence.json",
    }
    changed = not tuning_path.exists() or read_json(tuning_path).get("flags") != winner["flags"]
    if changed:
        write_json_atomic(tuning_path, tuning_doc)
    evidence = {
        "format": 1,
        "models": models,
        "family": family,
        "target": target_name,
        "date": time.strftime("%Y-%m-%d"),
        "machine": bench.machine_info(threads),
        "runs": runs,
        "score": "mean over models of total median / the fastest qualified candidate's (1.0 = best everywhere)",
        "winner": winner["name"],
        "candidates": measured,
    }
    write_json_atomic(tuning_path.with_suffix(".evidence.json"), evidence)
    print(f"dsa-tune: winner {winner['name']} ({' '.join(winner['flags']) or 'no extra flags'}); "
          f"{'wrote' if changed else 'unchanged:'} {tuning_path}")
    return evidence


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa tune", description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="bench subjects (bench/subjects.json) of one family")
    parser.add_argument("--target", default="auto")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--min-gain", type=float, default=0.05,
                        help="replace the current flags only for a winner this much faster (fraction)")
    parser.add_argument("--root", type=Path, help="checkout to read models and toolchains from")
    a = parser.parse_args(argv)
    root = a.root or Path(os.path.abspath(__file__)).parents[2]
    write_root = bench.workspace_root() if a.root is None else a.root
    target = bench.best_target(bench.cpu_flags(), root / "toolchains" / "targets") if a.target == "auto" else a.target
    bench.set_iree_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="dsa-tune-") as tmp:
        tune(a.models, root=root, target_name=target, runs=a.runs, warmup=a.warmup, threads=a.threads,
             work=Path(tmp), write_root=write_root, min_gain=a.min_gain)


if __name__ == "__main__":
    run_cli(main, "dsa tune")
