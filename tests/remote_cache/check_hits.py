#!/usr/bin/env python3
"""Asserts, from Bazel's `--execution_log_json_file`, that a build's Dsa* actions came from the remote cache.

    check_hits.py --exec-log CACHED.json [--reference COLD.json] [--build-log LOG ...] [--label NAME]
    check_hits.py --exec-log LOG.json --expect none     # the cache served nothing (it was down)
    check_hits.py --exec-log LOG.json --counts          # prints "<hits> <Dsa spawns>" and asserts nothing

`--expect all` (the default): every spawn whose mnemonic starts with "Dsa" (DsaManifest, DsaExport,
DsaParams, DsaCompile, DsaCheckpoint, DsaBundle, DsaLock, ...) has "remoteCacheHit": true, and there is at
least one. With `--reference` (the log of the build that filled the cache), each of its Dsa actions must
be in this log too, as a hit: an action missing from the log did not run at all (its outputs were already
on disk), which proves nothing about the cache.

When hits are missing it exits 1 and says why it can tell: a missed action whose command line, environment
or inputs differ from the reference's has a different action key (a key that is not portable between
checkouts or machines); one with the same key was not served by the cache, and the remote-cache warnings in
the `--build-log` files (the populating and the checked build's console output) name the cause, e.g. an
HTTP 413 when the server rejects large uploads.

The log is a stream of concatenated JSON objects (Bazel 4.2.3), one per spawn, not a JSON list.
Standard library only: it runs with any Python 3.8+.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for dsa.tools.execlog
from dsa.tools.execlog import read_execution_log  # noqa: E402  (standard library only)

PREFIX = "Dsa"


def is_dsa(spawn: dict) -> bool:
    return spawn.get("mnemonic", "").startswith(PREFIX)


def key_of(spawn: dict) -> Tuple[str, ...]:
    """Identifies an action across checkouts: its declared outputs (execroot-relative paths)."""
    return tuple(sorted(spawn.get("listedOutputs", []))) or (spawn.get("progressMessage", "?"),)


def describe(spawn: dict) -> str:
    outputs = sorted(spawn.get("listedOutputs", []), key=lambda o: (o.endswith(".json"), o))
    first = outputs[0].split("/bin/", 1)[-1] if outputs else "?"
    return "{} {} ({})".format(spawn.get("mnemonic", "?"), first, spawn.get("runner", "?"))


def _digests(spawn: dict) -> Dict[str, str]:
    return {i["path"]: i.get("digest", {}).get("hash", "") for i in spawn.get("inputs", [])}


def key_differences(cached: dict, reference: dict) -> List[str]:
    """What differs between two spawns' action keys (command line, environment, platform, inputs)."""
    out = []
    if cached.get("commandArgs") != reference.get("commandArgs"):
        a, b = cached.get("commandArgs", []), reference.get("commandArgs", [])
        diff = [f"{y!r} -> {x!r}" for x, y in zip(a, b) if x != y] or [f"{len(b)} -> {len(a)} arguments"]
        out.append("command line: " + "; ".join(diff[:3]))
    env_a = {e["name"]: e["value"] for e in cached.get("environmentVariables", [])}
    env_b = {e["name"]: e["value"] for e in reference.get("environmentVariables", [])}
    for name in sorted(set(env_a) | set(env_b)):
        if env_a.get(name) != env_b.get(name):
            out.append(f"environment {name}: {env_b.get(name)!r} -> {env_a.get(name)!r}")
    if cached.get("platform") != reference.get("platform"):
        out.append("execution platform properties")
    dig_a, dig_b = _digests(cached), _digests(reference)
    for path in sorted(set(dig_a) | set(dig_b)):
        if dig_a.get(path) != dig_b.get(path):
            if path not in dig_a:
                out.append(f"input {path} only in the populating build")
            elif path not in dig_b:
                out.append(f"input {path} only in this build")
            else:
                out.append(f"input {path} content differs")
    return out


