//! Benchmark results: the bytes a decode must read, and the tables, CSV and JSON the benches
//! write. Kept free of GPU code so reports can be re-rendered (and plotted) on any machine.

use crate::error::{Error, Result};
use crate::layout::BlockLayout;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::fmt::Write as _;

/// Bytes a decode step must read from device memory at the least: every K and V code and its
/// metadata for each (sequence, KV head, token), the block-table entries in use, the FP8 head
/// scales, and the queries. `int4-kc` keys count their codes for the tokens of sealed blocks,
/// each sealed block's `s` and `z`, and the f16 rows of a sequence's last, unsealed block.
/// This is the numerator of every bandwidth figure the crate reports. A count beyond `u64` is
/// an [`Error::Overflow`], never a wrapped figure.
pub fn decode_bytes_to_read(
    layout: &BlockLayout,
    context_lens: &[usize],
    num_q_heads: usize,
    q_len: usize,
    q_elem_bytes: usize,
) -> Result<u64> {
    let c = &layout.config;
    // A layout's row sizes are each below isize::MAX (validated or saturated), so their sum
    // fits in u64.
    let per_token_head = [
        layout.k_codes.row_bytes,
        layout.k_meta.row_bytes,
        layout.v_codes.row_bytes,
        layout.v_meta.row_bytes,
    ]
    .iter()
    .map(|&b| b as u64)
    .fold(0u64, u64::saturating_add);
    let scaled_sides = c.k_format.has_head_scale() as u64 + c.v_format.has_head_scale() as u64;
    let head_scales = mul(
        "FP8 head scale bytes (num_kv_heads × 4 per scaled side)",
        c.num_kv_heads as u64,
        4 * scaled_sides,
    )?;
    // In u128, so that only the product itself can overflow (a 0 factor makes it 0).
    let q_factors = [num_q_heads, q_len, c.head_dim, q_elem_bytes];
    let q = match q_factors.contains(&0) {
        true => Some(0),
        false => q_factors[1..]
            .iter()
            .try_fold(num_q_heads as u128, |a, &n| a.checked_mul(n as u128))
            .and_then(|q| u64::try_from(q).ok()),
    }
    .ok_or(Error::Overflow {
        what: "query bytes (num_q_heads × q_len·head_dim·element bytes)",
        lhs: num_q_heads,
        rhs: q_len
            .saturating_mul(c.head_dim)
            .saturating_mul(q_elem_bytes),
    })?;
    let kv_per_token = mul(
        "KV bytes per token (num_kv_heads × row bytes)",
        c.num_kv_heads as u64,
        per_token_head,
    )?;
    let mut total = head_scales;
    let mut largest = 0u64;
    for &len in context_lens {
        let mut kv = mul(
            "KV bytes (context_len × bytes per token)",
            len as u64,
            kv_per_token,
        )?;
        if c.k_format.block_groups() {
            // Per KV head: the sealed blocks' s and z, and the open rows as f16 instead of codes.
            let bs = c.block_size.max(1);
            let open = (len % bs) as u64;
            let block_meta = c.k_format.block_meta_bytes(c.head_dim) as u64;
            let per_head = ((len / bs) as u64)
                .checked_mul(block_meta)
                .zip(open.checked_mul(2 * c.head_dim as u64 - layout.k_codes.row_bytes as u64))
                .and_then(|(a, b)| a.checked_add(b));
            kv = per_head
                .and_then(|x| x.checked_mul(c.num_kv_heads as u64))
                .and_then(|x| x.checked_add(kv))
                .ok_or(Error::Overflow {
                    what: "int4-kc key bytes (blocks × s and z, open rows)",
                    lhs: len,
                    rhs: c.num_kv_heads,
                })?;
        }
        // block_size is at least 1 in a valid layout; max(1) keeps a literal's 0 harmless.
        let entries = len.div_ceil(c.block_size.max(1)) as u64;
        let table = mul("block-table bytes (entries × 4)", entries, 4)?;
        // + the context length itself
        let seq = [table, q, 4]
            .into_iter()
            .try_fold(kv, u64::checked_add)
            .ok_or(Error::Overflow {
                what: "bytes of one sequence (KV + table + query)",
                lhs: len,
                rhs: saturating_usize(kv_per_token),
            })?;
        largest = largest.max(seq);
        total = total.checked_add(seq).ok_or(Error::Overflow {
            what: "bytes to read (sequences × bytes of the largest)",
            lhs: context_lens.len(),
            rhs: saturating_usize(largest),
        })?;
    }
    Ok(total)
}

