"""dsa_vmfb: exported MLIR → IREE .vmfb for one target, plus the module index the runner loads."""

load(":common.bzl", "ACTION_ENV", "TOOLCHAINS", "TOOL_ATTRS", "execution_requirements", "manifest_view", "repo_relative", "stage_sources", "toolchain_identity")
load(":providers.bzl", "DsaBucketInfo", "DsaModelInfo", "DsaModuleInfo", "DsaTargetInfo")

def _lock_action(ctx, lock, index, spec, model, target, tuning, compile_view, bucket_views, mlirs, records, vmfbs, reports, levels):
    """DsaLock: digests of every input and output of these modules (see dsa/stages/lock.py), and the module
    index the runner loads (dsa.core.formats.ModuleIndex, the index's one writer)."""
    views = {"export": model.export_view, "params": model.params_view, "runtime": model.runtime_view, "compile": compile_view}
    for v in bucket_views:
        views["bucket/" + v.basename[:-len(".bucket_view.json")]] = v
    tool_sources = stage_sources(ctx.attr._stage_code, model.model_sources)
    args = ctx.actions.args()
    args.add("--manifest", model.manifest)
    args.add_all(["%s=%s" % (k, v.path) for k, v in sorted(views.items())], before_each = "--view")
    args.add("--checkpoint", model.checkpoint)
    args.add_all(model.checkpoint_shards, before_each = "--checkpoint-shard")
    args.add_all(["%s=%s" % (repo_relative(f), f.path) for f in model.own_sources], before_each = "--model-source")
    args.add_all(["%s=%s" % (repo_relative(f), f.path) for f in tool_sources], before_each = "--tool-source")
    args.add("--identity", toolchain_identity(ctx))
    args.add("--target-spec", target.spec)
    args.add_all([
        "%s=%s" % (m.basename[:-len(".mlir")], ",".join([m.path, r.path, v.path, p.path]))
        for m, r, v, p in zip(mlirs, records, vmfbs, reports)
    ], before_each = "--module")
    args.add("--params", model.params)
    extra = []
    if model.policy_config:
        args.add("--policy-config", model.policy_config)
        extra.append(model.policy_config)
    if model.model_file:
        args.add("--model-file", model.model_file)
        extra.append(model.model_file)
    if model.python_env:
        args.add("--export-identity", model.python_env.identity)
        extra.append(model.python_env.identity)
    if tuning:
        args.add("--tuning", "%s=%s" % (repo_relative(tuning), tuning.path))
    args.add("--out", lock)
    args.add("--index-out", index)
    args.add("--index-target", target.name)
    args.add("--index-target-spec", spec)
    args.add("--index-runtime-view", model.runtime_view)
    args.add_all(["%s=%s" % (level.target.name, level.index.basename) for level in levels], before_each = "--index-level")
    ctx.actions.run(
        executable = ctx.executable._lock_tool,
        arguments = [args],
        inputs = depset(
            [model.manifest, model.checkpoint, toolchain_identity(ctx), target.spec, model.params] +
            model.checkpoint_shards +
            views.values() + model.own_sources + tool_sources + mlirs + records + vmfbs + reports + extra +
            ([tuning] if tuning else []) + [spec, model.runtime_view],
        ),
        outputs = [lock, index],
        mnemonic = "DsaLock",
        progress_message = "Writing the recipe lock %s" % lock.short_path,
        env = ACTION_ENV,
        execution_requirements = execution_requirements(ctx),
    )

def _tuning_for(ctx, target, overridden):
    """The tuning file to compile with: the rule's `tuning` when it is for `target`; for a target chosen with
    //:target, the file of the same family for that target (the target's own `tuning` files, then the rule
    set's toolchains/tuning); None when the rule names none."""
    given = ctx.file.tuning
    if not given or given.basename.endswith(".%s.json" % target.name):
        return given
    if not overridden:
        fail("dsa_vmfb %s: tuning %s is not for target %s (tuning files are <family>.<target>.json); use " % (
            ctx.label, given.short_path, target.name) + "the family's %s file" % target.name)
    wanted = "%s.%s.json" % (given.basename.split(".")[0], target.name)
    for f in target.tuning_files + ctx.files._rule_set_tuning:
        if f.basename == wanted:
            return f
    fail(("dsa_vmfb %s: --//:target chose %s, but there is no tuning file %s for it (the rule names %s); " +
          "add one to the target's `tuning` (toolchains/tuning/README.md: an unmeasured file says so) or " +
          "build this policy for its own target") % (ctx.label, target.name, wanted, given.short_path))

