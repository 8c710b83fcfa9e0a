"""Analysis tests of the rules' Starlark logic (bazel-skylib analysistest): providers, the actions each rule
declares (mnemonics, counts, command lines) and the rules' failure messages. Analysis runs no action, so
these need neither the exports nor the compiles, only the Python environment's identity.json.

Uses only what bazel-skylib 1.0.3 (Debian's package; WORKSPACE.bazel) has: analysistest.make with `attrs`
and `expect_failure`, target_actions, asserts.equals/true/false/expect_failure."""

load("@bazel_skylib//lib:unittest.bzl", "analysistest", "asserts")
load("//rules:defs.bzl", "DsaBucketInfo", "DsaModelInfo", "DsaModuleInfo", "DsaTargetInfo")

# ---- helpers ------------------------------------------------------------------------------------------

# The fields rules/private/providers.bzl declares (kept in step with it by the tests below: a field the
# rule stops setting, or one it sets that is not declared here, fails them).
_MODEL_INFO_FIELDS = [
    "model_id",
    "manifest",
    "export_view",
    "params_view",
    "checkpoint",
    "checkpoint_shards",
    "runtime_view",
    "mlir",
    "export_record",
    "params",
    "model_sources",
    "own_sources",
    "pythonpath",
    "policy_config",
    "model_file",
    "python_env",
]

_MODULE_INFO_FIELDS = ["model", "target", "vmfbs", "records", "reports", "index", "lock", "levels", "files"]

_TARGET_INFO_FIELDS = ["name", "spec", "tuning_files"]

# The recipe lock records stage code only (dsa_vmfb's _stage_code, common.bzl's stage_sources).
_STAGE_CODE_PREFIXES = ["dsa/core/", "dsa/manifest/", "dsa/stages/"]
_STAGE_CODE_FILES = ["dsa/__init__.py"]
_FRONTEND_PREFIX = "dsa/frontends/"
_NEVER_LOCKED_PREFIXES = ["dsa/tools/", "dsa/runtime/"]

def _actions_by_mnemonic(env, mnemonic):
    return [a for a in analysistest.target_actions(env) if a.mnemonic == mnemonic]

def _one_action(env, mnemonic):
    """The target's only `mnemonic` action, or None (after failing the test) when it has not exactly one."""
    actions = _actions_by_mnemonic(env, mnemonic)
    if len(actions) != 1:
        analysistest.fail(env, "expected exactly one %s action, got %d" % (mnemonic, len(actions)))
        return None
    return actions[0]

def _flag_values(argv, flag):
    """Every value that follows `flag` in `argv` (`--flag VALUE` form, as ctx.actions.args().add writes it)."""
    return [argv[i + 1] for i in range(len(argv) - 1) if argv[i] == flag]

def _field_names(info):
    """The fields set on a provider instance (dir() also lists the to_json/to_proto methods)."""
    return sorted([f for f in dir(info) if f not in ("to_json", "to_proto")])

def _absolute_paths(value):
    """The parts of an argument or environment value that are absolute paths: each `=`, `,` or
    `:`-separated piece (a whole path, `name=path`, `a,b,c`, PYTHONPATH). A label (`//pkg:name`) is none."""
    found = []
    for piece in value.replace("=", ",").replace(":", ",").split(","):
        if piece.startswith("/") and not piece.startswith("//"):
            found.append(piece)
    return found

def _repo_relative(f):
    # As rules/private/common.bzl's repo_relative: the path inside the file's own repository.
    return f.short_path.split("/", 2)[2] if f.short_path.startswith("../") else f.short_path

def _check_tool_sources(env, allow_frontends):
    """The DsaLock action's --tool-source values: stage code only, each also an input of the action."""
    lock = _one_action(env, "DsaLock")
    if not lock:
        return []
    values = _flag_values(lock.argv, "--tool-source")
    asserts.true(env, len(values) > 0, "the DsaLock action records no --tool-source")
    input_paths = {f.path: True for f in lock.inputs.to_list()}
    names = []
    for value in values:
        name, sep, path = value.partition("=")
        asserts.true(env, sep == "=", "--tool-source %s is not NAME=PATH" % value)
        names.append(name)
        allowed = name in _STAGE_CODE_FILES or [p for p in _STAGE_CODE_PREFIXES if name.startswith(p)]
        if allow_frontends and name.startswith(_FRONTEND_PREFIX):
            allowed = True
        asserts.true(env, allowed, "the recipe lock records %s, which is not stage code" % name)
        for prefix in _NEVER_LOCKED_PREFIXES:
            asserts.false(env, name.startswith(prefix), "the recipe lock records %s (under %s)" % (name, prefix))
        asserts.true(env, path.endswith(name), "--tool-source %s: the path does not end with the name" % value)
        asserts.true(env, path in input_paths, "--tool-source %s is not an input of the DsaLock action" % value)
    asserts.equals(env, sorted(names), names, "--tool-source values are not sorted by path")
    for f in lock.inputs.to_list():
        for prefix in _NEVER_LOCKED_PREFIXES:
            asserts.false(env, f.short_path.startswith(prefix), "the DsaLock action reads %s" % f.short_path)
    return names

