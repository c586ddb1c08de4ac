//! Quantizing whole dense tensors, outside any cache: what `kvq quantize` writes to a file, and
//! what the GPU quantize kernels reproduce byte for byte.
//!
//! A dense tensor has shape `[..., heads, head_dim]`: the last axis is `head_dim` (the axis INT4
//! groups run along), the second-to-last is the head axis (the axis FP8 per-head scales run
//! along), and every axis before that is just more rows. A tensor of rank 1 is one head.
//!
//! The element math is [`KvFormat::encode_row`] / [`KvFormat::decode_row`] (FORMATS.md); this
//! module only decides which scale a row gets and where each byte of the result goes:
//!
//! | format | `codes` (U8) | `scales` | `zeros` |
//! |---|---|---|---|
//! | `fp8-e4m3`, `fp8-e5m2` | `[..., head_dim]` | F32 `[1]` per tensor or `[heads]` per head | — |
//! | `int4-k32` | `[..., head_dim / 2]` | F16 `[..., head_dim / 32]` | — |
//! | `int4-v64` | `[..., head_dim / 2]` | F16 `[..., head_dim / 64]` | F16 `[..., head_dim / 64]` |
//! | `int8-pth` | `[..., head_dim]` | F32 `[..., 1]` (one per row) | — |
//! | `fp4-e2m1` | `[..., head_dim / 2]` | U8 `[..., head_dim / 16]` (E4M3) | — |
//! | `int4-uniform` | `[..., head_dim / 2]` | F32 `[1]` | — |
//!
//! `fp4-e2m1` has a fourth part, `global_scales`: F32 `[heads]`, the global scale `g` of each
//! head, always calibrated from the tensor (`amax / 2688`, FORMATS.md).
//!
//! `int4-kc` (per-channel INT4 keys, [`int4_kc`]) is not a [`DenseFormat`]: its groups run along
//! tokens, across rows, so the row encoders (and the GPU dense kernels that mirror them) do not
//! apply. [`quantize_int4_kc`] writes it in FORMATS.md's layout, the tensor read as
//! `[T, heads, head_dim]` (T the product of the axes before the head axis) and G = 32:
//!
//! | format | `codes` (U8) | `scales` | `zeros` |
//! |---|---|---|---|
//! | `int4-kc` | `[..., head_dim / 2]` | F16 `[ceil(T / 32), heads, head_dim]` | F16, as `scales` |
//!
//! INT4 and FP4 codes are packed two per byte, element `2i` in the low nibble. All multi-byte
//! values are little-endian.

use crate::error::{Error, Result, filled};
use crate::format::int4_kc::{self, Int4KcTensor, KcShape};
use crate::format::{
    Element, Fp8Kind, HeadScale, KvFormat, fp4, head_amax, int4, int8, sanitize, sanitized_amax,
};
use half::f16;

pub use crate::format::dense_format::DenseFormat;

impl DenseFormat {
    /// Dtype and elements per row of the `scales` part when it holds each row's scales: f16 per
    /// group (INT4), an E4M3 byte per group (FP4), one f32 (INT8). `None` when it holds the
    /// head (or tensor) scales instead (FP8, `int4-uniform`).
    pub(crate) fn row_scales(self, head_dim: usize) -> Option<(StoredDtype, usize)> {
        let spec = self.kv_format()?.spec();
        match spec.group {
            Some(g) if spec.meta_bytes_per_group == 1 => Some((StoredDtype::U8, head_dim / g)),
            Some(g) => Some((StoredDtype::F16, head_dim / g)),
            None if spec.meta_bytes_per_row > 0 => Some((StoredDtype::F32, 1)),
            None => None,
        }
    }
}

/// Where an FP8 tensor's scale comes from. The other formats (INT4, INT8, FP4's global scales
/// per head, `int4-uniform`) always derive their scales from the data, and accept only the
/// default, [`PerTensorAmax`](Self::PerTensorAmax).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Fp8ScaleChoice {
    /// One given scale for the whole tensor: positive, finite, and small enough that
    /// `max_finite × scale` is finite too.
    Fixed(f32),
    /// One scale for the whole tensor, `amax / max_finite` over all its (sanitized) elements.
    #[default]
    PerTensorAmax,
    /// One scale per head (second-to-last axis), from the amax of that head's elements.
    PerHeadAmax,
}

/// Element type of a stored part of a quantized tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoredDtype {
    /// Bytes: codes, and FP4's E4M3 group scales.
    U8,
    /// IEEE binary16, little-endian: INT4 group scales and zeros.
    F16,
    /// IEEE binary32, little-endian: FP8, INT8 row, FP4 global and uniform INT4 scales.
    F32,
}

