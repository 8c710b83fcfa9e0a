"""Public API of rules_dsa: everything a BUILD file loads comes from here.

    load("@rules_dsa//rules:defs.bzl", "dsa_bucket", "dsa_model", "dsa_vmfb")

Data path (each arrow one action, by mnemonic):

    manifest ──DsaManifest──► views (export · params · bucket · compile · runtime)
    model code + export view ──DsaExport──► model.mlir + export_record.json
    checkpoint + params view + export record ──DsaParams──► params.irpa
    export view + bucket view ──DsaExport──► one static MLIR per bucket
    MLIR + compile view + target ──DsaCompile──► .vmfb + compile_report.json

The stand-in generators (seeded checkpoints, LeRobot policy directories, processor files, tokenizers: for
weights that are not at hand) and `dsa_py_test` are apart, in rules/testing.bzl.
"""

load("@rules_python//python:defs.bzl", "py_binary")
load("//rules/private:bucket.bzl", _dsa_bucket = "dsa_bucket")
load("//rules/private:common.bzl", _dsa_target = "dsa_target")
load("//rules/private:model.bzl", _dsa_model = "dsa_model")
load(
    "//rules/private:providers.bzl",
    _DsaBucketInfo = "DsaBucketInfo",
    _DsaModelInfo = "DsaModelInfo",
    _DsaModuleInfo = "DsaModuleInfo",
    _DsaPipelineInfo = "DsaPipelineInfo",
    _DsaPteInfo = "DsaPteInfo",
    _DsaTargetInfo = "DsaTargetInfo",
)
load("//rules/private:pte.bzl", _dsa_pte = "dsa_pte")
load("//rules/private:vmfb.bzl", _dsa_vmfb = "dsa_vmfb")
load("//rules/private:bundle.bzl", _dsa_bundle = "dsa_bundle", _dsa_release = "dsa_release")
load("//rules/private:link.bzl", _dsa_pipeline = "dsa_pipeline")
load("//rules/private:policy.bzl", _dsa_policies = "dsa_policies", _dsa_policy = "dsa_policy")
load("//toolchains/python:toolchain.bzl", _DsaPythonInfo = "DsaPythonInfo", _dsa_python_toolchain = "dsa_python_toolchain")

# One call per model: `dsa_policy(name, manifest, target, deps | lerobot_config, bucket, tuning, parity_test)`
# makes the weights (seeded, or a LeRobot policy directory), the dsa_model, the dsa_bucket and the dsa_vmfb
# (rules/private/policy.bzl). `dsa_policies(name)`, last in a BUILD file, indexes them for the tools.
dsa_policy = _dsa_policy
dsa_policies = _dsa_policies

dsa_model = _dsa_model
dsa_bucket = _dsa_bucket
dsa_vmfb = _dsa_vmfb
dsa_target = _dsa_target

# The ExecuTorch Plan B: `dsa_pte(name, model = ":<policy>_model")` builds the same model and checkpoint into
# an XNNPACK .pte (rules/private/pte.bzl); `dsa_bundle(pte = ...)` ships it with its provenance.
dsa_pte = _dsa_pte

# Split policies: `dsa_pipeline(name, stages = [dsa_vmfb...], edges = {"head.x": "backbone.x"})` links compiled
# models by the tensors they exchange, checking each edge's shape and dtype (rules/private/link.bzl).
dsa_pipeline = _dsa_pipeline

DsaModelInfo = _DsaModelInfo
DsaBucketInfo = _DsaBucketInfo
DsaModuleInfo = _DsaModuleInfo
DsaPipelineInfo = _DsaPipelineInfo
DsaPteInfo = _DsaPteInfo
DsaTargetInfo = _DsaTargetInfo

# The Python environment as a toolchain (toolchains/python/toolchain.bzl, docs/python-environments.md): an
# environment made some other way than dsa_python_env is a `dsa_python_toolchain` in a `toolchain()` of type
# @rules_dsa//toolchains/python:toolchain_type.
dsa_python_toolchain = _dsa_python_toolchain
DsaPythonInfo = _DsaPythonInfo

def dsa_runner(name, module, args = [], **kwargs):
    """`bazel run :name [-- dsa run flags]`: runs the compiled policy `module` (a dsa_vmfb) on a sample.

    Prints the action chunk's shape and latency percentiles; see dsa/runtime/run.py for its flags."""
    index = name + "_index"
    native.filegroup(name = index, srcs = [module], output_group = "index", tags = ["manual"])
    py_binary(
        name = name,
        srcs = [Label("//dsa:runtime/run.py")],
        main = Label("//dsa:runtime/run.py"),
        deps = [Label("//dsa:run")],
        data = [module, ":" + index],
        args = ["--index", "$(rootpath :%s)" % index] + args,
        **kwargs
    )

# Release bundles: `dsa_bundle(name, module = ":<dsa_vmfb>")` builds `<name>.tar` + `<name>.sha256`
# (docs/bundle-format.md); `dsa_release(name, bundle)` is `bazel run :name -- DEST`, which copies both to DEST.
dsa_bundle = _dsa_bundle
dsa_release = _dsa_release
