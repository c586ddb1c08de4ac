// prim/fast_div.cuh: division by a launch-invariant divisor.
#pragma once

#include <stdint.h>

namespace kvq {

// n / d for n < 2^31 and 1 <= d < 2^31 with one wide multiply instead of a division subroutine:
// m = ceil(2^(31 + l) / d) with l = ceil(log2 d) satisfies m * d - 2^(31 + l) < 2^l, which makes
// floor(n * m / 2^(31 + l)) == floor(n / d) for every 31-bit n (Granlund & Montgomery 1994).
struct FastDiv {
  uint32_t m, shift;

  FastDiv() = default;
  __host__ explicit FastDiv(uint32_t divisor) {
    uint32_t l = 0;
    while ((1ull << l) < divisor) ++l;
    m = (uint32_t)(((1ull << (31 + l)) + divisor - 1) / divisor);
    shift = 31 + l;
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    return (uint32_t)(((uint64_t)n * m) >> shift);
  }
};

}  // namespace kvq
