"""Benchmark and tuner logic, and the tuning data in toolchains/tuning (no timing is asserted anywhere)."""

import json
import re

import pytest

from dsa.runtime.host import best_target
from dsa.tools import tune
from dsa.tools.bench import lerobot as lerobot_bench
from dsa.tools.bench import report, runtimes as bench_runtimes, subjects, timing
from dsa.stages.compile import compile_flags, tuning_flags
from dsa.core.errors import DsaError
from dsa.core.runtime_flags import merge_runtime_flags
from dsa.core.fileio import read_json
from dsa.tools.testing import runfile

ROOT = runfile(".")
TUNING = runfile("toolchains/tuning")
TARGETS = runfile("toolchains/targets")
V3 = read_json(TARGETS / "x86_64-v3.json")


def test_summarize_gives_median_and_p90_of_the_samples():
    stats = timing.summarize([5.0, 1.0, 3.0, 2.0, 4.0, 100.0, 6.0, 7.0, 8.0, 9.0])
    assert stats["median_ms"] == 5.5
    assert stats["p90_ms"] == pytest.approx(18.1)
    assert stats["runs"] == 10


def test_parity_flags_an_output_outside_the_bound():
    import numpy as np

    ref = np.array([[1.0, -3.0]])
    assert timing.parity(ref + 1e-5, ref)["ok"]
    assert not timing.parity(ref + 1e-2, ref)["ok"]
    assert not timing.parity(np.zeros((2, 2)), ref)["ok"]  # wrong shape never passes


def test_best_target_is_the_most_capable_spec_the_cpu_satisfies():
    v3_flags = V3["host"]["cpu_features"]
    avx512 = ["avx512f", "avx512bw", "avx512cd", "avx512dq"]
    assert best_target(TARGETS, features=v3_flags, arch="x86_64") == "x86_64-v3"
    assert best_target(TARGETS, features=v3_flags + avx512, arch="x86_64") == \
        "x86_64-v3"  # x86-64-v4 needs every AVX-512 subset it names
    assert best_target(TARGETS, features=v3_flags + avx512 + ["avx512vl"], arch="x86_64") == "x86_64-v4"
    with pytest.raises(DsaError, match="no target spec fits this machine's CPU"):
        best_target(TARGETS, features=["avx2", "fma"], arch="x86_64")  # below x86-64-v3
    with pytest.raises(DsaError, match="no target spec fits"):
        best_target(TARGETS, features=v3_flags, arch="aarch64")


def _row(case, eager, tuned, ort=None):
    rt = {"eager": {"median_ms": eager}, "vmfb:tuned": {"median_ms": tuned}}
    if ort is not None:
        rt["onnxruntime"] = {"median_ms": ort}
    return {"case": case, "runtimes": rt}


def test_goal_needs_vmfb_at_most_eager_and_within_1_5x_of_onnx_runtime_where_it_applies():
    result = {"ort_goal": True, "cases": [_row("a", 10, 9, 6.5), _row("b", 10, 9, 5.0), _row("c", 10, 11, 20)]}
    status = subjects.goal_status(result)
    assert status["a"]["met"] and not status["b"]["met"] and not status["c"]["met"]
    assert status["b"]["vs_onnxruntime"] == 1.8
    result["ort_goal"] = False
    assert subjects.goal_status(result)["b"]["met"]


def _cand(name, flags, **models):
    return {"name": name, "flags": flags, "models": {
        m: ({"qualified": True, "total_median_ms": v} if v is not None else
            {"qualified": False, "reason": "does not compile"}) for m, v in models.items()}}


def test_winner_is_the_best_on_average_over_the_family_with_fewer_flags_on_a_tie():
    measured = [
        _cand("baseline", [], big=100.0, small=2.0),
        _cand("fails-on-one", ["--x"], big=10.0, small=None),
        _cand("two-flags", ["--a", "--b"], big=60.0, small=1.0),
        _cand("one-flag", ["--a"], big=60.0, small=1.0),
        _cand("helps-big-only", ["--c"], big=50.0, small=3.0),
    ]
    tune.score_candidates(measured, ["big", "small"])
    assert not measured[1]["qualified"] and "small: does not compile" in measured[1]["reason"]
    # Relative scores: a model 50x slower than another does not decide alone.
    assert measured[4]["score"] == pytest.approx((1.0 + 3.0) / 2)
    assert measured[3]["score"] == pytest.approx((1.2 + 1.0) / 2)
    assert tune.pick_winner(measured)["name"] == "one-flag"


def test_no_qualified_candidate_is_an_error_naming_each_reason():
    with pytest.raises(DsaError, match="no candidate qualified.*a: does not compile"):
        tune.pick_winner([{"name": "a", "flags": [], "qualified": False, "reason": "does not compile"}])


def test_candidates_file_is_valid_and_allowed_as_tuning():
    candidates = tune.load_candidates(TUNING / "candidates.json")
    assert candidates[0]["flags"] == []  # the baseline is always measured
    for c in candidates:
        tuning_flags({"format": 1, "family": "f", "target": "x86_64-v3", "flags": c["flags"]}, V3, c["name"])


