//! The table of cache formats: what identifies each one (its id, names) and fixes its storage
//! (bits per code, groups, metadata, head scale). [`KvFormat`]'s and [`DenseFormat`]'s
//! methods read it, so a format's identity is stated once here; `cuda/codec/format.cuh` is the
//! C++ counterpart, and both are checked against `cuda/kvq.h`.
//!
//! [`DenseFormat`]: crate::dense::DenseFormat

use super::dense_format::DenseFormat;
use super::fp8::Fp8Kind;
use super::{KvFormat, fp4, int4, int4_kc};

/// One cache format's identity and storage, as FORMATS.md defines them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct FormatSpec {
    /// The format; its discriminant is this row's index in [`SPECS`] and its `kvq_format` id.
    pub format: KvFormat,
    /// Short name: the CLI, tables, and the format name in dense tensor files.
    pub name: &'static str,
    /// The `kvq_format` enumerator of `cuda/kvq.h` with this id.
    pub c_name: &'static str,
    /// Bits per code.
    pub bits: u32,
    /// Elements per group along head_dim, for grouped formats.
    pub group: Option<usize>,
    /// Metadata bytes per group, in the row after the codes: an E4M3 scale (1, FP4), an f16
    /// scale (2), or an f16 scale and then an f16 zero (4); 0 without groups.
    pub meta_bytes_per_group: usize,
    /// Metadata bytes per row for a format whose one group is the whole row (INT8's f32 scale,
    /// 4); 0 otherwise.
    pub meta_bytes_per_row: usize,
    /// The f32 scale per KV head (or per tensor) from outside the rows that the format takes,
    /// and how it is calibrated.
    pub head_scale: Option<HeadScale>,
    /// The dense-tensor format with the same element math; none for the formats stored as is.
    pub dense: Option<DenseFormat>,
    /// Groups run along the tokens of a cache block, one per channel (`int4-kc`): keys only,
    /// block sizes [`int4_kc::GROUPS`], no row codec. A block keeps its tokens as f16 until its
    /// last one is appended, then is quantized in place (*sealed*); its f16 `s` and `z` per
    /// channel follow the codes ([`KvFormat::block_meta_bytes`]).
    pub block_groups: bool,
}

/// A format's f32 scale per KV head (or per tensor), which lives beside the pool rather than in
/// the rows: which format it scales, and so which largest value its calibration maps amax to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeadScale {
    /// FP8's scale `s`: codes are `x / s`; calibrated as `amax / max_finite`.
    Fp8(Fp8Kind),
    /// FP4's global scale `g`: group scales are E4M3 codes of `amax16 / 6 / g`; calibrated as
    /// `amax / 2688` (448 · 6), always per KV head.
    Fp4,
}

impl HeadScale {
    /// The scale from calibration data (FORMATS.md): `amax / max` (448, 57344 or 2688), or 1.0
    /// when that quotient is 0, so it is always positive and finite. `amax` is sanitized first
    /// and its sign ignored.
    pub fn scale_from_amax(self, amax: f32) -> f32 {
        match self {
            HeadScale::Fp8(kind) => kind.scale_from_amax(amax),
            HeadScale::Fp4 => fp4::global_scale_from_amax(amax),
        }
    }

    /// Largest value a code can decode to under scale 1: a stored scale `s` must keep
    /// `max_value × s` finite.
    pub const fn max_value(self) -> f32 {
        match self {
            HeadScale::Fp8(kind) => kind.max_finite(),
            HeadScale::Fp4 => fp4::GLOBAL_MAX,
        }
    }
}

impl FormatSpec {
    /// `head_dim` must be a positive multiple of this: whole groups, and whole 16-byte vectors
    /// of codes (one GPU thread's chunk of a row).
    pub const fn head_dim_multiple(&self) -> usize {
        let vector = 128 / self.bits as usize;
        match self.group {
            Some(g) if g > vector => g,
            _ => vector,
        }
    }

    /// Whether each group stores a zero after its scale (affine formats).
    pub const fn group_zeros(&self) -> bool {
        self.meta_bytes_per_group == 4
    }
}

