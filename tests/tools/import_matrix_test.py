"""dsa/tools/import_matrix/ without Bazel: the table is a pure function of the collected data (row order, units,
✗ and "not run" cells), the README's marked section is replaced without touching the rest, test.xml is read
as passed / failed / not run, and a child's peak RSS comes from its wait4 rusage."""

import json
import sys
from pathlib import Path

import pytest

from dsa.core.errors import DsaError

from dsa.tools import import_matrix as im
from dsa.tools import measure


def _row(model, module=None, *, pipeline=None, front_end="pytorch", export=True, compile=True, parity="passed", modules=1,
         measured=None, notes=(), vmfb=564_000, irpa=9_490_432, mlir=187_355, params=2_363_086):
    status = {"passed": {"status": "passed", "tests": 4, "failures": 0},
              "failed": {"status": "failed", "tests": 4, "failures": 1},
              "not run": {"status": "not run", "tests": 0, "failures": 0}}[parity]
    return {"model": model, "module": module or model, "pipeline": pipeline, "front_end": front_end,
            "export": export, "compile": compile,
            "parity": status, "modules": modules, "vmfb_bytes": vmfb if compile else None,
            "irpa_bytes": irpa if compile else None, "mlir_bytes": mlir if export else None,
            "parameter_count": params if export else None, "target": "x86_64-v3", "measured": measured,
            "notes": list(notes)}


MEASURED = {"module": "prompt_len_0", "compile_s": 16.26, "peak_rss_kib": 210_000, "identical": True,
            "latency_ms": 23.334, "inputs": "prompt_len=32, steps=10", "vmfb_sha256": "a", "built_sha256": "a",
            "import_s": 112.4, "import_peak_rss_kib": 5_125_000, "import_peak_stage": "export"}

DATA = {
    "format": 1, "date": "2026-11-30", "command": "./bazelw run //tools:import_matrix", "measure": True,
    "runs": 10, "target": "x86_64-v3",
    "machine": {"cpu": "Test CPU", "cores": 2, "threads": 2, "system": "Linux", "loadavg": "0.00 0.00 0.00"},
    "toolchain": {"iree-base-compiler": "3.13.0", "iree-base-runtime": "3.13.0"},
    "rows": [
        _row("pi0", modules=3, measured=MEASURED),
        _row("act", parity="failed", measured=dict(MEASURED, module="model", compile_s=5.0, latency_ms=1234.5,
                                                   inputs="batch=1")),
        _row("openvla", export=False, compile=False, parity="not run", notes=["openvla.modules.json not found"]),
        _row("groot", "groot_backbone", pipeline="groot", measured=None),
        _row("groot", "groot_head", pipeline="groot", measured=dict(MEASURED, identical=False, vmfb_sha256="b")),
    ],
}


def _table_rows(table):
    return [line for line in table.splitlines() if line.startswith("| `")]


def test_table_keeps_row_order_and_formats_units():
    table = im.render_table(DATA)
    rows = _table_rows(table)
    assert [r.split("|")[1].strip() for r in rows] == [
        "`pi0`", "`act`", "`openvla`", "`groot › backbone`", "`groot › head`"]
    pi0 = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert pi0 == ["`pi0`", "torch.export", "✓", "✓ (3 modules)", "✓ 4 passed", "564.0 kB", "9.49 MB", "187.4 kB", "2.36 M",
                   "16.3 s", "205 MiB", "112 s, 4.9 GiB (export)", "23.33 ms",
                   "prompt_len_0 (prompt_len=32, steps=10)"]
    assert "1234 ms" in rows[1] or "1235 ms" in rows[1]
    assert table.splitlines()[0].startswith("| model | front end | export | compile | parity | vmfb | irpa | MLIR |")


def test_missing_cells_are_crosses_and_not_run():
    rows = _table_rows(im.render_table(DATA))
    act = [c.strip() for c in rows[1].split("|")[1:-1]]
    assert act[4] == "✗ 1 of 4 failed"
    openvla = [c.strip() for c in rows[2].split("|")[1:-1]]
    assert openvla[2:5] == ["✗", "✗", "not run"]
    assert openvla[5:] == [im.MISSING] * 9
    backbone = [c.strip() for c in rows[3].split("|")[1:-1]]  # compiled, not measured
    assert backbone[9:13] == [im.NOT_MEASURED] * 4