def test_every_family_list_of_candidates_is_allowed_as_tuning_for_every_target_it_names():
    data = read_json(TUNING / "candidates.json")
    assert data["families"], "no family has its own candidates"
    for family in data["families"]:
        for c in tune.load_candidates(TUNING / "candidates.json", family):
            for target in c.get("targets", ["x86_64-v3"]):
                tuning_flags({"format": 1, "family": family, "target": target, "flags": c["flags"]},
                             read_json(TARGETS / f"{target}.json"), f"{family}: {c['name']}")


def test_a_family_gets_its_own_candidates_and_a_candidate_only_the_targets_it_names(tmp_path):
    path = tmp_path / "candidates.json"
    path.write_text(json.dumps({"format": 1, "candidates": [{"name": "baseline", "flags": []}], "families": {
        "conv": [{"name": "a", "flags": ["--iree-opt-level=O3"]},
                 {"name": "wide", "flags": ["--iree-opt-data-tiling"], "targets": ["x86_64-v4"]}]}}))
    assert [c["name"] for c in tune.load_candidates(path, "conv", "x86_64-v4")] == ["a", "wide"]
    assert [c["name"] for c in tune.load_candidates(path, "conv", "x86_64-v3")] == ["a"]
    assert [c["name"] for c in tune.load_candidates(path, "other", "x86_64-v3")] == ["baseline"]


def test_a_family_list_with_a_repeated_name_is_refused_naming_the_family(tmp_path):
    path = tmp_path / "candidates.json"
    path.write_text(json.dumps({"format": 1, "candidates": [{"name": "baseline", "flags": []}], "families": {
        "conv": [{"name": "a", "flags": []}, {"name": "a", "flags": ["--iree-opt-level=O1"]}]}}))
    with pytest.raises(DsaError, match="families.conv: candidate name 'a' appears twice"):
        tune.load_candidates(path, "conv")


@pytest.mark.parametrize("flags, message", [
    (["--task_topology_max_group_count=4"], "runtime flag '--task_topology_max_group_count=4' is not one a "
                                            "tuning may require"),
    (["--task_worker_stack_size=big"], "runtime flag '--task_worker_stack_size=big' needs a positive byte count"),
    (["--task_worker_stack_size"], "needs a positive byte count"),
    ("--task_worker_stack_size=1", "must be a list"),
])
def test_a_tuning_may_require_only_a_worker_stack_of_the_runtime_named_in_the_error(flags, message):
    tuning = {"format": 1, "family": "f", "target": "x86_64-v3", "flags": [], "runtime_flags": flags}
    with pytest.raises(DsaError, match=f"f.x86_64-v3.json: .*{re.escape(message)}"):
        tuning_flags(tuning, V3, "toolchains/tuning/f.x86_64-v3.json")


def test_merged_runtime_flags_keep_each_flags_largest_value():
    assert merge_runtime_flags([["--task_worker_stack_size=262144"], [], ["--task_worker_stack_size=524288"]]) \
        == ["--task_worker_stack_size=524288"]
    assert merge_runtime_flags([[], []]) == []


def test_a_candidate_with_a_bad_runtime_flag_is_refused_naming_the_file_and_candidate(tmp_path):
    path = tmp_path / "candidates.json"
    path.write_text(json.dumps({"format": 1, "candidates": [
        {"name": "big-stack", "flags": [], "runtime_flags": ["--task_worker_stack_size=-1"]}]}))
    with pytest.raises(DsaError, match="candidate 'big-stack'.*needs a positive byte count"):
        tune.load_candidates(path)


def test_a_winner_needing_runtime_flags_yields_to_a_plain_candidate_within_the_margin():
    measured = [_cand("plain", ["--a"], m=10.2), _cand("big-stack", ["--b"], m=10.0), _cand("bigger", ["--c"], m=8.0)]
    measured[1]["runtime_flags"] = measured[2]["runtime_flags"] = ["--task_worker_stack_size=524288"]
    tune.score_candidates(measured, ["m"])
    assert tune.without_runtime_requirements(measured, measured[1], 0.05)["name"] == "plain"  # 2% faster: no
    assert tune.without_runtime_requirements(measured, measured[2], 0.05)["name"] == "bigger"  # 27%: worth it
    assert tune.without_runtime_requirements(measured, measured[0], 0.05)["name"] == "plain"


def test_a_hand_chosen_tuning_is_no_incumbent_so_the_measured_winner_replaces_it():
    assert tune.incumbent_flags({"flags": ["--a"], "measured": False, "chosen": "not measured: x"}) is None
    assert tune.incumbent_flags({"flags": ["--a"], "chosen": "candidate 'a'"}) == ["--a"]
    assert tune.incumbent_flags(None) is None


