"""Helpers of the hostile-input tests: a CLI run under a time limit and an address-space limit, and the
one-line error it must end with."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import dsa

# The directory that holds the dsa package, for CLI subprocesses.
PACKAGE_ROOT = Path(dsa.__file__).resolve().parents[1]
TIME_LIMIT_S = 120
# Address space, not resident memory: a refused input must be refused before anything it names is allocated.
# The IREE runtime and numpy reserve about 1 GiB of address space when they load; 4 GiB leaves room for a
# small model and none for an input that asks for gigabytes.
MEMORY_LIMIT_BYTES = 4 << 30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def cli(module: str, *args, cwd: Path = None) -> subprocess.CompletedProcess:
    """`python -m module args` under TIME_LIMIT_S and MEMORY_LIMIT_BYTES (a hang or a runaway allocation
    fails the test instead of the machine)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=TIME_LIMIT_S, preexec_fn=_limit_memory)


def refused(proc: subprocess.CompletedProcess, pattern: str) -> str:
    """Asserts the one-line refusal: exit 2, no traceback, `pattern` (a substring) in the error line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors, proc.stderr[-2000:]
    assert pattern in errors[0], (pattern, errors[0])
    return errors[0]

