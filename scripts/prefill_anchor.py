#!/usr/bin/env python3
"""Compute anchors for examples/prefill_bench.rs, measured on the same GPU in the same call.

- the bf16 matrix-product rate (torch.matmul, 8192^3, random data): the compute ceiling;
- PyTorch's fused causal SDPA (flash / cuDNN backends as PyTorch picks them) on dense bf16
  Q/K/V with Llama-3-8B heads (32 q / 8 KV, head_dim 128, GQA), for the prompt shapes of the
  bench, TFLOP/s counting causal FLOPs once (4 * head_dim per visible pair and query head).

Times are CUDA-event medians (triton.testing.do_bench).

    python3 scripts/prefill_anchor.py
"""
import torch
import triton.testing as tt


def main():
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    ms = tt.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    print(f"bf16 matmul {n}^3: {2 * n**3 / ms / 1e9:.0f} TFLOP/s ({ms * 1e3:.0f} us)")
    del a, b
    hq, hkv, d = 32, 8, 128
    print("| shape | torch SDPA causal bf16 (us) | TFLOP/s |")
    print("|---|---:|---:|")
    for name, batch, nq, nk in [("prompt 4k, B=1", 1, 4096, 4096), ("prompt 4k, B=4", 4, 4096, 4096)]:
        q = torch.randn(batch, hq, nq, d, device=dev, dtype=torch.bfloat16) * 0.25
        k = torch.randn(batch, hkv, nk, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(batch, hkv, nk, d, device=dev, dtype=torch.bfloat16)
        f = lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        ms = tt.do_bench(f, warmup=25, rep=200, return_mode="median")
        pairs = batch * nq * (nq + 1) / 2
        print(f"| {name} | {ms * 1e3:.0f} | {4 * d * hq * pairs / ms / 1e9:.0f} |")


if __name__ == "__main__":
    main()