def test_a_policy_module_is_recompiled_from_the_mlir_beside_its_export_record(tmp_path):
    assert tune.policy_mlir(tmp_path / "act_buckets" / "batch_0.export_record.json") == \
        tmp_path / "act_buckets" / "batch_0.mlir"
    assert tune.policy_mlir(tmp_path / "smolvla_model" / "export_record.json") == \
        tmp_path / "smolvla_model" / "model.mlir"


@pytest.mark.parametrize("flag", [
    "--iree-llvmcpu-target-cpu=znver4",
    "--iree-llvmcpu-target-cpu=host",
    "--iree-hal-target-device=cuda",
    "--iree-vm-bytecode-module-strip-source-map=false",
    "--iree-llvmcpu-debug-symbols=true",
])
def test_tuning_may_not_set_target_device_or_reproducibility_flags(flag):
    with pytest.raises(DsaError, match="is not allowed"):
        tuning_flags({"format": 1, "family": "f", "target": "x86_64-v3", "flags": [flag]}, V3, "t.json")


def test_tuning_for_another_target_is_refused_with_the_right_file_named():
    with pytest.raises(DsaError, match=r"tuning is for target 'x86_64-v4'.*f\.x86_64-v3\.json"):
        tuning_flags({"format": 1, "family": "f", "target": "x86_64-v4", "flags": []}, V3, "t.json")


def test_tuning_flags_sit_between_the_target_and_the_reproducibility_flags():
    view = {"model_id": "m", "target": "x86_64-v3", "quant_scheme": {"kind": "none"}}
    flags = compile_flags(view, V3, "w", {"format": 1, "family": "f", "target": "x86_64-v3",
                                          "flags": ["--iree-opt-data-tiling"]})
    assert flags.index("--iree-llvmcpu-target-cpu=x86-64-v3") < flags.index("--iree-opt-data-tiling")
    assert flags.index("--iree-opt-data-tiling") < flags.index("--iree-llvmcpu-debug-symbols=false")


def test_every_tuning_file_is_valid_for_its_target_and_has_its_evidence():
    files = [p for p in TUNING.glob("*.json") if p.name != "candidates.json" and ".evidence." not in p.name]
    assert files, "no tuning files"
    for path in files:
        tuning = read_json(path)
        family, target_name = path.stem.split(".", 1)
        assert (tuning["family"], tuning["target"]) == (family, target_name), path.name
        tuning_flags(tuning, read_json(TARGETS / f"{target_name}.json"), path.name)
        if tuning.get("measured", True) is False:
            # A compile fix, not a choice among measured candidates: it says so, and why, and has no evidence.
            assert tuning["chosen"].startswith("not measured: ") and not path.with_suffix(".evidence.json").exists()
            continue
        evidence = read_json(path.with_suffix(".evidence.json"))
        winner = next(c for c in evidence["candidates"] if c["name"] == evidence["winner"])
        assert [f for f in tuning["flags"] if f in winner["flags"]] == winner["flags"], path.name
        assert winner["qualified"], path.name
        added = [f for f in tuning["flags"] if f not in winner["flags"]]
        if added:
            # Flags added after the sweep for the tuning's dispatch spec (the Winograd filters' hoisting limit):
            # its own evidence measured the whole model with them.
            assert "dispatch_spec" in tuning, (path.name, added)
            spec_evidence = read_json(TUNING / tuning["dispatch_spec"]["file"].replace(".mlir", ".evidence.json"))
            assert set(added) <= set(spec_evidence["flags"]) and spec_evidence["model"]["parity"], (path.name, added)


def test_every_manifest_is_a_bench_subject_or_says_why_not():
    """Every manifest is benchmarked — with subjects.json's options, or the defaults — unless subjects.json
    says why not; a listed subject's tuning family exists for the shipped target."""
    found = subjects.load_subjects(runfile("bench/subjects.json"), ROOT)
    covered = {s.manifest.name for s in found}
    data = read_json(runfile("bench/subjects.json"))
    exempt = data["not_benchmarked"]
    manifests = {p.name for p in runfile("manifests").glob("*.yaml")}
    assert manifests == covered | set(exempt), sorted(manifests ^ (covered | set(exempt)))
    assert not set(exempt) & covered and all(exempt.values()), exempt
    listed = {entry["model"] for entry in data["subjects"]}
    for s in found:
        if s.name in listed:
            assert (TUNING / f"{s.family}.x86_64-v3.json").exists(), s.name


def test_a_new_manifest_is_benchmarked_with_defaults_and_a_lerobot_one_must_say_why_not(tmp_path):
    """Adding a model needs no subjects.json entry: its manifest becomes a subject with the defaults
    (dsa_policy's seeded checkpoint, smallest bucket, target flags until a family is tuned). A LeRobot
    manifest runs in another environment: without a not_benchmarked line it is refused, naming the fix."""
    (tmp_path / "manifests").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "subjects.json").write_text('{"format": 1, "not_benchmarked": {}, "subjects": []}')
    (tmp_path / "manifests" / "new.yaml").write_text(
        "model_id: new_policy\nframework: pytorch\nbuckets:\n  prompt_len: [16, 32]\n")
    [subject] = subjects.load_subjects(tmp_path / "bench" / "subjects.json", tmp_path)
    assert (subject.name, subject.bucket, subject.cases, subject.ort_goal) == (
        "new_policy", {"dim": "prompt_len", "slot": 0}, [{}], True)
    assert subject.checkpoint == tmp_path / "models" / "new_policy.safetensors"
    (tmp_path / "manifests" / "lr.yaml").write_text("model_id: lr\nframework: lerobot\n")
    with pytest.raises(DsaError, match="lr.yaml: framework 'lerobot' is not benchmarked.*not_benchmarked"):
        subjects.load_subjects(tmp_path / "bench" / "subjects.json", tmp_path)


