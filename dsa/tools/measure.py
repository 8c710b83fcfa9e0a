"""Peak RSS and wall time of a child process, as the kernel counts them (wait4's rusage).

Used by the import matrix (iree-compile re-runs) and by `dsa compile` (each stage in a process of its own).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Mapping, Optional, Sequence

from dsa.core.errors import DsaError

# The measured child is started by this small launcher, not by this process: Linux carries a process's
# peak-RSS record across execve, and a child forked (or vforked) from a large parent starts with the parent's
# resident set as its high-water mark, so ru_maxrss would report at least this process's own size. The launcher
# (a bare interpreter, ~10 MB) forks and execs the command and reports its wait4 rusage.
_WAIT4_LAUNCHER = r"""
import json, os, sys, time
cmd = json.loads(sys.argv[1])
start = time.monotonic()
pid = os.fork()
if pid == 0:
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.execvp(cmd[0], cmd)
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
wall = time.monotonic() - start
print(json.dumps({"returncode": os.waitstatus_to_exitcode(status), "wall_s": wall,
                  "peak_rss_kib": usage.ru_maxrss}))
"""


def run_measured(cmd: Sequence[str], env: Optional[Mapping[str, str]] = None) -> dict:
    """Runs `cmd` (with environment `env`, default this process's) as a child process reaped with os.wait4:
    {"returncode" (negative: killed by that signal), "wall_s", "peak_rss_kib" (its rusage ru_maxrss, KiB on
    Linux: the largest of the child and of the processes it waited for), "stderr"}. Its stdout is discarded.
    Raises nothing for a failing command."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.run([sys.executable, "-S", "-c", _WAIT4_LAUNCHER, json.dumps(list(cmd))],
                              stdout=subprocess.PIPE, stderr=err, env=None if env is None else dict(env))
        err.seek(0)
        stderr = err.read().decode("utf-8", "replace")
    try:
        result = json.loads(proc.stdout.decode("utf-8").strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise DsaError("measure", f"the measuring launcher failed (exit {proc.returncode})",
                       stderr.strip()[-300:] or "no message") from None
    result["peak_rss_kib"] = int(result["peak_rss_kib"])
    result["stderr"] = stderr
    return result
