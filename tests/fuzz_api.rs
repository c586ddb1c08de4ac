//! Randomized calls of the whole public CPU API, valid and invalid, as a new user would make
//! them: every call runs under `catch_unwind` (a panic fails the property and names the call),
//! every error must be one of the crate's typed errors, and every valid result is checked
//! against a reference (scalar format math, a naive f64 attention, a model of the cache) or an
//! invariant (error bounds, finiteness, shapes).
//!
//! `KVQ_FUZZ_CASES` scales the proptest cases of every property (each gets a multiple of it;
//! default 256, about 320,000 calls in 3 s on 2 cores in the test profile). The full run,
//! documented in README.md, is `KVQ_FUZZ_CASES=2000`; with `--nocapture` each property prints
//! its calls per entry point, split into `Ok` and `Err` for the fallible ones.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::panic::{AssertUnwindSafe, catch_unwind};

use half::{bf16, f16};
use kvq::cache::{BlockAllocator, BlockTables, CopyBlock, HostCache, PagedKvCache, SeqId};
use kvq::cpu::{self, Accum, AttentionOptions, AttentionOutput, DecodeShape, DenseKv};
use kvq::dense::{self, DenseFormat, Fp8ScaleChoice, QuantizedTensor, StoredDtype, StoredTensor};
use kvq::format::{Fp8Kind, HeadScale, fp4, head_amax, int4, sanitize, sanitized_amax};
use kvq::layout::MAX_BLOCK_SIZE;
use kvq::synth::Synth;
use kvq::{CacheConfig, Error, KvFormat, ScaleGranularity};
use proptest::prelude::*;
use proptest::test_runner::{FileFailurePersistence, TestCaseError, TestRunner};

// ------------------------------------------------------------------------------ harness

/// Calls of one entry point: how many, and how many of those returned `Ok` / `Err`.
#[derive(Default)]
struct Count {
    calls: u64,
    ok: u64,
    err: u64,
}

thread_local! {
    /// Calls made per entry point by the property running on this thread.
    static CALLS: RefCell<BTreeMap<&'static str, Count>> = const { RefCell::new(BTreeMap::new()) };
}

fn cases() -> u32 {
    std::env::var("KVQ_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256)
}

/// Run `test` on `weight × KVQ_FUZZ_CASES` values of `strategy`, then print the calls it made
/// per entry point; a failing case (after shrinking) fails the test with its inputs.
fn run_property<S: Strategy>(
    name: &str,
    weight: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S::Value: std::fmt::Debug,
{
    CALLS.with(|c| c.borrow_mut().clear());
    let mut runner = TestRunner::new(ProptestConfig {
        cases: (cases() * weight).max(1),
        source_file: Some(file!()),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    });
    let start = std::time::Instant::now();
    let result = runner.run(&strategy, test);
    let calls = CALLS.with(|c| std::mem::take(&mut *c.borrow_mut()));
    let total: u64 = calls.values().map(|c| c.calls).sum();
    let mut text = format!(
        "fuzz {name}: {} cases, {total} calls, {} in {:.2} s\n  {:>8}  {:>7}  {:>7}  entry\n",
        (cases() * weight).max(1),
        if result.is_ok() {
            "0 panics, 0 failures"
        } else {
            "FAILED"
        },
        start.elapsed().as_secs_f64(),
        "calls",
        "Ok",
        "Err"
    );
    for (entry, c) in &calls {
        let (ok, err) = if c.ok + c.err > 0 {
            (c.ok.to_string(), c.err.to_string())
        } else {
            ("-".into(), "-".into())
        };
        text += &format!("  {:>8}  {ok:>7}  {err:>7}  {entry}\n", c.calls);
    }
    println!("{text}");
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
}

/// Run one public call, counting it; a panic becomes a test failure that names the call.
fn call<T>(entry: &'static str, f: impl FnOnce() -> T) -> Result<T, TestCaseError> {
    CALLS.with(|c| c.borrow_mut().entry(entry).or_default().calls += 1);
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        TestCaseError::fail(format!("{entry} panicked: {msg}"))
    })
}

/// [`call`] for a fallible entry point: also counts its `Ok`s and `Err`s, and checks that an
/// error's message is one line.
fn try_call<T>(
    entry: &'static str,
    f: impl FnOnce() -> Result<T, Error>,
) -> Result<Result<T, Error>, TestCaseError> {
    let r = call(entry, f)?;
    CALLS.with(|c| {
        let mut c = c.borrow_mut();
        let count = c.entry(entry).or_default();
        if r.is_ok() {
            count.ok += 1;
        } else {
            count.err += 1;
        }
    });
    if let Err(e) = &r {
        check_error(entry, e)?;
    }
    Ok(r)
}

/// An error must say something and stay on one line (the CLI prints it as one).
fn check_error(entry: &str, e: &Error) -> Result<(), TestCaseError> {
    let text = e.to_string();
    prop_assert!(
        !text.is_empty() && !text.contains('\n'),
        "{entry}: bad message {text:?}"
    );
    Ok(())
}

// --------------------------------------------------------------------------- strategies

/// Mostly ordinary values, with every kind of special f32 mixed in.
fn float() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -4.0f32..4.0,
        1 => -70000.0f32..70000.0,
        1 => any::<f32>(),
        1 => prop::sample::select(vec![
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            65504.0,
            -65504.0,
            1e9,
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::from_bits(0x0000_7FFF),
        ]),
    ]
}

/// Sizes: small ones (valid or not), and the large ones that used to overflow.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 0usize..300,
        1 => (0u32..64).prop_map(|s| 1usize << s),
        1 => (0usize..8).prop_map(|d| usize::MAX - d),
        1 => any::<usize>(),
        1 => (1usize..64).prop_map(|m| usize::MAX / 64 * 64 / m),
    ]
}

fn kv_format() -> impl Strategy<Value = KvFormat> {
    prop::sample::select(KvFormat::ALL.to_vec())
}

fn dense_format() -> impl Strategy<Value = DenseFormat> {
    prop::sample::select(DenseFormat::ALL.to_vec())
}

/// A format with a row codec: the caches these properties model row by row (`int4-kc`, whose
/// groups run along a block's tokens, has its own tests: tests/int4_kc_cache.rs).
fn row_format() -> impl Strategy<Value = KvFormat> {
    prop::sample::select(
        KvFormat::ALL
            .into_iter()
            .filter(|f| !f.block_groups())
            .collect::<Vec<_>>(),
    )
}

/// A head_dim every format accepts, and head counts and block sizes of a small cache.
fn small_config() -> impl Strategy<Value = CacheConfig> {
    (
        1usize..=3,
        prop::sample::select(vec![64usize, 128]),
        prop::sample::select(vec![1usize, 2, 3, 4, 16]),
        row_format(),
        row_format(),
    )
        .prop_map(|(h, d, bs, k, v)| CacheConfig::new(h, d, bs, k, v).unwrap())
}

/// A length near `n`: usually `n`, sometimes off by a little or by a lot.
fn near(n: usize) -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => Just(n),
        1 => Just(n.saturating_sub(1)),
        1 => Just(n + 1),
        1 => 0usize..(2 * n + 3),
    ]
}

// ------------------------------------------------------------------------ references

/// The f32 a row element decodes to, from scalar format math (FORMATS.md).
fn scalar_round_trip(format: KvFormat, x: f32, scale: f32) -> Option<f32> {
    let v = sanitize(x).0;
    match format {
        KvFormat::F16 => Some(f16::from_f32(v).to_f32()),
        KvFormat::Bf16 => Some(bf16::from_f32(v).to_f32()),
        KvFormat::Fp8E4m3 | KvFormat::Fp8E5m2 => {
            let k = format.fp8_kind().unwrap();
            Some(k.dequantize(k.quantize(v, scale), scale))
        }
        _ => None, // grouped: checked by bounds
    }
}

/// Largest error a grouped INT4 element may have: half a step of the group's f16 scale, plus
/// the f16 rounding of the scale (and zero) relative to the group's range.
fn int4_bound(format: KvFormat, group: &[f32]) -> f32 {
    let clean: Vec<f32> = group.iter().map(|&x| sanitize(x).0).collect();
    let (mn, mx) = clean
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    let amax = mn.abs().max(mx.abs());
    let step = match format {
        KvFormat::Int4Sym32 => amax / 7.0,
        _ => (mx - mn) / 15.0,
    };
    0.5 * step * (1.0 + 1e-3) + amax * 2e-3 + 1e-6
}

/// Naive causal GQA attention in f64 over dense `[len, kv_heads, d]` K/V of one sequence:
/// `q` is `[q_heads, q_len, d]`; returns (`out`, `lse`) in the layout of the CPU reference.
fn naive_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kv_heads: usize,
    d: usize,
    shape: &DecodeShape,
    softmax_scale: f32,
) -> (Vec<f64>, Vec<f64>) {
    let len = k.len() / (kv_heads * d);
    let group = shape.num_q_heads / kv_heads;
    let (mut out, mut lse) = (Vec::new(), Vec::new());
    for h in 0..shape.num_q_heads {
        let kvh = h / group;
        for i in 0..shape.q_len {
            let qr = &q[(h * shape.q_len + i) * d..][..d];
            let last = len - shape.q_len + i;
            let logits: Vec<f64> = (0..=last)
                .map(|p| {
                    let kr = &k[(p * kv_heads + kvh) * d..][..d];
                    softmax_scale as f64
                        * qr.iter()
                            .zip(kr)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                })
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let sum: f64 = w.iter().sum();
            for c in 0..d {
                let acc: f64 = (0..=last)
                    .map(|p| w[p] * v[(p * kv_heads + kvh) * d + c] as f64)
                    .sum();
                out.push(acc / sum);
            }
            lse.push(max + sum.ln());
        }
    }
    (out, lse)
}

/// Compare the reference's output with the naive one: `tol` relative to the largest |v|.
fn check_attention(
    got: &AttentionOutput,
    want_out: &[f64],
    want_lse: &[f64],
    v_scale: f64,
    tol: f64,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.out.len(), want_out.len());
    prop_assert_eq!(got.lse.len(), want_lse.len());
    for (i, (&g, &w)) in got.out.iter().zip(want_out).enumerate() {
        prop_assert!(
            (g as f64 - w).abs() <= tol * (v_scale + 1e-30),
            "out[{i}] = {g}, naive {w}"
        );
    }
    for (i, (&g, &w)) in got.lse.iter().zip(want_lse).enumerate() {
        if (w as f32).is_infinite() {
            // Past f32's range (a huge query): the f32 lse is the infinity it rounds to.
            prop_assert_eq!(g, w as f32, "lse[{}], naive {}", i, w);
        } else {
            prop_assert!(
                (g as f64 - w).abs() <= tol * (w.abs() + 1.0),
                "lse[{i}] = {g}, naive {w}"
            );
        }
    }
    Ok(())
}

// ------------------------------------------------------------------- format: one row

/// Arguments of one row call: format, head_dim, values, buffer lengths, scale.
#[derive(Debug, Clone)]
struct RowCase {
    format: KvFormat,
    x: Vec<f32>,
    codes_len: usize,
    meta_len: usize,
    scale: Option<f32>, // None: calibrated from the row
}