def test_markdown_report_has_latency_goal_and_rewrite_lines():
    entry = lambda ms: {"median_ms": ms, "p90_ms": ms * 1.1, "runs": 30, "parity": {"ok": True}}  # noqa: E731
    runtimes = {"eager": entry(10.0), "vmfb:default": entry(20.0), "vmfb:rewrites": entry(9.0),
                "vmfb:tuned": entry(8.0), "vmfb:-patchify_conv_to_matmul": entry(8.8), "onnxruntime": entry(6.0)}
    variant = {"flags": ["--x"], "rewrites": {"patchify_conv_to_matmul": 2, "fold_batchnorm": 0},
               "export_s": 1, "compile_s": 2, "vmfb_bytes": 3}
    result = {"model": "m", "target": "x86_64-v3", "ort_goal": True, "variants": {"default": variant, "tuned": variant},
              "cases": [{"case": "steps=1", "runtimes": runtimes}], "errors": {}}
    result["goal"] = subjects.goal_status(result)
    text = report.render_markdown({"machine": {"cpu": "c", "threads": 2, "avx512": False, "system": "s",
                                              "python": "3"}, "date": "d", "target": "x86_64-v3", "runs": 30,
                                  "warmup": 5, "models": [result]})
    assert "| m | steps=1 | 10.00 / 11.00 |" in text
    assert "| 0.80 | 1.33 | — | met |" in text
    assert "| m | steps=1 | `patchify_conv_to_matmul` | 2 | 8.80 | 8.00 | -9.1% |" in text
    assert "fold_batchnorm" not in text.split("## Graph rewrites")[1].split("## Builds")[0]
    # With the ExecuTorch Plan B timed: its column and the vmfb's ratio to it; a failed lowering is printed.
    runtimes["executorch"] = entry(16.0)
    result["errors"] = {"executorch": "XNNPACK lowering failed: ..."}
    text = report.render_markdown({"machine": {"cpu": "c", "threads": 2, "avx512": False, "system": "s",
                                              "python": "3"}, "date": "d", "target": "x86_64-v3", "runs": 30,
                                  "warmup": 5, "models": [result]})
    assert "| torch.compile | ExecuTorch (XNNPACK) | tuned / eager | tuned / ORT | tuned / ExecuTorch | goal |" in text
    assert "| — | 16.00 / 17.60 | 0.80 | 1.33 | 0.50 | met |" in text
    assert "m: ExecuTorch XNNPACK lowering failed: ..." in text


def test_interleaved_measurement_calls_each_function_warmup_plus_runs_times_in_alternating_rounds():
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    stats = timing.measure_interleaved(fns, warmup=2, runs=7, rounds=3)
    assert calls.count("a") == calls.count("b") == 9
    assert stats["a"]["runs"] == stats["b"]["runs"] == 7
    timed = calls[4:]  # after the warm-up: rounds of 3, 2, 2 calls, alternating between the functions
    assert timed == ["a"] * 3 + ["b"] * 3 + ["a"] * 2 + ["b"] * 2 + ["a"] * 2 + ["b"] * 2


def test_a_runtime_timed_alone_is_built_only_when_its_turn_comes_and_released_before_the_next():
    # ONNX Runtime's spin-waiting pool slows whatever shares the rounds with it (a 9.4 ms module measured 30.6 ms
    # beside it): measure_alone builds it after the others, times it on its own and lets it go.
    import gc
    import weakref

    calls, alive = [], []

    class Session:
        def run(self):
            calls.append("spin")

    def make():
        calls.append("make")
        session = Session()
        alive.append(weakref.ref(session))
        return session.run

    stats = timing.measure_alone(make, warmup=1, runs=3)
    gc.collect()
    assert calls == ["make"] + ["spin"] * 4 and stats["runs"] == 3
    assert alive[0]() is None  # nothing timed after it shares the machine with its threads