def _dispatch_spec_for(ctx, target, tuning):
    """The dispatch spec beside `tuning` (<family>.<target>.spec.mlir, written by `dsa tune-dispatches`) among
    the target's and the rule set's tuning files, or None. It is an input of every DsaCompile that reads the
    tuning file; the tool refuses a tuning file that names a spec it was not given."""
    if not tuning:
        return None
    wanted = tuning.basename[:-len(".json")] + ".spec.mlir"
    for f in target.tuning_files + ctx.files._rule_set_tuning:
        if f.basename == wanted and f.dirname == tuning.dirname:
            return f
    return None

def _levels(ctx, model, target, overridden):
    """The DsaModuleInfo of each of `levels`, checked: the same dsa_model's export compiled for another target,
    in this package (its index lies beside this one: the index names it by file name). None under
    --//:target, which compiles every dsa_vmfb for one target."""
    if overridden:
        return []
    seen = {target.name: str(ctx.label)}
    out = []
    for level in ctx.attr.levels:
        info = level[DsaModuleInfo]
        if info.model.params != model.params or info.model.manifest != model.manifest:
            fail(("dsa_vmfb %s: level %s compiles another dsa_model; a level is this export compiled for " +
                  "another target (one export, one parameter archive)") % (ctx.label, level.label))
        if level.label.workspace_name != ctx.label.workspace_name or level.label.package != ctx.label.package:
            fail("dsa_vmfb %s: level %s is in another package; build the levels beside the policy (dsa_policy's `levels`)" % (
                ctx.label, level.label))
        if info.levels:
            fail("dsa_vmfb %s: level %s has levels of its own; list every level on %s" % (ctx.label, level.label, ctx.label))
        if info.target.name in seen:
            fail("dsa_vmfb %s: %s and %s are both compiled for target %s; each level is another target" % (
                ctx.label, seen[info.target.name], level.label, info.target.name))
        seen[info.target.name] = str(level.label)
        out.append(info)
    return out

def _dsa_vmfb_impl(ctx):
    name = ctx.label.name
    # A build may choose another target for every dsa_vmfb: --//:target=//toolchains/targets:aarch64-orin (or
    # the label of the user's own dsa_target). Its actions are distinct cache entries: the spec is an input of each.
    override = ctx.attr._target_flag[DsaTargetInfo]
    target = override if override.name else ctx.attr.target[DsaTargetInfo]
    tuning = _tuning_for(ctx, target, bool(override.name))
    dispatch_spec = _dispatch_spec_for(ctx, target, tuning)
    src = ctx.attr.src
    if DsaBucketInfo in src:
        model = src[DsaBucketInfo].model
        mlirs = src[DsaBucketInfo].mlirs
        records = src[DsaBucketInfo].records
        bucket_views = src[DsaBucketInfo].views
    else:
        model = src[DsaModelInfo]
        mlirs = [model.mlir]
        records = [model.export_record]
        bucket_views = []

    # A tuning file is `<family>.<target>.json`: one for another target is refused (_tuning_for), before any
    # action (export included) runs. DsaCompile checks its family against the manifest's `tuning`.
    view = ctx.actions.declare_file("%s/compile_view.%s.json" % (name, target.name))
    manifest_view(ctx, model.manifest, "compile", view, target = target.name, target_spec = target.spec)

    vmfbs = []
    reports = []
    for mlir in mlirs:
        stem = "%s/%s" % (name, mlir.basename[:-len(".mlir")])
        vmfb = ctx.actions.declare_file(stem + ".vmfb")
        report = ctx.actions.declare_file(stem + ".compile_report.json")
        args = ctx.actions.args()
        args.add("--mlir", mlir)
        args.add("--view", view)
        args.add("--target", target.spec)
        if tuning:
            args.add("--tuning", tuning)
        args.add("--out", vmfb)
        args.add("--report", report)
        ctx.actions.run(
            executable = ctx.executable._compile_tool,
            arguments = [args],
            inputs = [mlir, view, target.spec, toolchain_identity(ctx)] + ([tuning] if tuning else []) +
                     ([dispatch_spec] if dispatch_spec else []),
            outputs = [vmfb, report],
            mnemonic = "DsaCompile",
            progress_message = "Compiling %s for %s" % (mlir.short_path, target.name),
            env = ACTION_ENV,
            execution_requirements = execution_requirements(ctx),
        )
        vmfbs.append(vmfb)
        reports.append(report)

    # The target spec beside the modules (a symlink), so the index resolves from bazel-bin as well as from
    # runfiles (a source file is not under bazel-bin).
    spec = ctx.actions.declare_file("%s/%s.json" % (name, target.name))
    ctx.actions.symlink(output = spec, target_file = target.spec)

    levels = _levels(ctx, model, target, bool(override.name))

    # The module index: written by the DsaLock action, which has every path (one writer: ModuleIndex).
    index = ctx.actions.declare_file(name + ".modules.json")
    lock = ctx.actions.declare_file(name + ".lock.json")
    _lock_action(ctx, lock, index, spec, model, target, tuning, view, bucket_views, mlirs, records, vmfbs, reports, levels)

    files = vmfbs + reports + records + [index, lock, model.params, model.runtime_view, spec]
    # A level's outputs are this target's outputs too: building the policy builds every level.
    level_targets = [] if override.name else ctx.attr.levels
    runfiles = ctx.runfiles(files = files + [view])
    for level in level_targets:
        runfiles = runfiles.merge(level[DefaultInfo].default_runfiles)
    return [
        # The compile view rides in the runfiles: the tuner compiles the policy again with it.
        DefaultInfo(
            files = depset(files, transitive = [level[DefaultInfo].files for level in level_targets]),
            runfiles = runfiles,
        ),
        DsaModuleInfo(
            model = model,
            target = target,
            vmfbs = vmfbs,
            records = records,
            reports = reports,
            index = index,
            lock = lock,
            levels = levels,
            files = depset(files),
        ),
        OutputGroupInfo(index = depset([index])),
    ]