impl StoredDtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            StoredDtype::U8 => 1,
            StoredDtype::F16 => 2,
            StoredDtype::F32 => 4,
        }
    }
}

/// One stored part (codes, scales or zeros): raw little-endian bytes with a dtype and a shape
/// whose element count matches the bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    dtype: StoredDtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl StoredTensor {
    /// A part, checked: `data` holds exactly `product(shape)` elements of `dtype`.
    pub fn new(dtype: StoredDtype, shape: Vec<usize>, data: Vec<u8>) -> Result<Self> {
        let expected = element_count(&shape)?
            .checked_mul(dtype.size())
            .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} is too large")))?;
        if data.len() != expected {
            return Err(Error::Length {
                what: "stored tensor bytes",
                expected,
                actual: data.len(),
            });
        }
        Ok(StoredTensor { dtype, shape, data })
    }

    /// Element type.
    pub fn dtype(&self) -> StoredDtype {
        self.dtype
    }

    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Raw little-endian bytes.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Take the bytes.
    pub fn into_data(self) -> Vec<u8> {
        self.data
    }

    /// The elements as f32s (F16 widened exactly); `None` for U8.
    fn floats(&self) -> Option<Vec<f32>> {
        match self.dtype {
            StoredDtype::U8 => None,
            StoredDtype::F16 => Some(
                self.data
                    .chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
            ),
            StoredDtype::F32 => Some(
                self.data
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
        }
    }
}

/// A quantized dense tensor: codes, scales, (for `int4-v64`) zeros and (for `fp4-e2m1`) global
/// scales, laid out as the module documentation's table says. Its parts are always consistent
/// with each other.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedTensor {
    format: DenseFormat,
    shape: Vec<usize>,
    codes: StoredTensor,
    scales: StoredTensor,
    zeros: Option<StoredTensor>,
    global_scales: Option<StoredTensor>,
    non_finite: u64,
}

/// A quantized tensor's stored parts: codes, scales, zeros (`int4-v64`) and global scales
/// (`fp4-e2m1`), as [`QuantizedTensor::into_parts`] gives them.
pub type Parts = (
    StoredTensor,
    StoredTensor,
    Option<StoredTensor>,
    Option<StoredTensor>,
);

impl QuantizedTensor {
    /// Reassemble a tensor from its stored parts (e.g. read back from a file), checking every
    /// dtype and shape against `format` and every scale, zero and global scale for validity.
    pub fn from_parts(
        format: DenseFormat,
        codes: StoredTensor,
        scales: StoredTensor,
        zeros: Option<StoredTensor>,
        global_scales: Option<StoredTensor>,
    ) -> Result<Self> {
        let bad = |msg: String| Error::InvalidArgument(format!("{format} tensor: {msg}"));
        if codes.dtype != StoredDtype::U8 {
            return Err(bad(format!("codes must be U8, not {:?}", codes.dtype)));
        }
        let Some((&code_dim, prefix)) = codes.shape.split_last() else {
            return Err(bad("codes have no axes".into()));
        };
        // With an empty axis before it, the last axis can be any size without any bytes.
        let per_byte = 8 / format.bits() as usize; // 1 or 2 codes per byte
        let head_dim = code_dim.checked_mul(per_byte).ok_or(Error::Overflow {
            what: "head_dim of the codes (last axis × codes per byte)",
            lhs: code_dim,
            rhs: per_byte,
        })?;
        let mut shape = prefix.to_vec();
        shape.push(head_dim);
        let geometry = Geometry::of(format, &shape)?;
        let (scale_dtype, scale_shape) = geometry.group_scale_shape(format);
        let expect_part = |part: &StoredTensor, what: &str, dtype, shapes: &[Vec<usize>]| {
            if part.dtype != dtype || !shapes.contains(&part.shape) {
                return Err(bad(format!(
                    "{what} must be {dtype:?} {}, not {:?} {:?}",
                    shapes
                        .iter()
                        .map(|s| format!("{s:?}"))
                        .collect::<Vec<_>>()
                        .join(" or "),
                    part.dtype,
                    part.shape
                )));
            }
            Ok(())
        };
        if format.fp8_kind().is_some() {
            expect_part(
                &scales,
                "scales",
                StoredDtype::F32,
                &[vec![1], vec![geometry.heads]],
            )?
        } else {
            expect_part(
                &scales,
                "scales",
                scale_dtype,
                std::slice::from_ref(&scale_shape),
            )?
        }
        match (format.has_zeros(), &zeros) {
            (true, Some(z)) => expect_part(z, "zeros", StoredDtype::F16, &[scale_shape])?,
            (true, None) => return Err(bad("zeros are missing".into())),
            (false, Some(_)) => {
                return Err(bad("has zeros, which only affine INT4 formats use".into()));
            }
            (false, None) => {}
        }
        let global = format.head_scale() == Some(HeadScale::Fp4);
        match (global, &global_scales) {
            (true, Some(g)) => expect_part(
                g,
                "global scales",
                StoredDtype::F32,
                &[vec![geometry.heads]],
            )?,
            (true, None) => return Err(bad("global scales are missing".into())),
            (false, Some(_)) => {
                return Err(bad("has global scales, which only FP4 uses".into()));
            }
            (false, None) => {}
        }
        check_scale_values(format, &scales, zeros.as_ref(), global_scales.as_ref())?;
        check_codes(format, &codes)?;
        Ok(QuantizedTensor {
            format,
            shape,
            codes,
            scales,
            zeros,
            global_scales,
            non_finite: 0,
        })
    }

