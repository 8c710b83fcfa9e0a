"""The one error type every stage raises for bad input, and the CLI wrapper that reports it.

A `DsaError` names the file, the field / op / tensor at fault, what was expected and what to do. CLIs print
it as one message on stderr and exit 2, without a Python traceback.
"""

from __future__ import annotations

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


def run_cli(main: Callable[[], None], tool: str) -> None:
    """Runs `main`, turning a DsaError (or a ManifestError) into `error: ...` on stderr and exit code 2."""
    try:
        main()
    except DsaError as e:
        print(f"{tool}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # ManifestError lives in dsa.manifest.contract; avoid importing it here.
        if type(e).__name__ == "ManifestError":
            print(f"{tool}: error: {e}", file=sys.stderr)
            sys.exit(2)
        raise
