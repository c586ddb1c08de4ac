//! GPU append, gather-dequantize and dense quantize / dequantize against the CPU reference, bit
//! for bit: every format pair, head_dim 64/128/256, block_size 16/32/64, f32/f16/bf16 inputs,
//! random and edge values; `int8-pth` at every kind of head_dim (rows that tile warps, straddle
//! them or span several), the dense `int8-pth` / `fp4-e2m1` tensors at several head dims, and
//! the dense `int4-kc` tensors (groups along tokens, a partial last group).
//! Without a GPU each test prints `SKIPPED: no GPU` and passes, unless `KVQ_REQUIRE_GPU=1` (then
//! it fails).
#![cfg(feature = "cuda")]

mod common;

use common::Input;
use half::{bf16, f16};
use kvq::cache::{BlockAllocator, HostCache, POISON};
use kvq::cuda::ops::{self, DeviceElement, DeviceQuantized};
use kvq::cuda::{DeviceCache, Gpu, require_gpu_or_skip};
use kvq::dense::{self, DenseFormat, Fp8ScaleChoice};
use kvq::{CacheConfig, Element, Error, KvFormat, ScaleGranularity};

// ---- inputs ------------------------------------------------------------------------------

/// SplitMix64: a small deterministic generator (tests must be reproducible).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Roughly normal, with a random magnitude per call site decided by the caller.
    fn normal(&mut self) -> f32 {
        (0..4).map(|_| self.uniform()).sum::<f32>() - 2.0
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// Random rows of `head_dim` values, each row with its own magnitude (1e-6 .. 1e4) so small,
/// subnormal-scale and large groups all occur.
fn random_rows(rng: &mut Rng, rows: usize, head_dim: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * head_dim);
    for _ in 0..rows {
        let mag = 10f32.powf(rng.uniform() * 10.0 - 6.0);
        let offset = if rng.below(4) == 0 { mag * 3.0 } else { 0.0 };
        out.extend((0..head_dim).map(|_| rng.normal() * mag + offset));
    }
    out
}

/// Rows that probe every rounding edge of FORMATS.md, for FP8 head scale `s` (the same for
/// every head in the edge tests). Each row is `head_dim` long; rows cycle through the cases.
fn edge_rows(rows: usize, head_dim: usize, s: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * head_dim);
    for r in 0..rows {
        let row: Vec<f32> = (0..head_dim)
            .map(|i| {
                let j = i as f32;
                match r % 14 {
                    0 => 0.0,
                    // Signed zeros in both orders: the sign of an affine zero / scale depends on
                    // which comes first.
                    1 => {
                        if i % 3 == 0 {
                            -0.0
                        } else {
                            0.0
                        }
                    }
                    2 => {
                        if i % 2 == 0 {
                            0.0
                        } else {
                            -0.0
                        }
                    }
                    3 => [1.0, -0.0, 0.0, 2.0][i % 4],
                    4 => [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1.5][i % 4],
                    5 => [65504.0, -65504.0, 1e6, -1e30, 3.0][i % 5],
                    // Subnormal f16 scales: amax / 7 below 6.1e-5.
                    6 => (j - 20.0) * 1e-6,
                    7 => (j - 30.0) * 3e-8,
                    // FP8 saturation and rounding boundaries after scaling.
                    8 => {
                        [
                            448.0,
                            464.0,
                            480.0,
                            -449.0,
                            57344.0,
                            61440.0,
                            -1e9,
                            0.001953125,
                        ][i % 8]
                            * s
                    }
                    9 => [0.5, 1.5, 2.5, -0.5, -1.5, 3.5, -6.5, 7.0][i % 8],
                    // Affine ties: min 0, max 15 → scale 1, zero 0.
                    10 => [0.0, 15.0, 0.5, 1.5, 2.5, 14.5, 7.5, 8.5][i % 8],
                    11 => (j * 0.37).sin() * 1000.0,
                    12 => 2f32.powi(-10) * s * [1.0, 3.0, 5.0, -1.0][i % 4],
                    _ => -(j + 1.0) * 0.01,
                }
            })
            .collect();
        out.extend(row);
    }
    out
}

fn to_input<T: Input>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

// ---- comparison helpers -------------------------------------------------------------------

/// First differing pool byte, described by block / head / region / row, or None when equal.
fn pool_mismatch(host: &HostCache, dev: &HostCache) -> Option<String> {
    let (a, b) = (host.pool(), dev.pool());
    let at = a.iter().zip(b).position(|(x, y)| x != y)?;
    let l = host.layout();
    let block = at / l.block_stride;
    let head = at % l.block_stride / l.head_stride;
    let off = at % l.head_stride;
    let region = [
        ("K codes", l.k_codes),
        ("K meta", l.k_meta),
        ("V codes", l.v_codes),
        ("V meta", l.v_meta),
    ]
    .into_iter()
    .rfind(|(_, r)| r.offset <= off)
    .map(|(n, r)| {
        let row = (off - r.offset).checked_div(r.row_bytes).unwrap_or(0);
        format!(
            "{n} row {row} byte {}",
            (off - r.offset) - row * r.row_bytes
        )
    })
    .unwrap_or_default();
    let diffs = a.iter().zip(b).filter(|(x, y)| x != y).count();
    Some(format!(
        "{:?}: {diffs} byte(s) differ; first at {at} (block {block}, head {head}, {region}): cpu {:#04x} gpu {:#04x}",
        host.config(),
        a[at],
        b[at]
    ))
}

fn assert_bits_eq(what: &str, cpu: &[f32], gpu: &[f32]) {
    assert_eq!(cpu.len(), gpu.len(), "{what}: lengths");
    if let Some(i) = cpu
        .iter()
        .zip(gpu)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!(
            "{what}: element {i} cpu {} ({:#010x}) gpu {} ({:#010x})",
            cpu[i],
            cpu[i].to_bits(),
            gpu[i],
            gpu[i].to_bits()
        );
    }
}

fn download<T: DeviceElement>(gpu: &Gpu, x: &cudarc::driver::CudaSlice<T>) -> Vec<T> {
    gpu.stream().clone_dtoh(x).expect("download")
}

// ---- append ------------------------------------------------------------------------------

/// The K / V values of an append test.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Data {
    /// `random_rows`, FP8 scales calibrated per head.
    Random,
    /// `edge_rows` (K, and V in reverse), FP8 scale 0.25.
    Edge,
    /// The append bench's values: 2001 values 0.01 apart in [-10, 10], FP8 scale 10 / 448, so that
    /// many elements sit exactly on rounding ties of x / scale (every warp takes the encoders'
    /// exact fallbacks).
    Grid,
}

/// Finite values of `k` and `v` (`[tokens, kv_heads, head_dim]`) past what `host`'s sides hold:
/// ±65504, and with a head scale that scale times the largest code. The elements
/// `HostCache::write_strict` refuses, which the appends count as saturated.
fn saturated_count<T: Element>(host: &HostCache, k: &[T], v: &[T]) -> u64 {
    let c = host.config();
    let mut n = 0u64;
    for (format, scales, x) in [
        (c.k_format, host.k_scales(), k),
        (c.v_format, host.v_scales(), v),
    ] {
        for (row, scale) in x.chunks_exact(c.head_dim).zip(scales.iter().cycle()) {
            let limit = format
                .head_scale()
                .map_or(65504.0, |h| (h.max_value() * scale).min(65504.0));
            let past = |e: &&T| e.to_f32().is_finite() && e.to_f32().abs() > limit;
            n += row.iter().filter(past).count() as u64;
        }
    }
    n
}