/// `a × b`, or [`Error::Overflow`] naming `what`.
fn mul(what: &'static str, a: u64, b: u64) -> Result<u64> {
    a.checked_mul(b).ok_or(Error::Overflow {
        what,
        lhs: saturating_usize(a),
        rhs: saturating_usize(b),
    })
}

fn saturating_usize(x: u64) -> usize {
    usize::try_from(x).unwrap_or(usize::MAX)
}

/// One decode shape: a model's attention geometry at a batch size and context length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeCase {
    /// Name of the shape family (e.g. `llama3-8b`, `8x22b-tp8`, `mha-32`).
    pub case: Cow<'static, str>,
    /// Sequences.
    pub batch: usize,
    /// Tokens of every sequence (new ones included).
    pub context_len: usize,
    /// Query heads.
    pub num_q_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per block of the pool.
    pub block_size: usize,
    /// New tokens per sequence.
    pub q_len: usize,
}

impl DecodeCase {
    /// Llama-3-8B attention: 32 query heads, 8 KV heads, head_dim 128, blocks of 16.
    pub const fn llama3_8b(batch: usize, context_len: usize) -> Self {
        DecodeCase {
            case: Cow::Borrowed("llama3-8b"),
            batch,
            context_len,
            num_q_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            block_size: 16,
            q_len: 1,
        }
    }

    /// One GPU's share of Mixtral-8x22B attention under 8-way tensor parallelism: 6 query
    /// heads over 1 KV head, head_dim 128.
    pub const fn moe_8x22b_tp8(batch: usize, context_len: usize) -> Self {
        DecodeCase {
            case: Cow::Borrowed("8x22b-tp8"),
            batch,
            context_len,
            num_q_heads: 6,
            num_kv_heads: 1,
            head_dim: 128,
            block_size: 16,
            q_len: 1,
        }
    }
}

/// One measured decode configuration (flat in JSON and CSV: the shape's fields first).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeBenchRow {
    /// What was measured.
    #[serde(flatten)]
    pub shape: DecodeCase,
    /// Key format (its short name).
    pub k_format: String,
    /// Value format (its short name).
    pub v_format: String,
    /// Split-KV partitions the plan chose.
    pub splits: usize,
    /// Median kernel time (decode + reduce), CUDA events.
    pub median_us: f64,
    /// [`decode_bytes_to_read`].
    pub bytes: u64,
    /// `bytes / median time`, in GB/s (1e9).
    pub gbps: f64,
    /// `gbps` as a percentage of the read ceiling measured in the same run.
    pub pct_of_ceiling: f64,
    /// Time of the bf16 cache on the same shape over this row's time.
    pub speedup_vs_bf16: Option<f64>,
}

/// One variant of the streaming-read probe (`cuda/bandwidth.cu`), as measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeVariant {
    /// Variant name, e.g. `nc-x16-t256-k3-tiles`.
    pub name: String,
    /// Median GB/s (1e9) of the timed reads; `None` when the variant does not count (`note`).
    pub gbps: Option<f64>,
    /// Slowest and fastest timed read, GB/s.
    pub range_gbps: Option<(f64, f64)>,
    /// Why the variant does not count: unavailable on this device, or a wrong checksum.
    pub note: Option<String>,
}

/// The streaming-read ceiling of one run: the median of the fastest probe variant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadCeiling {
    /// GB/s (1e9) of the winning variant.
    pub gbps: f64,
    /// Name of the winning variant.
    pub variant: String,
    /// Bytes each timed read covered.
    pub bytes: u64,
    /// Every variant, in probe order.
    pub variants: Vec<ProbeVariant>,
}

impl ReadCeiling {
    /// `read ceiling: 4607 GB/s (variant NAME; others: NAME 4512, ..., NAME unavailable)`.
    pub fn summary(&self) -> String {
        let others: Vec<String> = self
            .variants
            .iter()
            .filter(|v| v.name != self.variant)
            .map(|v| match (v.gbps, &v.note) {
                (Some(g), _) => format!("{} {g:.0}", v.name),
                (None, Some(n)) => format!("{} {}", v.name, n.split(':').next().unwrap_or(n)),
                (None, None) => format!("{} -", v.name),
            })
            .collect();
        format!(
            "read ceiling: {:.0} GB/s (variant {}; others: {})",
            self.gbps,
            self.variant,
            if others.is_empty() {
                "none".to_string()
            } else {
                others.join(", ")
            }
        )
    }
}

