// prefill/ws_kernel.cuh: the warp-specialized prefill kernel (sm_90a, head_dim 128; sides both
// stored as their 16-bit operands or both quantized; wide and narrow tiles, and triple ones but
// for E4M3 operands). Producer warps fill a ring of stages with each step's K and V operand
// tiles — copied, or for quantized sides copied raw into a staging area steps ahead and decoded
// by the producers — and hand every stage over through an mbarrier; a consumer warpgroup per 64
// rows (Q fragments held in registers, or at triple tiles, whose consumers have 144-152
// registers, read from the Q tile by descriptor) runs S = Q K^T, the softmax and O += P V from
// the ring and gives each stage back through a second mbarrier. No block-wide barrier is left in
// the loop, so one consumer warpgroup's softmax runs beside another's MMAs (of the block, or of
// the SM's other block at narrow tiles), and the copies and the decode run ahead of them.
#pragma once

#include "prefill/copies.cuh"
#include "prefill/decode_rows.cuh"
#include "prefill/e4m3.cuh"
#include "prefill/softmax.cuh"
#include "prefill/tiles.cuh"
#include "prefill/wg_mma.cuh"
#include "prim/mbarrier.cuh"
#include "prim/pdl.cuh"

namespace kvq_prefill {

using namespace kvq;

/// Threads of a warp-specialized block: a consumer warpgroup per 64 of its R rows, then its
/// producer threads: one warpgroup, or for quantized sides at wide tiles kWsQuantProducers (the
/// decode is most of a producer's work; narrow tiles share an SM, and its registers, with
/// another block).
constexpr int kWsQuantProducers = 256;
__host__ __device__ constexpr int ws_producers(bool quant, int r) {
  return quant && r == kWideRows ? kWsQuantProducers : 128;
}
__host__ __device__ constexpr int ws_threads(bool quant, int r) {
  return ws_producers(quant, r) + 2 * r;
}
/// Blocks an SM holds: wide and triple tiles one (two or three consumer warpgroups), narrow
/// tiles two, so that an SM still has two consumer warpgroups.
__host__ __device__ constexpr int ws_blocks_per_sm(int r) { return r == kRows ? 2 : 1; }
/// Stages of the ring: what fits the blocks an SM holds.
__host__ __device__ constexpr int ws_stages(int r) { return r == kRows ? 2 : 4; }
/// Steps whose copies a producer thread keeps in flight before handing the oldest over (16-bit
/// sides): at most three, at most the stages.
__host__ __device__ constexpr int ws_in_flight(int r) {
  return ws_stages(r) < 3 ? ws_stages(r) : 3;
}
/// Quantized sides: steps whose raw rows are in flight ahead of the one being decoded (the
/// kernel's A), in a ring of A + 1 staging areas (the step being decoded holds one). Decoded
/// sides at wide tiles take kWsRawDeep where the layout fits the block (INT4: 3-4 % faster than
/// one step ahead on an H100; FP8's does not fit, and was level at two), else one; narrow tiles
/// (two blocks an SM) and E4M3 operands one.
constexpr int kWsRawDeep = 3;

/// Bytes of one operand tile of the ring: kTokens rows of kWsD 16-bit operands, or of E4M3 codes
/// (the E4M3 instances).
__host__ __device__ constexpr int ws_tile_bytes(bool e4m3) {
  return kTokens * kWsD * (e4m3 ? 1 : 2);
}

/// Where the warp-specialized kernel's dynamic shared memory goes (offsets from its first
/// 1024-byte boundary; `bytes` has room for the alignment): the Q tile, the ring's K and V
/// operand tiles (B128) per stage, for quantized sides `ahead` + 1 staging areas of raw rows
/// and the zero row. Quantized sides at narrow tiles (two blocks an SM) put the Q tile over the
/// staging areas from the second on: the consumers hold Q in registers before the producers
/// first copy there (the kernel's q_free).
struct WsLayout {
  int q, ring, raw, slot, zero, bytes;
};
__host__ __device__ inline WsLayout ws_layout(const Side &k, const Side &v, int r, int ahead,
                                              bool e4m3 = false) {
  const bool quant = !k.direct, q_over_raw = quant && r == kRows;
  const int q_bytes = r * kWsD * 2;
  WsLayout l;
  l.slot = quant ? stage_bytes(k) + stage_bytes(v) : 0;
  l.ring = q_over_raw ? 0 : q_bytes;
  l.raw = l.ring + ws_stages(r) * 2 * ws_tile_bytes(e4m3);
  l.q = q_over_raw ? l.raw + l.slot : 0;
  int staging = quant ? (ahead + 1) * l.slot : 0;
  if (q_over_raw && staging < l.slot + q_bytes) staging = l.slot + q_bytes;
  l.zero = l.raw + staging;
  l.bytes = l.zero + (quant ? kZeroRow : 0) + 1024;
  return l;
}
/// Whether the warp-specialized kernel serves a pair of sides: both 16-bit (one operand type)
/// or both quantized (f16 operands); int4-kc keys and mixed pairs take the block-synchronous
/// one.
__host__ __device__ inline bool ws_sides(const Side &k, const Side &v, bool kb, bool vb) {
  return kb == vb && k.direct == v.direct && k.format != KVQ_INT4_KC;
}

/// QUANT: both sides quantized (decoded by the producer into f16 operands), else both 16-bit.
/// R: the tile's query rows (kWideRows or kRows). A: quantized sides' raw steps in flight ahead
/// of the one being decoded (kWsRawDeep or 1). E4M3: both sides fp8-e4m3, their codes the MMAs'
/// operands (the producers copy K's and transpose V's; the consumers quantize Q and P).
template <bool KB, bool VB, bool QUANT, int R, int A, bool E4M3 = false>
__global__ void __launch_bounds__(ws_threads(QUANT, R), ws_blocks_per_sm(R))
    prefill_ws_kernel(const Params p) {
  static_assert(!QUANT || (!KB && !VB), "quantized sides decode to f16 operands");
  static_assert(!E4M3 || QUANT, "E4M3 operands are a quantized cache's");
  static_assert(R == kWideRows || R == kRows || (R == kTripleRows && !E4M3 && A == 1),
                "wide or narrow tiles, or triple tiles of decoded sides");
#if KVQ_HAS_WGMMA
  // Registers of a producer and a consumer thread (setmaxnreg). The block's pool is what it
  // launched with (kLaunchRegs a thread, from the launch bound): a consumer's increase waits
  // until the producers' decrease covers it, so the two must fit in it.
  constexpr int NP = ws_producers(QUANT, R), NC = 2 * R, kThreads = ws_threads(QUANT, R);
  constexpr int kLaunchRegs = 65536 / (kThreads * ws_blocks_per_sm(R)) / 8 * 8;
  // Decoded sides' producers: narrow tiles 88 (80 spilled in the decode of run-major staging);
  // triple tiles 80 (their consumers get 144 either way); wide tiles 80 where the raw rows are
  // kWsRawDeep steps ahead (INT4: 64 spilled ~8 registers a step; 80 measured 3-4 % faster on
  // 4k prompts), else 64 (decoded FP8: its consumers lost 4-8 % at 176 registers).
  constexpr int kProducerRegs =
      !QUANT ? 56 : R == kRows ? 88 : (R == kTripleRows || A > 1) ? 80 : 64;
  constexpr int kPoolLeft = (kThreads * kLaunchRegs - NP * kProducerRegs) / NC / 8 * 8;
  constexpr int kConsumerRegs = kPoolLeft < 224 ? kPoolLeft : 224;
  static_assert(NP * kProducerRegs + NC * kConsumerRegs <= kThreads * kLaunchRegs,
                "register pool");
  constexpr int D = kWsD, S = ws_stages(R), kInFlight = ws_in_flight(R);
  static_assert(kInFlight <= S, "in-flight steps hold stages");
  constexpr int TILE = ws_tile_bytes(E4M3);
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t *const smem = align1024(smem_raw);
  __shared__ RowInfo<R> rw;
  __shared__ uint64_t full[S], empty[S];  // stage landed (producer threads), consumed (consumers)
  // Quantized sides: a staging area's raw rows landed (the copying lanes and their bytes),
  // decoded (every producer thread).
  constexpr int kRawSlots = A + 1;
  __shared__ uint64_t raw_full[kRawSlots], raw_free[kRawSlots];
  // Quantized sides at narrow tiles: the consumers hold Q in registers (the Q tile lies over the
  // staging areas from the second on).
  __shared__ uint64_t q_free;
  // The split merge (prefill.cu) may launch now: it waits for this grid before its reads, and
  // its blocks take the SMs this grid's blocks leave.
  allow_dependent_launch();

  TileJob job;
  if (!begin_tile<R, kThreads>(p, rw, job)) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const WsLayout L = ws_layout(p.k, p.v, R, A, E4M3);
  constexpr bool kQOverRaw = QUANT && R == kRows;
  // Triple tiles' consumers have 144-152 registers: Q stays in its tile, read by descriptor.
  constexpr bool kQHeld = R != kTripleRows;
  uint8_t *const qs = smem + L.q;
  auto k_op = [&](int s) { return smem + L.ring + s * 2 * TILE; };
  auto v_op = [&](int s) { return k_op(s) + TILE; };
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) mbar_init(&full[s], NP), mbar_init(&empty[s], NC);
#pragma unroll
    for (int s = 0; s < kRawSlots; ++s)
      mbar_init(&raw_full[s], kTokens / kRun), mbar_init(&raw_free[s], NP);
    mbar_init(&q_free, NC);
    fence_mbarrier_init();
  }
  load_q<D, R, true, kThreads>(p, job, qs);
  // Quantized sides: the zero row after the staging areas, stored before the barrier below.
  uint8_t *const zero_row = smem + L.zero;
  if (QUANT && tid < kZeroRow / 16)
    reinterpret_cast<uint4 *>(zero_row)[tid] = make_uint4(0, 0, 0, 0);
  cp_async_wait<0>();
  __syncthreads();  // row bounds, the barriers, the Q tile
  if (p.q_bf16 && !KB && !E4M3) {  // (E4M3 quantizes either query type as it is)
    scale_q<D, R, true>(qs, rw, warp, kThreads / 32);
    __syncthreads();
  }

  int kv_lo, kv_hi;
  tile_keys(rw, &kv_lo, &kv_hi);
  const int base = kv_hi > kv_lo ? kv_lo / kRun * kRun : 0;
  const int nsteps = kv_hi > kv_lo ? (kv_hi - base + kTokens - 1) / kTokens : 0;
  bool fault = false;

  // The consumer warps come first (warps 0 .. NC / 32 - 1), the producers after them: quantized
  // sides measured 0.5-1.5 % faster so than the other way round, 16-bit ones level.
  if (warp >= NC / 32) {
    // ---- Producers. A step's four runs are looked up by four threads, each run's table entry
    // loaded ahead so that the load's latency hides behind copies: for 16-bit sides lane r of
    // every producer warp, one step ahead (the warp shares the four by shuffles); for quantized
    // sides the threads that copy the runs' raw rows: lane 0 of producer warp r, every step, or
    // with `p.ws_turns` lane r of warp j % kPW for step j, kPW steps ahead, so that each warp
    // issues one step's copies in kPW (a bulk copy's issue, ~40 instructions, is its warp's
    // serial work beside the decode all producers share; Launch decides which pays).
    setmaxnreg_dec<kProducerRegs>();
    const uint8_t *head = p.pool + (int64_t)job.kvh * p.head_stride;
    const int32_t *table = p.block_tables + (int64_t)job.b * p.max_blocks;
    const int pw = warp - NC / 32;  // the producer warp
    constexpr int kPW = NP / 32;     // producer warps
    static_assert(kTokens / kRun <= 32 && kTokens / kRun <= kPW, "a run a lane, or a warp");
    const bool turns = QUANT && p.ws_turns != 0;
    const int my_run = QUANT && !turns ? pw : lane;
    const bool looks_up =
        QUANT && !turns ? lane == 0 && pw < kTokens / kRun : lane < kTokens / kRun;
    const int issue_apart = turns ? kPW : 1;  // steps between two a warp copies
    bool live = false;       // this thread's run of the looked-up step lies before kv_hi
    int entry = 0, off = 0;  // its table entry and first row within its page
    auto load_entry = [&](int st) {
      const int tok = base + st * kTokens + my_run * kRun;
      live = looks_up && st < nsteps && tok < kv_hi;
      if (live) {
        const int page = (int)p.block_div.div((uint32_t)tok);
        off = tok - page * p.block_size;
        entry = __ldg(table + page);
      }
    };
    // This thread's run of the step whose entries were loaded last: its pool offset, or -1.
    auto run_offset = [&] { return live ? block_offset(p, entry, &fault) : int64_t{-1}; };
    // The pages of the step whose entries were loaded last.
    auto pages = [&] {
      const int64_t at = run_offset();
      StepPages pg;
#pragma unroll
      for (int r = 0; r < kTokens / kRun; ++r) {
        pg.at[r] = __shfl_sync(kFull, at, r);
        pg.off[r] = __shfl_sync(kFull, off, r);
      }
      return pg;
    };
    // Step j's operand tiles are written: make them visible to wgmma (async proxy) and hand
    // the stage over.
    auto hand_over = [&](int j) {
      fence_proxy_async();
      mbar_arrive(&full[j % S]);
    };
    load_entry(turns ? pw : 0);  // the first step this thread looks up
    if constexpr (!QUANT) {
#pragma unroll 1
      for (int st = 0; st < nsteps; ++st) {
        const int s = st % S;
        const StepPages pg = pages();
        load_entry(st + 1);
        if (st >= S) mbar_wait(&empty[s], (st / S + 1) & 1);  // step st - S consumed
        const int hi = kv_hi - (base + st * kTokens);
        issue_direct<D, true, 128>(head, p.k.codes_off, pg, hi, k_op(s));
        issue_direct<D, true, 128>(head, p.v.codes_off, pg, hi, v_op(s));
        cp_async_commit();
        if (st >= kInFlight - 1) {
          cp_async_wait<kInFlight - 1>();
          hand_over(st - (kInFlight - 1));
        }
      }
      // The last steps still in flight, oldest first.
      cp_async_wait<0>();
      for (int j = max(nsteps - (kInFlight - 1), 0); j < nsteps; ++j) hand_over(j);
    } else {
      // Quantized sides: the looking-up thread of run r of step j copies its raw rows (codes,
      // metadata; both sides) by bulk copies (one, of the page's head section, where
      // p.ws_whole_runs), A steps ahead, into run r of staging area j % (A + 1) (run-major,
      // p.ws_run: the area holds kTokens / kRun of them, stage_bytes(k) + stage_bytes(v)),
      // and arrives on its raw_full barrier expecting their bytes; every producer thread waits
      // there, decodes (or stages) the step into the stage's operand tiles, and gives the
      // staging area back (raw_free).
      const RunLayout &rl = p.ws_run;
      uint8_t *const raw0 = smem + L.raw;
      auto raw_k = [&](int j) { return raw0 + (j % kRawSlots) * L.slot; };
      auto staged_k = [&](const uint8_t *area) {
        return Staged{area + rl.k_codes, area + rl.k_meta, rl.bytes, rl.bytes};
      };
      auto staged_v = [&](const uint8_t *area) {
        return Staged{area + rl.v_codes, area + rl.v_meta, rl.bytes, rl.bytes};
      };
      auto issue_step = [&](int j) {
        if (!looks_up || j >= nsteps || (turns && j % kPW != pw)) return;
        // The Q tile lies over staging areas 1 on (as many as it spans): each one's first copy
        // waits until the consumers hold Q in registers (a completed phase: later waits pass).
        if (kQOverRaw && j >= 1 && j < kRawSlots) mbar_wait(&q_free, 0);
        const int slot = j % kRawSlots;
        if (j >= kRawSlots) mbar_wait(&raw_free[slot], (j / kRawSlots + 1) & 1);
        const bool run_live = live;
        const int run_off = off;
        const int64_t at = run_offset();
        load_entry(j + issue_apart);  // this thread's next step
        uint8_t *const run_at = raw_k(j) + my_run * rl.bytes;  // this run's raw rows
        if (run_live && at < 0) {
          // A block outside the pool (counted): its rows read as zeros, stored before this
          // lane's arrival releases them, and ordered before the bulk copies that later refill
          // the staging area.
          for (int x = 0; x < rl.bytes; x += 16)
            *reinterpret_cast<uint4 *>(run_at + x) = make_uint4(0, 0, 0, 0);
          fence_proxy_async();
        }
        mbar_arrive_expect_tx(&raw_full[slot], run_live && at >= 0 ? rl.bytes : 0);
        if (!run_live || at < 0) return;  // past the keys (never decoded), or zeros stored
        const uint8_t *sec = head + at;
        if (p.ws_whole_runs) {  // (the run is its whole page: run_off is 0)
          bulk_to_shared(run_at, sec, rl.bytes, &raw_full[slot]);
          return;
        }
        const Side *sides[2] = {&p.k, &p.v};
        const int to[2][2] = {{rl.k_codes, rl.k_meta}, {rl.v_codes, rl.v_meta}};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const Side &sd = *sides[i];
          bulk_to_shared(run_at + to[i][0], sec + sd.codes_off + run_off * sd.codes_row,
                         kRun * sd.codes_row, &raw_full[slot]);
          if (sd.meta_row > 0)
            bulk_to_shared(run_at + to[i][1], sec + sd.meta_off + run_off * sd.meta_row,
                           kRun * sd.meta_row, &raw_full[slot]);
        }
      };
#pragma unroll 1
      for (int j = 0; j < A; ++j) issue_step(j);
      // The steps, with the sides' decoders (E4M3: none, the codes staged as they are).
      auto steps = [&](auto decode_k, auto decode_v) __attribute__((always_inline)) {
#pragma unroll 1
        for (int st = 0; st < nsteps; ++st) {
          const int s = st % S, slot = st % kRawSlots;
          issue_step(st + A);
          __syncwarp();  // the copying lanes rejoin their warp before the decode
          mbar_wait(&raw_full[slot], (st / kRawSlots) & 1);  // step st's raw rows landed
          if (st >= S) mbar_wait(&empty[s], (st / S + 1) & 1);  // step st - S consumed
          const int tok0 = base + st * kTokens;
          const int lo = max(kv_lo, tok0) - tok0, hi = min(kv_hi, tok0 + kTokens) - tok0;
          const uint8_t *area = raw_k(st);
          if constexpr (E4M3) {
            stage_e4m3<NP>(area + rl.k_codes, area + rl.v_codes, rl.bytes, k_op(s), v_op(s),
                           lo, hi, (unsigned)(tid - NC));
          } else {
            decode_k(staged_k(area), k_op(s), lo, hi);
            decode_v(staged_v(area), v_op(s), lo, hi);
          }
          hand_over(st);
          mbar_arrive(&raw_free[slot]);  // this thread is done reading the staging area
        }
      };
      if constexpr (E4M3) steps(0, 0);
      else with_decoder_pair<D, NP>(AllFormats{}, p.k, p.v, zero_row, steps);
    }
  } else {
    // ---- Consumers: warpgroup c = warp / 4 serves rows 64 c .. 64 c + 63.
    setmaxnreg_inc<kConsumerRegs>();
    const int cw = warp;  // the warp's 16 rows: 16 cw ..
    const float k_factor = head_factor(p.k_scales, job.kvh);
    const float v_factor = head_factor(p.v_scales, job.kvh);
    WarpSoftmax<R> sm(p, rw, cw, k_factor);
    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    // The warp's Q fragments (A of S): 16-bit, chunk 2 kk + lane / 16; or E4M3 (k32 steps).
    uint32_t qf[E4M3 || !kQHeld ? 1 : D / 16][4], q8[E4M3 ? D / 32 : 1][4];
    if constexpr (E4M3) {
      float scale_a, scale_b;
      e4m3_q_fragments<R>(qs, cw, p.q_bf16 != 0, q8, &scale_a, &scale_b);
      sm.mul_a *= scale_a, sm.mul_b *= scale_b;  // the rows' scales multiply their scores
    } else if constexpr (kQHeld) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(smem_u32(qs) + tile_at<D, true, R>(cw * 16 + lane % 16, 2 * kk + lane / 16),
                    qf[kk]);
    }
    if constexpr (kQOverRaw) mbar_arrive(&q_free);  // the producers may copy over the Q tile
    // Addresses the loop would otherwise convert every step: stage s's barriers are 8 s bytes
    // past the first, its K tile's descriptor 2 TILE bytes past stage 0's, its V tile's TILE
    // past its K tile's.
    const uint32_t full0 = smem_u32(full), empty0 = smem_u32(empty);
    const uint32_t k_op0 = smem_u32(k_op(0)), k_lo0 = b128_desc_lo(k_op0, 8192);
    const uint32_t q_lo = b128_desc_lo(smem_u32(qs) + (cw / 4) * 64 * 128, R * 128);
    // The low descriptor word of step st's K tile (its V tile's is TILE >> 4 past it).
    auto k_lo_of = [&](int st) { return k_lo0 + (st % S) * (2 * TILE >> 4); };
    // 16-bit sides at triple tiles and decoded sides at wide tiles one raw step ahead (FP8 and
    // the other byte-wide formats): step st's P V stays in flight while step st + 1's S is
    // issued, so that the tensor cores run the two back to back; step st's stage is released
    // when its P V has completed. Measured on an H100 against waiting for each P V (session
    // 44): 1.4-2.4 % faster on bf16's prompts and chunks (triple tiles), 6.4 % on decoded FP8's
    // extend of 64 tokens (wide tiles); from 1.5 % faster to 10 % slower on the other instances
    // (16-bit sides at wide tiles, decoded ones at triple tiles or three raw steps ahead, E4M3
    // operands). Waiting for step st + 1 while holding step st's stage stalls no producer: their
    // rings of four stages hand step st + 1 over once step st - 1's stage is free. (Narrow
    // tiles' two stages would deadlock 16-bit sides, which hand a step over only after copying
    // the next.)
    constexpr bool kPvInFlight = (!QUANT && R == kTripleRows) ||
                                 (QUANT && !E4M3 && R == kWideRows && A == 1);
    if constexpr (kPvInFlight) {
      uint32_t pa[8][2];
      float sc[8][4];
      auto issue_scores = [&](int st) {  // S of step st, committed once the step has landed
        mbar_wait(full0 + 8 * (st % S), (st / S) & 1);
        if constexpr (kQHeld) wg_qk<KB, D, false>(sc, qf, k_lo_of(st));
        else wg_qk_ss<KB, D, R, false>(sc, q_lo, k_lo_of(st));
      };
      auto issue_pv = [&](int st) { wg_pv_issue<VB, D>(o, pa, k_lo_of(st) + (TILE >> 4)); };
      if (nsteps > 0) {
        issue_scores(0);
        wg_wait_committed(sc);
        sm.template step<VB, D>(sc, base, o, pa);
#pragma unroll 1
        for (int st = 0; st + 1 < nsteps; ++st) {
          issue_pv(st);
          issue_scores(st + 1);
          wg_pv_wait<1, D>(o, pa);  // step st's P V (step st + 1's S may still run)
          mbar_arrive(empty0 + 8 * (st % S));
          wg_wait_committed(sc);
          sm.template step<VB, D>(sc, base + (st + 1) * kTokens, o, pa);
        }
        issue_pv(nsteps - 1);
        wg_pv_wait<0, D>(o, pa);
      }
    } else {
#pragma unroll 1
      for (int st = 0; st < nsteps; ++st) {
        const int s = st % S;
        const uint32_t k_lo = k_lo_of(st);
        mbar_wait(full0 + 8 * s, (st / S) & 1);
        float sc[8][4];
        if constexpr (E4M3) wg_qk_e4m3(sc, q8, k_lo);
        else if constexpr (kQHeld) wg_qk<KB, D>(sc, qf, k_lo);
        else wg_qk_ss<KB, D, R>(sc, q_lo, k_lo);

        uint32_t pa[8][2];
        sm.template step<VB, D, E4M3>(sc, base + st * kTokens, o, pa);

        if constexpr (E4M3) wg_pv_e4m3(o, pa, k_op0 + s * 2 * TILE + TILE);
        else wg_pv<VB, D>(o, pa, k_lo + (TILE >> 4));
        mbar_arrive(empty0 + 8 * s);  // this thread is done with the stage's tiles
      }
    }
    if constexpr (E4M3) {
      // P's factor 2^kE4m3POffset out of l and O.
      constexpr float kInv = 1.f / (1 << (int)kE4m3POffset);
      sm.l_a *= kInv, sm.l_b *= kInv;
      sm.template finish<D>(p, job, o, v_factor * kInv);
    } else {
      sm.template finish<D>(p, job, o, v_factor);
    }
  }

  // One count per thread block that met a fault.
  if (__syncthreads_or(fault || job.bad_len) && tid == 0 && p.counters != nullptr)
    atomicAdd(p.counters + KVQ_COUNTER_OUT_OF_RANGE, 1ull);
#else
  // Built without sm_90a features: the launcher never selects this instance (prefill.cu tells
  // it by its binary version and by the shared memory it declares, none here); were it run,
  // every row would be left unwritten, so count it.
  if (threadIdx.x == 0 && p.counters != nullptr)
    atomicAdd(p.counters + KVQ_COUNTER_OUT_OF_RANGE, 1ull);
#endif
}

}  // namespace kvq_prefill