    /// The format.
    pub fn format(&self) -> DenseFormat {
        self.format
    }

    /// Shape of the original (and the dequantized) tensor.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Packed codes.
    pub fn codes(&self) -> &StoredTensor {
        &self.codes
    }

    /// Scales.
    pub fn scales(&self) -> &StoredTensor {
        &self.scales
    }

    /// Zeros (`int4-v64` only).
    pub fn zeros(&self) -> Option<&StoredTensor> {
        self.zeros.as_ref()
    }

    /// Global scales, one per head (`fp4-e2m1` only).
    pub fn global_scales(&self) -> Option<&StoredTensor> {
        self.global_scales.as_ref()
    }

    /// Non-finite inputs met while quantizing (stored as the sanitized values, FORMATS.md);
    /// 0 for a tensor built with [`from_parts`](Self::from_parts).
    pub fn non_finite(&self) -> u64 {
        self.non_finite
    }

    /// Bytes of all parts together.
    pub fn stored_bytes(&self) -> usize {
        self.codes.data.len()
            + self.scales.data.len()
            + self.zeros.as_ref().map_or(0, |z| z.data.len())
            + self.global_scales.as_ref().map_or(0, |g| g.data.len())
    }

    /// Split into `(codes, scales, zeros, global_scales)`.
    pub fn into_parts(self) -> Parts {
        (self.codes, self.scales, self.zeros, self.global_scales)
    }
}

/// How a dense tensor's elements split into rows and heads.
struct Geometry {
    /// Rows of `head_dim` elements.
    rows: usize,
    /// Size of the head axis (1 for a rank-1 tensor).
    heads: usize,
    head_dim: usize,
    /// The shape without its last axis.
    prefix: Vec<usize>,
}

impl Geometry {
    /// The geometry of `shape`, checked to hold `elements` values (a tensor's data).
    fn of_data(format: DenseFormat, shape: &[usize], elements: usize) -> Result<Self> {
        let geometry = Geometry::of(format, shape)?;
        if elements != geometry.elements() {
            return Err(Error::Length {
                what: "tensor data",
                expected: geometry.elements(),
                actual: elements,
            });
        }
        Ok(geometry)
    }

    fn of(format: DenseFormat, shape: &[usize]) -> Result<Self> {
        let Some((&head_dim, prefix)) = shape.split_last() else {
            return Err(Error::InvalidArgument(
                "a tensor to quantize needs at least one axis (head_dim)".into(),
            ));
        };
        format.check_head_dim(head_dim)?;
        element_count(shape)?;
        Ok(Geometry {
            rows: prefix.iter().product(),
            heads: prefix.last().copied().unwrap_or(1),
            head_dim,
            prefix: prefix.to_vec(),
        })
    }

    fn elements(&self) -> usize {
        self.rows * self.head_dim
    }

    fn codes_shape(&self, format: DenseFormat) -> Vec<usize> {
        let mut s = self.prefix.clone();
        s.push(format.code_bytes(self.head_dim));
        s
    }

    /// Dtype and shape of the scales of grouped INT4 (f16 per group), FP4 (E4M3 bytes per
    /// group), INT8 (f32 per row) and `int4-uniform` (one f32); FP8 is `[1]` or `[heads]`,
    /// chosen at quantize time.
    fn group_scale_shape(&self, format: DenseFormat) -> (StoredDtype, Vec<usize>) {
        match format.row_scales(self.head_dim) {
            Some((dtype, per_row)) => {
                let mut s = self.prefix.clone();
                s.push(per_row);
                (dtype, s)
            }
            None => (StoredDtype::F32, vec![1]),
        }
    }
}

/// Product of a shape's axes, or an error when it overflows.
fn element_count(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} is too large")))
}

