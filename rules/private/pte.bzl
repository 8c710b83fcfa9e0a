"""dsa_pte: the ExecuTorch Plan B — a dsa_model's entry point and checkpoint → an XNNPACK .pte."""

load("//toolchains/python:toolchain.bzl", "DsaPythonInfo")
load(":common.bzl", "TOOLCHAINS", "TOOL_ATTRS", "execution_requirements", "manifest_view", "python_env_of", "repo_relative", "run_tool", "stage_sources")
load(":providers.bzl", "DsaModelInfo", "DsaPteInfo")

def _dsa_pte_impl(ctx):
    model = ctx.attr.model[DsaModelInfo]
    pte = ctx.actions.declare_file(ctx.label.name + ".pte")
    record = ctx.actions.declare_file(ctx.label.name + ".pte_record.json")
    env = python_env_of(ctx.attr.python_env)
    if model.checkpoint_shards:
        fail("dsa_pte %s: the ExecuTorch Plan B reads one checkpoint file; %s is sharded (%d shards)" % (
            ctx.label,
            model.checkpoint.short_path,
            len(model.checkpoint_shards),
        ))
    tool_sources = stage_sources(ctx.attr._stage_code, model.model_sources)
    args = ctx.actions.args()
    args.add("--view", model.export_view)
    args.add("--params-view", model.params_view)
    inputs = [model.export_view, model.params_view, model.checkpoint, model.manifest, env.identity]
    if ctx.attr.bucket:
        view = ctx.actions.declare_file(ctx.label.name + ".bucket_view.json")
        manifest_view(ctx, model.manifest, "bucket", view, bucket = ctx.attr.bucket)
        args.add("--bucket-view", view)
        inputs.append(view)
    args.add("--checkpoint", model.checkpoint)
    args.add("--manifest", model.manifest)
    args.add("--manifest-name", model.manifest.short_path)
    args.add_all(model.pythonpath, before_each = "--pythonpath")
    args.add_all(["%s=%s" % (repo_relative(f), f.path) for f in model.own_sources], before_each = "--model-source")
    args.add_all(["%s=%s" % (repo_relative(f), f.path) for f in tool_sources], before_each = "--tool-source")
    args.add("--identity", env.identity)
    args.add("--out-pte", pte)
    args.add("--out-record", record)
    run_tool(
        ctx,
        env,
        ctx.attr._pte_tool,
        "dsa.stages.pte",
        [args],
        depset(inputs + tool_sources, transitive = [model.model_sources]),
        outputs = [pte, record],
        mnemonic = "DsaPte",
        progress_message = "Building the ExecuTorch program of %s" % ctx.label,
        execution_requirements = execution_requirements(ctx),
    )
    return [
        DefaultInfo(files = depset([pte, record]), runfiles = ctx.runfiles(files = [pte, record])),
        DsaPteInfo(model = model, pte = pte, record = record),
    ]

dsa_pte = rule(
    implementation = _dsa_pte_impl,
    toolchains = TOOLCHAINS,
    doc = """The ExecuTorch Plan B of a dsa_model: its entry point, built at static dims (`bucket`'s size, else
each dynamic dim at its minimum) with its checkpoint's weights, traced by torch.export and lowered to an
ExecuTorch program for the XNNPACK CPU backend: `<name>.pte` and `<name>.pte_record.json` (what XNNPACK took,
inputs, outputs, and the digests of every input: the provenance a bundle carries). Runs in the ExecuTorch
environment (@dsa_executorch_python). Framework pytorch models only; docs/frontends.md says when to ship it.""",
    attrs = dict(TOOL_ATTRS, **{
        "model": attr.label(mandatory = True, providers = [DsaModelInfo], doc = "The dsa_model (manifest, entry point, checkpoint)."),
        "bucket": attr.string(doc = "DIM:SLOT: build the program at that bucket's size of the manifest's `buckets`."),
        "python_env": attr.label(
            default = Label("@dsa_executorch_python//:env"),
            providers = [DsaPythonInfo],
            cfg = "exec",
            doc = "The environment (DsaPythonInfo: a dsa_python_env's `:env`) with ExecuTorch installed.",
        ),
        "_pte_tool": attr.label(default = Label("//dsa:pte_tool"), executable = True, cfg = "exec"),
        "_stage_code": attr.label(default = Label("//dsa:stage_code")),
    }),
    provides = [DsaPteInfo],
)