# ---- (1) providers ------------------------------------------------------------------------------------

def _dsa_model_info_test_impl(ctx):
    env = analysistest.begin(ctx)
    target = analysistest.target_under_test(env)
    asserts.true(env, DsaModelInfo in target, "dsa_model returns no DsaModelInfo")
    if DsaModelInfo not in target:
        return analysistest.end(env)
    info = target[DsaModelInfo]
    missing = [f for f in _MODEL_INFO_FIELDS if f not in dir(info)]
    asserts.equals(env, [], missing, "DsaModelInfo fields the rule does not set")
    asserts.equals(env, sorted(_MODEL_INFO_FIELDS), _field_names(info), "DsaModelInfo's fields")

    asserts.equals(env, target.label.name, info.model_id)
    asserts.equals(env, "pi0.yaml", info.manifest.basename)
    for field, basename in [
        ("export_view", "export_view.json"),
        ("params_view", "params_view.json"),
        ("runtime_view", "runtime_view.json"),
        ("mlir", "model.mlir"),
        ("export_record", "export_record.json"),
        ("params", "params.irpa"),
    ]:
        f = getattr(info, field)
        asserts.equals(env, basename, f.basename, "DsaModelInfo.%s" % field)
        asserts.false(env, f.is_source, "DsaModelInfo.%s is not an output of the rule" % field)
    asserts.true(env, info.checkpoint.basename.endswith(".safetensors"), "DsaModelInfo.checkpoint")
    asserts.equals(env, "depset", type(info.model_sources))
    asserts.equals(env, "list", type(info.own_sources))
    asserts.equals(env, "list", type(info.pythonpath))
    asserts.equals(env, None, info.policy_config)
    asserts.equals(env, None, info.python_env)

    # Model code is the model's own; dsa.stages.spec is in model_sources (the export imports it) but not own.
    model_sources = [_repo_relative(f) for f in info.model_sources.to_list()]
    own_sources = [_repo_relative(f) for f in info.own_sources]
    asserts.true(env, "dsa/stages/spec.py" in model_sources, "model_sources lacks dsa/stages/spec.py")
    asserts.true(env, "models/pi0/pi0.py" in own_sources, "own_sources lacks models/pi0/pi0.py")
    asserts.equals(env, [], [p for p in own_sources if p.startswith("dsa/")], "own_sources holds rules_dsa's files")
    asserts.equals(env, [], [p for p in info.pythonpath if p.startswith("/")], "absolute pythonpath entries")

    default = sorted([f.basename for f in target[DefaultInfo].files.to_list()])
    asserts.equals(env, ["export_record.json", "model.mlir", "params.irpa"], default, "dsa_model's default outputs")
    return analysistest.end(env)

dsa_model_info_test = analysistest.make(_dsa_model_info_test_impl)

def _dsa_bucket_info_test_impl(ctx):
    env = analysistest.begin(ctx)
    target = analysistest.target_under_test(env)
    info = target[DsaBucketInfo]
    asserts.equals(env, "prompt_len", info.dim)
    asserts.equals(env, ["prompt_len_0.mlir", "prompt_len_1.mlir", "prompt_len_2.mlir"], [f.basename for f in info.mlirs])
    asserts.equals(env, 3, len(info.records))
    asserts.equals(env, 3, len(info.views))
    asserts.equals(env, "pi0_model", info.model.model_id, "DsaBucketInfo.model is the bucketed model's DsaModelInfo")
    return analysistest.end(env)

dsa_bucket_info_test = analysistest.make(_dsa_bucket_info_test_impl)