dsa_vmfb = rule(
    implementation = _dsa_vmfb_impl,
    toolchains = TOOLCHAINS,
    doc = """Compiles a dsa_model (one module) or a dsa_bucket (one module per bucket) for a target.

Flags come from the target spec (toolchains/targets), the optional `tuning` file of the model family
for that target (toolchains/tuning, chosen by measurement: `bazel run //bench:tune`) and the manifest's
compile view, plus fixed reproducibility flags; the target must be one the manifest lists under `targets`.
Editing the tuning file recompiles exactly the dsa_vmfb targets that name it.""",
    attrs = dict(TOOL_ATTRS, **{
        "src": attr.label(mandatory = True, providers = [[DsaModelInfo], [DsaBucketInfo]], doc = "A dsa_model (one module) or a dsa_bucket (one module per bucket)."),
        "target": attr.label(mandatory = True, providers = [DsaTargetInfo], doc = "A dsa_target; the manifest must list its name under `targets`."),
        "tuning": attr.label(
            allow_single_file = [".json"],
            doc = "Tuning file for this model family and target (toolchains/tuning/<family>.<target>.json).",
        ),
        "levels": attr.label_list(
            providers = [DsaModuleInfo],
            doc = "dsa_vmfbs of the same `src` for further targets of the same machines (x86-64-v4 beside " +
                  "x86-64-v3), in this package: building this target builds them, its index lists them, and a " +
                  "runner without an explicit target runs the most capable one the machine executes " +
                  "(docs/targets.md). Ignored under --//:target.",
        ),
        "_compile_tool": attr.label(default = Label("//dsa:compile_tool"), executable = True, cfg = "exec"),
        # --//:target: another target for the whole build (default: none, each rule's own `target`).
        "_target_flag": attr.label(default = Label("//:target"), providers = [DsaTargetInfo]),
        "_rule_set_tuning": attr.label(default = Label("//toolchains/tuning:tuning"), allow_files = True),
        "_lock_tool": attr.label(default = Label("//dsa:lock_tool"), executable = True, cfg = "exec"),
        # The stage code the recipe lock records (never the tools: editing one changes no lock).
        "_stage_code": attr.label(default = Label("//dsa:stage_code")),
    }),
    provides = [DsaModuleInfo],
)
