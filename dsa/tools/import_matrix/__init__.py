"""dsa-import-matrix: every model × (export, compile, parity, sizes, compile time, peak RSS, latency), generated.

    ./bazelw test //models/...                    # first: the parity cells are the models' own test results
    ./bazelw run //tools:import_matrix [-- --models act,pi0] [--no-measure] [--out-dir DIR] [--runs 10]
    ./bazelw run //tools:import_matrix -- --real-size   # also the real-size policies, as a second table
    bin/dsa import-matrix --real-size-only --real-size-bin DIR   # that table alone; the main one as committed

Writes docs/import-matrix.md (the table, how it was made, machine, CPU, date, command), docs/import-matrix.json
(the collected data the table is rendered from) and the same table into README.md between the lines
`<!-- import-matrix:begin -->` and `<!-- import-matrix:end -->`. Nothing in the table is typed by hand:

  export / compile   the module index's export records (and MLIR) / vmfbs are present in the build outputs
  parity             the model's Bazel test (bazel-testlogs/<pkg>/<test>/test.xml): passed, failed or not run
  vmfb, MLIR         summed over the model's modules (one per shape bucket); irpa: the parameter archive
  params             parameter_count of the export record
  compile, peak RSS  measured here: `iree-compile` re-run on one module's built MLIR with exactly the flags of
                     its compile report, in a child process whose peak RSS is its wait4 rusage (ru_maxrss);
                     the re-run's vmfb must be byte-identical to the built one (a mismatch is reported loudly
                     and makes the command fail after writing)
  import→vmfb        measured here: `dsa compile` of the model (its manifest, checkpoint and, for LeRobot, policy
                     config from the build, in the model's own Python environment) into a scratch directory: the
                     whole run's wall time and the largest peak RSS of its stages (each a process of its own;
                     the stage named), from its timings.json (--no-import skips it)
  latency            from the benchmark's own runs where it timed this very module (bench/results.json, matched by
                     the vmfb's sha256: the median vmfb call there, and its ratio to eager PyTorch / LeRobot);
                     otherwise measured here: `iree-benchmark-module` on the module's built vmfb and the
                     parameter archive, with deterministic sample inputs from its export record (dsa.runtime.
                     policy.sample_inputs; dynamic dims at their smallest size, bucketed dims at the module's
                     bucket, the step-count input at the manifest's flow_steps); median of --runs single-call
                     repetitions after one warm-up call

The measured module is the smallest bucket of a bucketed model (the module the runtime picks for the shortest
input). A split policy (dsa_pipeline, e.g. //models:groot) gets one row per stage. `--no-measure` renders from
the build and test outputs alone (the measured cells then read "not measured").

Real sizes (`--real-size`): the policies of //models:policies_real_size_index (tagged real_size, built by hand:
`bazel build //models:policies_real_size_index //models:pi0_full ...`), read from the bin directory they were
built in, get a second table "Real sizes" with the same columns. Their compile re-run is measured here; their
latency and import→vmfb are not (minutes a call, tens of GB): they come from `dsa scale` (docs/real-size.json,
dsa/tools/scale/), matched by the vmfb's sha256 like the benchmark's: its median runtime call at batch 1 and
its ratio to eager, and its `dsa compile --no-cache` wall time and largest stage peak.

Outputs are read from the runfiles tree under `bazel run` (the models are this binary's data) or from --bin;
test results from the testlogs directory beside the bin directory (or --testlogs), so it works with any
--output_base and with --symlink_prefix=/.

The package, by job (the names above are re-exported here, so `dsa.tools.import_matrix.X` is the API):

    models.py     the models (the policies index the build writes), their build outputs and test results
    measure.py    a row measured: the iree-compile re-run, latency, the import, the benchmark's and dsa scale's numbers
    report.py     the matrix rendered: docs/import-matrix.md and README's marked section
    cli.py        the command line (`python -m dsa.tools.import_matrix`, `bin/dsa import-matrix`)
"""

from dsa.tools.import_matrix.models import (  # noqa: F401
    NOT_RUN, ModelSpec, POLICIES_INDEX, POLICIES_INDEX_FORMAT, POLICIES_REAL_SIZE_INDEX, read_import_sources,
    read_models, test_xml_dir, parse_test_result, module_units, Unit, read_unit, FRONT_ENDS, front_end_of,
    collect_files)
from dsa.tools.import_matrix.measure import (  # noqa: F401
    DATA_FORMAT, measure_compile, sample_sizes, sample_values, benchmark_command, parse_benchmark, measure_latency,
    read_bench_latencies, attach_bench, REAL_SIZE_RESULTS, read_scale_results, attach_scale, import_command,
    measure_import, measure_row, collect)
from dsa.tools.import_matrix.report import (  # noqa: F401
    BEGIN_MARKER, END_MARKER, MISSING, NOT_MEASURED, fmt_bytes, fmt_count, fmt_ms, fmt_import, fmt_bench, fmt_scale,
    fmt_parity, row_cells, HEADER, render_real_size, render_table, all_rows, render_document, replace_marked)
from dsa.tools.import_matrix.cli import (  # noqa: F401
    DEFAULT_RUNS, workspace_root, default_dirs, real_size_bin, select_models, main)
