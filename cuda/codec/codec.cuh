// codec/codec.cuh: every stored format's codec, and the one switch from a runtime kvq_format to
// its row codec.
#pragma once

#include <stdint.h>

#include <type_traits>

#include "codec/f16.cuh"
#include "codec/format.cuh"
#include "codec/fp4.cuh"
#include "codec/fp8.cuh"
#include "codec/int4_affine.cuh"
#include "codec/int4_kc.cuh"
#include "codec/int4_sym.cuh"
#include "codec/int8.cuh"
#include "codec/sanitize.cuh"
#include "kvq.h"

namespace kvq {

template <int F> using FormatTag = std::integral_constant<int, F>;

// Call fn(FormatTag<F>) for the F of List equal to `format`; KVQ_ERR_INVALID when none is.
template <bool Dense, typename Fn, int... F>
int with_format_in(FormatList<F...>, int32_t format, Fn &&fn) {
  auto call = [&](auto f) -> int {
    if constexpr (Dense && !Codec<decltype(f)::value>::kDense) return KVQ_ERR_INVALID;
    else return fn(f);
  };
  int status = KVQ_ERR_INVALID;
  (void)((format == F && (status = call(FormatTag<F>{}), true)) || ...);
  return status;
}

// Call fn(FormatTag<F>) for a kvq_format; Dense excludes the formats without a dense layout.
template <bool Dense, typename Fn> int with_format(int32_t format, Fn &&fn) {
  return with_format_in<Dense>(AllFormats{}, format, static_cast<Fn &&>(fn));
}

// A stored format's constants at run time, for the launchers' checks.
struct FormatInfo {
  int bits;               // per code
  int group;              // elements per group along head_dim (0: none)
  int group_entries;      // f16 metadata entries per group: a scale (1), a scale and a zero (2)
  int head_dim_multiple;  // whole chunks of a thread and whole groups (KvFormat::head_dim_multiple)
  bool head_scale;        // an f32 scale per head (or tensor) outside the rows
  bool row_group;         // the row is one group: one scale per row, its lanes reduced (RowGroupOf)

  int code_bytes(int head_dim) const { return head_dim * bits / 8; }
};

// The constants of a kvq_format; false for an unknown one.
inline bool format_info(int32_t format, FormatInfo &out) {
  return with_format<false>(format, [&](auto f) {
           using C = Codec<decltype(f)::value>;
           out = {C::kBits, C::kGroup, C::kGroupMeta / 2, C::kGroup > C::kEpt ? C::kGroup : C::kEpt,
                  C::kHeadScale, RowGroupOf<C>::value};
           return (int)KVQ_OK;
         }) == KVQ_OK;
}

}  // namespace kvq
