"""dsa_bundle: a dsa_vmfb's modules, parameters, manifest, lock and evidence as one deterministic archive.

dsa_release: `bazel run :name -- DEST` copies a verified bundle and its .sha256 into DEST."""

load("@rules_python//python:defs.bzl", "py_binary")
load(":common.bzl", "ACTION_ENV", "TOOLCHAINS", "TOOL_ATTRS", "execution_requirements", "repo_relative", "toolchain_identity")
load(":providers.bzl", "DsaModuleInfo", "DsaPipelineInfo", "DsaPteInfo")

def _processor_args(ctx, args):
    """`processors` and `policy_config` as the bundle tool's flags; returns the files they add as inputs."""
    if ctx.files.processors:
        if not ctx.file.policy_config:
            fail("dsa_bundle %s: `processors` needs `policy_config` (the policy's config.json)" % ctx.label)
        args.add_all(ctx.files.processors, before_each = "--processor")
        args.add("--policy-config", ctx.file.policy_config)
        return ctx.files.processors + [ctx.file.policy_config]
    if ctx.file.policy_config:
        fail("dsa_bundle %s: `policy_config` is read only with `processors`" % ctx.label)
    return []

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
    inputs = depset(manifests + [toolchain_identity(ctx)], transitive = [ctx.attr.pipeline[DefaultInfo].files])
    return args, inputs, ctx.attr.pipeline.label

def _multi_target_bundle(ctx, archive, digest, labels, modules, most_capable_first):
    """DsaBundle of one model's dsa_vmfbs for several targets (format 2): one parameter archive, each target's
    modules, lock and index. The modules must share their dsa_model (one export, one parameter archive).
    `labels` name each of `modules` (DsaModuleInfo) in messages; `most_capable_first`: a policy's levels, which
    the writer orders by the CPU features their targets need."""
    if len(modules) < 2:
        fail("dsa_bundle %s: `modules` takes the dsa_vmfbs of two or more targets; bundle one with `module`" % ctx.label)
    first = modules[0]
    seen = {}
    for label, m in zip(labels, modules):
        if m.model.params != first.model.params or m.model.manifest != first.model.manifest:
            fail(("dsa_bundle %s: %s compiles another dsa_model than %s; a multi-target bundle holds the " +
                  "modules of one dsa_model (one export, one parameter archive) for several targets") % (
                ctx.label, label, labels[0]))
        if m.target.name in seen:
            fail(("dsa_bundle %s: %s and %s are both compiled for target %s (a build with --//:target compiles " +
                  "every dsa_vmfb for that target: build a multi-target bundle without it)") % (
                ctx.label, seen[m.target.name], label, m.target.name))
        seen[m.target.name] = label
    args = ctx.actions.args()
    args.add("create")
    if most_capable_first:
        args.add("--most-capable-first")
    args.add("--manifest", first.model.manifest)
    args.add("--manifest-source", repo_relative(first.model.manifest))
    args.add_all([m.index for m in modules], before_each = "--index")
    extra = _processor_args(ctx, args)
    args.add("--out", archive)
    args.add("--digest", digest)

    # Each module's own files: its index and all the index names (modules, lock, parameters, spec link).
    inputs = depset(
        [first.model.manifest, toolchain_identity(ctx)] + [m.target.spec for m in modules] + extra,
        transitive = [m.files for m in modules],
    )
    return args, inputs, "%s for %s" % (labels[0], ", ".join([m.target.name for m in modules]))

def _pte_bundle(ctx, archive, digest):
    """DsaBundle of a dsa_pte (format 3): the ExecuTorch program, its record, manifest and runtime view."""
    pte = ctx.attr.pte[DsaPteInfo]
    args = ctx.actions.args()
    args.add("create")
    args.add("--pte", pte.pte)
    args.add("--manifest", pte.model.manifest)
    args.add("--manifest-source", repo_relative(pte.model.manifest))
    args.add("--runtime-view", pte.model.runtime_view)
    args.add("--out", archive)
    args.add("--digest", digest)
    inputs = depset([pte.pte, pte.record, pte.model.manifest, pte.model.runtime_view, toolchain_identity(ctx)])
    return args, inputs, ctx.attr.pte.label

