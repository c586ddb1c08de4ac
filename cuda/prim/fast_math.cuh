// prim/fast_math.cuh: approximate math where the caller's error budget allows it.
#pragma once

namespace kvq {

// 2^x with the hardware approximation (flushes subnormals): softmax weights.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) with the hardware approximation (relative error about 2^-11): soft-capped logits.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace kvq
