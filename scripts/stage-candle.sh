#!/usr/bin/env bash
# Build examples/candle_llama (feature `candle`) HERE, for the GPU machine, into
# .gpu-stage/candle_llama.xz. candle-core links the CUDA libraries at build time (cudarc's
# dynamic-linking): cuBLAS, cuRAND and NVRTC come from NVIDIA's PyPI wheels (fetched once into
# ~/.cache/kvq-cuda-link), and the driver library from a stub generated here (every cu* entry
# point cudarc declares, exported by an empty libcuda.so.1; the real driver is loaded at run
# time). On the GPU machine, from the repo root:
#   xz -d .gpu-stage/candle_llama.xz && chmod +x .gpu-stage/candle_llama
#   LD_LIBRARY_PATH=$(dirname "$(find /opt /usr -name libcublas.so.13 | head -1)") \
#     .gpu-stage/candle_llama --steps 64
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
if ! command -v nvcc >/dev/null 2>&1 && [ -z "${NVCC:-}" ]; then
  if [ -f ../shared/device/cuda-toolkit.sh ]; then source ../shared/device/cuda-toolkit.sh
  else eval "$(scripts/install-cuda-toolkit.sh)"; fi
fi
nvcc_bin=${NVCC:-$(command -v nvcc)}
link=${KVQ_CUDA_LINK_DIR:-$HOME/.cache/kvq-cuda-link}
lib=$link/nvidia/cu13/lib
if [ ! -e "$lib/libcuda.so" ]; then
  mkdir -p "$link/wheels"
  python3 -m pip download -q --no-deps -d "$link/wheels" \
    'nvidia-cublas==13.0.*' 'nvidia-curand==10.4.*' 'nvidia-cuda-nvrtc==13.0.*'
  for w in "$link"/wheels/*.whl; do
    python3 - "$w" "$link" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.startswith("nvidia/cu13/lib/"):
            z.extract(n, sys.argv[2])
PY
  done
  for so in libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
    ln -sf "$so" "$lib/${so%%.so.*}.so"
  done
  ln -sf "$(dirname "$(dirname "$nvcc_bin")")/lib/libcudart.so.13" "$lib/libcudart.so"
  cudarc=$(ls -d "$HOME"/.cargo/registry/src/*/cudarc-0.19.* | tail -1)
  grep -ohE 'pub (unsafe )?fn (cu[A-Za-z0-9_]+)\(' "$cudarc/src/driver/sys/mod.rs" |
    sed -E 's/pub (unsafe )?fn //; s/\(//' | sort -u |
    awk '{print "void " $1 "(void) {}"}' > "$link/libcuda_stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$lib/libcuda.so" "$link/libcuda_stub.c"
fi
export KVQ_CUDA_ARCHS=${KVQ_CUDA_ARCHS:-90a} CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target/candle}
RUSTFLAGS="-L native=$lib" cargo build --release --features candle --example candle_llama
mkdir -p .gpu-stage
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.gpu-stage/' "$exclude" 2>/dev/null || echo '/.gpu-stage/' >> "$exclude"
cp "$CARGO_TARGET_DIR/release/examples/candle_llama" .gpu-stage/candle_llama
strip .gpu-stage/candle_llama
rm -f .gpu-stage/candle_llama.xz && xz -T2 .gpu-stage/candle_llama
ls -la .gpu-stage/candle_llama.xz