/// One append round-trip: K/V of `data` for `tokens` tokens, some of them padding (slot -1), into
/// shuffled slots; GPU pool bytes and the non-finite and saturated counts must equal the CPU's,
/// and the whole pool gathered as one sequence must dequantize to the CPU's values bit for
/// bit.
fn check_append<T: Input>(gpu: &Gpu, config: CacheConfig, tokens: usize, seed: u64, data: Data) {
    let num_blocks = 3 + tokens / config.block_size;
    let mut rng = Rng(seed);
    let row = config.num_kv_heads * config.head_dim;
    let rows = tokens * config.num_kv_heads;
    let grid = |i: usize| ((i * 2_654_435_761) % 2001) as f32 / 100.0 - 10.0;
    let (k32, v32, fp8_scale): (Vec<f32>, Vec<f32>, Option<f32>) = match data {
        Data::Random => (
            random_rows(&mut rng, rows, config.head_dim),
            random_rows(&mut rng, rows, config.head_dim),
            None,
        ),
        Data::Edge => (
            edge_rows(rows, config.head_dim, 0.25),
            edge_rows(rows, config.head_dim, 0.25)
                .into_iter()
                .rev()
                .collect(),
            Some(0.25),
        ),
        Data::Grid => (
            (0..rows * config.head_dim).map(grid).collect(),
            (0..rows * config.head_dim).map(|i| grid(i + 977)).collect(),
            Some(10.0 / 448.0),
        ),
    };
    let (k, v) = (to_input::<T>(&k32), to_input::<T>(&v32));

    let mut host = HostCache::new(config, num_blocks).unwrap();
    if let Some(s) = fp8_scale {
        let s = vec![s; config.num_kv_heads];
        host.set_scales(&s, &s).unwrap();
    } else {
        host.calibrate_fp8_scales(&k, &v, ScaleGranularity::PerHead)
            .unwrap();
    }
    let mut dev = DeviceCache::new(gpu, config, num_blocks).unwrap();
    dev.set_scales(host.k_scales(), host.v_scales()).unwrap();

    // Slot mapping: shuffled pool slots, every 7th token padding.
    let mut pool_slots: Vec<usize> = (0..host.num_slots()).collect();
    rng.shuffle(&mut pool_slots);
    let mapping: Vec<i64> = (0..tokens)
        .map(|t| if t % 7 == 3 { -1 } else { pool_slots[t] as i64 })
        .collect();
    let kept: Vec<usize> = (0..tokens).filter(|&t| mapping[t] >= 0).collect();
    let pick = |x: &[T]| -> Vec<T> {
        kept.iter()
            .flat_map(|&t| x[t * row..(t + 1) * row].iter().copied())
            .collect()
    };
    let host_slots: Vec<usize> = kept.iter().map(|&t| mapping[t] as usize).collect();
    let non_finite = host.write(&host_slots, &pick(&k), &pick(&v)).unwrap();
    let saturated = saturated_count(&host, &pick(&k), &pick(&v));
    if non_finite == 0 {
        // The same rule as the library's strict write.
        let mut strict = HostCache::new(config, num_blocks).unwrap();
        strict.set_scales(host.k_scales(), host.v_scales()).unwrap();
        match strict.write_strict(&host_slots, &pick(&k), &pick(&v)) {
            Ok(()) => assert_eq!(saturated, 0, "{config:?}"),
            Err(Error::Saturated { count, .. }) => assert_eq!(count, saturated, "{config:?}"),
            Err(e) => panic!("{config:?}: {e}"),
        }
    }

    let s = gpu.stream();
    let slots_d = s.clone_htod(&mapping).unwrap();
    let (k_d, v_d) = (s.clone_htod(&k).unwrap(), s.clone_htod(&v).unwrap());
    ops::append(&mut dev, &slots_d, &k_d, &v_d, tokens).unwrap();
    let counted = dev.take_counters().unwrap();
    assert_eq!(counted.out_of_range, 0, "{config:?}: faults");
    let back = dev.to_host().unwrap();
    if let Some(m) = pool_mismatch(&host, &back) {
        panic!(
            "append ({} input, {data:?} data): {m}",
            std::any::type_name::<T>()
        );
    }
    // Padding tokens' inputs are not counted (they are not quantized).
    assert_eq!(
        counted.non_finite, non_finite,
        "{config:?}: non-finite count"
    );
    assert_eq!(counted.saturated, saturated, "{config:?}: saturated count");
    if data == Data::Edge {
        // The edge rows hold values past ±65504 (and, with FP8 / FP4 sides, past their scale's
        // largest code) for f32 and bf16 inputs: the count above is not trivially zero.
        let wide = std::any::type_name::<T>() != std::any::type_name::<f16>();
        let scaled =
            config.k_format.head_scale().is_some() || config.v_format.head_scale().is_some();
        assert!(
            !(wide || scaled) || saturated > 0,
            "{config:?}: nothing saturated"
        );
    }

    // Dequantize everything (written rows and poison alike) as one long sequence.
    let table: Vec<i32> = (0..num_blocks as i32).collect();
    let len = host.num_slots();
    let mut hk = vec![0f32; len * row];
    let mut hv = vec![0f32; len * row];
    host.gather(&table, len, &mut hk, &mut hv).unwrap();
    let (gk, gv) = ops::gather_dequantize::<f32>(&dev, &table, len).unwrap();
    assert_bits_eq("gather k f32", &hk, &download(gpu, &gk));
    assert_bits_eq("gather v f32", &hv, &download(gpu, &gv));
    let (gk16, _) = ops::gather_dequantize::<f16>(&dev, &table, len).unwrap();
    let want: Vec<u16> = hk.iter().map(|&x| f16::from_f32(x).to_bits()).collect();
    let got: Vec<u16> = download(gpu, &gk16).iter().map(|x| x.to_bits()).collect();
    assert!(want == got, "{config:?}: gather k as f16 differs");
    let (_, gvb) = ops::gather_dequantize::<bf16>(&dev, &table, len).unwrap();
    let want: Vec<u16> = hv.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
    let got: Vec<u16> = download(gpu, &gvb).iter().map(|x| x.to_bits()).collect();
    assert!(want == got, "{config:?}: gather v as bf16 differs");
}

/// Every format values may take (int4-kc is keys only).
fn value_formats() -> impl Iterator<Item = KvFormat> {
    KvFormat::ALL.into_iter().filter(|f| !f.block_groups())
}

#[test]
fn append_matches_cpu_every_format_pair_and_shape() {
    let Some(gpu) = require_gpu_or_skip("append_matches_cpu_every_format_pair_and_shape") else {
        return;
    };
    let mut seed = 1;
    let mut configs = 0;
    for head_dim in [64, 128, 256] {
        for block_size in [16, 32, 64] {
            for kf in KvFormat::ALL {
                for vf in value_formats() {
                    let c = CacheConfig::new(2, head_dim, block_size, kf, vf).unwrap();
                    let tokens = block_size + 19;
                    seed += 1;
                    match seed % 3 {
                        0 => check_append::<f32>(&gpu, c, tokens, seed, Data::Random),
                        1 => check_append::<f16>(&gpu, c, tokens, seed, Data::Random),
                        _ => check_append::<bf16>(&gpu, c, tokens, seed, Data::Random),
                    }
                    configs += 1;
                }
            }
        }
    }
    assert_eq!(
        configs,
        3 * 3 * KvFormat::ALL.len() * value_formats().count()
    );
}

#[test]
fn append_edge_values_match_cpu() {
    let Some(gpu) = require_gpu_or_skip("append_edge_values_match_cpu") else {
        return;
    };
    for head_dim in [64, 128, 256] {
        for kf in KvFormat::ALL {
            for vf in [KvFormat::Int4Affine64, kf]
                .into_iter()
                .filter(|f| !f.block_groups())
            {
                let c = CacheConfig::new(3, head_dim, 16, kf, vf).unwrap();
                check_append::<f32>(&gpu, c, 40, 7, Data::Edge);
                check_append::<f16>(&gpu, c, 40, 8, Data::Edge);
                check_append::<bf16>(&gpu, c, 40, 9, Data::Edge);
            }
        }
    }
}

