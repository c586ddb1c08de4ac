//! Raw bindings to `cuda/kvq.h`, written by hand and checked against the header by a unit test
//! (every `kvq_*` function with its parameter count, every struct field, every constant).
//!
//! Nothing here is safe to call directly: the launchers trust their arguments (kvq.h says so).
//! [`super::ops`] validates and then calls these.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_ulonglong, c_void};

/// `kvq_status`: success.
pub const KVQ_OK: c_int = 0;
/// `kvq_status`: an argument the launcher cannot serve.
pub const KVQ_ERR_INVALID: c_int = -1;
/// `kvq_status`: a valid combination this build has no kernel for.
pub const KVQ_ERR_UNSUPPORTED: c_int = -2;
/// `kvq_status`: the CUDA runtime reported an error at launch.
pub const KVQ_ERR_LAUNCH: c_int = -3;

/// `kvq_dtype`: f32 elements.
pub const KVQ_DTYPE_F32: i32 = 0;
/// `kvq_dtype`: f16 elements.
pub const KVQ_DTYPE_F16: i32 = 1;
/// `kvq_dtype`: bf16 elements.
pub const KVQ_DTYPE_BF16: i32 = 2;

/// Format id of uniform per-tensor INT4 (dense only), beside the `kvq_format` ids.
pub const KVQ_DENSE_INT4_UNIFORM: i32 = 16;

/// Index of the non-finite-input count in a counters array.
pub const KVQ_COUNTER_NON_FINITE: usize = 0;
/// Index of the out-of-range slot / block count in a counters array.
pub const KVQ_COUNTER_OUT_OF_RANGE: usize = 1;
/// Length of a counters array.
pub const KVQ_NUM_COUNTERS: usize = 2;

/// `kvq_layout`: [`crate::layout::BlockLayout`] field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct kvq_layout {
    /// KV heads per layer.
    pub num_kv_heads: i32,
    /// Elements per head.
    pub head_dim: i32,
    /// Token slots per block.
    pub block_size: i32,
    /// Key format (`kvq_format`, the discriminant of `KvFormat`).
    pub k_format: i32,
    /// Value format.
    pub v_format: i32,
    /// Key codes: region offset in a head section.
    pub k_codes_offset: i32,
    /// Bytes per key code row.
    pub k_codes_row: i32,
    /// Key metadata (INT4 scales): region offset.
    pub k_meta_offset: i32,
    /// Bytes per key metadata row.
    pub k_meta_row: i32,
    /// Value codes: region offset.
    pub v_codes_offset: i32,
    /// Bytes per value code row.
    pub v_codes_row: i32,
    /// Value metadata (INT4 scale/zero pairs): region offset.
    pub v_meta_offset: i32,
    /// Bytes per value metadata row.
    pub v_meta_row: i32,
    /// Bytes of one head section.
    pub head_stride: i64,
    /// Bytes of one block (all heads).
    pub block_stride: i64,
}

/// `kvq_cache`: a device pool, FP8 per-head scales and the layout.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvq_cache {
    /// Device pointer to the block pool.
    pub pool: *mut u8,
    /// Device pointer to `num_kv_heads` FP8 key scales (may be null for non-FP8 keys).
    pub k_scales: *const f32,
    /// Device pointer to `num_kv_heads` FP8 value scales (may be null for non-FP8 values).
    pub v_scales: *const f32,
    /// The block layout.
    pub layout: kvq_layout,
}

/// Tokens per decode copy chunk: a decodable block size is a multiple of it.
pub const KVQ_DECODE_CHUNK_TOKENS: i32 = 16;
/// Warps of a small decode thread block.
pub const KVQ_DECODE_WARPS_SMALL: i32 = 4;
/// Warps of a large decode thread block.
pub const KVQ_DECODE_WARPS_LARGE: i32 = 8;
/// Fewest copy stages per decode warp.
pub const KVQ_DECODE_MIN_STAGES: i32 = 2;
/// Most copy stages per decode warp.
pub const KVQ_DECODE_MAX_STAGES: i32 = 8;

/// Most split-KV splits one decode launch may use.
pub const KVQ_DECODE_MAX_SPLITS: i32 = 256;

/// Query rows one decode thread block serves (its tensor-core tile's N).
pub const KVQ_DECODE_TILE_ROWS: i32 = 8;

/// `kvq_rows`: element strides of a query-shaped tensor (kvq.h).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct kvq_rows {
    pub seq: i64,
    pub token: i64,
    pub head: i64,
}

