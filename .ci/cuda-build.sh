#!/usr/bin/env bash
# CI, CUDA part (called by .ci/run; no GPU needed): install nvcc with
# scripts/install-cuda-toolkit.sh, build the library, tests, benches and examples with the
# `cuda` feature in release mode, and lint them. GPU tests are built here, not run.
set -euo pipefail
cd "$(dirname "$0")/.."

eval "$(scripts/install-cuda-toolkit.sh)"

start=$SECONDS
cargo build --release --features cuda --all-targets
echo "cargo build --release --features cuda --all-targets: $((SECONDS - start))s"

# Release profile, like the build above: the kernels are compiled once, not again for debug.
start=$SECONDS
cargo clippy --release --all-targets --features cuda -- -D warnings
echo "cargo clippy --release --all-targets --features cuda: $((SECONDS - start))s"

# The sys.rs ⇄ kvq.h consistency tests and the no-GPU behaviour tests need no device.
cargo test --release --features cuda --lib cuda::
cargo test --release --features cuda --test gpu_append probing_never_panics