/// Long appends: 20,000 tokens of 8 KV heads, thousands of thread blocks, for every format and
/// input type; then the bench's grid data, on whose rounding ties most warps take the encoders'
/// exact fallbacks (INT4 per undecided word, FP8 per undecided pair).
#[test]
fn long_appends_match_cpu() {
    let Some(gpu) = require_gpu_or_skip("long_appends_match_cpu") else {
        return;
    };
    use KvFormat::*;
    let pairs = [
        (Int4Sym32, Int4Affine64),
        (Fp8E4m3, Fp8E4m3),
        (Fp8E5m2, Int4Affine64),
        (F16, Bf16),
    ];
    for (i, (kf, vf)) in pairs.into_iter().enumerate() {
        let c = CacheConfig::new(8, 128, 16, kf, vf).unwrap();
        let seed = 100 + i as u64;
        match i % 3 {
            0 => check_append::<f16>(&gpu, c, 20_000, seed, Data::Random),
            1 => check_append::<f32>(&gpu, c, 20_000, seed, Data::Random),
            _ => check_append::<bf16>(&gpu, c, 20_000, seed, Data::Random),
        }
    }
    // Every input type with INT4 on both sides (the kernel differs per input type).
    let c = CacheConfig::new(8, 128, 16, Int4Sym32, Int4Affine64).unwrap();
    check_append::<f32>(&gpu, c, 20_000, 7, Data::Random);
    check_append::<bf16>(&gpu, c, 20_000, 8, Data::Random);
    for (kf, vf) in [(Int4Sym32, Int4Affine64), (Fp8E4m3, Fp8E5m2)] {
        let c = CacheConfig::new(8, 128, 16, kf, vf).unwrap();
        check_append::<f16>(&gpu, c, 20_000, 9, Data::Grid);
        check_append::<bf16>(&gpu, c, 20_000, 10, Data::Grid);
    }
}

#[test]
fn i32_and_i64_slot_mappings_agree() {
    let Some(gpu) = require_gpu_or_skip("i32_and_i64_slot_mappings_agree") else {
        return;
    };
    let c = CacheConfig::new(4, 128, 16, KvFormat::Int4Sym32, KvFormat::Int4Affine64).unwrap();
    let mut rng = Rng(11);
    let k: Vec<f16> = to_input(&random_rows(&mut rng, 20 * 4, 128));
    let v: Vec<f16> = to_input(&random_rows(&mut rng, 20 * 4, 128));
    let slots: Vec<i64> = (0..20).map(|t| (t * 3 % 64) as i64).collect();
    let s = gpu.stream();
    let (k_d, v_d) = (s.clone_htod(&k).unwrap(), s.clone_htod(&v).unwrap());
    let mut a = DeviceCache::new(&gpu, c, 4).unwrap();
    let mut b = DeviceCache::new(&gpu, c, 4).unwrap();
    ops::append(&mut a, &s.clone_htod(&slots).unwrap(), &k_d, &v_d, 20).unwrap();
    let slots32: Vec<i32> = slots.iter().map(|&x| x as i32).collect();
    ops::append(&mut b, &s.clone_htod(&slots32).unwrap(), &k_d, &v_d, 20).unwrap();
    assert!(a.to_host().unwrap().pool() == b.to_host().unwrap().pool());
}

/// Several sequences grow in interleaved rounds through one allocator; after the appends the
/// pool equals the CPU's and every slot never written still holds POISON in every region.
#[test]
fn shared_pool_keeps_poison_outside_written_slots() {
    let Some(gpu) = require_gpu_or_skip("shared_pool_keeps_poison_outside_written_slots") else {
        return;
    };
    for (kf, vf) in [
        (KvFormat::Int4Sym32, KvFormat::Int4Affine64),
        (KvFormat::Fp8E4m3, KvFormat::Fp8E5m2),
        (KvFormat::F16, KvFormat::Bf16),
    ] {
        let c = CacheConfig::new(2, 128, 16, kf, vf).unwrap();
        let num_blocks = 40;
        let mut alloc = BlockAllocator::new(num_blocks, 16).unwrap();
        let mut host = HostCache::new(c, num_blocks).unwrap();
        let mut dev = DeviceCache::new(&gpu, c, num_blocks).unwrap();
        let seqs: Vec<_> = (0..5).map(|_| alloc.create_sequence()).collect();
        let mut rng = Rng(99);
        let row = c.num_kv_heads * c.head_dim;
        let mut written = vec![false; num_blocks * 16];
        let s = gpu.stream();
        for round in 0..6 {
            // Each round: a batch with one entry per sequence (1..20 tokens) plus padding.
            let mut mapping: Vec<i64> = Vec::new();
            for (i, &seq) in seqs.iter().enumerate() {
                let n = if round == 0 {
                    1 + rng.below(20)
                } else {
                    1 + (i + round) % 3
                };
                let r = alloc.reserve(seq, n).unwrap();
                assert!(r.copies.is_empty());
                mapping.extend(r.slots.iter().map(|&x| x as i64));
                mapping.push(-1); // padding between requests
            }
            let tokens = mapping.len();
            let k: Vec<bf16> = to_input(&random_rows(&mut rng, tokens * 2, 128));
            let v: Vec<bf16> = to_input(&random_rows(&mut rng, tokens * 2, 128));
            let kept: Vec<usize> = (0..tokens).filter(|&t| mapping[t] >= 0).collect();
            let pick = |x: &[bf16]| -> Vec<bf16> {
                kept.iter()
                    .flat_map(|&t| x[t * row..(t + 1) * row].iter().copied())
                    .collect()
            };
            let slots: Vec<usize> = kept.iter().map(|&t| mapping[t] as usize).collect();
            for &sl in &slots {
                written[sl] = true;
            }
            host.write(&slots, &pick(&k), &pick(&v)).unwrap();
            let (k_d, v_d) = (s.clone_htod(&k).unwrap(), s.clone_htod(&v).unwrap());
            let m_d = s.clone_htod(&mapping).unwrap();
            ops::append(&mut dev, &m_d, &k_d, &v_d, tokens).unwrap();
        }
        assert_eq!(dev.check_appends().unwrap(), 0);
        let back = dev.to_host().unwrap();
        if let Some(m) = pool_mismatch(&host, &back) {
            panic!("shared pool: {m}");
        }
        let l = *back.layout();
        let mut unwritten = 0;
        for (slot, _) in written.iter().enumerate().filter(|(_, w)| !**w) {
            let (block, off) = l.split_slot(slot);
            for h in 0..c.num_kv_heads {
                let sec = l.head_section(block, h);
                for r in [l.k_codes, l.k_meta, l.v_codes, l.v_meta] {
                    let bytes = &back.pool()[sec + r.row(off)..][..r.row_bytes];
                    assert!(
                        bytes.iter().all(|&b| b == POISON),
                        "slot {slot} head {h}: an unwritten row lost its poison"
                    );
                }
            }
            unwritten += 1;
        }
        assert!(
            unwritten > num_blocks * 16 / 2,
            "test should leave most slots unwritten"
        );
    }
}

