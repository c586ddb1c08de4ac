// decode/pipeline.cuh: the decode kernel's copy pipeline: each warp copies its steps' rows (K
// codes, K meta, V codes, V meta of 16-token chunks, contiguous runs of a page's head section;
// int4-kc keys: their block's s and z)
// into a ring of shared-memory stages with cp.async, fetching each step's block-table entries a
// step ahead.
#pragma once

#include <stdint.h>

#include "decode/plan.cuh"
#include "prim/cp_async.cuh"

namespace kvq_decode {

/// Row (of 32 / PER_ROW per pass) whose piece lane % PER_ROW lane copies. A quarter-warp's eight
/// 16-byte stores are one shared-memory wavefront when they hit eight distinct 16-byte bank
/// groups; with padded rows (pitch = 16 * (PER_ROW + 1)) consecutive rows would put two of
/// them in one group, so a quarter-warp takes rows {q, q + 4} (4 pieces a row) or rows
/// {a, a + 2, a + 4, a + 6} (2 pieces a row) instead. Rows of 8+ pieces fill a quarter alone.
template <int PER_ROW>
__device__ __forceinline__ int copy_row_of(int lane) {
  if constexpr (PER_ROW == 4) {
    return (lane >> 3) + ((lane >> 2) & 1) * 4;
  } else if constexpr (PER_ROW == 2) {
    return ((lane >> 3) & 1) + ((lane >> 4) << 3) + ((lane >> 1) & 3) * 2;
  } else {
    return lane / PER_ROW;
  }
}

/// Rows stored as they are. A swizzle policy gives the XOR on the byte offsets of row r (swz).
struct NoSwizzle {
  static __host__ __device__ constexpr int swz(int) { return 0; }
};

/// Whether Swz gives every row of a chunk the XOR of the row `step` rows on.
template <class Swz>
__host__ __device__ constexpr bool repeats_every(int step) {
  for (int r = 0; r < kChunk; ++r)
    if (Swz::swz(r) != Swz::swz(r + step)) return false;
  return true;
}

/// Queue the copy of 16 rows of ROW bytes starting at `src` (global) into shared-memory rows of
/// PITCH bytes starting at `dst` (rows shorter than 16 bytes are packed: PITCH == ROW). Packed
/// rows may be stored with their byte offsets XORed by Swz::swz(row) (decode/frag.cuh).
/// `src_bytes` is 16, or 0 to zero-fill without reading. Each pass of the warp copies 512
/// contiguous bytes (32 pieces of 16).
template <int ROW, int PITCH, class Swz = NoSwizzle>
__device__ __forceinline__ void copy_rows(uint32_t dst, const uint8_t *src, uint32_t src_bytes,
                                          int lane) {
  constexpr int PIECES = ROW;  // 16 rows * ROW bytes / 16 bytes
  static_assert(PITCH == ROW || (ROW >= 16 && ROW % 16 == 0 && PITCH % 16 == 0),
                "padded rows are whole 16-byte pieces");
  static_assert(PITCH == ROW || (Swz::swz(1) == 0 && Swz::swz(2) == 0),
                "padded rows are not swizzled");
  if constexpr (PIECES > 0) {
    if constexpr (PITCH == ROW) {
      const int l16 = (lane & 31) * 16;
      if constexpr (512 % ROW == 0 && repeats_every<Swz>(512 / ROW)) {
        // Every pass has the first one's XOR: one swizzled offset per lane.
        const int d0 = l16 ^ Swz::swz(l16 / ROW);
#pragma unroll
        for (int i = 0; i < (PIECES + 31) / 32; ++i)
          if (PIECES % 32 == 0 || lane + 32 * i < PIECES)
            cp_async16(dst + d0 + 512 * i, src + l16 + 512 * i, src_bytes);
      } else {
#pragma unroll
        for (int i = 0; i < (PIECES + 31) / 32; ++i)
          if (PIECES % 32 == 0 || lane + 32 * i < PIECES) {
            const int d = l16 + 512 * i;
            cp_async16(dst + (d ^ Swz::swz(d / ROW)), src + d, src_bytes);
          }
      }
    } else if constexpr (PIECES % 32 != 0 || 32 % (ROW / 16) != 0) {
      // Rows whose pieces do not tile a warp pass (head dims like 96, 160-byte rows): piece
      // p of the chunk is piece p % PER_ROW of row p / PER_ROW (a division by a constant).
      constexpr int PER_ROW = ROW / 16;
#pragma unroll
      for (int i = 0; i < (PIECES + 31) / 32; ++i) {
        const int p = lane + 32 * i;
        if (PIECES % 32 == 0 || p < PIECES) {
          const int row = p / PER_ROW, piece = p - row * PER_ROW;
          cp_async16(dst + row * PITCH + piece * 16, src + p * 16, src_bytes);
        }
      }
    } else {
      constexpr int PER_ROW = ROW / 16;  // pieces per row (divides 32)
      constexpr int ROWS = 32 / PER_ROW;  // rows per pass
      const int row = copy_row_of<PER_ROW>(lane), piece = lane % PER_ROW;
      const uint32_t d0 = row * PITCH + piece * 16;
      src += row * ROW + piece * 16;
#pragma unroll
      for (int i = 0; i < PIECES / 32; ++i)
        cp_async16(dst + d0 + ROWS * PITCH * i, src + 512 * i, src_bytes);
    }
  }
}

/// One fetched step: per chunk the table entry (or -1: past the split, nothing to read), the
/// chunk's index within its block, and whether the chunk lies inside the split (bit c).
template <int CH>
struct Fetch {
  int page[CH], cib[CH];
  uint32_t live;
};

// The two steps of a warp's copy pipeline. Their state lives in the kernel: they hold
// references to it, as lambdas defined there would (and compile to the same code).

/// Read the table entries of the next step to fetch and advance to the step after it.
template <int CH, int STEP>
struct StepFetch {
  int &f_blk, &f_cib;  // the next step's first chunk: table index, chunk within the block
  const int &bs16;     // chunks per block
  int &fetched;        // steps fetched so far
  const int &my_steps;
  int &f_tok;  // the next step's first token
  const int &t1;
  const int32_t *const &table;  // the sequence's block-table row
  const int &nw, &adv_blk, &adv_cib;

