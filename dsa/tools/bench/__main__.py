"""`python -m dsa.tools.bench`, `bin/dsa bench` and `bazel run //bench` (this file is the py_binary's main):
the benchmark's command line, dsa.tools.bench.cli."""

import os
import sys

if __name__ == "__main__":
    # Run as a script (`bazel run //bench`), this package's directory is first on sys.path, and its modules
    # would shadow packages of the same name (lerobot.py: LeRobot's; quant.py): the package root stays on
    # the path, this directory does not. Done before anything else is imported.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

    from dsa.core.errors import run_cli
    from dsa.tools.bench.cli import main

    run_cli(main, "dsa bench")
