"""The machine's store of installed Python environments, shared by every output base (dsa_python_env).

Each fresh Bazel output base (a second checkout, a worktree, a CI check that builds in a clean clone) used to
pip-install the same hashed lock again: minutes each. An environment is fully determined by its lock (every
package pinned with its sha256), the interpreter it is made from and pip's extra arguments, so this script
keys a venv by exactly those and installs it once per machine; the repository rule links its `venv` to it.
Nothing an action sees changes: the identity.json written from the venv is the same, and the interpreter
wrapper finds the venv through the link.

    python3.11 envstore.py --store DIR --lock LOCK [--pip-arg=ARG ...]   # prints the ready venv's path
    python3.11 envstore.py --into VENV --lock LOCK [--pip-arg=ARG ...]   # no store: installs at VENV
    python3.11 envstore.py --image-root ROOT --lock LOCK [--store DIR]   # a worker image's environment

--image-root lays an environment out the way a remote-execution worker's image holds it (docs/remote-execution.md):
at ROOT/<the lock's sha256>/venv, the path the interpreter wrapper of dsa_python_env looks at when no venv lies
beside it (ROOT: the image's DSA_ENV_IMAGE_ROOT, else /opt/rules_dsa/python-envs). Without --store it installs
there (a Dockerfile's RUN step); with --store it links there the store's venv, installing that first if needed
(the loopback test worker of tests/remote_exec). Prints the venv's path.

With --store, the venv's path is printed on the last line. An entry is used only once complete (a marker
written after pip succeeded); a half-made one (an interrupted install) is removed and made again. Concurrent callers (two
output bases set up at once) wait for each other on a file lock. Entries are never modified once complete,
so deleting the store (or an entry: `<store>/<key>`) is always safe between builds; the next build installs
again. Standard library only: it runs before anything is installed.
"""

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys

FORMAT = 1
COMPLETE = "complete.json"


def entry_key(lock_bytes: bytes, python: str, python_version: str, pip_args: list) -> str:
    """What the venv is made of, as a digest: the lock's bytes, the interpreter (resolved path and version),
    pip's extra arguments and this store's format."""
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT, "python": python, "python_version": python_version,
                         "pip_args": pip_args}, sort_keys=True).encode())
    h.update(b"\0")
    h.update(lock_bytes)
    return h.hexdigest()[:32]


def install(venv: str, lock: str, pip_args: list) -> int:
    """A venv at `venv`, made from this interpreter, with the lock pip-installed (every file hash-checked, no
    dependency resolution); pip's output goes to stderr. Returns pip's exit status."""
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    env = dict(os.environ, PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run(
        [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--no-input", "--require-hashes", "--no-deps",
         "--only-binary=:all:", "-r", lock, *pip_args], env=env, stdout=sys.stderr).returncode


class InstallFailed(Exception):
    def __init__(self, status: int):
        super().__init__(f"pip exited with status {status}")
        self.status = status


def ensure(store: str, lock: str, pip_args: list) -> str:
    """The store's venv for this lock, interpreter and pip arguments, installed first if it is not there."""
    with open(lock, "rb") as f:
        lock_bytes = f.read()
    real_python = os.path.realpath(sys.executable)
    version = ".".join(map(str, sys.version_info[:3]))
    key = entry_key(lock_bytes, real_python, version, pip_args)
    os.makedirs(store, exist_ok=True)
    entry = os.path.join(store, key)
    venv = os.path.join(entry, "venv")
    with open(os.path.join(store, key + ".lock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if os.path.isfile(os.path.join(entry, COMPLETE)) and os.path.exists(os.path.join(venv, "bin", "python3")):
            print(f"envstore: using {entry}", file=sys.stderr)
            return venv
        if os.path.lexists(entry):  # an install that did not finish
            shutil.rmtree(entry, ignore_errors=True)
        os.makedirs(entry)
        status = install(venv, lock, pip_args)
        if status != 0:
            shutil.rmtree(entry, ignore_errors=True)
            raise InstallFailed(status)
        with open(os.path.join(entry, COMPLETE), "w") as f:
            json.dump({"format": FORMAT, "lock_sha256": hashlib.sha256(lock_bytes).hexdigest(),
                       "python": real_python, "python_version": version, "pip_args": pip_args}, f, indent=2)
            f.write("\n")
        return venv


def image_entry(root: str, lock: str, pip_args: list, store: str = None) -> str:
    """ROOT/<lock sha256>/venv for a worker image: installed there, or linked to the store's venv."""
    with open(lock, "rb") as f:
        lock_sha = hashlib.sha256(f.read()).hexdigest()
    entry = os.path.join(root, lock_sha)
    venv = os.path.join(entry, "venv")
    if os.path.exists(os.path.join(venv, "bin", "python3")):
        return venv
    if os.path.lexists(venv):
        shutil.rmtree(venv, ignore_errors=True) if not os.path.islink(venv) else os.unlink(venv)
    os.makedirs(entry, exist_ok=True)
    if store:
        os.symlink(ensure(store, lock, pip_args), venv)
    else:
        status = install(venv, lock, pip_args)
        if status != 0:
            shutil.rmtree(entry, ignore_errors=True)
            raise InstallFailed(status)
    return venv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", help="the machine's store: print the venv of this lock, installed once")
    parser.add_argument("--into", help="install a venv at this path, outside any store (DSA_ENV_STORE=off)")
    parser.add_argument("--image-root", help="a worker image's environments: ROOT/<lock sha256>/venv")
    parser.add_argument("--lock", required=True)
    parser.add_argument("--pip-arg", action="append", default=[])
    a = parser.parse_args()
    lock = os.path.abspath(a.lock)
    if bool(a.into) + bool(a.store or a.image_root) != 1 or (a.into and a.image_root):
        parser.error("give one of --store, --into, --image-root (--image-root may take --store)")
    if a.image_root:
        try:
            print(image_entry(os.path.abspath(a.image_root), lock, a.pip_arg,
                              os.path.abspath(a.store) if a.store else None))
        except InstallFailed as e:
            sys.exit(e.status)
        return
    if a.into:
        sys.exit(install(os.path.abspath(a.into), lock, a.pip_arg))
    try:
        print(ensure(os.path.abspath(a.store), lock, a.pip_arg))
    except InstallFailed as e:
        sys.exit(e.status)


if __name__ == "__main__":
    main()