def _dsa_vmfb_module_info_test_impl(ctx):
    env = analysistest.begin(ctx)
    target = analysistest.target_under_test(env)
    asserts.true(env, DsaModuleInfo in target, "dsa_vmfb returns no DsaModuleInfo")
    if DsaModuleInfo not in target:
        return analysistest.end(env)
    info = target[DsaModuleInfo]
    asserts.equals(env, sorted(_MODULE_INFO_FIELDS), _field_names(info), "DsaModuleInfo's fields")

    stems = ctx.attr.module_stems
    name = target.label.name
    asserts.equals(env, [s + ".vmfb" for s in stems], [f.basename for f in info.vmfbs], "one vmfb per bucket, in slot order")
    asserts.equals(env, [s + ".compile_report.json" for s in stems], [f.basename for f in info.reports])
    asserts.equals(env, len(stems), len(info.records), "one export record per module")
    for vmfb in info.vmfbs:
        asserts.true(env, vmfb.short_path.endswith("/%s/%s" % (name, vmfb.basename)), "%s is not under %s/" % (vmfb.short_path, name))
    asserts.equals(env, name + ".modules.json", info.index.basename)
    asserts.equals(env, name + ".lock.json", info.lock.basename)
    asserts.equals(env, ctx.attr.model_id, info.model.model_id, "DsaModuleInfo.model")
    asserts.equals(env, "x86_64-v3", info.target.name, "DsaModuleInfo.target")
    asserts.equals(env, "x86_64-v3.json", info.target.spec.basename, "DsaModuleInfo.target")

    default = [f.basename for f in target[DefaultInfo].files.to_list()]
    for f in info.vmfbs + [info.index, info.lock, info.model.params]:
        asserts.true(env, f.basename in default, "%s is not among dsa_vmfb's default outputs" % f.basename)
    return analysistest.end(env)

dsa_vmfb_module_info_test = analysistest.make(
    _dsa_vmfb_module_info_test_impl,
    attrs = {
        "model_id": attr.string(mandatory = True),
        "module_stems": attr.string_list(mandatory = True),
    },
)

def _levels_test_impl(ctx):
    """A policy with levels: its DsaModuleInfo lists them, its DsaLock action writes them into the index by
    file name, and building it builds them (their modules are among its outputs)."""
    env = analysistest.begin(ctx)
    target = analysistest.target_under_test(env)
    info = target[DsaModuleInfo]
    name = target.label.name
    asserts.equals(env, ctx.attr.levels, [m.target.name for m in info.levels], "DsaModuleInfo.levels")
    lock = _one_action(env, "DsaLock")
    if lock:
        asserts.equals(env, ["%s=%s_%s.modules.json" % (t, name, t) for t in ctx.attr.levels],
                       _flag_values(lock.argv, "--index-level"), "the index's levels")
    default = [f.short_path for f in target[DefaultInfo].files.to_list()]
    for level in info.levels:
        for f in level.vmfbs + [level.index, level.lock]:
            asserts.true(env, f.short_path in default, "%s (a level's output) is not among %s's outputs" % (f.short_path, name))
    return analysistest.end(env)

levels_test = analysistest.make(_levels_test_impl, attrs = {"levels": attr.string_list()})

def _bundle_levels_test_impl(ctx):
    """A bundle of a module with levels holds every level, the most capable first (the writer orders them);
    with levels = False, the module's own target alone."""
    env = analysistest.begin(ctx)
    action = _one_action(env, "DsaBundle")
    if action:
        indexes = [v.rpartition("/")[2] for v in _flag_values(action.argv, "--index")]
        asserts.equals(env, ctx.attr.indexes, indexes, "the bundle's module indexes")
        asserts.equals(env, ctx.attr.most_capable_first, "--most-capable-first" in action.argv)
    return analysistest.end(env)

bundle_levels_test = analysistest.make(_bundle_levels_test_impl, attrs = {
    "indexes": attr.string_list(),
    "most_capable_first": attr.bool(),
})

def _dsa_target_info_test_impl(ctx):
    env = analysistest.begin(ctx)
    target = analysistest.target_under_test(env)
    asserts.true(env, DsaTargetInfo in target, "dsa_target returns no DsaTargetInfo")
    if DsaTargetInfo not in target:
        return analysistest.end(env)
    info = target[DsaTargetInfo]
    asserts.equals(env, sorted(_TARGET_INFO_FIELDS), _field_names(info), "DsaTargetInfo's fields")
    asserts.equals(env, "x86_64-v3", info.name, "the target's name is its rule name")
    asserts.equals(env, "toolchains/targets/x86_64-v3.json", info.spec.short_path)
    asserts.true(env, info.spec.is_source)
    asserts.equals(env, [info.spec], target[DefaultInfo].files.to_list())
    asserts.equals(env, 0, len(analysistest.target_actions(env)), "dsa_target declares actions")
    return analysistest.end(env)

dsa_target_info_test = analysistest.make(_dsa_target_info_test_impl)

# ---- (2) mnemonics and counts -------------------------------------------------------------------------

def _action_counts_test_impl(ctx):
    env = analysistest.begin(ctx)
    counts = {}
    for action in analysistest.target_actions(env):
        if action.mnemonic.startswith("Dsa"):
            counts[action.mnemonic] = counts.get(action.mnemonic, 0) + 1
    expected = {k: int(v) for k, v in ctx.attr.counts.items()}
    asserts.equals(env, expected, counts, "the target's Dsa* actions by mnemonic")
    return analysistest.end(env)

