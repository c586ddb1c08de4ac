//! Reading and writing safetensors files for the CLI: whole-file reads, dtype conversion to
//! f32, and writes that never leave a partial output behind.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use half::{bf16, f16};
use kvq::dense::{StoredDtype, StoredTensor};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};

use crate::CliError;

/// The files this run reads (canonical paths): no output may replace one.
static INPUTS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Note `path` as an input of this run, so that no output of it replaces the file.
pub fn note_input(path: &Path) {
    if let Ok(p) = fs::canonicalize(path) {
        INPUTS.lock().unwrap_or_else(|e| e.into_inner()).push(p);
    }
}

/// Refuse an output path that would replace an input of this run or a read-only file.
fn check_output(path: &Path) -> Result<(), CliError> {
    let Ok(meta) = fs::metadata(path) else {
        return Ok(()); // a new file
    };
    let shown = path.display();
    let input = fs::canonicalize(path).is_ok_and(|p| {
        INPUTS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&p)
    });
    if input {
        return Err(CliError::new(format!(
            "'{shown}' is an input of this command: write the output to another path"
        )));
    }
    if meta.permissions().readonly() {
        return Err(CliError::new(format!(
            "'{shown}' is read-only: kvq does not replace it (write elsewhere, or remove it \
             first)"
        )));
    }
    Ok(())
}

/// A safetensors file read into memory.
pub struct InputFile {
    path: PathBuf,
    bytes: Vec<u8>,
}

impl InputFile {
    /// Read `path` whole.
    pub fn read(path: &Path) -> Result<Self, CliError> {
        let bytes = fs::read(path)
            .map_err(|e| CliError::new(format!("cannot read '{}': {e}", path.display())))?;
        note_input(path);
        Ok(InputFile {
            path: path.to_path_buf(),
            bytes,
        })
    }

    /// The parsed header and tensors.
    pub fn parse(&self) -> Result<SafeTensors<'_>, CliError> {
        SafeTensors::deserialize(&self.bytes).map_err(|e| {
            CliError::new(format!(
                "'{}' is not a valid safetensors file: {e}",
                self.path.display()
            ))
        })
    }

    /// The free-form `__metadata__` map of the header (empty when absent).
    pub fn metadata(&self) -> Result<HashMap<String, String>, CliError> {
        let (_, meta) = SafeTensors::read_metadata(&self.bytes).map_err(|e| {
            CliError::new(format!(
                "'{}' is not a valid safetensors file: {e}",
                self.path.display()
            ))
        })?;
        Ok(meta.metadata().clone().unwrap_or_default())
    }

    /// Where the file came from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The elements of a floating-point tensor (F16, BF16 or F32) as f32, exactly.
pub fn to_f32(name: &str, t: &TensorView<'_>) -> Result<Vec<f32>, CliError> {
    let data = t.data();
    Ok(match t.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(CliError::new(format!(
                "tensor '{name}' has dtype {other:?}; expected F16, BF16 or F32"
            )));
        }
    })
}

/// A U8 / F16 / F32 tensor of a quantized file as a stored part.
pub fn to_stored(name: &str, t: &TensorView<'_>) -> Result<StoredTensor, CliError> {
    let dtype = match t.dtype() {
        Dtype::U8 => StoredDtype::U8,
        Dtype::F16 => StoredDtype::F16,
        Dtype::F32 => StoredDtype::F32,
        other => {
            return Err(CliError::new(format!(
                "tensor '{name}' has dtype {other:?}; a kvq file holds only U8, F16 and F32"
            )));
        }
    };
    StoredTensor::new(dtype, t.shape().to_vec(), t.data().to_vec())
        .map_err(|e| CliError::new(format!("tensor '{name}': {e}")))
}

/// An owned tensor to write.
pub struct OutTensor {
    /// Its dtype in the file.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Little-endian bytes.
    pub data: Vec<u8>,
}

impl OutTensor {
    /// A stored part, as is.
    pub fn stored(t: StoredTensor) -> Self {
        let dtype = match t.dtype() {
            StoredDtype::U8 => Dtype::U8,
            StoredDtype::F16 => Dtype::F16,
            StoredDtype::F32 => Dtype::F32,
        };
        let shape = t.shape().to_vec();
        OutTensor {
            dtype,
            shape,
            data: t.into_data(),
        }
    }