impl ReadCeiling {
    /// A markdown table of every variant: median, slowest and fastest read, % of the best, and
    /// why a variant did not count.
    pub fn markdown(&self) -> String {
        let mut s = String::from(
            "| variant | median GB/s | slowest | fastest | % of best | note |\n\
             |---|---:|---:|---:|---:|---|\n",
        );
        for v in &self.variants {
            let note = v.note.as_deref().unwrap_or("");
            let _ = match (v.gbps, v.range_gbps) {
                (Some(g), Some((lo, hi))) => writeln!(
                    s,
                    "| {} | {g:.0} | {lo:.0} | {hi:.0} | {:.1} | {note} |",
                    v.name,
                    100.0 * g / self.gbps
                ),
                _ => writeln!(s, "| {} | - | - | - | - | {note} |", v.name),
            };
        }
        s
    }

    /// Whether some variant read the wrong bytes (it is left out of the ceiling).
    pub fn any_wrong_checksum(&self) -> bool {
        self.variants.iter().any(|v| {
            v.note
                .as_deref()
                .is_some_and(|n| n.starts_with("wrong checksum"))
        })
    }
}

impl std::fmt::Display for ReadCeiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.summary())
    }
}

/// A whole benchmark run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeBenchReport {
    /// GPU name.
    pub device: String,
    /// Streaming-read bandwidth measured in the same run, GB/s.
    pub ceiling_gbps: f64,
    /// How `ceiling_gbps` was found (absent in reports from before the probe had variants).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceiling_probe: Option<ReadCeiling>,
    /// kvq version that produced it.
    pub kvq_version: String,
    /// The measured configurations.
    pub rows: Vec<DecodeBenchRow>,
}

impl DecodeBenchReport {
    /// A new report with no rows.
    pub fn new(device: impl Into<String>, ceiling_gbps: f64) -> Self {
        DecodeBenchReport {
            device: device.into(),
            ceiling_gbps,
            ceiling_probe: None,
            kvq_version: env!("CARGO_PKG_VERSION").to_string(),
            rows: Vec::new(),
        }
    }

    /// Fill `speedup_vs_bf16` for every row that has a bf16/bf16 row of the same shape.
    pub fn fill_speedups(&mut self) {
        let base: Vec<(DecodeCase, f64)> = self
            .rows
            .iter()
            .filter(|r| r.k_format == "bf16" && r.v_format == "bf16")
            .map(|r| (r.shape.clone(), r.median_us))
            .collect();
        for r in &mut self.rows {
            r.speedup_vs_bf16 = base
                .iter()
                .find(|b| b.0 == r.shape)
                .map(|b| b.1 / r.median_us);
        }
    }

    /// A markdown table, one row per measurement.
    pub fn markdown(&self) -> String {
        let mut s = match &self.ceiling_probe {
            Some(p) => format!("Device: {} — {} — measured in this run\n\n", self.device, p),
            None => format!(
                "Device: {} — read ceiling {:.0} GB/s (measured in this run)\n\n",
                self.device, self.ceiling_gbps
            ),
        };
        s.push_str("| case | B | L | q/kv heads | d | K | V | splits | µs (median) | MB read | GB/s | % ceiling | × bf16 |\n");
        s.push_str("|---|---:|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|\n");
        for r in &self.rows {
            let speedup = r
                .speedup_vs_bf16
                .map_or("—".to_string(), |x| format!("{x:.2}"));
            let _ = writeln!(
                s,
                "| {} | {} | {} | {}/{} | {} | {} | {} | {} | {:.1} | {:.1} | {:.0} | {:.1} | {} |",
                r.shape.case,
                r.shape.batch,
                r.shape.context_len,
                r.shape.num_q_heads,
                r.shape.num_kv_heads,
                r.shape.head_dim,
                r.k_format,
                r.v_format,
                r.splits,
                r.median_us,
                r.bytes as f64 / 1e6,
                r.gbps,
                r.pct_of_ceiling,
                speedup
            );
        }
        s
    }

    /// CSV with a header line.
    pub fn csv(&self) -> String {
        let mut s = String::from(
            "case,batch,context_len,num_q_heads,num_kv_heads,head_dim,block_size,q_len,k_format,v_format,splits,median_us,bytes,gbps,pct_of_ceiling,speedup_vs_bf16\n",
        );
        for r in &self.rows {
            let _ = writeln!(
                s,
                "{},{},{},{},{},{},{},{},{},{},{},{:.3},{},{:.1},{:.2},{}",
                r.shape.case,
                r.shape.batch,
                r.shape.context_len,
                r.shape.num_q_heads,
                r.shape.num_kv_heads,
                r.shape.head_dim,
                r.shape.block_size,
                r.shape.q_len,
                r.k_format,
                r.v_format,
                r.splits,
                r.median_us,
                r.bytes,
                r.gbps,
                r.pct_of_ceiling,
                r.speedup_vs_bf16
                    .map_or(String::new(), |x| format!("{x:.3}"))
            );
        }
        s
    }

