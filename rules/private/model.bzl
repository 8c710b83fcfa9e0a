"""dsa_model: checkpoint + manifest + model code → exported MLIR, export record and parameter archive."""

load("@rules_python//python:defs.bzl", "PyInfo")
load(":common.bzl", "ACTION_ENV", "ENV_ATTRS", "TOOLCHAINS", "TOOL_ATTRS", "execution_requirements", "manifest_view", "python_env_of", "pythonpath_of", "run_tool", "toolchain_identity")
load(":providers.bzl", "DsaModelInfo")

# rules_dsa's own `dsa` package: model code imports dsa.stages.spec, but it is tool code, recorded as such in
# the lock, not as the model's sources.
_DSA_PACKAGE = Label("//dsa:spec")

def model_sources(deps):
    """(all Python sources the export imports, the model's own sources)."""
    everything = depset(transitive = [d[PyInfo].transitive_sources for d in deps])
    own = [
        f
        for f in everything.to_list()
        if not (f.owner.workspace_root == _DSA_PACKAGE.workspace_root and f.owner.package == _DSA_PACKAGE.package)
    ]
    return everything, own

def _out(ctx, basename):
    return ctx.actions.declare_file("%s/%s" % (ctx.label.name, basename))

def checkpoint_files(label, files):
    """(the checkpoint file, its shards) of a `checkpoint` attribute's files: one weights file, or a sharded
    checkpoint — its model.safetensors.index.json and the shard files, all in the index's directory."""
    if len(files) == 1:
        return files[0], []
    indexes = [f for f in files if f.basename.endswith(".index.json")]
    if len(indexes) != 1:
        fail("%s: `checkpoint` must be one weights file, or a sharded checkpoint's index " % label +
             "(model.safetensors.index.json) and its shards; got %d files, %d index files" % (len(files), len(indexes)))
    index = indexes[0]
    shards = [f for f in files if f != index]
    for shard in shards:
        if not shard.basename.endswith(".safetensors"):
            fail("%s: checkpoint shard %s is not a .safetensors file" % (label, shard.short_path))
        if shard.dirname != index.dirname:
            fail("%s: checkpoint shard %s is not in the directory of its index %s (the index names shards by file name)" % (
                label,
                shard.short_path,
                index.short_path,
            ))
    return index, sorted(shards, key = _basename)

def _basename(f):
    return f.basename

def _dsa_model_impl(ctx):
    name = ctx.label.name
    manifest = ctx.file.manifest
    identity = toolchain_identity(ctx)
    checkpoint, shards = checkpoint_files(ctx.label, ctx.files.checkpoint)

    export_view = _out(ctx, "export_view.json")
    params_view = _out(ctx, "params_view.json")
    runtime_view = _out(ctx, "runtime_view.json")
    manifest_view(ctx, manifest, "export", export_view)
    manifest_view(ctx, manifest, "params", params_view)
    manifest_view(ctx, manifest, "runtime", runtime_view)

    sources, own_sources = model_sources(ctx.attr.deps)
    source_list = sources.to_list()
    mlir = _out(ctx, "model.mlir")
    record = _out(ctx, "export_record.json")
    args = ctx.actions.args()
    args.add("--view", export_view)
    args.add("--manifest-name", manifest.short_path)
    args.add_all(pythonpath_of(source_list), before_each = "--pythonpath")
    args.add_all(own_sources, before_each = "--source")
    policy_config = ctx.file.policy_config
    if policy_config:
        args.add("--policy-config", policy_config)
    model_file = ctx.file.model_file
    if model_file:
        args.add("--model-file", model_file)
    args.add("--out-mlir", mlir)
    args.add("--out-record", record)
    python_env = python_env_of(ctx.attr.python_env)
    run_tool(
        ctx,
        python_env,
        ctx.attr._export_tool,
        "dsa.stages.export",
        [args],
        depset([export_view] + [f for f in [policy_config, model_file] if f], transitive = [sources]),
        outputs = [mlir, record],
        mnemonic = "DsaExport",
        progress_message = ("Importing %s" if model_file else "Exporting %s to torch-dialect MLIR") % ctx.label,
        execution_requirements = execution_requirements(ctx),
    )

    params = _out(ctx, "params.irpa")
    args = ctx.actions.args()
    args.add("--checkpoint", checkpoint)
    args.add("--view", params_view)
    args.add("--record", record)
    args.add("--manifest-name", manifest.short_path)
    args.add("--out", params)
    ctx.actions.run(
        executable = ctx.executable._params_tool,
        arguments = [args],
        inputs = [checkpoint, params_view, record, identity] + shards,
        outputs = [params],
        mnemonic = "DsaParams",
        progress_message = "Checking %s and writing its parameter archive" % checkpoint.short_path,
        env = ACTION_ENV,
        execution_requirements = execution_requirements(ctx),
    )

    return [
        DefaultInfo(files = depset([mlir, record, params]), runfiles = ctx.runfiles(files = [mlir, record, params])),
        DsaModelInfo(
            model_id = name,
            manifest = manifest,
            export_view = export_view,
            params_view = params_view,
            checkpoint = checkpoint,
            checkpoint_shards = shards,
            runtime_view = runtime_view,
            mlir = mlir,
            export_record = record,
            params = params,
            model_sources = sources,
            own_sources = own_sources,
            pythonpath = pythonpath_of(source_list),
            policy_config = policy_config,
            model_file = model_file,
            python_env = python_env,
        ),
        OutputGroupInfo(views = depset([export_view, params_view, runtime_view])),
    ]

dsa_model = rule(
    implementation = _dsa_model_impl,
    toolchains = TOOLCHAINS,
    doc = """Exports a policy with its parameters externalised, and archives its checkpoint.

For frameworks pytorch and lerobot the manifest's `model.entry_point` names the function (in `deps`) that
builds the policy; for onnx and stablehlo the export imports `model_file` (the manifest's model.file). The
export (DsaExport) reads only the manifest's export view and the model code or file, the parameter archive
(DsaParams) only the checkpoint, the params view and the export record. So a new checkpoint of the same
architecture reruns DsaParams alone.""",
    attrs = dict(TOOL_ATTRS, **dict(ENV_ATTRS, **{
        "manifest": attr.label(mandatory = True, allow_single_file = [".yaml", ".yml"], doc = "Deployment manifest."),
        "checkpoint": attr.label(mandatory = True, allow_files = [".safetensors", ".json", ".onnx", ".data", ".bin"], doc = "Checkpoint: a safetensors file, or a sharded checkpoint (a filegroup of its model.safetensors.index.json and its shards, in one directory); for framework onnx the model's external-data file (or the .onnx file when its weights are inline). Its sha256 (and each shard's) must match the manifest's."),
        "model_file": attr.label(allow_single_file = True, doc = "frameworks onnx, stablehlo: the model file the export imports (its sha256 must match the manifest's model.file; the export refuses a suffix its framework does not read)."),
        "policy_config": attr.label(allow_single_file = [".json"], doc = "framework lerobot: the policy's config.json (its sha256 must match the manifest's model.policy_config)."),
        "deps": attr.label_list(providers = [PyInfo], doc = "py_library targets holding the model code."),
        "_export_tool": attr.label(default = Label("//dsa:export_tool"), executable = True, cfg = "exec"),
        "_params_tool": attr.label(default = Label("//dsa:params_tool"), executable = True, cfg = "exec"),
    })),
    provides = [DsaModelInfo],
)