/// `kvq_decode_args`: one fused decode launch (kvq.h documents every field).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvq_decode_args {
    pub cache: kvq_cache,
    pub num_blocks: i64,
    pub q: *const c_void,
    pub out: *mut c_void,
    pub lse: *mut f32,
    pub q_rows: kvq_rows,
    pub out_rows: kvq_rows,
    pub lse_rows: kvq_rows,
    pub block_tables: *const i32,
    pub context_lens: *const i32,
    pub ws_o: *mut f32,
    pub ws_lse: *mut f32,
    pub ws_counters: *mut u32,
    pub counters: *mut c_ulonglong,
    pub q_dtype: i32,
    pub out_dtype: i32,
    pub batch: i32,
    pub num_q_heads: i32,
    pub q_len: i32,
    pub max_blocks: i32,
    pub num_splits: i32,
    pub split_tokens: i32,
    pub warps: i32,
    pub stages: i32,
    pub softmax_scale: f32,
}

unsafe extern "C" {
    // ---- append / quantize / dequantize (cuda/append.cu) ----

    /// Quantize-on-append of K and V rows into pool slots (kvq.h).
    pub fn kvq_append(
        cache: *const kvq_cache,
        num_blocks: i64,
        slots: *const c_void,
        slots_i64: i32,
        num_tokens: i64,
        k: *const c_void,
        v: *const c_void,
        dtype: i32,
        k_token_stride: i64,
        v_token_stride: i64,
        counters: *mut c_ulonglong,
        stream: *mut c_void,
    ) -> c_int;

    /// Dequantize one sequence's pages into dense K and V (kvq.h).
    pub fn kvq_gather_dequantize(
        cache: *const kvq_cache,
        num_blocks: i64,
        block_table: *const i32,
        num_tokens: i64,
        out_dtype: i32,
        k_out: *mut c_void,
        v_out: *mut c_void,
        counters: *mut c_ulonglong,
        stream: *mut c_void,
    ) -> c_int;

    /// Calibrated FP8 / uniform-INT4 scales of a dense tensor (kvq.h).
    pub fn kvq_dense_scales(
        format: i32,
        x: *const c_void,
        dtype: i32,
        rows: i64,
        heads: i32,
        head_dim: i32,
        per_head: i32,
        scales_out: *mut f32,
        amax_scratch: *mut u32,
        stream: *mut c_void,
    ) -> c_int;

    /// Quantize a dense tensor into the layout of `crate::dense` (kvq.h).
    pub fn kvq_quantize_dense(
        format: i32,
        x: *const c_void,
        dtype: i32,
        rows: i64,
        heads: i32,
        head_dim: i32,
        head_scales: *const f32,
        num_head_scales: i32,
        codes: *mut u8,
        group_scales: *mut u16,
        group_zeros: *mut u16,
        counters: *mut c_ulonglong,
        stream: *mut c_void,
    ) -> c_int;

    /// Dequantize a dense quantized tensor (kvq.h).
    pub fn kvq_dequantize_dense(
        format: i32,
        codes: *const u8,
        head_scales: *const f32,
        num_head_scales: i32,
        group_scales: *const u16,
        group_zeros: *const u16,
        rows: i64,
        heads: i32,
        head_dim: i32,
        out_dtype: i32,
        out: *mut c_void,
        stream: *mut c_void,
    ) -> c_int;

    /// Copy whole blocks inside one pool, pairs (src, dst) of int32 (kvq.h, cuda/blocks.cu).
    pub fn kvq_copy_blocks(
        cache: *const kvq_cache,
        num_blocks: i64,
        pairs: *const i32,
        num_pairs: i64,
        counters: *mut c_ulonglong,
        stream: *mut c_void,
    ) -> c_int;

    /// dst[pairs[2i]] = pairs[2i + 1] for i < num_pairs (kvq.h, cuda/blocks.cu).
    pub fn kvq_scatter_i32(
        dst: *mut i32,
        pairs: *const i32,
        num_pairs: i64,
        stream: *mut c_void,
    ) -> c_int;

    /// Message of the last failed launch on this thread (kvq.h).
    pub fn kvq_last_error() -> *const c_char;

    // ---- fused paged decode attention (cuda/decode.cu) ----

    /// Enqueue the fused decode kernel (splits merged in the same launch) (kvq.h).
    pub fn kvq_decode_attention(args: *const kvq_decode_args, stream: *mut c_void) -> c_int;

    /// 1 when a decode kernel exists for (K format, V format, head_dim) (kvq.h).
    pub fn kvq_decode_supported(k_format: i32, v_format: i32, head_dim: i32) -> c_int;

    /// Decode thread blocks per SM and stage bytes for a format pair, head_dim, warps per block
    /// and stage count; raises the smem limit (kvq.h).
    pub fn kvq_decode_occupancy(
        k_format: i32,
        v_format: i32,
        head_dim: i32,
        warps: i32,
        stages: i32,
        ctas_per_sm: *mut i32,
        stage_bytes: *mut i32,
    ) -> c_int;

    // ---- streaming-read probes (cuda/bandwidth.cu) ----

    /// Number of streaming-read variants (kvq.h).
    pub fn kvq_stream_read_variants() -> i32;

    /// Static name of a read variant, null out of range (kvq.h).
    pub fn kvq_stream_read_variant_name(variant: i32) -> *const c_char;

    /// Read a buffer once with one variant, checksum into `sink` (kvq.h).
    pub fn kvq_stream_read_variant(
        variant: i32,
        src: *const c_void,
        bytes: i64,
        sink: *mut u32,
        stream: *mut c_void,
    ) -> c_int;

    /// Streaming read with the default variant (the timer's L2 flush) (kvq.h).
    pub fn kvq_stream_read(
        src: *const c_void,
        bytes: i64,
        sink: *mut f32,
        stream: *mut c_void,
    ) -> c_int;

    /// Fill a buffer with the `KVQ_STREAM_FILL_STEP` sequence (kvq.h).
    pub fn kvq_stream_fill(dst: *mut c_void, bytes: i64, seed: u32, stream: *mut c_void) -> c_int;
}