    /// Pretty JSON of the whole report, which [`from_json`](Self::from_json) reads back equal
    /// (every f64 bit for bit: serde_json's `float_roundtrip`). JSON has no NaN or infinity
    /// (serde_json would write `null`, which reads back as an error or as `None`), so a report
    /// holding one is refused here, naming the field ([`Error::InvalidArgument`]): a bad
    /// measurement must not turn into a file that cannot be read.
    pub fn to_json(&self) -> Result<String> {
        if let Some((field, value)) = self.non_finite() {
            return Err(Error::InvalidArgument(format!(
                "bench report: {field} is {value}, which JSON cannot hold"
            )));
        }
        serde_json::to_string_pretty(self)
            .map_err(|e| Error::InvalidArgument(format!("bench report to JSON: {e}")))
    }

    /// The first f64 field that is NaN or infinite, with its path.
    fn non_finite(&self) -> Option<(String, f64)> {
        let mut fields: Vec<(String, f64)> = vec![("ceiling_gbps".into(), self.ceiling_gbps)];
        if let Some(p) = &self.ceiling_probe {
            fields.push(("ceiling_probe.gbps".into(), p.gbps));
            for (i, v) in p.variants.iter().enumerate() {
                let at = |f: &str| format!("ceiling_probe.variants[{i}].{f}");
                fields.extend(v.gbps.map(|g| (at("gbps"), g)));
                if let Some((lo, hi)) = v.range_gbps {
                    fields.extend([(at("range_gbps.0"), lo), (at("range_gbps.1"), hi)]);
                }
            }
        }
        for (i, r) in self.rows.iter().enumerate() {
            let at = |f: &str| format!("rows[{i}].{f}");
            fields.extend([
                (at("median_us"), r.median_us),
                (at("gbps"), r.gbps),
                (at("pct_of_ceiling"), r.pct_of_ceiling),
            ]);
            fields.extend(r.speedup_vs_bf16.map(|x| (at("speedup_vs_bf16"), x)));
        }
        fields.into_iter().find(|(_, v)| !v.is_finite())
    }

