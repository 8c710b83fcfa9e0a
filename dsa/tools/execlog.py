"""Reading Bazel's `--execution_log_json_file`: which actions ran and which came from a cache.

    dsa execlog LOG          # prints, per mnemonic, how many spawns ran and how many were hits

The log is a sequence of concatenated JSON objects (not a JSON list), one per spawn, each with its
"mnemonic" and "remoteCacheHit". Standard library only: scripts outside Bazel use it too.
"""

import collections
import json
import sys
from pathlib import Path
from typing import Counter, List


def read_execution_log(path: Path) -> List[dict]:
    """The spawns of an execution log; [] when the file does not exist (nothing ran)."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    entries, pos = [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return entries
        entry, pos = decoder.raw_decode(text, pos)
        entries.append(entry)


def executed_mnemonics(entries: List[dict]) -> Counter[str]:
    """Mnemonic → number of spawns that actually ran (not served from a cache)."""
    return collections.Counter(
        e.get("mnemonic", "?") for e in entries if not (e.get("cacheHit") or e.get("remoteCacheHit"))
    )


if __name__ == "__main__":
    spawns = read_execution_log(Path(sys.argv[1]))
    ran = executed_mnemonics(spawns)
    hits = collections.Counter(e.get("mnemonic", "?") for e in spawns if e.get("remoteCacheHit"))
    for mnemonic in sorted(set(ran) | set(hits)):
        print(f"{mnemonic}: {ran[mnemonic]} ran, {hits[mnemonic]} cache hits")
