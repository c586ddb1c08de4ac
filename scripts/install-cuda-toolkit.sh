#!/usr/bin/env bash
# Install what `cargo build --features cuda` needs — nvcc, the CUDA headers and the static CUDA
# runtime, version 13.0 — from NVIDIA's PyPI wheels into a user directory (no root, no driver;
# the GPU driver is only needed to *run* the kernels). Prints the environment to export on
# stdout, so the usual use is:
#
#   eval "$(scripts/install-cuda-toolkit.sh)"
#
# Progress goes to stderr. Re-running is cheap: an existing install is reused.
# Options (environment): KVQ_CUDA_DIR (default ~/.cache/kvq-cuda-13.0), PYTHON (default python3).
set -euo pipefail

dir="${KVQ_CUDA_DIR:-$HOME/.cache/kvq-cuda-13.0}"
python="${PYTHON:-python3}"
# Pinned to one CUDA 13.0 release: nvcc and the runtime it links must agree.
wheels=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
)

log() { echo "install-cuda-toolkit: $*" >&2; }

find_root() {
  ls -d "$dir"/venv/lib/python3*/site-packages/nvidia/cu13 2>/dev/null | head -n1
}

root=$(find_root || true)
if [ -z "$root" ] || [ ! -x "$root/bin/nvcc" ]; then
  command -v "$python" >/dev/null || { log "needs $python (set PYTHON)"; exit 1; }
  log "installing CUDA 13.0 (nvcc, headers, cudart) into $dir"
  "$python" -m venv "$dir/venv" >&2
  "$dir/venv/bin/python" -m pip install --quiet --disable-pip-version-check "${wheels[@]}" >&2
  root=$(find_root || true)
fi
if [ -z "$root" ] || [ ! -x "$root/bin/nvcc" ]; then
  log "the wheels installed, but no nvcc was found under $dir"
  exit 1
fi
# The wheels ship libcudart_static.a under lib/; build.rs looks there (and in lib64/).
[ -f "$root/lib/libcudart_static.a" ] || log "warning: $root/lib/libcudart_static.a is missing"
log "$("$root/bin/nvcc" --version | tail -n1)"

cat <<ENV
export CUDA_HOME="$root"
export NVCC="$root/bin/nvcc"
export PATH="$root/bin:\$PATH"
ENV
