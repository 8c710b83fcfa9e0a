"""`python -m dsa.tools.import_matrix`, `bin/dsa import-matrix` and `bazel run //tools:import_matrix` (this file
is the py_binaries' main)."""

import os
import sys

if __name__ == "__main__":
    # Run as a script (`bazel run //tools:import_matrix`), this package's directory is first on sys.path, and its
    # modules would shadow packages of the same name: the package root stays on the path, this directory does not.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

    from dsa.core.errors import run_cli
    from dsa.tools.import_matrix.cli import main

    run_cli(main, "dsa import-matrix")