/// Reject scales and zeros that would decode to non-finite or sign-flipped values, and FP4
/// block scales that are NaN or carry a sign.
fn check_scale_values(
    format: DenseFormat,
    scales: &StoredTensor,
    zeros: Option<&StoredTensor>,
    global_scales: Option<&StoredTensor>,
) -> Result<()> {
    // FP8 divides by its scale, so it must be positive; INT4 and INT8 scales are 0 for all-zero
    // groups (rows). An f32 scale must also keep the largest code finite: FP8's max_finite,
    // INT8's 128 (0x80, never written), INT4's 8 (f16 scales always do: 15 × 65504 + 65504 is
    // far below f32's range); FP4's global scale its 2688.
    let fp8 = format.fp8_kind().is_some();
    let max_code = match format.kv_format() {
        Some(KvFormat::Int8Pth) => int8::MAX_DECODED,
        _ => format.fp8_kind().map_or(8.0, Fp8Kind::max_finite),
    };
    if let Some(i) = (scales.dtype == StoredDtype::U8)
        .then(|| scales.data.iter().position(|&b| b > fp4::MAX_BLOCK_SCALE))
        .flatten()
    {
        return Err(Error::InvalidArgument(format!(
            "{format} tensor: block scale {i} is {:#04x}, not an E4M3 code of 0x00..=0x7e",
            scales.data[i]
        )));
    }
    for g in global_scales
        .and_then(StoredTensor::floats)
        .unwrap_or_default()
    {
        if !f32_scale_decodes_finite(g, fp4::GLOBAL_MAX) {
            return Err(Error::Scale {
                what: "stored FP4 global scale (positive; 2688 × scale finite)",
                value: g,
            });
        }
    }
    for s in scales.floats().unwrap_or_default() {
        // `s == 0.0` holds for -0.0 too, which decodes every code to a zero.
        let zero_ok = !fp8 && s == 0.0;
        if !(zero_ok || f32_scale_decodes_finite(s, max_code)) {
            return Err(Error::Scale {
                what: "stored scale (positive, or 0 for INT4; max code × scale finite)",
                value: s,
            });
        }
    }
    if let Some(z) = zeros.and_then(|z| z.floats()) {
        if let Some(bad) = z.into_iter().find(|z| !z.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "stored zero {bad} is not finite"
            )));
        }
    }
    Ok(())
}

/// Whether an f32 scale is positive and finite and keeps the largest code (`max_code`) finite.
fn f32_scale_decodes_finite(s: f32, max_code: f32) -> bool {
    s.is_finite() && s > 0.0 && (max_code * s).is_finite()
}

/// Reject FP8 codes that are NaN or infinity (0x7F / 0xFF in E4M3, 0x7C..=0x7F and
/// 0xFC..=0xFF in E5M2): the encoder never writes them, and they decode to non-finite values.
fn check_codes(format: DenseFormat, codes: &StoredTensor) -> Result<()> {
    let Some(kind) = format.fp8_kind() else {
        return Ok(()); // every INT4, INT8 and E2M1 code decodes to a finite value
    };
    match codes.data.iter().position(|&c| !kind.decode(c).is_finite()) {
        Some(i) => Err(Error::InvalidArgument(format!(
            "{format} tensor: code {i} is {:#04x}, which is not a finite {format} value",
            codes.data[i]
        ))),
        None => Ok(()),
    }
}

/// Quantize a dense tensor of `shape` (`[..., heads, head_dim]`, row-major) held in `data`.
///
/// Inputs are sanitized first (NaN → 0, clamp to ±65504) and counted in
/// [`QuantizedTensor::non_finite`]. Errors: `data.len()` not matching `shape`, a `head_dim`
/// the format cannot use, a scale choice other than the default for a non-FP8 format, and a
/// fixed scale that is not positive and finite or so large that `max_finite × scale`
/// overflows f32 ([`Error::Scale`]): such a scale would store codes that decode to infinity,
/// which [`QuantizedTensor::from_parts`] refuses too.
pub fn quantize<T: Element>(
    format: DenseFormat,
    data: &[T],
    shape: &[usize],
    scale: Fp8ScaleChoice,
) -> Result<QuantizedTensor> {
    let geometry = Geometry::of_data(format, shape, data.len())?;
    if format.fp8_kind().is_none() && scale != Fp8ScaleChoice::PerTensorAmax {
        return Err(Error::Unsupported(format!(
            "{format} derives its scales from the data; a {scale:?} scale applies only to FP8"
        )));
    }
    match format.kv_format() {
        Some(kv) => {
            let head_scales = head_scales_of(kv, data, &geometry, scale)?;
            quantize_rows(format, kv, data, &geometry, &head_scales)
        }
        None => quantize_uniform(data, &geometry),
    }
}