fn row_case() -> impl Strategy<Value = RowCase> {
    (
        kv_format(),
        prop_oneof![3 => 1usize..=8, 1 => 0usize..=9],
        any::<bool>(),
    )
        .prop_flat_map(|(format, k, aligned)| {
            let d = if aligned {
                k * format.head_dim_multiple()
            } else {
                k * 7 + 3
            }
            .min(512);
            (
                Just(format),
                prop::collection::vec(float(), d),
                near(format.code_bytes(d)),
                near(format.meta_bytes(d)),
                prop_oneof![3 => Just(None), 1 => float().prop_map(Some)],
            )
        })
        .prop_map(|(format, x, codes_len, meta_len, scale)| RowCase {
            format,
            x,
            codes_len,
            meta_len,
            scale,
        })
}

fn check_row_case(c: &RowCase) -> Result<(), TestCaseError> {
    let f = c.format;
    let d = c.x.len();
    let scale = c.scale.unwrap_or_else(|| {
        f.head_scale()
            .map_or(1.0, |h| h.scale_from_amax(sanitized_amax(&c.x)))
    });
    let valid = !f.block_groups()
        && f.check_head_dim(d).is_ok()
        && c.codes_len == f.code_bytes(d)
        && c.meta_len == f.meta_bytes(d)
        && (!f.has_head_scale() || (scale.is_finite() && scale > 0.0));
    let checked = try_call("KvFormat::check_row", || {
        f.check_row(d, c.codes_len, c.meta_len, scale)
    })?;
    prop_assert_eq!(checked.is_ok(), valid, "check_row {:?}", checked);

    let (mut codes, mut meta) = (vec![0x5Au8; c.codes_len], vec![0x5Au8; c.meta_len]);
    let encoded = try_call("KvFormat::try_encode_row", || {
        f.try_encode_row(&c.x, scale, &mut codes, &mut meta)
    })?;
    let (mut codes2, mut meta2) = (vec![0x5Au8; c.codes_len], vec![0x5Au8; c.meta_len]);
    let legacy = call("KvFormat::encode_row", || {
        f.encode_row(&c.x, scale, &mut codes2, &mut meta2)
    })?;
    let mut out = vec![0f32; d];
    let decoded = try_call("KvFormat::try_decode_row", || {
        f.try_decode_row(&codes, &meta, scale, &mut out)
    })?;
    let mut out2 = vec![0f32; d];
    call("KvFormat::decode_row", || {
        f.decode_row(&codes, &meta, scale, &mut out2)
    })?;
    let f16_in: Vec<f16> = c.x.iter().map(|&v| f16::from_f32(v)).collect();
    let (mut codes3, mut meta3) = (vec![0u8; c.codes_len], vec![0u8; c.meta_len]);
    let from_f16 = try_call("KvFormat::try_encode_row (f16 input)", || {
        f.try_encode_row(&f16_in, scale, &mut codes3, &mut meta3)
    })?;
    prop_assert_eq!(from_f16.is_ok(), valid);

    if !valid {
        for (what, r) in [
            ("try_encode_row", encoded.map(|_| ())),
            ("try_decode_row", decoded),
        ] {
            let e = r.expect_err(what);
            check_error(what, &e)?;
        }
        prop_assert_eq!(legacy, 0);
        prop_assert!(codes2.iter().chain(&meta2).all(|&b| b == 0x5A), "wrote");
        prop_assert!(out2.iter().all(|v| v.is_nan()));
        return Ok(());
    }
    let non_finite = c.x.iter().filter(|v| !v.is_finite()).count() as u64;
    prop_assert_eq!(encoded.clone().unwrap(), non_finite);
    prop_assert_eq!(legacy, non_finite);
    prop_assert_eq!((&codes2, &meta2), (&codes, &meta));
    decoded.unwrap();
    prop_assert_eq!(
        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        out2.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    prop_assert!(
        out.iter().all(|v| v.is_finite()),
        "non-finite decode {:?}",
        out
    );
    match f.group_size() {
        // INT8's group is the row: half a step of s = amax / 127, plus s's own rounding.
        None if f == KvFormat::Int8Pth => {
            let s = sanitized_amax(&c.x) / 127.0;
            for (&x, &o) in c.x.iter().zip(&out) {
                let v = sanitize(x).0;
                let bound = 0.5 * s * (1.0 + 1e-5) + v.abs() * 1e-6;
                prop_assert!((v - o).abs() <= bound, "{} {} -> {} (s {})", f, v, o, s);
            }
        }
        None => {
            for (i, (&x, &o)) in c.x.iter().zip(&out).enumerate() {
                let want = scalar_round_trip(f, x, scale).unwrap();
                prop_assert_eq!(o.to_bits(), want.to_bits(), "{} element {} of {}", f, i, x);
            }
            // A scale calibrated from the row keeps FP8 within its rounding.
            if let (Some(kind), None) = (f.fp8_kind(), c.scale) {
                let rel = match kind {
                    Fp8Kind::E4M3 => 1.0 / 16.0,
                    Fp8Kind::E5M2 => 1.0 / 8.0,
                };
                let unit = kind.decode(1) * scale;
                for (&x, &o) in c.x.iter().zip(&out) {
                    let v = sanitize(x).0;
                    prop_assert!(
                        (v - o).abs() <= rel * v.abs() + unit,
                        "{} {} -> {} (scale {})",
                        f,
                        v,
                        o,
                        scale
                    );
                }
            }
        }
        // FP4 under a calibrated g (no block scale saturates): half its largest step d, or
        // what a block scale rounded down leaves past 6 d.
        Some(g) if f == KvFormat::Fp4E2m1 => {
            if c.scale.is_some() {
                return Ok(()); // any g: block scales may saturate; decoded values stay finite
            }
            for (gx, go) in c.x.chunks(g).zip(out.chunks(g)) {
                let amax16 = sanitized_amax(gx);
                let d = Fp8Kind::E4M3.decode(fp4::block_scale(amax16, scale)) * scale;
                let bound = d.max(amax16 - 6.0 * d) * (1.0 + 1e-5) + amax16 * 1e-6;
                for (&x, &o) in gx.iter().zip(go) {
                    let v = sanitize(x).0;
                    prop_assert!((v - o).abs() <= bound, "{} {} -> {} (d {})", f, v, o, d);
                }
            }
        }
        Some(g) => {
            for (gx, go) in c.x.chunks(g).zip(out.chunks(g)) {
                let bound = int4_bound(f, gx);
                for (&x, &o) in gx.iter().zip(go) {
                    let v = sanitize(x).0;
                    prop_assert!(
                        (v - o).abs() <= bound,
                        "{} {} -> {} (bound {})",
                        f,
                        v,
                        o,
                        bound
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn format_rows() {
    run_property("format rows", 16, row_case(), |c| check_row_case(&c));
}

// --------------------------------------------------------------- format: scalar helpers

#[test]
fn format_scalars() {
    let strategy = (
        (float(), float(), any::<bool>()),
        prop::collection::vec(float(), 0..80),
        0usize..80,
        prop_oneof![3 => 0usize..5, 1 => size()],
        prop_oneof![3 => 0usize..12, 1 => size()],
        size(),
    );
    run_property(
        "format scalars",
        8,
        strategy,
        |((x, amax, whole), xs, codes_len, heads, head_dim, i)| {
            // Half the head_amax calls get data of a whole number of tokens.
            let fit = heads
                .checked_mul(head_dim)
                .filter(|&r| r > 0 && whole)
                .map_or(xs.len(), |r| xs.len() / r * r);
            let xs_amax = &xs[..fit];
            for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
                let sc = call("Fp8Kind::scale_from_amax", || kind.scale_from_amax(amax))?;
                prop_assert!(
                    sc.is_finite() && sc > 0.0,
                    "scale {} from amax {}",
                    sc,
                    amax
                );
                let code = call("Fp8Kind::encode", || kind.encode(x))?;
                let back = call("Fp8Kind::decode", || kind.decode(code))?;
                if x.is_finite() {
                    let max = kind.max_finite();
                    let clamped = x.clamp(-max, max);
                    prop_assert!((back - clamped).abs() <= clamped.abs() / 8.0 + kind.decode(1));
                }
                let q = call("Fp8Kind::quantize", || kind.quantize(sanitize(x).0, sc))?;
                let y = call("Fp8Kind::dequantize", || kind.dequantize(q, sc))?;
                prop_assert!(y.is_finite(), "{} with scale {} -> {}", x, sc, y);
            }
            let (v, bad) = call("format::sanitize", || sanitize(x))?;
            prop_assert!(v.is_finite() && v.abs() <= 65504.0 && bad != x.is_finite());
            let amax_all = call("format::sanitized_amax", || sanitized_amax(&xs))?;
            prop_assert!(amax_all.is_finite() && amax_all >= 0.0);

            // INT4 group helpers with any lengths: the group is the common prefix.
            let clean: Vec<f32> = xs.iter().map(|&v| sanitize(v).0).collect();
            let n = clean.len().min(codes_len);
            let mut sym = vec![0i8; codes_len];
            let s16 = call("int4::quantize_sym_group", || {
                int4::quantize_sym_group(&clean, &mut sym)
            })?;
            prop_assert!(s16.to_f32().is_finite() && s16.to_f32() >= 0.0);
            prop_assert!(sym.iter().all(|&q| (-7..=7).contains(&q)));
            for (&q, &v) in sym.iter().zip(&clean) {
                let o = call("int4::dequantize_sym", || int4::dequantize_sym(q, s16))?;
                prop_assert!((o - v).abs() <= int4_bound(KvFormat::Int4Sym32, &clean[..n]));
            }
            let mut aff = vec![0u8; codes_len];
            let (sa, za) = call("int4::quantize_affine_group", || {
                int4::quantize_affine_group(&clean, &mut aff)
            })?;
            prop_assert!(sa.to_f32().is_finite() && sa.to_f32() >= 0.0 && za.to_f32().is_finite());
            prop_assert!(aff.iter().all(|&q| q <= 15));
            for (&q, &v) in aff.iter().zip(&clean) {
                let o = call("int4::dequantize_affine", || {
                    int4::dequantize_affine(q, sa, za)
                })?;
                prop_assert!((o - v).abs() <= int4_bound(KvFormat::Int4Affine64, &clean[..n]));
            }
            let us = call("int4::uniform_scale", || int4::uniform_scale(amax_all))?;
            let uq = call("int4::quantize_uniform", || {
                int4::quantize_uniform(sanitize(x).0, us)
            })?;
            prop_assert!((-7..=7).contains(&uq));
            let ud = call("int4::dequantize_uniform", || {
                int4::dequantize_uniform(uq, us)
            })?;
            prop_assert!(ud.is_finite());
            let mut packed = vec![0u8; codes_len / 2];
            call("int4::pack_nibbles", || {
                int4::pack_nibbles(sym.iter().map(|&q| q as u8), &mut packed)
            })?;
            let nib = call("int4::nibble", || int4::nibble(&packed, i))?;
            let snib = call("int4::signed_nibble", || int4::signed_nibble(&packed, i))?;
            if i / 2 < packed.len() {
                prop_assert_eq!(snib, sym[i]);
                prop_assert_eq!(nib, sym[i] as u8 & 0xF);
            } else {
                prop_assert_eq!((nib, snib), (0, 0));
            }
            let mut dst = vec![0f32; codes_len];
            let mut count = 0;
            call("format::sanitize_into", || {
                kvq::format::sanitize::sanitize_into(&xs, &mut dst, &mut count)
            })?;
            prop_assert_eq!(
                count,
                xs[..n].iter().filter(|v| !v.is_finite()).count() as u64
            );

            // head_amax with any sizes (but no huge output for no data: that is a real request).
            // One amax per head is a real request for memory: no huge head counts without data.
            let row = heads.checked_mul(head_dim);
            if xs_amax.is_empty() && heads > 1 << 16 {
                return Ok(());
            }
            let xs = xs_amax;
            let r = try_call("format::head_amax", || head_amax(xs, heads, head_dim))?;
            let valid = match row {
                Some(0) => xs.is_empty(),
                Some(r) => xs.len() % r == 0,
                None => false,
            };
            prop_assert_eq!(
                r.is_ok(),
                valid,
                "head_amax({}, {}, {}) = {:?}",
                xs.len(),
                heads,
                head_dim,
                r
            );
            match r {
                Ok(amax) => {
                    prop_assert_eq!(amax.len(), heads);
                    for (h, &a) in amax.iter().enumerate() {
                        let want = xs
                            .chunks(head_dim.max(1))
                            .enumerate()
                            .filter(|(r, _)| r % heads == h)
                            .map(|(_, c)| sanitized_amax(c))
                            .fold(0.0f32, f32::max);
                        prop_assert_eq!(a, want);
                    }
                }
                Err(e) => check_error("head_amax", &e)?,
            }
            Ok(())
        },
    );
}

// ------------------------------------------------------------------------ layout

/// The limit `CacheConfig::validate` states: every size product of the layout (`head_dim ×
/// bits`, each region's `row bytes × block_size`, `head_stride × num_kv_heads`) at most
/// `(isize::MAX - 64) / 4`. Whether a plausible config's layout exceeds it, in u128.
fn layout_exceeds_limit(heads: usize, d: usize, bs: usize, k: KvFormat, v: KvFormat) -> bool {
    let limit = (isize::MAX as u128 - 64) / 4;
    if [k, v].iter().any(|f| d as u128 * f.bits() as u128 > limit) {
        return true;
    }
    let mut head_stride = 0u128;
    for f in [k, v] {
        let mut part = 0u128;
        for row in [f.code_bytes(d), f.meta_bytes(d)] {
            let bytes = row as u128 * bs as u128;
            if bytes > limit {
                return true;
            }
            part += bytes.div_ceil(16) * 16;
        }
        if f.block_groups() {
            // int4-kc: the block's s and z after its codes, all inside the f16 window
            let window = 2 * d as u128 * bs as u128;
            if window > limit {
                return true;
            }
            part = (part + (4 * d as u128).div_ceil(16) * 16).max(window.div_ceil(16) * 16);
        }
        head_stride += part;
    }
    head_stride * heads as u128 > limit
}

#[test]
fn layout_and_config() {
    let strategy = (
        (
            size(),
            prop_oneof![2 => (1usize..9).prop_map(|k| 64 * k), 3 => size()],
            prop_oneof![2 => 1usize..=64, 1 => size()],
            kv_format(),
            kv_format(),
        ),
        (size(), size(), size(), size()),
    );
    run_property(
        "layout",
        16,
        strategy,
        |((heads, head_dim, bs, k, v), (slot, block, head, nb))| {
            let literal = CacheConfig {
                num_kv_heads: heads,
                head_dim,
                block_size: bs,
                k_format: k,
                v_format: v,
            };
            let new = try_call("CacheConfig::new", || {
                CacheConfig::new(heads, head_dim, bs, k, v)
            })?;
            let validated = try_call("CacheConfig::validate", || literal.validate())?;
            let tried = try_call("CacheConfig::try_layout", || literal.try_layout())?;
            let l = call("CacheConfig::layout", || literal.layout())?;
            prop_assert_eq!(new.is_ok(), validated.is_ok());
            prop_assert_eq!(tried.is_ok(), validated.is_ok());
            call("BlockLayout::head_section", || l.head_section(block, head))?;
            call("BlockLayout::pool_bytes", || l.pool_bytes(nb))?;
            let pool = try_call("BlockLayout::try_pool_bytes", || l.try_pool_bytes(nb))?;
            let (b, o) = call("BlockLayout::split_slot", || l.split_slot(slot))?;
            call("BlockLayout::bytes_per_token_head", || {
                l.bytes_per_token_head()
            })?;
            call("Region::row", || l.v_meta.row(slot))?;
            call("KvFormat::bytes_per_element", || k.bytes_per_element())?;
            if let Err(e) = &pool {
                check_error("try_pool_bytes", e)?;
            }
            match validated {
                Err(e) => {
                    check_error("CacheConfig::validate", &e)?;
                    let plausible = heads >= 1
                        && (1..=MAX_BLOCK_SIZE).contains(&bs)
                        && k.check_block_size(bs).is_ok()
                        && !v.block_groups()
                        && k.check_head_dim(head_dim).is_ok()
                        && v.check_head_dim(head_dim).is_ok();
                    // Only an overflow may reject an otherwise valid shape, and only past the
                    // documented limit.
                    prop_assert!(!plausible || matches!(e, Error::Overflow { .. }), "{:?}", e);
                    prop_assert!(
                        !plausible || layout_exceeds_limit(heads, head_dim, bs, k, v),
                        "{:?} within the documented limit",
                        e
                    );
                }
                Ok(()) => {
                    prop_assert!(!layout_exceeds_limit(heads, head_dim, bs, k, v));
                    prop_assert_eq!(tried.unwrap(), l);
                    prop_assert_eq!(l.config, literal);
                    let regions = [l.k_codes, l.k_meta, l.v_codes, l.v_meta];
                    prop_assert_eq!(
                        regions.map(|r| r.row_bytes),
                        [
                            k.code_bytes(head_dim),
                            k.meta_bytes(head_dim),
                            v.code_bytes(head_dim),
                            v.meta_bytes(head_dim)
                        ]
                    );
                    let mut end = 0;
                    for r in regions {
                        prop_assert_eq!(r.offset % 16, 0);
                        prop_assert!(r.offset >= end);
                        end = r.offset + r.row_bytes * bs;
                    }
                    prop_assert!(end <= l.head_stride && l.head_stride % 16 == 0);
                    prop_assert_eq!(Some(l.block_stride), l.head_stride.checked_mul(heads));
                    prop_assert_eq!((b, o), (slot / bs, slot % bs));
                    if let Ok(bytes) = pool {
                        prop_assert_eq!(Some(bytes), l.block_stride.checked_mul(nb));
                        prop_assert_eq!(l.pool_bytes(nb), bytes);
                    }
                }
            }
            Ok(())
        },
    );
}

// -------------------------------------------------------------------- block tables

#[test]
fn block_tables() {
    let strategy = (
        prop::collection::vec(prop::collection::vec(-2i32..12, 0..6), 0..5),
        prop::collection::vec(prop_oneof![4 => 0usize..30, 1 => size()], 0..6),
        prop::collection::vec(-3i32..12, 0..30),
        prop::collection::vec(-3i32..40, 0..6),
        (
            prop_oneof![3 => 0usize..8, 1 => size()],
            prop_oneof![3 => 0usize..12, 1 => size()],
            prop_oneof![3 => 0usize..6, 1 => size()],
            prop_oneof![3 => 0usize..8, 1 => size()],
        ),
    );
    run_property(
        "block tables",
        16,
        strategy,
        |(rows, lens, data, raw_lens, (max_blocks, num_blocks, block_size, index))| {
            let refs: Vec<&[i32]> = rows.iter().map(|r| r.as_slice()).collect();
            let built = try_call("BlockTables::from_rows", || {
                BlockTables::from_rows(&refs, &lens)
            })?;
            let valid_build =
                rows.len() == lens.len() && lens.iter().all(|&l| l <= i32::MAX as usize);
            prop_assert_eq!(built.is_ok(), valid_build, "{:?}", built);
            if let Err(e) = &built {
                check_error("from_rows", e)?;
            }
            let literal = BlockTables {
                data,
                max_blocks,
                context_lens: raw_lens,
            };
            for t in built.iter().chain([&literal]) {
                let v = try_call("BlockTables::validate", || {
                    t.validate(num_blocks, block_size)
                })?;
                let row = call("BlockTables::row", || t.row(index))?;
                let tried = try_call("BlockTables::try_row", || t.try_row(index))?;
                call("BlockTables::batch", || t.batch())?;
                let max_len = call("BlockTables::max_context_len", || t.max_context_len())?;
                match &tried {
                    Ok(r) => {
                        prop_assert_eq!(*r, row);
                        prop_assert_eq!(r.len(), t.max_blocks);
                        prop_assert_eq!(*r, &t.data[index * t.max_blocks..][..t.max_blocks]);
                    }
                    Err(e) => {
                        check_error("try_row", e)?;
                        prop_assert!(row.is_empty());
                    }
                }
                match v {
                    Err(e) => check_error("BlockTables::validate", &e)?,
                    Ok(()) => {
                        // Valid tables: every used entry is a block of the pool.
                        prop_assert!(block_size >= 1 && t.data.len() == t.batch() * t.max_blocks);
                        for b in 0..t.batch() {
                            let len = t.context_lens[b] as usize;
                            prop_assert!(len <= max_len);
                            for &e in &t.row(b)[..len.div_ceil(block_size)] {
                                prop_assert!(e >= 0 && (e as usize) < num_blocks);
                            }
                        }
                    }
                }
            }
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------- host cache

#[derive(Debug, Clone)]
enum CacheOp {
    Write {
        slots: Vec<usize>,
        strict: bool,
        len_delta: usize,
        seed: u64,
    },
    Read {
        slot: usize,
        head: usize,
        len: Option<usize>,
    },
    SetScales {
        k: Vec<f32>,
        v: Vec<f32>,
        /// `None`: one scale per KV head (the valid length); else this many.
        len: Option<usize>,
    },
    Calibrate {
        tokens: usize,
        extra: usize,
        per_head: bool,
        seed: u64,
    },
    Copy {
        src: usize,
        dst: usize,
    },
    ApplyCopies(Vec<(usize, usize)>),
    Gather {
        table: Vec<i32>,
        len: usize,
        out_delta: usize,
    },
}

fn scale_value() -> impl Strategy<Value = f32> {
    prop_oneof![4 => 0.001f32..10.0, 1 => float()]
}

fn cache_op() -> impl Strategy<Value = CacheOp> {
    prop_oneof![
        4 => (
            prop::collection::vec(0usize..24, 0..5),
            any::<bool>(),
            prop_oneof![5 => Just(0usize), 1 => 1usize..3],
            any::<u64>()
        )
            .prop_map(|(slots, strict, len_delta, seed)| CacheOp::Write {
                slots,
                strict,
                len_delta,
                seed
            }),
        3 => (0usize..24, 0usize..4, prop::option::weighted(0.2, 0usize..200))
            .prop_map(|(slot, head, len)| CacheOp::Read { slot, head, len }),
        1 => (
            prop::collection::vec(scale_value(), 4),
            prop::collection::vec(scale_value(), 4),
            prop::option::weighted(0.2, 0usize..5)
        )
            .prop_map(|(k, v, len)| CacheOp::SetScales { k, v, len }),
        1 => (
            0usize..4,
            prop_oneof![5 => Just(0usize), 1 => 1usize..5],
            any::<bool>(),
            any::<u64>()
        )
            .prop_map(|(tokens, extra, per_head, seed)| CacheOp::Calibrate {
                tokens,
                extra,
                per_head,
                seed
            }),
        1 => (0usize..6, 0usize..6).prop_map(|(src, dst)| CacheOp::Copy { src, dst }),
        1 => prop::collection::vec((0usize..6, 0usize..6), 0..3).prop_map(CacheOp::ApplyCopies),
        2 => (
            prop::collection::vec(prop_oneof![8 => 0i32..4, 1 => -2i32..8], 0..8),
            0usize..30,
            prop_oneof![5 => Just(0usize), 1 => 1usize..3]
        )
            .prop_map(|(table, len, out_delta)| CacheOp::Gather {
                table,
                len,
                out_delta
            }),
    ]
}

/// `n` moderate values (normal, std 1.5), with one special value for some seeds.
fn rows(seed: u64, n: usize, specials: bool) -> Vec<f32> {
    let mut x = Synth::new(seed).normal(n, 1.5);
    if specials && seed % 3 == 0 && !x.is_empty() {
        let i = (seed / 3) as usize % x.len();
        x[i] = [f32::NAN, f32::INFINITY, 1e9][(seed / 7) as usize % 3];
    }
    x
}

/// Model of a host cache: the bytes (codes, then metadata) of every row written, by
/// (slot, side: 0 = K / 1 = V, head).
#[derive(Default)]
struct CacheModel {
    rows: HashMap<(usize, u8, usize), Vec<u8>>,
}

impl CacheModel {
    fn side(cache: &HostCache, side: u8, head: usize) -> (KvFormat, f32) {
        let c = cache.config();
        if side == 0 {
            (c.k_format, cache.k_scales()[head])
        } else {
            (c.v_format, cache.v_scales()[head])
        }
    }

    /// What a row of `x` encodes to with the cache's current scale.
    fn encode(cache: &HostCache, side: u8, head: usize, x: &[f32]) -> Vec<u8> {
        let (f, s) = Self::side(cache, side, head);
        let d = cache.config().head_dim;
        let mut codes = vec![0u8; f.code_bytes(d)];
        let mut meta = vec![0u8; f.meta_bytes(d)];
        f.try_encode_row(x, s, &mut codes, &mut meta).unwrap();
        codes.extend(meta);
        codes
    }

    /// What the bytes of a row decode to with the cache's current scale.
    fn decode(cache: &HostCache, side: u8, head: usize, bytes: &[u8]) -> Vec<f32> {
        let (f, s) = Self::side(cache, side, head);
        let d = cache.config().head_dim;
        let n = f.code_bytes(d);
        let mut out = vec![0f32; d];
        f.try_decode_row(&bytes[..n], &bytes[n..], s, &mut out)
            .unwrap();
        out
    }

    /// The bytes of a row where the layout puts them in the pool.
    fn pool_row(cache: &HostCache, slot: usize, side: u8, head: usize) -> Vec<u8> {
        let l = cache.layout();
        let (block, off) = l.split_slot(slot);
        let sec = l.head_section(block, head);
        let (codes, meta) = if side == 0 {
            (l.k_codes, l.k_meta)
        } else {
            (l.v_codes, l.v_meta)
        };
        let mut b = cache.pool()[sec + codes.row(off)..][..codes.row_bytes].to_vec();
        b.extend_from_slice(&cache.pool()[sec + meta.row(off)..][..meta.row_bytes]);
        b
    }

    fn copy(&mut self, src: usize, dst: usize, bs: usize) {
        if src == dst {
            return;
        }
        let moved: Vec<_> = self
            .rows
            .iter()
            .filter(|((slot, _, _), _)| slot / bs == src)
            .map(|(&(slot, side, head), b)| ((dst * bs + slot % bs, side, head), b.clone()))
            .collect();
        self.rows.retain(|&(slot, _, _), _| slot / bs != dst);
        self.rows.extend(moved);
    }
}

fn run_cache_op(
    cache: &mut HostCache,
    model: &mut CacheModel,
    op: &CacheOp,
) -> Result<(), TestCaseError> {
    let c = *cache.config();
    let (heads, d, bs, nb) = (c.num_kv_heads, c.head_dim, c.block_size, cache.num_blocks());
    let row = heads * d;
    match op {
        CacheOp::Write {
            slots,
            strict,
            len_delta,
            seed,
        } => {
            let k = rows(*seed, slots.len() * row + len_delta, true);
            let v = rows(seed ^ 1, slots.len() * row, true);
            let before = cache.pool().to_vec();
            let r = if *strict {
                try_call("HostCache::write_strict", || {
                    cache.write_strict(slots, &k, &v).map(|()| 0)
                })?
            } else {
                try_call("HostCache::write", || cache.write(slots, &k, &v))?
            };
            let valid_shape = *len_delta == 0 && slots.iter().all(|&s| s < nb * bs);
            let non_finite = k.iter().chain(&v).filter(|x| !x.is_finite()).count() as u64;
            // What a strict write also refuses: magnitudes past f16's range or past a
            // head-scaled side's largest code.
            let saturated: usize = [
                (c.k_format, cache.k_scales(), &k),
                (c.v_format, cache.v_scales(), &v),
            ]
            .iter()
            .map(|&(f, scales, x)| {
                x.chunks(d)
                    .zip(scales.iter().cycle())
                    .map(|(r, &g)| {
                        let lim = f
                            .head_scale()
                            .map_or(65504.0, |h| (h.max_value() * g).min(65504.0));
                        r.iter().filter(|e| e.is_finite() && e.abs() > lim).count()
                    })
                    .sum::<usize>()
            })
            .sum();
            let refused = *strict && (non_finite > 0 || saturated > 0);
            match r {
                Err(e) => {
                    check_error("HostCache::write", &e)?;
                    prop_assert!(!valid_shape || refused, "{:?}", e);
                    prop_assert!(
                        cache.pool() == &before[..],
                        "a failed write changed the pool"
                    );
                }
                Ok(count) => {
                    prop_assert!(valid_shape && !refused);
                    if !*strict {
                        prop_assert_eq!(count, non_finite);
                    }
                    for (t, &slot) in slots.iter().enumerate() {
                        for h in 0..heads {
                            for (side, x) in [(0u8, &k), (1u8, &v)] {
                                let r = &x[(t * heads + h) * d..][..d];
                                let bytes = CacheModel::encode(cache, side, h, r);
                                model.rows.insert((slot, side, h), bytes);
                            }
                        }
                    }
                }
            }
        }
        CacheOp::Read { slot, head, len } => {
            let len = len.unwrap_or(d);
            for side in [0u8, 1] {
                let mut out = vec![0f32; len];
                let r = if side == 0 {
                    try_call("HostCache::read_k", || cache.read_k(*slot, *head, &mut out))?
                } else {
                    try_call("HostCache::read_v", || cache.read_v(*slot, *head, &mut out))?
                };
                let valid = *slot < nb * bs && *head < heads && len == d;
                match r {
                    Err(e) => {
                        check_error("HostCache::read", &e)?;
                        prop_assert!(!valid || matches!(e, Error::NonFinite { .. }), "{:?}", e);
                    }
                    Ok(()) => {
                        prop_assert!(valid);
                        prop_assert!(out.iter().all(|x| x.is_finite()));
                        if let Some(bytes) = model.rows.get(&(*slot, side, *head)) {
                            prop_assert_eq!(&out, &CacheModel::decode(cache, side, *head, bytes));
                        }
                    }
                }
            }
        }
        CacheOp::SetScales { k, v, len } => {
            let n = len.unwrap_or(heads);
            let (k, v) = (&k[..n.min(4)], &v[..n.min(4)]);
            let before = (cache.k_scales().to_vec(), cache.v_scales().to_vec());
            let r = try_call("HostCache::set_scales", || cache.set_scales(k, v))?;
            // A side without a head scale may take no values and keeps its scales.
            let c = *cache.config();
            let keeps = |s: &[f32], f: KvFormat| s.is_empty() && f.head_scale().is_none();
            let ok = |s: &[f32], f: KvFormat| {
                keeps(s, f) || s.len() == heads && s.iter().all(|x| x.is_finite() && *x > 0.0)
            };
            prop_assert_eq!(r.is_ok(), ok(k, c.k_format) && ok(v, c.v_format));
            if r.is_ok() {
                let k = if keeps(k, c.k_format) {
                    &before.0[..]
                } else {
                    k
                };
                let v = if keeps(v, c.v_format) {
                    &before.1[..]
                } else {
                    v
                };
                prop_assert_eq!((cache.k_scales(), cache.v_scales()), (k, v));
            }
        }
        CacheOp::Calibrate {
            tokens,
            extra,
            per_head,
            seed,
        } => {
            let x = rows(*seed, tokens * row + extra, true);
            let g = if *per_head {
                ScaleGranularity::PerHead
            } else {
                ScaleGranularity::PerTensor
            };
            let r = try_call("HostCache::calibrate_fp8_scales", || {
                cache.calibrate_fp8_scales(&x, &x, g)
            })?;
            prop_assert_eq!(r.is_ok(), *extra == 0);
            for s in cache.k_scales().iter().chain(cache.v_scales()) {
                prop_assert!(s.is_finite() && *s > 0.0);
            }
        }
        CacheOp::Copy { src, dst } => {
            let r = try_call("HostCache::copy_block", || cache.copy_block(*src, *dst))?;
            prop_assert_eq!(r.is_ok(), *src < nb && *dst < nb);
            if r.is_ok() {
                model.copy(*src, *dst, bs);
            }
        }
        CacheOp::ApplyCopies(pairs) => {
            let copies: Vec<CopyBlock> = pairs
                .iter()
                .map(|&(src, dst)| CopyBlock { src, dst })
                .collect();
            let before = cache.pool().to_vec();
            let r = try_call("HostCache::apply_copies", || cache.apply_copies(&copies))?;
            let valid = pairs.iter().all(|&(s, d)| s < nb && d < nb);
            prop_assert_eq!(r.is_ok(), valid);
            if valid {
                for &(src, dst) in pairs {
                    model.copy(src, dst, bs);
                }
            } else {
                prop_assert!(cache.pool() == &before[..]);
            }
        }
        CacheOp::Gather {
            table,
            len,
            out_delta,
        } => {
            let n = len * row;
            let (mut gk, mut gv) = (vec![0f32; n + out_delta], vec![0f32; n]);
            let r = try_call("HostCache::gather", || {
                cache.gather(table, *len, &mut gk, &mut gv)
            })?;
            let used = len.div_ceil(bs);
            let valid = *out_delta == 0
                && table.len() >= used
                && table[..used].iter().all(|&b| b >= 0 && (b as usize) < nb);
            match r {
                Err(e) => {
                    check_error("HostCache::gather", &e)?;
                    prop_assert!(!valid || matches!(e, Error::NonFinite { .. }), "{:?}", e);
                }
                Ok(()) => {
                    prop_assert!(valid);
                    let mut one = vec![0f32; d];
                    for p in 0..*len {
                        let slot = table[p / bs] as usize * bs + p % bs;
                        for h in 0..heads {
                            cache.read_k(slot, h, &mut one).unwrap();
                            prop_assert_eq!(&gk[(p * heads + h) * d..][..d], &one[..]);
                            cache.read_v(slot, h, &mut one).unwrap();
                            prop_assert_eq!(&gv[(p * heads + h) * d..][..d], &one[..]);
                        }
                    }
                }
            }
        }
    }
    // The pool holds what the model says, byte for byte, wherever the model knows the row.
    for (&(slot, side, head), bytes) in &model.rows {
        prop_assert_eq!(
            &CacheModel::pool_row(cache, slot, side, head),
            bytes,
            "slot {} side {} head {}",
            slot,
            side,
            head
        );
    }
    Ok(())
}

#[test]
fn host_cache_ops() {
    let strategy = (
        small_config(),
        1usize..=4,
        prop::collection::vec(cache_op(), 1..24),
    );
    run_property("host cache", 2, strategy, |(c, num_blocks, ops)| {
        let mut cache = try_call("HostCache::new", || HostCache::new(c, num_blocks))?.unwrap();
        prop_assert!(cache.pool().iter().all(|&b| b == kvq::cache::POISON));
        prop_assert_eq!(cache.num_slots(), num_blocks * c.block_size);
        let mut model = CacheModel::default();
        for op in &ops {
            run_cache_op(&mut cache, &mut model, op)?;
        }
        // Corrupt bytes (as pool_mut allows) read back as errors or finite values, never NaN.
        for (i, b) in cache.pool_mut().iter_mut().enumerate().step_by(7) {
            *b = [0x7F, 0xFF, 0x7C, 0xFC, 0x00][i % 5];
        }
        let mut out = vec![0f32; c.head_dim];
        for slot in 0..cache.num_slots() {
            match try_call("HostCache::read_k", || cache.read_k(slot, 0, &mut out))? {
                Ok(()) => prop_assert!(out.iter().all(|x| x.is_finite())),
                Err(e) => prop_assert!(matches!(e, Error::NonFinite { .. }), "{:?}", e),
            }
        }
        Ok(())
    });
}

#[test]
fn cache_construction_any_size() {
    let strategy = (
        size(),
        prop_oneof![1 => (1usize..5).prop_map(|k| 64 * k), 1 => size()],
        prop_oneof![1 => 1usize..=16, 1 => size()],
        kv_format(),
        kv_format(),
        size(),
        prop_oneof![3 => 0usize..3, 1 => size()],
    );
    run_property(
        "cache construction",
        8,
        strategy,
        |(heads, head_dim, bs, k, v, num_blocks, layers)| {
            let cfg = CacheConfig {
                num_kv_heads: heads,
                head_dim,
                block_size: bs,
                k_format: k,
                v_format: v,
            };
            // Any pool that can be addressed is a legitimate request, so only small ones are
            // built; the point is the arithmetic and the typed errors, not this machine's memory.
            let bytes = cfg
                .try_layout()
                .ok()
                .and_then(|l| l.try_pool_bytes(num_blocks).ok());
            let small = bytes.is_some_and(|b| b.saturating_mul(layers.max(1)) <= 1 << 22);
            if small || bytes.is_none() {
                match try_call("HostCache::new", || HostCache::new(cfg, num_blocks))? {
                    Ok(h) => {
                        prop_assert!(small);
                        prop_assert_eq!(h.pool().len(), h.layout().pool_bytes(num_blocks));
                    }
                    Err(e) => check_error("HostCache::new", &e)?,
                }
                match try_call("PagedKvCache::new", || {
                    PagedKvCache::new(cfg, layers, num_blocks)
                })? {
                    Ok(p) => prop_assert_eq!(p.layers().len(), layers),
                    Err(e) => check_error("PagedKvCache::new", &e)?,
                }
            }
            // Bookkeeping grows with use, so any pool size is cheap.
            match try_call("BlockAllocator::new", || {
                BlockAllocator::new(num_blocks, bs)
            })? {
                Ok(a) => {
                    prop_assert_eq!(a.num_free_blocks(), num_blocks);
                    prop_assert!(num_blocks <= i32::MAX as usize && bs <= MAX_BLOCK_SIZE);
                }
                Err(e) => check_error("BlockAllocator::new", &e)?,
            }
            Ok(())
        },
    );
}

// ------------------------------------------------------------- paged cache + attention

#[derive(Debug, Clone)]
enum PagedOp {
    Create,
    Append {
        seq: usize,
        n: usize,
        bad_len: bool,
    },
    Fork(usize),
    Free(usize),
    /// Roll back to a shorter length (`cut` tokens fewer, modulo the length), or ask for one
    /// more token than the sequence has.
    Truncate {
        seq: usize,
        cut: usize,
        longer: bool,
    },
    /// Swap a layer of another block size in through `layers_mut`, append (refused), restore.
    SwapLayer {
        layer: usize,
        seq: usize,
    },
    Decode {
        q_heads_mul: usize,
        q_len: usize,
        accum64: bool,
    },
}

fn paged_op() -> impl Strategy<Value = PagedOp> {
    prop_oneof![
        1 => Just(PagedOp::Create),
        4 => (any::<usize>(), 0usize..7, prop::bool::weighted(0.1))
            .prop_map(|(seq, n, bad_len)| PagedOp::Append { seq, n, bad_len }),
        1 => any::<usize>().prop_map(PagedOp::Fork),
        1 => any::<usize>().prop_map(PagedOp::Free),
        2 => (any::<usize>(), 0usize..9, prop::bool::weighted(0.1))
            .prop_map(|(seq, cut, longer)| PagedOp::Truncate { seq, cut, longer }),
        1 => (any::<usize>(), any::<usize>())
            .prop_map(|(layer, seq)| PagedOp::SwapLayer { layer, seq }),
        2 => (1usize..=3, 1usize..=3, any::<bool>()).prop_map(|(q_heads_mul, q_len, accum64)| {
            PagedOp::Decode { q_heads_mul, q_len, accum64 }
        }),
    ]
}

/// Per live sequence, per layer: the decoded K and V (`[len, heads, d]`) it must read back.
type PagedModel = Vec<(SeqId, Vec<(Vec<f32>, Vec<f32>)>)>;

fn paged_decode(
    p: &PagedKvCache,
    model: &PagedModel,
    (q_heads_mul, q_len, accum64): (usize, usize, bool),
    seed: u64,
) -> Result<(), TestCaseError> {
    let c = *p.layers()[0].config();
    let (heads, d) = (c.num_kv_heads, c.head_dim);
    let live: Vec<usize> = (0..model.len())
        .filter(|&i| model[i].1[0].0.len() / (heads * d) >= q_len)
        .collect();
    if live.is_empty() {
        return Ok(());
    }
    let seqs: Vec<SeqId> = live.iter().map(|&i| model[i].0).collect();
    let tables = try_call("PagedKvCache::block_tables", || p.block_tables(&seqs))?.unwrap();
    let (shape, opts) = (
        DecodeShape::new(heads * q_heads_mul, q_len),
        AttentionOptions::new(d),
    );
    let per_seq = shape.num_q_heads * q_len * d;
    let q = rows(seed, live.len() * per_seq, false);
    let accum = if accum64 { Accum::F64 } else { Accum::F32 };
    for (l, cache) in p.layers().iter().enumerate() {
        let got = try_call("cpu::decode_attention", || {
            cpu::decode_attention(cache, &tables, &q, &shape, &opts, accum)
        })?
        .map_err(|e| TestCaseError::fail(format!("valid decode failed: {e}")))?;
        let (mut want_out, mut want_lse) = (Vec::new(), Vec::new());
        let mut v_scale = 0f64;
        for (b, &i) in live.iter().enumerate() {
            let (mk, mv) = &model[i].1[l];
            v_scale = mv.iter().fold(v_scale, |m, &x| m.max(x.abs() as f64));
            let qb = &q[b * per_seq..][..per_seq];
            let (o, s) = naive_attention(qb, mk, mv, heads, d, &shape, opts.softmax_scale);
            want_out.extend(o);
            want_lse.extend(s);
        }
        let tol = if accum64 { 1e-5 } else { 2e-3 };
        check_attention(&got, &want_out, &want_lse, v_scale, tol)?;
    }
    Ok(())
}

/// A model's paged cache through random appends, forks and frees (blocks freed by one
/// sequence are reused by others): every sequence reads back exactly its own tokens in every
/// layer, and decode attention over the live sequences matches a naive f64 attention over the
/// model's tokens, so no stale block content ever reaches a read.
#[test]
fn paged_cache_and_decode() {
    let strategy = (
        small_config(),
        1usize..=2,
        1usize..=8,
        prop::collection::vec(paged_op(), 1..30),
        any::<u64>(),
    );
    run_property(
        "paged cache + decode",
        2,
        strategy,
        |(c, layers, num_blocks, ops, seed)| {
            let mut p = try_call("PagedKvCache::new", || {
                PagedKvCache::new(c, layers, num_blocks)
            })?
            .unwrap();
            let (heads, d) = (c.num_kv_heads, c.head_dim);
            let row = heads * d;
            let mut model: PagedModel = Vec::new();
            let mut tag = seed;
            for op in &ops {
                let pick = |i: usize| (!model.is_empty()).then(|| i % model.len());
                match *op {
                    PagedOp::Create => {
                        let s = call("PagedKvCache::create_sequence", || p.create_sequence())?;
                        model.push((s, vec![(Vec::new(), Vec::new()); layers]));
                    }
                    PagedOp::Append { seq, n, bad_len } => {
                        let Some(i) = pick(seq) else { continue };
                        let s = model[i].0;
                        let ks: Vec<Vec<f32>> = (0..layers)
                            .map(|l| rows(tag.wrapping_add(2 * l as u64), n * row, false))
                            .collect();
                        let mut vs: Vec<Vec<f32>> = (0..layers)
                            .map(|l| rows(tag.wrapping_add(2 * l as u64 + 1), n * row, false))
                            .collect();
                        tag = tag.wrapping_add(2 * layers as u64);
                        if bad_len {
                            vs[layers - 1].push(1.0);
                        }
                        let kr: Vec<&[f32]> = ks.iter().map(|x| x.as_slice()).collect();
                        let vr: Vec<&[f32]> = vs.iter().map(|x| x.as_slice()).collect();
                        let free = p.allocator().num_free_blocks();
                        match try_call("PagedKvCache::append", || p.append(s, &kr, &vr))? {
                            Ok(nf) => {
                                prop_assert!(!bad_len && nf == 0);
                                for (l, (mk, mv)) in model[i].1.iter_mut().enumerate() {
                                    let cache = &p.layers()[l];
                                    for (x, m, side) in [(&ks[l], mk, 0u8), (&vs[l], mv, 1u8)] {
                                        for (t, r) in x.chunks(d).enumerate() {
                                            let b = CacheModel::encode(cache, side, t % heads, r);
                                            m.extend(CacheModel::decode(
                                                cache,
                                                side,
                                                t % heads,
                                                &b,
                                            ));
                                        }
                                    }
                                }
                            }
                            Err(e) => {
                                check_error("PagedKvCache::append", &e)?;
                                let expected = bad_len || matches!(e, Error::OutOfBlocks { .. });
                                prop_assert!(expected, "{:?}", e);
                                prop_assert_eq!(p.allocator().num_free_blocks(), free);
                            }
                        }
                    }
                    PagedOp::Fork(seq) => {
                        let Some(i) = pick(seq) else { continue };
                        let child = try_call("PagedKvCache::fork", || p.fork(model[i].0))?.unwrap();
                        let tokens = model[i].1.clone();
                        model.push((child, tokens));
                    }
                    PagedOp::Free(seq) => {
                        let Some(i) = pick(seq) else { continue };
                        let (s, _) = model.swap_remove(i);
                        try_call("PagedKvCache::free", || p.free(s))?.unwrap();
                        let again = try_call("PagedKvCache::free", || p.free(s))?;
                        prop_assert_eq!(again, Err(Error::UnknownSequence(s.0)));
                    }
                    PagedOp::Truncate { seq, cut, longer } => {
                        let Some(i) = pick(seq) else { continue };
                        let s = model[i].0;
                        let len = p.len(s).unwrap();
                        let new_len = if longer {
                            len + 1
                        } else {
                            len - cut % (len + 1)
                        };
                        let free = p.allocator().num_free_blocks();
                        match try_call("PagedKvCache::truncate", || p.truncate(s, new_len))? {
                            Ok(()) => {
                                prop_assert!(!longer);
                                prop_assert!(p.allocator().num_free_blocks() >= free);
                                for (mk, mv) in &mut model[i].1 {
                                    mk.truncate(new_len * row);
                                    mv.truncate(new_len * row);
                                }
                            }
                            Err(e) => {
                                prop_assert!(longer && matches!(e, Error::InvalidArgument(_)));
                                prop_assert_eq!(p.allocator().num_free_blocks(), free);
                            }
                        }
                    }
                    PagedOp::SwapLayer { layer, seq } => {
                        let Some(i) = pick(seq) else { continue };
                        let (l, s) = (layer % layers, model[i].0);
                        let other = CacheConfig {
                            block_size: c.block_size % 16 + 1,
                            ..c
                        };
                        let swapped = HostCache::new(other, num_blocks).unwrap();
                        let original = std::mem::replace(&mut p.layers_mut()[l], swapped);
                        let (len, free) = (p.len(s).unwrap(), p.allocator().num_free_blocks());
                        let x = vec![0.5f32; row];
                        let (k, v): (Vec<&[f32]>, Vec<&[f32]>) =
                            (vec![&x; layers], vec![&x; layers]);
                        let got = try_call("PagedKvCache::append", || p.append(s, &k, &v))?;
                        prop_assert!(
                            matches!(got, Err(Error::LayerMismatch { layer, .. }) if layer == l),
                            "{:?}",
                            got
                        );
                        prop_assert_eq!(p.len(s).unwrap(), len);
                        prop_assert_eq!(p.allocator().num_free_blocks(), free);
                        p.layers_mut()[l] = original;
                    }
                    PagedOp::Decode {
                        q_heads_mul,
                        q_len,
                        accum64,
                    } => {
                        paged_decode(&p, &model, (q_heads_mul, q_len, accum64), tag)?;
                        tag = tag.wrapping_add(1);
                    }
                }
                // Every live sequence reads back exactly its own tokens, in every layer.
                for (s, per_layer) in &model {
                    let len = try_call("PagedKvCache::len", || p.len(*s))?.unwrap();
                    prop_assert_eq!(len * row, per_layer[0].0.len());
                    let tables = p.block_tables(&[*s]).unwrap();
                    for (l, (mk, mv)) in per_layer.iter().enumerate() {
                        let (mut k, mut v) = (vec![0f32; mk.len()], vec![0f32; mv.len()]);
                        try_call("HostCache::gather", || {
                            p.layers()[l].gather(tables.row(0), len, &mut k, &mut v)
                        })?
                        .unwrap();
                        prop_assert_eq!(&k, mk, "seq {} layer {} keys", s, l);
                        prop_assert_eq!(&v, mv, "seq {} layer {} values", s, l);
                    }
                }
            }
            Ok(())
        },
    );
}

// ------------------------------------------------------------ attention: any arguments

#[derive(Debug, Clone)]
struct AttnCase {
    q_heads: usize,
    q_len: usize,
    scale: f32,
    q_delta: usize,
    q_special: Option<f32>,
    table_entry: Option<i32>,
    len_delta: i32,
    extra_entry: bool,
    dense_heads: Option<usize>,
    dense_dim: Option<usize>,
}

fn attn_case() -> impl Strategy<Value = AttnCase> {
    (
        (
            prop_oneof![4 => 1usize..=6, 1 => size()],
            prop_oneof![4 => 1usize..=3, 1 => size()],
            prop_oneof![4 => 0.01f32..1.0, 1 => float()],
            prop_oneof![6 => Just(0usize), 1 => 1usize..4],
            prop::option::weighted(0.1, float()),
        ),
        (
            prop::option::weighted(0.1, -3i32..20),
            prop_oneof![6 => Just(0i32), 1 => -40i32..40],
            prop::bool::weighted(0.1),
            prop::option::weighted(0.15, prop_oneof![1 => 0usize..8, 1 => size()]),
            prop::option::weighted(0.15, prop_oneof![1 => 0usize..300, 1 => size()]),
        ),
    )
        .prop_map(
            |(
                (q_heads, q_len, scale, q_delta, q_special),
                (table_entry, len_delta, extra_entry, dense_heads, dense_dim),
            )| AttnCase {
                q_heads,
                q_len,
                scale,
                q_delta,
                q_special,
                table_entry,
                len_delta,
                extra_entry,
                dense_heads,
                dense_dim,
            },
        )
}

/// Decode attention with arguments that are valid or broken in one or more ways: valid calls
/// match the naive attention, the rest are typed errors. The dense entry point likewise.
#[test]
fn attention_arguments() {
    let strategy = (small_config(), 1usize..20, attn_case(), any::<u64>());
    run_property("attention arguments", 8, strategy, |(c, len, a, seed)| {
        let (heads, d, bs) = (c.num_kv_heads, c.head_dim, c.block_size);
        let blocks = len.div_ceil(bs);
        // Block 0 stays unwritten (POISON); the sequence lives in blocks 1..=blocks.
        let mut cache = HostCache::new(c, blocks + 1).unwrap();
        let (k, v) = (
            rows(seed, len * heads * d, false),
            rows(!seed, len * heads * d, false),
        );
        let slots: Vec<usize> = (0..len).map(|p| (p / bs + 1) * bs + p % bs).collect();
        cache.write(&slots, &k, &v).unwrap();
        let good: Vec<i32> = (1..=blocks as i32).collect();
        let mut table = good.clone();
        if let Some(e) = a.table_entry {
            table[0] = e;
        }
        let ctx = len as i32 + a.len_delta;
        let mut tables = BlockTables {
            data: table.clone(),
            max_blocks: blocks,
            context_lens: vec![ctx],
        };
        if a.extra_entry {
            tables.data.push(0);
        }
        let shape = DecodeShape::new(a.q_heads, a.q_len);
        let opts = AttentionOptions {
            softmax_scale: a.scale,
            window_left: None,
            logits_soft_cap: None,
        };
        let scale_ok = a.scale.is_finite() && a.scale > 0.0;
        let q_elems = a
            .q_heads
            .checked_mul(a.q_len)
            .and_then(|n| n.checked_mul(d));
        let q_n = match q_elems {
            Some(n) if n <= 1 << 16 => n + a.q_delta,
            _ => 3,
        };
        let mut q = rows(seed ^ 7, q_n, false);
        if let (Some(x), Some(first)) = (a.q_special, q.first_mut()) {
            *first = x;
        }
        let finite_inputs = scale_ok && q.iter().all(|x| x.is_finite());
        let got = try_call("cpu::decode_attention", || {
            cpu::decode_attention(&cache, &tables, &q, &shape, &opts, Accum::F64)
        })?;
        let table_ok = ctx <= 0 || a.table_entry.is_none_or(|e| e >= 0 && e as usize <= blocks);
        let valid = a.q_heads > 0
            && a.q_heads % heads == 0
            && a.q_len >= 1
            && ctx >= 0
            && ctx as usize >= a.q_len
            && (ctx as usize).div_ceil(bs) <= blocks
            && table_ok
            && !a.extra_entry
            && q_elems == Some(q.len())
            && finite_inputs;
        // Valid arguments can still overflow f32 (logits, lse) with extreme scales or queries.
        let extreme = a.scale.abs() > 1.0 || a.q_special.is_some();
        match got {
            Err(e) => {
                check_error("decode_attention", &e)?;
                let overflow = matches!(e, Error::NonFinite { .. }) && extreme;
                prop_assert!(!valid || overflow, "{:?}", e);
            }
            Ok(r) => {
                prop_assert!(valid, "accepted invalid arguments (context {})", ctx);
                let n = ctx as usize;
                let (mut gk, mut gv) = (vec![0f32; n * heads * d], vec![0f32; n * heads * d]);
                cache.gather(&table, n, &mut gk, &mut gv).unwrap();
                let (o, l) = naive_attention(&q, &gk, &gv, heads, d, &shape, a.scale);
                let v_scale = gv.iter().fold(0f64, |m, &x| m.max(x.abs() as f64));
                check_attention(&r, &o, &l, v_scale, 1e-5)?;
            }
        }

        // An empty batch of the same shape: empty output when one sequence's query fits in
        // memory, a typed error otherwise (the shape alone used to overflow).
        let empty = BlockTables {
            data: vec![],
            max_blocks: blocks,
            context_lens: vec![],
        };
        let q_none = vec![0.5f32; a.q_delta];
        let got = try_call("cpu::decode_attention (empty batch)", || {
            cpu::decode_attention(&cache, &empty, &q_none, &shape, &opts, Accum::F64)
        })?;
        let empty_valid = a.q_heads > 0
            && a.q_heads % heads == 0
            && a.q_len >= 1
            && scale_ok
            && q_elems.is_some()
            && q_none.is_empty();
        match got {
            Err(e) => prop_assert!(!empty_valid, "{:?}", e),
            Ok(r) => {
                prop_assert!(empty_valid, "accepted invalid empty-batch arguments");
                prop_assert!(r.out.is_empty() && r.lse.is_empty());
            }
        }

        // The dense entry point over the sequence's tokens, with its own head split.
        let (mut gk, mut gv) = (vec![0f32; len * heads * d], vec![0f32; len * heads * d]);
        cache.gather(&good, len, &mut gk, &mut gv).unwrap();
        let (kvh, hd) = (a.dense_heads.unwrap_or(heads), a.dense_dim.unwrap_or(d));
        let kv = DenseKv {
            k: &gk,
            v: &gv,
            num_kv_heads: kvh,
            head_dim: hd,
        };
        let got = try_call("cpu::attention_dense", || {
            cpu::attention_dense(&q, kv, &shape, &opts, Accum::F64)
        })?;
        let row = kvh.checked_mul(hd).filter(|&r| r > 0);
        let dense_len = row.filter(|r| gk.len() % r == 0).map(|r| gk.len() / r);
        let dense_valid = dense_len.is_some_and(|n| n >= a.q_len)
            && a.q_heads > 0
            && a.q_heads % kvh == 0
            && a.q_len >= 1
            && a.q_heads
                .checked_mul(a.q_len)
                .and_then(|n| n.checked_mul(hd))
                == Some(q.len())
            && finite_inputs;
        match got {
            Err(e) => {
                check_error("attention_dense", &e)?;
                let overflow = matches!(e, Error::NonFinite { .. }) && extreme;
                prop_assert!(!dense_valid || overflow, "{:?}", e);
            }
            Ok(r) => {
                prop_assert!(dense_valid, "accepted invalid dense arguments");
                let (o, l) = naive_attention(&q, &gk, &gv, kvh, hd, &shape, a.scale);
                let v_scale = gv.iter().fold(0f64, |m, &x| m.max(x.abs() as f64));
                check_attention(&r, &o, &l, v_scale, 1e-5)?;
            }
        }
        Ok(())
    });
}

// --------------------------------------------------------------------------- dense

/// A dense shape: rank 0..=4, head_dim usually valid, some axes 0 or huge.
fn dense_shape() -> impl Strategy<Value = Vec<usize>> {
    (
        prop::collection::vec(
            prop_oneof![6 => 1usize..4, 1 => Just(0usize), 1 => size()],
            0..3,
        ),
        prop_oneof![
            6 => prop::sample::select(vec![16usize, 32, 64, 128]),
            1 => size(),
            1 => 1usize..80
        ],
        prop::bool::weighted(0.95),
    )
        .prop_map(|(mut prefix, d, nonempty)| {
            if nonempty {
                prefix.push(d);
            }
            prefix
        })
}

fn scale_choice() -> impl Strategy<Value = Fp8ScaleChoice> {
    prop_oneof![
        2 => Just(Fp8ScaleChoice::PerTensorAmax),
        2 => Just(Fp8ScaleChoice::PerHeadAmax),
        1 => scale_value().prop_map(Fp8ScaleChoice::Fixed),
    ]
}

/// A dequantized tensor against its input, element by element: exact for FP8 (scalar math
/// with the stored scale), within the group bound for grouped INT4, half a step for uniform.
fn check_dense(
    format: DenseFormat,
    x: &[f32],
    shape: &[usize],
    q: &QuantizedTensor,
    y: &[f32],
) -> Result<(), TestCaseError> {
    prop_assert_eq!(q.shape(), shape);
    prop_assert_eq!(y.len(), x.len());
    prop_assert!(y.iter().all(|v| v.is_finite()));
    let d = *shape.last().unwrap();
    let heads = if shape.len() >= 2 {
        shape[shape.len() - 2]
    } else {
        1
    };
    let f32s = |t: &StoredTensor| -> Vec<f32> {
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    match format.kv_format() {
        // Half a step of the row's stored scale.
        Some(KvFormat::Int8Pth) => {
            let scales = f32s(q.scales());
            for (i, (&a, &b)) in x.iter().zip(y).enumerate() {
                let v = sanitize(a).0;
                prop_assert!((v - b).abs() <= 0.5 * scales[i / d] * (1.0 + 1e-5) + v.abs() * 1e-6);
            }
        }
        // Half the largest step of the group's d = value(sb) · g, or what saturation leaves.
        Some(KvFormat::Fp4E2m1) => {
            let globals = f32s(q.global_scales().unwrap());
            let sb = q.scales().data();
            for (k, (gx, gy)) in x.chunks(16).zip(y.chunks(16)).enumerate() {
                let g = globals[(k * 16 / d) % heads];
                let dd = Fp8Kind::E4M3.decode(sb[k]) * g;
                let amax16 = sanitized_amax(gx);
                let bound = dd.max(amax16 - 6.0 * dd) * (1.0 + 1e-5) + amax16 * 1e-6;
                for (&a, &b) in gx.iter().zip(gy) {
                    prop_assert!((sanitize(a).0 - b).abs() <= bound);
                }
            }
        }
        Some(kv) if kv.group_size().is_some() => {
            let g = kv.group_size().unwrap();
            for (gx, gy) in x.chunks(g).zip(y.chunks(g)) {
                let bound = int4_bound(kv, gx);
                for (&a, &b) in gx.iter().zip(gy) {
                    prop_assert!((sanitize(a).0 - b).abs() <= bound);
                }
            }
        }
        Some(kv) => {
            let scales = f32s(q.scales());
            for (i, (&a, &b)) in x.iter().zip(y).enumerate() {
                let s = scales[if scales.len() == 1 {
                    0
                } else {
                    (i / d) % heads
                }];
                let want = scalar_round_trip(kv, a, s).unwrap();
                prop_assert_eq!(b.to_bits(), want.to_bits());
            }
        }
        None => {
            let s = f32s(q.scales())[0];
            for (&a, &b) in x.iter().zip(y) {
                prop_assert!((sanitize(a).0 - b).abs() <= 0.5 * s * (1.0 + 1e-6) + 1e-30);
            }
        }
    }
    Ok(())
}

#[test]
fn dense_quantize_round_trip() {
    let strategy = (
        dense_format(),
        dense_shape(),
        scale_choice(),
        prop_oneof![8 => Just(0usize), 1 => 1usize..3],
        any::<u64>(),
        any::<bool>(),
    );
    run_property(
        "dense quantize",
        8,
        strategy,
        |(format, shape, choice, len_delta, seed, as_f16)| {
            let numel = shape.iter().try_fold(1usize, |n, &a| n.checked_mul(a));
            let n = match numel {
                Some(n) if n <= 1 << 14 => n + len_delta,
                _ => 5, // too large to hold: the call must fail on the shape alone
            };
            // An empty tensor may still name a huge head axis: its per-head scales (FP8 per
            // head, FP4's g always) are a real request for memory (or an overflow), which this
            // suite does not make.
            let heads = if shape.len() >= 2 {
                shape[shape.len() - 2]
            } else {
                1
            };
            let per_head = choice == Fp8ScaleChoice::PerHeadAmax
                || format.head_scale() == Some(HeadScale::Fp4);
            if per_head && heads > 1 << 20 && numel == Some(0) {
                return Ok(());
            }
            let x = rows(seed, n, true);
            let xs: Vec<f32> = if as_f16 {
                x.iter().map(|&v| f16::from_f32(v).to_f32()).collect()
            } else {
                x.clone()
            };
            let r = if as_f16 {
                let h: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
                try_call("dense::quantize (f16)", || {
                    dense::quantize(format, &h, &shape, choice)
                })?
            } else {
                try_call("dense::quantize", || {
                    dense::quantize(format, &x, &shape, choice)
                })?
            };
            let d_ok = shape
                .last()
                .is_some_and(|&d| format.check_head_dim(d).is_ok());
            let choice_ok = match choice {
                Fp8ScaleChoice::Fixed(s) => format
                    .fp8_kind()
                    .is_some_and(|k| s > 0.0 && (k.max_finite() * s).is_finite()),
                Fp8ScaleChoice::PerHeadAmax => format.fp8_kind().is_some(),
                Fp8ScaleChoice::PerTensorAmax => true,
            };
            let valid = d_ok && choice_ok && numel == Some(x.len());
            // The documented error of a fixed FP8 scale that is bad on its own.
            let bad_scale = d_ok
                && numel == Some(x.len())
                && format.fp8_kind().is_some()
                && matches!(choice, Fp8ScaleChoice::Fixed(_))
                && !choice_ok;
            match r {
                Err(e) => {
                    prop_assert!(!valid, "{:?}", e);
                    prop_assert!(!bad_scale || matches!(e, Error::Scale { .. }), "{:?}", e);
                }
                Ok(q) => {
                    prop_assert!(valid);
                    let non_finite = xs.iter().filter(|v| !v.is_finite()).count() as u64;
                    prop_assert_eq!(q.non_finite(), non_finite);
                    let y = call("dense::dequantize", || dense::dequantize(&q))?;
                    check_dense(format, &xs, &shape, &q, &y)?;
                    call("QuantizedTensor::stored_bytes", || q.stored_bytes())?;
                    let (c, s, z, g) = q.clone().into_parts();
                    let back = try_call("QuantizedTensor::from_parts", || {
                        QuantizedTensor::from_parts(format, c, s, z, g)
                    })?
                    .map_err(|e| TestCaseError::fail(format!("from_parts of quantize: {e}")))?;
                    prop_assert_eq!(back.scales(), q.scales());
                    prop_assert_eq!(dense::dequantize(&back), y);
                }
            }
            Ok(())
        },
    );
}

/// Arbitrary parts, as a file could hold them: from_parts accepts or gives a typed error, and
/// what it accepts dequantizes to finite values of its shape.
#[test]
fn dense_from_parts_any() {
    let strategy = (
        (
            dense_format(),
            prop::collection::vec(prop_oneof![6 => 0usize..40, 1 => size()], 0..4),
            prop::collection::vec(prop_oneof![6 => 0usize..6, 1 => size()], 0..4),
            prop::sample::select(vec![StoredDtype::U8, StoredDtype::F16, StoredDtype::F32]),
            prop_oneof![6 => Just(StoredDtype::U8), 1 => Just(StoredDtype::F16)],
        ),
        (
            prop::option::of(prop::collection::vec(0usize..6, 0..4)),
            prop::option::weighted(0.3, float()),
            any::<u64>(),
            prop_oneof![8 => Just(0usize), 1 => 1usize..3],
            prop::bool::weighted(0.6),
        ),
    );
    run_property(
        "dense from_parts",
        8,
        strategy,
        |(
            (format, code_shape, scale_shape, scale_dtype, code_dtype),
            (zeros, special, seed, len_delta, derive),
        )| {
            let mut rng = seed;
            let mut bytes = |n: usize| -> Vec<u8> {
                (0..n)
                    .map(|_| {
                        rng = rng
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        (rng >> 56) as u8
                    })
                    .collect()
            };
            let count = |s: &[usize]| {
                s.iter()
                    .try_fold(1usize, |n, &a| n.checked_mul(a))
                    .filter(|&n| n <= 1 << 14)
            };
            // Most cases derive the scale / zero / global scale shapes from the codes, as a valid
            // file would.
            let mut globals = None;
            let (scale_shape, scale_dtype, zeros) = match code_shape.split_last() {
                Some((&last, prefix)) if derive => {
                    let mut s = prefix.to_vec();
                    let per_byte = 8 / format.bits() as usize;
                    let dtype = match format.kv_format().and_then(KvFormat::group_size) {
                        Some(g) => {
                            s.push(last.saturating_mul(per_byte) / g);
                            if format == DenseFormat::Fp4E2m1 {
                                globals = Some(vec![*prefix.last().unwrap_or(&1)]);
                                StoredDtype::U8
                            } else {
                                StoredDtype::F16
                            }
                        }
                        None if format.fp8_kind().is_some() => {
                            s = vec![*prefix.last().unwrap_or(&1)];
                            StoredDtype::F32
                        }
                        None if format == DenseFormat::Int8Pth => {
                            s.push(1);
                            StoredDtype::F32
                        }
                        None => {
                            s = vec![1];
                            StoredDtype::F32
                        }
                    };
                    let z = (format == DenseFormat::Int4V64).then(|| s.clone());
                    (s, dtype, z)
                }
                _ => (scale_shape, scale_dtype, zeros),
            };
            let Some(nc) = count(&code_shape) else {
                // Shapes too large to hold: StoredTensor::new refuses them without the bytes.
                let r = try_call("StoredTensor::new", || {
                    StoredTensor::new(code_dtype, code_shape.clone(), vec![0; 3])
                })?;
                prop_assert!(r.is_err());
                return Ok(());
            };
            let Some(ns) = count(&scale_shape) else {
                return Ok(());
            };
            let codes = try_call("StoredTensor::new", || {
                StoredTensor::new(
                    code_dtype,
                    code_shape.clone(),
                    bytes(nc * code_dtype.size() + len_delta),
                )
            })?;
            let mut sdata = bytes(ns * scale_dtype.size());
            if scale_dtype == StoredDtype::F32 {
                for c in sdata.chunks_mut(4) {
                    // Plausible scales unless a special value is asked for.
                    let v = special.unwrap_or((c[0] as f32 + 1.0) / 64.0);
                    c.copy_from_slice(&v.to_le_bytes());
                }
            }
            let scales = try_call("StoredTensor::new", || {
                StoredTensor::new(scale_dtype, scale_shape.clone(), sdata)
            })?;
            let zeros = match zeros.map(|z| (count(&z), z)) {
                Some((Some(nz), z)) => Some(try_call("StoredTensor::new", || {
                    StoredTensor::new(StoredDtype::F16, z, bytes(nz * 2))
                })?),
                Some((None, _)) => return Ok(()),
                None => None,
            };
            let globals = match globals.map(|g| (count(&g), g)) {
                Some((Some(ng), g)) => {
                    let data = (0..ng)
                        .flat_map(|i| special.unwrap_or(i as f32 + 0.5).to_le_bytes())
                        .collect();
                    Some(try_call("StoredTensor::new", || {
                        StoredTensor::new(StoredDtype::F32, g, data)
                    })?)
                }
                Some((None, _)) => return Ok(()),
                None => None,
            };
            let (codes, scales, zeros, globals) =
                match (codes, scales, zeros.transpose(), globals.transpose()) {
                    (Ok(c), Ok(s), Ok(z), Ok(g)) => (c, s, z, g),
                    (c, s, z, g) => {
                        for e in [c.err(), s.err(), z.err(), g.err()].into_iter().flatten() {
                            check_error("StoredTensor::new", &e)?;
                        }
                        prop_assert!(len_delta > 0, "StoredTensor::new refused consistent bytes");
                        return Ok(());
                    }
                };
            match try_call("QuantizedTensor::from_parts", || {
                QuantizedTensor::from_parts(format, codes, scales, zeros, globals)
            })? {
                Err(e) => check_error("from_parts", &e)?,
                Ok(q) => {
                    let y = call("dense::dequantize", || dense::dequantize(&q))?;
                    prop_assert_eq!(y.len(), q.shape().iter().product::<usize>());
                    prop_assert!(
                        y.iter().all(|v| v.is_finite()),
                        "from_parts accepted parts that decode to non-finite values"
                    );
                    call("QuantizedTensor::into_parts", || q.into_parts())?;
                }
            }
            Ok(())
        },
    );
}

#[test]
fn dense_format_names() {
    let names: Vec<String> = DenseFormat::ALL
        .iter()
        .map(|f| f.name().to_string())
        .chain(KvFormat::ALL.iter().map(|f| f.name().to_string()))
        .collect();
    let strategy = prop_oneof![3 => prop::sample::select(names), 1 => "[a-z0-9-]{0,14}"];
    run_property("format names", 4, strategy, |name| {
        let d = try_call("DenseFormat::from_str", || name.parse::<DenseFormat>())?;
        let kv = try_call("KvFormat::from_str", || name.parse::<KvFormat>())?;
        match &d {
            Ok(f) => {
                prop_assert_eq!(f.name(), name.as_str());
                prop_assert_eq!(f.to_string(), name.clone());
                // One source of truth: a dense name is its cache format's name.
                let kv_name = kv.as_ref().ok().map(|k| k.name());
                prop_assert_eq!(f.kv_format().map(KvFormat::name), kv_name);
                if let Some(k) = f.kv_format() {
                    prop_assert_eq!(DenseFormat::try_from(k).ok(), Some(*f));
                    prop_assert_eq!(f.bits(), k.bits());
                    prop_assert_eq!(f.fp8_kind(), k.fp8_kind());
                }
            }
            Err(e) => {
                check_error("DenseFormat::from_str", e)?;
                if let Ok(k) = kv {
                    prop_assert!(DenseFormat::try_from(k).is_err());
                }
            }
        }
        Ok(())
    });
}

// --------------------------------------------------------------------------- synth

#[test]
fn synth_helpers() {
    let strategy = (
        (any::<u64>(), 0usize..300, float(), float(), float()),
        (
            0usize..6,
            0usize..4,
            0usize..70,
            prop_oneof![3 => 0usize..4, 1 => size()],
            float(),
        ),
    );
    run_property(
        "synth",
        8,
        strategy,
        |((seed, n, lo, hi, std), (tokens, heads, head_dim, outliers, outlier_scale))| {
            let mut s = call("Synth::new", || Synth::new(seed))?;
            let u = call("Synth::uniform", || s.uniform(n, lo, hi))?;
            prop_assert_eq!(u.len(), n);
            if lo < hi {
                prop_assert!(
                    u.iter().all(|&x| lo <= x && x <= hi),
                    "{:?} not in [{}, {})",
                    u,
                    lo,
                    hi
                );
            }
            let g = call("Synth::normal", || s.normal(n, std))?;
            prop_assert_eq!(g.len(), n);
            let x = call("Synth::with_outlier_channels", || {
                s.with_outlier_channels(tokens, heads, head_dim, outliers, outlier_scale)
            })?;
            prop_assert_eq!(x.len(), tokens * heads * head_dim);
            // Seeded: the same calls give the same values.
            let mut t = Synth::new(seed);
            let again = t.uniform(n, lo, hi);
            prop_assert!(
                again
                    .iter()
                    .zip(&u)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
            Ok(())
        },
    );
}

// -------------------------------------------------------------------------- reports

/// Mostly ordinary measurements, with NaN, infinities and awkward finite values mixed in.
#[cfg(feature = "bench")]
fn measurement() -> impl Strategy<Value = f64> {
    prop_oneof![
        6 => 0.0f64..1e4,
        2 => any::<f64>(),
        1 => prop::sample::select(vec![
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            0.1 + 0.2,
            f64::MIN_POSITIVE,
            f64::from_bits(1),
            f64::MAX,
            -0.0,
        ]),
    ]
}

/// Bench reports with any f64s: JSON reads back bit for bit when every value is finite and is
/// refused with a typed error otherwise; the bytes a decode reads are exact (u128 model) or an
/// overflow error, never wrapped.
#[cfg(feature = "bench")]
#[test]
fn bench_reports() {
    use kvq::report::{
        DecodeBenchReport, DecodeBenchRow, DecodeCase, ProbeVariant, ReadCeiling,
        decode_bytes_to_read,
    };
    let strategy = (
        (
            prop::collection::vec((measurement(), measurement(), measurement()), 0..3),
            prop::collection::vec(prop::option::of(measurement()), 0..3),
            prop::option::of((measurement(), measurement(), measurement())),
            measurement(),
        ),
        (
            small_config(),
            prop::collection::vec(prop_oneof![4 => 0usize..5000, 1 => size()], 0..4),
            (size(), size(), 0usize..=4),
        ),
    );
    run_property(
        "bench reports",
        4,
        strategy,
        |((rows, speedups, probe, ceiling), (config, lens, (q_heads, q_len, q_bytes)))| {
            let mut r = DecodeBenchReport::new("dev", ceiling);
            for (i, &(us, gbps, pct)) in rows.iter().enumerate() {
                r.rows.push(DecodeBenchRow {
                    shape: DecodeCase::llama3_8b(1, 4096),
                    k_format: "bf16".into(),
                    v_format: "int4-v64".into(),
                    splits: i,
                    median_us: us,
                    bytes: i as u64,
                    gbps,
                    pct_of_ceiling: pct,
                    speedup_vs_bf16: speedups.get(i).copied().flatten(),
                });
            }
            let mut all: Vec<f64> = vec![ceiling];
            for row in &r.rows {
                all.extend([row.median_us, row.gbps, row.pct_of_ceiling]);
                all.extend(row.speedup_vs_bf16);
            }
            if let Some((g, lo, hi)) = probe {
                r.ceiling_probe = Some(ReadCeiling {
                    gbps: g,
                    variant: "v".into(),
                    bytes: 1,
                    variants: vec![ProbeVariant {
                        name: "v".into(),
                        gbps: Some(g),
                        range_gbps: Some((lo, hi)),
                        note: None,
                    }],
                });
                all.extend([g, lo, hi]);
            }
            let json = try_call("DecodeBenchReport::to_json", || r.to_json())?;
            match json {
                Ok(text) => {
                    prop_assert!(all.iter().all(|x| x.is_finite()));
                    let back = try_call("DecodeBenchReport::from_json", || {
                        DecodeBenchReport::from_json(&text)
                    })?
                    .map_err(|e| TestCaseError::fail(format!("from_json of to_json: {e}")))?;
                    let bits = |r: &DecodeBenchReport| -> Vec<u64> {
                        let mut v = vec![r.ceiling_gbps.to_bits()];
                        for row in &r.rows {
                            v.extend(
                                [row.median_us, row.gbps, row.pct_of_ceiling].map(f64::to_bits),
                            );
                            v.extend(row.speedup_vs_bf16.map(f64::to_bits));
                        }
                        v
                    };
                    prop_assert_eq!(bits(&back), bits(&r));
                    prop_assert_eq!(back, r);
                }
                Err(e) => prop_assert!(
                    all.iter().any(|x| !x.is_finite()) && matches!(e, Error::InvalidArgument(_)),
                    "{:?}",
                    e
                ),
            }

            // Bytes to read, against a u128 model: exact, or refused where a figure passes u64.
            let l = config.layout();
            let got = try_call("report::decode_bytes_to_read", || {
                decode_bytes_to_read(&l, &lens, q_heads, q_len, q_bytes)
            })?;
            let row = [l.k_codes, l.k_meta, l.v_codes, l.v_meta]
                .iter()
                .map(|r| r.row_bytes as u128)
                .sum::<u128>();
            let heads = config.num_kv_heads as u128;
            let sides =
                config.k_format.has_head_scale() as u128 + config.v_format.has_head_scale() as u128;
            let q = (q_heads as u128)
                .checked_mul(q_len as u128)
                .and_then(|x| x.checked_mul(config.head_dim as u128 * q_bytes as u128));
            let per_seq = |len: usize| {
                let table = 4 * len.div_ceil(config.block_size) as u128;
                let kv = len as u128 * heads * row;
                q.and_then(|q| q.checked_add(kv + table + 4))
            };
            let total = lens.iter().try_fold(4 * heads * sides, |t, &len| {
                per_seq(len).and_then(|s| s.checked_add(t))
            });
            match got {
                Ok(b) => prop_assert_eq!(Some(b as u128), total),
                Err(e) => {
                    prop_assert!(matches!(e, Error::Overflow { .. }), "{:?}", e);
                    let fits = |x: Option<u128>| x.is_some_and(|x| x <= u64::MAX as u128);
                    prop_assert!(!fits(total) || !fits(q), "refused {:?} bytes", total);
                }
            }
            Ok(())
        },
    );
}
