#!/usr/bin/env bash
# The GPU machine's side of scripts/stage-gpu.sh: run from the repo root as
#   bash .gpu-stage/gpu-check.sh [quick | peers | prefill-peers | sanitize [TOOL...]]
# Default: the read ceiling (every probe variant, then the Triton cross-check
# scripts/read_ceiling.py when python3 has torch and triton), every GPU test binary
# (KVQ_REQUIRE_GPU=1: a missing GPU fails), the engine examples (step loop, tensor parallel),
# the decode bandwidth grid, the 8x22B budget, the append bench. `quick`: the tests and the
# examples only. `peers`: the bracketed peer run: the read ceiling, the decode grid, the peers
# of scripts/peer_decode.py (cuDNN's dense SDPA; FlashInfer and XQA when .gpu-stage/fi holds
# their prebuilt carry, scripts/stage-flashinfer.sh), the grid again. `prefill-peers`: the same
# bracket for prefill: the read ceiling, kvq's prefill grid, scripts/peer_prefill.py (cuDNN's
# dense SDPA; FlashInfer's fa2 and fa3 paged prefill from the carry), the grid again, and the
# compute anchors of scripts/prefill_anchor.py.
# `sanitize`: every GPU test binary, whole, under compute-sanitizer's memcheck
# (with leak check), racecheck, initcheck and synccheck (or the TOOLs named); with
# KVQ_DECODE_QUICK=1 the decode suite is the reduced one (racecheck is slow on the whole).
# Reports go to $OUT (or ./gpu-check-out): decode_bench.{md,json,png}, moe.md, and every log in
# logs.tar.gz (the device tool returns at most 8 files); a summary is printed last.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${OUT:-gpu-check-out}; out=$(mktemp -d); mkdir -p "$dest"
bin=$here/bin
[ -d "$bin" ] || tar -xJf "$here/bin.tar.xz" -C "$here"
export KVQ_REQUIRE_GPU=1 KVQ_REQUIRE_DATA=1 KVQ_DATA_DIR=$here/data
mode=${1:-full}; shift || true
summary=()
failed=0
# KVQ_STEP_TIMEOUT (seconds, default none) bounds each step; the logs so far are packed after
# every step, so a run cut short still returns them.
step() {  # step NAME LOG CMD...: run, keep the log, record pass/fail and time
  local name=$1 log=$2; shift 2; local t0=$SECONDS
  if [ -n "${KVQ_STEP_TIMEOUT:-}" ]; then
    timeout "$KVQ_STEP_TIMEOUT" "$@" > "$out/$log" 2>&1
  else
    "$@" > "$out/$log" 2>&1
  fi
  local rc=$? verdict=ok
  [ $rc = 0 ] || verdict=FAIL failed=1
  [ $rc = 124 ] && verdict=TIME
  summary+=("$(printf '%-40s %-5s %4ss  %s' "$name" "$verdict" $((SECONDS - t0)) "$log")")
  printf '%s\n' "${summary[@]}" > "$out/summary.txt"
  tar -czf "$dest/logs.tar.gz" -C "$out" .
}
# gpu_engine's tests run one at a time (graph captures and timing beside each other). Under a sanitizer every
# binary runs one test at a time too: racecheck over 9 concurrent decode tests did not finish in
# 10 minutes, one at a time it takes 40 s.
tests=("gpu_append" "gpu_decode --test-threads 8" "gpu_engine --test-threads 1" "gpu_prefill" \
  "gpu_calibrate")
[ "$mode" = sanitize ] && tests=("gpu_append --test-threads 1" "gpu_decode --test-threads 1" \
  "gpu_engine --test-threads 1" "gpu_prefill --test-threads 1" "gpu_calibrate --test-threads 1")
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
read_ceiling() {  # kvq's probe variants, then Triton's read right after on the same warm GPU
  step "read ceiling (probe variants)" read_ceiling.log "$bin/example-decode_bench" --ceiling-only
  if python3 -c 'import torch, triton' 2>/dev/null; then
    step "read ceiling (triton cross-check)" read_ceiling_triton.log \
      python3 "$here/read_ceiling.py" --json "$out/read_ceiling_triton.json"
  fi
}
if [ "$mode" = sanitize ]; then
  tools=("$@"); [ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck initcheck synccheck)
  for tool in "${tools[@]}"; do
    extra=(); [ "$tool" = memcheck ] && extra=(--leak-check full)
    for t in "${tests[@]}"; do
      set -- $t
      step "$tool: $1" "$tool-$1.log" compute-sanitizer --tool "$tool" "${extra[@]}" \
        --error-exitcode 1 "$bin/test-$1" "${@:2}"
    done
  done