/// Quantize an FP8 tensor as [`quantize`] does, under given scales: one per head (the
/// second-to-last axis) or one for the whole tensor, each positive and finite with `max_finite ×
/// scale` finite too, such as scales calibrated on other data. Values past `max_finite ×
/// scale` saturate. Errors as [`quantize`], and [`Error::Unsupported`] for a format without FP8
/// codes, [`Error::Length`] for a count of scales that is neither 1 nor the heads,
/// [`Error::Scale`] for a scale outside that rule.
pub fn quantize_fp8_with_scales<T: Element>(
    format: DenseFormat,
    data: &[T],
    shape: &[usize],
    scales: &[f32],
) -> Result<QuantizedTensor> {
    let geometry = Geometry::of_data(format, shape, data.len())?;
    let (Some(kv), Some(kind)) = (format.kv_format(), format.fp8_kind()) else {
        return Err(Error::Unsupported(format!(
            "{format} derives its scales from the data; given scales apply only to FP8"
        )));
    };
    if scales.len() != 1 && scales.len() != geometry.heads {
        return Err(Error::Length {
            what: "FP8 scales (one per head, or one)",
            expected: geometry.heads,
            actual: scales.len(),
        });
    }
    check_fp8_scales(
        kind,
        scales,
        "given FP8 scale (max_finite × scale must be finite too)",
    )?;
    quantize_rows(format, kv, data, &geometry, scales)
}

/// Check FP8 scales a caller gives (`what` names them in the error): each must keep
/// `max_finite × scale` finite, the rule `from_parts` applies to stored scales, so that a
/// tensor always reads back.
fn check_fp8_scales(kind: Fp8Kind, scales: &[f32], what: &'static str) -> Result<()> {
    match scales
        .iter()
        .find(|&&s| !f32_scale_decodes_finite(s, kind.max_finite()))
    {
        Some(&bad) => Err(Error::Scale { what, value: bad }),
        None => Ok(()),
    }
}

/// FP8 scales for a tensor: `[1]` or `[heads]` values.
fn fp8_scales<T: Element>(
    kind: Fp8Kind,
    data: &[T],
    geometry: &Geometry,
    choice: Fp8ScaleChoice,
) -> Result<Vec<f32>> {
    Ok(match choice {
        Fp8ScaleChoice::Fixed(s) => {
            check_fp8_scales(
                kind,
                &[s],
                "fixed FP8 scale (max_finite × scale must be finite too)",
            )?;
            vec![s]
        }
        Fp8ScaleChoice::PerTensorAmax => vec![kind.scale_from_amax(sanitized_amax(data))],
        Fp8ScaleChoice::PerHeadAmax => head_amax(data, geometry.heads, geometry.head_dim)?
            .into_iter()
            .map(|a| kind.scale_from_amax(a))
            .collect(),
    })
}

/// The head scales of a tensor of cache format `kv`: `[1]` or `[heads]` values.
fn head_scales_of<T: Element>(
    kv: KvFormat,
    data: &[T],
    geometry: &Geometry,
    choice: Fp8ScaleChoice,
) -> Result<Vec<f32>> {
    Ok(match kv.head_scale() {
        Some(HeadScale::Fp8(kind)) => fp8_scales(kind, data, geometry, choice)?,
        // FP4's g: always per head, from that head's amax.
        Some(h @ HeadScale::Fp4) => head_amax(data, geometry.heads, geometry.head_dim)?
            .into_iter()
            .map(|a| h.scale_from_amax(a))
            .collect(),
        None => vec![1.0], // unused by INT4 and INT8
    })
}

