// codec/sanitize.cuh: FORMATS.md "Input sanitizing", shared by every format.
#pragma once

#include <stdint.h>

namespace kvq {

// Largest finite f16; inputs are clamped into [-kF16Max, kF16Max].
constexpr float kF16Max = 65504.0f;

// NaN → 0, then clamp to ±65504 (so ±Inf → ±65504); adds 1 to `non_finite` for NaN or ±Inf.
// The sign of a zero is kept, as the CPU's f32::clamp keeps it.
__device__ __forceinline__ float sanitize(float x, uint32_t &non_finite) {
  if (isnan(x)) {
    non_finite += 1;
    return 0.0f;
  }
  non_finite += isinf(x) ? 1u : 0u;
  return fminf(fmaxf(x, -kF16Max), kF16Max);
}

}  // namespace kvq
