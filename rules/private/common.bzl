"""Helpers shared by the rules: the Python tools and the manifest-view action."""

load("//toolchains/python:toolchain.bzl", "DSA_PYTHON_TOOLCHAIN_TYPE", "DsaPythonInfo", "dsa_python_of")
load(":providers.bzl", "DsaTargetInfo")

# Every action runs a py_binary of //dsa on the hermetic Python environment. The environment's identity
# (lock digest, interpreter, installed set) is an explicit input of each, so a toolchain change is a
# cache miss while a different client environment is not. The environment is the registered toolchain of
# type //toolchains/python:toolchain_type (a dsa_python_env's `:dsa_toolchain`): every rule with
# TOOL_ATTRS declares `toolchains = TOOLCHAINS`.
TOOL_ATTRS = {
    "_manifest_tool": attr.label(default = Label("//dsa:manifest_tool"), executable = True, cfg = "exec"),
}

# As a string of the label (Bazel 4's rule() takes no Label here): `@rules_dsa//...` from a user's workspace.
TOOLCHAINS = [str(DSA_PYTHON_TOOLCHAIN_TYPE)]

def toolchain_identity(ctx):
    """identity.json of the registered environment (the rule's resolved dsa_python toolchain)."""
    return dsa_python_of(ctx).identity

# For rules whose actions may run in another dsa_python_env than the registered toolchain's (LeRobot
# policies need torch 2.14.1 + LeRobot): that environment's `:env`.
ENV_ATTRS = {
    "python_env": attr.label(
        providers = [DsaPythonInfo],
        cfg = "exec",
        doc = "An environment (DsaPythonInfo: a dsa_python_env's `:env`, or any dsa_python_toolchain) to run " +
              "the export in, instead of the registered toolchain's; LeRobot policies (framework: lerobot) " +
              "need \"@dsa_lerobot_python//:env\".",
    ),
}

# The rule set's own package, to tell its sources from model code.
_DSA_PACKAGE = Label("//dsa:BUILD.bazel")

def dsa_sources(files):
    """The rule set's own Python sources (and manifest schema) among `files`, sorted by path."""
    by_path = {
        f.path: f
        for f in files
        if f.is_source and f.owner.workspace_root == _DSA_PACKAGE.workspace_root and f.owner.package == _DSA_PACKAGE.package
    }
    return [by_path[path] for path in sorted(by_path.keys())]

def stage_sources(stage_code, model_sources):
    """The stage code a recipe lock records: //dsa:stage_code's files (core, manifest, stages) plus the
    front end (dsa/frontends/...) the model's deps name, if any; dsa.stages.lock.stage_source_files lists
    the same set without Bazel. Never runtime/ or tools/: editing a tool changes no lock."""
    frontends = [f for f in dsa_sources(model_sources.to_list()) if repo_relative(f).startswith("dsa/frontends/")]
    return dsa_sources(stage_code[DefaultInfo].default_runfiles.files.to_list() + frontends)

def python_env_of(target):
    """struct(python, identity, files) of an environment target (DsaPythonInfo: a dsa_python_env's `:env`),
    or None for no target."""
    if not target:
        return None
    info = target[DsaPythonInfo]
    return struct(python = info.interpreter, identity = info.identity, files = info.files)

def run_tool(ctx, env, tool, module, arguments, inputs, **kwargs):
    """Runs a //dsa tool (`tool`, its py_binary target): the binary on the toolchain's environment (env
    None), else `python -m module` on `env`'s interpreter with the binary's own sources — exactly the code
    it runs, never the rest of the package — as inputs. The environment's identity is added to the inputs
    either way, so a different environment is a different action key."""
    if env == None:
        ctx.actions.run(
            executable = tool[DefaultInfo].files_to_run,
            arguments = arguments,
            inputs = depset([toolchain_identity(ctx)], transitive = [inputs]),
            env = ACTION_ENV,
            **kwargs
        )
        return
    sources = dsa_sources(tool[DefaultInfo].default_runfiles.files.to_list())
    ctx.actions.run(
        executable = env.python,
        arguments = ["-m", module] + arguments,
        inputs = depset(env.files + sources, transitive = [inputs]),
        env = dict(ACTION_ENV, PYTHONPATH = ":".join(pythonpath_of(sources))),
        **kwargs
    )