/// Quantize row by row with the cache format's own row encoder, under `head_scales` (`[1]` or
/// `[heads]`).
fn quantize_rows<T: Element>(
    format: DenseFormat,
    kv: KvFormat,
    data: &[T],
    geometry: &Geometry,
    head_scales: &[f32],
) -> Result<QuantizedTensor> {
    let d = geometry.head_dim;
    // Both fit: the codes and metadata of a row are no larger than its f32 elements.
    let (code_len, meta_len) = (kv.code_bytes(d), kv.meta_bytes(d));
    let mut codes = filled(geometry.rows * code_len, 0u8, "quantized codes")?;
    let mut meta = filled(geometry.rows * meta_len, 0u8, "quantized scales")?;
    let mut non_finite = 0u64;
    for (r, (x, c)) in data
        .chunks_exact(d)
        .zip(codes.chunks_exact_mut(code_len))
        .enumerate()
    {
        // Indexing rather than chunks_exact_mut: FP8 rows have no metadata (meta_len == 0).
        // One head scale is FP8's per-tensor scale (or one head's).
        let m = &mut meta[r * meta_len..(r + 1) * meta_len];
        let s = head_scales[if head_scales.len() == 1 {
            0
        } else {
            r % geometry.heads
        }];
        non_finite += kv.try_encode_row(x, s, c, m)?;
    }

    let codes = StoredTensor::new(StoredDtype::U8, geometry.codes_shape(format), codes)?;
    let spec = kv.spec();
    let f32_part = |values: &[f32]| {
        let bytes = values.iter().flat_map(|s| s.to_le_bytes()).collect();
        StoredTensor::new(StoredDtype::F32, vec![values.len()], bytes)
    };
    let global_scales = match spec.head_scale {
        Some(HeadScale::Fp4) => Some(f32_part(head_scales)?),
        _ => None,
    };
    let (scales, zeros) = if spec.group.is_none() && spec.meta_bytes_per_row == 0 {
        (f32_part(head_scales)?, None) // FP8: the head scales are the scales
    } else if spec.group_zeros() {
        // The row metadata interleaves (scale, zero) per group; files keep them apart.
        let (dtype, shape) = geometry.group_scale_shape(format);
        let half = meta.len() / 2;
        let (mut s, mut z) = (Vec::with_capacity(half), Vec::with_capacity(half));
        for pair in meta.chunks_exact(4) {
            s.extend_from_slice(&pair[..2]);
            z.extend_from_slice(&pair[2..]);
        }
        (
            StoredTensor::new(dtype, shape.clone(), s)?,
            Some(StoredTensor::new(dtype, shape, z)?),
        )
    } else {
        let (dtype, shape) = geometry.group_scale_shape(format);
        (StoredTensor::new(dtype, shape, meta)?, None)
    };
    Ok(QuantizedTensor {
        format,
        shape: geometry.prefix.iter().copied().chain([d]).collect(),
        codes,
        scales,
        zeros,
        global_scales,
        non_finite,
    })
}

/// `int4-uniform`: one f32 scale `amax / 7` over the whole tensor.
fn quantize_uniform<T: Element>(data: &[T], geometry: &Geometry) -> Result<QuantizedTensor> {
    let format = DenseFormat::Int4Uniform;
    let s = int4::uniform_scale(sanitized_amax(data));
    let mut non_finite = 0u64;
    let codes_iter = data.iter().map(|x| {
        let (v, bad) = sanitize(x.to_f32());
        non_finite += bad as u64;
        int4::quantize_uniform(v, s) as u8
    });
    let mut codes = filled(data.len() / 2, 0u8, "quantized codes")?;
    int4::pack_nibbles(codes_iter, &mut codes);
    Ok(QuantizedTensor {
        format,
        shape: geometry
            .prefix
            .iter()
            .copied()
            .chain([geometry.head_dim])
            .collect(),
        codes: StoredTensor::new(StoredDtype::U8, geometry.codes_shape(format), codes)?,
        scales: StoredTensor::new(StoredDtype::F32, vec![1], s.to_le_bytes().to_vec())?,
        zeros: None,
        global_scales: None,
        non_finite,
    })
}

/// Dequantize into f32 values of [`QuantizedTensor::shape`], exactly as FORMATS.md defines.
pub fn dequantize(q: &QuantizedTensor) -> Vec<f32> {
    let geometry = Geometry::of(q.format, &q.shape).expect("validated at construction");
    let d = geometry.head_dim;
    let mut out = vec![0f32; geometry.elements()];
    if out.is_empty() {
        return out;
    }
    let Some(kv) = q.format.kv_format() else {
        let scales = q.scales.floats().expect("uniform scales are floats");
        for (i, o) in out.iter_mut().enumerate() {
            *o = int4::dequantize_uniform(int4::signed_nibble(&q.codes.data, i), scales[0]);
        }
        return out;
    };
    // The per-head (or per-tensor) scales: FP8's are the scales, FP4's the global scales.
    let head_scales = match kv.head_scale() {
        Some(HeadScale::Fp8(_)) => q.scales.floats(),
        Some(HeadScale::Fp4) => q.global_scales.as_ref().and_then(StoredTensor::floats),
        None => None,
    }
    .unwrap_or_else(|| vec![1.0]);
    let code_len = kv.code_bytes(d);
    let meta_len = kv.meta_bytes(d);
    let mut meta = vec![0u8; meta_len];
    for (r, (o, c)) in out
        .chunks_exact_mut(d)
        .zip(q.codes.data.chunks_exact(code_len))
        .enumerate()
    {
        // Rebuild the row metadata the row decoder expects from the stored scales (and zeros):
        // the scales of a row are its metadata, but for affine INT4's interleaved zeros.
        match &q.zeros {
            Some(z) => {
                let half = meta_len / 2;
                let s_row = &q.scales.data[r * half..][..half];
                let z_row = &z.data[r * half..][..half];
                for (g, m) in meta.chunks_exact_mut(4).enumerate() {
                    m[..2].copy_from_slice(&s_row[g * 2..g * 2 + 2]);
                    m[2..].copy_from_slice(&z_row[g * 2..g * 2 + 2]);
                }
            }
            None => meta.copy_from_slice(&q.scales.data[r * meta_len..][..meta_len]),
        }
        let head_scale = match head_scales.len() {
            1 => head_scales[0],
            _ => head_scales[r % geometry.heads],
        };
        kv.decode_row(c, &meta, head_scale, o);
    }
    out
}

