//! FP8 E4M3 (OCP E4M3FN) and E5M2 element math, bit-exact with CUDA's `__nv_cvt_float_to_fp8`
//! under `__NV_SATFINITE` (FORMATS.md, "FP8 E4M3").

use std::sync::LazyLock;

/// Which FP8 encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Fp8Kind {
    /// 4 exponent bits (bias 7), 3 mantissa bits, max 448, no infinity.
    E4M3 = 0,
    /// 5 exponent bits (bias 15), 2 mantissa bits, max 57344.
    E5M2 = 1,
}

impl Fp8Kind {
    /// Smallest positive (subnormal) magnitude: 2^-9 (E4M3), 2^-16 (E5M2).
    pub const fn min_subnormal(self) -> f32 {
        match self {
            Fp8Kind::E4M3 => 1.0 / 512.0,
            Fp8Kind::E5M2 => 1.0 / 65536.0,
        }
    }

    /// Largest finite magnitude; encoding saturates to it.
    pub const fn max_finite(self) -> f32 {
        match self {
            Fp8Kind::E4M3 => 448.0,
            Fp8Kind::E5M2 => 57344.0,
        }
    }

    const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Kind::E4M3 => 3,
            Fp8Kind::E5M2 => 2,
        }
    }

    const fn bias(self) -> i32 {
        match self {
            Fp8Kind::E4M3 => 7,
            Fp8Kind::E5M2 => 15,
        }
    }

    /// Code of the largest finite value (positive).
    const fn max_code(self) -> u8 {
        match self {
            Fp8Kind::E4M3 => 0x7E,
            Fp8Kind::E5M2 => 0x7B,
        }
    }

    /// Encode an f32 with round-to-nearest-even and saturation to ±max. NaN encodes as the
    /// canonical NaN (0x7F), which sanitized inputs never produce.
    pub fn encode(self, y: f32) -> u8 {
        let bits = y.to_bits();
        let sign = ((bits >> 24) & 0x80) as u8;
        let a = y.abs();
        if a.is_nan() {
            return 0x7F;
        }
        let mbits = self.mantissa_bits();
        let min_normal_exp = 1 - self.bias(); // exponent of the smallest normal
        let code = if a < f32::from_bits(((min_normal_exp + 127) as u32) << 23) {
            // Subnormal range: value = m * 2^(min_normal_exp - mbits). Scaling by a power of two
            // is exact, so one round-ties-even gives the nearest code; m == 2^mbits lands on the
            // smallest normal, whose code is the same integer.
            let unit_exp = min_normal_exp - mbits as i32;
            let scaled = a * f32::from_bits(((127 - unit_exp) as u32) << 23);
            scaled.round_ties_even() as u32
        } else if a >= self.max_finite() {
            self.max_code() as u32
        } else {
            // Normal: round the 23-bit mantissa to `mbits` bits, ties to even; a carry into the
            // exponent is handled by the addition itself.
            let a_bits = a.to_bits();
            let shift = 23 - mbits;
            let lsb = (a_bits >> shift) & 1;
            let rounded = (a_bits + (1 << (shift - 1)) - 1 + lsb) >> shift;
            let rebias = ((127 - self.bias()) as u32) << mbits;
            (rounded - rebias).min(self.max_code() as u32)
        };
        sign | code as u8
    }

    /// Decode a code to f32 (exact). NaN codes decode to NaN; E5M2 infinities to ±Inf.
    #[inline]
    pub fn decode(self, code: u8) -> f32 {
        static TABLES: LazyLock<[[f32; 256]; 2]> = LazyLock::new(|| {
            let table = |kind: Fp8Kind| std::array::from_fn(|c| kind.decode_slow(c as u8));
            [table(Fp8Kind::E4M3), table(Fp8Kind::E5M2)]
        });
        TABLES[self as usize][code as usize]
    }

    /// [`decode`](Self::decode) computed from the bit fields; builds the lookup table.
    fn decode_slow(self, code: u8) -> f32 {
        let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let mbits = self.mantissa_bits();
        let mag = (code & 0x7F) as u32;
        let exp = (mag >> mbits) as i32;
        let man = mag & ((1 << mbits) - 1);
        let max_exp = (1 << (7 - mbits)) - 1;
        match self {
            Fp8Kind::E4M3 if mag == 0x7F => return f32::NAN,
            Fp8Kind::E5M2 if exp == max_exp && man != 0 => return f32::NAN,
            Fp8Kind::E5M2 if exp == max_exp => return sign * f32::INFINITY,
            _ => {}
        }
        let unit = (1u32 << mbits) as f32;
        let v = if exp == 0 {
            man as f32 / unit * 2f32.powi(1 - self.bias())
        } else {
            (1.0 + man as f32 / unit) * 2f32.powi(exp - self.bias())
        };
        sign * v
    }

    /// Quantize one sanitized value with scale `s`: `encode(x / s)`.
    #[inline]
    pub fn quantize(self, x: f32, scale: f32) -> u8 {
        self.encode(x / scale)
    }

    /// Dequantize: `decode(code) * s`.
    #[inline]
    pub fn dequantize(self, code: u8, scale: f32) -> f32 {
        self.decode(code) * scale
    }

    /// Scale from calibration data: `amax / max_finite`, or 1.0 when that quotient is 0
    /// (amax 0, or an amax so small that the division underflows: FORMATS.md), so the scale is
    /// always positive and finite. `amax` is sanitized first, like every quantizer input (NaN
    /// counts as 0, beyond ±65504 clamps), and its sign is ignored.
    pub fn scale_from_amax(self, amax: f32) -> f32 {
        let amax = super::sanitize(amax).0.abs();
        let s = amax / self.max_finite();
        if s == 0.0 { 1.0 } else { s }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_subnormal_is_code_one() {
        for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
            assert_eq!(kind.decode(1), kind.min_subnormal());
        }
    }

    #[test]
    fn every_code_round_trips() {
        for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
            for code in 0..=255u8 {
                let v = kind.decode(code);
                if v.is_nan() || v.is_infinite() {
                    continue;
                }
                let back = kind.encode(v);
                // -0 and +0 are distinct codes with equal value.
                assert_eq!(back, code, "{kind:?} code {code:#04x} value {v}");
            }
        }
    }

    #[test]
    fn scale_from_amax_is_always_a_valid_scale() {
        for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
            // Subnormal amaxes whose quotient underflows to 0 give 1.0, as amax 0 does.
            for amax in [0.0, -0.0, f32::from_bits(1), f32::from_bits(100), f32::NAN] {
                assert_eq!(kind.scale_from_amax(amax), 1.0, "{kind:?} {amax:e}");
            }
            // The smallest amax whose quotient does not underflow keeps it.
            let tiny = f32::from_bits(1) * kind.max_finite();
            assert_eq!(kind.scale_from_amax(tiny), f32::from_bits(1));
            for amax in [f32::INFINITY, 1e30, -3.0, 65504.0] {
                let s = kind.scale_from_amax(amax);
                assert!(s.is_finite() && s > 0.0, "{kind:?} {amax:e} -> {s:e}");
            }
        }
    }

    #[test]
    fn saturation_and_boundaries() {
        let k = Fp8Kind::E4M3;
        assert_eq!(k.decode(0x7E), 448.0);
        assert_eq!(k.encode(448.0), 0x7E);
        assert_eq!(k.encode(464.0), 0x7E);
        assert_eq!(k.encode(480.0), 0x7E);
        assert_eq!(k.encode(f32::INFINITY), 0x7E);
        assert_eq!(k.encode(-1e30), 0xFE);
        assert_eq!(k.decode(1), 2f32.powi(-9));
        assert_eq!(k.encode(2f32.powi(-10)), 0); // tie to even: 0
        assert_eq!(k.encode(2f32.powi(-10) * 1.0001), 1);
        assert_eq!(k.encode(3.0 * 2f32.powi(-10)), 2); // 1.5 units → 2 (even)
        let e = Fp8Kind::E5M2;
        assert_eq!(e.decode(0x7B), 57344.0);
        assert_eq!(e.encode(1e9), 0x7B);
        assert_eq!(e.decode(1), 2f32.powi(-16));
    }
}