# `counts`: every Dsa* mnemonic the target declares, with how many times (a mnemonic not listed must not
# appear). Only the target's own actions count, not its dependencies'.
action_counts_test = analysistest.make(
    _action_counts_test_impl,
    attrs = {"counts": attr.string_dict(mandatory = True)},
)

# ---- (3) argument lines -------------------------------------------------------------------------------

def _dsa_compile_argv_test_impl(ctx):
    env = analysistest.begin(ctx)
    compiles = _actions_by_mnemonic(env, "DsaCompile")
    asserts.true(env, len(compiles) > 0, "no DsaCompile action")
    mlirs = []
    for action in compiles:
        argv = action.argv
        for flag in ["--mlir", "--view", "--target", "--out", "--report"]:
            asserts.equals(env, 1, len(_flag_values(argv, flag)), "DsaCompile has %s once: %s" % (flag, argv))
        tuning = _flag_values(argv, "--tuning")
        if ctx.attr.tuning:
            asserts.equals(env, [ctx.attr.tuning], tuning, "DsaCompile's --tuning")
        else:
            asserts.equals(env, [], tuning, "DsaCompile has --tuning though the dsa_vmfb names none")
        target = _flag_values(argv, "--target")
        asserts.true(env, target and target[0].endswith("/x86_64-v3.json"), "--target is the target spec")
        view = _flag_values(argv, "--view")
        asserts.true(env, view and view[0].endswith("/compile_view.x86_64-v3.json"), "--view is the compile view")
        out = _flag_values(argv, "--out")
        report = _flag_values(argv, "--report")
        mlir = _flag_values(argv, "--mlir")
        if out and report and mlir:
            stem = mlir[0].rpartition("/")[2][:-len(".mlir")]
            mlirs.append(stem)
            asserts.true(env, out[0].endswith("/%s.vmfb" % stem), "--out %s is not %s.vmfb" % (out[0], stem))
            asserts.true(env, report[0].endswith("/%s.compile_report.json" % stem), "--report names another module")
            asserts.equals(env, sorted([out[0], report[0]]), sorted([f.path for f in action.outputs.to_list()]))

            # Every file the command line names is an input or an output of the action.
            inputs = [f.path for f in action.inputs.to_list()]
            for flag in ["--mlir", "--view", "--target"] + (["--tuning"] if tuning else []):
                value = _flag_values(argv, flag)[0]
                asserts.true(env, value in inputs or [p for p in inputs if p.endswith("/" + value)], "%s %s is not an input" % (flag, value))
    asserts.equals(env, sorted(ctx.attr.module_stems), sorted(mlirs), "one DsaCompile per bucket")
    return analysistest.end(env)

def _target_override_test_impl(ctx):
    """Under --//:target=//toolchains/targets:aarch64-orin, every DsaCompile of a dsa_vmfb whose own target is x86_64-v3 compiles
    for aarch64-orin, with the same family's tuning file for aarch64-orin."""
    env = analysistest.begin(ctx)
    compiles = [a for a in analysistest.target_actions(env) if a.mnemonic == "DsaCompile"]
    asserts.equals(env, 3, len(compiles), "one DsaCompile per bucket")
    for action in compiles:
        argv = action.argv
        target = _flag_values(argv, "--target")
        asserts.true(env, target and target[0].endswith("/aarch64-orin.json"), "--target %s" % target)
        view = _flag_values(argv, "--view")
        asserts.true(env, view and view[0].endswith("/compile_view.aarch64-orin.json"), "--view %s" % view)
        asserts.equals(env, ["toolchains/tuning/flow_vla.aarch64-orin.json"], _flag_values(argv, "--tuning"))
    return analysistest.end(env)

target_override_test = analysistest.make(
    _target_override_test_impl,
    config_settings = {str(Label("//:target")): str(Label("//toolchains/targets:aarch64-orin"))},
)

# `tuning`: the --tuning value expected (a source file's path), or "" for none.
dsa_compile_argv_test = analysistest.make(
    _dsa_compile_argv_test_impl,
    attrs = {
        "tuning": attr.string(),
        "module_stems": attr.string_list(mandatory = True),
    },
)

def _no_absolute_paths_test_impl(ctx):
    env = analysistest.begin(ctx)
    checked = 0
    found = []
    for action in analysistest.target_actions(env):
        if action.argv == None:
            continue  # file writes, symlinks: no command line
        checked += 1
        for arg in action.argv:
            found.extend(["%s argument %s" % (action.mnemonic, p) for p in _absolute_paths(arg)])
        for key, value in (action.env or {}).items():
            found.extend(["%s environment %s: %s" % (action.mnemonic, key, p) for p in _absolute_paths(value)])
    asserts.true(env, checked > 0, "the target declares no action with a command line")
    asserts.equals(env, ctx.attr.expected_absolute, found, "absolute paths in the target's command lines")
    return analysistest.end(env)

