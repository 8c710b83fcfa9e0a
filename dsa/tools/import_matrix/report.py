"""The matrix rendered (pure functions of the collected data): docs/import-matrix.md and README's marked section."""

from __future__ import annotations

import re
from typing import List, Optional, Sequence

from dsa.core.errors import DsaError
from dsa.tools.import_matrix.measure import REAL_SIZE_RESULTS
from dsa.tools.import_matrix.models import FRONT_ENDS, NOT_RUN


BEGIN_MARKER = "<!-- import-matrix:begin -->"
END_MARKER = "<!-- import-matrix:end -->"
MISSING = "–"
NOT_MEASURED = "not measured"


# -- rendering (pure functions of the collected data) -------------------------------------------------------
def fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return MISSING
    if n < 1000:
        return f"{n} B"
    if n < 1000 ** 2:
        return f"{n / 1000:.1f} kB"
    if n < 1000 ** 3:
        return f"{n / 1000 ** 2:.{2 if n < 10 * 1000 ** 2 else 1}f} MB"
    return f"{n / 1000 ** 3:.2f} GB"


def fmt_count(n: Optional[int]) -> str:
    if n is None:
        return MISSING
    if n >= 10 ** 9:
        return f"{n / 1e9:.2f} B"
    if n >= 10 ** 6:
        return f"{n / 1e6:.2f} M"
    if n >= 10 ** 3:
        return f"{n / 1e3:.1f} k"
    return str(n)


def fmt_ms(ms: float) -> str:
    return f"{ms:.0f} ms" if ms >= 1000 else f"{ms:.1f} ms" if ms >= 100 else f"{ms:.2f} ms" if ms >= 1 \
        else f"{ms:.3f} ms"


def fmt_import(measured: dict) -> str:
    """`dsa compile`'s wall time and its largest stage peak RSS: "112 s, 4.9 GiB (export)"."""
    if "import_s" not in measured:
        return NOT_MEASURED
    peak = measured["import_peak_rss_kib"] / 1024
    peak_text = f"{peak / 1024:.1f} GiB" if peak >= 1024 else f"{peak:.0f} MiB"
    return f"{measured['import_s']:.0f} s, {peak_text} ({measured['import_peak_stage']})"


def fmt_bench(bench: dict) -> str:
    """The benchmark's median vmfb call and its ratio to eager (and to ONNX Runtime where it ran)."""
    ratios = f"{bench['vs_eager']:.2f}× eager"
    if "vs_onnxruntime" in bench:
        ratios += f", {bench['vs_onnxruntime']:.2f}× ORT"
    return f"{fmt_ms(bench['vmfb_ms'])} ({ratios})"


def fmt_scale(scale: dict) -> str:
    """`dsa scale`'s median runtime call and its ratio to eager, or why it did not run."""
    if "latency_ms" not in scale:
        return f"not run ({scale['not_run']})" if scale.get("not_run") else NOT_MEASURED
    ms = scale["latency_ms"]
    text = f"{ms / 1000:.1f} s" if ms >= 10_000 else fmt_ms(ms)  # real sizes: seconds a call
    return text + (f" ({scale['vs_eager']:.2f}× eager)" if scale.get("vs_eager") else "")


def _check(ok: bool) -> str:
    return "✓" if ok else "✗"


def fmt_parity(test: dict) -> str:
    if test["status"] == NOT_RUN:
        return NOT_RUN
    if test["status"] == "passed":
        return f"✓ {test['tests']} passed"
    return f"✗ {test['failures']} of {test['tests']} failed"


def row_cells(row: dict) -> List[str]:
    measured = row.get("measured") or {}
    model = row["model"]
    if row.get("pipeline") is not None:  # a stage of a split policy: groot › backbone
        stage = row["module"]
        model += " › " + (stage[len(model) + 1:] if stage.startswith(model + "_") else stage)
    compile_cell = _check(row["compile"])
    if row["compile"] and measured.get("identical") is False:
        compile_cell = "✗ re-run differs"
    if row["compile"] and row["modules"] > 1:
        compile_cell += f" ({row['modules']} modules)"
    bench = row.get("bench")
    if not row["compile"]:
        timing = [MISSING] * 4
    elif measured:
        timing = [f"{measured['compile_s']:.1f} s" if "compile_s" in measured else "failed",
                  f"{measured['peak_rss_kib'] / 1024:.0f} MiB" if "peak_rss_kib" in measured else "failed",
                  fmt_import(measured),
                  fmt_ms(measured["latency_ms"]) if "latency_ms" in measured else "failed"]
    else:
        timing = [NOT_MEASURED] * 4
    if row["compile"] and bench:
        timing[3] = fmt_bench(bench)
    scale = row.get("scale")
    if row["compile"] and row.get("real_size"):
        # Real sizes: latency and import→vmfb from `dsa scale` (docs/real-size.json), never measured here.
        timing[2] = fmt_import(scale) if scale else NOT_MEASURED
        timing[3] = fmt_scale(scale) if scale else NOT_MEASURED
    measured_on = MISSING
    if measured:
        measured_on = measured["module"] + (f" ({measured['inputs']})" if measured.get("inputs") else "")
    if bench:
        module = (row.get("measured") or {}).get("module") or "smallest bucket"
        measured_on = f"{module} (bench {bench['date']}: {bench['case']})"
    if scale and "latency_ms" in scale:
        module = (row.get("measured") or {}).get("module") or "smallest bucket"
        measured_on = f"{module} ({scale['source']} {scale['date']}: {scale.get('inputs') or 'static shapes'})"
    framework = row.get("front_end")
    front_end = FRONT_ENDS.get(framework, framework) if framework else MISSING
    return [f"`{model}`", front_end, _check(row["export"]), compile_cell, fmt_parity(row["parity"]),
            fmt_bytes(row["vmfb_bytes"]), fmt_bytes(row["irpa_bytes"]), fmt_bytes(row["mlir_bytes"]),
            fmt_count(row["parameter_count"]), *timing, measured_on]


