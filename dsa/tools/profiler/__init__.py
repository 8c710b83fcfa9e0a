"""dsa-profile: profile a model's compiled dispatches and name the torch ops and model modules behind each.

    dsa profile --manifest manifests/pi0.yaml --checkpoint pi0.safetensors \
        --target toolchains/targets/x86_64-v3.json --bucket prompt_len=32 [--top 15] [--json OUT] \
        [-- --iree-opt-level=O3 ...]

Traces the model as the export stage does (`dsa.stages.export.trace_model`), tags every FX node with a source
location naming its module path and aten op (`"dsa-fx|expert.layers.2.attn|aten.linear":SERIAL`, set as the
node's stack trace, which iree-turbine's importer turns into MLIR `loc(...)`), and compiles the module with
the build's flags in two steps: `--compile-to=executable-sources --mlir-print-debuginfo`, whose output holds
every dispatch executable with the locations of the ops fused into it and every host-side
`stream.cmd.dispatch` with the location of the op its dispatch region was formed around; then
`--compile-from=executable-sources` to the .vmfb that is profiled. Locations change neither the dispatch
names nor, with the build's source-map stripping, a single byte of the .vmfb. The module then runs `runs`
times under `iree-benchmark-module --device_profiling_mode=...`, and `iree-profile dispatch` gives each
dispatch function's count and time.

A dispatch's source ops and module paths are those of its root op at every call site (a deduplicated
executable serves several layers: each call site names its own), then those of the other ops fused into
its body. Nodes inside a higher-order op's subgraph (the body of a `while_loop`) carry no module stack in
torch.export: their path is taken from the parameters they read, or else the common prefix of the paths of
their nearest producers and consumers, and is shown with a leading `~`.

The package, by job (the names above are re-exported here, so `dsa.tools.profiler.X` is the API):

    sources.py    FX nodes tagged with source locations; dispatches mapped back to their ops and modules
    runner.py     IREE's runtime tools, the profiled run, inputs, the parameter archive and the compile flags
    model.py      `profile_model`: trace, tag, compile in two steps, profile, join dispatches to sources
    cli.py        the command line and the text output (`python -m dsa.tools.profiler`, `bin/dsa profile`)
"""

from dsa.tools.profiler.sources import (  # noqa: F401
    LOC_PREFIX, INFERRED_MARK, ROOT_PATH, SourceNode, annotate_locations, DispatchSource, map_dispatches)
from dsa.tools.profiler.runner import (  # noqa: F401
    runtime_tool_path, profiling_mode_of, run_profiler, parse_bucket, input_values, benchmark_input_flags,
    parameter_record, check_archive, profile_compile_view, check_extra_flags)
from dsa.tools.profiler.model import (  # noqa: F401
    RESULT_FORMAT, DEFAULT_RUNS, profile_model)
from dsa.tools.profiler.cli import (  # noqa: F401
    format_profile, main)
