// codec/codec.cuh: every stored format's codec, the lists of formats the kernels fold over, and
// the one switch from a runtime kvq_format to its row codec.
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

namespace detail {
template <int N, int... F> struct IdsBelow : IdsBelow<N - 1, N - 1, F...> {};
template <int... F> struct IdsBelow<0, F...> {
  using type = FormatList<F...>;
};
// The ids of F... whose codec has a row role, in their order: all but those whose groups cross
// rows (BlockChannelsOf: int4-kc, which append.cu serves apart).
template <class Kept, int... F> struct RowCodecs {
  using type = Kept;
};
template <int... K, int F, int... Rest>
struct RowCodecs<FormatList<K...>, F, Rest...>
    : std::conditional_t<BlockChannelsOf<Codec<F>>::value, RowCodecs<FormatList<K...>, Rest...>,
                         RowCodecs<FormatList<K..., F>, Rest...>> {};
template <int... F> typename RowCodecs<FormatList<>, F...>::type row_codecs(FormatList<F...>);
template <int... F> constexpr bool all_defined(FormatList<F...>) {
  return ((sizeof(Codec<F>) > 0) && ...);
}
}  // namespace detail

// Every format an attention kernel may take: kvq.h's ids 0 to KVQ_NUM_FORMATS - 1, in order.
// decode.cu's dispatch folds over it. A new format is one here once kvq.h counts its id and its
// codec is included above.
using AttentionFormats = detail::IdsBelow<KVQ_NUM_FORMATS>::type;
static_assert(detail::all_defined(AttentionFormats{}), "every kvq_format id has a codec");
// Every format with a row codec, in id order: the cases of the run-time format switch
// (with_format below) and of the prefill kernel's decode.
using AllFormats = decltype(detail::row_codecs(AttentionFormats{}));

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