/// A dense tensor in per-channel INT4 keys (`int4-kc`, G = 32), laid out as the module
/// documentation's second table says. Its parts are always consistent with each other.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedChannels {
    shape: Vec<usize>,
    tensor: Int4KcTensor,
}

/// The `[T, heads, head_dim]` reading of a dense shape `[..., heads, head_dim]` (T = 1 for a
/// rank below 3), with the dense file's group size.
pub(crate) fn kc_shape(shape: &[usize]) -> Result<KcShape> {
    let Some((&head_dim, prefix)) = shape.split_last() else {
        return Err(Error::InvalidArgument(
            "a tensor to quantize needs at least one axis (head_dim)".into(),
        ));
    };
    element_count(shape)?;
    let (heads, tokens) = match prefix.split_last() {
        Some((&heads, before)) => (heads, before.iter().product()),
        None => (1, 1),
    };
    KcShape::new(tokens, heads, head_dim, int4_kc::DENSE_GROUP)
}

/// Quantize a dense tensor of `shape` (`[..., heads, head_dim]`, row-major, head_dim even)
/// held in `data` to `int4-kc` (FORMATS.md's dense file: G = 32, a last group of `T mod 32`
/// tokens quantized over those). Inputs are sanitized and counted as [`quantize`] does.
/// Errors: `data.len()` not matching `shape`, an odd or zero `head_dim`.
pub fn quantize_int4_kc<T: Element>(data: &[T], shape: &[usize]) -> Result<QuantizedChannels> {
    let kc = kc_shape(shape)?;
    Ok(QuantizedChannels {
        shape: shape.to_vec(),
        tensor: int4_kc::quantize(data, kc, int4_kc::Mode::Dense)?,
    })
}

