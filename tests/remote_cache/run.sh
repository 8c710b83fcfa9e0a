#!/usr/bin/env bash
# CI test of remote caching (docs/remote-cache.md), run by .ci/run from the repository root:
#
#   tests/remote_cache/run.sh
#
# Two fresh clones of the repository under test (committed files only, as CI has them) at different paths,
# each with its own Bazel output base: checkout A builds //models:pi0 against a real cache server on
# 127.0.0.1 (tools/cache/cache-server), checkout B builds the same and every Dsa* action (DsaManifest,
# DsaExport, DsaParams, DsaCompile, ... any mnemonic starting with "Dsa") must be a remote-cache hit, read
# from --execution_log_json_file. Both servers: BuildGrid (gRPC, --config=remote-cache) and nginx with
# WebDAV (HTTP, --config=http-cache). Then the faults, each with its expectation asserted:
#   corrupt entry    a CAS blob on the HTTP server's disk is altered: Bazel's digest check refuses it, runs
#                    that action locally, and the outputs are byte-identical to the good ones
#   down at start    nothing listens at the endpoint (gRPC and HTTP): the build succeeds locally, says so,
#                    0 hits
#   killed mid-build the gRPC server is SIGKILLed after its first upload: the build still succeeds, with the
#                    good outputs
#   uploads rejected nginx with client_max_body_size 16k: the builds succeed (Bazel only warns), the hit
#                    check fails and names the cause (HTTP 413)
# plus --remote_download_toplevel / --remote_download_minimal on a cache hit (docs: large artifacts).
# Prints the cold and cached wall times and hit counts as a benchmark line (no threshold).
#
# About 6 minutes on 2 cores: each fresh output base links the project's Python environment from the
# machine's store (toolchains/python/envstore.py; installed there by the first build on the machine, ~3 min
# when this script is the first), and each fault that needs actions to run is a cold build
# (~1-2 min).
# Environment: DSA_CACHE_ROOT (where cache-server installs BuildGrid and nginx; default ~/.cache/...),
# RC_KEEP_WORK=1 keeps the work directory (checkouts, logs) for inspection.
set -euo pipefail

ROOT="$PWD"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SERVER="$HERE/../../tools/cache/cache-server"
CHECK="$HERE/check_hits.py"
TARGET=//models:pi0
# The faults that need cold builds (down at start, killed mid-build, uploads rejected: five builds) use the
# custom-op example, seconds to build instead of a minute or two: what they test is Bazel and the cache
# server, not the model. The cache hits, downloads and the corrupt entry are checked on //models:pi0.
FAULT_TARGET=//models:custom_op

[ -d "$ROOT/.git" ] || { echo "remote-cache test: run me from the repository root (a git checkout)" >&2; exit 2; }
if [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ]; then
    echo "remote-cache test: note: uncommitted changes in $ROOT are not tested (the checkouts are clones of HEAD)"
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/rules_dsa-remote-cache.XXXXXX")"
LOGS="$WORK/logs"
A="$WORK/a/rules_dsa"                # two checkouts at different paths (and depths)
B="$WORK/b/elsewhere/rules_dsa"
OB_A="$WORK/output-base-a"
OB_B="$WORK/output-base-b"
mkdir -p "$LOGS"
SERVER_DIRS=()
BG_PID=""
T_START=$SECONDS

log() { echo "remote-cache test: $*"; }
fail() {
    echo "remote-cache test: FAILED: $*" >&2
    exit 1
}