HEADER = ["model", "front end", "export", "compile", "parity", "vmfb", "irpa", "MLIR", "params", "compile time", "peak RSS",
          "import→vmfb (peak RSS)", "latency (median)", "measured on"]
_RIGHT = {"vmfb", "irpa", "MLIR", "params", "compile time", "peak RSS", "import→vmfb (peak RSS)",
          "latency (median)"}


def _table(rows: Sequence[dict]) -> List[str]:
    lines = ["| " + " | ".join(HEADER) + " |",
             "|" + "|".join("---:" if h in _RIGHT else "---" for h in HEADER) + "|"]
    return lines + ["| " + " | ".join(row_cells(row)) + " |" for row in rows]


def render_real_size(data: dict) -> List[str]:
    """The second table, "Real sizes" (the real-size policies), when the data has it."""
    real = data.get("real_size")
    if not real:
        return []
    lines = ["", "**Real sizes** (the real-size policies, `--real-size`):", ""] + _table(real["rows"])
    made = (f" Collected {real['date']} by `{real['command']}` on {real['machine']['cpu']} "
            f"({real['machine']['threads']} threads).") if real.get("command") and real.get("machine") else ""
    lines += ["", f"Real sizes: built by hand in {real.get('bin') or 'the bin directory'}; compile time and peak RSS "
                  "measured here as above; import→vmfb and latency from `dsa scale` "
                  f"({real.get('results') or REAL_SIZE_RESULTS}, docs/real-size.md), matched by the vmfb's "
                  "sha256: its `dsa compile --no-cache` of the same manifest and stand-in, and its median runtime "
                  "call at batch 1 with the ratio to eager in the subject's environment." + made]
    notes = [(row, note) for row in real["rows"] for note in row["notes"]]
    if notes:
        lines.append("")
        lines += [f"* `{row['module']}`: {note}" for row, note in notes]
    return lines


def render_table(data: dict) -> str:
    """The matrix as a Markdown table (with a one-line caption naming the machine and the notes), and the
    real-size policies' table after it when the data has them."""
    lines = _table(data["rows"])
    machine = data["machine"]
    caption = (f"Generated {data['date']} by `{data['command']}` on {machine['cpu']} "
               f"({machine['threads']} threads, target {data['target'] or MISSING}); ")
    if data["measure"]:
        caption += ("latency: the benchmark's median call where it timed this very module (bench/results.json, "
                    "matched by sha256; with its ratio to eager in the same alternating rounds), else the median of "
                    f"{data['runs']} `iree-benchmark-module` calls of the measured module; "
                    "compile time and peak RSS: `iree-compile` re-run on its MLIR with its build flags; "
                    "import→vmfb: `dsa compile` of the model from its manifest and checkpoint, with the largest "
                    "peak RSS of its stages and the stage.")
    else:
        caption += ("rendered from build and test outputs only (`--no-measure`); latency where the benchmark "
                    "timed the module (bench/results.json).")
    lines += ["", caption]
    notes = [(row, note) for row in data["rows"] for note in row["notes"]]
    mismatched = [row for row in all_rows(data) if (row.get("measured") or {}).get("identical") is False]
    for row in mismatched:
        notes.append((row, "**the re-compiled vmfb is not byte-identical to the built one** "
                           f"(built {row['measured']['built_sha256']}, re-run {row['measured']['vmfb_sha256']})"))
    if notes:
        lines.append("")
        lines += [f"* `{row['module']}`: {note}" for row, note in notes]
    lines += render_real_size(data)
    return "\n".join(lines) + "\n"


def all_rows(data: dict) -> List[dict]:
    return list(data["rows"]) + list((data.get("real_size") or {}).get("rows", []))