def test_a_default_rewrite_the_manifest_opts_out_of_gets_its_evidence_line():
    entry = lambda ms: {"median_ms": ms, "p90_ms": ms, "runs": 30, "parity": {"ok": True}}  # noqa: E731
    runtimes = {"eager": entry(10.0), "vmfb:tuned": entry(4.0), "vmfb:+decompose_attention": entry(5.0)}
    variant = {"flags": [], "rewrites": {"patchify_conv_to_matmul": 0}, "export_s": 1, "compile_s": 2,
               "vmfb_bytes": 3}
    plus = dict(variant, rewrites={"decompose_attention": 11})
    result = {"model": "m", "target": "t", "ort_goal": False, "errors": {},
              "variants": {"default": variant, "tuned": variant, "+decompose_attention": plus},
              "cases": [{"case": "-", "runtimes": runtimes}]}
    result["goal"] = subjects.goal_status(result)
    text = report.render_markdown({"machine": {"cpu": "c", "threads": 2, "avx512": False, "system": "s",
                                              "python": "3"}, "date": "d", "target": "t", "runs": 30,
                                  "warmup": 5, "models": [result]})
    assert "| m | - | `decompose_attention` (not used: manifest opts out) | 11 | 4.00 | 5.00 | +25.0% |" in text


def test_current_flags_stay_unless_the_winner_beats_them_by_the_margin():
    measured = [_cand("current", ["--a"], m=10.3), _cand("new", ["--b"], m=10.0), _cand("bad", ["--c"], m=None)]
    tune.score_candidates(measured, ["m"])
    assert tune.keep_incumbent(measured, ["--a"], 0.05)["name"] == "current"  # 3% slower: within the margin
    assert tune.keep_incumbent(measured, ["--a"], 0.01)["name"] == "new"
    assert tune.keep_incumbent(measured, ["--c"], 0.05)["name"] == "new"  # current no longer qualifies
    assert tune.keep_incumbent(measured, None, 0.05)["name"] == "new"


# -- the LeRobot policies (run in the LeRobot environment by `bazel run //bench`) -----------------------


def test_lerobot_policies_are_the_index_rows_with_a_policy_config(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "policies_index.json").write_text(json.dumps({"format": 1, "pipelines": [], "policies": [
        {"name": "pi0", "label": "//models:pi0", "index": "models/pi0.modules.json", "manifest": "manifests/pi0.yaml",
         "checkpoint": "models/pi0.safetensors", "policy_config": None, "model_file": None, "python": None,
         "test": ""},
        {"name": "act", "label": "//models:act", "index": "models/act.modules.json", "manifest": "manifests/act.yaml",
         "checkpoint": "models/act_policy/model.safetensors", "policy_config": "models/act_policy/config.json",
         "model_file": None, "python": "lerobot/bin/python3", "test": "//models/act:act_test"}]}))
    [policy] = lerobot_bench.lerobot_policies(tmp_path)
    assert (policy.name, policy.index, policy.policy_dir) == (
        "act", tmp_path / "models/act.modules.json", tmp_path / "models/act_policy")
    index = json.loads((tmp_path / "models" / "policies_index.json").read_text())
    del index["policies"][1]["index"]
    (tmp_path / "models" / "policies_index.json").write_text(json.dumps(index))
    with pytest.raises(DsaError, match=r"policies_index.json: policies\[1\].index: is missing"):
        lerobot_bench.lerobot_policies(tmp_path)


def test_the_benchmark_measures_each_policy_once_and_a_level_only_when_named(tmp_path, monkeypatch):
    """`act` is measured as a user runs it (the runner's choice among its levels); its level
    `act_x86_64-v4`'s own row only when --models names it."""
    row = lambda name, **extra: dict({  # noqa: E731
        "name": name, "label": f"//models:{name}", "index": f"models/{name}.modules.json",
        "manifest": "manifests/act.yaml", "checkpoint": "models/act_policy/model.safetensors",
        "policy_config": "models/act_policy/config.json", "model_file": None, "python": None, "test": ""}, **extra)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "policies_index.json").write_text(json.dumps({"format": 1, "pipelines": [], "policies": [
        row("act", targets=["x86_64-v3", "x86_64-v4"]),
        row("act_x86_64-v4", level_of="act", build_of="act", targets=["x86_64-v4"])]}))
    assert [(p.name, p.level_of) for p in lerobot_bench.lerobot_policies(tmp_path)] == [
        ("act", None), ("act_x86_64-v4", "act")]
    measured = []
    monkeypatch.setattr(lerobot_bench, "not_runnable", lambda index: {"target": "t", "not_run": "here"})
    monkeypatch.setattr(lerobot_bench.iree_flags, "require", lambda flags, where: None)
    monkeypatch.setattr(lerobot_bench.iree_flags, "set_task_threads", lambda n: None)
    monkeypatch.setattr(lerobot_bench, "read_module_index", lambda index: measured.append(index.name) or {})
    for models, names in ((None, ["act"]), (["act", "act_x86_64-v4"], ["act", "act_x86_64-v4"])):
        rows = lerobot_bench.run_lerobot_benchmark(tmp_path, models=models, runs=1, warmup=0, threads=1)
        assert [r["model"] for r in rows] == names


def test_quiet_wait_returns_at_once_on_an_idle_machine_and_reports_a_busy_one(monkeypatch):
    monkeypatch.setattr(timing, "load_average", lambda: 0.4)
    assert timing.wait_for_quiet(limit=1.5, wait_s=30) == {"load": 0.4, "waited_s": 0.0, "quiet": True}
    monkeypatch.setattr(timing, "load_average", lambda: 3.0)
    seen = timing.wait_for_quiet(limit=1.5, wait_s=0)
    assert seen["quiet"] is False and seen["load"] == 3.0