cleanup() {
    local rc=$?
    set +e
    [ -n "$BG_PID" ] && kill "$BG_PID" 2>/dev/null && wait "$BG_PID" 2>/dev/null
    local entry
    for entry in "${SERVER_DIRS[@]}"; do
        "$SERVER" stop "${entry%%:*}" --dir "${entry#*:}" >/dev/null 2>&1
    done
    local pair ob dir
    for pair in "$OB_A:$A" "$OB_B:$B"; do
        ob="${pair%%:*}"; dir="${pair#*:}"
        [ -d "$ob" ] || continue
        # clean --expunge also ends that output base's Bazel server.
        (cd "$dir" && ./bazelw --output_base="$ob" --max_idle_secs=900 clean --expunge) >/dev/null 2>&1 \
            || bazel --output_base="$ob" --max_idle_secs=900 shutdown >/dev/null 2>&1
    done
    chmod -R u+w "$WORK" 2>/dev/null
    if [ "$rc" -ne 0 ] || [ "${RC_KEEP_WORK:-0}" = 1 ]; then
        # Keep the logs (and, when asked, everything else) for the post-mortem.
        [ "${RC_KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK/a" "$WORK/b" "$OB_A" "$OB_B" "$WORK"/srv-*/cas "$WORK"/srv-*/data
        echo "remote-cache test: logs kept in $LOGS" >&2
    else
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
# shellcheck source=buildlib.sh
. "$HERE/buildlib.sh"   # now, secs, build, clean, free_port, output_digests
trap 'exit 130' INT TERM

must_succeed() { # NAME
    [ "$RC" -eq 0 ] || fail "$1: the build failed (exit $RC); its log ($LOGS/$1.log) ends with:
$(grep -v '^\s*at ' "$LOGS/$1.log" | tail -n 25)"
}

start_server() { # VAR KIND DIR [cache-server flags]: starts a server on a free port; VAR=its endpoint
    local var="$1" kind="$2" dir="$3" endpoint
    shift 3
    SERVER_DIRS+=("$kind:$dir")
    endpoint="$("$SERVER" start "$kind" --port 0 --dir "$dir" "$@" 2>>"$LOGS/servers.log")" \
        || fail "the $kind cache server did not start: $(tail -n 15 "$LOGS/servers.log")"
    printf -v "$var" '%s' "$endpoint"
}

counts() { python3 "$CHECK" --exec-log "$LOGS/$1.json" --counts; } # NAME -> "hits total"

# ----------------------------------------------------------------------------------------------------------
log "work directory $WORK"
t0="$(now)"
"$SERVER" install grpc >/dev/null 2>>"$LOGS/servers.log" || fail "installing BuildGrid: $(tail -n 5 "$LOGS/servers.log")"
"$SERVER" install http >/dev/null 2>>"$LOGS/servers.log" || fail "installing nginx: $(tail -n 5 "$LOGS/servers.log")"
log "cache servers installed ($(secs "$t0" "$(now)") s)"

mkdir -p "$(dirname "$A")" "$(dirname "$B")"
git clone -q "$ROOT" "$A"
git clone -q "$ROOT" "$B"
log "checkouts: A=$A, B=$B ($(git -C "$A" rev-parse --short HEAD))"

# Set-up outside the timings: each output base starts its Bazel server and sets up the Python environment
# (analysis fetches it: a link into the machine's store, or one install the two wait for). Both at once.
t0="$(now)"
setup_pids=()
for pair in "A:$A:$OB_A" "B:$B:$OB_B"; do
    IFS=: read -r n dir ob <<<"$pair"
    (cd "$dir" && ./bazelw --output_base="$ob" --max_idle_secs=900 build --nobuild "$TARGET") \
        >"$LOGS/setup-$n.log" 2>&1 &
    setup_pids+=("$!")
done
for i in 0 1; do
    n=$([ "$i" = 0 ] && echo A || echo B)
    wait "${setup_pids[$i]}" || fail "set-up of checkout $n failed: $(tail -n 20 "$LOGS/setup-$n.log")"
done
SETUP_A=$(secs "$t0" "$(now)")
log "set-up (Bazel server and Python environment per output base, both at once): ${SETUP_A} s"

# ---- 1. gRPC: BuildGrid ------------------------------------------------------------------------------------
start_server GRPC grpc "$WORK/srv-grpc"
log "BuildGrid at $GRPC"
build "$A" "$OB_A" grpc-cold --config=remote-cache --remote_cache="$GRPC"
must_succeed grpc-cold
python3 "$CHECK" --exec-log "$LOGS/grpc-cold.json" --expect none --label "grpc cold (empty cache)" >/dev/null \
    || fail "the cold gRPC build had remote-cache hits from an empty cache: $(python3 "$CHECK" --exec-log "$LOGS/grpc-cold.json" --expect none)"
GRPC_COLD=$WALL
build "$B" "$OB_B" grpc-cached --config=remote-cache --remote_cache="$GRPC"
must_succeed grpc-cached
GRPC_CACHED=$WALL
python3 "$CHECK" --exec-log "$LOGS/grpc-cached.json" --reference "$LOGS/grpc-cold.json" \
    --build-log "$LOGS/grpc-cold.log" --build-log "$LOGS/grpc-cached.log" --label "grpc, checkout B" \
    || fail "checkout B was not served from the gRPC cache (above)"
read -r GRPC_HITS GRPC_TOTAL <<<"$(counts grpc-cached)"

# ---- 2. HTTP: nginx + WebDAV -------------------------------------------------------------------------------
start_server HTTP http "$WORK/srv-http"
log "nginx at $HTTP"
clean "$A" "$OB_A"
build "$A" "$OB_A" http-cold --config=http-cache --remote_cache="$HTTP"
must_succeed http-cold
python3 "$CHECK" --exec-log "$LOGS/http-cold.json" --expect none --label "http cold" >/dev/null \
    || fail "the cold HTTP build had remote-cache hits from an empty cache"
HTTP_COLD=$WALL
output_digests "$A" >"$LOGS/good-digests.txt"   # built locally: the reference outputs
[ -s "$LOGS/good-digests.txt" ] || fail "no outputs under $A/bazel-bin/models"
clean "$B" "$OB_B"
build "$B" "$OB_B" http-cached --config=http-cache --remote_cache="$HTTP"
must_succeed http-cached
HTTP_CACHED=$WALL
python3 "$CHECK" --exec-log "$LOGS/http-cached.json" --reference "$LOGS/http-cold.json" \
    --build-log "$LOGS/http-cold.log" --build-log "$LOGS/http-cached.log" --label "http, checkout B" \
    || fail "checkout B was not served from the HTTP cache (above)"
read -r HTTP_HITS HTTP_TOTAL <<<"$(counts http-cached)"
output_digests "$B" | diff -u "$LOGS/good-digests.txt" - >"$LOGS/http-cached.diff" \
    || fail "outputs downloaded from the HTTP cache differ from the locally built ones: $(head -n 20 "$LOGS/http-cached.diff")"
log "PASS: both caches served all Dsa actions to another checkout; downloaded outputs equal the local build's"

# ---- Large artifacts: what --remote_download_toplevel / _minimal fetch on a full cache hit -------------------
clean "$B" "$OB_B"
build "$B" "$OB_B" toplevel --config=http-cache --remote_cache="$HTTP" --remote_download_toplevel
must_succeed toplevel
[ -f "$B/bazel-bin/models/pi0/prompt_len_0.vmfb" ] && [ -f "$B/bazel-bin/models/pi0_model/params.irpa" ] \
    || fail "--remote_download_toplevel did not download the top-level vmfb and .irpa"
[ ! -e "$B/bazel-bin/models/pi0.safetensors" ] \
    || fail "--remote_download_toplevel downloaded the intermediate checkpoint pi0.safetensors"
clean "$B" "$OB_B"
build "$B" "$OB_B" minimal --config=http-cache --remote_cache="$HTTP" --remote_download_minimal
must_succeed minimal
[ ! -e "$B/bazel-bin/models/pi0/prompt_len_0.vmfb" ] || fail "--remote_download_minimal downloaded the vmfb"
read -r h t <<<"$(counts minimal)"
[ "$h" = "$t" ] || fail "--remote_download_minimal: $h of $t hits"
log "PASS: --remote_download_toplevel fetches the vmfbs and .irpa but not the 9 MB checkpoint; _minimal fetches no output"

# ---- Fault: a corrupted cache entry ------------------------------------------------------------------------
vmfb_sha="$(grep ' bazel-bin/models/pi0/prompt_len_0.vmfb$' "$LOGS/good-digests.txt" | cut -d' ' -f1)"
blob="$WORK/srv-http/data/cas/$vmfb_sha"
[ -f "$blob" ] || fail "the vmfb's blob is not in the HTTP cache at $blob"
python3 - "$blob" <<'EOF'
import sys
path = sys.argv[1]
data = bytearray(open(path, "rb").read())
data[len(data) // 2] ^= 0xFF          # same size, one byte changed
open(path, "wb").write(bytes(data))
EOF
clean "$B" "$OB_B"
build "$B" "$OB_B" corrupt --config=http-cache --remote_cache="$HTTP"
must_succeed corrupt
grep -q "does not match received digest" "$LOGS/corrupt.log" \
    || fail "corrupt entry: Bazel did not report the digest mismatch (log: $LOGS/corrupt.log)"
output_digests "$B" | diff -u "$LOGS/good-digests.txt" - >"$LOGS/corrupt.diff" \
    || fail "corrupt entry: the build's outputs differ from the good ones: $(head -n 20 "$LOGS/corrupt.diff")"
read -r h t <<<"$(counts corrupt)"
[ "$h" -eq $((t - 1)) ] || fail "corrupt entry: expected $((t - 1)) of $t hits (all but the corrupted vmfb's compile), got $h"
log "PASS: corrupt entry refused (digest mismatch), its action rerun locally ($h of $t hits), outputs equal the good ones"

# ---- Fault: the cache is down at the start -----------------------------------------------------------------
BUILD_TARGET="$FAULT_TARGET"
dead="$(free_port)"
clean "$B" "$OB_B"
build "$B" "$OB_B" down-grpc --config=remote-cache --remote_cache="grpc://127.0.0.1:$dead"
must_succeed down-grpc
grep -q "WARNING: Failed to query remote execution capabilities" "$LOGS/down-grpc.log" \
    || fail "down at start (gRPC): Bazel did not warn that the cache is unreachable"
python3 "$CHECK" --exec-log "$LOGS/down-grpc.json" --expect none --label "grpc down at start" \
    || fail "down at start (gRPC): expected 0 hits"
clean "$A" "$OB_A"
build "$A" "$OB_A" down-http --config=http-cache --remote_cache="http://127.0.0.1:$dead"
must_succeed down-http
grep -q "WARNING: \(Reading from\|Writing to\) Remote Cache" "$LOGS/down-http.log" \
    || fail "down at start (HTTP): Bazel did not warn that the cache is unreachable"
python3 "$CHECK" --exec-log "$LOGS/down-http.json" --expect none --label "http down at start" \
    || fail "down at start (HTTP): expected 0 hits"
output_digests "$A" >"$LOGS/fault-good-digests.txt"   # built locally, no cache: the reference outputs
[ -s "$LOGS/fault-good-digests.txt" ] || fail "no outputs of $FAULT_TARGET under $A/bazel-bin/models"
log "PASS: cache down at start: both builds succeeded locally, warned, 0 hits"

# ---- Fault: the cache is killed mid-build ------------------------------------------------------------------
KILL_DIR="$WORK/srv-grpc-kill"
start_server GRPC_K grpc "$KILL_DIR"
clean "$A" "$OB_A"
build "$A" "$OB_A" killed --config=remote-cache --remote_cache="$GRPC_K" &
BG_PID=$!
deadline=$((SECONDS + 300))
until [ -n "$(find "$KILL_DIR/cas" -type f 2>/dev/null | head -n 1)" ]; do
    kill -0 "$BG_PID" 2>/dev/null || fail "killed mid-build: the build ended before its first upload"
    [ "$SECONDS" -lt "$deadline" ] || fail "killed mid-build: no upload reached the server within 300 s"
    sleep 0.2
done
kill -KILL "$("$SERVER" pid grpc --dir "$KILL_DIR")"
log "BuildGrid SIGKILLed after its first upload ($(find "$KILL_DIR/cas" -type f | wc -l) blobs stored)"
wait "$BG_PID" || true
BG_PID=""
RC="$(cat "$LOGS/killed.rc")"
must_succeed killed
grep -q "WARNING: \(Writing to\|Reading from\) Remote Cache" "$LOGS/killed.log" \
    || fail "killed mid-build: no remote-cache warning (was the server really killed before the build ended?)"
output_digests "$A" | diff -u "$LOGS/fault-good-digests.txt" - >"$LOGS/killed.diff" \
    || fail "killed mid-build: outputs differ from the good ones: $(head -n 20 "$LOGS/killed.diff")"
log "PASS: cache killed mid-build: the build succeeded with the good outputs"

# ---- Fault: uploads rejected -------------------------------------------------------------------------------
start_server SMALL http "$WORK/srv-http-small" --max-body-size 16k
clean "$A" "$OB_A"
build "$A" "$OB_A" rejected-fill --config=http-cache --remote_cache="$SMALL"
must_succeed rejected-fill
clean "$B" "$OB_B"
build "$B" "$OB_B" rejected-check --config=http-cache --remote_cache="$SMALL"
must_succeed rejected-check
if python3 "$CHECK" --exec-log "$LOGS/rejected-check.json" --reference "$LOGS/rejected-fill.json" \
    --build-log "$LOGS/rejected-fill.log" --build-log "$LOGS/rejected-check.log" --label "uploads rejected" \
    >"$LOGS/rejected-check.txt" 2>&1; then
    fail "uploads rejected: the hit check passed although the server refused the large uploads"
fi
grep -q "413 Request Entity Too Large" "$LOGS/rejected-check.txt" \
    || fail "uploads rejected: the hit check failed without naming the cause: $(cat "$LOGS/rejected-check.txt")"
log "PASS: uploads rejected: the builds succeeded, the hit check failed and named the cause:"
sed -n '1p;/cause:/p' "$LOGS/rejected-check.txt" | sed 's/^/    /'

# ----------------------------------------------------------------------------------------------------------
log "benchmark: grpc (BuildGrid) cold ${GRPC_COLD} s, cached ${GRPC_CACHED} s, ${GRPC_HITS}/${GRPC_TOTAL} Dsa hits;" \
    "http (nginx WebDAV) cold ${HTTP_COLD} s, cached ${HTTP_CACHED} s, ${HTTP_HITS}/${HTTP_TOTAL} Dsa hits" \
    "(//models:pi0, checkout B at another path, fresh output base; set-up of both output bases ${SETUP_A} s)"
log "all scenarios passed in $((SECONDS - T_START)) s"