def test_byte_mismatch_is_loud():
    table = im.render_table(DATA)
    head = _table_rows(table)[4]
    assert "✗ re-run differs" in head
    assert "not byte-identical" in table and "`groot_head`" in table
    assert "openvla.modules.json not found" in table


def test_rendering_is_a_pure_function_of_the_data():
    assert im.render_table(DATA) == im.render_table(DATA)
    assert im.render_document(DATA) == im.render_document(DATA)
    doc = im.render_document(DATA)
    assert doc.startswith("# Import matrix")
    assert im.render_table(DATA) in doc
    assert "Test CPU" in doc and "2026-11-30" in doc and "./bazelw run //tools:import_matrix" in doc
    unmeasured = dict(DATA, measure=False)
    assert "--no-measure" in im.render_table(unmeasured)


def test_import_cell_says_time_peak_and_stage_or_not_measured():
    assert im.fmt_import({"import_s": 41.6, "import_peak_rss_kib": 600 * 1024, "import_peak_stage": "params"}) == \
        "42 s, 600 MiB (params)"
    assert im.fmt_import({"compile_s": 1.0}) == im.NOT_MEASURED  # --no-import, or dsa compile failed (a note)


def test_import_command_builds_the_policy_from_its_build_inputs_in_its_own_environment(tmp_path):
    runfiles = tmp_path / "bench.runfiles" / "_main"
    for rel in ["toolchains/targets", "toolchains/tuning"]:
        (runfiles / rel).mkdir(parents=True)
    python = tmp_path / "bench.runfiles" / "dsa_lerobot_python" / "bin" / "python3"
    python.parent.mkdir(parents=True)
    python.write_text("")
    source = {"name": "act", "manifest": "manifests/act.yaml", "checkpoint": "models/act_policy/model.safetensors",
              "policy_config": "models/act_policy/config.json", "python": "../dsa_lerobot_python/bin/python3"}
    cmd = im.import_command(source, tmp_path / "out", runfiles, tmp_path / "ws")
    assert cmd[:4] == [str(python), "-m", "dsa", "compile"]
    # Every stage run: never a compile-cache hit timed as an import.
    assert cmd[-1] == "--no-cache" and cmd.count("--no-cache") == 1
    flags = dict(zip(cmd[4:-1:2], cmd[5:-1:2]))
    assert flags == {"--manifest": str(runfiles / "manifests/act.yaml"), "--out": str(tmp_path / "out"),
                     "--checkpoint": str(runfiles / "models/act_policy/model.safetensors"),
                     "--targets-dir": str(runfiles / "toolchains/targets"),
                     "--tuning-dir": str(runfiles / "toolchains/tuning"), "--pythonpath": str(runfiles),
                     "--policy-config": str(runfiles / "models/act_policy/config.json")}
    plain = im.import_command(dict(source, python=None, policy_config=None), tmp_path / "o", runfiles, tmp_path)
    assert plain[0] == sys.executable and "--policy-config" not in plain and "--model-file" not in plain
    # A file front end's model file (the policies index's model_file) is passed as the build imported it.
    onnx = im.import_command(dict(source, python=None, policy_config=None, model_file="models/m/model.onnx"),
                             tmp_path / "o", runfiles, tmp_path)
    assert onnx[onnx.index("--model-file") + 1] == str(runfiles / "models/m/model.onnx")


def test_fmt_bytes_units():
    assert im.fmt_bytes(None) == im.MISSING
    assert im.fmt_bytes(999) == "999 B"
    assert im.fmt_bytes(167_247) == "167.2 kB"
    assert im.fmt_bytes(9_490_432) == "9.49 MB"
    assert im.fmt_bytes(137_039_872) == "137.0 MB"
    assert im.fmt_bytes(1_050_900_000) == "1.05 GB"


README = """# rules_dsa

Intro.

## Performance

Perf text.

{section}## Read next

Links.
"""


def test_markers_replaced_without_touching_other_text():
    old = f"## Import matrix\n\nHand-written words.\n\n{im.BEGIN_MARKER}\n| old | table |\n{im.END_MARKER}\n\n"
    text = README.format(section=old)
    out = im.replace_marked(text, "| new | table |\n")
    assert out == text.replace("| old | table |", "| new | table |")
    assert im.replace_marked(out, "| new | table |\n") == out  # idempotent


