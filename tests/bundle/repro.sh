#!/usr/bin/env bash
# Reproducible release bundles: two checkouts of this repository at different paths, each built with a
# Bazel output base of its own (so its own Python environment, execroot and action cache), must give
# //models:pi0_bundle the same sha256. Prints both digests; exits 1, with `dsa diff` of the two bundles,
# when they differ. Everything it makes (clones, output bases, Bazel servers) is removed at exit.
#
#   tests/bundle/repro.sh            # from the repository root; .ci/run calls it
#
# The first checkout is this one, built in its own output base (after `bazel test //...` in CI: the bundle
# is then already there); the second a fresh clone of HEAD elsewhere with a fresh output base. With
# uncommitted changes to tracked files, this checkout is not HEAD, so both are fresh clones of HEAD.
# A fresh output base creates the Python environment (~3 min) and builds π0 (~1 min).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
target=//models:pi0_bundle
work=$(mktemp -d "${TMPDIR:-/tmp}/dsa-bundle-repro.XXXXXX")
# Different checkout paths (and directory names), different output bases.
checkouts=("$work/first/rules_dsa" "$work/second/elsewhere/checkout")
bases=("$work/first/output_base" "$work/second/ob")
if [ -z "$(git status --porcelain --untracked-files=no)" ]; then
    checkouts[0]=$repo
    bases[0]=$(./bazelw info output_base 2>/dev/null)
fi
first_is_repo() { [ "${checkouts[0]}" = "$repo" ]; }

cleanup() {
    local i
    for i in 0 1; do
        if [ "$i" = 0 ] && first_is_repo; then
            continue  # this checkout's own output base stays
        fi
        if [ -x "${checkouts[$i]}/bazelw" ] && [ -d "${bases[$i]}" ]; then
            (cd "${checkouts[$i]}" &&
                ./bazelw --output_base="${bases[$i]}" clean --expunge >/dev/null 2>&1 || true
                ./bazelw --output_base="${bases[$i]}" shutdown >/dev/null 2>&1 || true)
        fi
    done
    chmod -R u+w "$work" 2>/dev/null || true  # Bazel leaves read-only outputs behind
    rm -rf "$work"
}
trap cleanup EXIT

digests=()
for i in 0 1; do
    checkout=${checkouts[$i]}
    if ! { [ "$i" = 0 ] && first_is_repo; }; then
        mkdir -p "$(dirname "$checkout")"
        git clone --quiet "$repo" "$checkout"
    fi
    echo "repro: building $target in $checkout (output base ${bases[$i]})"
    start=$(date +%s)
    (cd "$checkout" && ./bazelw --output_base="${bases[$i]}" build "$target")
    echo "repro: built in $(($(date +%s) - start)) s"
    digests+=("$(cat "$checkout/bazel-bin/models/pi0_bundle.sha256")")
    # Keep the bundle (for `dsa diff`), then free this output base before the next one is made: one
    # Python environment and build tree on disk at a time.
    cp "$checkout/bazel-bin/models/pi0_bundle.tar" "$work/bundle$i.tar"
    if [ "$i" = 0 ] && ! first_is_repo; then
        (cd "$checkout" && ./bazelw --output_base="${bases[$i]}" clean --expunge >/dev/null 2>&1 || true)
    fi
done

echo "repro: ${checkouts[0]}: ${digests[0]}"
echo "repro: ${checkouts[1]}: ${digests[1]}"
if [ "${digests[0]}" != "${digests[1]}" ]; then
    echo "repro: FAILED: the two checkouts built different bundles; what differs:" >&2
    (cd "${checkouts[1]}" &&
        "${bases[1]}/external/dsa_python/bin/python3" -m dsa.tools.diff "$work/bundle0.tar" "$work/bundle1.tar" >&2 ||
        true)
    exit 1
fi
echo "repro: OK: the bundle is byte-identical ($(stat -c %s "$work/bundle0.tar") bytes)"