/// Engines pass views into a fused QKV buffer: tokens `3 * row` elements apart.
#[test]
fn raw_append_with_token_stride_matches_cpu() {
    let Some(gpu) = require_gpu_or_skip("raw_append_with_token_stride_matches_cpu") else {
        return;
    };
    use cudarc::driver::DevicePtr;
    let c = CacheConfig::new(2, 64, 32, KvFormat::Fp8E4m3, KvFormat::Int4Affine64).unwrap();
    let (tokens, row) = (50, 2 * 64);
    let mut rng = Rng(5);
    let qkv: Vec<f16> = to_input(&random_rows(&mut rng, tokens * 3 * 2, 64));
    let k: Vec<f16> = (0..tokens)
        .flat_map(|t| {
            qkv[t * 3 * row + row..t * 3 * row + 2 * row]
                .iter()
                .copied()
        })
        .collect();
    let v: Vec<f16> = (0..tokens)
        .flat_map(|t| {
            qkv[t * 3 * row + 2 * row..t * 3 * row + 3 * row]
                .iter()
                .copied()
        })
        .collect();
    let slots: Vec<usize> = (0..tokens).map(|t| (t * 5) % 128).collect();
    let mut host = HostCache::new(c, 4).unwrap();
    host.set_scales(&[0.01, 0.02], &[1.0, 1.0]).unwrap();
    host.write(&slots, &k, &v).unwrap();

    let mut dev = DeviceCache::new(&gpu, c, 4).unwrap();
    dev.set_scales(host.k_scales(), host.v_scales()).unwrap();
    let s = gpu.stream();
    let qkv_d = s.clone_htod(&qkv).unwrap();
    let slots_d = s
        .clone_htod(&slots.iter().map(|&x| x as i32).collect::<Vec<_>>())
        .unwrap();
    let raw = dev.as_raw();
    {
        let (base, _g1) = qkv_d.device_ptr(s);
        let (sl, _g2) = slots_d.device_ptr(s);
        let elem = std::mem::size_of::<f16>() as u64;
        // SAFETY: the cache view is live, the buffers hold `tokens` rows at stride 3 * row, and
        // the launch is on the cache's stream.
        unsafe {
            ops::append_raw(
                &ops::RawAppendArgs {
                    cache: raw,
                    num_blocks: 4,
                    slots: sl,
                    slots_i64: false,
                    num_tokens: tokens,
                    k: base + row as u64 * elem,
                    v: base + 2 * row as u64 * elem,
                    dtype: ops::Dtype::F16,
                    k_token_stride: 3 * row,
                    v_token_stride: 3 * row,
                    counters: 0,
                },
                s.cu_stream(),
            )
            .unwrap();
        }
    }
    let back = dev.to_host().unwrap();
    if let Some(m) = pool_mismatch(&host, &back) {
        panic!("strided append: {m}");
    }
}

/// The safe appends take views: K and V straight out of a fused QKV buffer (token rows
/// interleaved: `append_strided`; `[Q | K | V]` blocks: `append`), the step's part of a larger
/// slot mapping. A view that is misaligned or too short is a typed error.
#[test]
fn safe_append_takes_views() {
    let Some(gpu) = require_gpu_or_skip("safe_append_takes_views") else {
        return;
    };
    let c = CacheConfig::new(2, 64, 32, KvFormat::Int4Sym32, KvFormat::Fp8E4m3).unwrap();
    let (tokens, row) = (40, 2 * 64);
    let mut rng = Rng(6);
    // Interleaved: token t's q, k, v rows at t * 3 * row + (0, 1, 2) * row.
    let qkv: Vec<f16> = to_input(&random_rows(&mut rng, tokens * 3 * 2, 64));
    let part = |p: usize| -> Vec<f16> {
        (0..tokens)
            .flat_map(|t| {
                qkv[(3 * t + p) * row..(3 * t + p + 1) * row]
                    .iter()
                    .copied()
            })
            .collect()
    };
    let (k, v) = (part(1), part(2));
    let slots: Vec<usize> = (0..tokens).map(|t| (t * 7) % 128).collect();
    let mut host = HostCache::new(c, 4).unwrap();
    host.set_scales(&[1.0, 1.0], &[0.02, 0.03]).unwrap();
    host.write(&slots, &k, &v).unwrap();

    let s = gpu.stream();
    // The step's slots sit after another step's 5 in one mapping buffer.
    let mut mapping = vec![-1i64; 5];
    mapping.extend(slots.iter().map(|&x| x as i64));
    let mapping = s.clone_htod(&mapping).unwrap();
    let step_slots = mapping.slice(5..);

    let qkv_d = s.clone_htod(&qkv).unwrap();
    let mut dev = DeviceCache::new(&gpu, c, 4).unwrap();
    dev.set_scales(host.k_scales(), host.v_scales()).unwrap();
    ops::append_strided(
        &mut dev,
        &step_slots,
        &qkv_d.slice(row..),
        3 * row,
        &qkv_d.slice(2 * row..),
        3 * row,
        tokens,
    )
    .unwrap();
    if let Some(m) = pool_mismatch(&host, &dev.to_host().unwrap()) {
        panic!("append_strided of QKV views: {m}");
    }

    // [Q | K | V] blocks of one allocation: contiguous K and V views.
    let mut blocks = vec![f16::ZERO; tokens * row];
    blocks.extend_from_slice(&k);
    blocks.extend_from_slice(&v);
    let blocks_d = s.clone_htod(&blocks).unwrap();
    let (kv, vv) = (
        blocks_d.slice(tokens * row..2 * tokens * row),
        blocks_d.slice(2 * tokens * row..),
    );
    let mut dev = DeviceCache::new(&gpu, c, 4).unwrap();
    dev.set_scales(host.k_scales(), host.v_scales()).unwrap();
    ops::append(&mut dev, &step_slots, &kv, &vv, tokens).unwrap();
    if let Some(m) = pool_mismatch(&host, &dev.to_host().unwrap()) {
        panic!("append of [Q | K | V] views: {m}");
    }

    // A view starting one f16 in is not 16-byte aligned; one row short is too short.
    let r = ops::append(&mut dev, &step_slots, &blocks_d.slice(1..), &vv, tokens);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    let r = ops::append(&mut dev, &step_slots, &kv, &vv.slice(row..), tokens);
    assert!(matches!(r, Err(Error::Length { .. })), "{r:?}");
    let r = ops::append_strided(
        &mut dev,
        &step_slots,
        &qkv_d.slice(row..),
        3 * row,
        &qkv_d.slice(2 * row..),
        3 * row,
        tokens + 1,
    );
    assert!(matches!(r, Err(Error::Length { .. })), "{r:?}");
    assert_eq!(dev.check_appends().unwrap(), 0);
}

#[test]
fn out_of_range_slot_is_reported_and_skipped() {
    let Some(gpu) = require_gpu_or_skip("out_of_range_slot_is_reported_and_skipped") else {
        return;
    };
    let c = CacheConfig::new(1, 64, 16, KvFormat::Int4Sym32, KvFormat::Int4Affine64).unwrap();
    let mut dev = DeviceCache::new(&gpu, c, 2).unwrap();
    let s = gpu.stream();
    let x = s.clone_htod(&vec![f16::ONE; 3 * 64]).unwrap();
    let slots = s.clone_htod(&[0i64, 32, 1]).unwrap(); // 32 == num_slots
    ops::append(&mut dev, &slots, &x, &x, 3).unwrap();
    let err = dev.check_appends().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // The valid tokens were written, and the counters were reset by the check.
    let mut host = HostCache::new(c, 2).unwrap();
    let one = vec![f16::ONE; 2 * 64];
    host.write(&[0, 1], &one, &one).unwrap();
    assert!(pool_mismatch(&host, &dev.to_host().unwrap()).is_none());
    assert_eq!(dev.check_appends().unwrap(), 0);
}

#[test]
fn bad_arguments_are_typed_errors() {
    let Some(gpu) = require_gpu_or_skip("bad_arguments_are_typed_errors") else {
        return;
    };
    let c = CacheConfig::new(2, 64, 16, KvFormat::F16, KvFormat::F16).unwrap();
    let mut dev = DeviceCache::new(&gpu, c, 2).unwrap();
    let s = gpu.stream();
    let x = s.clone_htod(&vec![0f32; 2 * 128]).unwrap();
    let slots = s.clone_htod(&[0i32, 1, 2]).unwrap();
    let r = ops::append(&mut dev, &slots, &x, &x, 3);
    assert!(matches!(r, Err(Error::Length { .. })), "{r:?}");
    let r = ops::append(&mut dev, &slots, &x, &x, 4);
    assert!(
        matches!(r, Err(Error::Length { what: "slots", .. })),
        "{r:?}"
    );
    let r = ops::gather_dequantize::<f32>(&dev, &[0, 2], 20);
    assert!(
        matches!(r, Err(Error::BlockIndex { block: 2, .. })),
        "{r:?}"
    );
    let r = ops::gather_dequantize::<f32>(&dev, &[0], 20);
    assert!(matches!(r, Err(Error::Length { .. })), "{r:?}");
    let big = CacheConfig::new(1, 4096, 16, KvFormat::F16, KvFormat::F16).unwrap();
    assert!(matches!(
        DeviceCache::new(&gpu, big, 1),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        dev.set_scales(&[1.0], &[1.0, 1.0]),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        dev.set_scales(&[1.0, f32::NAN], &[1.0, 1.0]),
        Err(Error::Scale { .. })
    ));
    let d = s.clone_htod(&vec![0f32; 100]).unwrap();
    let r = ops::quantize_dense(
        &gpu,
        DenseFormat::Int4K32,
        &d,
        &[2, 64],
        Fp8ScaleChoice::default(),
    );
    assert!(matches!(r, Err(Error::Length { .. })), "{r:?}");
}

