#!/usr/bin/env python3
"""The dense anchor beside kvq's decode grid: torch's cuDNN SDPA (bf16, q_len 1, contiguous K/V,
so no block table) at the shapes of `kvq::cuda::bench::standard_grid`.

    python3 scripts/peer_decode.py [--ceiling GBPS] [--iters 30] [--json OUT]

Timing as kvq's grid: the L2 flushed before each run by *reading* a 256 MiB buffer, CUDA events
around one call, median. Bytes = K + V + q, as `kvq::report::decode_bytes_to_read` counts for a
bf16 cache less its block table. With `--ceiling` (e.g. the best read of scripts/read_ceiling.py
in the same call) each row also gets its % of it. A shape the backend refuses is printed as such.
FlashInfer and TensorRT-LLM's XQA (../shared/docs/PEERS.md) need packages and cubins that the GPU
machine lacks and cannot fetch; this script is the part of the peer bracket that runs there.
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (case, batch, context, q heads, kv heads, head_dim): the standard grid.
GRID = [
    ("llama3-8b", 1, 4096, 32, 8, 128),
    ("llama3-8b", 16, 4096, 32, 8, 128),
    ("llama3-8b", 64, 4096, 32, 8, 128),
    ("llama3-8b", 64, 16384, 32, 8, 128),
    ("llama3-8b", 128, 8192, 32, 8, 128),
    ("llama3-8b", 8, 65536, 32, 8, 128),
    ("llama3-8b", 1, 32768, 32, 8, 128),
    ("llama3-8b", 1, 131072, 32, 8, 128),
    ("8x22b-tp8", 64, 16384, 6, 1, 128),
    ("mha-32", 32, 8192, 32, 32, 128),
    ("gqa-d64", 64, 16384, 32, 8, 64),
    ("gqa-d256", 32, 8192, 16, 4, 256),
]


def time_us(fn, flush, iters):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        flush.sum()
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ceiling", type=float, help="read ceiling in GB/s for the % column")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    dev = "cuda"
    flush = torch.ones(256 << 20 >> 2, device=dev, dtype=torch.int32)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print("| case | B | L | heads q/kv | d | cuDNN bf16 µs | GB/s | % ceiling |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    rows = []
    for case, b, l, hq, hkv, d in GRID:
        g = torch.Generator(device=dev).manual_seed(7)
        mk = lambda h, n: torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, generator=g)
        q, k, v = mk(hq, 1), mk(hkv, l), mk(hkv, l)

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv)

        row = dict(case=case, batch=b, context_len=l, q_heads=hq, kv_heads=hkv, head_dim=d)
        try:
            us = time_us(run, flush, a.iters)
        except RuntimeError as e:
            print(f"| {case} | {b} | {l} | {hq}/{hkv} | {d} | refused: {str(e).splitlines()[0][:60]} | | |")
            row["error"] = str(e).splitlines()[0]
            rows.append(row)
            continue
        nbytes = 2 * b * hkv * l * d * 2 + b * hq * d * 2
        gbps = nbytes / us / 1e3
        pct = f"{100 * gbps / a.ceiling:.1f}" if a.ceiling else ""
        print(f"| {case} | {b} | {l} | {hq}/{hkv} | {d} | {us:.1f} | {gbps:.0f} | {pct} |")
        row.update(us=us, gbps=gbps)
        rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), ceiling=a.ceiling, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
