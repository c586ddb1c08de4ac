//! The `kvq` binary, run as a user would: round trips through files for every format with the
//! bytes checked against an independent recomputation, `eval` and `info`, and every kind of bad
//! input (exit code 1 and one error line, or 2 for usage; never an output file).

#![cfg(feature = "cli")]

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use half::{bf16, f16};
use kvq::dense::DenseFormat;
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};

mod common;
mod quant_ref;
use quant_ref::{Expected, Rng, Values, decode, expected};

/// A fresh, empty scratch directory for one test under cargo's per-target temp dir.
fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-{test}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn kvq(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvq"))
        .args(args)
        .output()
        .expect("run kvq")
}

/// Run the CLI and require it to succeed (its stderr in the panic otherwise).
fn kvq_ok(args: &[&str]) -> Output {
    let out = kvq(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn arg(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// One tensor to put in an input file.
struct In {
    name: &'static str,
    dtype: Dtype,
    shape: Vec<usize>,
    values: Vec<f32>,
}

impl In {
    fn bytes(&self) -> Vec<u8> {
        match self.dtype {
            Dtype::F32 => self.values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::F16 => self
                .values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            Dtype::BF16 => self
                .values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            _ => unreachable!(),
        }
    }

    /// The values as the file stores them (rounded to the dtype).
    fn stored_values(&self) -> Vec<f32> {
        match self.dtype {
            Dtype::F16 => self
                .values
                .iter()
                .map(|v| f16::from_f32(*v).to_f32())
                .collect(),
            Dtype::BF16 => self
                .values
                .iter()
                .map(|v| bf16::from_f32(*v).to_f32())
                .collect(),
            _ => self.values.clone(),
        }
    }
}

fn write_input(path: &Path, tensors: &[In]) {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(In::bytes).collect();
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            (
                t.name,
                TensorView::new(t.dtype, t.shape.clone(), b).unwrap(),
            )
        })
        .collect();
    fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn random_inputs(seed: u64, head_dim: usize) -> Vec<In> {
    let mut rng = Rng(seed);
    let mut t = |name, dtype, shape: Vec<usize>| {
        let values = rng.vec(shape.iter().product());
        In {
            name,
            dtype,
            shape,
            values,
        }
    };
    vec![
        t("k.0", Dtype::F16, vec![37, 4, head_dim]),
        t("v.0", Dtype::BF16, vec![19, 3, head_dim]),
        t("extra", Dtype::F32, vec![2, 5, 3, head_dim]),
    ]
}

fn metadata(bytes: &[u8]) -> HashMap<String, String> {
    let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
    meta.metadata().clone().unwrap_or_default()
}

/// Quantize random F16/BF16/F32 tensors to a file, check every stored byte, dtype and shape,
/// then dequantize and check every value.
fn round_trip(format: DenseFormat, extra_args: &[&str], per_head: bool, fixed: Option<f32>) {
    let dir = scratch(&format!("rt-{format}-{}", extra_args.join("")));
    let (input, quant, back) = (dir.join("in.st"), dir.join("q.st"), dir.join("back.st"));
    let tensors = random_inputs(format as u64 + 17, 128);
    write_input(&input, &tensors);

    let mut args = vec!["quantize", "--format", format.name()];
    args.extend_from_slice(extra_args);
    args.extend([arg(&input), arg(&quant)]);
    kvq_ok(&args);
    assert!(!dir.join("q.st.tmp").exists());

    let qbytes = fs::read(&quant).unwrap();
    assert_eq!(metadata(&qbytes)["kvq.format"], format.name());
    let q = SafeTensors::deserialize(&qbytes).unwrap();
    let parts = match format {
        DenseFormat::Int4V64 | DenseFormat::Fp4E2m1 => 3,
        _ => 2,
    };
    let expected_names = tensors.len() * parts;
    assert_eq!(q.len(), expected_names);
    let mut wants = Vec::new();
    for t in &tensors {
        let (heads, d) = (t.shape[t.shape.len() - 2], t.shape[t.shape.len() - 1]);
        let want = expected(format, &t.stored_values(), heads, d, per_head, fixed);
        let codes = q.tensor(&format!("{}.codes", t.name)).unwrap();
        let scales = q.tensor(&format!("{}.scales", t.name)).unwrap();
        assert_eq!(codes.dtype(), Dtype::U8);
        assert_eq!(codes.data(), &want.codes[..], "{format} {} codes", t.name);
        assert_eq!(
            scales.data(),
            &want.scales[..],
            "{format} {} scales",
            t.name
        );
        let prefix = &t.shape[..t.shape.len() - 1];
        let code_dim = if format.bits() == 8 { d } else { d / 2 };
        assert_eq!(codes.shape(), [prefix, &[code_dim]].concat());
        let (scale_dtype, scale_shape) = match format {
            DenseFormat::Fp8E4m3 | DenseFormat::Fp8E5m2 => {
                (Dtype::F32, vec![if per_head { heads } else { 1 }])
            }
            DenseFormat::Int4K32 => (Dtype::F16, [prefix, &[d / 32]].concat()),
            DenseFormat::Int4V64 => (Dtype::F16, [prefix, &[d / 64]].concat()),
            DenseFormat::Int4Uniform => (Dtype::F32, vec![1]),
            DenseFormat::Int8Pth => (Dtype::F32, [prefix, &[1]].concat()),
            DenseFormat::Fp4E2m1 => (Dtype::U8, [prefix, &[d / 16]].concat()),
        };
        assert_eq!(
            (scales.dtype(), scales.shape()),
            (scale_dtype, &scale_shape[..])
        );
        match q.tensor(&format!("{}.zeros", t.name)) {
            Ok(z) => {
                assert_eq!(format, DenseFormat::Int4V64);
                assert_eq!((z.dtype(), z.shape()), (Dtype::F16, &scale_shape[..]));
                assert_eq!(Some(z.data().to_vec()), want.zeros);
            }
            Err(_) => assert_ne!(format, DenseFormat::Int4V64),
        }
        match q.tensor(&format!("{}.global_scales", t.name)) {
            Ok(g) => {
                assert_eq!(format, DenseFormat::Fp4E2m1);
                assert_eq!((g.dtype(), g.shape()), (Dtype::F32, &[heads][..]));
                assert_eq!(Some(g.data().to_vec()), want.global_scales);
            }
            Err(_) => assert_ne!(format, DenseFormat::Fp4E2m1),
        }
        wants.push((heads, d, want));
    }

    kvq_ok(&["dequantize", arg(&quant), arg(&back)]);
    let bbytes = fs::read(&back).unwrap();
    let b = SafeTensors::deserialize(&bbytes).unwrap();
    assert_eq!(b.len(), tensors.len());
    for (t, (heads, d, want)) in tensors.iter().zip(&wants) {
        let v = b.tensor(t.name).unwrap();
        assert_eq!((v.dtype(), v.shape()), (Dtype::F32, &t.shape[..]));
        let got: Vec<u32> = v
            .data()
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let expect: Vec<u32> = decode(format, want, *heads, *d)
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(got, expect, "{format} {} dequantized", t.name);
    }
}

#[test]
fn round_trip_every_format() {
    for format in DenseFormat::ALL {
        round_trip(format, &[], false, None);
    }
}

/// `int4-kc`: per-channel INT4 keys in FORMATS.md's dense file layout (G = 32, the tensor read as
/// `[T, heads, head_dim]`), every stored byte against a transcription of FORMATS.md, then back.
#[test]
fn int4_kc_round_trip() {
    let dir = scratch("rt-int4-kc");
    let (input, quant, back) = (dir.join("in.st"), dir.join("q.st"), dir.join("back.st"));
    // 37 tokens (a last group of 5), 19 (one partial group), and [2, 5, 3, 8]: T = 10.
    let tensors = random_inputs(41, 8);
    write_input(&input, &tensors);
    kvq_ok(&["quantize", "--format", "int4-kc", arg(&input), arg(&quant)]);
    let bytes = fs::read(&quant).unwrap();
    assert_eq!(metadata(&bytes)["kvq.format"], "int4-kc");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.names().len(), 3 * tensors.len());
    kvq_ok(&["dequantize", arg(&quant), arg(&back)]);
    let back_bytes = fs::read(&back).unwrap();
    let back_st = SafeTensors::deserialize(&back_bytes).unwrap();
    for t in &tensors {
        let (heads, d) = (t.shape[t.shape.len() - 2], t.shape[t.shape.len() - 1]);
        let tokens: usize = t.shape[..t.shape.len() - 2].iter().product();
        let plane = heads * d;
        // The input as the file holds it (F16 / BF16 / F32), widened to f32.
        let x: Vec<f32> = match t.dtype {
            Dtype::F16 => t
                .values
                .iter()
                .map(|&v| f16::from_f32(v).to_f32())
                .collect(),
            Dtype::BF16 => t
                .values
                .iter()
                .map(|&v| bf16::from_f32(v).to_f32())
                .collect(),
            _ => t.values.clone(),
        };
        let groups = tokens.div_ceil(32);
        let codes = st.tensor(&format!("{}.codes", t.name)).unwrap();
        let mut codes_shape = t.shape.clone();
        *codes_shape.last_mut().unwrap() /= 2;
        assert_eq!(
            (codes.dtype(), codes.shape()),
            (Dtype::U8, &codes_shape[..])
        );
        let part = |what: &str| -> Vec<f16> {
            let v = st.tensor(&format!("{}.{what}", t.name)).unwrap();
            assert_eq!(
                (v.dtype(), v.shape()),
                (Dtype::F16, &[groups, heads, d][..])
            );
            v.data()
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]))
                .collect()
        };
        let (scales, zeros) = (part("scales"), part("zeros"));
        let mut expected = vec![0f32; x.len()];
        for k in 0..groups {
            let rows = k * 32..tokens.min(k * 32 + 32);
            for c in 0..plane {
                let col: Vec<f32> = rows.clone().map(|r| x[r * plane + c]).collect();
                let mn = col.iter().copied().fold(f32::INFINITY, f32::min) + 0.0;
                let mx = col.iter().copied().fold(f32::NEG_INFINITY, f32::max) + 0.0;
                let (s, z) = (f16::from_f32((mx - mn) / 15.0), f16::from_f32(mn));
                assert_eq!(scales[k * plane + c].to_bits(), s.to_bits(), "{} s", t.name);
                assert_eq!(zeros[k * plane + c].to_bits(), z.to_bits(), "{} z", t.name);
                for (r, &v) in rows.clone().zip(&col) {
                    let q = if s.to_f32() == 0.0 {
                        0
                    } else {
                        ((v - z.to_f32()) / s.to_f32())
                            .round_ties_even()
                            .clamp(0.0, 15.0) as u8
                    };
                    let i = r * plane + c;
                    assert_eq!(
                        (codes.data()[i / 2] >> (i % 2 * 4)) & 0xF,
                        q,
                        "{} {i}",
                        t.name
                    );
                    expected[i] = (q as f32).mul_add(s.to_f32(), z.to_f32());
                }
            }
        }
        let b = back_st.tensor(t.name).unwrap();
        assert_eq!((b.dtype(), b.shape()), (Dtype::F32, &t.shape[..]));
        let got: Vec<f32> = b
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(got, expected, "{}", t.name);
    }
    // Bad input: an odd head_dim, a missing zeros part, a per-head scale.
    let odd = dir.join("odd.st");
    write_input(&odd, &random_inputs(3, 7));
    let out_path = dir.join("out.st");
    assert_fails(
        &["quantize", "--format", "int4-kc", arg(&odd), arg(&out_path)],
        &out_path,
        "even",
    );
    assert_fails(
        &[
            "quantize",
            "--format",
            "int4-kc",
            "--per-head",
            arg(&input),
            arg(&out_path),
        ],
        &out_path,
        "only to FP8",
    );
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| !n.ends_with(".zeros"))
        .collect();
    let no_zeros = dir.join("no-zeros.st");
    let meta = HashMap::from([("kvq.format".to_string(), "int4-kc".to_string())]);
    fs::write(&no_zeros, safetensors::serialize(kept, Some(meta)).unwrap()).unwrap();
    assert_fails(
        &["dequantize", arg(&no_zeros), arg(&out_path)],
        &out_path,
        "zeros' is missing",
    );
}

