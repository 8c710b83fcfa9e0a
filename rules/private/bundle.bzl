"""dsa_bundle: a dsa_vmfb's modules, parameters, manifest, lock and evidence as one deterministic archive.

dsa_release: `bazel run :name -- DEST` copies a verified bundle and its .sha256 into DEST."""

load("@rules_python//python:defs.bzl", "py_binary")
load(":common.bzl", "ACTION_ENV", "execution_requirements", "TOOL_ATTRS", "repo_relative")
load(":providers.bzl", "DsaModuleInfo", "DsaPipelineInfo")

def _pipeline_bundle(ctx, archive, digest):
    """DsaBundle of a dsa_pipeline: every stage's files (from its module index), its manifest, the link."""
    pipeline = ctx.attr.pipeline[DsaPipelineInfo]
    args = ctx.actions.args()
    args.add("create")
    args.add("--pipeline", pipeline.index)
    manifests = []
    for name, stage in zip(pipeline.stage_names, pipeline.stages):
        manifest = stage.model.manifest
        args.add("--stage-manifest", "%s=%s,%s" % (name, manifest.path, repo_relative(manifest)))
        manifests.append(manifest)
    args.add("--out", archive)
    args.add("--digest", digest)

    # The pipeline's files hold every stage's module index and what it names (dsa_vmfb's outputs).
    inputs = depset(manifests + [ctx.file._toolchain_identity], transitive = [ctx.attr.pipeline[DefaultInfo].files])
    return args, inputs, ctx.attr.pipeline.label

def _dsa_bundle_impl(ctx):
    archive = ctx.actions.declare_file(ctx.label.name + ".tar")
    digest = ctx.actions.declare_file(ctx.label.name + ".sha256")
    if bool(ctx.attr.module) == bool(ctx.attr.pipeline):
        fail("dsa_bundle %s: set exactly one of `module` (a dsa_vmfb) and `pipeline` (a dsa_pipeline)" % ctx.label)
    if ctx.attr.pipeline:
        args, inputs, subject = _pipeline_bundle(ctx, archive, digest)
        ctx.actions.run(
            executable = ctx.executable._bundle_tool,
            arguments = [args],
            inputs = inputs,
            outputs = [archive, digest],
            mnemonic = "DsaBundle",
            progress_message = "Bundling %s for release" % subject,
            env = ACTION_ENV,
            execution_requirements = execution_requirements(ctx),
        )
        return [
            DefaultInfo(files = depset([archive, digest]), runfiles = ctx.runfiles(files = [archive, digest])),
            OutputGroupInfo(archive = depset([archive]), digest = depset([digest])),
        ]
    module = ctx.attr.module[DsaModuleInfo]
    lock = module.lock
    model = module.model

    args = ctx.actions.args()
    args.add("create")
    args.add("--lock", lock)
    args.add("--manifest", model.manifest)
    args.add("--manifest-source", repo_relative(model.manifest))
    args.add("--runtime-view", model.runtime_view)
    args.add("--target-spec", module.target.spec)
    args.add("--params", model.params)
    for vmfb, record, report in zip(module.vmfbs, module.records, module.reports):
        args.add("--module", "%s=%s,%s,%s" % (vmfb.basename[:-len(".vmfb")], vmfb.path, record.path, report.path))
    args.add("--out", archive)
    args.add("--digest", digest)
    ctx.actions.run(
        executable = ctx.executable._bundle_tool,
        arguments = [args],
        inputs = [lock, model.manifest, model.runtime_view, module.target.spec, model.params, ctx.file._toolchain_identity] +
                 module.vmfbs + module.records + module.reports,
        outputs = [archive, digest],
        mnemonic = "DsaBundle",
        progress_message = "Bundling %s for release" % ctx.attr.module.label,
        env = ACTION_ENV,
        execution_requirements = execution_requirements(ctx),
    )
    return [
        DefaultInfo(files = depset([archive, digest]), runfiles = ctx.runfiles(files = [archive, digest])),
        OutputGroupInfo(archive = depset([archive]), digest = depset([digest])),
    ]

dsa_bundle = rule(
    implementation = _dsa_bundle_impl,
    doc = """Packs a dsa_vmfb for release: `<name>.tar` and `<name>.sha256` (`<hex>  <name>.tar`).

The archive (docs/bundle-format.md, format 1) holds the vmfbs with their export records and compile reports,
the parameter archive, the manifest and its runtime view, the target spec, the recipe lock, a build report,
an in-toto/SLSA provenance statement and bundle.json. Same inputs, same bytes: in any checkout, with any
output base. `dsa run BUNDLE` verifies and runs it, `dsa diff` compares two.

With `pipeline` (a dsa_pipeline) instead of `module`, the archive holds every stage's files under
`<stage>.` names, the link and the pipeline index; `bin/dsa link run --bundle` runs it.""",
    attrs = dict(TOOL_ATTRS, **{
        "module": attr.label(providers = [DsaModuleInfo], doc = "A dsa_vmfb (or set `pipeline`)."),
        "pipeline": attr.label(
            providers = [DsaPipelineInfo],
            doc = "A dsa_pipeline: a pipeline bundle of all its stages and its link (docs/bundle-format.md).",
        ),
        "_bundle_tool": attr.label(default = Label("//dsa:bundle_tool"), executable = True, cfg = "exec"),
    }),
)

def dsa_release(name, bundle, **kwargs):
    """`bazel run :name -- DEST`: verifies `bundle` (a dsa_bundle), then copies its archive and .sha256 into
    DEST (created if missing; a relative DEST is relative to the directory `bazel run` was started in)."""
    archive = name + "_archive"
    native.filegroup(name = archive, srcs = [bundle], output_group = "archive", tags = ["manual"])
    py_binary(
        name = name,
        srcs = [Label("//dsa:runtime/bundle.py")],
        main = Label("//dsa:runtime/bundle.py"),
        deps = [Label("//dsa:bundle")],
        data = [bundle, ":" + archive],
        args = ["release", "$(rootpath :%s)" % archive],
        **kwargs
    )
