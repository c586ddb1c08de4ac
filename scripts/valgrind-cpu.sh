#!/usr/bin/env bash
# valgrind memcheck over every CPU test binary (the library's unit tests and tests/*.rs; with
# `--cli`, also the `kvq` binary's tests and tests/cli.rs): invalid reads / writes, uses of
# uninitialized memory and definite leaks fail the run (exit code 1).
#
#   scripts/valgrind-cpu.sh          # default features
#   scripts/valgrind-cpu.sh --cli    # plus what feature `cli` adds
#
# The fuzz suites run at a small count under valgrind (KVQ_FUZZ_CASES, default 16 here); the
# memcheck log of each process goes to target/valgrind/NAME.PID.log. About 5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

features=()
children=no
if [ "${1:-}" = "--cli" ]; then
    features=(--features cli --lib --bins --test cli)
    children=yes # tests/cli.rs runs the kvq binary: check those processes too
fi
export KVQ_FUZZ_CASES="${KVQ_FUZZ_CASES:-16}"
target_dir="${CARGO_TARGET_DIR:-target}"
logs="$target_dir/valgrind"
mkdir -p "$logs"

mapfile -t bins < <(
    cargo test --no-run "${features[@]}" --message-format=json |
        jq -r 'select(.reason == "compiler-artifact" and .profile.test == true) | .executable // empty'
)

status=0
for bin in "${bins[@]}"; do
    name=$(basename "$bin")
    case "$name" in
    gpu_*) continue ;; # CUDA tests: empty without the feature
    esac
    # The exhaustive FP8 sweep (2^32 encodes) is #[ignore]d already; the 1/97 sweep is the
    # slowest test left, about a minute and a half under memcheck.
    start=$SECONDS
    rm -f "$logs/$name".*.log
    if valgrind --tool=memcheck --error-exitcode=1 --leak-check=full \
        --show-leak-kinds=definite --errors-for-leak-kinds=definite \
        --trace-children=$children --log-file="$logs/$name.%p.log" \
        "$bin" --test-threads=2 >"$logs/$name.out" 2>&1; then
        verdict=ok
    else
        verdict=FAILED
        status=1
    fi
    # One log per process: the test binary and, with --cli, each kvq run it spawned.
    processes=$(ls "$logs/$name".*.log | wc -l)
    errors=$(grep -h "ERROR SUMMARY" "$logs/$name".*.log | awk '{n += $4} END {print n + 0}')
    [ "$errors" = 0 ] || { verdict=FAILED; status=1; }
    printf '%-36s %-6s %4ds  %3d process(es), %s memcheck errors\n' \
        "$name" "$verdict" $((SECONDS - start)) "$processes" "$errors"
done
exit $status
