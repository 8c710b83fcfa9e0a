#!/usr/bin/env bash
# Reproducible release bundles: two checkouts of this repository at different paths, each built with a
# Bazel output base of its own (so its own execroot and action cache), must give the
# same sha256s for //models:pi0_bundle and a multi-target bundle of π0: //models:pi0_fleet_bundle (Orin's GPU
# and CPU, AVX-512 and AVX2 x86: the targets CI also tests) by default, //models:pi0_all_targets_bundle
# (every target of the rule set: x86, aarch64, riscv64, CUDA, Vulkan, ROCm; ~40 compiles, ~7 more minutes)
# with --all-targets. Prints the digests; exits 1, with `dsa diff` of the bundles (per target for the
# multi-target one), when they differ. Everything it makes (clones, output bases, Bazel servers) is removed
# at exit.
#
#   tests/bundle/repro.sh                 # from the repository root; .ci/run calls it (.ci/run --full: --all-targets)
#   tests/bundle/repro.sh --all-targets   # every target's compiler
#
# The first checkout is this one, built in its own output base (after `bazel test //...` in CI: the bundle
# is then already there); the second a fresh clone of HEAD elsewhere with a fresh output base. With
# uncommitted changes to tracked files, this checkout is not HEAD, so both are fresh clones of HEAD.
# A fresh output base links the Python environment from the machine's store (toolchains/python/envstore.py:
# seconds, it is the one this checkout's build installed) and builds π0 (~1 min). With --all-targets the second
# checkout installs its own from the lock, in a store of its own (~3 min more): the environment is then made
# anew as well.
# Different checkout paths (and directory names), different output bases.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
case "${1:-}" in
    "") multi=pi0_fleet_bundle ;;
    --all-targets) multi=pi0_all_targets_bundle ;;
    *) echo "usage: tests/bundle/repro.sh [--all-targets]" >&2; exit 2 ;;
esac
bundles=(pi0_bundle "$multi")
targets=(//models:pi0_bundle "//models:$multi")
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
    echo "repro: building ${targets[*]} in $checkout (output base ${bases[$i]})"
    start=$(date +%s)
    # --all-targets: the second checkout installs its Python environment anew, into a store of its own.
    own_store=()
    [ "$i" = 1 ] && [ "$multi" = pi0_all_targets_bundle ] && own_store=(env "DSA_ENV_STORE=$work/env-store")
    (cd "$checkout" && "${own_store[@]}" ./bazelw --output_base="${bases[$i]}" build "${targets[@]}")
    echo "repro: built in $(($(date +%s) - start)) s"
    # Keep the bundles (for `dsa diff`), then free this output base before the next one is made: one
    # Python environment and build tree on disk at a time.
    for b in "${bundles[@]}"; do
        digests+=("$(cat "$checkout/bazel-bin/models/$b.sha256")")
        cp "$checkout/bazel-bin/models/$b.tar" "$work/$b.$i.tar"
    done
    if [ "$i" = 0 ] && ! first_is_repo; then
        (cd "$checkout" && ./bazelw --output_base="${bases[$i]}" clean --expunge >/dev/null 2>&1 || true)
    fi
done

n=${#bundles[@]}
failed=0
for j in "${!bundles[@]}"; do
    b=${bundles[$j]}
    echo "repro: ${checkouts[0]}: ${digests[$j]}"
    echo "repro: ${checkouts[1]}: ${digests[$((n + j))]}"
    if [ "${digests[$j]}" = "${digests[$((n + j))]}" ]; then
        echo "repro: OK: $b is byte-identical ($(stat -c %s "$work/$b.0.tar") bytes)"
        continue
    fi
    failed=1
    echo "repro: FAILED: the two checkouts built different $b; what differs:" >&2
    python="${bases[1]}/external/dsa_python/bin/python3"
    if [ "$b" = pi0_bundle ]; then
        (cd "${checkouts[1]}" && "$python" -m dsa.tools.diff "$work/$b.0.tar" "$work/$b.1.tar" >&2 || true)
    else
        (cd "${checkouts[1]}" && for t in $("$python" -c 'import json, sys, tarfile
meta = json.load(tarfile.open(sys.argv[1]).extractfile("bundle.json"))
print(" ".join(t["target"] for t in meta["targets"]))' "$work/$b.0.tar"); do
            echo "repro: target $t:" >&2
            "$python" -m dsa.tools.diff "$work/$b.0.tar" "$work/$b.1.tar" --target "$t" >&2 || true
        done)
    fi
done
exit $failed