# Remote-cache trouble as Bazel 4.2.3 prints it, and what it means.
HINTS = [
    (re.compile(r"\b413 Request Entity Too Large"),
     "HTTP 413 Request Entity Too Large: the server rejects uploads over its body-size limit, so the larger "
     "outputs (MLIR, vmfb, .irpa) were never stored (nginx: `client_max_body_size 0;`)"),
    (re.compile(r"\b405 Not Allowed|\b405 Method Not Allowed"),
     "HTTP 405: the server does not accept PUT (nginx: `dav_methods PUT;`)"),
    (re.compile(r"\b(401 Unauthorized|403 Forbidden)"),
     "HTTP 401/403: the server refused the client (credentials: --remote_header=..., or a read-only cache)"),
    (re.compile(r"\b(409 Conflict|404 Not Found).*PUT|PUT.*\b(409 Conflict|404 Not Found)"),
     "HTTP 404/409 on upload: the server cannot create the entry's directory (nginx: `create_full_put_path on;`)"),
    (re.compile(r"\b5\d\d [A-Z][A-Za-z ]+"),
     "HTTP 5xx: the server failed while storing or serving entries (see its error log)"),
    (re.compile(r"does not match received digest|OutputDigestMismatchException"),
     "a cache entry's content did not match its digest (a corrupt blob): Bazel refused it and ran the "
     "action locally"),
    (re.compile(r"RESOURCE_EXHAUSTED"),
     "gRPC RESOURCE_EXHAUSTED: the server refused the message size or is out of space/quota"),
    (re.compile(r"PERMISSION_DENIED|UNAUTHENTICATED"),
     "gRPC PERMISSION_DENIED/UNAUTHENTICATED: credentials, or a cache that does not allow updates"),
    (re.compile(r"UNAVAILABLE|Connection refused|Failed to query remote execution capabilities"),
     "the cache server was unreachable (down, wrong address or port)"),
    (re.compile(r"DEADLINE_EXCEEDED|timed out|Timeout", re.IGNORECASE),
     "requests to the cache timed out (--remote_timeout)"),
]


def remote_warnings(logs: Iterable[Path]) -> List[Tuple[str, str]]:
    """(log name, warning text) for each "WARNING: Writing to/Reading from Remote Cache" block and failed
    capabilities query in the given console logs."""
    found = []
    for log in logs:
        if not log.exists():
            continue
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            if re.search(r"(WARNING|ERROR): (Writing to|Reading from) Remote Cache|remote execution capabilities",
                         line):
                block = [line]
                i += 1
                # The exception's text follows, up to the next progress or INFO/WARNING line.
                while i < len(lines) and not re.match(r"(INFO|WARNING|ERROR):|\[\d|Target |Loading|Analyzing",
                                                      lines[i]):
                    block.append(lines[i])
                    i += 1
                found.append((log.name, "\n".join(block)))
            else:
                i += 1
    return found