impl QuantizedChannels {
    /// Reassemble a tensor from its stored parts (e.g. read back from a file): U8 codes
    /// `[..., head_dim / 2]`, F16 scales and zeros `[ceil(T / 32), heads, head_dim]`, checked
    /// as [`Int4KcTensor::from_parts`] checks them (scales 0 or positive and finite, zeros
    /// finite).
    pub fn from_parts(
        codes: StoredTensor,
        scales: StoredTensor,
        zeros: StoredTensor,
    ) -> Result<Self> {
        let bad = |msg: String| Error::InvalidArgument(format!("{} tensor: {msg}", int4_kc::NAME));
        if codes.dtype != StoredDtype::U8 {
            return Err(bad(format!("codes must be U8, not {:?}", codes.dtype)));
        }
        let Some((&code_dim, prefix)) = codes.shape.split_last() else {
            return Err(bad("codes have no axes".into()));
        };
        let head_dim = code_dim.checked_mul(2).ok_or(Error::Overflow {
            what: "head_dim of the codes (last axis × 2)",
            lhs: code_dim,
            rhs: 2,
        })?;
        let mut shape = prefix.to_vec();
        shape.push(head_dim);
        let kc = kc_shape(&shape)?;
        let meta_shape = vec![kc.groups(int4_kc::Mode::Dense), kc.heads(), kc.head_dim()];
        let halves = |part: &StoredTensor, what: &str| -> Result<Vec<f16>> {
            if part.dtype != StoredDtype::F16 || part.shape != meta_shape {
                return Err(bad(format!(
                    "{what} must be F16 {meta_shape:?}, not {:?} {:?}",
                    part.dtype, part.shape
                )));
            }
            Ok(part
                .data
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]))
                .collect())
        };
        let (s, z) = (halves(&scales, "scales")?, halves(&zeros, "zeros")?);
        let tensor =
            Int4KcTensor::from_parts(kc, int4_kc::Mode::Dense, codes.data, s, z, Vec::new())?;
        Ok(QuantizedChannels { shape, tensor })
    }

    /// Shape of the original (and the dequantized) tensor.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The quantized keys: codes, scales and zeros as values.
    pub fn tensor(&self) -> &Int4KcTensor {
        &self.tensor
    }

    /// Non-finite inputs met while quantizing; 0 for a tensor built with
    /// [`from_parts`](Self::from_parts).
    pub fn non_finite(&self) -> u64 {
        self.tensor.non_finite()
    }

    /// Bytes of all parts together.
    pub fn stored_bytes(&self) -> usize {
        self.tensor.stored_bytes()
    }

    /// Dequantize into f32 values of [`shape`](Self::shape), exactly as FORMATS.md defines.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        self.tensor.dequantize()
    }

    /// Split into `(codes, scales, zeros)`.
    pub fn into_parts(self) -> (StoredTensor, StoredTensor, StoredTensor) {
        let kc = self.tensor.shape();
        let meta_shape = vec![kc.groups(int4_kc::Mode::Dense), kc.heads(), kc.head_dim()];
        let mut codes_shape = self.shape;
        if let Some(last) = codes_shape.last_mut() {
            *last /= 2;
        }
        let (codes, s, z, _) = self.tensor.into_parts();
        // The lengths agree with the shapes by construction (quantize, from_parts).
        let part = |dtype, shape, data| StoredTensor { dtype, shape, data };
        let bytes = |v: Vec<f16>| v.into_iter().flat_map(f16::to_le_bytes).collect();
        (
            part(StoredDtype::U8, codes_shape, codes),
            part(StoredDtype::F16, meta_shape.clone(), bytes(s)),
            part(StoredDtype::F16, meta_shape, bytes(z)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `int4-kc` parts have FORMATS.md's shapes and read back to the same tensor.
    #[test]
    fn int4_kc_parts_round_trip() {
        // [2, 35, 2, 8]: T = 70 tokens (three groups, the last of 6), 2 heads, head_dim 8.
        let shape = [2, 35, 2, 8];
        let x: Vec<f32> = (0..2 * 35 * 2 * 8)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let q = quantize_int4_kc(&x, &shape).unwrap();
        let (c, s, z) = q.clone().into_parts();
        assert_eq!(c.shape(), [2, 35, 2, 4]);
        assert_eq!((s.shape(), z.shape()), (&[3, 2, 8][..], &[3, 2, 8][..]));
        let back = QuantizedChannels::from_parts(c.clone(), s.clone(), z).unwrap();
        assert_eq!(back.shape(), shape);
        assert_eq!(back.dequantize().unwrap(), q.dequantize().unwrap());
        assert!(QuantizedChannels::from_parts(c.clone(), s.clone(), s.clone()).is_ok());
        let wrong = StoredTensor::new(StoredDtype::F16, vec![2, 2, 8], vec![0; 64]).unwrap();
        assert!(QuantizedChannels::from_parts(c, s, wrong).is_err());
        // Rank 1 and 2 are one token; an odd head_dim is refused.
        assert_eq!(
            quantize_int4_kc(&[1f32; 6], &[3, 2])
                .unwrap()
                .tensor()
                .shape()
                .tokens(),
            1
        );
        assert!(quantize_int4_kc(&[1f32; 3], &[3]).is_err());
    }

    #[test]
    fn names_round_trip() {
        for f in DenseFormat::ALL {
            assert_eq!(f.name().parse::<DenseFormat>().unwrap(), f);
        }
        assert!(DenseFormat::from_name("int3").is_err());
    }

    /// The table-derived list is the cache formats' dense forms in their order, then uniform.
    #[test]
    fn all_lists_every_dense_format() {
        assert_eq!(
            DenseFormat::ALL,
            [
                DenseFormat::Fp8E4m3,
                DenseFormat::Fp8E5m2,
                DenseFormat::Int4K32,
                DenseFormat::Int4V64,
                DenseFormat::Int8Pth,
                DenseFormat::Fp4E2m1,
                DenseFormat::Int4Uniform,
            ]
        );
        assert_eq!(DenseFormat::Int4Uniform.kv_format(), None);
    }

    #[test]
    fn parts_round_trip_through_from_parts() {
        let x: Vec<f32> = (0..2 * 3 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
        for f in DenseFormat::ALL {
            let q = quantize(f, &x, &[2, 3, 64], Fp8ScaleChoice::default()).unwrap();
            let (c, s, z, g) = q.clone().into_parts();
            let back = QuantizedTensor::from_parts(f, c, s, z, g).unwrap();
            assert_eq!(back, q);
            assert_eq!(dequantize(&back), dequantize(&q));
        }
    }
}
