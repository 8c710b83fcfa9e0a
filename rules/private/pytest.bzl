"""dsa_py_test: a py_test that runs pytest on its sources."""

# From @rules_python, not `native`: the Python rules are leaving Bazel
# (autoloaded from rules_python in 8). Under WORKSPACE on Bazel 4.2.3, rules_dsa_dependencies() provides an
# offline @rules_python whose py_test is the native rule.
load("@rules_python//python:defs.bzl", "py_test")
load("//toolchains/python:toolchain.bzl", "DsaPythonInfo")

_MAIN = Label("//rules/private:pytest_main.py")

def _test_python_impl(ctx):
    info = ctx.attr.env[DsaPythonInfo]
    return [DefaultInfo(
        # The interpreter alone, for $(rootpath); the identity rides along in the runfiles, so the test
        # reruns when the environment changes.
        files = depset([info.interpreter]),
        runfiles = ctx.runfiles(files = info.files),
    )]

# The interpreter of an environment (DsaPythonInfo) as a data dependency of a dsa_py_test.
_test_python = rule(
    implementation = _test_python_impl,
    attrs = {
        "env": attr.label(mandatory = True, providers = [DsaPythonInfo], doc = "A dsa_python_env's `:env`."),
    },
)

def dsa_py_test(name, srcs, deps = [], data = [], args = [], python = None, **kwargs):
    """Runs pytest on `srcs`; fails if a test fails or none is collected.

    Args:
      name: test target name.
      srcs: pytest files; each is collected.
      deps: py_library dependencies.
      data: files the tests read at run time (from the runfiles tree).
      args: extra pytest arguments, after the test files.
      python: an environment (DsaPythonInfo: a dsa_python_env's `:env`, e.g. `@dsa_lerobot_python//:env`)
        to run pytest under instead of the toolchain's; the test starts on the toolchain and re-executes
        itself on that environment's interpreter.
      **kwargs: passed to py_test (size, tags, timeout, ...).
    """
    reexec = []
    if python:
        # The interpreter and its environment's identity (so the test reruns when the environment changes).
        interpreter = name + "_python"
        _test_python(
            name = interpreter,
            env = python,
            testonly = True,
            tags = ["manual"],
            visibility = ["//visibility:private"],
        )
        data = data + [":" + interpreter]
        reexec = ["--python", "$(rootpath :%s)" % interpreter]
    py_test(
        name = name,
        srcs = srcs + [_MAIN],
        main = _MAIN,
        deps = deps,
        data = data,
        # The test files go first, as runfiles-relative paths: a test runs in
        # its workspace's runfiles directory.
        args = reexec + ["$(rootpath %s)" % src for src in srcs] + args,
        **kwargs
    )
