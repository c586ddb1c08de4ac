#!/usr/bin/env bash
# The GPU machine's side of scripts/stage-gpu.sh: run from the repo root as
#   bash .gpu-stage/gpu-check.sh [quick]
# The read ceiling (every probe variant, then unless quick the Triton cross-check
# scripts/read_ceiling.py when python3 has torch and triton), GPU tests (KVQ_REQUIRE_GPU=1: a
# missing GPU fails), compute-sanitizer memcheck + racecheck on a reduced decode suite, the
# decode bandwidth grid, the 8x22B budget, the append bench.
# Reports go to $OUT (or ./gpu-check-out): decode_bench.{md,json,png}, moe.md, and every log in
# logs.tar.gz (the device tool returns at most 8 files); a summary is printed last.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${OUT:-gpu-check-out}; out=$(mktemp -d); mkdir -p "$dest"
bin=$here/bin
[ -d "$bin" ] || tar -xJf "$here/bin.tar.xz" -C "$here"
export KVQ_REQUIRE_GPU=1 KVQ_REQUIRE_DATA=1 KVQ_DATA_DIR=$here/data KVQ_MINILM=$here/data/minilm_kv.safetensors
summary=()
step() {  # step NAME LOG CMD...: run, keep the log, record pass/fail and time
  local name=$1 log=$2; shift 2; local t0=$SECONDS
  "$@" > "$out/$log" 2>&1; local rc=$?
  summary+=("$(printf '%-34s %-5s %4ss  %s' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t0)) "$log")")
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
step "kvq info" info.log "$bin/bin-kvq" info
step "read ceiling (probe variants)" read_ceiling.log "$bin/example-decode_bench" --ceiling-only
# Right after the probe, on the same warm GPU, so that the two BEST lines compare.
if [ "${1:-}" != quick ] && python3 -c 'import torch, triton' 2>/dev/null; then
  step "read ceiling (triton cross-check)" read_ceiling_triton.log \
    python3 "$here/read_ceiling.py" --json "$out/read_ceiling_triton.json"
fi
step "tests: gpu_append" test-gpu_append.log "$bin/test-gpu_append"
step "tests: gpu_decode" test-gpu_decode.log "$bin/test-gpu_decode" --test-threads 8
export KVQ_DECODE_QUICK=1  # gpu_decode: the reduced suite, for the sanitizers
step "memcheck: gpu_decode" memcheck.log compute-sanitizer --tool memcheck --error-exitcode 1 "$bin/test-gpu_decode"
step "racecheck: gpu_decode" racecheck.log compute-sanitizer --tool racecheck --error-exitcode 1 "$bin/test-gpu_decode" every_format_pair speculative long_context
step "memcheck: gpu_append" memcheck-append.log compute-sanitizer --tool memcheck --error-exitcode 1 "$bin/test-gpu_append" edge_values shared_pool
unset KVQ_DECODE_QUICK
if [ "${1:-}" != quick ]; then
  step "decode_bench (grid)" decode_bench.log "$bin/example-decode_bench" --out "$out" --iters 30
  step "moe_decode_budget" moe.md "$bin/example-moe_decode_budget"
  step "bench: gpu_append" bench-gpu_append.log "$bin/bench-gpu_append" --bench
fi
cat "$out/gpu.txt"
[ -f "$out/decode_bench.md" ] && cat "$out/decode_bench.md"
[ -f "$out/moe.md" ] && cat "$out/moe.md"
grep -h -e '^read ceiling' -e '^BEST' "$out"/read_ceiling*.log 2>/dev/null
printf '%s\n' "${summary[@]}"
tar -czf "$dest/logs.tar.gz" -C "$out" .
for f in decode_bench.md decode_bench.json decode_bench.png moe.md; do
  [ -f "$out/$f" ] && cp "$out/$f" "$dest/"
done
