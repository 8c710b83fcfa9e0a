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

LeRobot policies (the policies index, models/BUILD.bazel's dsa_policies) are tuned as built:

    bazel run //bench:tune -- act diffusion --target x86_64-v4

The tool runs itself again in the LeRobot environment, takes each policy's exported MLIR of its smallest
bucket (what DsaCompile compiled), compiles the candidates of the family (candidates.json's `families`, else
the common list), checks each against eager LeRobot on the benchmark's batch-1 case and times them in
alternating rounds with eager LeRobot itself, whose median goes into the evidence beside every candidate's
ratio to it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from dsa.core.errors import DsaError, one_line, run_cli
from dsa.core.fileio import read_json, write_json_atomic
from dsa.core.runtime_flags import merge_runtime_flags, runtime_flag_values
from dsa.runtime import iree_flags
from dsa.runtime.host import best_target, check_host, host_cpu_model
from dsa.runtime.policy import read_module_index
from dsa.stages.compile import TUNING_FORMAT
from dsa.stages.compile_flags import check_tuning_flags
from dsa.tools.bench.lerobot import POLICIES_INDEX, lerobot_policies, lerobot_python, policy_case
from dsa.tools.bench.report import workspace_root
from dsa.tools.bench.runtimes import Built, IreeModule
from dsa.tools.bench.subjects import build_variant, load_subject_manifest, load_subjects, reference_cases
from dsa.tools.bench.timing import machine_info, measure_interleaved, parity


def _check_candidates(path: Path, where: str, candidates) -> None:
    if not isinstance(candidates, list) or not candidates:
        raise DsaError(str(path), f"has no {where} list", "list named flag sets: {name, flags}")
    names = set()
    for c in candidates:
        if not isinstance(c, dict) or "name" not in c or not isinstance(c.get("flags"), list):
            raise DsaError(str(path), f"{where}: candidate {c!r} is not {{name, flags: [...]}}")
        check_tuning_flags(c["flags"], f"{path}: {where}", f"candidate '{c['name']}'")
        runtime_flag_values(c.get("runtime_flags", []), f"{path}: {where}: candidate '{c['name']}'")
        if not isinstance(c.get("targets", []), list):
            raise DsaError(str(path), f"{where}: candidate '{c['name']}': 'targets' is not a list of target names")
        if c["name"] in names:
            raise DsaError(str(path), f"{where}: candidate name '{c['name']}' appears twice")
        names.add(c["name"])


def load_candidates(path: Path, family: Optional[str] = None, target: Optional[str] = None) -> List[dict]:
    """The candidates for `family` (its own list under `families`, else the common `candidates`), without
    those whose `targets` leave out `target`."""
    data = read_json(path)
    _check_candidates(path, "'candidates'", data.get("candidates"))
    families = data.get("families", {})
    if not isinstance(families, dict):
        raise DsaError(str(path), "'families' is not {family: [candidates]}")
    for name, listed in families.items():
        _check_candidates(path, f"families.{name}", listed)
    candidates = families.get(family, data["candidates"]) if family else data["candidates"]
    if target is not None:
        candidates = [c for c in candidates if target in c.get("targets", [target])]
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


def without_runtime_requirements(measured: List[dict], winner: dict, min_gain: float) -> dict:
    """`winner`, unless it requires runtime flags of the runner and a qualified candidate that requires none is
    within `min_gain` (a fraction) of it: then the fastest such. A runtime requirement is a cost to every
    runner of the module (and a process can be set up for only one worker stack), paid only for a real gain."""
    if not winner.get("runtime_flags"):
        return winner
    plain = [m for m in measured if m.get("qualified") and not m.get("runtime_flags")]
    if not plain:
        return winner
    best_plain = min(plain, key=lambda m: (m["score"], len(m["flags"])))
    return best_plain if best_plain["score"] <= winner["score"] * (1.0 + min_gain) else winner


def incumbent_flags(current: Optional[dict]) -> Optional[List[str]]:
    """The flags of the tuning file in place that a re-tune keeps within the margin: none for a missing file
    or a hand-chosen one (`"measured": false`), which the measured winner always replaces."""
    if current is None or current.get("measured", True) is False:
        return None
    return current["flags"]


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


def _compile_candidates(model: str, mlir: Path, compile_view: dict, family: str, record: dict, irpa: Path, *,
                        root: Path, target: dict, candidates: List[dict], work: Path) -> tuple:
    """Compiles `mlir` with every candidate's flags and loads what compiled with the model's parameters.
    Returns (name → result so far: compile time and size, or why it was disqualified; name → loaded module)."""
    from dsa.stages.compile import compile_module

    results: Dict[str, dict] = {}
    modules = {}
    work.mkdir(parents=True, exist_ok=True)
    for cand in candidates:
        tuning = {"format": TUNING_FORMAT, "family": family, "target": target["name"], "flags": cand["flags"],
                  "runtime_flags": cand.get("runtime_flags", [])}
        vmfb = work / f"{cand['name']}.vmfb"
        start = time.perf_counter()
        try:
            report = compile_module(mlir, compile_view, target, vmfb, where=f"{model} candidate {cand['name']}",
                                    tuning=tuning)
        except DsaError as e:
            # Paths as the checkout names them: the evidence is committed, this machine's runfiles are not.
            reason = str(e).replace(f"{root}{os.sep}", "")
            results[cand["name"]] = {"qualified": False, "reason": f"does not compile: {reason}"}
            print(f"dsa-tune: {model} {cand['name']}: does not compile", flush=True)
            continue
        results[cand["name"]] = {"compile_s": round(time.perf_counter() - start, 2),
                                 "vmfb_bytes": report["vmfb_bytes"], "cases": {}}
        modules[cand["name"]] = IreeModule(
            Built(vmfb, record, irpa, report["flags"], {}, 0, 0, report["vmfb_bytes"]),
            target["runtime_driver"])
        print(f"dsa-tune: {model} {cand['name']}: compiled in {results[cand['name']]['compile_s']} s", flush=True)
    return results, modules


def _measure_model(model: str, subject, *, root: Path, target: dict, candidates: List[dict], runs: int,
                   warmup: int, work: Path) -> Dict[str, dict]:
    """Compiles every candidate for one model, checks parity against eager and times it: name → result."""
    from dsa.stages import passes
    from dsa.manifest.contract import project

    manifest = load_subject_manifest(subject, root, work)
    rewrites = list(manifest["model"].get("rewrites", passes.DEFAULT_PASSES))
    base = build_variant(subject, manifest, target, None, rewrites, work / "base", [str(root)])
    _, _, cases = reference_cases(subject, manifest, base.record)

    compile_view = dict(project(manifest, "compile", target=manifest["targets"][0]), target=target["name"])
    results, modules = _compile_candidates(model, base.vmfb.with_name("model.mlir"), compile_view, subject.family,
                                           base.record, base.irpa, root=root, target=target,
                                           candidates=candidates, work=work)
    # Every compiled candidate is timed in alternating rounds (see dsa.tools.bench.timing.measure_interleaved).
    for case in cases:
        checks = {name: parity(module(case.inputs), case.ref) for name, module in modules.items()}
        timings = measure_interleaved(
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


def policy_mlir(record_path: Path) -> Path:
    """The MLIR DsaCompile compiled for a module, beside its export record: `<bucket>.export_record.json` →
    `<bucket>.mlir` (a bucketed model), `export_record.json` → `model.mlir`."""
    name = record_path.name
    stem = "model" if name == "export_record.json" else name[:-len(".export_record.json")]
    return record_path.with_name(stem + ".mlir")


def _policy_compile_view(policy) -> tuple:
    """(path, content) of the compile view DsaCompile compiled a built policy with: beside its modules."""
    index = read_module_index(policy.index)
    path = (Path(policy.index).parent / index["target_spec"]).parent / f"compile_view.{index['target']}.json"
    if not path.is_file():
        raise DsaError(str(path), f"is missing: policy {policy.name}'s compile view",
                       "run the tuner with `bazel run //bench:tune`, which builds what it reads")
    return path, read_json(path)


def _policy_family(policy) -> str:
    """The tuning family a built policy's manifest names (its compile view's `tuning`)."""
    path, view = _policy_compile_view(policy)
    if not view.get("tuning"):
        raise DsaError(str(path), f"policy {policy.name}'s manifest names no tuning family",
                       "set `tuning: <family>` in its manifest")
    return view["tuning"]


def _measure_policy(policy, family: str, *, root: Path, target: dict, candidates: List[dict], runs: int,
                    warmup: int, work: Path) -> tuple:
    """Compiles every candidate for one LeRobot policy's smallest bucket (the MLIR it was built from), checks
    each against eager LeRobot and times them with eager LeRobot in alternating rounds. Returns (name →
    result, eager's timing)."""
    import torch

    from dsa.runtime.policy import CompiledPolicy

    # The build tuned (its compile view and MLIR), not the level a runner would choose.
    compiled = CompiledPolicy(policy.index, target=read_module_index(policy.index)["target"])
    base = Path(policy.index).parent
    smallest = compiled.modules[0]
    entry = next(m for m in compiled.index["modules"] if base / m["vmfb"] == smallest.vmfb)
    mlir = policy_mlir(base / entry["record"])
    if not mlir.is_file():
        raise DsaError(str(mlir), f"is missing: policy {policy.name} was not built with its MLIR",
                       "run the tuner with `bazel run //bench:tune`, which builds what it reads")
    compile_view = dict(_policy_compile_view(policy)[1], target=target["name"])
    inputs, observation, steps, _, eager, args, ref = policy_case(policy, compiled)
    results, modules = _compile_candidates(policy.name, mlir, compile_view, family, smallest.record,
                                           compiled.parameter_archive, root=root, target=target,
                                           candidates=candidates, work=work)
    case = ", ".join(["batch=1"] + ([f"steps={steps}"] if steps is not None else []))
    checks = {}
    for name, module in modules.items():
        try:
            checks[name] = parity(module(inputs), ref)
        except Exception as e:  # a module that compiles but cannot run here (e.g. out of worker stack)
            results[name].update(qualified=False, reason=f"does not run: {one_line(e)}")
    runnable = {name: module for name, module in modules.items() if name in checks}
    fns = {name: (lambda m: lambda: m(inputs))(module) for name, module in runnable.items()}
    fns[EAGER] = lambda: eager(*args)
    with torch.no_grad():
        timings = measure_interleaved(fns, warmup=warmup, runs=runs)
    eager_timing = timings[EAGER]
    for name in runnable:
        entry = results[name]
        entry["cases"][case] = dict(timings[name], parity=checks[name])
        entry["total_median_ms"] = timings[name]["median_ms"]
        entry["vs_eager"] = round(timings[name]["median_ms"] / eager_timing["median_ms"], 3)
        entry["qualified"] = checks[name]["ok"]
        if not entry["qualified"]:
            entry["reason"] = "output outside the parity bound against eager LeRobot"
        print(f"dsa-tune: {policy.name} {name}: {entry['total_median_ms']:.2f} ms, {entry['vs_eager']}x eager"
              f"{'' if entry['qualified'] else ' (parity FAILED)'}", flush=True)
    print(f"dsa-tune: {policy.name} {EAGER}: {eager_timing['median_ms']:.2f} ms", flush=True)
    return results, dict(eager_timing, case=case)


# The name eager LeRobot's timing has among the candidates' (never a candidate's name: candidates.json's
# names are flag sets).
EAGER = "eager LeRobot"


def tune(models: List[str], *, root: Path, target_name: str, runs: int, warmup: int, threads: int,
         work: Path, write_root: Path, min_gain: float = 0.05) -> dict:
    """Tunes bench subjects (bench/subjects.json) or LeRobot policies (the policies index) of one family."""
    import torch

    torch.set_num_threads(threads)
    target = read_json(root / "toolchains" / "targets" / f"{target_name}.json")
    candidates_path = root / "toolchains" / "tuning" / "candidates.json"
    policies = {p.name: p for p in lerobot_policies(root)} if (root / POLICIES_INDEX).is_file() else {}
    eager: Dict[str, dict] = {}
    lerobot = bool(policies) and all(m in policies for m in models)
    if lerobot:
        family = _one_family(models, {m: _policy_family(policies[m]) for m in models})
        built = [read_module_index(policies[m].index).get("runtime_flags", []) for m in models]
        how = "against eager LeRobot, in the LeRobot environment"
    else:
        subjects = {s.name: s for s in load_subjects(root / "bench" / "subjects.json", root)}
        for model in models:
            if model not in subjects:
                known = sorted(subjects) + sorted(policies)
                raise DsaError("tune", f"no bench subject or LeRobot policy '{model}'", f"known: {', '.join(known)}"
                               + ("; tune LeRobot policies apart from bench subjects" if model in policies else ""))
        family = _one_family(models, {m: subjects[m].family for m in models})
        built = []
        how = "against eager PyTorch"
    candidates = load_candidates(candidates_path, family, target_name)
    # Every candidate shares this process's IREE runtime, set up once before the first device, with the
    # runtime flags (a worker stack) that the most demanding candidate or built module needs.
    iree_flags.require(merge_runtime_flags([c.get("runtime_flags", []) for c in candidates] + built), "dsa tune")
    if lerobot:
        # A module for a CPU this machine lacks would die of SIGILL in the first candidate, not fail.
        check_host(target, f"--target {target_name}")
        per_model = {}
        for model in models:
            per_model[model], eager[model] = _measure_policy(
                policies[model], family, root=root, target=target, candidates=candidates, runs=runs, warmup=warmup,
                work=work / model)
    else:
        per_model = {m: _measure_model(m, subjects[m], root=root, target=target, candidates=candidates,
                                       runs=runs, warmup=warmup, work=work / m) for m in models}
    measured = [{"name": c["name"], "flags": c["flags"], **({"runtime_flags": c["runtime_flags"]}
                                                            if c.get("runtime_flags") else {}),
                 "models": {m: per_model[m][c["name"]] for m in models}} for c in candidates]
    score_candidates(measured, models)
    tuning_path = write_root / "toolchains" / "tuning" / f"{family}.{target_name}.json"
    current = read_json(tuning_path) if tuning_path.exists() else None
    winner = without_runtime_requirements(measured, keep_incumbent(measured, incumbent_flags(current), min_gain),
                                          min_gain)
    ratios = ", ".join(f"{m} {winner['models'][m]['vs_eager']}x" for m in models
                       if "vs_eager" in winner["models"][m])
    tuning_doc = {
        "format": TUNING_FORMAT,
        "family": family,
        "target": target_name,
        "flags": winner["flags"],
        **({"runtime_flags": winner["runtime_flags"]} if winner.get("runtime_flags") else {}),
        # The dispatch spec (`dsa tune-dispatches`) is measured apart: kept as it is. New flags can configure its
        # ops otherwise; its entries then match nothing and the compile reports say so (re-run that tuner).
        **({"dispatch_spec": current["dispatch_spec"]} if (current or {}).get("dispatch_spec") else {}),
        "chosen": f"candidate '{winner['name']}', measured by `bazel run //bench:tune -- {' '.join(models)} "
                  f"--target {target_name}` {how} on {host_cpu_model()}"
                  + (f" (vs eager: {ratios})" if ratios else "")
                  + f"; evidence in {tuning_path.stem}.evidence.json",
    }
    changed = (incumbent_flags(current) != winner["flags"]
               or (current or {}).get("runtime_flags", []) != winner.get("runtime_flags", []))
    if changed:
        write_json_atomic(tuning_path, tuning_doc)
    evidence = {
        "format": 1,
        "models": models,
        "family": family,
        "target": target_name,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(threads),
        "runs": runs,
        "score": "mean over models of total median / the fastest qualified candidate's (1.0 = best everywhere)",
        "winner": winner["name"],
        "candidates": measured,
    }
    if eager:
        evidence["eager_lerobot"] = eager
    write_json_atomic(tuning_path.with_suffix(".evidence.json"), evidence)
    print(f"dsa-tune: winner {winner['name']} ({' '.join(winner['flags']) or 'no extra flags'}); "
          f"{'wrote' if changed else 'unchanged:'} {tuning_path}")
    return evidence


def _one_family(models: List[str], families: Dict[str, str]) -> str:
    """The one family of `models`, or an error naming theirs."""
    names = sorted(set(map(str, families.values())))
    if len(names) != 1:
        raise DsaError("tune", f"models {', '.join(models)} belong to families {', '.join(names)}",
                       "tune one family at a time: its tuning file serves all of its models")
    return families[models[0]]


def _in_lerobot_environment() -> bool:
    import importlib.util

    return importlib.util.find_spec("lerobot") is not None


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dsa tune", description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+",
                        help="bench subjects (bench/subjects.json) or LeRobot policies (the policies index) of "
                             "one family")
    parser.add_argument("--target", default="auto")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--min-gain", type=float, default=0.05,
                        help="replace the current flags only for a winner this much faster (fraction)")
    parser.add_argument("--root", type=Path, help="checkout to read models and toolchains from")
    parser.add_argument("--write-root", type=Path, help=argparse.SUPPRESS)  # kept across the LeRobot re-run
    a = parser.parse_args(argv)
    root = a.root or Path(os.path.abspath(__file__)).parents[2]
    write_root = a.write_root or (workspace_root() if a.root is None else a.root)
    target = best_target(root / "toolchains" / "targets") if a.target == "auto" else a.target
    policies = set()
    if (root / POLICIES_INDEX).is_file():
        policies = {p.name for p in lerobot_policies(root)}
    if policies and all(m in policies for m in a.models) and not _in_lerobot_environment():
        # LeRobot policies are measured against eager LeRobot: this tool again, under that environment's
        # interpreter (in the runfiles), with the same import roots and arguments.
        python = lerobot_python(root)
        if python is None:
            raise DsaError("dsa tune", "the LeRobot environment is not in this binary's runfiles",
                           "run `bazel run //bench:tune -- POLICY ...`")
        pythonpath = [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join(pythonpath)
        args = list(sys.argv[1:] if argv is None else argv)
        if a.root is None:
            args += ["--root", str(root), "--write-root", str(write_root)]
        os.execv(str(python), [str(python), "-m", "dsa.tools.tune", *args])
    iree_flags.set_task_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="dsa-tune-") as tmp:
        tune(a.models, root=root, target_name=target, runs=a.runs, warmup=a.warmup, threads=a.threads,
             work=Path(tmp), write_root=write_root, min_gain=a.min_gain)


if __name__ == "__main__":
    run_cli(main, "dsa tune")
