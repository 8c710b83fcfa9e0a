"""Entry point of dsa_py_test: runs pytest on the test files given first.

argv: the test files (runfiles-relative paths, put there by dsa_py_test),
then any further pytest arguments (the target's `args`, `--test_arg`).
"""

import os
import sys

import pytest

NO_TESTS_COLLECTED = 5


def main(argv):
    # No cache directory: runfiles are read-only, and a cache is state that
    # makes one run depend on the last.
    pytest_args = list(argv) + ["-p", "no:cacheprovider", "-q"]
    xml = os.environ.get("XML_OUTPUT_FILE")  # set by `bazel test`
    if xml:
        pytest_args.append("--junitxml=" + xml)
    code = pytest.main(pytest_args)
    if code == NO_TESTS_COLLECTED:
        # A test target that tests nothing is a mistake (a misnamed function,
        # a -k that matches nothing): fail rather than pass vacuously.
        print("dsa_py_test: no tests were collected from %s" % " ".join(argv), file=sys.stderr)
    return int(code)


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["--python"]:
        # dsa_py_test(python = ...): run under that environment's interpreter instead; PYTHONPATH (the
        # runfiles' import roots, set by the launcher) carries over.
        python = os.path.abspath(argv[1])
        os.execv(python, [python, os.path.abspath(__file__)] + argv[2:])
    sys.exit(main(argv))
