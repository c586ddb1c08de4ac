#!/usr/bin/env bash
# Build the GPU test, bench and example binaries HERE (no GPU needed; nvcc 13 from
# ../shared/device/cuda-toolkit.sh or scripts/install-cuda-toolkit.sh) and lay them out in
# .gpu-stage/ beside scripts/gpu-check.sh and the MiniLM data, small enough to carry to the GPU
# machine (its transfer limit is 64 MiB: sm_90a only, stripped, xz-compressed; gpu-check.sh
# unpacks them). There, from the repo root:
#   bash .gpu-stage/gpu-check.sh [quick]     tests, sanitizers, benches; logs under $OUT
#   bash .gpu-stage/gpu-check.sh peers       kvq's grid beside cuDNN, FlashInfer and XQA
#   bash .gpu-stage/gpu-check.sh prefill-peers  kvq's prefill grid beside cuDNN and FlashInfer
# Usage here: scripts/stage-gpu.sh   (KVQ_CUDA_ARCHS overrides the sm_90a default; with
# KVQ_STAGE_PEERS=1 it also stages FlashInfer's prebuilt kernels for the peers, ~22 MB:
# scripts/stage-flashinfer.sh, ~40 min the first time, under a minute after that)
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
if ! command -v nvcc >/dev/null 2>&1 && [ -z "${NVCC:-}" ]; then
  if [ -f ../shared/device/cuda-toolkit.sh ]; then source ../shared/device/cuda-toolkit.sh
  else eval "$(scripts/install-cuda-toolkit.sh)"; fi
fi
export KVQ_CUDA_ARCHS=${KVQ_CUDA_ARCHS:-90a} CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target/gpu-stage}
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.gpu-stage/' "$exclude" 2>/dev/null || echo '/.gpu-stage/' >> "$exclude"
rm -rf .gpu-stage && mkdir -p .gpu-stage/bin .gpu-stage/data
cargo build --release --features cuda,cli --bin kvq \
  --test gpu_append --test gpu_decode --test gpu_engine --test gpu_prefill --test gpu_calibrate \
  --bench gpu_append --bench gpu_decode \
  --example decode_bench --example moe_decode_budget --example decode_sweep --example prefill_bench \
  --example engine_step --example tensor_parallel --example gpu_quickstart \
  --message-format=json-render-diagnostics > .gpu-stage/build.json
python3 - <<'PY'
import json, shutil
for line in open(".gpu-stage/build.json"):
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"): continue
    t = m["target"]; kind = t["kind"][0]  # bin, example, test, bench
    shutil.copy2(m["executable"], f".gpu-stage/bin/{kind}-{t['name']}")
PY
rm .gpu-stage/build.json
strip .gpu-stage/bin/*
# Every binary carries the same kernel image (~15 MB): a dictionary wider than the whole tar
# stores it once (15 binaries: 238 MB -> 8.5 MB, where xz's default 8 MiB window gave 69 MB), under
# the device tool's 64 MiB transfer limit. Unpacking needs 256 MiB of memory.
tar -cf - -C .gpu-stage bin | xz -6 --lzma2=preset=6,dict=256MiB -T1 > .gpu-stage/bin.tar.xz
rm -rf .gpu-stage/bin
cp scripts/gpu-check.sh scripts/read_ceiling.py .gpu-stage/
data=../shared/data/minilm_kv.safetensors
[ -f "$data" ] && cp "$data" .gpu-stage/data/
if [ "${KVQ_STAGE_PEERS:-0}" = 1 ]; then scripts/stage-flashinfer.sh .gpu-stage/fi; fi
tar -tJf .gpu-stage/bin.tar.xz; du -sh .gpu-stage
