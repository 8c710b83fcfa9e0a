"""dsa_py_test: a py_test that runs pytest on its sources."""

# From @rules_python, not `native`: the Python rules are leaving Bazel
# (autoloaded from rules_python in 8). Under WORKSPACE on Bazel 4.2.3, rules_dsa_dependencies() provides an
# offline @rules_python whose py_test is the native rule.
load("@rules_python//python:defs.bzl", "py_test")

_MAIN = Label("//rules/private:pytest_main.py")

def dsa_py_test(name, srcs, deps = [], data = [], args = [], python = None, **kwargs):
    """Runs pytest on `srcs`; fails if a test fails or none is collected.

    Args:
      name: test target name.
      srcs: pytest files; each is collected.
      deps: py_library dependencies.
      data: files the tests read at run time (from the runfiles tree).
      args: extra pytest arguments, after the test files.
      python: a dsa_python_env's interpreter (`@dsa_lerobot_python//:bin/python3`) to run pytest under
        instead of the toolchain's; the test starts on the toolchain and re-executes itself there.
      **kwargs: passed to py_test (size, tags, timeout, ...).
    """
    reexec = []
    if python:
        # The interpreter and its environment's identity (so the test reruns when the environment changes).
        data = data + [python, python.replace(":bin/python3", ":identity.json")]
        reexec = ["--python", "$(rootpath %s)" % python]
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