    /// An F32 tensor.
    pub fn f32(shape: Vec<usize>, values: &[f32]) -> Self {
        OutTensor {
            dtype: Dtype::F32,
            shape,
            data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// Write `tensors` and `metadata` to `path` all or nothing: the bytes go to `path.tmp` in the
/// same directory first and are renamed over `path` only once complete.
pub fn write_atomic(
    path: &Path,
    tensors: Vec<(String, OutTensor)>,
    metadata: HashMap<String, String>,
) -> Result<(), CliError> {
    let views = tensors
        .iter()
        .map(|(name, t)| {
            TensorView::new(t.dtype, t.shape.clone(), &t.data)
                .map(|v| (name.as_str(), v))
                .map_err(|e| CliError::new(format!("tensor '{name}': {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|e| CliError::new(format!("cannot encode safetensors: {e}")))?;
    write_bytes_atomic(path, &bytes)
}

/// Write `bytes` to `path` all or nothing, through `path.tmp` as [`write_atomic`] does; never
/// over an input of this run or a read-only file.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<(), CliError> {
    check_output(path)?;
    let mut tmp = OsString::from(path.as_os_str());
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let written = fs::write(&tmp, bytes).and_then(|()| fs::rename(&tmp, path));
    if let Err(e) = written {
        // Best effort: the write already failed, and a leftover temp file must not linger.
        let _ = fs::remove_file(&tmp);
        return Err(CliError::new(format!(
            "cannot write '{}' (through '{}'): {e}",
            path.display(),
            tmp.display()
        )));
    }
    Ok(())
}

/// A `[tokens, heads, head_dim]` tensor as f32 with its three axes.
pub type Tensor3 = (Vec<f32>, [usize; 3]);

/// A `[tokens, heads, head_dim]` tensor of the file as f32.
pub fn load3(st: &SafeTensors<'_>, name: &str) -> Result<Tensor3, CliError> {
    let view = st
        .tensor(name)
        .map_err(|_| CliError::new(format!("tensor '{name}' is missing")))?;
    let &[t, h, d] = view.shape() else {
        return Err(CliError::new(format!(
            "tensor '{name}' has shape {:?}; expected [tokens, heads, head_dim]",
            view.shape()
        )));
    };
    Ok((to_f32(name, &view)?, [t, h, d]))
}

/// The name of a layer's tensor, `{L}` standing for the layer index: `k.{L}`,
/// `model.layers.{L}.self_attn.k`. Dumps name their tensors in many ways; a pattern maps them.
#[derive(Clone, Debug)]
pub struct LayerPattern {
    prefix: String,
    suffix: String,
}

impl LayerPattern {
    /// `{prefix}{L}`, such as `k.{L}`.
    pub fn with_prefix(prefix: &str) -> Self {
        LayerPattern {
            prefix: prefix.to_string(),
            suffix: String::new(),
        }
    }

    /// The name of layer `layer`'s tensor.
    pub fn name(&self, layer: usize) -> String {
        format!("{}{layer}{}", self.prefix, self.suffix)
    }

    /// The layer whose tensor `name` is, if it is one: the index in place of `{L}` exactly as
    /// [`name`](Self::name) writes it (`k.01` and `k.+1` are no layer's).
    pub fn layer_of(&self, name: &str) -> Option<usize> {
        let index = name
            .strip_prefix(&self.prefix)?
            .strip_suffix(&self.suffix)?;
        let layer = index.parse().ok()?;
        (self.name(layer) == name).then_some(layer)
    }
}

impl std::str::FromStr for LayerPattern {
    type Err = String;

    /// A pattern holds `{L}` exactly once.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once("{L}") {
            Some((prefix, suffix)) if !suffix.contains("{L}") => Ok(LayerPattern {
                prefix: prefix.to_string(),
                suffix: suffix.to_string(),
            }),
            _ => Err(format!(
                "'{s}' must hold {{L}} (the layer index) exactly once, e.g. model.layers.{{L}}.k"
            )),
        }
    }
}

impl std::fmt::Display for LayerPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{{L}}{}", self.prefix, self.suffix)
    }
}

/// Layers `L` for which every pattern names a tensor of `st`, ascending.
pub fn layers_with(st: &SafeTensors<'_>, patterns: &[&LayerPattern]) -> Vec<usize> {
    let names = st.names();
    let Some((first, rest)) = patterns.split_first() else {
        return Vec::new();
    };
    let mut layers: Vec<usize> = names
        .iter()
        .filter_map(|n| first.layer_of(n))
        .filter(|&l| rest.iter().all(|p| names.contains(&&*p.name(l))))
        .collect();
    layers.sort_unstable();
    layers
}

/// Why `file` holds no layer with a tensor of every one of `patterns` (each with the flag that
/// sets it): which layers each pattern finds alone, the file's first tensor names, and, for a
/// file `kvq quantize` wrote, that `kvq dequantize` turns it back into tensors.
pub fn no_layers_error(
    file: &InputFile,
    st: &SafeTensors<'_>,
    patterns: &[(&LayerPattern, &str)],
) -> CliError {
    let list = |p: &[&str]| p.join(", ");
    let wanted: Vec<String> = patterns.iter().map(|(p, _)| p.to_string()).collect();
    let flags: Vec<&str> = patterns.iter().map(|(_, f)| *f).collect();
    let found: Vec<String> = patterns
        .iter()
        .map(|(p, _)| {
            let layers = layers_with(st, &[p]);
            match (layers.first(), layers.last()) {
                (Some(a), Some(b)) => format!("{p}: layers {a}..={b} ({} of them)", layers.len()),
                _ => format!("{p}: none"),
            }
        })
        .collect();
    let mut names = st.names();
    names.sort();
    let shown: Vec<String> = names.iter().take(6).map(|n| n.to_string()).collect();
    let more = if names.len() > shown.len() {
        format!(", ... ({} in all)", names.len())
    } else {
        String::new()
    };
    let quantized = if file
        .metadata()
        .is_ok_and(|m| m.contains_key(crate::META_FORMAT))
    {
        "; it holds the codes `kvq quantize` wrote: `kvq dequantize` turns them back into \
         tensors"
    } else {
        ""
    };
    CliError::new(format!(
        "'{}' holds no layer with all of {} ({}): {}; its tensors: {}{more}{quantized}",
        file.path().display(),
        wanted.join(", "),
        list(&flags),
        found.join(", "),
        shown.join(", ")
    ))
}

/// The layers `requested` (all of `available` when empty), each of which must be available;
/// `source` names the file in the error.
pub fn choose_layers(
    requested: &[usize],
    available: &[usize],
    source: &str,
) -> Result<Vec<usize>, CliError> {
    if let Some(l) = requested.iter().find(|l| !available.contains(l)) {
        return Err(CliError::new(format!(
            "layer {l} is not in '{source}' (it has layers {available:?})"
        )));
    }
    if let Some(l) = requested
        .iter()
        .enumerate()
        .find_map(|(i, l)| requested[..i].contains(l).then_some(l))
    {
        return Err(CliError::new(format!("--layers names layer {l} twice")));
    }
    Ok(if requested.is_empty() {
        available.to_vec()
    } else {
        requested.to_vec()
    })
}

#[cfg(test)]
mod tests {
    //! The readers fed random, truncated and corrupted files: never a panic, and every failure
    //! is one error of one line. Cases: `KVQ_FUZZ_CASES` × 8 per property (default 256).

    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{TestCaseError, TestRunner};

    const DTYPES: [Dtype; 6] = [
        Dtype::U8,
        Dtype::F16,
        Dtype::BF16,
        Dtype::F32,
        Dtype::I32,
        Dtype::F64,
    ];

    fn runner() -> TestRunner {
        let cases = std::env::var("KVQ_FUZZ_CASES")
            .ok()
            .and_then(|s| s.parse::<u32>().ok())
            .unwrap_or(256);
        TestRunner::new(ProptestConfig {
            cases: (cases * 8).max(1),
            failure_persistence: None,
            ..ProptestConfig::default()
        })
    }

    /// A valid file of tensors with the given dtypes and shapes (random bytes) and metadata.
    fn file(tensors: &[(u8, Vec<usize>)], meta: &[(String, String)], seed: u8) -> Vec<u8> {
        let data: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(dt, shape)| {
                let n = shape.iter().product::<usize>() * DTYPES[*dt as usize].bitsize() / 8;
                (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
            })
            .collect();
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .zip(&data)
            .enumerate()
            .map(|(i, ((dt, shape), d))| {
                let v = TensorView::new(DTYPES[*dt as usize], shape.clone(), d).unwrap();
                (format!("t{i}"), v)
            })
            .collect();
        let meta = (!meta.is_empty()).then(|| meta.iter().cloned().collect());
        safetensors::serialize(views, meta).unwrap()
    }

    fn one_line(e: &CliError) -> Result<(), TestCaseError> {
        let text = e.to_string();
        prop_assert!(!text.is_empty() && !text.contains('\n'), "{text:?}");
        Ok(())
    }

    /// Every reader on `bytes`; returns how many tensors converted.
    fn read_all(bytes: Vec<u8>) -> Result<usize, TestCaseError> {
        let f = InputFile {
            path: PathBuf::from("fuzz.safetensors"),
            bytes,
        };
        if let Err(e) = f.metadata() {
            one_line(&e)?;
        }
        let st = match f.parse() {
            Ok(st) => st,
            Err(e) => {
                one_line(&e)?;
                return Ok(0);
            }
        };
        let mut converted = 0;
        for name in st.names() {
            let view = st.tensor(name).unwrap();
            let elements: usize = view.shape().iter().product();
            match to_f32(name, &view) {
                Ok(x) => {
                    prop_assert_eq!(x.len(), elements);
                    converted += 1;
                }
                Err(e) => {
                    one_line(&e)?;
                    let float = matches!(view.dtype(), Dtype::F16 | Dtype::BF16 | Dtype::F32);
                    prop_assert!(!float);
                }
            }
            match to_stored(name, &view) {
                Ok(t) => prop_assert_eq!(t.shape(), view.shape()),
                Err(e) => one_line(&e)?,
            }
        }
        Ok(converted)
    }

    fn tensors() -> impl Strategy<Value = Vec<(u8, Vec<usize>)>> {
        prop::collection::vec((0u8..6, prop::collection::vec(0usize..5, 0..4)), 0..4)
    }

    fn meta() -> impl Strategy<Value = Vec<(String, String)>> {
        prop::collection::vec(("[a-z.]{1,8}", "[ -~]{0,12}"), 0..3)
    }

    #[test]
    fn layer_patterns_name_and_find_layers() {
        let p: LayerPattern = "model.layers.{L}.k".parse().unwrap();
        assert_eq!(p.name(12), "model.layers.12.k");
        assert_eq!(p.to_string(), "model.layers.{L}.k");
        assert_eq!(p.layer_of("model.layers.12.k"), Some(12));
        for other in [
            "model.layers.12.v",
            "model.layers..k",
            "model.layers.01.k",
            "k.1",
        ] {
            assert_eq!(p.layer_of(other), None, "{other}");
        }
        for bad in ["k", "k.{L}.{L}", "{l}"] {
            assert!(bad.parse::<LayerPattern>().is_err(), "{bad}");
        }
        let bytes = file(
            &[(1, vec![1, 1, 8]), (1, vec![1, 1, 8]), (1, vec![1, 1, 8])],
            &[],
            0,
        );
        let f = InputFile {
            path: PathBuf::from("layers.safetensors"),
            bytes,
        };
        let st = f.parse().unwrap();
        // The file's tensors are t0, t1, t2.
        let t: LayerPattern = "t{L}".parse().unwrap();
        assert_eq!(layers_with(&st, &[&t]), [0, 1, 2]);
        let x: LayerPattern = "x{L}".parse().unwrap();
        assert!(layers_with(&st, &[&t, &x]).is_empty());
        assert_eq!(choose_layers(&[], &[0, 1, 2], "f").unwrap(), [0, 1, 2]);
        assert_eq!(choose_layers(&[2, 0], &[0, 1, 2], "f").unwrap(), [2, 0]);
        assert!(choose_layers(&[3], &[0, 1, 2], "f").is_err());
    }

    #[test]
    fn valid_files_read_back() {
        let r = runner().run(&(tensors(), meta(), any::<u8>()), |(t, m, seed)| {
            let n = t.len();
            let floats = t.iter().filter(|(dt, _)| (1..=3).contains(dt)).count();
            let converted = read_all(file(&t, &m, seed))?;
            prop_assert!(n == 0 || converted == floats);
            Ok(())
        });
        r.unwrap();
    }

    #[test]
    fn truncated_and_corrupted_files_are_errors() {
        let strategy = (
            tensors(),
            meta(),
            any::<u8>(),
            any::<prop::sample::Index>(),
            prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        );
        let r = runner().run(&strategy, |(t, m, seed, cut, flips)| {
            let full = file(&t, &m, seed);
            // Any proper prefix is not a file.
            let at = cut.index(full.len());
            let f = InputFile {
                path: PathBuf::from("cut.safetensors"),
                bytes: full[..at].to_vec(),
            };
            prop_assert!(f.parse().is_err());
            read_all(full[..at].to_vec())?;
            // Flipped bytes, in the header or the data: read or refused, never a panic.
            let mut bad = full;
            for (i, b) in flips {
                let i = i.index(bad.len());
                bad[i] ^= b;
            }
            read_all(bad)?;
            Ok(())
        });
        r.unwrap();
    }

    #[test]
    fn random_bytes_and_headers_are_errors() {
        let header = (
            prop::sample::select(vec!["U8", "F16", "BF16", "F32", "I64", "F4", "BOOL", "X"]),
            prop::collection::vec(prop_oneof![3 => 0u64..6, 1 => any::<u64>()], 0..4),
            prop_oneof![3 => 0u64..64, 1 => any::<u64>()],
            prop_oneof![3 => 0u64..64, 1 => any::<u64>()],
            0usize..80,
        );
        let strategy = (prop::collection::vec(any::<u8>(), 0..256), header);
        let r = runner().run(&strategy, |(noise, (dtype, shape, start, end, data_len))| {
            read_all(noise.clone())?;
            // A header that parses as JSON but describes anything at all.
            let json = format!(
                r#"{{"t":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{start},{end}]}}}}"#
            );
            let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(json.as_bytes());
            bytes.extend(noise.iter().cycle().take(data_len));
            read_all(bytes)?;
            Ok(())
        });
        r.unwrap();
    }
}
