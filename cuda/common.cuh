// common.cuh: what the .cu files share: the primitives the append and dense kernels use (prim/),
// the row kernels' thread-block size, and launcher status handling. No format math here.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <cstdlib>

#include "kvq.h"
#include "prim/fast_div.cuh"
#include "prim/vec_io.cuh"
#include "prim/warp.cuh"

namespace kvq {

// Elements one thread handles: 16 bytes of f16/bf16 input, one 16-byte load.
constexpr int kChunk = 8;
constexpr int kThreadsPerBlock = 256;

// ---- launch helpers --------------------------------------------------------------------------

// Blocks of kThreadsPerBlock covering `threads` threads (a multiple of 32 is launched, so every
// warp is full and full-mask shuffles are valid).
inline unsigned blocks_for(int64_t threads) {
  return (unsigned)((threads + kThreadsPerBlock - 1) / kThreadsPerBlock);
}

// The message of the last failed launch on this host thread (kvq_last_error).
void set_last_error(cudaError_t e);

// Map the launch result to a kvq_status, remembering the CUDA error for kvq_last_error().
inline int launch_status() {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return KVQ_OK;
  set_last_error(e);
  return KVQ_ERR_LAUNCH;
}

inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// An A/B switch of the environment: 0 or 1 where `name` starts with that digit, else -1 (unset
// or anything else). Callers read it once (a function-local static).
inline int env_switch(const char *name) {
  const char *e = std::getenv(name);
  return e == nullptr ? -1 : e[0] == '1' ? 1 : e[0] == '0' ? 0 : -1;
}

}  // namespace kvq
