"""dsa/tools/scale/ (`dsa scale`): the tables and the plot are pure functions of the collected data; a process's
peak memory is its own VmHWM, not its parent's size; every measured step holds the heavy-work lock; a subject
runs in its framework's environment with the stand-in generator the rules use, re-pinned when the manifest's
pins are not its weights'; and one real run of the tool on a tiny manifest (stand-in, dsa compile --no-cache,
the runtime on each target this machine runs, eager PyTorch) writes the data, the docs and RESULTS.md's section."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from dsa.core.errors import DsaError
from dsa.tools import scale

HERE = Path(__file__).absolute().parent
ROOT = HERE.parents[1]  # the runfiles tree (or the checkout): manifests/, models/, toolchains/


# -- peak memory: VmHWM -------------------------------------------------------------------------------------
STATUS = """Name:\tpython3
VmPeak:\t  812345 kB
VmSize:\t  712345 kB
VmHWM:\t  345678 kB
VmRSS:\t  300000 kB
"""


def test_vmhwm_is_read_from_proc_status_text():
    assert scale.read_vmhwm_kib(STATUS) == 345678
    with pytest.raises(DsaError, match="no VmHWM"):
        scale.read_vmhwm_kib("Name:\tx\nVmRSS:\t1 kB\n")
    assert scale.own_vmhwm_kib() > 1000


def _child_vmhwm(code: str) -> int:
    out = subprocess.run([sys.executable, "-c", code + "\nfrom dsa.tools.scale import own_vmhwm_kib\n"
                          "print(own_vmhwm_kib())"], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path)))
    return int(out.stdout.split()[-1])


def test_a_child_reports_its_own_peak_not_the_parents_size_at_fork():
    ballast = bytearray(256 * 1024 * 1024)  # this process is large: a child forked from it must not inherit it
    ballast[::4096] = b"x" * len(ballast[::4096])
    small = _child_vmhwm("pass")
    big = _child_vmhwm("b = bytearray(96 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096])")
    assert small < 128 * 1024, small            # far below the parent's 256 MiB of ballast
    assert big >= small + 80 * 1024, (big, small)  # what the child itself touched
    del ballast


# -- the heavy lock ------------------------------------------------------------------------------------------
def test_the_lock_is_exclusive_and_waits_for_its_holder(tmp_path):
    lock = tmp_path / "heavy.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('held', flush=True)\ntime.sleep(1.5)\n"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    said = []
    start = time.monotonic()
    with scale.heavy_lock(lock, "a stage", said.append) as waited:
        inside = time.monotonic() - start
    holder.wait()
    assert inside >= 0.8 and waited >= 0.8, (inside, waited)
    assert said and "waiting for the heavy lock" in said[0] and "a stage" in said[0]
    # Free: taken at once, nothing said; no path: no lock at all.
    said.clear()
    with scale.heavy_lock(lock, "again", said.append) as waited:
        assert waited < 0.5
    assert not said
    with scale.heavy_lock(None) as waited:
        assert waited == 0.0


def test_the_lock_serialises_two_holders_in_one_process(tmp_path):
    lock, order = tmp_path / "heavy.lock", []

    def hold(name):
        with scale.heavy_lock(lock, name, lambda m: None):
            order.append(f"{name} in")
            time.sleep(0.3)
            order.append(f"{name} out")

    threads = [threading.Thread(target=hold, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order in (["a in", "a out", "b in", "b out"], ["b in", "b out", "a in", "a out"])


# -- subjects, environments, stand-ins ------------------------------------------------------------------------
def test_a_subject_runs_in_its_frameworks_environment(tmp_path):
    lerobot = tmp_path / "lerobot" / "bin" / "python3"
    lerobot.parent.mkdir(parents=True)
    lerobot.write_text("")
    toolchain = Path(sys.executable)
    assert scale.subject_python("lerobot", lerobot_python=lerobot, toolchain_python=toolchain) == lerobot
    for framework in ("pytorch", "onnx", "stablehlo"):
        assert scale.subject_python(framework, lerobot_python=lerobot, toolchain_python=toolchain) == toolchain
    with pytest.raises(DsaError, match="LeRobot environment"):
        scale.subject_python("lerobot", lerobot_python=None, toolchain_python=toolchain)
    assert scale.requirements_lock_for("pytorch", ROOT).name == "requirements_lock.txt"


@pytest.mark.parametrize("manifest, recipe", [
    ({"framework": "lerobot", "precision": {"weights": "bf16"}},
     {"generator": "lerobot", "dtype": "bfloat16", "shards": 0, "weights": "seeded"}),
    ({"framework": "lerobot"}, {"generator": "lerobot", "dtype": "float32", "shards": 0, "weights": "lerobot"}),
    ({"framework": "pytorch", "checkpoint": {"shards": [{"file": "a"}, {"file": "b"}, {"file": "c"}]}},
     {"generator": "checkpoint", "dtype": "bfloat16", "shards": 3}),
    ({"framework": "pytorch"}, {"generator": "checkpoint", "dtype": "float32", "shards": 0}),
])
def test_the_stand_in_recipe_comes_from_the_manifest(manifest, recipe):
    assert scale.stand_in_recipe(manifest) == recipe


def test_stand_in_commands_are_the_rules_generators():
    py = Path("/env/python3")
    seeded = scale.stand_in_command(py, scale.stand_in_recipe({"framework": "lerobot", "precision": {"weights": "bf16"}}),
                                    out=Path("/s/out"), config=Path("/m/policy.json"))
    assert seeded == ["/env/python3", "-m", "dsa.frontends.lerobot.cli", "init", "--config-file", "/m/policy.json",
                      "--seed", "0", "--out-dir", "/s/out", "--weights", "seeded", "--dtype", "bfloat16"]
    own = scale.stand_in_command(py, scale.stand_in_recipe({"framework": "lerobot"}), out=Path("/o"),
                                 config=Path("/c.json"))
    assert "--weights" not in own and "--dtype" not in own
    sharded = scale.stand_in_command(py, {"generator": "checkpoint", "dtype": "bfloat16", "shards": 3},
                                     out=Path("/o"), view=Path("/v.json"), pythonpath=["/root"])
    assert sharded == ["/env/python3", "-m", "dsa.stages.checkpoint", "--view", "/v.json", "--seed", "0",
                       "--dtype", "bfloat16", "--out", "/o", "--pythonpath", "/root", "--shards", "3"]


def test_a_lerobot_manifest_makes_its_stand_in_from_models_policy_json(tmp_path):
    subject = scale.manifest_subject(ROOT / "manifests" / "pi0_lerobot.yaml", ROOT)
    assert subject.framework == "lerobot" and subject.key == "pi0_lerobot"
    assert subject.lerobot_config == ROOT / "models" / "pi0_lerobot" / "policy.json"
    assert subject.description == "manifests/pi0_lerobot.yaml"
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"model_id": "nowhere", "framework": "lerobot"}))
    with pytest.raises(DsaError, match="models/nowhere/policy.json"):
        scale.manifest_subject(tmp_path / "m.yaml", tmp_path)
    given = scale.manifest_subject(tmp_path / "m.yaml", tmp_path, weights=tmp_path / "policy")
    assert given.lerobot_config is None and given.weights == tmp_path / "policy"


def test_the_pi0_sweep_takes_the_real_sizes_recipe_at_every_size():
    small, medium, real = scale.sweep_subjects("pi0", ROOT)
    recipe = yaml.safe_load((ROOT / "manifests" / "pi0_full.yaml").read_text())
    assert [s.key for s in (small, medium, real)] == ["pi0_small", "pi0_medium", "pi0_full"]
    assert [s.size for s in (small, medium, real)] == ["small", "medium", "real"]
    for subject in (small, medium):
        for field in scale.RECIPE_FIELDS:
            assert subject.manifest.get(field) == recipe.get(field), (subject.key, field)
        assert subject.manifest["model_id"] == subject.key and "processors" not in subject.manifest
        assert scale.stand_in_recipe(subject.manifest) == scale.stand_in_recipe(recipe)
    # The small size keeps its own inputs and config; the medium the real inputs with smaller Gemmas.
    assert small.manifest["inputs"] == yaml.safe_load((ROOT / "manifests" / "pi0_lerobot.yaml").read_text())["inputs"]
    assert small.lerobot_config == ROOT / "models" / "pi0_lerobot" / "policy.json" and not small.variants
    assert medium.manifest["inputs"] == recipe["inputs"]
    assert set(medium.variants) == {"paligemma_variant", "action_expert_variant"}
    assert all(v.startswith("dsa-gemma:") for v in medium.variants.values())
    # The real size is the real manifest itself: the subject of the same name.
    assert real.manifest == recipe and real.key == "pi0_full"
    assert (small.old_design, medium.old_design, real.old_design) == (True, True, False)
    with pytest.raises(DsaError, match="no sweep"):
        scale.sweep_subjects("nope", ROOT)


def test_a_manifest_is_repinned_to_its_weights_only_where_they_differ(tmp_path):
    from dsa.core.fileio import sha256_file

    directory = tmp_path / "ckpt"
    directory.mkdir()
    for name, body in (("model.safetensors.index.json", b"{}"), ("model-00001-of-00002.safetensors", b"one"),
                       ("model-00002-of-00002.safetensors", b"two")):
        (directory / name).write_bytes(body)
    index = directory / "model.safetensors.index.json"
    manifest = {"model_id": "m", "checkpoint": {"sha256": sha256_file(index), "shards": [
        {"file": "model-00001-of-00002.safetensors", "sha256": "0" * 64},
        {"file": "model-00002-of-00002.safetensors", "sha256": sha256_file(directory / "model-00002-of-00002.safetensors")}]}}
    pinned, changed = scale.repin(manifest, index, None)
    assert changed == ["checkpoint.shards[0].sha256"]
    assert pinned["checkpoint"]["shards"][0]["sha256"] == sha256_file(directory / "model-00001-of-00002.safetensors")
    assert manifest["checkpoint"]["shards"][0]["sha256"] == "0" * 64  # the given data is not changed
    again, changed = scale.repin(pinned, index, None)
    assert changed == [] and again is pinned


def test_scratch_estimate_counts_the_stand_in_and_the_archive():
    bf16 = {"framework": "lerobot", "precision": {"weights": "bf16"}}
    assert scale.estimate_scratch_bytes(bf16, 10 ** 9) == 4 * 10 ** 9          # bf16 checkpoint + bf16 archive
    assert scale.estimate_scratch_bytes({"framework": "pytorch"}, 10 ** 9) == 8 * 10 ** 9
    int4 = {"framework": "pytorch", "checkpoint": {"shards": [{}, {}, {}]}, "quant_scheme": {"kind": "int4"}}
    assert scale.estimate_scratch_bytes(int4, 10 ** 9) == int(2e9 + 4e9 * 0.2)


# -- rendering from fixed data ----------------------------------------------------------------------------------
def _stages(standin=(72.0, 4_000_000), export=(44.0, 1_500_000)):
    return [{"stage": "stand-in", "wall_s": standin[0], "peak_rss_kib": standin[1]},
            {"stage": "export", "wall_s": export[0], "peak_rss_kib": export[1]},
            {"stage": "params", "wall_s": 29.0, "peak_rss_kib": 1_100_000},
            {"stage": "export batch_0", "wall_s": 40.0, "peak_rss_kib": 1_550_000},
            {"stage": "compile batch_0 x86_64-v3", "wall_s": 50.0, "peak_rss_kib": 300_000},
            {"stage": "compile batch_0 x86_64-v4", "wall_s": 47.0, "peak_rss_kib": 310_000}]


MACHINE = {"cpu": "Test CPU", "cores": 2, "threads": 2, "memory_gib": 23.5, "avx512": True, "system": "Linux",
           "loadavg": "0.00 0.00 0.00"}


def _entry(key, params, size=None, **extra):
    entry = {
        "key": key, "model_id": key, "manifest": f"manifests/{key}.yaml", "framework": "lerobot",
        "description": f"manifests/{key}.yaml", "family": "pi0" if size else None, "size": size,
        "date": "2026-12-04 16:00", "command": "bin/dsa scale --sweep pi0", "machine": MACHINE, "notes": [],
        "weights": {"source": "stand-in", "generator": "lerobot", "dtype": "bfloat16", "pins": "match"},
        "parameter_count": params, "checkpoint_parameters": int(params * 1.08), "checkpoint_bytes": params * 2,
        "checkpoint_files": 1, "irpa_bytes": params * 2, "mlir_bytes": 1000, "targets": ["x86_64-v3", "x86_64-v4"],
        "modules": {"x86_64-v3": [{"vmfb": "x86_64-v3/batch_0.vmfb", "bytes": 900_000, "sha256": "a3" * 32,
                                   "bucket": {"dim": "batch", "size": 1}}],
                    "x86_64-v4": [{"vmfb": "x86_64-v4/batch_0.vmfb", "bytes": 800_000, "sha256": "a4" * 32,
                                   "bucket": {"dim": "batch", "size": 1}}]},
        "vmfb_bytes": {"x86_64-v3": 900_000, "x86_64-v4": 800_000},
        "stages": _stages(), "import_s": 230.0,
        "runtime": {"x86_64-v3": {"median_ms": 41_000.0, "first_call_ms": 52_000.0, "load_s": 3.0, "runs": 3,
                                  "vmhwm_kib": 6_200_000, "inputs": "batch=1, steps=10", "error_vs_eager": 2.1e-5},
                    "x86_64-v4": {"median_ms": 35_000.0, "first_call_ms": 47_000.0, "load_s": 3.0, "runs": 3,
                                  "vmhwm_kib": 6_100_000, "inputs": "batch=1, steps=10", "error_vs_eager": 4.8e-5}},
        "eager": {"median_ms": 32_000.0, "first_call_ms": 40_000.0, "load_s": 60.0, "runs": 3,
                  "vmhwm_kib": 15_400_000, "inputs": "batch=1, steps=10"},
    }
    entry.update(extra)
    return entry


DATA = {
    "format": 1, "date": "2026-12-04",
    "toolchain": {"iree-base-compiler": "3.13.0", "iree-base-runtime": "3.13.0", "iree-turbine": "3.9.0",
                  "torch": "2.13.0+cpu", "lerobot environment": {"lerobot": "0.4.4", "torch": "2.14.1",
                                                                 "transformers": "4.57.6"}},
    "subjects": [
        _entry("pi0_small", 16_610_000, "small", stages=_stages((5.0, 600_000), (6.0, 700_000)),
               old_design={"stand-in": {"wall_s": 6.0, "peak_rss_kib": 650_000},
                           "export": {"wall_s": 8.0, "peak_rss_kib": 900_000}}),
        _entry("pi0_medium", 560_000_000, "medium", stages=_stages((30.0, 1_800_000), (20.0, 1_000_000)),
               old_design={"stand-in": {"wall_s": 60.0, "peak_rss_kib": 5_000_000},
                           "export": {"error": "killed"}}),
        _entry("pi0_full", 3_240_000_000, "real"),
        _entry("pi05_full", 3_240_000_000, None, notes=["the manifest's pins are not this stand-in's"],
               runtime={"x86_64-v3": {"not_run": "it needs the CPU features avx2"},
                        "x86_64-v4": {"error": "boom"}},
               eager={"not_run": "its float32 weights alone need 30.0 GiB"}),
    ],
    "sweeps": {"pi0": {"recipe": "manifests/pi0_full.yaml", "old_design": ["small", "medium"], "points": [
        {"size": "small", "key": "pi0_small", "config": "models/pi0_lerobot/policy.json", "variants": {}},
        {"size": "medium", "key": "pi0_medium", "config": "models/pi0_full/policy.json", "variants": {"x": "y"}},
        {"size": "real", "key": "pi0_full", "config": "models/pi0_full/policy.json", "variants": {}}]}},
}


def _rows(table):
    return [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith("| `")]


def test_the_build_table_has_one_cell_per_stage_kind():
    table = scale.render_build_table([_entry("pi0_full", 3_240_000_000)])
    assert table.splitlines()[0] == ("| model | params (graph / checkpoint) | checkpoint | irpa | vmfb | stand-in | export "
                                     "| params | bucket export | compile x86_64-v3 | compile x86_64-v4 | dsa compile, all |")
    (row,) = _rows(table)
    assert row == ["`pi0_full`", "3.24 B / 3.50 B", "6.48 GB", "6.48 GB", "900.0 kB, 800.0 kB", "72 s, 3.8 GiB",
                   "44 s, 1.4 GiB", "29 s, 1.0 GiB", "40 s, 1.5 GiB", "50 s, 293 MiB", "47 s, 303 MiB",
                   "230 s, peak 1.5 GiB (export batch_0)"]


def test_the_runtime_table_has_each_target_and_eager_and_says_why_not():
    rows = _rows(scale.render_runtime_table([DATA["subjects"][2], DATA["subjects"][3]]))
    assert [r[1] for r in rows] == ["IREE x86_64-v3", "IREE x86_64-v4", "eager LeRobot"] * 2
    assert rows[0][2:8] == ["41.0 s (of 3)", "52.0 s", "3.0 s", "5.9 GiB", "1.28×", "2.1e-05"]
    assert rows[2][2:7] == ["32.0 s (of 3)", "40.0 s", "60 s", "14.7 GiB", scale.MISSING]
    assert rows[3][2] == "it needs the CPU features avx2"
    assert rows[4][2].startswith("failed: boom")
    assert rows[5][2] == "its float32 weights alone need 30.0 GiB"


def test_the_sweep_table_has_each_size_with_old_design_where_measured():
    table = scale.render_sweep_table(DATA, "pi0")
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[2:]]
    assert [r[0] for r in rows] == ["small (`pi0_small`)", "medium (`pi0_medium`)", "real (`pi0_full`)"]
    small, medium, real = rows
    assert small[1:7] == ["16.61 M", "586 MiB", "635 MiB", "684 MiB", "879 MiB", "1.0 GiB"]
    assert medium[5] == "failed"
    assert real[3] == "not run" and real[5].startswith("not run (OOM-killed")
    assert real[9] == "5.9 GiB" and real[10] == "14.7 GiB"  # runtime: the largest over targets


def test_rendering_is_a_pure_function_of_the_data(tmp_path):
    doc = scale.render_document(DATA, "real-size-rss.png")
    assert doc == scale.render_document(DATA, "real-size-rss.png")
    assert doc.startswith("# Real sizes")
    assert "![peak RSS per stage against parameter count](real-size-rss.png)" in doc
    assert "bin/dsa scale --sweep pi0" in doc and "Test CPU, 2 cores, 23.5 GiB, AVX-512 yes" in doc
    assert "lerobot 0.4.4" in doc
    assert "* `pi05_full`: the manifest's pins are not this stand-in's" in doc
    # The real-size tables hold the real subjects; the smaller sizes are listed under the sweep.
    build = doc[doc.index("## Build"):doc.index("## Runtime")]
    assert [r[0] for r in _rows(build)] == ["`pi0_full`", "`pi05_full`"]
    assert "`pi0_small` (pi0, small)" in doc[doc.index("## PI0 at three sizes"):]


def test_the_plot_is_written_from_the_sweep(tmp_path):
    path = tmp_path / "real-size-rss.png"
    assert scale.render_plot(DATA, "pi0", path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    one = dict(DATA, subjects=DATA["subjects"][:1])
    assert not scale.render_plot(one, "pi0", tmp_path / "none.png")


RESULTS = """# Benchmark results