elif [ "$mode" = peers ] || [ "$mode" = prefill-peers ]; then
  read_ceiling
  ceiling=$(grep -h '^BEST' "$out"/read_ceiling*.log | awk '{print $NF}' | sort -g | tail -1)
  if [ "$mode" = peers ]; then
    step "decode_bench (grid 1)" decode_bench.log "$bin/example-decode_bench" --out "$out" --iters 30
  else
    step "prefill_bench (grid 1)" prefill.md "$bin/example-prefill_bench" \
      --json "$out/prefill_bench.json"
  fi
  if [ -f "$here/fi/install.sh" ]; then
    step "FlashInfer install" fi-install.log bash "$here/fi/install.sh"
    source /tmp/site/fi_env.sh
  fi
  if [ "$mode" = peers ]; then
    step "peers" peers.log env PYTHONUNBUFFERED=1 python3 scripts/peer_decode.py \
      --ceiling "${ceiling:-0}" --json "$out/peers.json"
    mkdir -p "$out/grid2"
    step "decode_bench (grid 2)" decode_bench-2.log "$bin/example-decode_bench" \
      --out "$out/grid2" --iters 30
  else
    step "prefill peers" prefill-peers.log env PYTHONUNBUFFERED=1 python3 \
      scripts/peer_prefill.py --ceiling "${ceiling:-0}" --json "$out/prefill_peers.json"
    step "prefill_bench (grid 2)" prefill-2.md "$bin/example-prefill_bench" \
      --json "$out/prefill_bench-2.json"
    step "compute anchors" prefill_anchor.log python3 scripts/prefill_anchor.py
  fi
else
  step "kvq info" info.log "$bin/bin-kvq" info
  if [ "$mode" != quick ]; then read_ceiling; fi
  for t in "${tests[@]}"; do
    set -- $t
    step "tests: $1" "test-$1.log" "$bin/test-$1" "${@:2}"
  done
  # The block-synchronous prefill kernel, which the warp-specialized one replaces on sm_90a at
  # head_dim 128 (it serves those instances on other GPUs): its wide and narrow tiles there.
  step "tests: gpu_prefill, KVQ_PREFILL_WS=0" test-gpu_prefill-ws0.log \
    env KVQ_PREFILL_WS=0 "$bin/test-gpu_prefill" wide_tiles narrow_tiles every_format_pair windows \
      block_outside
  step "example: engine_step" engine_step.log "$bin/example-engine_step" --steps 300
  step "example: tensor_parallel" tensor_parallel.log "$bin/example-tensor_parallel"
  step "example: gpu_quickstart" gpu_quickstart.log "$bin/example-gpu_quickstart"
  if [ "$mode" != quick ]; then
    step "decode_bench (grid)" decode_bench.log "$bin/example-decode_bench" --out "$out" --iters 30
    step "moe_decode_budget" moe.md "$bin/example-moe_decode_budget"
    step "prefill_bench" prefill.md "$bin/example-prefill_bench"
    step "bench: gpu_append" bench-gpu_append.log "$bin/bench-gpu_append" --bench
  fi
fi
cat "$out/gpu.txt"
[ -f "$out/decode_bench.md" ] && cat "$out/decode_bench.md"
[ -f "$out/moe.md" ] && cat "$out/moe.md"
[ -f "$out/prefill.md" ] && cat "$out/prefill.md"
[ -f "$out/prefill-peers.log" ] && grep -e '^|' -e '^check' "$out/prefill-peers.log"
[ -f "$out/prefill-2.md" ] && cat "$out/prefill-2.md"
[ -f "$out/prefill_anchor.log" ] && cat "$out/prefill_anchor.log"
grep -h -e '^read ceiling' -e '^BEST' "$out"/read_ceiling*.log 2>/dev/null
grep -h -e '^decode:' -e '^host per step' -e '^capacity shape' "$out"/engine_step.log 2>/dev/null
grep -h -e 'ERROR SUMMARY' -e 'RACECHECK SUMMARY' -e 'LEAK SUMMARY' "$out"/*check-*.log 2>/dev/null | sort | uniq -c
printf '%s\n' "${summary[@]}"
tar -czf "$dest/logs.tar.gz" -C "$out" .
for f in decode_bench.md decode_bench.json decode_bench.png moe.md read_ceiling_triton.json \
  peers.json prefill_bench.json prefill_peers.json; do
  [ -f "$out/$f" ] && cp "$out/$f" "$dest/"
done
# The exit status says whether every step passed (a missing report above is not a failure).
exit $failed