  __device__ __forceinline__ Fetch<CH> operator()() const {
    Fetch<CH> f;
    f.live = 0;
    int blk = f_blk, cib = f_cib;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      if (c > 0 && ++cib == bs16) cib = 0, ++blk;
      const bool live = fetched < my_steps && f_tok + c * kChunk < t1;
      // The table entry is loaded here and first used a step later (in issue), so the load's
      // latency hides behind a step of math.
      f.page[c] = live ? table[blk] : -1;
      f.live |= (uint32_t)live << c;
      f.cib[c] = cib;
    }
    ++fetched;
    f_tok += nw * STEP;
    f_blk += adv_blk, f_cib += adv_cib;
    if (f_cib >= bs16) f_cib -= bs16, ++f_blk;
    return f;
  }
};

/// Queue the copies of fetched step k (if the warp has it) into ring slot `slot`: one cp.async
/// group per call.
template <class F, class C>
struct StepIssue {
  static constexpr int CH = C::CH;
  struct KSwizzle {
    static __host__ __device__ constexpr int swz(int r) { return F::k_swz(r); }
  };
  struct VSwizzle {
    static __host__ __device__ constexpr int swz(int r) { return F::v_swz(r); }
  };
  const int &my_steps;
  const uint32_t &ring_u32;    // the warp's ring of stages
  const uint32_t &num_blocks;  // blocks in the pool: page ids at or past it are faults
  bool &fault;                 // set when a live chunk's page id is outside the pool
  uint32_t &page_ok;  // bit (slot * CH + c): chunk c of the step in `slot` has a valid page
  const uint8_t *const &head;  // the KV head's section in block 0
  const Params &p;
  const int &lane;

  __device__ __forceinline__ void operator()(int k, int slot, const Fetch<CH> &f) const {
    if (k < my_steps) {
      const uint32_t dst = ring_u32 + slot * C::STAGE;
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const bool ok = (uint32_t)f.page[c] < num_blocks;
        fault |= ((f.live >> c) & 1u) && !ok;
        const uint32_t bit = 1u << (slot * CH + c);
        page_ok = ok ? (page_ok | bit) : (page_ok & ~bit);
        // A bad page id reads block 0's address range with a zero-fill copy (nothing is read,
        // the address stays inside the pool).
        const int off = f.cib[c] * kChunk;  // token offset in the block
        const uint8_t *base = head + (int64_t)(ok ? f.page[c] : 0) * p.block_stride;
        const uint32_t bytes = ok ? 16u : 0u;
        copy_rows<F::KC_ROW, F::KPITCH, KSwizzle>(dst + C::KC_OFF + c * kChunk * F::KPITCH,
                                        base + p.k_codes_off + off * F::KC_ROW, bytes, lane);
        copy_rows<F::KM_ROW, F::KM_ROW>(dst + C::KM_OFF + c * kChunk * F::KM_ROW,
                                        base + p.k_meta_off + off * F::KM_ROW, bytes, lane);
        // int4-kc: the s and z of the chunk's block, into slot c, when the chunk is the step's
        // first or starts a block (a step of 32 tokens lies in one block unless blocks are 16).
        if constexpr (F::KBM > 0)
          if (c == 0 || f.cib[c] == 0)
            copy_rows<F::KBM / 16, F::KBM / 16>(dst + C::KM_OFF + c * F::KBM,
                                                base + p.k_meta_off, bytes, lane);
        copy_rows<F::VC_ROW, F::VPITCH, VSwizzle>(dst + C::VC_OFF + c * kChunk * F::VPITCH,
                                        base + p.v_codes_off + off * F::VC_ROW, bytes, lane);
        copy_rows<F::VM_ROW, F::VM_ROW>(dst + C::VM_OFF + c * kChunk * F::VM_ROW,
                                        base + p.v_meta_off + off * F::VM_ROW, bytes, lane);
      }
    }
    cp_async_commit();
  }
};

}  // namespace kvq_decode