// ---- dense --------------------------------------------------------------------------------

/// Index of the first byte where `a` and `b` differ (or where the shorter ends), None if equal.
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

/// Dense quantize on the GPU against `dense::quantize` (every part's bytes, the non-finite
/// count), dequantize of the host's tensor against `dense::dequantize` (f32, bit for bit), and
/// dequantize of the GPU's tensor to f16. Random rows, every 5th element replaced by an edge
/// value (NaN, ±Inf, ±65504, 1e6, -1e30, ties, subnormal-scale values, signed zeros).
fn check_dense<T: Input>(gpu: &Gpu, format: DenseFormat, shape: &[usize], choice: Fp8ScaleChoice) {
    let n: usize = shape.iter().product();
    let d = *shape.last().unwrap();
    let mut rng = Rng(n as u64 + d as u64);
    let mut x32 = random_rows(&mut rng, n / d, d);
    // Edge rows in the middle of the tensor.
    let edges = edge_rows(n / d, d, 0.5);
    for (i, e) in edges.iter().enumerate().filter(|(i, _)| i % 5 == 0) {
        x32[i] = *e;
    }
    let x = to_input::<T>(&x32);
    let want = dense::quantize(format, &x, shape, choice).unwrap();
    let x_d = gpu.stream().clone_htod(&x).unwrap();
    let got = ops::quantize_dense(gpu, format, &x_d, shape, choice).unwrap();
    let what = format!(
        "{format} {shape:?} {choice:?} {}",
        std::any::type_name::<T>()
    );
    assert_eq!(
        got.non_finite().unwrap(),
        want.non_finite(),
        "{what}: non-finite"
    );
    let got_host = got.to_host().unwrap();
    if let Some(i) = first_difference(want.codes().data(), got_host.codes().data()) {
        panic!("{what}: codes differ first at byte {i}");
    }
    assert_eq!(want.codes(), got_host.codes(), "{what}: codes (shape)");
    if let Some(i) = first_difference(want.scales().data(), got_host.scales().data()) {
        panic!("{what}: scales differ first at byte {i}");
    }
    assert_eq!(
        want.scales(),
        got_host.scales(),
        "{what}: scales (dtype, shape)"
    );
    assert!(want.zeros() == got_host.zeros(), "{what}: zeros differ");
    assert_eq!(
        want.global_scales(),
        got_host.global_scales(),
        "{what}: global scales differ"
    );

    let deq = dense::dequantize(&want);
    let up = DeviceQuantized::from_host(gpu, &want).unwrap();
    let back = ops::dequantize_dense::<f32>(gpu, &up).unwrap();
    assert_bits_eq(&format!("{what}: dequantize"), &deq, &download(gpu, &back));
    let back16 = ops::dequantize_dense::<f16>(gpu, &got).unwrap();
    let want16: Vec<u16> = deq.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    let got16: Vec<u16> = download(gpu, &back16).iter().map(|v| v.to_bits()).collect();
    assert!(want16 == got16, "{what}: dequantize to f16 differs");
}

#[test]
fn dense_quantize_and_dequantize_match_cpu() {
    let Some(gpu) = require_gpu_or_skip("dense_quantize_and_dequantize_match_cpu") else {
        return;
    };
    for format in DenseFormat::ALL {
        let choices: &[Fp8ScaleChoice] = if format.fp8_kind().is_some() {
            &[
                Fp8ScaleChoice::Fixed(0.37),
                Fp8ScaleChoice::PerTensorAmax,
                Fp8ScaleChoice::PerHeadAmax,
            ]
        } else {
            &[Fp8ScaleChoice::PerTensorAmax]
        };
        let mut shapes = vec![vec![5, 3, 128], vec![7, 64], vec![2, 2, 256]];
        if format == DenseFormat::Int4Uniform {
            shapes.push(vec![3, 6]); // head_dim not a multiple of 8: the tail path
            shapes.push(vec![1, 2]);
        }
        for shape in &shapes {
            for &choice in choices {
                check_dense::<f32>(&gpu, format, shape, choice);
                check_dense::<f16>(&gpu, format, shape, choice);
                check_dense::<bf16>(&gpu, format, shape, choice);
            }
        }
    }
}