#[test]
fn fp8_per_head_and_fixed_scales() {
    for format in [DenseFormat::Fp8E4m3, DenseFormat::Fp8E5m2] {
        round_trip(format, &["--per-head"], true, None);
        round_trip(format, &["--scale", "0.0625"], false, Some(0.0625));
    }
}

/// `--pair-heads 2` quantizes [..., 4, 32] as the same bytes shaped [..., 2, 64] (so groups of
/// 64 fit), says so in the metadata, and `dequantize` gives the original shape back; heads it
/// cannot pair, and 0, are errors.
#[test]
fn quantize_pairs_adjacent_heads() {
    let dir = scratch("pair-heads");
    let mut rng = Rng(77);
    let (k, extra) = (rng.vec(37 * 4 * 32), rng.vec(2 * 6 * 32));
    let input = |paired: bool| {
        let (kh, eh, d) = if paired { (2, 3, 64) } else { (4, 6, 32) };
        vec![
            In {
                name: "k.0",
                dtype: Dtype::F16,
                shape: vec![37, kh, d],
                values: k.clone(),
            },
            In {
                name: "extra",
                dtype: Dtype::F32,
                shape: vec![2, eh, d],
                values: extra.clone(),
            },
        ]
    };
    let path = |name: &str| dir.join(name);
    write_input(&path("heads32.st"), &input(false));
    write_input(&path("heads64.st"), &input(true));
    let (h32, h64) = (path("heads32.st"), path("heads64.st"));
    let (q32, q64) = (path("q32.st"), path("q64.st"));
    let (b32, b64) = (path("b32.st"), path("b64.st"));
    let quantize = |extra: &[&str], input: &Path, out: &Path| {
        let mut args = vec!["quantize", "--format", "int4-v64"];
        args.extend_from_slice(extra);
        args.extend([arg(input), arg(out)]);
        kvq_ok(&args);
    };
    // Heads of 32 take no groups of 64 unpaired; the error says what would.
    assert_fails(
        &["quantize", "--format", "int4-v64", arg(&h32), arg(&q32)],
        &q32,
        "--pair-heads 2 joins adjacent heads into heads of 64",
    );
    quantize(&["--pair-heads", "2"], &h32, &q32);
    quantize(&[], &h64, &q64);
    let (a, b) = (fs::read(&q32).unwrap(), fs::read(&q64).unwrap());
    assert_eq!(metadata(&a)["kvq.pair_heads"], "2");
    assert!(!metadata(&b).contains_key("kvq.pair_heads"));
    let (sa, sb) = (
        SafeTensors::deserialize(&a).unwrap(),
        SafeTensors::deserialize(&b).unwrap(),
    );
    let mut names = sa.names();
    names.sort();
    assert_eq!(names.len(), 6);
    for name in names {
        let (x, y) = (sa.tensor(name).unwrap(), sb.tensor(name).unwrap());
        assert_eq!((x.shape(), x.data()), (y.shape(), y.data()), "{name}");
    }
    kvq_ok(&["dequantize", arg(&q32), arg(&b32)]);
    kvq_ok(&["dequantize", arg(&q64), arg(&b64)]);
    let (a, b) = (fs::read(&b32).unwrap(), fs::read(&b64).unwrap());
    let (sa, sb) = (
        SafeTensors::deserialize(&a).unwrap(),
        SafeTensors::deserialize(&b).unwrap(),
    );
    for (name, shape) in [("k.0", vec![37, 4, 32]), ("extra", vec![2, 6, 32])] {
        let (x, y) = (sa.tensor(name).unwrap(), sb.tensor(name).unwrap());
        assert_eq!(x.shape(), &shape[..], "{name}");
        assert_eq!(x.data(), y.data(), "{name}");
    }
    // Three heads do not pair; 0 heads per pair is no pairing at all.
    write_input(&h32, &random_inputs(3, 32));
    for n in ["2", "0"] {
        assert_fails(
            &[
                "quantize",
                "--format",
                "int4-k32",
                "--pair-heads",
                n,
                arg(&h32),
                arg(&q32),
            ],
            &q32,
            "--pair-heads",
        );
    }
}

