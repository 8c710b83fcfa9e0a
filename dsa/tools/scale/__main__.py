"""`python -m dsa.tools.scale`, `bin/dsa scale` and `bazel run //tools:scale` (this file is the py_binary's main);
the measured children run it too (hidden flags, cli.py)."""

import os
import sys

if __name__ == "__main__":
    # Run as a script (`bazel run //tools:scale`), this package's directory is first on sys.path, and its
    # modules would shadow packages of the same name: the package root stays on the path, this directory does not.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

    from dsa.core.errors import run_cli
    from dsa.tools.scale.cli import main

    run_cli(main, "dsa scale")