/// `int8-pth` and `fp4-e2m1` dense tensors at head dims of every kind the GPU takes. INT8 rows
/// are head_dim / 16 lanes: 5, 6, 7, 12, 20 and 36 lanes (80 .. 576) straddle warps and 64 or
/// 128 (1024, 2048) span several, so their amax goes through shared memory; the others use
/// shuffles. FP4 at multiples of 32 up to 2048. 37 x 3 rows: several thread blocks, rows of
/// three heads (FP4's global scale per head differs: the edge rows put ±Inf and 1e30 in some
/// heads only); rank 1 is one head. f32, f16 and bf16 inputs.
#[test]
fn dense_int8_and_fp4_match_cpu_at_every_head_dim() {
    let Some(gpu) = require_gpu_or_skip("dense_int8_and_fp4_match_cpu_at_every_head_dim") else {
        return;
    };
    let int8_dims = [
        16, 32, 48, 80, 96, 112, 128, 192, 256, 320, 512, 576, 1024, 2048,
    ];
    let fp4_dims = [32, 64, 96, 128, 160, 192, 256, 320, 576, 1024, 2048];
    let mut checked = 0;
    for (format, dims) in [
        (DenseFormat::Int8Pth, &int8_dims[..]),
        (DenseFormat::Fp4E2m1, &fp4_dims[..]),
    ] {
        for &d in dims {
            for shape in [vec![37, 3, d], vec![d]] {
                let choice = Fp8ScaleChoice::default();
                check_dense::<f32>(&gpu, format, &shape, choice);
                check_dense::<f16>(&gpu, format, &shape, choice);
                check_dense::<bf16>(&gpu, format, &shape, choice);
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 2 * (int8_dims.len() + fp4_dims.len()));
}

/// What the dense GPU path refuses for `int8-pth` and `fp4-e2m1`, as typed errors before any
/// launch: a head_dim off the format's multiple, one past the GPU's largest, a scale choice
/// other than the default, an empty head axis, data of the wrong length.
#[test]
fn dense_int8_and_fp4_bad_arguments_are_typed_errors() {
    let Some(gpu) = require_gpu_or_skip("dense_int8_and_fp4_bad_arguments_are_typed_errors") else {
        return;
    };
    let s = gpu.stream();
    let default = Fp8ScaleChoice::default();
    let q = |format, shape: &[usize], choice| {
        // Data of the shape's length, so that only the tested rule can refuse it.
        let n = shape.iter().product::<usize>().max(1);
        let x = s.clone_htod(&vec![1.0f32; n]).unwrap();
        ops::quantize_dense(&gpu, format, &x, shape, choice)
    };
    for (format, off_multiple) in [(DenseFormat::Int8Pth, 24), (DenseFormat::Fp4E2m1, 48)] {
        let r = q(format, &[2, off_multiple], default);
        assert!(matches!(r, Err(Error::HeadDim { .. })), "{format}: {r:?}");
        // A multiple of 32, one step past the GPU's largest head_dim (2048).
        let r = q(format, &[2, 2080], default);
        assert!(matches!(r, Err(Error::Unsupported(_))), "{format}: {r:?}");
        let r = q(format, &[2, 64], Fp8ScaleChoice::PerHeadAmax);
        assert!(matches!(r, Err(Error::Unsupported(_))), "{format}: {r:?}");
        let r = q(format, &[2, 64], Fp8ScaleChoice::Fixed(0.5));
        assert!(matches!(r, Err(Error::Unsupported(_))), "{format}: {r:?}");
        let r = q(format, &[0, 64], default);
        assert!(matches!(r, Err(Error::Unsupported(_))), "{format}: {r:?}");
        let x = s.clone_htod(&vec![1.0f32; 100]).unwrap();
        let r = ops::quantize_dense(&gpu, format, &x, &[3, 64], default);
        assert!(matches!(r, Err(Error::Length { .. })), "{format}: {r:?}");
        // No rows but heads: the host's tensor (FP4's global scales 1), no launch.
        let none = s.null::<f32>().unwrap();
        let shape = [0, 2, 64];
        let got = ops::quantize_dense(&gpu, format, &none, &shape, default).unwrap();
        let want = dense::quantize(format, &[0f32; 0], &shape, default).unwrap();
        assert_eq!(got.to_host().unwrap(), want, "{format}: empty tensor");
        assert_eq!(got.non_finite().unwrap(), 0);
        assert!(ops::dequantize_dense::<f32>(&gpu, &got).unwrap().is_empty());
    }
}

/// Keys for the dense `int4-kc` tests, `[T, heads, head_dim]` flattened, of one of three kinds:
/// 0, `random_rows` with a random mean per channel and a few outlier channels (a scale and an
/// offset of tens), every 7th element an edge value (NaN, ±Inf, ±65504, 1e6, -1e30, signed
/// zeros, subnormal-scale values); 1, a grid, exact in f16: each channel `z0 + m / 2 * s0` for
/// random m in 0..=30 (0 and 30 the first two of every 16 tokens, so a group of 16, 32 or 64 has
/// s = s0 and z = z0 exactly), s0 a power of two, so that every (x - z) / s is an integer or a
/// tie (the codes' exact fallbacks); 2, channels that are constant over some groups (s = 0) or
/// whose extremes are signed zeros.
fn kc_keys(rng: &mut Rng, tokens: usize, heads: usize, head_dim: usize, kind: usize) -> Vec<f32> {
    let plane = heads * head_dim;
    let n = tokens * plane;
    match kind {
        0 => {
            let mut x = random_rows(rng, tokens * heads, head_dim);
            let means: Vec<f32> = (0..plane).map(|_| rng.normal() * 4.0).collect();
            let edges = edge_rows(tokens * heads, head_dim, 0.5);
            for (i, v) in x.iter_mut().enumerate() {
                let c = i % plane;
                *v += means[c];
                if c % head_dim % 11 == 3 {
                    *v = *v * 37.0 + 60.0; // an outlier channel: larger and offset
                }
                if i % 7 == 0 {
                    *v = edges[i];
                }
            }
            x
        }
        1 => {
            let s0: Vec<f32> = (0..plane)
                .map(|_| 2f32.powi(rng.below(20) as i32 - 12))
                .collect();
            let z0: Vec<f32> = (0..plane)
                .map(|c| (rng.below(200) as f32 - 100.0) * s0[c])
                .collect();
            (0..n)
                .map(|i| {
                    let (t, c) = (i / plane, i % plane);
                    let m = match t % 16 {
                        0 => 0,
                        1 => 30,
                        _ => rng.below(31),
                    };
                    z0[c] + m as f32 * 0.5 * s0[c]
                })
                .collect()
        }
        _ => (0..n)
            .map(|i| {
                let (t, c) = (i / plane, i % plane);
                match (c + t / 32) % 4 {
                    0 => 1.25,
                    1 => [0.0, -0.0][(t + c) % 2],
                    2 => [-0.0, 0.0, 3.0][t % 3],
                    _ => rng.normal() * 1e-3,
                }
            })
            .collect(),
    }
}

/// Dense `int4-kc` on the GPU against `dense::quantize_int4_kc`: the codes, scales and zeros
/// bytes and the non-finite count; dequantize of the host's tensor against the host's values
/// (f32, bit for bit) and of the GPU's tensor to f16 and bf16 (the host's values rounded).
fn check_dense_kc<T: Input>(gpu: &Gpu, shape: &[usize], x32: &[f32], what: &str) {
    let x = to_input::<T>(x32);
    let what = format!("int4-kc {shape:?} {what} {}", std::any::type_name::<T>());
    let want = dense::quantize_int4_kc(&x, shape).unwrap();
    let x_d = gpu.stream().clone_htod(&x).unwrap();
    let got = ops::quantize_int4_kc(gpu, &x_d, shape).unwrap();
    assert_eq!(
        got.non_finite().unwrap(),
        want.non_finite(),
        "{what}: non-finite"
    );
    assert_eq!(got.shape(), shape);
    let got_host = got.to_host().unwrap();
    let (wc, ws, wz) = want.clone().into_parts();
    let (gc, gs, gz) = got_host.clone().into_parts();
    for (part, w, g) in [
        ("codes", &wc, &gc),
        ("scales", &ws, &gs),
        ("zeros", &wz, &gz),
    ] {
        if let Some(i) = first_difference(w.data(), g.data()) {
            panic!("{what}: {part} differ first at byte {i}");
        }
        assert_eq!(w, g, "{what}: {part} (dtype, shape)");
    }

    let deq = want.dequantize().unwrap();
    let up = ops::DeviceQuantizedChannels::from_host(gpu, &want).unwrap();
    let back = ops::dequantize_int4_kc::<f32>(gpu, &up).unwrap();
    assert_bits_eq(&format!("{what}: dequantize"), &deq, &download(gpu, &back));
    let back16 = ops::dequantize_int4_kc::<f16>(gpu, &got).unwrap();
    let want16: Vec<u16> = deq.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    let got16: Vec<u16> = download(gpu, &back16).iter().map(|v| v.to_bits()).collect();
    assert!(want16 == got16, "{what}: dequantize to f16 differs");
    let backb = ops::dequantize_int4_kc::<bf16>(gpu, &got).unwrap();
    let wantb: Vec<u16> = deq.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    let gotb: Vec<u16> = download(gpu, &backb).iter().map(|v| v.to_bits()).collect();
    assert!(wantb == gotb, "{what}: dequantize to bf16 differs");
}

/// Dense `int4-kc` tensors (FORMATS.md's file: groups of 32 tokens per head and channel, a last
/// group of T mod 32) at token counts around the group size and past it, several head counts
/// and head dims (any even one: 2, 6 and 40 are no multiple of 8 or 32), ranks 1 to 4, f32, f16
/// and bf16 inputs, random keys with outlier channels and edge values, tie-heavy grids and
/// constant channels; then a tensor of many thread blocks.
#[test]
fn dense_int4_kc_matches_cpu() {
    let Some(gpu) = require_gpu_or_skip("dense_int4_kc_matches_cpu") else {
        return;
    };
    let mut rng = Rng(5150);
    let mut checked = 0;
    for (tokens, heads, head_dim) in [
        (1, 1, 2),
        (31, 1, 64),
        (32, 2, 128),
        (33, 3, 6),
        (45, 8, 64),
        (64, 1, 96),
        (70, 2, 40),
        (100, 3, 128),
        (257, 2, 256),
        (5, 4, 576),
    ] {
        for kind in 0..3 {
            let x = kc_keys(&mut rng, tokens, heads, head_dim, kind);
            let shape = [tokens, heads, head_dim];
            let what = format!("kind {kind}");
            check_dense_kc::<f32>(&gpu, &shape, &x, &what);
            check_dense_kc::<f16>(&gpu, &shape, &x, &what);
            check_dense_kc::<bf16>(&gpu, &shape, &x, &what);
            checked += 1;
        }
    }
    assert_eq!(checked, 30);
    // Other ranks: T is the product of the axes before the head axis (1 below rank 3).
    for shape in [
        vec![128],
        vec![5, 64],
        vec![2, 35, 2, 8],
        vec![3, 4, 11, 1, 32],
    ] {
        let n: usize = shape.iter().product();
        let d = *shape.last().unwrap();
        let x = kc_keys(&mut rng, n / d, 1, d, 0);
        check_dense_kc::<f32>(&gpu, &shape, &x, "rank");
        check_dense_kc::<bf16>(&gpu, &shape, &x, "rank");
    }
    // Many thread blocks: 4,000 tokens (125 full groups) of 8 heads of 128, and 3,001 tokens (the
    // last group of 25) of 6 heads of 80.
    for (tokens, heads, head_dim) in [(4_000, 8, 128), (3_001, 6, 80)] {
        for kind in 0..2 {
            let x = kc_keys(&mut rng, tokens, heads, head_dim, kind);
            let shape = [tokens, heads, head_dim];
            check_dense_kc::<f16>(&gpu, &shape, &x, &format!("kind {kind}"));
            check_dense_kc::<f32>(&gpu, &shape, &x, &format!("kind {kind}"));
        }
    }
}

/// What the dense `int4-kc` GPU path refuses, as the host's typed errors before any launch (an
/// odd or zero head_dim, no axes, data of the wrong length), and the empty tensors it takes
/// without a launch (no tokens, no heads), equal to the host's.
#[test]
fn dense_int4_kc_bad_arguments_are_typed_errors() {
    let Some(gpu) = require_gpu_or_skip("dense_int4_kc_bad_arguments_are_typed_errors") else {
        return;
    };
    let s = gpu.stream();
    let q = |shape: &[usize]| {
        let n = shape.iter().product::<usize>().max(1);
        let x = s.clone_htod(&vec![1.0f32; n]).unwrap();
        ops::quantize_int4_kc(&gpu, &x, shape)
    };
    for d in [3, 0] {
        let r = q(&[4, 2, d]);
        assert!(
            matches!(r, Err(Error::Config { .. })),
            "head_dim {d}: {r:?}"
        );
    }
    let r = q(&[]);
    assert!(
        matches!(r, Err(Error::InvalidArgument(_))),
        "no axes: {r:?}"
    );
    let x = s.clone_htod(&vec![1.0f32; 100]).unwrap();
    let r = ops::quantize_int4_kc(&gpu, &x, &[3, 2, 16]);
    assert!(matches!(r, Err(Error::Length { .. })), "length: {r:?}");
    for shape in [[0, 2, 64], [3, 0, 64]] {
        let none = s.null::<f32>().unwrap();
        let got = ops::quantize_int4_kc(&gpu, &none, &shape).unwrap();
        let want = dense::quantize_int4_kc(&[0f32; 0], &shape).unwrap();
        assert_eq!(got.to_host().unwrap(), want, "{shape:?}: empty tensor");
        assert_eq!(got.non_finite().unwrap(), 0);
        assert!(
            ops::dequantize_int4_kc::<f32>(&gpu, &got)
                .unwrap()
                .is_empty()
        );
    }
}

/// `int8-pth` append and gather at head dims whose rows do not tile warps evenly (80, 96, 112,
/// 192: rows of 5, 6, 7 and 12 lanes straddle warps; 48, 320, 576: 3, 20 and 36 lanes) or span
/// several warps (1024, 2048: 64 and 128 lanes), which reduce each row's amax through shared
/// memory; 16 and 512 are the two ends of the shuffle path. Pool bytes, non-finite counts and
/// gathered values against the CPU's, INT8 on both sides or beside another format, random, edge
/// (NaN, ±Inf, huge) and tie-heavy data; then many thread blocks at 96.
#[test]
fn int8_append_matches_cpu_at_every_head_dim() {
    let Some(gpu) = require_gpu_or_skip("int8_append_matches_cpu_at_every_head_dim") else {
        return;
    };
    use KvFormat::*;
    let mut seed = 300;
    for head_dim in [16, 48, 80, 96, 112, 192, 320, 512, 576, 1024, 2048] {
        for (kf, vf) in [(Int8Pth, Int8Pth), (Int8Pth, Fp8E4m3), (F16, Int8Pth)] {
            let c = CacheConfig::new(3, head_dim, 16, kf, vf).unwrap();
            seed += 1;
            check_append::<f16>(&gpu, c, 45, seed, Data::Random);
            check_append::<bf16>(&gpu, c, 45, seed + 1000, Data::Random);
            check_append::<f32>(&gpu, c, 45, seed + 2000, Data::Random);
            check_append::<f16>(&gpu, c, 40, seed, Data::Edge);
            check_append::<bf16>(&gpu, c, 40, seed, Data::Edge);
            check_append::<f32>(&gpu, c, 40, seed, Data::Edge);
            check_append::<bf16>(&gpu, c, 33, seed, Data::Grid);
        }
    }
    for (i, head_dim) in [80, 96, 112, 192].into_iter().enumerate() {
        let c = CacheConfig::new(8, head_dim, 16, Int8Pth, Int8Pth).unwrap();
        check_append::<f16>(&gpu, c, 3_000, 400 + i as u64, Data::Random);
        check_append::<bf16>(&gpu, c, 3_000, 500 + i as u64, Data::Grid);
    }
}

/// `int4-kc` keys appended in order, as an engine's steps do (prefill chunks, then single
/// tokens, for several sequences at once): every block the steps fill is sealed on the GPU to
/// the CPU's bytes, and a gather of each sequence at its length reads sealed blocks as codes and
/// the last, open one as its f16 window, as the CPU does.
#[test]
fn int4_kc_keys_seal_like_the_cpu() {
    let Some(gpu) = require_gpu_or_skip("int4_kc_keys_seal_like_the_cpu") else {
        return;
    };
    for (seed, (bs, head_dim, vf)) in [
        (16, 64, KvFormat::Int4Affine64),
        (32, 128, KvFormat::Fp8E4m3),
        (64, 128, KvFormat::Bf16),
        (16, 256, KvFormat::Int8Pth),
        (32, 96, KvFormat::F16),
    ]
    .into_iter()
    .enumerate()
    {
        let config = CacheConfig::new(2, head_dim, bs, KvFormat::Int4Kc, vf).unwrap();
        let row = 2 * head_dim;
        let num_blocks = 40;
        let mut alloc = BlockAllocator::new(num_blocks, bs).unwrap();
        let mut host = HostCache::new(config, num_blocks).unwrap();
        let mut dev = DeviceCache::new(&gpu, config, num_blocks).unwrap();
        let s = gpu.stream();
        let seqs: Vec<_> = (0..3).map(|_| alloc.create_sequence()).collect();
        let mut rng = Rng(900 + seed as u64);
        for step in 0..10 {
            // A step: a chunk for each sequence (a prompt, then decode-sized pieces), one call.
            let mut slots = Vec::new();
            for (i, &q) in seqs.iter().enumerate() {
                let n = if step == 0 {
                    [5, bs, bs + 7][i]
                } else {
                    [1, 3, bs - 1][(step + i) % 3]
                };
                slots.extend(alloc.reserve(q, n).unwrap().slots);
            }
            let tokens = slots.len();
            let k = to_input::<f16>(&random_rows(&mut rng, tokens * 2, head_dim));
            let v = to_input::<f16>(&random_rows(&mut rng, tokens * 2, head_dim));
            assert_eq!(k.len(), tokens * row);
            host.write(&slots, &k, &v).unwrap();
            let slots_d = s.clone_htod(&slots.iter().map(|&x| x as i64).collect::<Vec<_>>());
            let (k_d, v_d) = (s.clone_htod(&k).unwrap(), s.clone_htod(&v).unwrap());
            ops::append(&mut dev, &slots_d.unwrap(), &k_d, &v_d, tokens).unwrap();
            let back = dev.to_host().unwrap();
            if let Some(m) = pool_mismatch(&host, &back) {
                panic!("int4-kc {config:?} step {step}: {m}");
            }
        }
        for &q in &seqs {
            let len = alloc.len(q).unwrap();
            let table = alloc.block_table(q).unwrap().to_vec();
            let mut hk = vec![0f32; len * row];
            let mut hv = vec![0f32; len * row];
            host.gather(&table, len, &mut hk, &mut hv).unwrap();
            let (gk, gv) = ops::gather_dequantize::<f32>(&dev, &table, len).unwrap();
            assert_bits_eq("int4-kc gather k", &hk, &download(&gpu, &gk));
            assert_bits_eq("int4-kc gather v", &hv, &download(&gpu, &gv));
            let (gk16, _) = ops::gather_dequantize::<f16>(&dev, &table, len).unwrap();
            let want: Vec<u16> = hk.iter().map(|&x| f16::from_f32(x).to_bits()).collect();
            let got: Vec<u16> = download(&gpu, &gk16).iter().map(|x| x.to_bits()).collect();
            assert!(want == got, "{config:?}: int4-kc gather k as f16 differs");
        }
    }
}

/// Values beside int4-kc keys at any head_dim the keys allow (a multiple of 32).
fn kc_values(head_dim: usize) -> KvFormat {
    if head_dim % 64 == 0 {
        KvFormat::Int4Affine64
    } else {
        KvFormat::Int4Sym32
    }
}

/// The seal pass where its work is dense: one call whose tokens all end their blocks (besides
/// padding and slots past the pool, which seal nothing), so a seal thread block has a block to
/// seal for nearly every token it scans, in several rounds, at every kind of head_dim (1, 2 or
/// 4 channel pairs a thread a round; a round of many sections or of one), block size and KV
/// head count, from 32 tokens a seal thread block to 256 (the first shape). Then shuffled
/// appends of thousands of tokens, as check_append makes them.
#[test]
fn int4_kc_seals_every_block_of_a_call() {
    let Some(gpu) = require_gpu_or_skip("int4_kc_seals_every_block_of_a_call") else {
        return;
    };
    let mut rng = Rng(4242);
    for (heads, head_dim, bs, num_blocks) in [
        (16, 32, 16, 4100),
        (8, 128, 16, 1100),
        (1, 32, 64, 300),
        (3, 96, 32, 600),
        (2, 576, 16, 300),
        (1, 2048, 64, 40),
        (4, 1024, 32, 70),
        (5, 160, 64, 200),
    ] {
        let c =
            CacheConfig::new(heads, head_dim, bs, KvFormat::Int4Kc, kc_values(head_dim)).unwrap();
        let row = heads * head_dim;
        let num_slots = num_blocks * bs;
        let mut blocks: Vec<usize> = (0..num_blocks).collect();
        rng.shuffle(&mut blocks);
        // Each block's last slot; every 9th token padding, every 13th past the pool (at a
        // block's last slot, so only the range check keeps it from sealing).
        let mapping: Vec<i32> = blocks
            .iter()
            .enumerate()
            .map(|(t, &b)| match (t % 9, t % 13) {
                (4, _) => -1,
                (_, 6) => (num_slots + (b + 1) * bs - 1) as i32,
                _ => ((b + 1) * bs - 1) as i32,
            })
            .collect();
        let tokens = mapping.len();
        let k = to_input::<f16>(&random_rows(&mut rng, tokens * heads, head_dim));
        let v = to_input::<f16>(&random_rows(&mut rng, tokens * heads, head_dim));
        let kept: Vec<usize> = (0..tokens)
            .filter(|&t| (0..num_slots as i32).contains(&mapping[t]))
            .collect();
        let pick = |x: &[f16]| -> Vec<f16> {
            kept.iter()
                .flat_map(|&t| x[t * row..(t + 1) * row].iter().copied())
                .collect()
        };
        let host_slots: Vec<usize> = kept.iter().map(|&t| mapping[t] as usize).collect();
        let mut host = HostCache::new(c, num_blocks).unwrap();
        host.write(&host_slots, &pick(&k), &pick(&v)).unwrap();

        let mut dev = DeviceCache::new(&gpu, c, num_blocks).unwrap();
        let s = gpu.stream();
        let slots_d = s.clone_htod(&mapping).unwrap();
        let (k_d, v_d) = (s.clone_htod(&k).unwrap(), s.clone_htod(&v).unwrap());
        ops::append(&mut dev, &slots_d, &k_d, &v_d, tokens).unwrap();
        let err = dev.check_appends().unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{c:?}: {err}");
        if let Some(m) = pool_mismatch(&host, &dev.to_host().unwrap()) {
            panic!("int4-kc, every token a block's last: {m}");
        }
    }
    for (i, (heads, head_dim, bs, tokens)) in [
        (8, 128, 16, 9_000),
        (3, 96, 32, 3_000),
        (1, 2048, 64, 300),
        (6, 320, 16, 1_500),
    ]
    .into_iter()
    .enumerate()
    {
        let c =
            CacheConfig::new(heads, head_dim, bs, KvFormat::Int4Kc, kc_values(head_dim)).unwrap();
        check_append::<f16>(&gpu, c, tokens, 4300 + i as u64, Data::Random);
        check_append::<bf16>(&gpu, c, tokens, 4400 + i as u64, Data::Grid);
    }
}

/// The seal's codes where rounding is hardest: keys on each channel's grid (`kc_keys` kind 1,
/// every (x - z) / s an integer or a tie, so most words of codes take the exact fallback) and
/// channels constant or of signed zeros over a block (kind 2, s = 0), appended in order through
/// shuffled blocks at every block size, the last block left open: the pool's bytes are the
/// CPU's.
#[test]
fn int4_kc_seal_of_grid_keys_matches_cpu() {
    let Some(gpu) = require_gpu_or_skip("int4_kc_seal_of_grid_keys_matches_cpu") else {
        return;
    };
    let s = gpu.stream();
    let mut rng = Rng(6060);
    for (heads, head_dim, bs) in [(2, 64, 16), (3, 96, 32), (1, 128, 64), (4, 32, 16)] {
        for kind in 1..3 {
            let c = CacheConfig::new(heads, head_dim, bs, KvFormat::Int4Kc, kc_values(head_dim))
                .unwrap();
            let num_blocks = 12;
            let tokens = num_blocks * bs - 3;
            let mut blocks: Vec<usize> = (0..num_blocks).collect();
            rng.shuffle(&mut blocks);
            let slots: Vec<usize> = (0..tokens).map(|t| blocks[t / bs] * bs + t % bs).collect();
            let k = to_input::<f16>(&kc_keys(&mut rng, tokens, heads, head_dim, kind));
            let v = to_input::<f16>(&random_rows(&mut rng, tokens * heads, head_dim));
            let mut host = HostCache::new(c, num_blocks).unwrap();
            host.write(&slots, &k, &v).unwrap();
            let mut dev = DeviceCache::new(&gpu, c, num_blocks).unwrap();
            let slots_i32: Vec<i32> = slots.iter().map(|&x| x as i32).collect();
            let slots_d = s.clone_htod(&slots_i32).unwrap();
            let (k_d, v_d) = (s.clone_htod(&k).unwrap(), s.clone_htod(&v).unwrap());
            ops::append(&mut dev, &slots_d, &k_d, &v_d, tokens).unwrap();
            if let Some(m) = pool_mismatch(&host, &dev.to_host().unwrap()) {
                panic!("int4-kc {c:?}, grid keys of kind {kind}: {m}");
            }
        }
    }
}

// ---- no-GPU behaviour (runs everywhere) -----------------------------------------------------

#[test]
fn probing_never_panics() {
    let available = kvq::cuda::is_available();
    let lines = kvq::cuda::device_summary();
    assert!(lines[0].starts_with("kernels built for: "), "{lines:?}");
    if !available {
        assert!(matches!(Gpu::new(0), Err(Error::NoDevice(_))));
        assert!(lines.iter().any(|l| l.starts_with("no CUDA device")));
    }
}