def render_document(data: dict) -> str:
    """docs/import-matrix.md: the table, then how it was generated."""
    machine = data["machine"]
    return "\n".join([
        "# Import matrix",
        "",
        "<!-- Generated by dsa/tools/import_matrix/ (`bazel run //tools:import_matrix`): do not edit by hand. -->",
        "",
        "Every model in `models/BUILD.bazel` through the pipeline: its front end (torch.export → iree-turbine, "
        "or an ONNX or StableHLO import) → iree-compile → IREE runtime.",
        "",
        render_table(data),
        "## Columns",
        "",
        "* **front end**: how the model reached IREE, from its manifest's `framework` (docs/frontends.md): "
        "torch.export (pytorch), LeRobot's classes then torch.export (lerobot), IREE's ONNX importer (onnx), "
        "a jax.export StableHLO module (stablehlo).",
        "* **export**: the model's export records and MLIR are in the build outputs (dsa_model / dsa_bucket).",
        "* **compile**: every module the index lists has its vmfb and compile report (dsa_vmfb); "
        "\"re-run differs\" if the re-compiled vmfb is not byte-identical to the built one.",
        "* **parity**: the model's Bazel test (`bazel-testlogs/<pkg>/<test>/test.xml`): the compiled module "
        "against eager PyTorch (or LeRobot). \"not run\" when the test has no result in this output base.",
        "* **vmfb**, **MLIR**: summed over the model's modules (one per shape bucket); **irpa**: the parameter "
        "archive; **params**: the export record's parameter count. kB/MB/GB are powers of 1000.",
        "* **compile time**, **peak RSS**: `iree-compile` re-run on the measured module's MLIR with exactly the "
        "flags of its compile report, as a child process; peak RSS is its `wait4` rusage `ru_maxrss` (MiB; it "
        "includes the ~7 MB that the small launcher process forking it had resident). Wall time on a machine "
        "that may be shared: a rough figure, not a benchmark.",
        "* **import→vmfb (peak RSS)**: `dsa compile` of the model from the same manifest, checkpoint (and LeRobot "
        "policy config) as its build, in its own Python environment, into a scratch directory: the whole run's "
        "wall time (export, parameter archive, bucket exports, compiles for every target the manifest lists), "
        "and the largest peak RSS among its stages, each a process of its own (`timings.json`), with that "
        "stage. Not measured with `--no-import`.",
        "* **latency (median)**: where the benchmark (`./bazelw run //bench`, bench/RESULTS.md) timed this very "
        "module — matched by the vmfb's sha256 in bench/results.json — its median call, with the ratio to eager "
        "PyTorch / LeRobot (and ONNX Runtime) from the same alternating rounds; **measured on** then names the "
        "bench run's date and case. Otherwise `iree-benchmark-module` on the built vmfb and parameter archive: "
        "one untimed call, then the median of single-call repetitions; inputs from "
        "`dsa.runtime.policy.sample_inputs` (seed 0) with the sizes in **measured on** (dynamic dims at their "
        "smallest size, bucketed inputs at the module's bucket, the step-count input at the manifest's "
        "`flow_steps`).",
        "* **measured on**: the module measured (a bucketed model: its smallest bucket) and its input sizes.",
        "* **Real sizes** (`--real-size`): the real-size policies (tagged `real_size`, built by hand), with the same "
        "columns; their **import→vmfb** and **latency** are `dsa scale`'s (docs/real-size.json, docs/real-size.md: "
        "`dsa compile --no-cache` from the same manifest and stand-in, and the module at batch 1 against eager in "
        "the subject's environment), matched by the vmfb's sha256, never measured by this tool (minutes a call).",
        "",
        "## How it was generated",
        "",
        "```sh",
        "./bazelw test //models/...            # the parity cells",
        data["command"],
        "```",
        "",
        f"* date: {data['date']}",
        f"* machine: {machine['cpu']}; {machine['cores']} cores available, {machine['threads']} benchmark "
        f"threads; {machine['system']}; load average {machine['loadavg']} at the start",
        f"* target: {data['target'] or MISSING}; iree-base-compiler {data['toolchain'].get('iree-base-compiler', MISSING)}, "
        f"iree-base-runtime {data['toolchain'].get('iree-base-runtime', MISSING)}",
        f"* latency repetitions: {data['runs']}" if data["measure"] else "* not measured (`--no-measure`)",
        "",
    ])


def replace_marked(text: str, table: str) -> str:
    """`text` with everything between the import-matrix markers replaced by `table`; with no markers, an
    "Import matrix" section is added before README's "## Read next" (else at the end)."""
    block = f"{BEGIN_MARKER}\n{table.rstrip()}\n{END_MARKER}"
    begin, end = text.find(BEGIN_MARKER), text.find(END_MARKER)
    if begin >= 0 and end > begin:
        return text[:begin] + block + text[end + len(END_MARKER):]
    if begin >= 0 or end >= 0:
        raise DsaError("README.md", "has only one of the import-matrix markers",
                       f"put both {BEGIN_MARKER} and {END_MARKER} on lines of their own, or neither")
    section = ("## Import matrix\n\n"
               "Every model through export, compile, parity and the runtime, generated (never typed) by\n"
               "`./bazelw run //tools:import_matrix` after `./bazelw test //models/...`; columns, method and\n"
               "machine: [docs/import-matrix.md](docs/import-matrix.md).\n\n" + block + "\n\n")
    anchor = re.search(r"^## Read next", text, re.M)
    if anchor:
        return text[:anchor.start()] + section + text[anchor.start():]
    return text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