/// Checksum words of a streaming-read sink.
pub const KVQ_STREAM_SINK_WORDS: usize = 4096;

/// Word i of a `kvq_stream_fill` buffer is `seed + i * KVQ_STREAM_FILL_STEP` (mod 2^32).
pub const KVQ_STREAM_FILL_STEP: u32 = 0x9E3779B9;

#[cfg(test)]
mod tests {
    //! The header is the source of truth; these tests parse it (a small C subset: the shapes
    //! kvq.h uses) and compare with this file's own text and types.
    use std::collections::BTreeMap;

    const HEADER: &str = include_str!("../../cuda/kvq.h");
    const THIS: &str = include_str!("sys.rs");

    /// Drop `/* */` and `//` comments and preprocessor lines.
    fn strip_c(src: &str) -> String {
        let mut out = String::new();
        let mut rest = src;
        while let Some(i) = rest.find("/*") {
            out.push_str(&rest[..i]);
            rest = rest[i..].find("*/").map_or("", |j| &rest[i + j + 2..]);
        }
        out.push_str(rest);
        out.lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Parameters in a list (`void` or empty → 0; a Rust trailing comma adds none).
    fn param_count(params: &str) -> usize {
        if params.trim() == "void" {
            return 0;
        }
        params.split(',').filter(|p| !p.trim().is_empty()).count()
    }

    /// name → parameter count of every `kvq_*(...)` declaration in `src`, found as an
    /// identifier starting with `kvq_` directly followed by `(`.
    fn functions(src: &str, rust: bool) -> BTreeMap<String, usize> {
        let mut found = BTreeMap::new();
        let marker = if rust { "pub fn kvq_" } else { "kvq_" };
        let mut at = 0;
        while let Some(i) = src[at..].find(marker) {
            let start = at + i + marker.len() - 4;
            let name_len = src[start..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(0);
            let name = &src[start..start + name_len];
            let after = src[start + name_len..].trim_start();
            at = start + name_len;
            let preceded_ok = rust
                || !src[..start]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
            if preceded_ok && after.starts_with('(') {
                let close = after.find(')').expect("closing parenthesis");
                found.insert(name.to_string(), param_count(&after[1..close]));
            }
        }
        found
    }

    /// Field names of `typedef struct NAME { ... } NAME;` in the header, in order.
    fn c_struct_fields(src: &str, name: &str) -> Vec<String> {
        let open = format!("typedef struct {name} {{");
        let i = src.find(&open).unwrap_or_else(|| panic!("{name} in kvq.h"));
        let body = &src[i + open.len()..];
        let body = &body[..body.find('}').expect("struct end")];
        let mut fields = Vec::new();
        for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
            // `type a, b` or `type *a`: the first declarator follows the type's last word.
            let mut parts = decl.split(',');
            let first = parts.next().unwrap_or("");
            let first_name = first.rsplit([' ', '*']).next().unwrap_or("");
            fields.push(first_name.trim().to_string());
            fields.extend(parts.map(|p| p.trim().trim_start_matches('*').to_string()));
        }
        fields
    }

    /// Field names of `pub struct NAME { ... }` in this file, in order.
    fn rust_struct_fields(src: &str, name: &str) -> Vec<String> {
        let open = format!("pub struct {name} {{");
        let i = src
            .find(&open)
            .unwrap_or_else(|| panic!("{name} in sys.rs"));
        let body = &src[i + open.len()..];
        let body = &body[..body.find('}').expect("struct end")];
        body.lines()
            .filter_map(|l| l.trim().strip_prefix("pub "))
            .filter_map(|l| l.split(':').next())
            .map(|n| n.trim().to_string())
            .collect()
    }

    #[test]
    fn every_header_function_is_declared_with_its_arity() {
        let header = functions(&strip_c(HEADER), false);
        let extern_block = &THIS[..THIS.find("#[cfg(test)]").expect("test module")];
        let rust = functions(extern_block, true);
        assert!(header.contains_key("kvq_append"), "parser found {header:?}");
        for (name, n) in &header {
            assert_eq!(
                rust.get(name),
                Some(n),
                "{name}: kvq.h has {n} parameters; sys.rs must declare it with as many"
            );
        }
        for name in rust.keys() {
            assert!(
                header.contains_key(name),
                "{name} is in sys.rs but not kvq.h"
            );
        }
    }

    #[test]
    fn structs_match_the_header() {
        let header = strip_c(HEADER);
        for name in ["kvq_layout", "kvq_cache", "kvq_rows", "kvq_decode_args"] {
            let c = c_struct_fields(&header, name);
            let r = rust_struct_fields(THIS, name);
            assert_eq!(c, r, "fields of {name}");
        }
        // 13 int32 (52 bytes, padded to 56) + 2 int64; the cache adds three pointers.
        assert_eq!(std::mem::size_of::<super::kvq_layout>(), 72);
        assert_eq!(std::mem::size_of::<super::kvq_cache>(), 96);
    }

    #[test]
    fn constants_match_the_header() {
        let header = strip_c(HEADER);
        let defines: Vec<(&str, &str)> = HEADER
            .lines()
            .filter_map(|l| l.trim().strip_prefix("#define KVQ_"))
            .filter_map(|l| l.split_once(' '))
            .collect();
        let enums = header
            .split([',', '{', '}'])
            .filter_map(|e| e.trim().split_once('='))
            .map(|(n, v)| (n.trim(), v.trim()))
            .filter(|(n, _)| n.starts_with("KVQ_"));
        let mut checked = 0;
        for (name, value) in defines
            .iter()
            .map(|(n, v)| (format!("KVQ_{n}"), v.trim()))
            .chain(enums.map(|(n, v)| (n.to_string(), v)))
        {
            // Formats are checked against KvFormat instead (they have no const here).
            if name.starts_with("KVQ_F16")
                || name.starts_with("KVQ_BF16")
                || name.starts_with("KVQ_FP8")
                || name.starts_with("KVQ_INT4")
                || name == "KVQ_H"
            {
                continue;
            }
            let needle = format!("pub const {name}: ");
            let at = THIS
                .find(&needle)
                .unwrap_or_else(|| panic!("{name} is in kvq.h but not sys.rs"));
            let rest = &THIS[at + needle.len()..];
            let rust_value = rest[rest.find('=').unwrap() + 1..rest.find(';').unwrap()].trim();
            assert_eq!(rust_value, value, "{name}");
            checked += 1;
        }
        assert!(checked >= 10, "only {checked} constants found");
    }

    #[test]
    fn format_ids_match_kv_format() {
        use crate::format::KvFormat;
        let header = strip_c(HEADER);
        for (name, f) in [
            ("KVQ_F16", KvFormat::F16),
            ("KVQ_BF16", KvFormat::Bf16),
            ("KVQ_FP8_E4M3", KvFormat::Fp8E4m3),
            ("KVQ_FP8_E5M2", KvFormat::Fp8E5m2),
            ("KVQ_INT4_SYM32", KvFormat::Int4Sym32),
            ("KVQ_INT4_AFFINE64", KvFormat::Int4Affine64),
        ] {
            let pat = format!("{name} = {}", f as u32);
            assert!(header.contains(&pat), "kvq.h must say {pat}");
        }
    }
}
