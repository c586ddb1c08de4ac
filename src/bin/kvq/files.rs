//! Reading and writing safetensors files for the CLI: whole-file reads, dtype conversion to
//! f32, and writes that never leave a partial output behind.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use kvq::dense::{StoredDtype, StoredTensor};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};

use crate::CliError;

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
    let mut tmp = OsString::from(path.as_os_str());
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let written = fs::write(&tmp, &bytes).and_then(|()| fs::rename(&tmp, path));
    if let Err(e) = written {
        // Best effort: the write already failed, and a leftover temp file must not linger.
        let _ = fs::remove_file(&tmp);
        return Err(CliError::new(format!(
            "cannot write '{}': {e}",
            path.display()
        )));
    }
    Ok(())
}