# Every command line (and environment) of the target's actions is free of absolute paths: action keys are
# the same in every checkout and output base (remote caching, reproducible bundles). `expected_absolute`
# (default none) is for the check's own test: a fixture that does put an absolute path on a command line.
no_absolute_paths_test = analysistest.make(
    _no_absolute_paths_test_impl,
    attrs = {"expected_absolute": attr.string_list()},
)

def _dsa_lock_stage_code_test_impl(ctx):
    env = analysistest.begin(ctx)
    names = _check_tool_sources(env, allow_frontends = ctx.attr.frontend_source != "")
    for required in ["dsa/__init__.py", "dsa/stages/lock.py", "dsa/stages/compile.py", "dsa/manifest/contract.py"]:
        asserts.true(env, required in names, "the recipe lock does not record %s" % required)
    frontends = [n for n in names if n.startswith(_FRONTEND_PREFIX)]
    if ctx.attr.frontend_source:
        asserts.true(env, ctx.attr.frontend_source in frontends, "the recipe lock does not record %s" % ctx.attr.frontend_source)
    else:
        asserts.equals(env, [], frontends, "a model without //dsa:lerobot records front-end code")
    return analysistest.end(env)

# `frontend_source`: a front-end file the lock must record (the model's deps include //dsa:lerobot), or ""
# for a model whose lock records no dsa/frontends/ file.
dsa_lock_stage_code_test = analysistest.make(
    _dsa_lock_stage_code_test_impl,
    attrs = {"frontend_source": attr.string()},
)

def _python_env_export_test_impl(ctx):
    env = analysistest.begin(ctx)
    export = _one_action(env, "DsaExport")
    if export:
        argv = export.argv
        asserts.true(env, argv[0].endswith("tests/rules/fake_env/bin/python3"), "DsaExport runs %s" % argv[0])
        asserts.equals(env, ["-m", "dsa.stages.export"], argv[1:3])
        inputs = [f.short_path for f in export.inputs.to_list()]
        asserts.true(env, "tests/rules/fake_env/identity.json" in inputs, "the environment's identity is not an input")
        asserts.true(env, "dsa/stages/export.py" in inputs, "the export stage's source is not an input")
        asserts.equals(env, [], [p for p in inputs if p.startswith("dsa/tools/") or p.startswith("dsa/runtime/")], "tool code among the inputs")
        pythonpath = export.env.get("PYTHONPATH", "")
        asserts.true(env, pythonpath != "", "no PYTHONPATH for the export's sources")
        asserts.equals(env, [], _absolute_paths(pythonpath), "PYTHONPATH %s" % pythonpath)
    info = analysistest.target_under_test(env)[DsaModelInfo]
    asserts.true(env, info.python_env != None, "DsaModelInfo.python_env is None")
    if info.python_env:
        asserts.equals(env, "python3", info.python_env.python.basename)
        asserts.equals(env, "identity.json", info.python_env.identity.basename)
    return analysistest.end(env)

# A dsa_model with `python_env` runs its export as `python -m dsa.stages.export` on that environment's
# interpreter, with the environment's identity and the stage's own sources as inputs.
python_env_export_test = analysistest.make(_python_env_export_test_impl)

def _toolchain_identity_test_impl(ctx):
    env = analysistest.begin(ctx)
    identity = ctx.attr.identity
    for action in analysistest.target_actions(env):
        if not action.mnemonic.startswith("Dsa"):
            continue
        inputs = [f.short_path for f in action.inputs.to_list()]
        asserts.true(env, identity in inputs, "%s lacks the toolchain's identity %s among its inputs" % (action.mnemonic, identity))
        if action.mnemonic == "DsaLock":
            asserts.equals(env, [f for f in _flag_values(action.argv, "--identity")], [ctx.attr.identity_path], "DsaLock --identity")
    return analysistest.end(env)

_TOOLCHAIN_IDENTITY_ATTRS = {
    "identity": attr.string(mandatory = True, doc = "short_path of the identity.json every Dsa action must take."),
    "identity_path": attr.string(mandatory = True, doc = "its path, as DsaLock's --identity names it."),
}

# Every Dsa action of a rule takes the identity of the environment registered for
# //toolchains/python:toolchain_type (WORKSPACE.bazel: @dsa_python//:dsa_toolchain) ...
toolchain_identity_test = analysistest.make(_toolchain_identity_test_impl, attrs = _TOOLCHAIN_IDENTITY_ATTRS)