Intro.

## LeRobot policies

rows

## Quantised matmuls at OpenVLA's real layer sizes

more rows
"""


def test_the_results_section_goes_between_markers_and_nothing_else_changes():
    section = scale.render_results_section(DATA)
    assert section.startswith("## Real sizes") and "[docs/real-size.md](../docs/real-size.md)" in section
    out = scale.replace_marked(RESULTS, section)
    assert out.index(scale.BEGIN_MARKER) < out.index("## Real sizes") < out.index(scale.END_MARKER) \
        < out.index("## Quantised matmuls")
    assert out.replace(out[out.index(scale.BEGIN_MARKER):out.index(scale.END_MARKER) + len(scale.END_MARKER) + 2],
                       "") == RESULTS
    assert scale.replace_marked(out, section) == out                        # idempotent
    assert scale.replace_marked(out, "## Real sizes\n\nnew\n").count("## Real sizes") == 1
    with pytest.raises(DsaError, match="only one of the real-size markers"):
        scale.replace_marked(f"x\n{scale.BEGIN_MARKER}\n", section)


def test_a_subject_not_measured_is_a_row_saying_why():
    entry = {"key": "openvla_7b", "framework": "pytorch", "size": None, "not_measured": "needs about 21.0 GB"}
    (row,) = _rows(scale.render_build_table([entry, _entry("pi0_full", 3_240_000_000)])[:-1].rsplit("\n", 1)[0])
    assert row[:2] == ["`openvla_7b`", "not measured: needs about 21.0 GB"]
    assert "openvla_7b" not in scale.render_runtime_table([entry])


def test_merging_replaces_a_subject_by_key_and_keeps_the_others():
    first = scale.merge(None, [_entry("a", 1), _entry("b", 2)], [], {"torch": "1"})
    again = scale.merge(first, [_entry("a", 3), _entry("c", 4)], ["pi0"], {"torch": "2"})
    assert [(e["key"], e["parameter_count"]) for e in again["subjects"]] == [("a", 3), ("b", 2), ("c", 4)]
    assert again["sweeps"]["pi0"]["points"][1]["key"] == "pi0_medium" and again["toolchain"] == {"torch": "2"}
    with pytest.raises(DsaError, match="format"):
        scale.merge(dict(first, format=99), [], [], {})


# -- one real run ---------------------------------------------------------------------------------------------
def test_a_real_run_on_a_tiny_manifest(tmp_path):
    """Stand-in, dsa compile --no-cache for two targets, the runtime on each this machine runs, eager PyTorch,
    under a lock; the data, the docs and the marked RESULTS.md section written; the pins re-pinned."""
    from dsa.runtime.host import runs_here
    from dsa.core.fileio import read_json

    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(yaml.safe_dump({
        "schema_version": "1.3.0", "model_id": "tiny", "framework": "pytorch",
        "model": {"entry_point": "tiny_models:pooled", "config": {"width": 8}},
        "checkpoint": {"path": "checkpoint.safetensors", "sha256": "0" * 64},
        "inputs": {"state": {"dim": 3}, "cameras": [], "prompt": {"vocab_size": 16, "pad_id": 0}},
        "outputs": {"action": {"dim": 2}}, "chunk_size": 1, "n_action_steps": 1, "flow_steps": 1,
        "buckets": {}, "quant_scheme": {"kind": "none"}, "targets": ["x86_64-v3", "x86_64-v4"],
        "power_profile": "balanced"}))
    results = tmp_path / "RESULTS.md"
    results.write_text(RESULTS)
    lock = tmp_path / "heavy.lock"
    start = time.monotonic()
    scale.main([str(manifest), "--root", str(ROOT), "--pythonpath", str(HERE), "--lock", str(lock),
                "--work", str(tmp_path / "work"), "--out-dir", str(tmp_path / "docs"), "--results", str(results),
                "--runs", "2", "--max-scratch-gb", "1"])
    took = time.monotonic() - start
    data = read_json(tmp_path / "docs" / "real-size.json")
    (entry,) = data["subjects"]
    assert entry["key"] == "tiny" and entry["weights"]["source"] == "stand-in"
    assert entry["weights"]["pins"] == "re-pinned" and "checkpoint.sha256" in entry["notes"][0]
    assert [s["stage"] for s in entry["stages"]] == ["stand-in", "export", "params", "compile model x86_64-v3",
                                                     "compile model x86_64-v4"]
    assert all(s["wall_s"] > 0 and s["peak_rss_kib"] > 10_000 for s in entry["stages"])
    assert entry["parameter_count"] == entry["checkpoint_parameters"] == 4 * 8 + 8 + 11 * 2 + 2
    assert entry["checkpoint_bytes"] > 0 and entry["irpa_bytes"] > 0 and entry["vmfb_bytes"]["x86_64-v3"] > 0
    assert len(entry["modules"]["x86_64-v3"][0]["sha256"]) == 64
    assert entry["compile_command"].startswith("dsa compile --manifest <scratch>/") and "--no-cache" in entry["compile_command"]
    specs = {t: read_json(ROOT / "toolchains" / "targets" / f"{t}.json") for t in entry["targets"]}
    for target, spec in specs.items():
        runtime = entry["runtime"][target]
        if runs_here(spec):
            assert runtime["runs"] == 2 and runtime["median_ms"] > 0 and runtime["first_call_ms"] > 0
            assert 10_000 < runtime["vmhwm_kib"] < 1_000_000      # the runtime process alone: no torch in it
            assert runtime["error_vs_eager"] < 1e-5
            assert runtime["inputs"] == "seq_len=2"
        else:
            assert "not_run" in runtime
    assert entry["eager"]["runs"] == 2 and entry["eager"]["vmhwm_kib"] > 100_000  # torch is in this one
    assert not (tmp_path / "work" / "tiny").exists()  # scratch removed
    assert lock.exists()
    doc = (tmp_path / "docs" / "real-size.md").read_text()
    assert "`tiny`" in doc and "IREE x86_64-v3" in doc
    text = results.read_text()
    assert "## Real sizes" in text and text.count(scale.BEGIN_MARKER) == 1 and "## Quantised matmuls" in text
    print(f"the tiny run took {took:.0f} s")
    # Rendering again from the data changes nothing.
    before = doc
    scale.main(["--render", "--root", str(ROOT), "--out-dir", str(tmp_path / "docs"), "--results", str(results)])
    assert (tmp_path / "docs" / "real-size.md").read_text() == before


def test_the_eager_weights_of_a_quantised_model_are_its_integers_and_scales_not_float32():
    """A weight-quantised subject's eager reference holds one byte per quantised weight and a float32 scale per
    group (dsa.tools.testing.quantised_eager_policy), float32 for the rest: OpenVLA-7B's 7.5B weights fit in
    ~10 GiB that way, not the 30 GB of float32 that skipped its eager column."""
    record = {"quantization": {"scheme": {"kind": "int4", "group_size": 32},
                               "tensors": {"a.weight": {"kind": "int4", "group_size": 32, "shape": [64, 128]},
                                           "b.weight": {"kind": "int4", "group_size": 32, "shape": [32, 64]}}}}
    quantised = 64 * 128 + 32 * 64
    assert scale.eager_weight_bytes(record, quantised + 100) == quantised + 4 * quantised // 32 + 4 * 100
    assert scale.eager_weight_bytes({}, 1000) == 4000


def test_a_quantised_subject_is_compared_with_eager_on_the_same_quantised_weights(tmp_path):
    """An int4 subject (OpenVLA-7B's kind): its eager column comes from the quantised reference, so the
    runtime's deviation from it is float32 reduction order (measured ~1e-7 here), not the quantisation error
    (~1e-1 against the float32 model, what the column showed before)."""
    from dsa.core.fileio import read_json
    from dsa.runtime.host import runs_here

    manifest = tmp_path / "tinyq.yaml"
    manifest.write_text(yaml.safe_dump({
        "schema_version": "1.3.0", "model_id": "tinyq", "framework": "pytorch",
        "model": {"entry_point": "tiny_models:mlp", "config": {}},
        "checkpoint": {"path": "checkpoint.safetensors", "sha256": "0" * 64},
        "inputs": {"state": {"dim": 3}, "cameras": []},
        "outputs": {"action": {"dim": 2}}, "chunk_size": 1, "n_action_steps": 1, "flow_steps": 1,
        "buckets": {}, "quant_scheme": {"kind": "int4", "group_size": 32}, "targets": ["x86_64-v3"],
        "power_profile": "balanced"}))
    (tmp_path / "RESULTS.md").write_text(RESULTS)
    scale.main([str(manifest), "--root", str(ROOT), "--pythonpath", str(HERE), "--no-lock",
                "--work", str(tmp_path / "work"), "--out-dir", str(tmp_path / "docs"),
                "--results", str(tmp_path / "RESULTS.md"), "--runs", "1", "--max-scratch-gb", "1"])
    (entry,) = read_json(tmp_path / "docs" / "real-size.json")["subjects"]
    assert entry["eager"]["runs"] == 1, entry["eager"]
    runtime = entry["runtime"]["x86_64-v3"]
    if not runs_here(read_json(ROOT / "toolchains" / "targets" / "x86_64-v3.json")):
        pytest.skip("x86-64-v3 modules do not run on this CPU")
    assert runtime["error_vs_eager"] < 1e-5, runtime


def test_a_subject_over_the_scratch_limit_is_refused_before_its_stand_in(tmp_path):
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(yaml.safe_dump({
        "schema_version": "1.3.0", "model_id": "tiny", "framework": "pytorch",
        "model": {"entry_point": "tiny_models:pooled", "config": {"width": 8}},
        "checkpoint": {"path": "checkpoint.safetensors", "sha256": "0" * 64},
        "inputs": {"state": {"dim": 3}, "cameras": [], "prompt": {"vocab_size": 16, "pad_id": 0}},
        "outputs": {"action": {"dim": 2}}, "chunk_size": 1, "n_action_steps": 1, "flow_steps": 1,
        "buckets": {}, "quant_scheme": {"kind": "none"}, "targets": ["x86_64-v3"], "power_profile": "balanced"}))
    with pytest.raises(DsaError, match="1 subject\\(s\\) not measured: tiny: .*scratch"):
        scale.main([str(manifest), "--root", str(ROOT), "--pythonpath", str(HERE), "--no-lock",
                    "--work", str(tmp_path / "work"), "--out-dir", str(tmp_path / "docs"), "--results", "",
                    "--max-scratch-gb", "0.0000001"])
    # The data and the docs say it was not measured, and why.
    from dsa.core.fileio import read_json

    (entry,) = read_json(tmp_path / "docs" / "real-size.json")["subjects"]
    assert entry["key"] == "tiny" and "scratch" in entry["not_measured"] and "stages" not in entry
    assert "| `tiny` | not measured: " in (tmp_path / "docs" / "real-size.md").read_text()


@pytest.mark.parametrize("derived", [False, True])
def test_the_manifest_dsa_compile_reads_is_pinned_to_the_weights(tmp_path, derived):
    from dsa.core.fileio import sha256_file

    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"weights")
    manifest = {"model_id": "m", "framework": "pytorch", "checkpoint": {"path": "x", "sha256": "0" * 64}}
    subject = scale.Subject(key="m", source=tmp_path / "m.yaml", manifest=manifest, derived=derived)
    given = scale.write_manifest(manifest, tmp_path / "given" / "m.yaml")
    entry = {"weights": {"source": "stand-in"}, "notes": []}
    path = scale.pin_manifest(subject, checkpoint, None, given, entry)
    assert yaml.safe_load(path.read_text())["checkpoint"]["sha256"] == sha256_file(checkpoint)
    assert entry["weights"]["pins"] == ("derived" if derived else "re-pinned")
    assert bool(entry["notes"]) is not derived  # a sweep point's own manifest is pinned to its stand-in: no note
    matching = dict(manifest, checkpoint={"path": "x", "sha256": sha256_file(checkpoint)})
    entry = {"weights": {"source": "stand-in"}, "notes": []}
    same = scale.pin_manifest(scale.Subject(key="m", source=given, manifest=matching), checkpoint, None, given, entry)
    assert same == given and entry["weights"]["pins"] == "match" and not entry["notes"]


def test_a_failed_steps_cause_is_its_last_error_line():
    stderr = "Traceback ...\n  File x\nwarning: noise\ndsa compile: error: checkpoint.sha256: mismatch\n\nexiting\n"
    assert scale.failure_cause(stderr) == "dsa compile: error: checkpoint.sha256: mismatch"
    assert scale.failure_cause("only\nlines\n") == "lines"
    assert scale.failure_cause("") == "no message"
