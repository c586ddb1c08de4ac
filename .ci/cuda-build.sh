#!/usr/bin/env bash
# CI, CUDA part (called by .ci/run; no GPU needed): install nvcc with
# scripts/install-cuda-toolkit.sh, build the library, tests, benches and examples with the
# `cuda` feature in release mode, and lint them. GPU tests are built here, not run.
# One feature set throughout, `cuda,cli` (it implies `bench` and `plot`, which the GPU benches,
# the bench examples and `kvq bench` need): each feature set compiles the kernels again.
set -euo pipefail
cd "$(dirname "$0")/.."

eval "$(scripts/install-cuda-toolkit.sh)"

# The default targets (build.rs): sm_80 (the oldest supported, the bit-move FP8 path), sm_90a
# (Hopper, the conversion-instruction path and its own features) and compute_80 PTX, which
# comes from sm_80's front-end pass at almost no cost. KVQ_CUDA_ARCHS set by the caller wins.

start=$SECONDS
cargo build --release --features cuda,cli --all-targets
echo "cargo build --release --features cuda,cli --all-targets: $((SECONDS - start))s"

# Release profile, like the build above. Cargo keeps clippy's build-script run apart from the
# build's (the clippy wrapper is part of its identity), so it would run nvcc again; clippy links
# nothing, so KVQ_CHECK_ONLY=1 skips the kernels there.
start=$SECONDS
KVQ_CHECK_ONLY=1 cargo clippy --release --all-targets --features cuda,cli -- -D warnings
echo "cargo clippy --release --all-targets --features cuda,cli: $((SECONDS - start))s"

# The format-id and no-GPU behaviour tests need no device.
cargo test --release --features cuda,cli --lib cuda::
cargo test --release --features cuda,cli --test gpu_append probing_never_panics

# The candle integration: candle-core's build compiles its kernels with nvcc (for sm_90 here),
# and its cudarc links the CUDA libraries, which this machine does not have: lint only (nothing
# links). scripts/stage-candle.sh builds the example where it is run. Only what the feature
# adds (the library's `candle` module and the candle example): every other target was linted
# above with the same code, and the dev profile reuses the check-only lint's dependencies.
# candle-kernels' own CUDA files are compiled by a stand-in nvcc that writes empty outputs
# (.ci/lint-nvcc): a lint needs their build script to finish, not their PTX (8-9 minutes of
# nvcc here otherwise).
start=$SECONDS
REAL_NVCC=$(command -v nvcc) NVCC=$PWD/.ci/lint-nvcc CUDA_COMPUTE_CAP=90 KVQ_CHECK_ONLY=1 \
    cargo clippy --lib --example candle_llama --features candle -- -D warnings
echo "cargo clippy --lib --example candle_llama --features candle: $((SECONDS - start))s"
