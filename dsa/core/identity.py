"""The identity of the Python environment the tools run in: lock digest, interpreter, installed set.

The `dsa_python_env` repository rule runs this file to write `@dsa_python//:identity.json`, an input of
every rules_dsa action; `dsa compile` calls `identity()` to put the same object in its lock. It names no
path, so it is the same for every checkout of the same environment.

    python dsa/core/identity.py LOCK_FILE        # prints the identity as canonical JSON

Standard library only: it runs before anything else is importable.
"""

import hashlib
import json
import platform
import re
import subprocess
import sys
import sysconfig


def identity(lock_path: str) -> dict:
    with open(lock_path, "rb") as f:
        lock_sha256 = hashlib.sha256(f.read()).hexdigest()
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--disable-pip-version-check"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    # Names in PEP 503 normal form, as in the lock, so the list reads like it. (`pip freeze` leaves out
    # the venv's own pip and setuptools.)
    installed = sorted(
        re.sub(r"[-_.]+", "-", name).lower() + "==" + version
        for name, version in (line.split("==", 1) for line in freeze if "==" in line)
    )
    return {
        "schema": 1,
        "lock_sha256": lock_sha256,
        "python_version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": sysconfig.get_platform(),
        "installed": installed,
    }


if __name__ == "__main__":
    print(json.dumps(identity(sys.argv[1]), sort_keys=True, indent=2))
