# Shell helpers shared by the remote-cache and remote-execution tests (tests/remote_cache/run.sh,
# tests/remote_exec/run.sh), sourced after the caller has set LOGS (its log directory) and TARGET.

now() { date +%s.%N; }
secs() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$2"; }

# build CHECKOUT OUTPUT_BASE NAME [bazel flags...]: builds $BUILD_TARGET (default $TARGET); NAME.log / NAME.json
# in $LOGS; sets RC and WALL (seconds). --disk_cache= so that no disk cache (e.g. from a ~/.bazelrc) can answer
# instead.
build() {
    local dir="$1" ob="$2" name="$3"
    shift 3
    local t0 t1
    t0="$(now)"
    set +e
    (cd "$dir" && ./bazelw --output_base="$ob" --max_idle_secs=900 build "${BUILD_TARGET:-$TARGET}" --disk_cache= \
        --execution_log_json_file="$LOGS/$name.json" "$@") >"$LOGS/$name.log" 2>&1
    RC=$?
    set -e
    t1="$(now)"
    WALL="$(secs "$t0" "$t1")"
    echo "$RC" >"$LOGS/$name.rc"
}

clean() { # CHECKOUT OUTPUT_BASE: drop the outputs (the Python environment, an external repository, stays)
    (cd "$1" && ./bazelw --output_base="$2" --max_idle_secs=900 clean) >>"$LOGS/clean.log" 2>&1
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# sha256 of every output file under bazel-bin/models (runfiles trees excluded), relative paths, sorted.
output_digests() { # CHECKOUT
    (cd "$1" && find -L bazel-bin/models -type f ! -path '*.runfiles/*' ! -name '*.runfiles_manifest' \
        -print0 | sort -z | xargs -0 sha256sum)
}
