"""dsa_pipeline: compiled models (dsa_vmfb) linked into one pipeline by the tensors they exchange."""

load(":common.bzl", "ACTION_ENV", "TOOLCHAINS", "execution_requirements", "toolchain_identity")
load(":providers.bzl", "DsaModuleInfo", "DsaPipelineInfo")

def _dsa_pipeline_impl(ctx):
    name = ctx.label.name
    stages = [s[DsaModuleInfo] for s in ctx.attr.stages]
    stage_names = [s.label.name for s in ctx.attr.stages]
    link = ctx.actions.declare_file(name + ".link.json")
    index = ctx.actions.declare_file(name + ".pipeline.json")

    args = ctx.actions.args()
    args.add("link")
    for stage_name, stage in zip(stage_names, stages):
        args.add("--stage", "%s=%s" % (stage_name, stage.index.path))
    args.add_all(["%s=%s" % (c, p) for c, p in ctx.attr.edges.items()], before_each = "--edge")
    args.add("--out", link)
    args.add("--pipeline-out", index)
    ctx.actions.run(
        executable = ctx.executable._link_tool,
        arguments = [args],
        inputs = depset(
            [toolchain_identity(ctx)] + [s.index for s in stages],
            transitive = [depset(s.records) for s in stages],
        ),
        outputs = [link, index],
        mnemonic = "DsaLink",
        progress_message = "Linking %s: checking the edges between %s" % (ctx.label, ", ".join(stage_names)),
        env = ACTION_ENV,
        execution_requirements = execution_requirements(ctx),
    )

    # The pipeline index (the link and each stage's module index) is written by the same action, through
    # dsa.core.formats.PipelineIndex, its one writer.

    # Each stage's files (modules, records, reports, index, lock, parameters, runtime view, target spec).
    stage_files = [s[DefaultInfo].files for s in ctx.attr.stages]
    runfiles = ctx.runfiles(files = [link, index])
    for s in ctx.attr.stages:
        runfiles = runfiles.merge(s[DefaultInfo].default_runfiles)
    return [
        DefaultInfo(files = depset([link, index], transitive = stage_files), runfiles = runfiles),
        DsaPipelineInfo(stage_names = stage_names, stages = stages, link = link, index = index),
        OutputGroupInfo(index = depset([index])),
    ]

dsa_pipeline = rule(
    implementation = _dsa_pipeline_impl,
    toolchains = TOOLCHAINS,
    doc = """Links compiled models into a pipeline: `stages` run in order, `edges` feed outputs of earlier
stages to inputs of later ones.

`edges` maps each fed input to the output that feeds it: `{"<consumer stage>.<input>": "<producer stage>.<output>"}`,
a stage named by its dsa_vmfb's name. The DsaLink action (dsa/stages/link.py) reads every stage's export records and
fails the build, naming the edge and both records' shape and dtype, when an edge's two ends differ; it writes
`<name>.link.json` (each edge's name, shape, dtype, producer, consumer). `<name>.pipeline.json` is the index
`dsa.runtime.pipeline_runtime.CompiledPipeline` loads; `dsa_bundle(pipeline = ...)` packs the whole
pipeline.""",
    attrs = {
        "stages": attr.label_list(mandatory = True, providers = [DsaModuleInfo], doc = "dsa_vmfb targets, in run order."),
        "edges": attr.string_dict(mandatory = True, doc = "CONSUMER_STAGE.INPUT → PRODUCER_STAGE.OUTPUT."),
        "_link_tool": attr.label(default = Label("//dsa:link_tool"), executable = True, cfg = "exec"),
    },
    provides = [DsaPipelineInfo],
)
