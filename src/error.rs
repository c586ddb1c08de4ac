//! The crate's one error type. Every variant carries the values that were wrong, so a caller can
//! print it and know what to fix without a debugger.

use crate::format::kind::KvFormat;

/// Errors returned by every fallible call in the crate.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// `head_dim` is not usable with a format (not a multiple of its group or vector width).
    #[error(
        "head_dim {head_dim} is not valid for {format}: it must be a positive multiple of {multiple}"
    )]
    HeadDim {
        /// The head_dim asked for.
        head_dim: usize,
        /// The format that cannot take it.
        format: KvFormat,
        /// What head_dim must be a multiple of.
        multiple: usize,
    },
    /// A configuration value is out of its valid range.
    #[error("invalid {what}: {value} ({expected})")]
    Config {
        /// The setting, e.g. `block_size`.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The range it must be in.
        expected: &'static str,
    },
    /// A buffer or tensor has the wrong number of elements or bytes (`what` says which, and
    /// whether `expected` is the exact count or the least that fits).
    #[error("{what}: expected {expected}, got {actual}")]
    Length {
        /// The buffer, with its shape.
        what: &'static str,
        /// The length it must have (or the least that fits, where `what` says so).
        expected: usize,
        /// The length it has.
        actual: usize,
    },
    /// A scale is not a positive finite f32.
    #[error("{what}: scale {value} must be positive and finite")]
    Scale {
        /// Whose scale.
        what: &'static str,
        /// The scale given.
        value: f32,
    },
    /// Non-finite values where finite ones are needed: inputs quantized with `strict` set,
    /// queries, sinks, slopes, or a reference result that overflowed.
    #[error("{count} non-finite value(s) in {what}")]
    NonFinite {
        /// Where they were met.
        what: &'static str,
        /// How many.
        count: u64,
    },
    /// Finite values beyond what a cache stores, met by a strict write: past f16's range (the
    /// sanitizer clamps them) or past an FP8 / FP4 side's head scale times its largest code
    /// (saturated: calibrate the scales first).
    #[error(
        "{count} value(s) in {what} saturate (beyond f16's range or a head scale's largest code)"
    )]
    Saturated {
        /// Where they were met.
        what: &'static str,
        /// How many.
        count: u64,
    },
    /// The block pool has no free block left.
    #[error("out of cache blocks: need {needed}, {free} free of {total}")]
    OutOfBlocks {
        /// Blocks the call needs.
        needed: usize,
        /// Blocks free now.
        free: usize,
        /// Blocks of the pool.
        total: usize,
    },
    /// A sequence id that the allocator does not know (never created, or already freed).
    #[error("unknown sequence id {0}")]
    UnknownSequence(u64),
    /// A block index outside the pool.
    #[error("block {block} is outside the pool of {num_blocks} blocks")]
    BlockIndex {
        /// The block id given.
        block: usize,
        /// Blocks of the pool.
        num_blocks: usize,
    },
    /// A size product computed from the arguments (such as `head_dim × bits` or
    /// `tokens × (heads × head_dim)`) does not fit in `usize`, or exceeds the bytes one
    /// allocation can hold (`isize::MAX`, less where a sum of such products must fit too).
    #[error("{what}: {lhs} × {rhs} overflows the addressable size")]
    Overflow {
        /// The size computed, as `a × b`.
        what: &'static str,
        /// Its first factor.
        lhs: usize,
        /// Its second factor.
        rhs: usize,
    },
    /// Memory for a buffer of a valid size could not be allocated.
    #[error("cannot allocate {bytes} bytes for {what}")]
    Alloc {
        /// The buffer.
        what: &'static str,
        /// Its size.
        bytes: usize,
    },
    /// An index argument of an accessor is out of range.
    #[error("{what} {index} is out of range (there are {len})")]
    Index {
        /// What was indexed.
        what: &'static str,
        /// The index given.
        index: usize,
        /// How many there are.
        len: usize,
    },
    /// An argument combination that is valid in general but not supported by this path.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Anything else about a caller's input, with a sentence that says what.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A safetensors file could not be read or written.
    #[error("safetensors: {0}")]
    SafeTensors(String),
    /// A CUDA failure with no driver or runtime code to keep (a launcher refusing arguments the
    /// host checks let through, a measurement that produced nothing). Calls that have a code
    /// return `Error::Driver` or `Error::Launch` (feature `cuda`).
    #[error("cuda: {0}")]
    Cuda(String),
    /// A CUDA driver call failed. The driver's code is kept (not flattened into a message) so an
    /// engine can tell running out of device memory from a bad launch or a lost context:
    /// [`Error::cuda_code`], [`Error::is_out_of_memory`]. `?` converts cudarc's
    /// [`DriverError`](cudarc::driver::DriverError) into this variant.
    #[cfg(feature = "cuda")]
    #[error("cuda: {what} failed: {code:?}")]
    Driver {
        /// What kvq was doing, e.g. `allocating the pool`.
        what: &'static str,
        /// The driver's status.
        code: cudarc::driver::sys::CUresult,
    },
    /// A kvq kernel launch failed: `code` is the CUDA runtime's `cudaError_t` (the runtime and
    /// driver number the errors they share alike: 2 is out of memory in both), `message` its
    /// text. A sticky error of earlier asynchronous work (an illegal address) surfaces here too.
    #[cfg(feature = "cuda")]
    #[error("cuda: {what}: kernel launch failed: {message} (cudaError_t {code})")]
    Launch {
        /// The kvq.h launcher, e.g. `kvq_append`.
        what: &'static str,
        /// The runtime's `cudaError_t`, as an integer.
        code: i32,
        /// `cudaGetErrorString` of `code`.
        message: String,
    },
    /// The `cuda` feature is on but no usable GPU / driver was found.
    #[error("no CUDA device available: {0}")]
    NoDevice(String),
    /// A layer of a multi-layer cache differs from what the cache was built with (a layer
    /// swapped in through `PagedKvCache::layers_mut`): writing it at the allocator's slots would
    /// put tokens at wrong positions. Also a layer of an all-layer GPU call
    /// (`kvq::cuda::copy_blocks_all`) that differs from layer 0 in shape or stream.
    #[error("layer {layer}: {what} is {actual}, the cache was built with {expected}")]
    LayerMismatch {
        /// The layer that differs.
        layer: usize,
        /// What differs, e.g. `config` or `stream`.
        what: &'static str,
        /// What the cache (or layer 0) has.
        expected: String,
        /// What this layer has.
        actual: String,
    },
}