/// Every cache format, indexed by its [`KvFormat`] discriminant (the `kvq_format` id).
pub const SPECS: &[FormatSpec] = &[
    FormatSpec {
        format: KvFormat::F16,
        name: "f16",
        c_name: "KVQ_F16",
        bits: 16,
        group: None,
        meta_bytes_per_group: 0,
        meta_bytes_per_row: 0,
        head_scale: None,
        dense: None,
        block_groups: false,
    },
    FormatSpec {
        format: KvFormat::Bf16,
        name: "bf16",
        c_name: "KVQ_BF16",
        bits: 16,
        group: None,
        meta_bytes_per_group: 0,
        meta_bytes_per_row: 0,
        head_scale: None,
        dense: None,
        block_groups: false,
    },
    FormatSpec {
        format: KvFormat::Fp8E4m3,
        name: "fp8-e4m3",
        c_name: "KVQ_FP8_E4M3",
        bits: 8,
        group: None,
        meta_bytes_per_group: 0,
        meta_bytes_per_row: 0,
        head_scale: Some(HeadScale::Fp8(Fp8Kind::E4M3)),
        dense: Some(DenseFormat::Fp8E4m3),
        block_groups: false,
    },
    FormatSpec {
        format: KvFormat::Fp8E5m2,
        name: "fp8-e5m2",
        c_name: "KVQ_FP8_E5M2",
        bits: 8,
        group: None,
        meta_bytes_per_group: 0,
        meta_bytes_per_row: 0,
        head_scale: Some(HeadScale::Fp8(Fp8Kind::E5M2)),
        dense: Some(DenseFormat::Fp8E5m2),
        block_groups: false,
    },
    FormatSpec {
        format: KvFormat::Int4Sym32,
        name: "int4-k32",
        c_name: "KVQ_INT4_SYM32",
        bits: 4,
        group: Some(int4::SYM_GROUP),
        meta_bytes_per_group: 2,
        meta_bytes_per_row: 0,
        head_scale: None,
        dense: Some(DenseFormat::Int4K32),
        block_groups: false,
    },
    FormatSpec {
        format: KvFormat::Int4Affine64,
        name: "int4-v64",
        c_name: "KVQ_INT4_AFFINE64",
        bits: 4,
        group: Some(int4::AFFINE_GROUP),
        meta_bytes_per_group: 4,
        meta_bytes_per_row: 0,
        head_scale: None,
        dense: Some(DenseFormat::Int4V64),
        block_groups: false,
    },
    FormatSpec {
        format: KvFormat::Int8Pth,
        name: "int8-pth",
        c_name: "KVQ_INT8_PTH",
        bits: 8,
        group: None,
        meta_bytes_per_group: 0,
        meta_bytes_per_row: 4,
        head_scale: None,
        dense: Some(DenseFormat::Int8Pth),
        block_groups: false,
    },
    FormatSpec {
        format: KvFormat::Fp4E2m1,
        name: "fp4-e2m1",
        c_name: "KVQ_FP4_E2M1",
        bits: 4,
        group: Some(fp4::GROUP),
        meta_bytes_per_group: 1,
        meta_bytes_per_row: 0,
        head_scale: Some(HeadScale::Fp4),
        dense: Some(DenseFormat::Fp4E2m1),
        block_groups: false,
    },
    FormatSpec {
        format: KvFormat::Int4Kc,
        name: int4_kc::NAME,
        c_name: "KVQ_INT4_KC",
        bits: 4,
        group: None,
        meta_bytes_per_group: 0,
        meta_bytes_per_row: 0,
        head_scale: None,
        // Its dense file is `dense::quantize_int4_kc`'s, whose groups cross rows.
        dense: None,
        block_groups: true,
    },
];

/// Number of cache formats.
pub(crate) const COUNT: usize = SPECS.len();