    /// Write `decode_bench.md`, `.csv` and `.json` into `dir` (created if missing); returns
    /// the paths written. A report [`to_json`](Self::to_json) refuses writes nothing.
    pub fn write_files(&self, dir: &std::path::Path) -> Result<Vec<std::path::PathBuf>> {
        let io = |p: &std::path::Path, e: std::io::Error| {
            Error::InvalidArgument(format!("{}: {e}", p.display()))
        };
        // Before anything is written: a report JSON cannot hold writes no file.
        let json = self.to_json()?;
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let mut written = Vec::new();
        for (name, text) in [
            ("decode_bench.md", self.markdown()),
            ("decode_bench.csv", self.csv()),
            ("decode_bench.json", json),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|e| io(&path, e))?;
            written.push(path);
        }
        Ok(written)
    }

    /// Parse a report written by [`to_json`](Self::to_json).
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| Error::InvalidArgument(format!("bench JSON: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CacheConfig, KvFormat};

    #[test]
    fn bytes_to_read_counts_codes_meta_tables_and_q() {
        let c = CacheConfig::new(8, 128, 16, KvFormat::Int4Sym32, KvFormat::Int4Affine64).unwrap();
        let b = decode_bytes_to_read(&c.layout(), &[1000], 32, 1, 2).unwrap();
        // 1000 tokens * 8 heads * 2 * 128 * 0.5625 + 63 table entries + q + length
        assert_eq!(b, 1000 * 8 * 144 + 63 * 4 + 32 * 128 * 2 + 4);
    }

    #[test]
    fn bytes_to_read_counts_int4_kc_blocks_and_the_open_window() {
        let c = CacheConfig::new(8, 128, 32, KvFormat::Int4Kc, KvFormat::Int4Affine64).unwrap();
        let b = decode_bytes_to_read(&c.layout(), &[1000], 32, 1, 2).unwrap();
        // 31 sealed blocks (992 tokens of 64 code bytes, s and z 512 bytes each), 8 open f16
        // rows of 256 bytes, values at 72 bytes a token; 32 table entries, q, length.
        let k = 992 * 64 + 31 * 512 + 8 * 256;
        assert_eq!(b, 8 * (k + 1000 * 72) + 32 * 4 + 32 * 128 * 2 + 4);
    }

    #[test]
    fn report_round_trips_through_json() {
        let mut r = DecodeBenchReport::new("test", 4700.0);
        r.rows.push(DecodeBenchRow {
            shape: DecodeCase {
                case: "x".into(),
                ..DecodeCase::llama3_8b(1, 4096)
            },
            k_format: "bf16".into(),
            v_format: "bf16".into(),
            splits: 4,
            median_us: 10.0,
            bytes: 1,
            gbps: 1.0,
            pct_of_ceiling: 1.0,
            speedup_vs_bf16: None,
        });
        r.fill_speedups();
        assert_eq!(r.rows[0].speedup_vs_bf16, Some(1.0));
        assert_eq!(
            DecodeBenchReport::from_json(&r.to_json().unwrap()).unwrap(),
            r
        );
        assert!(r.markdown().contains("| x | 1 | 4096 |"));
        assert_eq!(r.csv().lines().count(), 2);
    }

    #[test]
    fn json_keeps_every_bit_and_refuses_nan() {
        let mut r = DecodeBenchReport::new("test", 4700.123456789);
        r.rows.push(DecodeBenchRow {
            shape: DecodeCase::llama3_8b(1, 4096),
            k_format: "bf16".into(),
            v_format: "bf16".into(),
            splits: 4,
            median_us: 0.1 + 0.2,
            bytes: 1,
            gbps: 1.0 / 3.0,
            pct_of_ceiling: f64::MIN_POSITIVE,
            speedup_vs_bf16: Some(2.0f64.sqrt()),
        });
        assert_eq!(
            DecodeBenchReport::from_json(&r.to_json().unwrap()).unwrap(),
            r
        );
        r.rows[0].speedup_vs_bf16 = Some(f64::NAN);
        let err = r.to_json().unwrap_err();
        assert!(err.to_string().contains("rows[0].speedup_vs_bf16"), "{err}");
        let dir = std::env::temp_dir().join(format!("kvq-report-nan-{}", std::process::id()));
        assert!(r.write_files(&dir).is_err());
        assert!(!dir.exists(), "nothing written");
        r.rows[0].speedup_vs_bf16 = None;
        r.ceiling_gbps = f64::INFINITY;
        assert!(r.to_json().is_err());
    }

    #[test]
    fn bytes_to_read_refuses_to_wrap() {
        let c = CacheConfig::new(8, 128, 16, KvFormat::Int4Sym32, KvFormat::Int4Affine64).unwrap();
        let l = c.layout();
        assert!(matches!(
            decode_bytes_to_read(&l, &[usize::MAX], 32, 1, 2),
            Err(Error::Overflow { .. })
        ));
        assert!(matches!(
            decode_bytes_to_read(&l, &vec![1 << 40; 1 << 20], 32, 1, 2),
            Err(Error::Overflow { .. })
        ));
        assert!(matches!(
            decode_bytes_to_read(&l, &[1], usize::MAX, 2, 2),
            Err(Error::Overflow { .. })
        ));
        assert!(decode_bytes_to_read(&l, &[], usize::MAX, 2, 2).is_err());
    }

    #[test]
    fn ceiling_probe_is_summarised_and_optional_in_json() {
        let v = |name: &str, gbps: Option<f64>, note: Option<&str>| ProbeVariant {
            name: name.into(),
            gbps,
            range_gbps: gbps.map(|g| (g - 10.0, g + 5.0)),
            note: note.map(Into::into),
        };
        let probe = ReadCeiling {
            gbps: 4607.4,
            variant: "b".into(),
            bytes: 4 << 30,
            variants: vec![
                v("a", Some(4340.2), None),
                v("b", Some(4607.4), None),
                v("c", None, Some("unavailable: needs sm_90")),
            ],
        };
        assert_eq!(
            probe.summary(),
            "read ceiling: 4607 GB/s (variant b; others: a 4340, c unavailable)"
        );
        let mut r = DecodeBenchReport::new("test", probe.gbps);
        let old_json = r.to_json().unwrap();
        assert!(!old_json.contains("ceiling_probe"));
        assert_eq!(DecodeBenchReport::from_json(&old_json).unwrap(), r);
        r.ceiling_probe = Some(probe);
        assert_eq!(
            DecodeBenchReport::from_json(&r.to_json().unwrap()).unwrap(),
            r
        );
        assert!(r.markdown().contains("read ceiling: 4607 GB/s (variant b;"));
        let table = r.ceiling_probe.as_ref().unwrap().markdown();
        assert!(
            table.contains("| a | 4340 | 4330 | 4345 | 94.2 |  |"),
            "{table}"
        );
        assert!(table.contains("| c | - | - | - | - | unavailable: needs sm_90 |"));
        assert!(!r.ceiling_probe.as_ref().unwrap().any_wrong_checksum());
    }
}
