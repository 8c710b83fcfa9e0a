"""`python -m dsa.tools.profiler`, `bin/dsa profile` and `bazel run //bench:profile` (this file is the py_binary's main)."""

import os
import sys

if __name__ == "__main__":
    # Run as a script (`bazel run //bench:profile`), this package's directory is first on sys.path, and its
    # modules would shadow packages of the same name: the package root stays on the path, this directory does not.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

    from dsa.core.errors import run_cli
    from dsa.tools.profiler.cli import main

    run_cli(main, "dsa profile")