// The rules the methods reading the table rely on, checked when the crate compiles.
const _: () = {
    let mut i = 0;
    while i < COUNT {
        let s = &SPECS[i];
        assert!(
            s.format as usize == i,
            "SPECS must be in discriminant order"
        );
        assert!(
            matches!(s.bits, 4 | 8 | 16),
            "codes are 4, 8 or 16 bits: a 16-byte vector holds whole codes"
        );
        assert!(
            !s.block_groups
                || (s.bits == 4
                    && s.group.is_none()
                    && s.meta_bytes_per_row == 0
                    && s.head_scale.is_none()
                    && s.dense.is_none()),
            "a format grouped along a block's tokens is INT4 with its metadata per block"
        );
        match s.group {
            Some(g) => assert!(
                g > 0
                    && g * s.bits as usize % 8 == 0
                    && s.meta_bytes_per_row == 0
                    && match s.meta_bytes_per_group {
                        // an f16 scale (and zero), and no head scale
                        2 | 4 => s.head_scale.is_none(),
                        // an E4M3 scale under FP4's global scale
                        1 => matches!(s.head_scale, Some(HeadScale::Fp4)),
                        _ => false,
                    },
                "a group is whole bytes of codes with an f16 scale (and zero), or an E4M3 scale \
                 and a global head scale"
            ),
            None => assert!(
                s.meta_bytes_per_group == 0
                    && matches!(s.meta_bytes_per_row, 0 | 4)
                    && !(s.meta_bytes_per_row > 0 && s.head_scale.is_some())
                    && !matches!(s.head_scale, Some(HeadScale::Fp4)),
                "formats without groups have no metadata but an f32 row scale, or a head scale"
            ),
        }
        i += 1;
    }
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_name_and_format() {
        for (i, s) in SPECS.iter().enumerate() {
            assert_eq!(s.format as usize, i);
            assert_eq!(s.format.spec(), s);
            assert_eq!(KvFormat::from_name(s.name).unwrap(), s.format);
            assert_eq!(s.format.name(), s.name);
            assert_eq!(KvFormat::ALL[i], s.format);
        }
        assert_eq!(KvFormat::ALL.len(), SPECS.len());
    }

    #[test]
    fn dense_forms_round_trip() {
        for s in SPECS {
            match s.dense {
                Some(d) => {
                    assert_eq!(d.kv_format(), Some(s.format));
                    assert_eq!(DenseFormat::try_from(s.format).unwrap(), d);
                    assert_eq!(d.name(), s.name);
                }
                None => assert!(DenseFormat::try_from(s.format).is_err()),
            }
        }
    }

    /// The table's ids and names are `cuda/kvq.h`'s `kvq_format`, enumerator for enumerator, and
    /// its `KVQ_NUM_FORMATS` is the table's length (the device code takes its ids from the same
    /// header: `cuda/codec/format.cuh`, `codec.cuh`).
    #[test]
    fn table_matches_kvq_h() {
        let header = include_str!("../../cuda/kvq.h");
        let start = header
            .find("typedef enum kvq_format {")
            .expect("kvq.h declares kvq_format");
        let body = &header[start..];
        let mut body = body[body.find('{').unwrap() + 1..body.find('}').unwrap()].to_string();
        while let Some(open) = body.find("/*") {
            let close = open + body[open..].find("*/").expect("closed comment") + 2;
            body.replace_range(open..close, "");
        }
        let ids: Vec<(String, usize)> = body
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (name, id) = e.split_once('=').expect("kvq_format ids are explicit");
                (name.trim().to_string(), id.trim().parse().unwrap())
            })
            .collect();
        let table: Vec<(String, usize)> = SPECS
            .iter()
            .map(|s| (s.c_name.to_string(), s.format as usize))
            .collect();
        assert_eq!(ids, table);
        // The device code's format lists are the ids below this count (codec/codec.cuh).
        let count = header
            .lines()
            .find_map(|l| l.strip_prefix("#define KVQ_NUM_FORMATS "))
            .expect("kvq.h defines KVQ_NUM_FORMATS");
        assert_eq!(count.trim().parse::<usize>().unwrap(), SPECS.len());
    }
}