/// A failed run: exit code 1, exactly one `kvq: error:` line, and neither the output nor its
/// temp file written (an existing output stays as it was).
fn assert_fails(args: &[&str], out_path: &Path, mention: &str) {
    let before = fs::read(out_path).ok();
    let out = kvq(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
    assert!(stderr.starts_with("kvq: error: "), "{stderr}");
    assert!(
        stderr.contains(mention),
        "{args:?}: '{stderr}' lacks '{mention}'"
    );
    assert_eq!(
        fs::read(out_path).ok(),
        before,
        "{args:?} touched the output"
    );
    let mut tmp = out_path.as_os_str().to_owned();
    tmp.push(".tmp");
    assert!(!Path::new(&tmp).exists());
}

#[test]
fn bad_inputs_fail_cleanly() {
    let dir = scratch("bad");
    let good = dir.join("good.st");
    write_input(&good, &random_inputs(1, 64));
    let out = dir.join("out.st");
    let (g, o) = (arg(&good), arg(&out));

    let missing = dir.join("missing.st");
    assert_fails(
        &["quantize", "--format", "int4-k32", arg(&missing), o],
        &out,
        "cannot read",
    );

    let garbage = dir.join("garbage.st");
    fs::write(&garbage, b"\xff\xff\xff\xff\xff\xff\xff\x7fnot a header").unwrap();
    assert_fails(
        &["quantize", "--format", "int4-k32", arg(&garbage), o],
        &out,
        "not a valid safetensors file",
    );
    assert_fails(&["dequantize", arg(&garbage), o], &out, "not a valid");

    let ints = dir.join("ints.st");
    let data = [0u8; 4 * 64];
    let view = TensorView::new(Dtype::I32, vec![1, 64], &data).unwrap();
    fs::write(&ints, safetensors::serialize([("x", view)], None).unwrap()).unwrap();
    assert_fails(
        &["quantize", "--format", "fp8-e4m3", arg(&ints), o],
        &out,
        "dtype I32",
    );

    let d32 = dir.join("d32.st");
    write_input(&d32, &random_inputs(2, 32));
    assert_fails(
        &["quantize", "--format", "int4-v64", arg(&d32), o],
        &out,
        "multiple of 64",
    );
    assert_fails(
        &["quantize", "--format", "int4-k32", "--per-head", g, o],
        &out,
        "only to FP8",
    );
    assert_fails(
        &["quantize", "--format", "fp8-e4m3", "--scale", "-1", g, o],
        &out,
        "scale -1",
    );

    // A plain file is not a kvq file; a kvq file with a part removed is rejected.
    assert_fails(&["dequantize", g, o], &out, "kvq.format");
    let q = dir.join("q.st");
    let ok = kvq(&["quantize", "--format", "int4-v64", g, arg(&q)]);
    assert!(ok.status.success());
    let bytes = fs::read(&q).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<_> = st.iter().filter(|(n, _)| *n != "k.0.zeros").collect();
    let meta = metadata(&bytes);
    let broken = dir.join("broken.st");
    fs::write(&broken, safetensors::serialize(kept, Some(meta)).unwrap()).unwrap();
    assert_fails(&["dequantize", arg(&broken), o], &out, "zeros are missing");
    let kept: Vec<_> = st.iter().filter(|(n, _)| *n != "k.0.codes").collect();
    fs::write(
        &broken,
        safetensors::serialize(kept, Some(metadata(&bytes))).unwrap(),
    )
    .unwrap();
    assert_fails(
        &["dequantize", arg(&broken), o],
        &out,
        "'k.0.scales' has no 'k.0.codes' beside it",
    );

    // A failing run leaves an existing output alone.
    fs::write(&out, b"previous contents").unwrap();
    assert_fails(
        &["quantize", "--format", "int4-v64", arg(&d32), o],
        &out,
        "head_dim",
    );

    assert_fails(&["eval", g], &out, "no layer");

    // No output replaces an input of the run or a read-only file; a layer listed twice is
    // refused.
    assert_fails(
        &["quantize", "--format", "int4-k32", g, g],
        &good,
        "is an input of this command",
    );
    let layer = dir.join("layer.st");
    growing_layer(&layer, 32, 1.0);
    let l = arg(&layer);
    assert_fails(&["calibrate", l, l], &layer, "is an input of this command");
    let plan = dir.join("plan.json");
    assert_fails(
        &["eval", l, "--budget", "0.05", "--plan-out", l],
        &layer,
        "is an input of this command",
    );
    let locked = dir.join("locked.st");
    fs::write(&locked, b"keep").unwrap();
    let mut perms = fs::metadata(&locked).unwrap().permissions();
    perms.set_readonly(true);
    fs::set_permissions(&locked, perms).unwrap();
    assert_fails(
        &["quantize", "--format", "int4-k32", g, arg(&locked)],
        &locked,
        "is read-only",
    );
    assert_fails(
        &["calibrate", l, arg(&plan), "--layers", "0,0"],
        &plan,
        "names layer 0 twice",
    );
    assert_fails(
        &["eval", l, "--layers", "0,0"],
        &plan,
        "names layer 0 twice",
    );
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &["quantize", "in.st"][..],
        &[
            "quantize",
            "--format",
            "fp8-e4m3",
            "--scale",
            "1",
            "--per-head",
            "a",
            "b",
        ],
        &[
            "quantize", "--format", "fp8-e4m3", "--scale", "abc", "a", "b",
        ],
        &["frobnicate"],
        &[],
        // More outlier channels than the synthetic head_dim (128) has.
        &["eval", "--outliers", "129:8"],
        &["bench", "--iters", "0"],
        // A format name clap does not list; it suggests the nearest.
        &["quantize", "--format", "int4_v64", "a", "b"],
    ] {
        let out = kvq(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
    let out = kvq(&["quantize", "--format", "int4_v64", "a", "b"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("'int4-v64'"), "{stderr}");
}

#[test]
fn non_finite_inputs_are_reported_not_fatal() {
    let dir = scratch("nonfinite");
    let (input, q) = (dir.join("in.st"), dir.join("q.st"));
    let mut values = vec![0.5f32; 2 * 32];
    values[3] = f32::NAN;
    values[40] = f32::INFINITY;
    write_input(
        &input,
        &[In {
            name: "x",
            dtype: Dtype::F32,
            shape: vec![2, 32],
            values,
        }],
    );
    let out = kvq(&["quantize", "--format", "int4-k32", arg(&input), arg(&q)]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("2 non-finite"));
}

/// A layer file `q.0` / `k.0` / `v.0` (f32, 2 query and 2 KV heads of `head_dim`, 8 tokens).
fn layer_of_head_dim(path: &Path, head_dim: usize) {
    let mut rng = common::Rng(5);
    let mut t = |name| In {
        name,
        dtype: Dtype::F32,
        shape: vec![8, 2, head_dim],
        values: rng.normals(8 * 2 * head_dim, 1.0),
    };
    write_input(path, &[t("q.0"), t("k.0"), t("v.0")]);
}

#[test]
fn eval_says_what_to_do_with_a_head_dim_no_format_takes() {
    let dir = scratch("headdim");
    let (odd, d32) = (dir.join("odd.st"), dir.join("d32.st"));
    layer_of_head_dim(&odd, 7);
    layer_of_head_dim(&d32, 32);
    assert_fails(&["eval", arg(&odd)], &dir.join("none"), "--pair-heads N");
    let out = kvq_ok(&["eval", arg(&d32), "--only", "int4-v64,bf16"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("| int4-k32 / int4-v64 | n/a |"), "{stdout}");
    assert!(stdout.contains("--pair-heads N scores"), "{stdout}");
    // In JSON a skipped pair has no storage, and the int4-kc rows name their format as
    // `quantize` takes it, the group beside it.
    let doc = eval_json(&["eval", arg(&d32), "--json", "--only", "int4-v64,int4-kc"]);
    let rows = doc["pairs"].as_array().unwrap();
    let v64 = rows
        .iter()
        .find(|r| r["label"] == "int4-k32 / int4-v64")
        .unwrap();
    assert!(
        v64["bytes_per_element"].is_null() && v64["skipped"].is_string(),
        "{v64}"
    );
    let kc = rows
        .iter()
        .find(|r| r["k_format"] == "int4-kc" && r["skipped"].is_null())
        .unwrap();
    assert_eq!(kc["kc_group"], 32, "{kc}");
    assert!(kc["bytes_per_element"].is_number(), "{kc}");
    assert_eq!(doc["scored_queries"], doc["q_heads"]);
}

#[test]
fn eval_reads_tensors_by_name_pattern() {
    let dir = scratch("patterns");
    let (plain, named) = (dir.join("plain.st"), dir.join("named.st"));
    growing_layer(&plain, 32, 1.0);
    let bytes = fs::read(&plain).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let renamed: Vec<(String, _)> = st
        .iter()
        .map(|(n, t)| (format!("model.layers.0.attn.{}", &n[..1]), t))
        .collect();
    fs::write(&named, safetensors::serialize(renamed, None).unwrap()).unwrap();
    let only = ["--only", "int4-k32"];
    let want = kvq(&[&["eval", arg(&plain)][..], &only].concat());
    let pattern = |x: &str| format!("model.layers.{{L}}.attn.{x}");
    let (q, k, v) = (pattern("q"), pattern("k"), pattern("v"));
    let got = kvq(&[
        &[
            "eval",
            arg(&named),
            "--query-pattern",
            &q,
            "--key-pattern",
            &k,
        ][..],
        &["--value-pattern", &v],
        &only,
    ]
    .concat());
    assert!(
        got.status.success(),
        "{}",
        String::from_utf8_lossy(&got.stderr)
    );
    let table = |o: &Output| {
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        text[text.find("| K / V format").unwrap()..].to_string()
    };
    assert_eq!(table(&got), table(&want));
    // Without the patterns: what each default finds, and the names the file has.
    assert_fails(
        &["eval", arg(&named)],
        &dir.join("none"),
        "(--query-pattern, --key-pattern, --value-pattern): q.{L}: none, k.{L}: none, v.{L}: \
         none; its tensors: model.layers.0.attn.k, model.layers.0.attn.q, model.layers.0.attn.v",
    );
    // One pattern wrong: the other two still find their layer.
    assert_fails(
        &["eval", arg(&plain), "--key-pattern", "key.{L}"],
        &dir.join("none"),
        "q.{L}: layers 0..=0 (1 of them), key.{L}: none, v.{L}: layers 0..=0 (1 of them)",
    );
    // A file `kvq quantize` wrote: dequantize it first.
    let quantized = dir.join("q.st");
    kvq_ok(&[
        "quantize",
        "--format",
        "int4-k32",
        arg(&plain),
        arg(&quantized),
    ]);
    assert_fails(
        &["eval", arg(&quantized)],
        &dir.join("none"),
        "`kvq dequantize` turns them back into tensors",
    );
}

#[test]
fn a_fixed_fp8_scale_that_loses_values_is_reported() {
    let dir = scratch("fixedscale");
    let (input, q) = (dir.join("in.st"), dir.join("q.st"));
    // 1000 x 2 and 0.5 x 14 of 16 values.
    let mut values = vec![0.5f32; 16];
    values[0] = 1000.0;
    values[1] = -1000.0;
    write_input(
        &input,
        &[In {
            name: "x",
            dtype: Dtype::F32,
            shape: vec![1, 16],
            values,
        }],
    );
    let note = |scale: &str| {
        let out = kvq(&[
            "quantize",
            "--format",
            "fp8-e4m3",
            "--scale",
            scale,
            arg(&input),
            arg(&q),
        ]);
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // 448 x 1 saturates the two large values; 448 x 4 holds them; 1e4's smallest step
    // (2^-9 x 1e4 = 19.5) flushes the fourteen 0.5s.
    assert!(note("1").contains("2 value(s) saturated"), "{}", note("1"));
    assert!(note("4").is_empty(), "{}", note("4"));
    assert!(
        note("1e4").contains("14 nonzero value(s) flushed"),
        "{}",
        note("1e4")
    );
    let meta = metadata(&fs::read(&q).unwrap());
    assert_eq!(
        meta.get("kvq.scale").map(String::as_str),
        Some("fixed 10000")
    );
    assert!(
        kvq(&["quantize", "--format", "int8-pth", arg(&input), arg(&q)])
            .status
            .success()
    );
    assert!(!metadata(&fs::read(&q).unwrap()).contains_key("kvq.scale"));
}

/// `quantize --scales FILE` quantizes keys and values under a `kvq calibrate` file's per-head
/// scales: calibrated on the first half of a layer whose second half grows, the file's scales
/// are the stored ones, the grown values saturate (a note counts them), and what the file has
/// no scales for, or scales of another FP8 encoding, is refused.
#[test]
fn quantize_takes_scales_from_calibrate() {
    let dir = scratch("quantize-scales");
    let (input, scales, kv, q) = (
        dir.join("growing.st"),
        dir.join("scales.st"),
        dir.join("kv.st"),
        dir.join("q.st"),
    );
    growing_layer(&input, 32, 4.0);
    kvq_ok(&["calibrate", arg(&input), arg(&scales), "--tokens", "0..16"]);
    let calibrated = fs::read(&scales).unwrap();
    let calibrated = SafeTensors::deserialize(&calibrated).unwrap();
    // The keys and values alone (the file has no scales for q.0).
    let only_kv = dir.join("only-kv.st");
    let source = fs::read(&input).unwrap();
    let source = SafeTensors::deserialize(&source).unwrap();
    let tensor = |name: &'static str| {
        let t = source.tensor(name).unwrap();
        let values = t
            .data()
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        In {
            name,
            dtype: Dtype::F16,
            shape: t.shape().to_vec(),
            values,
        }
    };
    write_input(&only_kv, &[tensor("k.0"), tensor("v.0")]);
    let out = kvq_ok(&[
        "quantize",
        "--format",
        "fp8-e4m3",
        "--scales",
        arg(&scales),
        arg(&only_kv),
        arg(&kv),
    ]);
    let note = String::from_utf8_lossy(&out.stderr);
    assert!(note.contains("value(s) saturated"), "{note}");
    let bytes = fs::read(&kv).unwrap();
    assert!(metadata(&bytes)["kvq.scale"].contains("scales.st"));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for (stored, file) in [("k.0.scales", "k_scale.0"), ("v.0.scales", "v_scale.0")] {
        assert_eq!(f32_vector(&st, stored), f32_vector(&calibrated, file));
    }

    // q.0 has no scales in the file; an E5M2 file does not serve E4M3 codes; --scales is FP8's.
    assert_fails(
        &[
            "quantize",
            "--format",
            "fp8-e4m3",
            "--scales",
            arg(&scales),
            arg(&input),
            arg(&q),
        ],
        &q,
        "'q.0' is neither keys nor values",
    );
    let e5m2 = dir.join("e5m2.st");
    kvq_ok(&["calibrate", "--format", "e5m2", arg(&input), arg(&e5m2)]);
    assert_fails(
        &[
            "quantize",
            "--format",
            "fp8-e4m3",
            "--scales",
            arg(&e5m2),
            arg(&only_kv),
            arg(&q),
        ],
        &q,
        "holds e5m2 scales",
    );
    assert_fails(
        &[
            "quantize",
            "--format",
            "int8-pth",
            "--scales",
            arg(&scales),
            arg(&only_kv),
            arg(&q),
        ],
        &q,
        "apply only to FP8 formats",
    );
}

#[test]
fn eval_reports_every_pair() {
    let dir = scratch("eval");
    let input = dir.join("layers.st");
    let mut rng = Rng(5);
    let mut t = |name, heads| {
        let shape = vec![40, heads, 64];
        In {
            name,
            dtype: Dtype::F16,
            values: rng.vec(shape.iter().product()),
            shape,
        }
    };
    // GQA: 8 query heads over 4 KV heads.
    write_input(&input, &[t("q.3", 8), t("k.3", 4), t("v.3", 4)]);
    let out = kvq_ok(&["eval", arg(&input), "--block-size", "16", "--per-layer"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    for label in [
        "| f16 / f16 |",
        "| bf16 / bf16 |",
        "| fp8-e4m3 / fp8-e4m3 (tensor) |",
        "| fp8-e4m3 / fp8-e4m3 (head) |",
        "| fp8-e4m3 / fp8-e4m3 (head, e4m3 MMAs) |",
        "| fp4-e2m1 / fp4-e2m1 (head, e4m3 MMAs) |",
        "| int4-k32 / int4-v64 | 0.5625 |",
        "| int4-k32 / fp8-e4m3 (head) |",
        "| fp8-e4m3 / int4-v64 (head) |",
        "| int4-uniform / int4-uniform |",
        "| int4-kc (G=32) / int4-v64 | 0.5938 |",
        "| int4-kc (G=32) / fp8-e4m3 (head) |",
        // int8-pth's f32 row scale at this head_dim: 1 + 4 / 64 (not 128's 1.0312).
        "| int8-pth / int8-pth | 1.0625 |",
        "| fp8-e4m3 / int4-v64 (head) | 0.7812 |",
        "| L3 int4-k32 / int4-v64 |",
    ] {
        assert!(stdout.contains(label), "missing {label}:\n{stdout}");
    }
    assert!(!stdout.contains("n/a"), "{stdout}");

    assert_fails(
        &["eval", arg(&input), "--layers", "0"],
        &dir.join("none"),
        "layer 0 is not in",
    );
    assert_fails(
        &["eval", arg(&input), "--pair-heads", "3"],
        &dir.join("none"),
        "--pair-heads 3",
    );
}

/// A layer file (`q.0`, `k.0`, `v.0`, f16; 4 query / 2 KV heads of 64) of `tokens` tokens
/// whose second half is `growth` times the first.
fn growing_layer(path: &Path, tokens: usize, growth: f32) {
    let mut rng = common::Rng(11);
    let mut t = |name, heads: usize| {
        let row = heads * 64;
        let mut values = rng.normals(tokens * row, 1.0);
        values[tokens / 2 * row..]
            .iter_mut()
            .for_each(|x| *x *= growth);
        In {
            name,
            dtype: Dtype::F16,
            shape: vec![tokens, heads, 64],
            values,
        }
    };
    write_input(path, &[t("q.0", 4), t("k.0", 2), t("v.0", 2)]);
}

/// `kvq ARGS` (which must include `--json`), successful, its stdout parsed.
fn eval_json(args: &[&str]) -> serde_json::Value {
    let out = kvq_ok(args);
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{args:?}: not JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The pooled row `label` of a JSON report.
fn pair<'a>(doc: &'a serde_json::Value, label: &str) -> &'a serde_json::Value {
    doc["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["label"] == label)
        .unwrap_or_else(|| panic!("no pair {label}: {doc}"))
}

#[test]
fn eval_json_held_out_calibration_and_positions() {
    let dir = scratch("eval-json");
    let input = dir.join("growing.st");
    growing_layer(&input, 32, 4.0);
    let file = arg(&input);

    let held = eval_json(&["eval", file, "--json"]);
    assert_eq!(held["calibrate_on"], "first-half");
    assert_eq!(held["calibration_tokens"], serde_json::json!([0, 16]));
    assert_eq!(held["scored_tokens"], serde_json::json!([16, 32]));
    assert_eq!(held["positions"], "last");
    assert_eq!(held["query_positions"], 1);
    assert_eq!(held["tokens"], 32);
    assert_eq!(held["q_heads"], 4);
    assert_eq!(held["kv_heads"], 2);
    assert_eq!(held["pairs"].as_array().unwrap().len(), 17);
    assert!(held.get("per_layer").is_none());
    for p in held["pairs"].as_array().unwrap() {
        assert!(p["skipped"].is_null() && p["errors"].is_object(), "{p}");
    }
    // The file is f16: an f16 cache is exact.
    let f16 = &pair(&held, "f16 / f16")["errors"];
    assert_eq!(f16["k_rel_l2"], 0.0);
    assert_eq!(f16["attn_rel_err"], 0.0);

    // Scales from the first half saturate the (4x larger) second half; in-sample they do not.
    let all = eval_json(&["eval", file, "--json", "--calibrate-on", "all"]);
    assert_eq!(all["scored_tokens"], serde_json::json!([0, 32]));
    let k_err = |doc: &serde_json::Value| {
        pair(doc, "fp8-e4m3 / fp8-e4m3 (head)")["errors"]["k_rel_l2"]
            .as_f64()
            .unwrap()
    };
    assert!(k_err(&held) > 5.0 * k_err(&all), "{held}\n{all}");
    assert!(k_err(&all) < 0.05, "{all}");

    // E4M3 MMA operands: the same cache, so the same K / V errors; the query and the
    // probabilities rounded to E4M3 move the output a little more.
    let (decoded, e4m3) = (
        pair(&all, "fp8-e4m3 / fp8-e4m3 (head)"),
        pair(&all, "fp8-e4m3 / fp8-e4m3 (head, e4m3 MMAs)"),
    );
    assert_eq!(
        (
            decoded["mma_operands"].as_str(),
            e4m3["mma_operands"].as_str()
        ),
        (Some("decoded"), Some("e4m3"))
    );
    for key in ["k_rel_l2", "v_rel_l2"] {
        assert_eq!(decoded["errors"][key], e4m3["errors"][key], "{key}");
    }
    let attn = |p: &serde_json::Value| p["errors"]["attn_rel_err"].as_f64().unwrap();
    assert!(
        attn(e4m3) != attn(decoded) && attn(e4m3) < 2.0 * attn(decoded),
        "{all}"
    );

    // --only keeps the rows whose label contains a text, in any case; none is an error.
    let only = eval_json(&["eval", file, "--json", "--only", "E4M3 MMAs,bf16"]);
    let labels: Vec<&str> = only["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["label"].as_str().unwrap())
        .collect();
    assert_eq!(
        labels,
        [
            "bf16 / bf16",
            "fp8-e4m3 / fp8-e4m3 (head, e4m3 MMAs)",
            "fp4-e2m1 / fp4-e2m1 (head, e4m3 MMAs)"
        ]
    );
    assert_fails(
        &["eval", file, "--only", "int9"],
        &dir.join("none"),
        "--only int9: no row",
    );

    // Every scored position: the held-out half, or every token.
    let every = eval_json(&["eval", file, "--json", "--positions", "all", "--per-layer"]);
    assert_eq!(every["query_positions"], 16);
    assert_eq!(every["per_layer"].as_array().unwrap().len(), 17);
    assert_eq!(every["per_layer"][0]["layer"], 0);
    assert_eq!(pair(&every, "f16 / f16")["errors"]["attn_rel_err"], 0.0);
    let every_all = eval_json(&[
        "eval",
        file,
        "--json",
        "--positions",
        "all",
        "--calibrate-on",
        "all",
    ]);
    assert_eq!(every_all["query_positions"], 32);
    let int4 = pair(&every_all, "int4-k32 / int4-v64")["errors"]["attn_rel_err"]
        .as_f64()
        .unwrap();
    assert!(0.0 < int4 && int4 < 0.5, "{every_all}");
    // The attention distributions: exact with f16 keys, moved (a little) by INT4 keys.
    let probs = |label: &str| {
        let e = &pair(&every_all, label)["errors"];
        (
            e["attn_kl"].as_f64().unwrap(),
            e["top1_kept"].as_f64().unwrap(),
        )
    };
    assert_eq!(probs("f16 / f16"), (0.0, 1.0));
    let (kl, top1) = probs("int4-k32 / int4-v64");
    assert!(
        kl > 0.0 && kl < 0.5 && top1 > 0.5 && top1 <= 1.0,
        "{kl} {top1}"
    );

    // The Markdown table says what was calibrated and scored.
    let out = kvq(&["eval", file, "--positions", "all"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("scales from tokens 0..16"), "{text}");
    assert!(text.contains("the queries of tokens 16..32"), "{text}");

    // One token cannot be split into calibration and scoring.
    let one = dir.join("one.st");
    growing_layer(&one, 1, 1.0);
    assert_fails(&["eval", arg(&one)], &dir.join("none"), "at least 2 tokens");
    let ok = eval_json(&["eval", arg(&one), "--json", "--calibrate-on", "all"]);
    assert_eq!(ok["query_positions"], 1);
    for bad in [
        &["eval", file, "--positions", "middle"][..],
        &["eval", file, "--calibrate-on", "last-half"],
    ] {
        assert_eq!(kvq(bad).status.code(), Some(2), "{bad:?}");
    }
}

/// Without a file, `eval` runs on synthetic Llama-like layers (a user has no data yet).
#[test]
fn eval_without_a_file_is_synthetic() {
    let doc = eval_json(&["eval", "--json", "--layers", "1"]);
    assert!(doc["input"].is_null());
    assert!(doc["source"].as_str().unwrap().starts_with("synthetic"));
    assert_eq!(doc["layers"], serde_json::json!([1]));
    assert_eq!(
        [
            &doc["tokens"],
            &doc["q_heads"],
            &doc["kv_heads"],
            &doc["head_dim"]
        ],
        [512, 32, 8, 128]
    );
    let err = |label| {
        pair(&doc, label)["errors"]["attn_rel_err"]
            .as_f64()
            .unwrap()
    };
    let (bf16, int4) = (err("bf16 / bf16"), err("int4-k32 / int4-v64"));
    assert!(0.0 < bf16 && bf16 < int4 && int4 < 0.2, "{doc}");
    assert_fails(
        &["eval", "--layers", "2"],
        Path::new("none"),
        "layer 2 is not in",
    );
}

/// `int4-kc` rows on synthetic keys with strong outlier channels (issue 20's case): per-channel
/// groups at most 0.55x the attention error of per-token INT4 keys; bad flags are refused.
#[test]
fn eval_int4_kc_on_outlier_channels() {
    let doc = eval_json(&["eval", "--json", "--outliers", "4:20"]);
    assert!(
        doc["source"]
            .as_str()
            .unwrap()
            .contains("4 outlier channel(s) at 20x")
    );
    let attn = |label: &str| {
        pair(&doc, label)["errors"]["attn_rel_err"]
            .as_f64()
            .unwrap()
    };
    for v in ["int4-v64", "fp8-e4m3 (head)"] {
        let (kc, k32) = (
            attn(&format!("int4-kc (G=32) / {v}")),
            attn(&format!("int4-k32 / {v}")),
        );
        assert!(kc <= 0.55 * k32, "{v}: {kc} vs {k32}");
    }
    let g16 = eval_json(&["eval", "--json", "--layers", "0", "--kc-group", "16"]);
    assert_eq!(
        pair(&g16, "int4-kc (G=16) / int4-v64")["bytes_per_element"],
        0.65625
    );
    assert_fails(
        &["eval", "--kc-group", "24"],
        Path::new("none"),
        "16, 32 or 64",
    );
    for bad in [
        &["eval", "--outliers", "4"][..],
        &["eval", "--outliers", "4:-1"],
    ] {
        assert_eq!(kvq(bad).status.code(), Some(2), "{bad:?}");
    }
}

/// Outlier-aware sub-4-bit key rows (`int3` / `int2 + topK f16`): their bytes per element count
/// codes, row metadata and the f16 channels; keeping the outlier channels beats plain INT3 rows
/// (`--keep-channels 0`); a --keep-channels that leaves no channel to quantize, or a malformed
/// --outliers offset, is refused.
#[test]
fn eval_outlier_aware_sub_4_bit_keys() {
    let args = ["eval", "--json", "--layers", "0", "--outliers", "4:20:10"];
    let doc = eval_json(&args);
    assert!(
        doc["source"]
            .as_str()
            .unwrap()
            .contains("4 outlier channel(s) at 20x, offset +-10 std"),
        "{doc}"
    );
    let bpe = |doc: &serde_json::Value, label: &str| pair(doc, label)["bytes_per_element"].clone();
    let attn = |doc: &serde_json::Value, label: &str| {
        pair(doc, label)["errors"]["attn_rel_err"].as_f64().unwrap()
    };
    // head_dim 128: (ceil(124 × b / 8) + 4 + 2 × 4) / 128 for K, 0.5625 for int4-v64.
    let (int3, int2) = ("int3 + top4 f16 / int4-v64", "int2 + top4 f16 / int4-v64");
    assert_eq!(bpe(&doc, int3), (59.0 / 128.0 + 0.5625) / 2.0);
    assert_eq!(bpe(&doc, int2), (43.0 / 128.0 + 0.5625) / 2.0);
    // V goes the int4-k32 / int4-v64 row's way: the same V error.
    let v = |label| pair(&doc, label)["errors"]["v_rel_l2"].clone();
    assert_eq!(v(int3), v("int4-k32 / int4-v64"));
    assert_eq!(v(int2), v("int4-k32 / int4-v64"));
    let (e3, e2, k32) = (
        attn(&doc, int3),
        attn(&doc, int2),
        attn(&doc, "int4-k32 / int4-v64"),
    );
    assert!(e3 < e2 && e3 < k32, "{e3} {e2} {k32}");

    let none = eval_json(&[&args[..], &["--keep-channels", "0"]].concat());
    let plain3 = "int3 + top0 f16 / int4-v64";
    assert_eq!(bpe(&none, plain3), (52.0 / 128.0 + 0.5625) / 2.0);
    assert!(
        e3 < 0.5 * attn(&none, plain3),
        "{e3} vs {}",
        attn(&none, plain3)
    );

    assert_fails(
        &["eval", "--layers", "0", "--keep-channels", "128"],
        Path::new("none"),
        "--keep-channels 128 at head_dim 128",
    );
    for bad in [
        &["eval", "--keep-channels", "-1"][..],
        &["eval", "--outliers", "4:20:-1"],
        &["eval", "--outliers", "4:20:10:1"],
    ] {
        assert_eq!(kvq(bad).status.code(), Some(2), "{bad:?}");
    }
}

/// The attention-error column of `label`'s row.
fn attn_error(table: &str, label: &str) -> f64 {
    let row = table
        .lines()
        .find(|l| l.starts_with(&format!("| {label} |")))
        .unwrap_or_else(|| panic!("no row {label}:\n{table}"));
    row.trim_end_matches('|')
        .rsplit('|')
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn eval_on_real_minilm_kv() {
    let Some(file) = common::minilm_data("eval_on_real_minilm_kv") else {
        return;
    };
    let out = kvq_ok(&["eval", arg(&file), "--pair-heads", "2", "--layers", "0,5"]);
    let table = String::from_utf8_lossy(&out.stdout);
    // The file is f16, so an f16 cache is exact; the rest degrade in the expected order.
    assert_eq!(attn_error(&table, "f16 / f16"), 0.0);
    let fp8 = attn_error(&table, "fp8-e4m3 / fp8-e4m3 (head)");
    let int4 = attn_error(&table, "int4-k32 / int4-v64");
    let uniform = attn_error(&table, "int4-uniform / int4-uniform");
    assert!(0.0 < fp8 && fp8 < int4 && int4 < uniform, "{table}");
    assert!(int4 < 0.2, "{table}");
}

/// A file's F32 `[n]` tensor `name`.
fn f32_vector(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|_| panic!("no {name}"));
    assert_eq!((t.dtype(), t.shape().len()), (Dtype::F32, 1), "{name}");
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Each joined head's |x| values of `[tokens, heads, d]` values, `pair` heads joined.
fn joined_abs(values: &[f32], heads: usize, d: usize, pair: usize) -> Vec<Vec<f32>> {
    let mut out = vec![Vec::new(); heads / pair];
    for (r, row) in values.chunks_exact(d).enumerate() {
        out[r % heads / pair].extend(row.iter().map(|x| x.abs()));
    }
    out
}

/// `kvq calibrate` under other tensor names, with joined heads, by amax and by percentile: the
/// scales are recomputed here from FORMATS.md (amax / max_finite) and the nearest rank.
#[test]
fn calibrate_writes_per_head_scales() {
    let dir = scratch("calibrate");
    let (input, output) = (dir.join("dump.st"), dir.join("scales.st"));
    let mut rng = Rng(23);
    let mut t = |name| {
        let shape = vec![24, 4, 32];
        In {
            name,
            dtype: Dtype::F16,
            values: rng.vec(shape.iter().product()),
            shape,
        }
    };
    let tensors = [
        t("model.layers.0.k"),
        t("model.layers.0.v"),
        t("model.layers.1.k"),
        t("model.layers.1.v"),
        t("model.layers.2.k"), // no values: not a layer
    ];
    write_input(&input, &tensors);
    let (i, o) = (arg(&input), arg(&output));
    let patterns = [
        "--key-pattern",
        "model.layers.{L}.k",
        "--value-pattern",
        "model.layers.{L}.v",
        "--pair-heads",
        "2",
    ];
    for (method, kind_args, max_finite, format) in [
        (
            &["--method", "amax"][..],
            &["--format", "e5m2"][..],
            57344.0,
            "fp8-e5m2",
        ),
        (
            &["--method", "percentile", "--percentile", "50"],
            &[],
            448.0,
            "fp8-e4m3",
        ),
    ] {
        let mut args = vec!["calibrate", i, o];
        args.extend(patterns);
        args.extend(method);
        args.extend(kind_args);
        let out = kvq_ok(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("2 layer(s) of 2 kv heads"), "{stdout}");
        let bytes = fs::read(&output).unwrap();
        let meta = metadata(&bytes);
        assert_eq!(meta["kvq.format"], format);
        assert_eq!(meta["kvq.method"], method[1]);
        assert_eq!(meta["kvq.pair_heads"], "2");
        assert_eq!(
            meta.get("kvq.percentile").map(String::as_str),
            method.get(3).copied()
        );
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut names = st.names();
        names.sort();
        assert_eq!(names, ["k_scale.0", "k_scale.1", "v_scale.0", "v_scale.1"]);
        for (j, tensor) in tensors[..4].iter().enumerate() {
            let name = format!("{}_scale.{}", ["k", "v"][j % 2], j / 2);
            let expected: Vec<f32> = joined_abs(&tensor.stored_values(), 4, 32, 2)
                .into_iter()
                .map(|mut abs| {
                    abs.sort_by(f32::total_cmp);
                    // amax, or the nearest rank of the 50th percentile: ⌈n / 2⌉.
                    let c = if method[1] == "amax" {
                        abs[abs.len() - 1]
                    } else {
                        abs[abs.len().div_ceil(2) - 1]
                    };
                    c / max_finite
                })
                .collect();
            assert_eq!(f32_vector(&st, &name), expected, "{name} {method:?}");
        }
    }

    // --tokens A..B: the scales of those tokens alone, the range in the metadata.
    let mut args = vec!["calibrate", i, o, "--tokens", "8..20"];
    args.extend(patterns);
    kvq_ok(&args);
    let bytes = fs::read(&output).unwrap();
    assert_eq!(metadata(&bytes)["kvq.tokens"], "8..20");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let row = 4 * 32;
    let part = tensors[0].stored_values()[8 * row..20 * row].to_vec();
    let expected: Vec<f32> = joined_abs(&part, 4, 32, 2)
        .into_iter()
        .map(|abs| abs.into_iter().fold(0f32, f32::max) / 448.0)
        .collect();
    assert_eq!(f32_vector(&st, "k_scale.0"), expected);

    let none = dir.join("none.st");
    let n = arg(&none);
    let mut past = vec!["calibrate", i, n, "--tokens", "8..25"];
    past.extend(patterns);
    assert_fails(&past, &none, "--tokens 8..25 reaches past its 24 tokens");
    for bad in ["8..8", "9..3", "8", "a..b"] {
        let out = kvq(&["calibrate", i, n, "--tokens", bad]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
    }
    for (args, mention) in [
        (
            &["calibrate", i, n][..],
            "holds no layer with all of k.{L}, v.{L} (--key-pattern, --value-pattern)",
        ),
        (
            &["calibrate", i, n, "--percentile", "99"],
            "only with --method percentile",
        ),
        (
            &[
                "calibrate",
                i,
                n,
                "--method",
                "percentile",
                "--percentile",
                "0",
            ],
            "percentile 0 is not in (0, 100]",
        ),
        (
            &[
                "calibrate",
                i,
                n,
                "--method",
                "percentile",
                "--percentile",
                "-5",
            ],
            "percentile -5 is not in",
        ),
    ] {
        assert_fails(args, &none, mention);
    }
    let mut args = vec!["calibrate", i, n];
    args.extend(patterns);
    assert_fails(
        &[&args[..], &["--layers", "2"]].concat(),
        &none,
        "layer 2 is not in",
    );
    args[8] = "3";
    assert_fails(&args, &none, "--pair-heads 3");
    // A dump of no tokens has nothing to calibrate on.
    let empty = dir.join("empty.st");
    let t = |name| In {
        name,
        dtype: Dtype::F32,
        shape: vec![0, 2, 16],
        values: Vec::new(),
    };
    write_input(&empty, &[t("k.0"), t("v.0")]);
    assert_fails(&["calibrate", arg(&empty), n], &none, "no tokens");
    assert_eq!(
        kvq(&["calibrate", i, n, "--key-pattern", "k"])
            .status
            .code(),
        Some(2)
    );
    assert!(!none.exists());
}

/// `eval --scales FILE`: the per-head rows of the file's format take its scales; scales of every
/// token are exactly what `--calibrate-on all` calibrates, so the rows agree to the bit.
#[test]
fn eval_takes_scales_from_calibrate() {
    let dir = scratch("eval-scales");
    let (input, scales) = (dir.join("growing.st"), dir.join("scales.st"));
    growing_layer(&input, 32, 4.0);
    let (file, s) = (arg(&input), arg(&scales));
    kvq_ok(&["calibrate", file, s]);

    let calibrated = eval_json(&["eval", file, "--json", "--calibrate-on", "all"]);
    // In-sample scores with a scales file's scales.
    let in_sample_with = |scales: &str| {
        eval_json(&[
            "eval",
            file,
            "--json",
            "--calibrate-on",
            "all",
            "--scales",
            scales,
        ])
    };
    let from_file = in_sample_with(s);
    assert_eq!(from_file["scales_file"], s);
    for (head, file_row) in [
        ("fp8-e4m3 / fp8-e4m3 (head)", "fp8-e4m3 / fp8-e4m3 (file)"),
        ("int4-k32 / fp8-e4m3 (head)", "int4-k32 / fp8-e4m3 (file)"),
        ("fp8-e4m3 / int4-v64 (head)", "fp8-e4m3 / int4-v64 (file)"),
    ] {
        assert_eq!(
            pair(&calibrated, head)["errors"],
            pair(&from_file, file_row)["errors"]
        );
        assert_eq!(pair(&from_file, file_row)["fp8_scales"], "file");
    }
    // E5M2 rows keep their own scales: the file is for E4M3.
    let e5m2 = "fp8-e5m2 / fp8-e5m2 (head)";
    assert_eq!(pair(&calibrated, e5m2), pair(&from_file, e5m2));
    // --per-tensor: one scale a layer, in every head's place, which is what the (tensor) rows
    // calibrate in-sample: the (file) row agrees with them to the bit.
    let tensor_scales = dir.join("tensor.st");
    kvq_ok(&["calibrate", file, arg(&tensor_scales), "--per-tensor"]);
    let bytes = fs::read(&tensor_scales).unwrap();
    assert_eq!(metadata(&bytes)["kvq.granularity"], "tensor");
    let k = f32_vector(&SafeTensors::deserialize(&bytes).unwrap(), "k_scale.0");
    assert!(k.len() == 2 && k[0] == k[1], "{k:?}");
    let per_tensor = in_sample_with(arg(&tensor_scales));
    assert_eq!(
        pair(&calibrated, "fp8-e4m3 / fp8-e4m3 (tensor)")["errors"],
        pair(&per_tensor, "fp8-e4m3 / fp8-e4m3 (file)")["errors"]
    );
    // Held out, the file's in-sample scales do not saturate the grown half.
    let held = eval_json(&["eval", file, "--json"]);
    let held_file = eval_json(&["eval", file, "--json", "--scales", s]);
    let k_err =
        |doc: &serde_json::Value, label| pair(doc, label)["errors"]["k_rel_l2"].as_f64().unwrap();
    assert!(
        k_err(&held_file, "fp8-e4m3 / fp8-e4m3 (file)")
            < k_err(&held, "fp8-e4m3 / fp8-e4m3 (head)") / 5.0
    );

    // Scales of other heads, or of no FP8 format, or none at all, are refused.
    let none = dir.join("none");
    let joined = dir.join("joined.st");
    let out = kvq(&["calibrate", file, arg(&joined), "--pair-heads", "2"]);
    assert!(out.status.success());
    assert_fails(
        &["eval", file, "--scales", arg(&joined)],
        &none,
        "1 scales for layer 0",
    );
    assert_fails(
        &["eval", file, "--scales", file],
        &none,
        "not written by `kvq calibrate`",
    );
    assert_fails(
        &["eval", file, "--scales", arg(&none)],
        &none,
        "cannot read",
    );
    // A calibrate output and a quantize output are told apart.
    let codes = dir.join("codes.st");
    assert!(
        kvq(&["quantize", "--format", "fp8-e4m3", file, arg(&codes)])
            .status
            .success()
    );
    assert_fails(
        &["eval", file, "--scales", arg(&codes)],
        &none,
        "holds codes, not scales",
    );
    assert_fails(
        &["dequantize", s, arg(&none)],
        &none,
        "holds scales written by `kvq calibrate`",
    );
    // Scales that do not fit are checked only where a scored row takes them.
    let only_int8 = kvq(&["eval", file, "--scales", arg(&joined), "--only", "int8"]);
    assert!(
        only_int8.status.success(),
        "{}",
        String::from_utf8_lossy(&only_int8.stderr)
    );
    // The report says whether the file's scales saw the scored tokens (16..32 here).
    for (tokens, says) in [
        (
            &["--tokens", "0..16"][..],
            "calibrated on tokens 0..16: held out",
        ),
        (&[], "calibrated on every token: in-sample for these rows"),
        (
            &["--tokens", "8..24"],
            "calibrated on tokens 8..24: in-sample where they meet 16..32",
        ),
    ] {
        kvq_ok(&[&["calibrate", file, s][..], tokens].concat());
        let out = kvq_ok(&["eval", file, "--scales", s, "--only", "fp8-e4m3 / fp8-e4m3"]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(says), "{tokens:?}: {text}");
    }
    let doc = eval_json(&["eval", file, "--scales", s, "--json", "--only", "bf16"]);
    assert_eq!(doc["scales_file_tokens"], serde_json::json!([8, 24]));
}

/// `eval --budget E`: the cheapest pair within `E` per layer, its plan file, and `--plan` scoring
/// that plan again.
#[test]
fn eval_budget_plans_the_cheapest_pair() {
    let dir = scratch("eval-budget");
    let (input, plan) = (dir.join("growing.st"), dir.join("plan.json"));
    growing_layer(&input, 32, 1.0);
    let (file, p) = (arg(&input), arg(&plan));

    // Any error allowed: the cheapest pairs the kernels serve (4-bit keys and values: INT4 and
    // FP4 cost the same, the lower error wins). None allowed: the file is f16, so f16 / f16 is
    // exact.
    for (budget, keys, values, bpe) in [
        (
            "1",
            &["int4-k32", "fp4-e2m1"][..],
            &["int4-v64", "fp4-e2m1"][..],
            0.5625,
        ),
        ("0", &["f16"][..], &["f16"][..], 2.0),
    ] {
        let doc = eval_json(&["eval", file, "--json", "--budget", budget, "--plan-out", p]);
        let written: serde_json::Value = serde_json::from_slice(&fs::read(&plan).unwrap()).unwrap();
        assert_eq!(doc["plan"], written);
        assert_eq!(written["budget"], budget.parse::<f64>().unwrap());
        let layers = written["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 1);
        let l = &layers[0];
        assert_eq!(l["layer"], 0);
        let name = |key: &str| l[key].as_str().unwrap().to_string();
        assert!(keys.contains(&name("k_format").as_str()), "{l}");
        assert!(values.contains(&name("v_format").as_str()), "{l}");
        assert_eq!(l["bytes_per_element"], bpe);
        assert_eq!(l["within_budget"], true);
        assert!(l["attn_err"].as_f64().unwrap() <= budget.parse::<f64>().unwrap());
    }
    // A budget between: every cheaper pair the kernels serve exceeds it.
    let doc = eval_json(&["eval", file, "--json", "--budget", "0.03", "--plan-out", p]);
    let chosen = &doc["plan"]["layers"][0];
    let err = chosen["attn_err"].as_f64().unwrap();
    assert!(
        err <= 0.03 && chosen["bytes_per_element"].as_f64().unwrap() < 2.0,
        "{doc}"
    );

    // The Markdown report, and the plan scored on the same data again.
    let out = kvq(&["eval", file, "--budget", "0.03"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("plan for --budget 3.00e-2"), "{text}");
    assert!(text.contains("bytes per element over 1 layer(s)"), "{text}");
    let again = eval_json(&["eval", file, "--json", "--plan", p]);
    let check = &again["plan_check"]["layers"][0];
    assert_eq!(check["attn_err"], chosen["attn_err"]);
    assert_eq!(check["within_budget"], true);
    let out = kvq(&["eval", file, "--plan", p]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("| 0 | "));
    // A plan and its check score every position (one query per head would not hold), unless
    // told otherwise; the plan says the head_dim it was measured at.
    assert_eq!(
        (doc["positions"].as_str(), again["positions"].as_str()),
        (Some("all"), Some("all"))
    );
    let last = eval_json(&[
        "eval",
        file,
        "--json",
        "--budget",
        "0.03",
        "--positions",
        "last",
    ]);
    assert_eq!(last["positions"], "last");
    assert_eq!(eval_json(&["eval", file, "--json"])["positions"], "last");
    assert_eq!(doc["plan"]["head_dim"], 64);
    let mut other: serde_json::Value = serde_json::from_slice(&fs::read(&plan).unwrap()).unwrap();
    other["head_dim"] = 128.into();
    let other_path = dir.join("plan128.json");
    fs::write(&other_path, other.to_string()).unwrap();
    assert_fails(
        &["eval", file, "--plan", arg(&other_path)],
        &dir.join("none"),
        "the plan was measured at head_dim 128, layer 0 here has heads of 64",
    );

    let none = dir.join("none");
    assert_fails(&["eval", file, "--budget", "-1"], &none, "budget -1");
    assert_fails(&["eval", file, "--plan", file], &none, "is not a kvq plan");
    for bad in [
        &["eval", file, "--plan-out", p][..],
        &["eval", file, "--budget", "1", "--plan", p],
    ] {
        assert_eq!(kvq(bad).status.code(), Some(2), "{bad:?}");
    }
}

/// On the MiniLM dump: scales from `calibrate` give the in-sample per-head error, and a budget
/// plan stays within its budget on every layer at less than FP8's bytes... or says so.
#[test]
fn calibrate_and_budget_on_real_minilm_kv() {
    let Some(data) = common::minilm_data("calibrate_and_budget_on_real_minilm_kv") else {
        return;
    };
    let dir = scratch("minilm-budget");
    let (scales, plan) = (dir.join("scales.st"), dir.join("plan.json"));
    let d = arg(&data);
    kvq_ok(&["calibrate", d, arg(&scales), "--pair-heads", "2"]);
    let doc = eval_json(&[
        "eval",
        d,
        "--json",
        "--pair-heads",
        "2",
        "--layers",
        "0,5",
        "--scales",
        arg(&scales),
        "--budget",
        "0.05",
        "--plan-out",
        arg(&plan),
    ]);
    let fp8 = pair(&doc, "fp8-e4m3 / fp8-e4m3 (file)")["errors"]["attn_rel_err"]
        .as_f64()
        .unwrap();
    assert!(0.0 < fp8 && fp8 < 0.06, "{doc}");
    let layers = doc["plan"]["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2);
    for l in layers {
        assert_eq!(l["within_budget"], true, "{l}");
        assert!(l["attn_err"].as_f64().unwrap() <= 0.05, "{l}");
        assert!(l["bytes_per_element"].as_f64().unwrap() < 2.0, "{l}");
    }
}

/// `eval --hadamard`: on the synthetic keys with outlier channels the rotation halves the INT4
/// key error; a head_dim that is not a power of two cannot be rotated (a row of n/a).
#[test]
fn eval_hadamard_rotation_row() {
    let doc = eval_json(&["eval", "--json", "--layers", "1", "--hadamard"]);
    let k_err = |label| pair(&doc, label)["errors"]["k_rel_l2"].as_f64().unwrap();
    let (plain, rotated) = (
        k_err("int4-k32 / int4-v64"),
        k_err("int4-k32 (hadamard) / int4-v64"),
    );
    assert!(rotated < 0.7 * plain, "{doc}");
    let attn = |label| {
        pair(&doc, label)["errors"]["attn_rel_err"]
            .as_f64()
            .unwrap()
    };
    assert!(
        attn("int4-k32 (hadamard) / int4-v64") < attn("int4-k32 / int4-v64"),
        "{doc}"
    );
    assert_eq!(doc["pairs"].as_array().unwrap().len(), 18);

    let dir = scratch("eval-hadamard");
    let input = dir.join("d96.st");
    let mut rng = Rng(3);
    let mut t = |name| {
        let shape = vec![8, 2, 96];
        In {
            name,
            dtype: Dtype::F32,
            values: rng.vec(shape.iter().product()),
            shape,
        }
    };
    write_input(&input, &[t("q.0"), t("k.0"), t("v.0")]);
    let doc = eval_json(&["eval", arg(&input), "--json", "--hadamard"]);
    let row = pair(&doc, "int4-k32 (hadamard) / int4-v64");
    assert!(row["errors"].is_null(), "{row}");
    assert!(
        row["skipped"].as_str().unwrap().contains("power-of-two"),
        "{row}"
    );
}

#[test]
fn info_reports_the_build() {
    let out = kvq(&["info"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with(&format!("kvq {}", env!("CARGO_PKG_VERSION"))));
    assert!(text.contains("cuda support: "));
    assert!(text.contains("gpu archs built: "));
    assert!(text.contains("visible gpus: "));
}

/// Keep the reference decoder honest about FP8 per-head scales with an odd head count.
#[test]
fn reference_decoder_matches_expected_codes() {
    let x: Vec<f32> = (0..3 * 16).map(|i| i as f32 - 20.0).collect();
    let e: Expected = expected(DenseFormat::Fp8E4m3, &x, 3, 16, true, None);
    let y = decode(DenseFormat::Fp8E4m3, &e, 3, 16);
    assert!(
        x.iter()
            .zip(&y)
            .all(|(a, b)| (a - b).abs() <= a.abs() / 8.0)
    );
}

/// Run `kvq` on a file that may be anything: it succeeds, or fails with exit code 1 and one
/// `kvq: error:` line; it never panics (exit code 101) and never leaves a partial output.
fn survives(args: &[&str], out_path: &Path) {
    let _ = fs::remove_file(out_path);
    let out = kvq(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => {}
        Some(1) => {
            assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
            assert!(stderr.starts_with("kvq: error: "), "{args:?}: {stderr}");
            assert!(!out_path.exists(), "{args:?} left an output");
        }
        code => panic!("{args:?}: exit {code:?}: {stderr}"),
    }
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    let mut tmp = out_path.as_os_str().to_owned();
    tmp.push(".tmp");
    assert!(!Path::new(&tmp).exists());
}

/// A safetensors file of `(name, dtype, shape)` tensors with arbitrary bytes.
fn arbitrary_file(
    rng: &mut Rng,
    tensors: &[(String, Dtype, Vec<usize>)],
    format: Option<&str>,
) -> Vec<u8> {
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, dt, shape)| {
            let n = shape.iter().product::<usize>() * dt.bitsize() / 8;
            (0..n).map(|_| rng.next_u64() as u8).collect()
        })
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .zip(&data)
        .map(|((name, dt, shape), d)| {
            (
                name.as_str(),
                TensorView::new(*dt, shape.clone(), d).unwrap(),
            )
        })
        .collect();
    let meta = format.map(|f| HashMap::from([("kvq.format".to_string(), f.to_string())]));
    safetensors::serialize(views, meta).unwrap()
}

/// Random, truncated and corrupted files through every command that reads one: plain inputs
/// (`quantize`, `eval`, `calibrate`, `eval --scales`, `eval --plan`), kvq files whose parts have any dtype and shape (`dequantize`), and
/// each of those cut short or with bytes flipped. `KVQ_FUZZ_CASES / 8` files (default 32).
#[test]
fn random_and_truncated_files_never_panic() {
    let files = std::env::var("KVQ_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or(256)
        / 8;
    let dir = scratch("fuzz-files");
    let out = dir.join("out.st");
    let o = arg(&out);
    let mut rng = Rng(0x5eed);
    // A shape of 1 to 3 axes (or exactly `rank` when given).
    let dims = |rng: &mut Rng, rank: Option<usize>| -> Vec<usize> {
        let n = rank.unwrap_or_else(|| 1 + rng.below(3));
        (0..n)
            .map(|_| rng.pick(&[0, 1, 2, 3, 16, 32, 64, 128]))
            .collect()
    };
    let float = [Dtype::F16, Dtype::BF16, Dtype::F32];
    let parts = [Dtype::U8, Dtype::F16, Dtype::F32, Dtype::I32];
    for i in 0..files.max(1) {
        let bytes = match i % 3 {
            // A plain input: tensors of any rank, a float or other dtype.
            0 => {
                let t: Vec<_> = (0..1 + rng.below(3))
                    .map(|j| {
                        let rank = rng.below(4);
                        let dt = if rng.below(5) == 0 {
                            Dtype::I32
                        } else {
                            rng.pick(&float)
                        };
                        (format!("t{j}"), dt, dims(&mut rng, Some(rank)))
                    })
                    .collect();
                arbitrary_file(&mut rng, &t, None)
            }
            // Layers for eval: q.L, k.L, v.L of small, possibly inconsistent shapes.
            1 => {
                let t: Vec<_> = ["q.0", "k.0", "v.0"]
                    .iter()
                    .map(|n| {
                        let shape = vec![
                            rng.below(4),
                            rng.pick(&[0, 1, 2, 4]),
                            rng.pick(&[0, 8, 32, 64]),
                        ];
                        (n.to_string(), rng.pick(&float), shape)
                    })
                    .collect();
                arbitrary_file(&mut rng, &t, None)
            }
            // A kvq file whose parts have any dtype and shape.
            _ => {
                let mut t = vec![
                    (
                        "x.codes".to_string(),
                        rng.pick(&parts),
                        dims(&mut rng, None),
                    ),
                    (
                        "x.scales".to_string(),
                        rng.pick(&parts),
                        dims(&mut rng, None),
                    ),
                ];
                if rng.below(2) == 0 {
                    t.push((
                        "x.zeros".to_string(),
                        rng.pick(&parts),
                        dims(&mut rng, None),
                    ));
                }
                let format = rng.pick(&[
                    "fp8-e4m3",
                    "fp8-e5m2",
                    "int4-k32",
                    "int4-v64",
                    "int4-uniform",
                    "f16",
                    "??",
                ]);
                arbitrary_file(&mut rng, &t, Some(format))
            }
        };
        let cut = rng.below(bytes.len() + 1);
        let mut flipped = bytes.clone();
        for _ in 0..1 + rng.below(3) {
            let at = rng.below(flipped.len());
            flipped[at] ^= 1 << rng.below(8);
        }
        for (kind, b) in [
            ("whole", &bytes[..]),
            ("cut", &bytes[..cut]),
            ("flipped", &flipped[..]),
        ] {
            let input = dir.join(format!("in-{i}-{kind}.st"));
            fs::write(&input, b).unwrap();
            let inp = arg(&input);
            let format = rng.pick(&["fp8-e4m3", "int4-k32", "int4-uniform"]);
            survives(&["quantize", "--format", format, inp, o], &out);
            survives(&["dequantize", inp, o], &out);
            survives(&["eval", inp, "--block-size", "4"], &out);
            survives(&["calibrate", inp, o, "--method", "percentile"], &out);
            // The file as calibrated scales and as a plan: refused, or read.
            survives(&["eval", inp, "--block-size", "4", "--scales", inp], &out);
            survives(&["eval", inp, "--block-size", "4", "--plan", inp], &out);
        }
    }
    // Pure noise, and an eval that asks for impossible blocks.
    let noise: Vec<u8> = (0..200).map(|_| rng.next_u64() as u8).collect();
    let input = dir.join("noise.st");
    fs::write(&input, &noise).unwrap();
    survives(&["quantize", "--format", "int4-k32", arg(&input), o], &out);
    let good = dir.join("good.st");
    write_input(
        &good,
        &[
            In {
                name: "q.0",
                dtype: Dtype::F32,
                shape: vec![3, 2, 64],
                values: vec![0.5; 384],
            },
            In {
                name: "k.0",
                dtype: Dtype::F32,
                shape: vec![3, 2, 64],
                values: vec![0.5; 384],
            },
            In {
                name: "v.0",
                dtype: Dtype::F32,
                shape: vec![3, 2, 64],
                values: vec![0.5; 384],
            },
        ],
    );
    survives(&["eval", arg(&good), "--block-size", "0"], &out);
    survives(&["eval", arg(&good), "--block-size", "4096"], &out);
}
