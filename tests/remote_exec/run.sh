#!/usr/bin/env bash
# CI test of remote execution (docs/remote-execution.md), run by .ci/run from the repository root:
#
#   tests/remote_exec/run.sh [--full]
#
# A real Remote Execution API engine on 127.0.0.1 (tools/remote/rbe-server: BuildGrid's Execution, Bots, CAS and
# ActionCache services on a private PostgreSQL) and a worker (tests/remote_exec/worker.py, a test fixture speaking
# the Remote Workers API, standing in for BuildBox or Buildbarn's workers), whose "image" holds the project's
# Python environments at <image>/<lock sha256>/venv (toolchains/python/envstore.py --image-root). Two fresh clones
# of the repository under test (committed files only, as CI has them), each with its own output base:
#   local       checkout A builds //models:pi0 without any remote: the reference outputs
#   remote      A, cleaned, builds it with --config=remote-exec: every Dsa action (DsaManifest, DsaExport,
#               DsaParams, DsaCompile, ...) executes on the worker (execution log: runner "remote"), and the
#               outputs are byte-identical to the local build's
#   cached      checkout B builds the same: every Dsa action is a remote-cache hit, outputs identical
#   (--full)    //models:act, a LeRobot policy in the LeRobot environment (@dsa_lerobot_python), the same way
# and the faults, each with its expectation asserted (on //models:custom_op, seconds to build):
#   no env      a worker whose image lacks the environments: the build fails, the error names the missing
#               environment's lock digest and says what to do; no Python traceback, no output left
#   worker killed  the worker is SIGKILLed while it runs an action: BuildGrid requeues it when the bot's session
#               expires, a second worker runs it, the build succeeds with the reference outputs
#   engine down  nothing listens at the endpoint: the build fails at once naming it (no silent local build);
#               with --remote_local_fallback it builds locally, with the reference outputs
# Prints the wall times as a benchmark line (no threshold).
#
# About 6 minutes on 2 cores (--full: + ~4 for ACT), when the Python environments are already in the machine's
# store (the `bazel test //...` before it in .ci/run installs them).
# Environment: DSA_CACHE_ROOT (where BuildGrid is installed, as tools/cache/cache-server), RX_KEEP_WORK=1 keeps
# the work directory (checkouts, logs, engine and worker logs) for inspection.
set -euo pipefail

ROOT="$PWD"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ENGINE="$ROOT/tools/remote/rbe-server"
CACHE_SERVER="$ROOT/tools/cache/cache-server"
CHECK_REMOTE="$HERE/check_remote.py"
CHECK_HITS="$ROOT/tests/remote_cache/check_hits.py"
TARGET=//models:pi0
FAULT_TARGET=//models:custom_op
full=0
case "${1:-}" in
    "") ;;
    --full) full=1 ;;
    *) echo "usage: tests/remote_exec/run.sh [--full]" >&2; exit 2 ;;
esac

[ -d "$ROOT/.git" ] || { echo "remote-exec test: run me from the repository root (a git checkout)" >&2; exit 2; }
if [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ]; then
    echo "remote-exec test: note: uncommitted changes in $ROOT are not tested (the checkouts are clones of HEAD)"
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/rules_dsa-remote-exec.XXXXXX")"
LOGS="$WORK/logs"
A="$WORK/a/rules_dsa"
B="$WORK/b/elsewhere/rules_dsa"
OB_A="$WORK/output-base-a"
OB_B="$WORK/output-base-b"
IMAGE="$WORK/image"            # the worker image's environments (links into the machine's store)
EMPTY_IMAGE="$WORK/empty-image"
mkdir -p "$LOGS" "$IMAGE" "$EMPTY_IMAGE"
WORKER_PID=""
ENGINE_DIR=""
BG_PID=""
T_START=$SECONDS

log() { echo "remote-exec test: $*"; }
fail() {
    echo "remote-exec test: FAILED: $*" >&2
    exit 1
}

stop_worker() {
    if [ -n "$WORKER_PID" ]; then
        kill -TERM "$WORKER_PID" 2>/dev/null || true
        wait "$WORKER_PID" 2>/dev/null || true
        WORKER_PID=""
    fi
}