def test_markers_added_before_read_next_section_when_absent():
    text = README.format(section="")
    out = im.replace_marked(text, "| t |\n")
    assert out.startswith(text[:text.index("## Read next")])
    assert out.endswith(text[text.index("## Read next"):])
    section = out[out.index("## Import matrix"):out.index("## Read next")]
    assert f"{im.BEGIN_MARKER}\n| t |\n{im.END_MARKER}" in section
    assert im.replace_marked(out, "| t |\n") == out


def test_single_marker_is_refused():
    with pytest.raises(DsaError, match="only one of the import-matrix markers"):
        im.replace_marked(f"x\n{im.BEGIN_MARKER}\ny\n", "| t |")


PASSED_XML = ('<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" '
              'errors="0" failures="0" skipped="1" tests="3"><testcase classname="a" name="x" time="1" />'
              '<testcase classname="a" name="y" time="1" /><testcase classname="a" name="z"><skipped /></testcase>'
              '</testsuite></testsuites>')
FAILED_XML = ('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" '
              'failures="1" tests="2"><testcase classname="a" name="x" /><testcase classname="a" name="y">'
              '<failure message="assert 1 == 2">trace</failure></testcase></testsuite></testsuites>')
# What Bazel writes itself for a test that wrote no XML (a crash or a timeout).
BAZEL_XML = ('<?xml version="1.0" encoding="UTF-8"?><testsuites><testsuite name="models/act/act_test" tests="1" '
             'failures="0" errors="1"><testcase name="models/act/act_test" status="run" duration="3600">'
             '<error message="exited with error code 142"></error></testcase></testsuite></testsuites>')


@pytest.mark.parametrize("xml, status, tests, failures", [
    (PASSED_XML, "passed", 3, 0), (FAILED_XML, "failed", 2, 1), (BAZEL_XML, "failed", 1, 1)])
def test_test_xml_parsing(tmp_path, xml, status, tests, failures):
    directory = im.test_xml_dir(tmp_path, "//models/act:act_test")
    assert directory == tmp_path / "models" / "act" / "act_test"
    directory.mkdir(parents=True)
    (directory / "test.xml").write_text(xml)
    result = im.parse_test_result(directory)
    assert (result["status"], result["tests"], result["failures"]) == (status, tests, failures)
    assert im.fmt_parity(result) in ("✓ 3 passed", "✗ 1 of 2 failed", "✗ 1 of 1 failed")


def test_absent_test_xml_is_not_run(tmp_path):
    result = im.parse_test_result(tmp_path / "models" / "x" / "x_test")
    assert result["status"] == im.NOT_RUN
    assert im.fmt_parity(result) == "not run"


def test_sharded_results_are_summed(tmp_path):
    directory = tmp_path / "t"
    for shard, xml in (("shard_1_of_2", PASSED_XML), ("shard_2_of_2", FAILED_XML)):
        (directory / shard).mkdir(parents=True)
        (directory / shard / "test.xml").write_text(xml)
    result = im.parse_test_result(directory)
    assert (result["status"], result["tests"], result["failures"]) == ("failed", 5, 1)


def test_peak_rss_of_a_child_from_wait4():
    ballast = bytearray(128 * 1024 * 1024)  # this process is large; the measured child must not inherit it
    ballast[::4096] = b"x" * len(ballast[::4096])
    # A child that touches ~64 MiB: its ru_maxrss (KiB) is at least that, and far below a GiB.
    code = "b = bytearray(64 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096])"
    big = measure.run_measured([sys.executable, "-c", code])
    small = measure.run_measured([sys.executable, "-c", "pass"])
    assert big["returncode"] == 0 and small["returncode"] == 0
    assert big["peak_rss_kib"] >= 64 * 1024
    assert big["peak_rss_kib"] > small["peak_rss_kib"] + 32 * 1024
    assert big["peak_rss_kib"] < 1024 * 1024
    # Not this (larger) process's resident set: a child forked from it would start with that as its peak.
    assert small["peak_rss_kib"] < 48 * 1024
    assert big["wall_s"] > 0


