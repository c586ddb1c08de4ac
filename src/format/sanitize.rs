//! Input sanitizing shared by every quantizer (FORMATS.md, "Input sanitizing").

/// Largest finite f16; every input is clamped into `[-F16_MAX, F16_MAX]` before quantizing.
pub const F16_MAX: f32 = 65504.0;

/// Sanitize one input value: NaN → 0.0, then clamp to ±65504 (so ±Inf → ±65504).
///
/// Returns the value and whether the input was non-finite (NaN or ±Inf); finite values beyond
/// the f16 range are clamped but not counted.
#[inline]
pub fn sanitize(x: f32) -> (f32, bool) {
    if x.is_nan() {
        (0.0, true)
    } else {
        (x.clamp(-F16_MAX, F16_MAX), x.is_infinite())
    }
}

/// Element types a quantizer accepts, converted to f32 exactly.
pub trait Element: Copy + Send + Sync + 'static {
    /// The value as f32 (exact for f32, f16 and bf16).
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Element for half::f16 {
    #[inline]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

impl Element for half::bf16 {
    #[inline]
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

/// Sanitize a slice into f32s, adding the number of non-finite inputs to `non_finite`. Only
/// the first `min(src.len(), dst.len())` elements are converted (and counted).
pub fn sanitize_into<T: Element>(src: &[T], dst: &mut [f32], non_finite: &mut u64) {
    for (d, &s) in dst.iter_mut().zip(src) {
        let (v, bad) = sanitize(s.to_f32());
        *d = v;
        *non_finite += bad as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sanitize_rules() {
        assert_eq!(sanitize(f32::NAN), (0.0, true));
        assert_eq!(sanitize(f32::INFINITY), (65504.0, true));
        assert_eq!(sanitize(f32::NEG_INFINITY), (-65504.0, true));
        assert_eq!(sanitize(1e6), (65504.0, false));
        assert_eq!(sanitize(-1e6), (-65504.0, false));
        assert_eq!(sanitize(-0.5), (-0.5, false));
    }
}