# Deterministic, path-free environment for every tool: no user site, fixed hash seed, one thread where a
# library would otherwise size itself to the machine.
ACTION_ENV = {
    "PYTHONHASHSEED": "0",
    "PYTHONNOUSERSITE": "1",
    "OMP_NUM_THREADS": "1",
}

# Tags that say where an action may run or be cached. Bazel 4.2.3 hands a target's tags to its actions only
# with --experimental_allow_tags_propagation; the rules forward these themselves, so
# `tags = ["no-remote-cache"]` on a dsa_* target works on every Bazel.
_EXECUTION_TAGS = ["no-cache", "no-remote", "no-remote-cache", "no-remote-exec", "no-sandbox", "local"]

def execution_requirements(ctx):
    """The target's execution tags, as an action's execution_requirements."""
    return {tag: "" for tag in ctx.attr.tags if tag in _EXECUTION_TAGS}

def manifest_view(ctx, manifest, view, out, target = None, bucket = None, target_spec = None):
    """Declares the small DsaManifest action that validates `manifest` and writes one projection. With
    `target_spec` (the compile view's target), a precision.compute the target has no arithmetic for is refused
    here, before any export."""
    args = ctx.actions.args()
    args.add("project")
    args.add(manifest)
    args.add("--view", view)
    args.add("--out", out)
    if target:
        args.add("--target", target)
    if bucket:
        args.add("--bucket", bucket)
    if target_spec:
        args.add("--target-spec", target_spec)
    ctx.actions.run(
        executable = ctx.executable._manifest_tool,
        arguments = [args],
        inputs = [manifest, toolchain_identity(ctx)] + ([target_spec] if target_spec else []),
        outputs = [out],
        mnemonic = "DsaManifest",
        progress_message = "Validating %s: %s view of %s" % (ctx.label, view, manifest.short_path),
        env = ACTION_ENV,
        execution_requirements = execution_requirements(ctx),
    )

def pythonpath_of(files):
    """Execroot-relative roots that make each file importable by its workspace-relative module path."""
    roots = {}
    for f in files:
        root = f.root.path
        if f.owner and f.owner.workspace_root:
            root = (root + "/" if root else "") + f.owner.workspace_root
        roots[root or "."] = True
    return sorted(roots.keys())

def repo_relative(f):
    """A file's path inside its own repository (`dsa/stages/export.py`), the same in every checkout and workspace."""
    return f.short_path.split("/", 2)[2] if f.short_path.startswith("../") else f.short_path

def _dsa_target_impl(ctx):
    return [
        DefaultInfo(files = depset([ctx.file.spec])),
        DsaTargetInfo(name = ctx.label.name, spec = ctx.file.spec, tuning_files = ctx.files.tuning),
    ]

dsa_target = rule(
    implementation = _dsa_target_impl,
    doc = """A compilation target. The rule's name is the name manifests list under `targets`.

A target in your own workspace works like the rule set's: pass it as a dsa_vmfb's or dsa_policy's `target`,
or choose it for a whole build with `--@rules_dsa//:target=//your:target` (docs/targets.md).""",
    attrs = {
        "spec": attr.label(mandatory = True, allow_single_file = [".json"], doc = "Target spec (JSON): device, backends, runtime driver, flags."),
        "tuning": attr.label_list(allow_files = [".json", ".mlir"], doc = "Tuning files for this target (`<family>.<target>.json`, and the `<family>.<target>.spec.mlir` dispatch spec one names), found by family when a build chooses this target with //:target; the rule set's own toolchains/tuning files are always searched."),
    },
    provides = [DsaTargetInfo],
)

def _dsa_target_default_impl(ctx):
    return [DsaTargetInfo(name = "", spec = None, tuning_files = [])]

# //:target's default: no override, each dsa_vmfb compiles for its own `target`.
dsa_target_default = rule(
    implementation = _dsa_target_default_impl,
    doc = "The default of the //:target build setting: every dsa_vmfb compiles for its own `target`.",
    provides = [DsaTargetInfo],
)