def _dsa_bundle_impl(ctx):
    archive = ctx.actions.declare_file(ctx.label.name + ".tar")
    digest = ctx.actions.declare_file(ctx.label.name + ".sha256")
    if len([a for a in [ctx.attr.module, ctx.attr.modules, ctx.attr.pipeline, ctx.attr.pte] if a]) != 1:
        fail("dsa_bundle %s: set exactly one of `module` (a dsa_vmfb), `modules` (dsa_vmfbs of one model for " % ctx.label +
             "several targets), `pipeline` (a dsa_pipeline) and `pte` (a dsa_pte)")
    # A module with levels (dsa_policy's `levels`): every level, the most capable the machine runs first.
    levels = ctx.attr.module[DsaModuleInfo].levels if ctx.attr.module and ctx.attr.levels else []
    if ctx.attr.pipeline or ctx.attr.modules or ctx.attr.pte or levels:
        if (ctx.attr.pipeline or ctx.attr.pte) and (ctx.files.processors or ctx.file.policy_config):
            fail("dsa_bundle %s: `processors` and `policy_config` go with `module` or `modules` (a LeRobot policy)" % ctx.label)
        if ctx.attr.pipeline:
            args, inputs, subject = _pipeline_bundle(ctx, archive, digest)
        elif ctx.attr.pte:
            args, inputs, subject = _pte_bundle(ctx, archive, digest)
        elif levels:
            module = ctx.attr.module[DsaModuleInfo]
            labels = [str(ctx.attr.module.label)] + ["%s (level %s)" % (ctx.attr.module.label, m.target.name) for m in levels]
            args, inputs, subject = _multi_target_bundle(ctx, archive, digest, labels, [module] + levels, True)
        else:
            modules = [m[DsaModuleInfo] for m in ctx.attr.modules]
            args, inputs, subject = _multi_target_bundle(ctx, archive, digest, [str(m.label) for m in ctx.attr.modules], modules, False)
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
    _processor_args(ctx, args)
    args.add("--out", archive)
    args.add("--digest", digest)
    ctx.actions.run(
        executable = ctx.executable._bundle_tool,
        arguments = [args],
        inputs = [lock, model.manifest, model.runtime_view, module.target.spec, model.params, toolchain_identity(ctx)] +
                 module.vmfbs + module.records + module.reports + ctx.files.processors +
                 ([ctx.file.policy_config] if ctx.file.policy_config else []),
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
    toolchains = TOOLCHAINS,
    doc = """Packs a dsa_vmfb for release: `<name>.tar` and `<name>.sha256` (`<hex>  <name>.tar`).

The archive (docs/bundle-format.md, format 1) holds the vmfbs with their export records and compile reports,
the parameter archive, the manifest and its runtime view, the target spec, the recipe lock, a build report,
an in-toto/SLSA provenance statement and bundle.json. Same inputs, same bytes: in any checkout, with any
output base. `dsa run BUNDLE` verifies and runs it, `dsa diff` compares two.

With `modules` (the dsa_vmfbs of one dsa_model for several targets, in preference order) instead of
`module`, it is a multi-target bundle (format 2): one parameter archive, manifest and runtime view, and each
target's modules, lock, spec and index under `<target>.` names; `dsa run` runs the first target the machine
can execute and refuses, naming each target and the driver it needs, when there is none.

With `pipeline` (a dsa_pipeline) instead of `module`, the archive holds every stage's files under
`<stage>.` names, the link and the pipeline index; `bin/dsa link run --bundle` runs it.

With `pte` (a dsa_pte) it is an ExecuTorch bundle (format 3): the ExecuTorch program, its record, the
manifest and runtime view, and a provenance statement naming the digests of every input of the program;
`dsa bundle verify` checks it, `dsa pte run` runs it in the ExecuTorch environment.""",
    attrs = dict(TOOL_ATTRS, **{
        "module": attr.label(providers = [DsaModuleInfo], doc = "A dsa_vmfb (or set `modules` or `pipeline`)."),
        "modules": attr.label_list(
            providers = [DsaModuleInfo],
            doc = "dsa_vmfbs of one dsa_model, one per target, in the order `dsa run` prefers them: a " +
                  "multi-target bundle sharing one parameter archive (docs/bundle-format.md).",
        ),
        "levels": attr.bool(
            default = True,
            doc = "With `module`: when it has levels (dsa_policy's `levels`: x86-64-v4 beside x86-64-v3), hold " +
                  "them all, as a multi-target bundle ordered by the CPU features each needs, most first (`dsa " +
                  "run` and `dsa.runtime.load` take the most capable one the machine executes), with the " +
                  "`processors` when given. False: the module's own target alone (format 1).",
        ),
        "pte": attr.label(providers = [DsaPteInfo], doc = "A dsa_pte: an ExecuTorch bundle (format 3)."),
        "pipeline": attr.label(
            providers = [DsaPipelineInfo],
            doc = "A dsa_pipeline: a pipeline bundle of all its stages and its link (docs/bundle-format.md).",
        ),
        "processors": attr.label_list(
            allow_files = True,
            doc = "With `module` or `modules` (a LeRobot policy): LeRobot's processor files as the manifest's `processors` " +
                  "pins them (policy_preprocessor.json, policy_postprocessor.json, their statistics, " +
                  "tokenizer.json; a directory such as dsa_lerobot_processors' is read file by file). The " +
                  "bundle then ships the policy's whole pipeline: raw observations in, raw actions out " +
                  "(docs/policy-pipeline.md).",
        ),
        "policy_config": attr.label(
            allow_single_file = [".json"],
            doc = "With `processors`: the policy's config.json (the manifest's model.policy_config).",
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
        srcs = [Label("//dsa:runtime/release.py")],
        main = Label("//dsa:runtime/release.py"),
        deps = [Label("//dsa:signing")],
        data = [bundle, ":" + archive],
        args = ["release", "$(rootpath :%s)" % archive],
        **kwargs
    )
