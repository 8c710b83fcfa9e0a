#!/usr/bin/env python3
"""Asserts, from Bazel's `--execution_log_json_file`, that a build's Dsa* actions executed remotely.

    check_remote.py --exec-log LOG.json [--label NAME]     # every Dsa spawn ran on the remote executor
    check_remote.py --exec-log LOG.json --counts           # prints "<remote> <Dsa spawns>", asserts nothing

Every spawn whose mnemonic starts with "Dsa" (DsaManifest, DsaExport, DsaParams, DsaCompile, ...) must have
run on the remote executor: `"runner": "remote"` and not a cache hit (a hit proves nothing about execution),
and there must be at least one. The others (Bazel's own: symlink trees, file writes) are counted but may run
where Bazel likes. Exits 1 naming each Dsa spawn that ran elsewhere and the runner it ran on ("linux-sandbox",
"local", "remote cache hit").

Standard library only (the log is read by dsa.tools.execlog, itself standard library only).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for dsa.tools.execlog
from dsa.tools.execlog import read_execution_log  # noqa: E402  (standard library only)


def classify(spawns: list) -> tuple:
    """(remote Dsa spawns, other Dsa spawns, runners of all spawns)."""
    remote, elsewhere = [], []
    runners = collections.Counter(s.get("runner", "?") for s in spawns)
    for s in spawns:
        if not s.get("mnemonic", "").startswith("Dsa"):
            continue
        if s.get("runner") == "remote" and not s.get("remoteCacheHit"):
            remote.append(s)
        else:
            elsewhere.append(s)
    return remote, elsewhere, runners


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exec-log", required=True, type=Path)
    parser.add_argument("--label", default="build")
    parser.add_argument("--counts", action="store_true")
    a = parser.parse_args()
    spawns = list(read_execution_log(a.exec_log))
    remote, elsewhere, runners = classify(spawns)
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