def test_failing_child_reports_status_and_stderr():
    result = measure.run_measured([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"])
    assert result["returncode"] == 3
    assert "boom" in result["stderr"]


def test_sample_values_use_smallest_dynamic_size_and_flow_steps():
    record = {"dynamic_dims": {"batch": {"min": 1, "max": 65536}}, "inputs": [
        {"name": "image", "dtype": "float32", "shape": ["batch", 3, 8, 8], "dims": {"0": "batch"}},
        {"name": "steps", "dtype": "int64", "shape": [], "value_range": [1, 100]}]}
    values, described = im.sample_values(record, 10)
    assert values["image"].shape == (1, 3, 8, 8)
    assert int(values["steps"]) == 10
    assert described == "batch=1, steps=10"
    again, _ = im.sample_values(record, 10)
    assert (again["image"] == values["image"]).all()  # deterministic
    clamped, _ = im.sample_values(record, 1000)
    assert int(clamped["steps"]) == 100


def _runfiles_bin() -> Path:
    """The directory holding models/policies_index.json (//models:policies_index, this test's data)."""
    return Path(__file__).absolute().parents[2]


def test_unknown_model_is_refused():
    models = im.read_models(_runfiles_bin())
    with pytest.raises(DsaError, match="no model nope"):
        im.select_models("act,nope", models)
    assert [m.name for m in im.select_models("pi0,act", models)] == ["pi0", "act"]


def test_rows_come_from_the_policies_index_with_pipelines_in_one_row(tmp_path):
    (tmp_path / "models").mkdir()
    index = {"format": 1,
             "policies": [{"name": "a", "test": "//m:a_test"}, {"name": "bb", "test": ""}, {"name": "hd", "test": ""}],
             "pipelines": [{"name": "split", "stages": ["bb", "hd"], "test": "//m:split_test"}]}
    (tmp_path / "models" / "policies_index.json").write_text(json.dumps(index))
    rows = im.read_models(tmp_path)
    assert [(m.name, m.test, m.stages) for m in rows] == [("a", "//m:a_test", ()),
                                                         ("split", "//m:split_test", ("bb", "hd"))]
    (tmp_path / "models" / "policies_index.json").write_text(json.dumps(dict(index, format=9)))
    with pytest.raises(DsaError, match="policies index format 9 is not supported"):
        im.read_models(tmp_path)
    (tmp_path / "models" / "policies_index.json").unlink()
    with pytest.raises(DsaError, match="no policies index.*//models:policies_index"):
        im.read_models(tmp_path)


def test_every_manifest_is_a_row_or_a_stage_of_the_matrix():
    """A manifest without a dsa_policy (or a pipeline stage) in models/BUILD.bazel would silently be missing
    from the README's table: the policies index, discovered from the build graph, must cover every one."""
    import yaml

    manifests = Path(__file__).absolute().parents[2] / "manifests"
    model_ids = {yaml.safe_load(p.read_text())["model_id"] for p in manifests.glob("*.yaml")}
    assert model_ids, manifests
    models = im.read_models(_runfiles_bin())
    # The real-size policies (tagged real_size, built by hand) are the second table's rows.
    real = im.read_models(_runfiles_bin(), im.POLICIES_REAL_SIZE_INDEX)
    rows = {m.name for m in models + real} | {stage for m in models + real for stage in (m.stages or ())}
    assert model_ids <= rows, sorted(model_ids - rows)
    tests = {m.name: m.test for m in models}
    assert tests["pi0"] == "//models/pi0:pi0_test" and tests["groot"] == "//models/groot:groot_test"


BENCH_RESULTS = {
    "format": 1, "date": "2026-12-02", "runs": 30, "light": False,
    "policies": [
        {"model": "act", "case": "batch=1", "vmfb_sha256": "aa" * 32,
         "runtimes": {"eager": {"median_ms": 400.0, "runs": 30}, "vmfb": {"median_ms": 600.0, "runs": 30},
                      "onnxruntime": {"median_ms": 250.0, "runs": 30}}},
        {"model": "old", "case": "batch=1",  # a result from before the bench recorded hashes: never matched
         "runtimes": {"eager": {"median_ms": 1.0}, "vmfb": {"median_ms": 1.0}}},
    ],
    "models": [
        {"model": "pi0", "variants": {"tuned": {"vmfb_sha256": "bb" * 32}},
         "cases": [{"case": "steps=1", "runtimes": {"eager": {"median_ms": 16.0}, "vmfb:tuned": {"median_ms": 8.0}}},
                   {"case": "steps=10", "runtimes": {"eager": {"median_ms": 30.0},
                                                     "vmfb:tuned": {"median_ms": 12.0, "runs": 30}}}]},
    ],
}


def test_bench_latencies_are_keyed_by_the_timed_vmfb_sha256_with_their_eager_ratio(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(BENCH_RESULTS))
    found = im.read_bench_latencies(path)
    assert set(found) == {"aa" * 32, "bb" * 32}
    act = found["aa" * 32]
    assert (act["vmfb_ms"], act["eager_ms"], act["vs_eager"], act["vs_onnxruntime"]) == (600.0, 400.0, 1.5, 2.4)
    assert found["bb" * 32]["case"] == "steps=10" and found["bb" * 32]["vs_eager"] == 0.4
    assert im.read_bench_latencies(tmp_path / "absent.json") == {}


def test_a_row_the_bench_timed_takes_its_latency_and_says_so_and_others_keep_their_own(tmp_path):
    vmfb = tmp_path / "model.vmfb"
    vmfb.write_bytes(b"module bytes")
    import hashlib

    sha = hashlib.sha256(b"module bytes").hexdigest()
    unit = im.Unit("act", {}, tmp_path, [{"vmfb": vmfb}])
    bench = {sha: {"date": "2026-12-02", "case": "batch=1", "vmfb_ms": 600.0, "eager_ms": 400.0, "vs_eager": 1.5,
                   "vs_onnxruntime": 2.4, "runs": 30, "light": False, "source": "results.json"}}
    row = _row("act", measured=dict(MEASURED, module="batch_0"))
    im.attach_bench(row, unit, bench)
    cells = [c.strip() for c in _table_rows(im.render_table(dict(DATA, rows=[row])))[0].split("|")[1:-1]]
    assert cells[12] == "600.0 ms (1.50× eager, 2.40× ORT)"
    assert cells[13] == "batch_0 (bench 2026-12-02: batch=1)"
    other = _row("act", measured=dict(MEASURED, module="batch_0"))
    im.attach_bench(other, unit, {"cc" * 32: bench[sha]})   # another build's timing: not this module's
    assert other["bench"] is None
    assert [c.strip() for c in _table_rows(im.render_table(dict(DATA, rows=[other])))[0].split("|")[1:-1]][12] == \
        "23.33 ms"


@pytest.mark.parametrize("framework, cell", [("pytorch", "torch.export"), ("lerobot", "LeRobot → torch.export"),
                                             ("onnx", "ONNX (IREE's importer)"),
                                             ("stablehlo", "StableHLO (jax.export)"), (None, im.MISSING)])
def test_the_front_end_column_names_the_manifests_framework(framework, cell):
    row = _row("policy", front_end=framework)
    assert [c.strip() for c in _table_rows(im.render_table(dict(DATA, rows=[row])))[0].split("|")[1:-1]][1] == cell


def test_the_front_end_is_read_from_the_models_export_view(tmp_path):
    (tmp_path / "jax_policy_model").mkdir()
    (tmp_path / "jax_policy_model" / "export_view.json").write_text(json.dumps({"framework": "stablehlo"}))
    assert im.front_end_of(tmp_path, "jax_policy") == "stablehlo"
    assert im.front_end_of(tmp_path, "not_built") is None


# -- real sizes: a second table whose latency and import→vmfb come from `dsa scale` ----------------------------
def _scale_subject(key, shas, runtime, eager=None):
    return {"key": key, "date": "2026-12-04 17:00", "import_s": 231.0,
            "stages": [{"stage": "stand-in", "wall_s": 72.0, "peak_rss_kib": 4_100_000},
                       {"stage": "export", "wall_s": 44.0, "peak_rss_kib": 1_500_000},
                       {"stage": "params", "wall_s": 29.0, "peak_rss_kib": 1_100_000}],
            "modules": {target: [{"vmfb": f"{target}/batch_0.vmfb", "sha256": sha}] for target, sha in shas.items()},
            "runtime": runtime, "eager": eager or {}}


SCALE = {"format": 1, "subjects": [
    _scale_subject("pi0_full", {"x86_64-v3": "c3" * 32, "x86_64-v4": "c4" * 32},
                   {"x86_64-v3": {"median_ms": 41_000.0, "runs": 3, "first_call_ms": 50_000.0,
                                  "vmhwm_kib": 6_000_000, "inputs": "batch=1, steps=10"},
                    "x86_64-v4": {"not_run": "it needs the CPU features avx512f, which this CPU lacks"}},
                   {"median_ms": 32_000.0}),
]}


def test_scale_results_are_keyed_by_the_vmfb_sha256_with_the_import_and_the_eager_ratio(tmp_path):
    path = tmp_path / "real-size.json"
    path.write_text(json.dumps(SCALE))
    found = im.read_scale_results(path)
    assert set(found) == {"c3" * 32, "c4" * 32}
    v3 = found["c3" * 32]
    assert (v3["latency_ms"], v3["vs_eager"], v3["target"], v3["date"]) == (41_000.0, 1.281, "x86_64-v3", "2026-12-04")
    # The import is dsa compile's: its largest stage, never the stand-in made before it.
    assert (v3["import_s"], v3["import_peak_rss_kib"], v3["import_peak_stage"]) == (231.0, 1_500_000, "export")
    assert "latency_ms" not in found["c4" * 32] and "avx512f" in found["c4" * 32]["not_run"]
    assert im.read_scale_results(tmp_path / "absent.json") == {}


def test_real_size_rows_take_latency_and_import_from_scale_never_their_own(tmp_path):
    import hashlib

    vmfb = tmp_path / "batch_0.vmfb"
    vmfb.write_bytes(b"real-size module")
    sha = hashlib.sha256(b"real-size module").hexdigest()
    subjects = [_scale_subject("pi0_full", {"x86_64-v3": sha}, {"x86_64-v3": dict(
        SCALE["subjects"][0]["runtime"]["x86_64-v3"])}, {"median_ms": 32_000.0})]
    path = tmp_path / "real-size.json"
    path.write_text(json.dumps({"format": 1, "subjects": subjects}))
    scale = im.read_scale_results(path)
    unit = im.Unit("pi0_full", {}, tmp_path, [{"vmfb": vmfb}])
    row = _row("pi0_full", front_end="lerobot", params=3_240_000_000,
               measured={"module": "batch_0", "compile_s": 47.0, "peak_rss_kib": 300_000, "identical": True})
    im.attach_scale(row, unit, scale)
    assert row["real_size"] and row["scale"]["key"] == "pi0_full"
    unmatched = _row("pi05_full", front_end="lerobot", measured={"module": "batch_0", "compile_s": 46.0,
                                                                 "peak_rss_kib": 290_000, "identical": True})
    im.attach_scale(unmatched, unit, {})
    assert unmatched["real_size"] and unmatched["scale"] is None
    data = dict(DATA, real_size={"bin": "bazel-bin", "results": "docs/real-size.json", "rows": [row, unmatched]})
    table = im.render_table(data)
    # The first table is unchanged; the second has the same columns.
    assert table.startswith(im.render_table(DATA).split("\n\nGenerated")[0])
    second = table[table.index("**Real sizes**"):]
    assert second.count(im.render_table(DATA).splitlines()[0]) == 1
    pi0, pi05 = [[c.strip() for c in r.split("|")[1:-1]] for r in _table_rows(second)]
    assert pi0[0] == "`pi0_full`" and pi0[8] == "3.24 B"
    assert pi0[9:13] == ["47.0 s", "293 MiB", "231 s, 1.4 GiB (export)", "41.0 s (1.28× eager)"]
    assert pi0[13] == "batch_0 (real-size.json 2026-12-04: batch=1, steps=10)"
    assert pi05[11:13] == [im.NOT_MEASURED, im.NOT_MEASURED]
    assert "docs/real-size.json" in second
    assert im.render_table(data) == table


def test_a_target_scale_did_not_run_says_why():
    assert im.fmt_scale({"not_run": "it needs avx512f"}) == "not run (it needs avx512f)"
    assert im.fmt_scale({"latency_ms": 35_000.0}) == "35.0 s"
    assert im.fmt_scale({"latency_ms": 420.0, "vs_eager": 0.5}) == "420.0 ms (0.50× eager)"
    assert im.fmt_scale({}) == im.NOT_MEASURED


def test_real_size_rows_come_from_their_own_index(tmp_path):
    (tmp_path / "models").mkdir()
    index = {"format": 1, "policies": [{"name": "pi0_full", "test": "//models/pi0_full:pi0_full_test"},
                                       {"name": "pi0_full_x86_64-v4", "test": "//models/pi0_full:pi0_full_test"}],
             "pipelines": []}
    (tmp_path / "models" / "policies_real_size_index.json").write_text(json.dumps(index))
    rows = im.read_models(tmp_path, im.POLICIES_REAL_SIZE_INDEX)
    assert [m.name for m in rows] == ["pi0_full", "pi0_full_x86_64-v4"]
    with pytest.raises(DsaError, match="//models:policies_real_size_index"):
        im.read_models(tmp_path / "none", im.POLICIES_REAL_SIZE_INDEX)


def test_the_real_size_outputs_are_read_beside_the_runfiles_not_in_them(tmp_path):
    bin_dir = tmp_path / "out" / "bin"
    runfiles = bin_dir / "tools" / "import_matrix.runfiles" / "_main"
    runfiles.mkdir(parents=True)
    assert im.real_size_bin(runfiles) == bin_dir
    assert im.real_size_bin(bin_dir) == bin_dir
    (runfiles / "models").mkdir()
    (runfiles / im.POLICIES_REAL_SIZE_INDEX).write_text("{}")
    assert im.real_size_bin(runfiles) == runfiles


def test_a_build_for_a_further_target_takes_its_policys_front_end(tmp_path):
    (tmp_path / "pi0_full_model").mkdir()
    (tmp_path / "pi0_full_model" / "export_view.json").write_text(json.dumps({"framework": "lerobot"}))
    record = tmp_path / "pi0_full_buckets" / "batch_0.export_record.json"
    unit = im.Unit("pi0_full_x86_64-v4", None, tmp_path, [{"vmfb": tmp_path / "x.vmfb", "record": record}])
    row = im.collect_files(im.ModelSpec("pi0_full_x86_64-v4", ""), unit, {"status": im.NOT_RUN})
    assert row["front_end"] == "lerobot"


def test_real_size_only_collects_the_real_size_table_and_keeps_the_committed_main_table(tmp_path):
    """`--real-size-only`: the main table's rows and provenance are the committed import-matrix.json's, byte for
    byte in the data; the real-size rows are collected from their own bin directory (here: indexed, not built)."""
    out = tmp_path / "docs"
    out.mkdir()
    committed = {"format": im.DATA_FORMAT, "date": "2026-11-30", "command": "./bazelw run //tools:import_matrix",
                 "measure": True, "runs": 10, "target": "x86_64-v3",
                 "machine": {"cpu": "some CPU", "cores": 2, "threads": 2, "system": "Linux", "loadavg": "0"},
                 "toolchain": {}, "rows": [_row("act")]}
    (out / "import-matrix.json").write_text(json.dumps(committed))
    real = tmp_path / "real-bin"
    (real / "models").mkdir(parents=True)
    (real / im.POLICIES_REAL_SIZE_INDEX).write_text(json.dumps(
        {"format": 1, "pipelines": [], "policies": [{"name": "pi0_full", "test": "//models/pi0_full:pi0_full_test"}]}))
    im.main(["--real-size-only", "--real-size-bin", str(real), "--bin", str(tmp_path / "none"),
             "--testlogs", str(tmp_path / "testlogs"), "--out-dir", str(out), "--readme", "", "--no-measure",
             "--real-size-results", str(tmp_path / "no-scale.json"), "--bench-results", ""])
    data = json.loads((out / "import-matrix.json").read_text())
    assert {k: v for k, v in data.items() if k != "real_size"} == json.loads(json.dumps(committed))
    [row] = data["real_size"]["rows"]
    assert row["module"] == "pi0_full" and not row["built"] and row["parity"]["status"] == "not run"
    assert data["real_size"]["command"] and data["real_size"]["machine"]["cpu"]
    document = (out / "import-matrix.md").read_text()
    assert "**Real sizes**" in document and "pi0_full" in document and "Collected " in document
