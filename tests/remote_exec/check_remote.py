#!/usr/bin/env python3
"""Asserts, from Bazel's `--execution_log_json_file`, that a build's Dsa* actions executed remotely.

    check_remote.py --exec-log LOG.json [--label NAME]     # every Dsa spawn ran on the remote executor
    check_remote.py --exec-log LOG.json --counts           # prints "<remote> <Dsa spawns>", asserts nothing
    check_remote.py --exec-log LOG.json --finished-by WORKER.log   # ... or was finished by that (killed) worker

Every spawn whose mnemonic starts with "Dsa" (DsaManifest, DsaExport, DsaParams, DsaCompile, ...) must have
run on the remote executor: `"runner": "remote"` and not a cache hit (a hit proves nothing about execution),
and there must be at least one. The others (Bazel's own: symlink trees, file writes) are counted but may run
where Bazel likes. Exits 1 naming each Dsa spawn that ran elsewhere and the runner it ran on ("linux-sandbox",
"local", "remote cache hit").

`--finished-by` names the log of a worker that was killed mid-build: an action it finished (a `done ... exit=0`
line naming the action's output as `hint=`) had its result stored before the kill, and when Bazel's request is
retried the engine answers it from the cache. Such a hit did execute remotely, and is counted so.

Standard library only (the log is read by dsa.tools.execlog, itself standard library only).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for dsa.tools.execlog
from dsa.tools.execlog import read_execution_log  # noqa: E402  (standard library only)


def finished_outputs(worker_log: Path) -> set:
    """The outputs (`hint=`) of the actions a worker's log says it finished with exit 0."""
    out = set()
    for line in worker_log.read_text().splitlines():
        words = line.split()
        if words[:1] == ["done"] and "exit=0" in words:
            out.update(w[len("hint="):] for w in words if w.startswith("hint="))
    return out


def classify(spawns: list, finished: frozenset = frozenset()) -> tuple:
    """(remote Dsa spawns, other Dsa spawns, runners of all spawns). A remote-cache hit whose first listed
    output a killed worker finished counts as remote (see --finished-by)."""
    remote, elsewhere = [], []
    runners = collections.Counter(s.get("runner", "?") for s in spawns)
    for s in spawns:
        if not s.get("mnemonic", "").startswith("Dsa"):
            continue
        outs = sorted(s.get("listedOutputs", []))
        if s.get("runner") == "remote" and not s.get("remoteCacheHit"):
            remote.append(s)
        elif s.get("remoteCacheHit") and outs and outs[0] in finished:
            remote.append(s)
        else:
            elsewhere.append(s)
    return remote, elsewhere, runners


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exec-log", required=True, type=Path)
    parser.add_argument("--label", default="build")
    parser.add_argument("--counts", action="store_true")
    parser.add_argument("--finished-by", type=Path, help="the log of a worker killed mid-build")
    a = parser.parse_args()
    spawns = list(read_execution_log(a.exec_log))
    finished = frozenset(finished_outputs(a.finished_by)) if a.finished_by else frozenset()
    remote, elsewhere, runners = classify(spawns, finished)
    if a.counts:
        print(len(remote), len(remote) + len(elsewhere))
        return 0
    mnemonics = collections.Counter(s["mnemonic"] for s in remote)
    if not remote and not elsewhere:
        print(f"{a.label}: no Dsa action ran at all ({dict(runners)}): nothing was executed, remotely or not")
        return 1
    if elsewhere:
        print(f"{a.label}: {len(elsewhere)} of {len(remote) + len(elsewhere)} Dsa actions did not execute remotely:")
        for s in elsewhere[:20]:
            outs = sorted(s.get("listedOutputs", []))
            print(f"  {s.get('mnemonic')} {outs[0].split('/bin/', 1)[-1] if outs else '?'}: "
                  f"runner {s.get('runner', '?')!r}{', remote cache hit' if s.get('remoteCacheHit') else ''}")
        return 1
    print(f"{a.label}: all {len(remote)} Dsa actions executed remotely "
          f"({', '.join(f'{m} {n}' for m, n in sorted(mnemonics.items()))}); runners of all spawns: {dict(runners)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
