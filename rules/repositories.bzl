"""WORKSPACE setup for rules_dsa (Bazel without Bzlmod, e.g. 4.2.3).

A workspace that uses rules_dsa writes:

    local_repository(name = "rules_dsa", path = "...")  # or an http_archive
    load("@rules_dsa//rules:repositories.bzl", "rules_dsa_dependencies")
    rules_dsa_dependencies()
    load("@rules_dsa//toolchains/python:repositories.bzl", "dsa_python_env")
    dsa_python_env(name = "dsa_python", lock = "@rules_dsa//:requirements_lock.txt")
    register_toolchains("@dsa_python//:dsa_toolchain", "@dsa_python//:python_toolchain")

`@dsa_python//:dsa_toolchain` is the environment every rules_dsa rule resolves (toolchain type
@rules_dsa//toolchains/python:toolchain_type, toolchains/python/toolchain.bzl); `:python_toolchain` is the
Python toolchain rules_dsa's py_binary tools run on. Register both of one environment.

Bazel 7/8 with Bzlmod reads MODULE.bazel instead and never runs this.
"""

load("@bazel_tools//tools/build_defs/repo:utils.bzl", "maybe")

def _offline_repo_impl(rctx):
    for path, content in rctx.attr.files.items():
        rctx.file(path, content, executable = path.endswith(".sh"))

# Writes its files itself, so it works from any workspace (a local_repository
# path would be relative to whichever workspace is the main one).
_offline_repo = repository_rule(
    implementation = _offline_repo_impl,
    attrs = {"files": attr.string_dict(mandatory = True)},
)

_CC_RULES = [
    "cc_binary",
    "cc_library",
    "cc_test",
    "cc_toolchain",
    "cc_toolchain_suite",
    "cc_proto_library",
    "objc_library",
]

_PY_RULES = ["py_binary", "py_library", "py_test", "py_runtime"]

def _wrappers(rules):
    return "".join([
        "def {0}(**kwargs):\n    native.{0}(**kwargs)\n\n".format(r)
        for r in rules
    ])

# Bazel 4.2.3's own tools load the C++ rules from @rules_cc; Debian's
# bazel-rules-cc is too new for 4.2.3, and nothing can be downloaded.
_RULES_CC_FILES = {
    "WORKSPACE": "workspace(name = \"rules_cc\")\n",
    "BUILD": "",
    "cc/BUILD": "",
    "cc/defs.bzl": "\"\"\"Offline stand-in (rules_dsa): the native C++ rules.\"\"\"\n\n" + _wrappers(_CC_RULES),
}

# rules_dsa loads the Python rules from @rules_python: they are leaving Bazel
# (autoloaded from rules_python in 8). Where no real rules_python exists
# (offline Bazel 4.2.3), this stand-in serves the native rules.
_RULES_PYTHON_FILES = {
    "WORKSPACE": "workspace(name = \"rules_python\")\n",
    "BUILD": "",
    "python/BUILD": "alias(\n" +
                    "    name = \"toolchain_type\",\n" +
                    "    actual = \"@bazel_tools//tools/python:toolchain_type\",\n" +
                    "    visibility = [\"//visibility:public\"],\n" +
                    ")\n",
    # A top-level `PyInfo = PyInfo` would shadow the builtin it reads, hence
    # the second file.
    "python/private/BUILD": "",
    "python/private/builtins.bzl": "builtin_PyInfo = PyInfo\nbuiltin_PyRuntimeInfo = PyRuntimeInfo\n",
    "python/defs.bzl": "\"\"\"Offline stand-in (rules_dsa): the native Python rules.\"\"\"\n\n" +
                       "load(\"@bazel_tools//tools/python:toolchain.bzl\", _py_runtime_pair = \"py_runtime_pair\")\n" +
                       "load(\"//python/private:builtins.bzl\", \"builtin_PyInfo\", \"builtin_PyRuntimeInfo\")\n\n" +
                       "py_runtime_pair = _py_runtime_pair\n" +
                       "PyInfo = builtin_PyInfo\n" +
                       "PyRuntimeInfo = builtin_PyRuntimeInfo\n\n" +
                       _wrappers(_PY_RULES),
}

# `bazel test` needs these two targets even without --coverage.
_COVERAGE_TOOLS_FILES = {
    "WORKSPACE": "workspace(name = \"remote_coverage_tools\")\n",
    "unavailable.sh": "#!/bin/sh\necho 'coverage tools are not available offline' >&2\nexit 1\n",
    "BUILD": "\n".join([
        "sh_binary(name = \"{}\", srcs = [\"unavailable.sh\"], visibility = [\"//visibility:public\"])".format(t)
        for t in ["coverage_report_generator", "lcov_merger"]
    ]) + "\n",
}

def rules_dsa_dependencies():
    """Declares the repositories rules_dsa needs under WORKSPACE, offline.

    Each is declared only if the workspace has not declared it already, so a
    workspace with the real rules_cc / rules_java / rules_python keeps them.
    """
    maybe(_offline_repo, name = "rules_cc", files = _RULES_CC_FILES)
    maybe(_offline_repo, name = "rules_python", files = _RULES_PYTHON_FILES)
    maybe(_offline_repo, name = "remote_coverage_tools", files = _COVERAGE_TOOLS_FILES)

    # Debian's bazel-rules-java package, matched to its bazel-bootstrap 4.2.3.
    maybe(native.local_repository, name = "rules_java", path = "/usr/share/bazel/rules/java")