def test_markdown_report_has_a_row_per_lerobot_policy_with_load_and_goal():
    entry = lambda ms: {"median_ms": ms, "p90_ms": ms * 1.1, "runs": 30, "parity": {"ok": True}}  # noqa: E731
    row = {"model": "act", "target": "x86_64-v4", "module": "batch_0.vmfb", "bucket": {"batch": 1},
           "case": "batch=1", "runtimes": {"eager": entry(250.0), "vmfb": entry(200.0), "onnxruntime": entry(160.0),
                                           bench_runtimes.ORT_SPINNING: entry(150.0)},
           "goal": {"vs_eager": 0.8, "met": True, "vs_onnxruntime": 1.25},
           "load": {"before": {"load": 0.9, "waited_s": 0.0, "quiet": True}, "after": 1.2},
           "errors": {"torch.compile": "RuntimeError: x"}}
    text = report.render_markdown({"machine": {"cpu": "c", "threads": 2, "avx512": True, "system": "s",
                                              "python": "3"}, "date": "d", "target": "x86_64-v4", "runs": 30,
                                  "warmup": 5, "models": [], "policies": [row]})
    assert ("| act | x86_64-v4 | `batch_0.vmfb` | batch=1 | 250.00 / 275.00 | 200.00 / 220.00 | 160.00 / 176.00 "
            "| 150.00 / 165.00 | — | 0.80 | 1.25 | 0.9 → 1.2 | met |") in text
    assert "act: torch.compile not measured (RuntimeError: x)" in text


def test_markdown_report_has_an_end_to_end_line_per_policy_with_a_pipeline_bundle():
    entry = lambda ms: {"median_ms": ms, "p90_ms": ms * 1.1, "runs": 30, "parity": {"ok": True}}  # noqa: E731
    row = {"model": "act", "target": "x86_64-v3", "module": "batch_0.vmfb", "bucket": {"batch": 1},
           "case": "batch=1", "runtimes": {"eager": entry(250.0), "vmfb": entry(200.0)},
           "goal": {"vs_eager": 0.8, "met": True},
           "load": {"before": {"load": 0.9, "waited_s": 0.0, "quiet": True}, "after": 1.2}, "errors": {},
           "end_to_end": {"bundle": "act_pipeline_bundle.tar", "lerobot": entry(260.0),
                          "bundle_ms": dict(entry(210.0), parity={"ok": False}), "ratio": 0.808,
                          "nodes_ms": [["prepare_observation", 1.0], ["network", 205.0]]}}
    text = report.render_markdown({"machine": {"cpu": "c", "threads": 2, "avx512": False, "system": "s",
                                              "python": "3"}, "date": "d", "target": "x86_64-v3", "runs": 30,
                                  "warmup": 5, "models": [], "policies": [row, dict(row, model="pi05", end_to_end=None)]})
    assert "### End to end: raw observation → raw action" in text
    # The bundle's raw action outside the parity bound is marked, the nodes keep the pipeline's order.
    assert ("| act | 260.00 / 286.00 | 210.00 / 231.00 ✗ | 0.81 | prepare_observation 1.00, network 205.00 |"
            in text)
    assert "| pi05 | " not in text.split("### End to end")[1].split("\n\n")[1]


def test_a_build_this_machine_cannot_execute_is_a_not_run_row_naming_what_it_lacks(tmp_path):
    spec = dict(V3, name="x86_64-future", host={"arch": "x86_64", "cpu_features": ["dsa_no_cpu_has_this"]})
    (tmp_path / "future.json").write_text(json.dumps(spec))
    index = tmp_path / "p.modules.json"
    index.write_text(json.dumps({"format": 1, "target": "x86_64-future", "target_spec": "future.json",
                                 "parameter_archive": "p.irpa", "parameter_scope": "model",
                                 "runtime_view": "r.json", "modules": []}))
    row = lerobot_bench.not_runnable(index)
    assert row == {"target": "x86_64-future",
                   "not_run": "it needs the CPU features dsa_no_cpu_has_this, which this CPU lacks"}
    text = report.render_markdown({"machine": {"cpu": "c", "threads": 2, "avx512": False, "system": "s",
                                              "python": "3"}, "date": "d", "target": "x86_64-v3", "runs": 30,
                                  "warmup": 5, "models": [], "policies": [dict(model="p", **row)]})
    assert "| p | x86_64-future | — |" in text and "not run on this machine: it needs the CPU features" in text