cleanup() {
    local rc=$?
    set +e
    [ -n "$BG_PID" ] && kill "$BG_PID" 2>/dev/null && wait "$BG_PID" 2>/dev/null
    stop_worker
    [ -n "$ENGINE_DIR" ] && "$ENGINE" stop --dir "$ENGINE_DIR" >/dev/null 2>&1
    local pair ob dir
    for pair in "$OB_A:$A" "$OB_B:$B"; do
        ob="${pair%%:*}"; dir="${pair#*:}"
        [ -d "$ob" ] || continue
        (cd "$dir" && ./bazelw --output_base="$ob" --max_idle_secs=900 clean --expunge) >/dev/null 2>&1 \
            || bazel --output_base="$ob" --max_idle_secs=900 shutdown >/dev/null 2>&1
    done
    chmod -R u+w "$WORK" 2>/dev/null
    if [ "$rc" -ne 0 ] || [ "${RX_KEEP_WORK:-0}" = 1 ]; then
        [ "${RX_KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK/a" "$WORK/b" "$OB_A" "$OB_B" "$WORK/engine/cas" "$WORK"/worker-*
        echo "remote-exec test: logs kept in $LOGS (engine: $WORK/engine)" >&2
    else
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
# shellcheck source=../remote_cache/buildlib.sh
. "$ROOT/tests/remote_cache/buildlib.sh"   # now, secs, build, clean, free_port, output_digests
trap 'exit 130' INT TERM

must_succeed() { # NAME
    [ "$RC" -eq 0 ] || fail "$1: the build failed (exit $RC); its log ($LOGS/$1.log) ends with:
$(grep -v '^\s*at ' "$LOGS/$1.log" | tail -n 25)
worker log ($LOGS/worker-*.log) ends with:
$(tail -n 5 "$LOGS"/worker-*.log 2>/dev/null)"
}

no_vmfb() { [ -z "$(find -L "$1/bazel-bin/models" -name '*.vmfb' 2>/dev/null)" ]; } # CHECKOUT

# start_worker NAME IMAGE_ROOT: a worker whose image holds the environments under IMAGE_ROOT.
start_worker() {
    local name="$1" image="$2"
    mkdir -p "$WORK/worker-$name"
    "$BG_PYTHON" "$HERE/worker.py" --remote "$EXEC" --work-dir "$WORK/worker-$name" --slots 2 \
        --property OSFamily=linux --image-env "DSA_ENV_IMAGE_ROOT=$image" --log "$LOGS/worker-$name.log" \
        >"$LOGS/worker-$name.out" 2>&1 &
    WORKER_PID=$!
    sleep 1
    kill -0 "$WORKER_PID" 2>/dev/null || fail "worker $name exited at start: $(tail -n 20 "$LOGS/worker-$name.out")"
}

remote_flags() { echo "--config=remote-exec --remote_executor=$EXEC"; }

# ----------------------------------------------------------------------------------------------------------
log "work directory $WORK"
t0="$(now)"
BG_VENV="$("$CACHE_SERVER" install grpc 2>>"$LOGS/engine.log")" || fail "installing BuildGrid: $(tail -n 5 "$LOGS/engine.log")"
BG_PYTHON="$BG_VENV/bin/python"
ENGINE_DIR="$WORK/engine"
EXEC="$("$ENGINE" start --port 0 --dir "$ENGINE_DIR" --bot-keepalive 10 2>>"$LOGS/engine.log")" \
    || fail "the engine did not start: $(tail -n 15 "$LOGS/engine.log")"
log "engine (BuildGrid + PostgreSQL) at $EXEC ($(secs "$t0" "$(now)") s)"

# The worker image: the project's locked environments at <image>/<lock sha256>/venv. Built here the way the
# repository rule builds them (same interpreter lookup: DSA_PYTHON or python3.11 on the actions' PATH), linked
# from the machine's store; a container image would hold copies (docs/remote-execution.md).
store="${DSA_ENV_STORE:-${XDG_CACHE_HOME:-$HOME/.cache}/rules_dsa/python-envs}"
# Each lock with the pip arguments WORKSPACE.bazel gives its dsa_python_env (they are part of the store's key:
# other arguments would install the environment again instead of linking the one the builds use).
locks=("requirements_lock.txt")
[ "$full" = 1 ] && locks+=("requirements_lerobot_lock.txt --pip-arg=--no-cache-dir")
for entry in "${locks[@]}"; do
    read -r lock pip_args <<<"$entry"
    # shellcheck disable=SC2086 # pip_args: zero or more words
    PATH=/usr/local/bin:/usr/bin:/bin "${DSA_PYTHON:-python3.11}" "$ROOT/toolchains/python/envstore.py" \
        --image-root "$IMAGE" --store "$store" --lock "$ROOT/$lock" $pip_args >>"$LOGS/image.log" 2>&1 \
        || fail "making the worker image's environment for $lock: $(tail -n 10 "$LOGS/image.log")"
done
log "worker image: $(ls "$IMAGE" | tr '\n' ' ')"

mkdir -p "$(dirname "$A")" "$(dirname "$B")"
git clone -q "$ROOT" "$A"
git clone -q "$ROOT" "$B"
log "checkouts: A=$A, B=$B ($(git -C "$A" rev-parse --short HEAD))"

# ---- 1. Local reference ------------------------------------------------------------------------------------
build "$A" "$OB_A" local
must_succeed local
LOCAL=$WALL
output_digests "$A" >"$LOGS/local-digests.txt"
[ -s "$LOGS/local-digests.txt" ] || fail "no outputs under $A/bazel-bin/models/pi0"
log "local build of $TARGET: ${LOCAL} s (includes the output base's set-up)"

# ---- 2. The same build on the worker -----------------------------------------------------------------------
start_worker 1 "$IMAGE"
clean "$A" "$OB_A"
# shellcheck disable=SC2046 # two flags
build "$A" "$OB_A" remote $(remote_flags)
must_succeed remote
REMOTE=$WALL
python3 "$CHECK_REMOTE" --exec-log "$LOGS/remote.json" --label "$TARGET on the worker" \
    || fail "not every Dsa action of $TARGET executed on the worker (above)"
output_digests "$A" | diff -u "$LOGS/local-digests.txt" - \
    >"$LOGS/remote.diff" || fail "the worker's outputs differ from the local build's: $(head -n 20 "$LOGS/remote.diff")"
read -r N_REMOTE N_DSA <<<"$(python3 "$CHECK_REMOTE" --exec-log "$LOGS/remote.json" --counts)"
log "PASS: $TARGET built by the worker ($N_REMOTE of $N_DSA Dsa actions remote, ${REMOTE} s), byte-identical to local"

# ---- 3. A second clone: everything from the engine's cache ----------------------------------------------------
# shellcheck disable=SC2046
build "$B" "$OB_B" cached $(remote_flags)
must_succeed cached
CACHED=$WALL
python3 "$CHECK_HITS" --exec-log "$LOGS/cached.json" --reference "$LOGS/remote.json" \
    --build-log "$LOGS/cached.log" --label "checkout B, remote execution" \
    || fail "checkout B was not served from the engine's action cache (above)"
output_digests "$B" | diff -u "$LOGS/local-digests.txt" - \
    >"$LOGS/cached.diff" || fail "checkout B's outputs differ from the local build's: $(head -n 20 "$LOGS/cached.diff")"
log "PASS: checkout B got every Dsa action from the cache (${CACHED} s), byte-identical"

# ---- 4. (--full) ACT in the LeRobot environment ---------------------------------------------------------------
if [ "$full" = 1 ]; then
    BUILD_TARGET=//models:act
    clean "$B" "$OB_B"
    build "$B" "$OB_B" act-local
    must_succeed act-local
    output_digests "$B" >"$LOGS/act-local-digests.txt"
    clean "$A" "$OB_A"
    # shellcheck disable=SC2046
    build "$A" "$OB_A" act-remote $(remote_flags)
    must_succeed act-remote
    python3 "$CHECK_REMOTE" --exec-log "$LOGS/act-remote.json" --label "//models:act on the worker" \
        || fail "not every Dsa action of //models:act executed on the worker (above)"
    output_digests "$A" | diff -u "$LOGS/act-local-digests.txt" - \
        >"$LOGS/act.diff" || fail "ACT: the worker's outputs differ from the local build's: $(head -n 20 "$LOGS/act.diff")"
    log "PASS: //models:act (LeRobot environment) built by the worker, byte-identical to local (${WALL} s)"
    unset BUILD_TARGET
fi

# ---- Faults (on $FAULT_TARGET) -------------------------------------------------------------------------------
BUILD_TARGET="$FAULT_TARGET"
clean "$B" "$OB_B"
build "$B" "$OB_B" fault-local
must_succeed fault-local
output_digests "$B" >"$LOGS/fault-digests.txt"
[ -s "$LOGS/fault-digests.txt" ] || fail "no outputs of $FAULT_TARGET under $B/bazel-bin/models"

# -- The worker's image lacks the environment.
stop_worker
start_worker noenv "$EMPTY_IMAGE"
clean "$A" "$OB_A"
# shellcheck disable=SC2046
build "$A" "$OB_A" noenv $(remote_flags)
[ "$RC" -ne 0 ] || fail "no env: the build succeeded on a worker without the Python environment"
lock_sha="$(sha256sum "$ROOT/requirements_lock.txt" | cut -d' ' -f1)"
grep -q "the Python environment dsa_python (lock .*, sha256 $lock_sha, Python [0-9.]*) is not on this machine" \
    "$LOGS/noenv.log" || fail "no env: the error does not name the environment's digest ($lock_sha): $(grep -m3 -i 'error' "$LOGS/noenv.log")"
grep -q "docs/remote-execution.md" "$LOGS/noenv.log" || fail "no env: the error does not say what to do"
! grep -q "Traceback" "$LOGS/noenv.log" || fail "no env: a Python traceback reached the build's output"
no_vmfb "$A" || fail "no env: a vmfb was left in bazel-bin"
log "PASS: a worker without the environment: the build failed naming environment $lock_sha (no traceback, no output)"
stop_worker

# -- The worker is killed in the middle of an action.
start_worker killed "$IMAGE"
clean "$A" "$OB_A"
# shellcheck disable=SC2046
build "$A" "$OB_A" killed $(remote_flags) &
BG_PID=$!
deadline=$((SECONDS + 300))
until grep -q "^start" "$LOGS/worker-killed.log" 2>/dev/null; do
    kill -0 "$BG_PID" 2>/dev/null || fail "worker killed: the build ended before the worker started an action"
    [ "$SECONDS" -lt "$deadline" ] || fail "worker killed: the worker started no action within 300 s"
    sleep 0.2
done
sleep 1
kill -KILL "$WORKER_PID"
wait "$WORKER_PID" 2>/dev/null || true
WORKER_PID=""
t_kill="$(now)"
log "worker SIGKILLed while running: $(grep '^start' "$LOGS/worker-killed.log" | tail -n 1 | cut -c1-120)"
start_worker second "$IMAGE"
wait "$BG_PID" || true
BG_PID=""
RC="$(cat "$LOGS/killed.rc")"
must_succeed killed
REQUEUE="$(secs "$t_kill" "$(now)")"
# An action the killed worker finished just before the kill comes back to the retried request as a cache hit.
python3 "$CHECK_REMOTE" --exec-log "$LOGS/killed.json" --label "$FAULT_TARGET, worker killed" \
    --finished-by "$LOGS/worker-killed.log" || fail "worker killed: not every Dsa action executed remotely (above)"
output_digests "$A" | diff -u "$LOGS/fault-digests.txt" - >"$LOGS/killed.diff" \
    || fail "worker killed: outputs differ from the local build's: $(head -n 20 "$LOGS/killed.diff")"
grep -q "^start" "$LOGS/worker-second.log" || fail "worker killed: the second worker ran nothing"
log "PASS: worker killed mid-action: requeued to the second worker, build succeeded, outputs identical (${REQUEUE} s after the kill)"
stop_worker

# -- The engine is down at the start.
dead="grpc://127.0.0.1:$(free_port)"
clean "$A" "$OB_A"
build "$A" "$OB_A" down --config=remote-exec --remote_executor="$dead"
[ "$RC" -ne 0 ] || fail "engine down: the build succeeded without an engine and without --remote_local_fallback"
grep -q "Failed to query remote execution capabilities" "$LOGS/down.log" \
    || fail "engine down: the error does not say the engine is unreachable: $(grep -m3 ERROR "$LOGS/down.log")"
no_vmfb "$A" || fail "engine down: a vmfb was built"
build "$A" "$OB_A" down-fallback --config=remote-exec --remote_executor="$dead" --remote_local_fallback
must_succeed down-fallback
grep -q "WARNING: Failed to query remote execution capabilities" "$LOGS/down-fallback.log" \
    || fail "engine down, --remote_local_fallback: Bazel did not warn that the engine is unreachable"
[ "$(python3 "$CHECK_REMOTE" --exec-log "$LOGS/down-fallback.json" --counts | cut -d' ' -f1)" = 0 ] \
    || fail "engine down, --remote_local_fallback: actions claim to have run remotely"
output_digests "$A" | diff -u "$LOGS/fault-digests.txt" - >"$LOGS/down.diff" \
    || fail "engine down, --remote_local_fallback: outputs differ: $(head -n 20 "$LOGS/down.diff")"
log "PASS: engine down at start: the build fails naming it; with --remote_local_fallback it builds locally, warned"

# ----------------------------------------------------------------------------------------------------------
log "benchmark: $TARGET local ${LOCAL} s (with set-up), on the worker ${REMOTE} s, second clone from the cache" \
    "${CACHED} s; requeue after a killed worker ${REQUEUE} s"
log "all scenarios passed in $((SECONDS - T_START)) s"
