//! The crate's one error type. Every variant carries the values that were wrong, so a caller can
//! print it and know what to fix without a debugger.

use crate::format::KvFormat;

/// Errors returned by every fallible call in the crate.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// `head_dim` is not usable with a format (not a multiple of its group or vector width).
    #[error(
        "head_dim {head_dim} is not valid for {format}: it must be a positive multiple of {multiple}"
    )]
    HeadDim {
        head_dim: usize,
        format: KvFormat,
        multiple: usize,
    },
    /// A configuration value is out of its valid range.
    #[error("invalid {what}: {value} ({expected})")]
    Config {
        what: &'static str,
        value: usize,
        expected: &'static str,
    },
    /// A buffer or tensor has the wrong number of elements or bytes.
    #[error("{what}: expected {expected} elements, got {actual}")]
    Length {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A scale is not a positive finite f32.
    #[error("{what}: scale {value} must be positive and finite")]
    Scale { what: &'static str, value: f32 },
    /// Non-finite inputs met while quantizing with `strict` set.
    #[error("{count} non-finite input value(s) while quantizing {what}")]
    NonFinite { what: &'static str, count: u64 },
    /// The block pool has no free block left.
    #[error("out of cache blocks: need {needed}, {free} free of {total}")]
    OutOfBlocks {
        needed: usize,
        free: usize,
        total: usize,
    },
    /// A sequence id that the allocator does not know (never created, or already freed).
    #[error("unknown sequence id {0}")]
    UnknownSequence(u64),
    /// A block index outside the pool.
    #[error("block {block} is outside the pool of {num_blocks} blocks")]
    BlockIndex { block: usize, num_blocks: usize },
    /// A size product computed from the arguments (such as `head_dim × bits` or
    /// `tokens × (heads × head_dim)`) does not fit in `usize`, or exceeds the bytes one
    /// allocation can hold (`isize::MAX`, less where a sum of such products must fit too).
    #[error("{what}: {lhs} × {rhs} overflows the addressable size")]
    Overflow {
        what: &'static str,
        lhs: usize,
        rhs: usize,
    },
    /// Memory for a buffer of a valid size could not be allocated.
    #[error("cannot allocate {bytes} bytes for {what}")]
    Alloc { what: &'static str, bytes: usize },
    /// An index argument of an accessor is out of range.
    #[error("{what} {index} is out of range (there are {len})")]
    Index {
        what: &'static str,
        index: usize,
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
    /// A CUDA driver, runtime or kernel launch error (only with the `cuda` feature).
    #[error("cuda: {0}")]
    Cuda(String),
    /// The `cuda` feature is on but no usable GPU / driver was found.
    #[error("no CUDA device available: {0}")]
    NoDevice(String),
}

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

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