def test_quantised_layer_rows_render_ratio_sizes_and_error():
    entry = lambda ms, b, e: {"median_ms": ms, "p90_ms": ms, "runs": 30, "weight_bytes": b,  # noqa: E731
                              "rel_error": e, "parity": {"ok": True}}
    rows = [{"layer": "MLP down", "shape": [4096, 11008], "rows": 1, "case": "decode step",
             "schemes": {"fp32": entry(10.0, 4096 * 11008 * 4, 0.0), "int8 g32": entry(6.0, 1, 1e-3),
                         "int4 g32": entry(4.0, 4096 * 11008 // 2 + 4096 * 344 * 4, 5e-2)}}]
    text = "\n".join(report.render_quant_layers(rows))
    assert ("| MLP down | 4096×11008 | decode step | 10.00 / 10.00 | 6.00 / 6.00 | 4.00 / 4.00 | 0.40 "
            "| 172 → 26.9 MiB | 5.0e-02 |") in text
    assert text.count("\n| ") == 2  # header, one row (the rule line is "|---")


def test_a_project_subject_is_timed_against_eager_onnx_runtime_and_torch_compile(tmp_path):
    # The whole path of one project model (the transformer control, its builds, its baselines), with one
    # timed call each: every runtime gets a row and a parity check, and no baseline reports an error.
    subject = next(s for s in subjects.load_subjects(ROOT / "bench" / "subjects.json", ROOT)
                   if s.name == "transformer")
    subject.checkpoint = tmp_path / "absent.safetensors"   # the bench makes dsa_checkpoint's seed-0 one
    target = best_target(TARGETS)
    result = subjects.bench_subject(subject, target_name=target, root=ROOT, work=tmp_path / "work",
                                 runs=1, warmup=0, threads=2, profile_top=0)
    assert result["errors"] == {}
    runtimes = result["cases"][0]["runtimes"]
    assert {"eager", "vmfb:tuned", "onnxruntime", bench_runtimes.ORT_SPINNING, "torch.compile"} <= set(runtimes)
    assert all(r["parity"]["ok"] for r in runtimes.values()), runtimes
    assert "vs_onnxruntime" in result["goal"]["-"]
    assert len(result["variants"]["tuned"]["vmfb_sha256"]) == 64  # the import matrix matches builds by it


def test_onnx_runtime_is_timed_with_sleeping_threads_and_its_spin_wait_default_beside_it(tmp_path):
    # The bar is ORT with threads that do not spin between calls (a spinning pool steals the next runtime's CPU in
    # alternating rounds); its default, spinning, is the second session on the same file.
    import numpy as np
    import torch

    model = torch.nn.Linear(8, 4).eval()
    args = (torch.ones(2, 8),)
    session, feeds = bench_runtimes.ort_session(model, args, ["x"], tmp_path / "m.onnx", threads=2)
    spinning, _ = bench_runtimes.ort_file_session(tmp_path / "m.onnx", 2, spinning=True)
    for s, flag in ((session, "0"), (spinning, "1")):
        options = s.get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == flag
        assert options.get_session_config_entry("session.inter_op.allow_spinning") == flag
        assert options.intra_op_num_threads == 2
    x = {feeds[0]: np.ones((2, 8), np.float32)}
    np.testing.assert_allclose(session.run(None, x)[0], spinning.run(None, x)[0])
    np.testing.assert_allclose(session.run(None, x)[0], model(*args).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_update_replaces_only_the_re_measured_rows_and_says_when_each_was_measured():
    machine = {"cpu": "CPU", "threads": 2, "avx512": False, "system": "Linux", "python": "3.11"}
    common = {"target": "x86_64-v3", "runs": 30, "warmup": 5, "light": False, "full_size_light": True,
              "machine": machine, "quant_layers": [], "models": []}
    previous = dict(common, date="2026-12-01", policies=[{"model": "act", "eager": 1}, {"model": "pi05", "eager": 2}])
    fresh = dict(common, date="2026-12-02", policies=[{"model": "act", "eager": 3}])
    merged = report.merge_results(previous, fresh, "x86_64-v3")
    assert [(p["model"], p["eager"]) for p in merged["policies"]] == [("act", 3), ("pi05", 2)]
    assert merged["policies"][1]["measured"] == "2026-12-01" and "(--update)" in merged["policies"][0]["measured"]
    assert "measured in separate runs" in report.measured_note(merged)
    with pytest.raises(DsaError, match="runs=30"):
        report.merge_results(previous, dict(fresh, runs=10), "x86_64-v3")


def test_results_keep_the_latest_run_of_each_class_of_cpu_and_the_sections_other_tools_own(tmp_path):
    """A run on an AVX-512 machine replacing one from an AVX2 machine keeps that one as results.avx2.json and
    renders it as its own section; a later AVX2 run takes results.json back and keeps the AVX-512 run; the
    blocks `dsa scale` owns in RESULTS.md stay as they were each time."""
    from dsa.tools.bench.cli import write_results

    entry = lambda ms: {"median_ms": ms, "p90_ms": ms * 1.1, "runs": 30, "parity": {"ok": True}}  # noqa: E731

    def run(avx512: bool, cpu: str, vmfb_ms: float) -> dict:
        row = {"model": "act", "target": "x86_64-v4" if avx512 else "x86_64-v3", "module": "batch_0.vmfb",
               "bucket": {"batch": 1}, "case": "batch=1", "runtimes": {"eager": entry(100.0), "vmfb": entry(vmfb_ms)},
               "goal": {"vs_eager": vmfb_ms / 100, "met": vmfb_ms <= 100},
               "load": {"before": {"load": 0.5, "waited_s": 0.0, "quiet": True}, "after": 0.6}, "errors": {}}
        return {"format": 1, "machine": {"cpu": cpu, "threads": 2, "avx512": avx512, "system": "s", "python": "3"},
                "date": cpu, "target": row["target"], "runs": 30, "warmup": 5, "models": [], "policies": [row]}

    kept = "<!-- real-size:begin -->\n## Real sizes\n| pi0_full | 3.2 B |\n<!-- real-size:end -->"
    (tmp_path / "RESULTS.md").write_text("# old\n\n" + kept + "\n")
    write_results(tmp_path, run(False, "amd", 150.0))
    assert not list(tmp_path.glob("results.*.json"))
    text = write_results(tmp_path, run(True, "intel", 80.0))
    assert json.loads((tmp_path / "results.avx2.json").read_text())["machine"]["cpu"] == "amd"
    assert (tmp_path / "RESULTS.md").read_text() == text and text.count(kept) == 1
    main, other = text.split("## On an AVX2 machine without AVX-512 (x86-64-v3)")
    assert "| act | x86_64-v4 | `batch_0.vmfb` | batch=1 | 100.00 / 110.00 | 80.00 / 88.00 |" in main
    assert "not measured in this run (`--models` named LeRobot policies only)" in main  # no empty table
    assert "## Graph rewrites" not in main and "## Builds" not in main
    assert "### LeRobot policies" in other and "| act | x86_64-v3 | `batch_0.vmfb` | batch=1 | 100.00 / 110.00 | 150.00" \
        in other and "amd, 2 threads" in other
    write_results(tmp_path, run(True, "intel", 70.0))  # the same class again: the AVX2 run stays
    assert json.loads((tmp_path / "results.avx2.json").read_text())["machine"]["cpu"] == "amd"
    text = write_results(tmp_path, run(False, "amd", 140.0))
    assert not (tmp_path / "results.avx2.json").exists()
    assert json.loads((tmp_path / "results.avx512.json").read_text())["policies"][0]["runtimes"]["vmfb"][
        "median_ms"] == 70.0
    assert "## On an AVX-512 machine (x86-64-v4)" in text and text.count(kept) == 1


def test_a_policy_goal_is_four_fifths_of_eager_and_at_most_onnx_runtime_on_avx512_and_eager_elsewhere(tmp_path):
    """The issue's bar for a LeRobot policy's shipped module: on an AVX-512 build at most 0.8x eager and no slower
    than ONNX Runtime (where it ran), on x86-64-v3 no slower than eager; `dsa bench --render` applies it again
    to the rows a results file holds and renders RESULTS.md from them."""
    from dsa.tools.bench.cli import main as bench_main

    rt = lambda eager, vmfb, ort=None: dict(  # noqa: E731
        {"eager": {"median_ms": eager}, "vmfb": {"median_ms": vmfb}},
        **({"onnxruntime": {"median_ms": ort}} if ort else {}))
    assert timing.policy_goal("x86_64-v4", rt(100, 79, 80))["met"]
    assert not timing.policy_goal("x86_64-v4", rt(100, 81, 90))["met"]  # 0.81 of eager
    assert not timing.policy_goal("x86_64-v4", rt(100, 70, 60))["met"]  # slower than ORT
    assert timing.policy_goal("x86_64-v4", rt(100, 70))["met"]  # ORT not timed: eager's bound only
    assert timing.policy_goal("x86_64-v3", rt(100, 95, 50))["met"]  # no ORT bound on AVX2
    assert not timing.policy_goal("x86_64-v3", rt(100, 101))["met"]
    row = {"model": "act", "target": "x86_64-v4", "module": "m.vmfb", "case": "batch=1",
           "runtimes": {k: dict(v, p90_ms=v["median_ms"], parity={"ok": True}) for k, v in rt(100, 90, 95).items()},
           "goal": {"vs_eager": 0.9, "met": True},  # as an older criterion (≤ 1.0 eager) wrote it
           "load": {"before": {"load": 0.5}, "after": 0.5}, "errors": {}}
    results = {"format": 1, "machine": {"cpu": "c", "threads": 2, "avx512": True, "system": "s", "python": "3"},
               "date": "d", "target": "x86_64-v4", "runs": 30, "warmup": 5, "models": [], "policies": [row]}
    (tmp_path / "results.json").write_text(json.dumps(results))
    bench_main(["--render", "--out-dir", str(tmp_path)])
    goal = json.loads((tmp_path / "results.json").read_text())["policies"][0]["goal"]
    assert goal["met"] is False and goal["vs_onnxruntime"] == 0.947
    assert "| 0.90 | 0.95 | 0.5 → 0.5 | **not met** |" in (tmp_path / "RESULTS.md").read_text()
