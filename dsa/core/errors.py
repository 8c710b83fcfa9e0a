"""The one error type every stage raises for bad input, and the CLI wrapper that reports it.

A `DsaError` names the file, the field / op / tensor at fault, what was expected and what to do. CLIs print
it as one message on stderr and exit 2, without a Python traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional


class DsaError(Exception):
    def __init__(self, where: str, message: str, hint: Optional[str] = None):
        self.where = where
        self.message = message
        self.hint = hint
        super().__init__(str(self))

    def __str__(self) -> str:
        # One line, in the form ManifestError uses: where: what (what to do).
        text = f"{self.where}: {self.message}"
        return f"{text} ({self.hint})" if self.hint else text


def missing_package(e: ModuleNotFoundError) -> Optional[str]:
    """What to say when a command's Python lacks a package it needs (not a module of dsa itself), or None."""
    if e.name is None or e.name.split(".")[0] == "dsa":
        return None
    return (f"needs the Python package '{e.name}', which {sys.executable} lacks (run it in the environment "
            "installed from requirements_lock.txt (requirements_lerobot_lock.txt for LeRobot manifests and `dsa "
            "lerobot`): DSA_PYTHON=ENV/bin/python3 bin/dsa ..., or `./bazelw run //:dsa -- ...`)")


def one_line(e: BaseException, limit: int = 200) -> str:
    """`Kind: first line of the message` (at most `limit` characters of it): how a failure that is reported
    rather than raised (a baseline that does not export, a candidate that does not run) is written into a
    tool's results."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:limit] if text else ''}"


def describe_unexpected(e: BaseException) -> str:
    """One line for an error no check named: what kind it is, and what to do."""
    missing = missing_package(e) if isinstance(e, ModuleNotFoundError) else None
    if missing:
        return missing
    if isinstance(e, MemoryError):
        return "out of memory: an input states a size larger than this machine can hold (check the sizes " \
               "the manifest, bundle or files give)"
    if isinstance(e, RecursionError):
        return "an input is nested too deeply to read (a JSON or YAML file of thousands of levels?)"
    if isinstance(e, UnicodeError):
        return f"a file or argument is not valid UTF-8 text ({str(e)[:200]})"
    if isinstance(e, OSError):
        name = f" {e.filename}" if getattr(e, "filename", None) else ""
        return f"cannot read or write{name}: {e.strerror or e}"
    text = str(e).splitlines()[0][:300] if str(e) else ""
    return (f"unexpected {type(e).__name__}: {text} (a bug, or an input no check names: rerun with "
            "DSA_TRACEBACK=1 for the traceback and report it)")


def run_cli(main: Callable[[], None], tool: str) -> None:
    """Runs `main`: a DsaError (or a ManifestError) becomes `error: ...` on stderr and exit code 2; so does any
    other exception, as one line naming its kind (MemoryError, RecursionError, an undecodable file, an OS
    error, anything a check missed), never a traceback; Ctrl-C exits 130. `DSA_TRACEBACK=1` re-raises the
    unexpected ones, for a developer."""
    try:
        main()
    except DsaError as e:
        print(f"{tool}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{tool}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # ManifestError lives in dsa.manifest.contract; avoid importing it here.
        if type(e).__name__ == "ManifestError":
            print(f"{tool}: error: {e}", file=sys.stderr)
            sys.exit(2)
        if os.environ.get("DSA_TRACEBACK") == "1":
            raise
        try:
            line = describe_unexpected(e)
        except Exception:  # noqa: BLE001 - the message itself must not fail
            line = f"unexpected {type(e).__name__}"
        print(f"{tool}: error: {line}", file=sys.stderr)
        sys.exit(2)
