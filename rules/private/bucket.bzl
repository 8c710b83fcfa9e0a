"""dsa_bucket: specialises a dynamic dim of an exported model into shape buckets."""

load(":common.bzl", "TOOLCHAINS", "TOOL_ATTRS", "execution_requirements", "manifest_view", "run_tool")
load(":providers.bzl", "DsaBucketInfo", "DsaModelInfo")

def _dsa_bucket_impl(ctx):
    model = ctx.attr.model[DsaModelInfo]
    dim = ctx.attr.dim
    mlirs = []
    records = []
    views = []
    for slot in range(ctx.attr.count):
        stem = "%s/%s_%d" % (ctx.label.name, dim, slot)
        view = ctx.actions.declare_file(stem + ".bucket_view.json")
        manifest_view(ctx, model.manifest, "bucket", view, bucket = "%s:%d" % (dim, slot))
        mlir = ctx.actions.declare_file(stem + ".mlir")
        record = ctx.actions.declare_file(stem + ".export_record.json")
        args = ctx.actions.args()
        args.add("--view", model.export_view)
        args.add("--bucket-view", view)
        args.add("--bucket-count", str(ctx.attr.count))
        args.add("--bucket-target", str(ctx.label))
        args.add("--reference-record", model.export_record)
        args.add("--manifest-name", model.manifest.short_path)
        args.add_all(model.pythonpath, before_each = "--pythonpath")
        args.add_all(model.own_sources, before_each = "--source")
        if model.policy_config:
            args.add("--policy-config", model.policy_config)
        if model.model_file:
            args.add("--model-file", model.model_file)
        args.add("--out-mlir", mlir)
        args.add("--out-record", record)
        run_tool(
            ctx,
            model.python_env,
            ctx.attr._export_tool,
            "dsa.stages.export",
            [args],
            depset(
                [model.export_view, view, model.export_record] + [f for f in [model.policy_config, model.model_file] if f],
                transitive = [model.model_sources],
            ),
            outputs = [mlir, record],
            mnemonic = "DsaExport",
            progress_message = "Exporting %s bucket %s[%d]" % (ctx.label, dim, slot),
            execution_requirements = execution_requirements(ctx),
        )
        mlirs.append(mlir)
        records.append(record)
        views.append(view)
    return [
        DefaultInfo(files = depset(mlirs + records), runfiles = ctx.runfiles(files = mlirs + records)),
        DsaBucketInfo(model = model, dim = dim, mlirs = mlirs, records = records, views = views),
    ]

dsa_bucket = rule(
    implementation = _dsa_bucket_impl,
    toolchains = TOOLCHAINS,
    doc = """One static export per bucket of the manifest's `buckets.<dim>` list (slot i = the i-th size).

Why one module per bucket rather than one module with an entry point per bucket: parameters live outside
the modules (in the model's .irpa), so separate modules share one copy of the weights all the same, and
each bucket is its own export and compile action: editing one bucket size reruns only that bucket's work.
`count` must equal the number of sizes the manifest lists (Bazel fixes the action graph before reading
files); the manifest check says so when they disagree.""",
    attrs = dict(TOOL_ATTRS, **{
        "model": attr.label(mandatory = True, providers = [DsaModelInfo], doc = "The dsa_model whose export is specialised (its export view, record and sources)."),
        "dim": attr.string(mandatory = True, doc = "The dynamic dim to bucket (e.g. prompt_len)."),
        "count": attr.int(mandatory = True, doc = "How many bucket sizes the manifest lists for `dim`."),
        "_export_tool": attr.label(default = Label("//dsa:export_tool"), executable = True, cfg = "exec"),
    }),
    provides = [DsaBucketInfo],
)
