//! GPU path (feature `cuda`): device cache, append / dequantize / fused decode kernels.
