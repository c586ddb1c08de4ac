//! Reference decode attention on the CPU: the oracle the GPU kernels are tested against.