# ... and of another one registered before it (tests/rules:fake_dsa_toolchain, as a user's workspace would
# register its own environment): the rules resolve the toolchain, they name no environment themselves.
fake_toolchain_identity_test = analysistest.make(
    _toolchain_identity_test_impl,
    attrs = _TOOLCHAIN_IDENTITY_ATTRS,
    config_settings = {"//command_line_option:extra_toolchains": ["//tests/rules:fake_dsa_toolchain"]},
)

def _sharded_checkpoint_test_impl(ctx):
    env = analysistest.begin(ctx)
    info = analysistest.target_under_test(env)[DsaModelInfo]
    asserts.equals(env, "model.safetensors.index.json", info.checkpoint.basename, "DsaModelInfo.checkpoint is the index")
    names = [f.basename for f in info.checkpoint_shards]
    asserts.equals(env, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], names, "shards")
    params = [a for a in analysistest.target_actions(env) if a.mnemonic == "DsaParams"]
    asserts.equals(env, 1, len(params), "one DsaParams action")
    if params:
        inputs = [f.basename for f in params[0].inputs.to_list()]
        for name in ["model.safetensors.index.json"] + names:
            asserts.true(env, name in inputs, "DsaParams reads %s" % name)
        argv = params[0].argv
        asserts.equals(env, info.checkpoint.path, argv[argv.index("--checkpoint") + 1], "--checkpoint is the index")
    return analysistest.end(env)

# A dsa_model of a sharded checkpoint (a dsa_checkpoint with shards: the index and its shards): the provider
# names the index and the shards, and DsaParams reads all of them.
sharded_checkpoint_test = analysistest.make(_sharded_checkpoint_test_impl)

# ---- (4) failure messages -----------------------------------------------------------------------------

def _analysis_failure_test_impl(ctx):
    env = analysistest.begin(ctx)
    asserts.expect_failure(env, ctx.attr.message)
    return analysistest.end(env)

# The target fails analysis with an error containing `message`.
analysis_failure_test = analysistest.make(
    _analysis_failure_test_impl,
    expect_failure = True,
    attrs = {"message": attr.string(mandatory = True)},
)

# A toolchain of that type whose target is no dsa_python_toolchain (here a Python runtime pair) fails the
# rule's analysis with a message saying what to register.
not_a_dsa_toolchain_test = analysistest.make(
    _analysis_failure_test_impl,
    expect_failure = True,
    attrs = {"message": attr.string(mandatory = True)},
    config_settings = {"//command_line_option:extra_toolchains": ["//tests/rules:not_a_dsa_toolchain"]},
)

# ---- the suite ----------------------------------------------------------------------------------------

_BUCKET_STEMS = ["prompt_len_0", "prompt_len_1", "prompt_len_2"]

_TUNING = "toolchains/tuning/flow_vla.x86_64-v3.json"

