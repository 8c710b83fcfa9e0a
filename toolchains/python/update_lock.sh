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
# Usage: toolchains/python/update_lock.sh [IN LOCK]   (from anywhere in the repo)
#   default: requirements.in -> requirements_lock.txt
#   toolchains/python/update_lock.sh requirements_lerobot.in requirements_lerobot_lock.txt
# An .in file with a line `# resolve: none` is already the full pin set: it is installed with --no-deps
# (LeRobot's metadata asks for packages its policies never import, one of them without a wheel).
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
python="${DSA_PYTHON:-python3.11}"
in_file="$root/${1:-requirements.in}"
lock_file="$root/${2:-requirements_lock.txt}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

echo "resolving $in_file with $python" >&2
"$python" -m venv "$scratch/venv"
resolve=()
if grep -q '^# resolve: none' "$in_file"; then resolve=(--no-deps); fi
"$scratch/venv/bin/python" -m pip install --quiet --only-binary=:all: "${resolve[@]}" -r "$in_file"
"$scratch/venv/bin/python" -m pip freeze > "$scratch/pins.txt"

echo "downloading $(wc -l < "$scratch/pins.txt") wheels to hash them" >&2
"$scratch/venv/bin/python" -m pip download --quiet --no-deps --only-binary=:all: \
    -d "$scratch/wheels" -r "$scratch/pins.txt"

"$scratch/venv/bin/python" - "$scratch/pins.txt" "$scratch/wheels" "$lock_file" "$(basename "$in_file")" <<'PY'
import hashlib, pathlib, re, sys

pins_file, wheel_dir, lock_file, in_name = sys.argv[1:]

def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()

hashes = {}
for wheel in pathlib.Path(wheel_dir).glob("*.whl"):
    name, version = wheel.name.split("-")[:2]
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    hashes[(canon(name), version)] = digest

lines = [
    "# Full, hashed pin set of a rules_dsa Python environment: CPython 3.11, linux x86_64.",
    f"# Generated from {in_name} by toolchains/python/update_lock.sh -- do not edit;",
    f"# edit {in_name} and rerun that script.",
]
pins = sorted(
    (line.split("==") for line in pathlib.Path(pins_file).read_text().split() if "==" in line),
    key=lambda p: canon(p[0]),
)
if any("+cpu" in version for _, version in pins):
    lines.append("# torch's +cpu build is on https://download.pytorch.org/whl/cpu, not PyPI.")
lines.append("")
for name, version in pins:
    digest = hashes[(canon(name), version)]
    lines.append(f"{canon(name)}=={version} \\\n    --hash=sha256:{digest}")
pathlib.Path(lock_file).write_text("\n".join(lines) + "\n")
print(f"wrote {lock_file}: {len(pins)} pins", file=sys.stderr)
PY
