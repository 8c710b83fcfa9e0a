#!/usr/bin/env bash
# Regenerates requirements_lock.txt from requirements.in: resolves the full
# transitive set in a scratch venv, downloads each pinned wheel and records its
# sha256, in the format `pip install --require-hashes` reads.
#
# The lock targets CPython 3.11 on linux x86_64: run this with such an
# interpreter (python3.11 on PATH, or DSA_PYTHON=/path/to/python3.11).
# Uses the machine's pip configuration (index, find-links) as is; torch's
# +cpu build must be reachable through it (e.g.
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
#
# Usage: toolchains/python/update_lock.sh   (from anywhere in the repo)
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
python="${DSA_PYTHON:-python3.11}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

echo "resolving $root/requirements.in with $python" >&2
"$python" -m venv "$scratch/venv"
"$scratch/venv/bin/python" -m pip install --quiet --only-binary=:all: -r "$root/requirements.in"
"$scratch/venv/bin/python" -m pip freeze > "$scratch/pins.txt"

echo "downloading $(wc -l < "$scratch/pins.txt") wheels to hash them" >&2
"$scratch/venv/bin/python" -m pip download --quiet --no-deps --only-binary=:all: \
    -d "$scratch/wheels" -r "$scratch/pins.txt"

"$scratch/venv/bin/python" - "$scratch/pins.txt" "$scratch/wheels" "$root/requirements_lock.txt" <<'PY'
import hashlib, pathlib, re, sys

pins_file, wheel_dir, lock_file = sys.argv[1:]

def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()

hashes = {}
for wheel in pathlib.Path(wheel_dir).glob("*.whl"):
    name, version = wheel.name.split("-")[:2]
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    hashes[(canon(name), version)] = digest

lines = [
    "# Full, hashed pin set of rules_dsa's Python environment: CPython 3.11, linux x86_64.",
    "# Generated from requirements.in by toolchains/python/update_lock.sh -- do not edit;",
    "# edit requirements.in and rerun that script.",
    "# torch's +cpu build is on https://download.pytorch.org/whl/cpu, not PyPI.",
    "",
]
pins = sorted(
    (line.split("==") for line in pathlib.Path(pins_file).read_text().split() if "==" in line),
    key=lambda p: canon(p[0]),
)
for name, version in pins:
    digest = hashes[(canon(name), version)]
    lines.append(f"{canon(name)}=={version} \\\n    --hash=sha256:{digest}")
pathlib.Path(lock_file).write_text("\n".join(lines) + "\n")
print(f"wrote {lock_file}: {len(pins)} pins", file=sys.stderr)
PY