def explain_warnings(warnings: List[Tuple[str, str]]) -> List[str]:
    counts = collections.Counter()
    where: Dict[str, set] = collections.defaultdict(set)
    unmatched = []
    for log_name, text in warnings:
        for pattern, hint in HINTS:
            if pattern.search(text):
                counts[hint] += 1
                where[hint].add(log_name)
                break
        else:
            unmatched.append(text.splitlines()[0] + " " + " ".join(text.splitlines()[1:2]))
    out = [f"{hint} [{n} warning(s) in {', '.join(sorted(where[hint]))}]" for hint, n in counts.most_common()]
    out += [f"unclassified: {u}" for u in unmatched[:3]]
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exec-log", type=Path, required=True, help="--execution_log_json_file of the checked build")
    ap.add_argument("--reference", type=Path, help="execution log of the build that filled the cache")
    ap.add_argument("--build-log", type=Path, action="append", default=[],
                    help="console output of the populating and/or checked build (repeatable)")
    ap.add_argument("--label", default="", help="a name for the messages")
    ap.add_argument("--expect", choices=["all", "none"], default="all",
                    help="all: every Dsa action a remote-cache hit; none: no spawn a hit")
    ap.add_argument("--counts", action="store_true", help='print "<hits> <Dsa spawns>" and exit 0')
    args = ap.parse_args(argv)
    label = f"{args.label}: " if args.label else ""

    if not args.exec_log.exists():
        print(f"check_hits: {label}FAILED: no execution log at {args.exec_log} (did the build run?)")
        return 1
    spawns = read_execution_log(args.exec_log)
    dsa = [s for s in spawns if is_dsa(s)]
    hits = [s for s in dsa if s.get("remoteCacheHit")]
    if args.counts:
        print(len(hits), len(dsa))
        return 0
    by_mnemonic = collections.Counter(s["mnemonic"] for s in hits)
    breakdown = ", ".join(f"{m} {n}" for m, n in sorted(by_mnemonic.items()))

    if args.expect == "none":
        any_hits = [s for s in spawns if s.get("remoteCacheHit")]
        if any_hits:
            print(f"check_hits: {label}FAILED: expected no remote-cache hits, got {len(any_hits)}: "
                  + "; ".join(describe(s) for s in any_hits[:5]))
            return 1
        if not dsa:
            print(f"check_hits: {label}FAILED: no Dsa action ran at all (outputs already on disk? run `bazel clean`)")
            return 1
        print(f"check_hits: {label}OK: 0 remote-cache hits; {len(dsa)} Dsa actions ran locally")
        return 0

    problems: List[str] = []
    reference: Dict[Tuple[str, ...], dict] = {}
    if args.reference:
        reference = {key_of(s): s for s in read_execution_log(args.reference) if is_dsa(s)}
        if not reference:
            problems.append(f"the reference log {args.reference} has no Dsa actions")
        present = {key_of(s) for s in dsa}
        not_run = [s for k, s in reference.items() if k not in present]
        if not_run:
            problems.append(
                f"{len(not_run)} Dsa action(s) of the populating build did not run here at all (outputs already "
                "on disk, so the cache was never asked; build from a clean output tree): "
                + "; ".join(describe(s) for s in not_run[:5]))
    if not dsa:
        problems.append("the build ran no Dsa action (outputs already on disk? run `bazel clean` first)")

    misses = [s for s in dsa if not s.get("remoteCacheHit")]
    causes: List[str] = []
    if misses:
        lines = [f"{len(misses)} of {len(dsa)} Dsa actions were not remote-cache hits:"]
        same_key = other_key = 0
        for s in misses:
            ref = reference.get(key_of(s))
            diffs = key_differences(s, ref) if ref is not None else []
            if diffs:
                other_key += 1
                lines.append(f"  {describe(s)}: its action key differs from the populating build's: "
                             + "; ".join(diffs[:4]))
            else:
                same_key += ref is not None
                lines.append(f"  {describe(s)}")
        problems.append("\n".join(lines))
        if other_key:
            causes.append(f"{other_key} missed action(s) have another action key than in the populating build: "
                          "their command line, environment or inputs depend on the checkout or machine (see above)")
        if other_key < len(misses):
            if same_key:
                causes.append(f"{same_key} missed action(s) have the same key as in the populating build, so the "
                              "cache did not have (or did not return) their entries")
            explained = explain_warnings(remote_warnings(args.build_log))
            if explained:
                causes += explained
            elif args.build_log:
                causes.append("no remote-cache warning in the build logs: was the server restarted in between "
                              "(BuildGrid's action cache lives in memory), or were the builds pointed at "
                              "different caches?")
            else:
                causes.append("pass --build-log with the populating build's console output to see upload errors")

    if problems:
        print(f"check_hits: {label}FAILED: {len(hits)} of {len(dsa)} Dsa actions were remote-cache hits")
        for p in problems:
            print("  " + p.replace("\n", "\n  "))
        for c in causes:
            print("  cause: " + c)
        return 1
    print(f"check_hits: {label}OK: {len(hits)} of {len(dsa)} Dsa actions were remote-cache hits ({breakdown})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