/// `cudaErrorMemoryAllocation`, the runtime's code for running out of device memory (the same
/// number as the driver's `CUDA_ERROR_OUT_OF_MEMORY`).
#[cfg(feature = "cuda")]
const CUDA_RUNTIME_OUT_OF_MEMORY: i32 = 2;

#[cfg(feature = "cuda")]
impl Error {
    /// The driver's status of a failed driver call ([`Error::Driver`]), else `None`.
    pub fn cuda_code(&self) -> Option<cudarc::driver::sys::CUresult> {
        match self {
            Error::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The runtime's `cudaError_t` of a failed kvq kernel launch ([`Error::Launch`]), else
    /// `None`.
    pub fn launch_code(&self) -> Option<i32> {
        match self {
            Error::Launch { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether the device ran out of memory (a driver allocation or a launch). An engine may
    /// free cache blocks or shrink its batch and retry; any other CUDA error usually cannot be
    /// retried. Host allocation failures are [`Error::Alloc`], full pools
    /// [`Error::OutOfBlocks`]: neither counts here.
    pub fn is_out_of_memory(&self) -> bool {
        self.cuda_code() == Some(cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)
            || self.launch_code() == Some(CUDA_RUNTIME_OUT_OF_MEMORY)
    }
}

/// Keeps the driver's code: `?` on any cudarc call in a function returning [`Result`].
#[cfg(feature = "cuda")]
impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::Driver {
            what: "a CUDA driver call",
            code: e.0,
        }
    }
}

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// [`Error::Config`] naming the first of `sizes` that is 0 (each must be at least 1).
pub(crate) fn at_least_one(sizes: &[(&'static str, usize)]) -> Result<()> {
    match sizes.iter().find(|(_, value)| *value == 0) {
        Some(&(what, value)) => Err(Error::Config {
            what,
            value,
            expected: "at least 1",
        }),
        None => Ok(()),
    }
}

/// An empty vector with room for `n` elements, or [`Error::Alloc`] when the memory is not
/// there: a buffer of a valid size may still be more than the machine has, and running out must
/// be an error, not an abort.
pub(crate) fn reserved<T>(n: usize, what: &'static str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::Alloc {
        what,
        bytes: n.saturating_mul(size_of::<T>()),
    })?;
    Ok(v)
}

/// A vector of `n` copies of `value`, allocated as [`reserved`] does.
pub(crate) fn filled<T: Clone>(n: usize, value: T, what: &'static str) -> Result<Vec<T>> {
    let mut v = reserved(n, what)?;
    v.resize(n, value);
    Ok(v)
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use cudarc::driver::DriverError;
    use cudarc::driver::sys::CUresult;

    /// `?` on a cudarc call keeps the driver's code; no driver is needed to convert or print.
    #[test]
    fn driver_errors_keep_their_code() {
        fn alloc() -> Result<()> {
            Err(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY))?
        }
        let e = alloc().unwrap_err();
        assert_eq!(e.cuda_code(), Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert!(e.is_out_of_memory());
        assert_eq!(e.launch_code(), None);
        assert!(e.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY"), "{e}");
        assert_eq!(e.clone(), e);

        let bad = Error::from(DriverError(CUresult::CUDA_ERROR_INVALID_VALUE));
        assert!(!bad.is_out_of_memory());
        assert_ne!(bad, e);
    }

    #[test]
    fn launch_errors_keep_the_runtime_code() {
        let oom = Error::Launch {
            what: "kvq_append",
            code: 2,
            message: "out of memory".into(),
        };
        assert!(oom.is_out_of_memory());
        assert_eq!(oom.launch_code(), Some(2));
        assert_eq!(oom.cuda_code(), None);
        let illegal = Error::Launch {
            what: "kvq_decode",
            code: 700,
            message: "an illegal memory access was encountered".into(),
        };
        assert!(!illegal.is_out_of_memory());
        assert!(illegal.to_string().contains("700"), "{illegal}");
        // Errors without a code answer no to both.
        let other = Error::Cuda("no variant measured".into());
        assert!(!other.is_out_of_memory());
        assert_eq!((other.cuda_code(), other.launch_code()), (None, None));
    }
}