def dsa_rules_analysis_tests(name):
    """Declares every analysis test and a test_suite `name` of them all. Fixtures: tests/rules/BUILD.bazel."""

    # (test rule, test name: what it proves, attributes)
    tests = [
        # (1) providers
        (dsa_model_info_test, "dsa_model_provides_model_info_with_declared_fields", {"target_under_test": "//models:pi0_model"}),
        (dsa_bucket_info_test, "dsa_bucket_provides_one_mlir_per_bucket", {"target_under_test": ":three_buckets"}),
        (dsa_vmfb_module_info_test, "dsa_vmfb_provides_one_vmfb_per_bucket", {
            "target_under_test": ":tuned_vmfb",
            "model_id": "pi0_model",
            "module_stems": _BUCKET_STEMS,
        }),
        (dsa_vmfb_module_info_test, "dsa_vmfb_of_a_model_provides_one_vmfb", {
            "target_under_test": ":lerobot_vmfb",
            "model_id": "lerobot_model",
            "module_stems": ["model"],
        }),
        (dsa_target_info_test, "dsa_target_provides_target_info", {"target_under_test": "//toolchains/targets:x86_64-v3"}),
        (levels_test, "a_policy_with_levels_lists_them_in_its_index_and_builds_them", {
            "target_under_test": "//models:pi0",
            "levels": ["x86_64-v4", "x86_64-v4-bf16"],
        }),
        (bundle_levels_test, "a_bundle_of_a_policy_with_levels_holds_every_level_most_capable_first", {
            "target_under_test": "//models:pi0_levels_bundle",
            "indexes": ["pi0.modules.json", "pi0_x86_64-v4.modules.json", "pi0_x86_64-v4-bf16.modules.json"],
            "most_capable_first": True,
        }),
        (bundle_levels_test, "a_bundle_with_levels_false_holds_the_policys_own_target", {
            "target_under_test": "//models:pi0_bundle",
            "indexes": [],
            "most_capable_first": False,
        }),

        # (2) mnemonics and counts
        (action_counts_test, "dsa_vmfb_over_3_buckets_declares_3_compiles_and_1_lock", {
            "target_under_test": ":tuned_vmfb",
            "counts": {"DsaCompile": "3", "DsaLock": "1", "DsaManifest": "1"},
        }),
        (action_counts_test, "dsa_model_declares_export_params_and_3_manifest_views", {
            "target_under_test": "//models:pi0_model",
            "counts": {"DsaExport": "1", "DsaParams": "1", "DsaManifest": "3"},
        }),
        (action_counts_test, "dsa_bucket_declares_an_export_and_a_view_per_bucket", {
            "target_under_test": ":three_buckets",
            "counts": {"DsaExport": "3", "DsaManifest": "3"},
        }),
        (action_counts_test, "dsa_bundle_declares_one_bundle", {
            "target_under_test": ":tuned_bundle",
            "counts": {"DsaBundle": "1"},
        }),
        (action_counts_test, "dsa_bundle_of_several_targets_declares_one_bundle", {
            "target_under_test": ":multi_target_bundle",
            "counts": {"DsaBundle": "1"},
        }),
        (action_counts_test, "dsa_bundle_of_a_pipeline_declares_one_bundle", {
            "target_under_test": "//models:groot_bundle",
            "counts": {"DsaBundle": "1"},
        }),
        # The stand-in generators (rules/testing.bzl): one mnemonic each, all starting with "Dsa" (the remote
        # cache and execution checks select actions by that prefix).
        (action_counts_test, "dsa_checkpoint_declares_one_checkpoint_and_its_export_view", {
            "target_under_test": "//models:pi0_checkpoint",
            "counts": {"DsaCheckpoint": "1", "DsaManifest": "1"},
        }),
        (action_counts_test, "dsa_lerobot_policy_declares_one_lerobot_policy", {
            "target_under_test": ":stand_in_policy",
            "counts": {"DsaLeRobotPolicy": "1"},
        }),
        (action_counts_test, "dsa_lerobot_processors_declares_one_lerobot_processors", {
            "target_under_test": ":stand_in_processors",
            "counts": {"DsaLeRobotProcessors": "1"},
        }),
        (action_counts_test, "dsa_lerobot_tokenizer_declares_one_lerobot_tokenizer", {
            "target_under_test": ":stand_in_tokenizer",
            "counts": {"DsaLeRobotTokenizer": "1"},
        }),

        # (3) argument lines
        (dsa_compile_argv_test, "dsa_compile_argv_names_mlir_view_target_tuning_out_report", {
            "target_under_test": ":tuned_vmfb",
            "tuning": _TUNING,
            "module_stems": _BUCKET_STEMS,
        }),
        (target_override_test, "target_build_setting_compiles_every_bucket_for_another_target_with_its_tuning", {
            "target_under_test": ":tuned_vmfb",
        }),
        (dsa_compile_argv_test, "dsa_compile_argv_has_no_tuning_without_a_tuning_file", {
            "target_under_test": ":untuned_vmfb",
            "module_stems": _BUCKET_STEMS,
        }),
    ] + [
        (no_absolute_paths_test, subject + "_argv_has_no_absolute_paths", {"target_under_test": label})
        for label, subject in [
            ("//models:pi0_model", "dsa_model"),
            ("//models:pi0_checkpoint", "dsa_checkpoint"),
            (":env_model", "dsa_model_with_python_env"),
            (":three_buckets", "dsa_bucket"),
            (":tuned_vmfb", "dsa_vmfb"),
            (":tuned_bundle", "dsa_bundle"),
            (":multi_target_bundle", "dsa_multi_target_bundle"),
            ("//models:groot", "dsa_pipeline"),
            ("//models:groot_bundle", "dsa_pipeline_bundle"),
        ]
    ] + [
        # The check above finds an absolute path where there is one (a dsa_pipeline edge is user text).
        (no_absolute_paths_test, "absolute_path_check_finds_an_absolute_path_in_argv", {
            "target_under_test": ":pipeline_with_absolute_edge",
            "expected_absolute": ["DsaLink argument /abs/tuned_vmfb.y"],
        }),
        (dsa_lock_stage_code_test, "dsa_lock_records_only_stage_code", {"target_under_test": ":tuned_vmfb"}),
        (dsa_lock_stage_code_test, "dsa_lock_of_models_pi0_records_only_stage_code", {"target_under_test": "//models:pi0"}),
        (dsa_lock_stage_code_test, "dsa_lock_records_stage_code_and_lerobot_frontend", {
            "target_under_test": ":lerobot_vmfb",
            "frontend_source": "dsa/frontends/lerobot/__init__.py",
        }),
        (python_env_export_test, "dsa_model_with_python_env_exports_on_its_interpreter", {"target_under_test": ":env_model"}),
        (sharded_checkpoint_test, "dsa_model_of_a_sharded_checkpoint_reads_the_index_and_every_shard", {"target_under_test": ":sharded_model"}),

        # (3b) the environment comes from the registered toolchain
        (toolchain_identity_test, "dsa_vmfb_actions_take_the_registered_toolchains_identity", {
            "target_under_test": ":untuned_vmfb",
            "identity": "../dsa_python/identity.json",
            "identity_path": "external/dsa_python/identity.json",
        }),
        (fake_toolchain_identity_test, "dsa_vmfb_actions_take_the_identity_of_a_toolchain_registered_first", {
            "target_under_test": ":untuned_vmfb",
            "identity": "tests/rules/fake_env/identity.json",
            "identity_path": "tests/rules/fake_env/identity.json",
        }),
        # A dsa_model of a source checkpoint: under allow_analysis_failures, Bazel 4.2.3 crashes on a failed
        # rule's predeclared output (dsa_checkpoint's) that another target reads.
        (not_a_dsa_toolchain_test, "a_toolchain_that_is_no_dsa_python_toolchain_fails_naming_what_to_register", {
            "target_under_test": ":lerobot_model",
            "message": "is not a dsa_python_toolchain (no DsaPythonInfo): register a dsa_python_env's `:dsa_toolchain`",
        }),

        # (4) failure messages
        (analysis_failure_test, "dsa_bundle_with_module_and_pipeline_fails", {
            "target_under_test": ":bundle_with_module_and_pipeline",
            "message": "set exactly one of `module` (a dsa_vmfb), `modules` (dsa_vmfbs of one model for several targets), `pipeline` (a dsa_pipeline) and `pte` (a dsa_pte)",
        }),
        (analysis_failure_test, "dsa_bundle_without_module_or_pipeline_fails", {
            "target_under_test": ":bundle_without_module_or_pipeline",
            "message": "set exactly one of `module` (a dsa_vmfb), `modules` (dsa_vmfbs of one model for several targets), `pipeline` (a dsa_pipeline) and `pte` (a dsa_pte)",
        }),
        (analysis_failure_test, "multi_target_bundle_of_two_models_fails", {
            "target_under_test": ":multi_target_bundle_of_two_models",
            "message": "//models:transformer compiles another dsa_model than //tests/rules:tuned_vmfb",
        }),
        (analysis_failure_test, "multi_target_bundle_with_a_target_twice_fails", {
            "target_under_test": ":multi_target_bundle_with_a_target_twice",
            "message": "//tests/rules:tuned_vmfb and //models:pi0 are both compiled for target x86_64-v3",
        }),
        (analysis_failure_test, "multi_target_bundle_of_one_module_fails", {
            "target_under_test": ":multi_target_bundle_of_one_module",
            "message": "`modules` takes the dsa_vmfbs of two or more targets; bundle one with `module`",
        }),
        (analysis_failure_test, "a_level_of_another_model_fails", {
            "target_under_test": ":vmfb_with_a_level_of_another_model",
            "message": "level //models:transformer compiles another dsa_model; a level is this export compiled for another target",
        }),
        (analysis_failure_test, "a_level_in_another_package_fails", {
            "target_under_test": ":vmfb_with_a_level_in_another_package",
            "message": "level //models:pi0_x86_64-v4 is in another package; build the levels beside the policy",
        }),
        (analysis_failure_test, "dsa_vmfb_with_a_tuning_file_of_another_target_fails_before_any_action", {
            "target_under_test": ":vmfb_tuned_for_another_target",
            "message": "tuning toolchains/tuning/flow_vla.x86_64-v4.json is not for target x86_64-v3",
        }),
        (analysis_failure_test, "dsa_model_of_two_weight_files_without_an_index_fails", {
            "target_under_test": ":model_of_two_weight_files",
            "message": "`checkpoint` must be one weights file, or a sharded checkpoint's index (model.safetensors.index.json) and its shards; got 2 files, 0 index files",
        }),
        (analysis_failure_test, "dsa_model_with_a_shard_outside_its_index_directory_fails", {
            "target_under_test": ":model_with_a_stray_shard",
            "message": "checkpoint shard tests/rules/fixture.safetensors is not in the directory of its index",
        }),
        (analysis_failure_test, "dsa_model_with_a_python_env_that_is_no_env_fails", {
            "target_under_test": ":model_with_bad_python_env",
            "message": "does not have mandatory providers: 'DsaPythonInfo'",
        }),
    ]
    for rule, test_name, attrs in tests:
        rule(name = test_name, size = "small", **attrs)
    native.test_suite(name = name, tests = [":" + t[1] for t in tests])
