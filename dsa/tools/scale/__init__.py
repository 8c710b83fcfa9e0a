"""dsa scale: measured scale of real-size models — sizes, each stage's wall time and peak RSS, the runtime's and
eager's latency and peak memory at batch 1 — generated into docs/real-size.{json,md,png}, never typed.

    bin/dsa scale manifests/pi0_full.yaml manifests/pi05_full.yaml      # real-size subjects, by manifest
    bin/dsa scale --sweep pi0                                           # PI0 at three sizes, and the plot
    bin/dsa scale --real-size-index                                     # every manifest of //models:policies_real_size_index
    bin/dsa scale --render                                              # the docs again from docs/real-size.json
    bazel run //tools:scale -- [the same flags]

For each subject (a manifest):

  weights     a seeded stand-in made here, in a scratch directory, by the generator the Bazel rules use
              (framework lerobot: `python -m dsa.frontends.lerobot.cli init` on models/<model_id>/policy.json,
              `--weights seeded` in bf16 when the manifest stores bf16 weights; others: `python -m
              dsa.stages.checkpoint` on the manifest's export view, in bf16 and with the manifest's shards when it
              lists shards or stores bf16 weights) — itself a measured stage — or given (`--weights ID=PATH`: a
              LeRobot policy directory, a .safetensors file or a sharded checkpoint's index). When the
              manifest's sha256 pins are not those of the weights (a placeholder, another seed), the subject is
              built from a copy of the manifest pinned to them, and the data says so.
  build       `dsa compile --no-cache` for every target the manifest lists, in the subject's own Python
              environment (framework lerobot: the LeRobot environment), each stage a process of its own: every
              stage's wall time and peak RSS from its timings.json (wait4's ru_maxrss of the stage's process).
  sizes       parameter count (the export record: parameters the graph reads; and the checkpoint's), checkpoint
              bytes (every shard), .irpa bytes, vmfb bytes and sha256 per target.
  runtime     for each target this machine runs (dsa.runtime.host.runs_here): the module index in a process of
              its own (dsa.runtime.policy.CompiledPolicy, no torch) at batch 1 on the import matrix's sample
              inputs (dynamic dims at their smallest, the manifest's flow_steps): the load, the first call
              (module load and first-touch of the weights), the median of --runs further calls, and the process's
              peak resident memory, VmHWM from its own /proc/self/status at its end (not the parent's rusage: on
              Linux a child's ru_maxrss starts at its parent's RSS at fork).
  eager       the same inputs through the framework's own eager model in the subject's environment, in another
              process (LeRobot: its policy class, loaded by dsa.frontends.lerobot.load_pretrained_mapped; pytorch:
              dsa.tools.testing.eager_policy; a weight-quantised model: dsa.tools.testing.quantised_eager_policy,
              the same quantised weights dequantised one layer at a time, since its float32 weights need not fit):
              the same timings and VmHWM, and the runtime's largest deviation from it. Skipped, saying why, when
              those weights cannot fit this machine's memory.

A family sweep (`--sweep pi0`) measures the family at three sizes with the real size's recipe (the same
manifest fields — precision, buckets, targets, tuning — and stand-in generator; only the policy config and the
inputs it implies differ) and, at the small and medium sizes, the design before weightless building: the export
with the model's weights materialised (`export_model(..., weightless=False)`) and LeRobot's own random
initialisation as the stand-in. The real size is the subject of the same name (one measurement serves both).

Every measured step (stand-in, dsa compile, each runtime, eager, each old-design step) runs under an exclusive
lock on --lock (default /tmp/dsa-heavy.lock, fcntl.flock), so concurrent heavy jobs on a shared machine do not
distort the numbers; `--no-lock` turns it off. docs/real-size.json keeps every subject measured (a new
measurement of a subject replaces its entry); after each subject the docs, the plot and bench/RESULTS.md's
"Real sizes" section (between `<!-- real-size:begin -->` and `<!-- real-size:end -->`) are rendered again.

The package, by job (the names above are re-exported here, so `dsa.tools.scale.X` is the API):

    memory.py     the heavy lock and peak-memory readings (VmHWM, the machine's memory)
    subjects.py   subjects (a manifest, its weights), family sweeps, stand-in weights, the manifest pinned to them
    children.py   the measured child processes (a stage, the runtime, eager, the parameter count, the old export)
    measure.py    one subject measured end to end, and its entry merged into the data
    report.py     docs/real-size.{md,png} and bench/RESULTS.md's "Real sizes" section
    cli.py        the command line (`python -m dsa.tools.scale`, `bin/dsa scale`)
"""

from dsa.tools.scale.memory import (  # noqa: F401
    DEFAULT_LOCK, heavy_lock, read_vmhwm_kib, own_vmhwm_kib, memory_total_bytes)
from dsa.tools.scale.subjects import (  # noqa: F401
    LEROBOT_CONFIG, RECIPE_FIELDS, SWEEPS, Subject, read_manifest_data, relative_to, manifest_subject,
    sweep_subjects, real_size_manifests, lerobot_python_candidates, subject_python, requirements_lock_for,
    stand_in_recipe, stand_in_command, checkpoint_files, resolve_weights, repin, pin_manifest, write_manifest,
    estimate_scratch_bytes, checkpoint_elements)
from dsa.tools.scale.children import (  # noqa: F401
    child_env, failure_cause, run_stage, run_child, eager_weight_bytes, runtime_child, eager_child, count_child,
    old_export_child)
from dsa.tools.scale.measure import (  # noqa: F401
    DATA_FORMAT, EAGER_MEMORY_MARGIN_BYTES, Settings, measure_subject, without_work, measure_old_design, machine,
    toolchain, merge)
from dsa.tools.scale.report import (  # noqa: F401
    BEGIN_MARKER, END_MARKER, MISSING, fmt_rss, fmt_seconds, fmt_ms, stage_kinds, render_build_table,
    render_runtime_table, SWEEP_STAGES, sweep_series, render_sweep_table, render_plot, memory_of, real_and_points,
    render_document, render_results_section, replace_marked, write_outputs)
from dsa.tools.scale.cli import (  # noqa: F401
    DEFAULT_RUNS, DEFAULT_MAX_SCRATCH_GB, workspace_root, main)
