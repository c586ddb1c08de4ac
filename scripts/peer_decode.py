#!/usr/bin/env python3
"""The peers beside kvq's decode grid, at the shapes of `kvq::cuda::bench::standard_grid`:
torch's cuDNN SDPA (bf16, q_len 1, contiguous K/V, so no block table) always; FlashInfer's
tensor-core paged decode and TensorRT-LLM's XQA through FlashInfer (bf16 and FP8 E4M3 caches,
pages of 16 scattered through a random block table) where `flashinfer` imports.

    python3 scripts/peer_decode.py [--ceiling GBPS] [--iters 30] [--json OUT] [--peers cudnn,fi,xqa]

Timing as kvq's grid: the L2 flushed before each run by *reading* a 256 MiB buffer, CUDA events
around one call, median; the GPU is kept busy (a spin of ~0.1 ms after the flush) while the
host queues the call, so a peer's Python-side launch cost does not count as GPU time. Bytes =
K + V + q (+ the block-table entries used, for the paged peers), as
`kvq::report::decode_bytes_to_read` counts them. With `--ceiling` (e.g. the best read of
scripts/read_ceiling.py in the same call) each row also gets its % of it. A shape a backend
refuses (or was not built for) is printed as such; each paged peer is first checked against an
f32 reference on a small batch of mixed lengths, and a peer that fails the check is not timed.

FlashInfer and XQA need FlashInfer 0.7.2 with its kernels prebuilt for sm_90a (the GPU machine
cannot compile them in the time it is lent): `scripts/stage-flashinfer.sh` says how the carry is
made and installed. Built for pages of 16 and bf16 queries; FlashInfer for head_dim 64, 128 and
256 (any GQA group), XQA for head_dim 128 and groups 1, 4 and 6: the grid's shapes.
"""

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from peer_common import (DEV, PAGE, have_flashinfer, parse_args, random_cache, scattered_pages,
                         start, time_us, write_json)

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


class Paged:
    """A paged cache of `lens` tokens per sequence, pages scattered by a random permutation."""

    def __init__(self, lens, hq, hkv, d, kv_dtype, layout, seed=7):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.lens, self.hq, self.hkv, self.d = lens, hq, hkv, d
        self.indptr, self.indices, self.last, total = scattered_pages(lens, seed)
        per = self.indptr.diff().tolist()  # pages per sequence
        self.tables = torch.zeros(len(lens), max(per), dtype=torch.int32)
        for b in range(len(lens)):
            self.tables[b, : per[b]] = self.indices[self.indptr[b] : self.indptr[b + 1]]
        shape = (total, 2, PAGE, hkv, d) if layout == "NHD" else (total, 2, hkv, PAGE, d)
        self.kv = random_cache(shape, kv_dtype, g)
        self.layout = layout
        self.q = (torch.randn(len(lens), hq, d, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
        self.indptr, self.indices = self.indptr.to(DEV), self.indices.to(DEV)
        self.last, self.tables = self.last.to(DEV), self.tables.to(DEV)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        self.used_pages = total

    def reference(self):
        """Attention in f32 from the cache's own (dequantized) values."""
        q, kv = self.q.float(), self.kv.float()
        out = torch.empty_like(q)
        group = self.hq // self.hkv
        for b, n in enumerate(self.lens):
            pages = self.tables[b, : math.ceil(n / PAGE)].long()
            side = lambda i: (  # noqa: E731
                kv[pages, i] if self.layout == "NHD" else kv[pages, i].transpose(1, 2)
            ).reshape(-1, self.hkv, self.d)[:n].repeat_interleave(group, dim=1)
            s = torch.einsum("hd,lhd->hl", q[b], side(0)) / math.sqrt(self.d)
            out[b] = torch.einsum("hl,lhd->hd", s.softmax(-1), side(1))
        return out


def fi_run(c, ws):
    """FlashInfer's tensor-core decode (bf16 query: its fa2 paged kernel) over cache `c`."""
    import flashinfer

    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, c.layout, use_tensor_cores=True)
    w.plan(c.indptr, c.indices, c.last, c.hq, c.hkv, c.d, PAGE,
           q_data_type=torch.bfloat16, kv_data_type=c.kv.dtype)
    return lambda: w.run(c.q, c.kv)


def xqa_run(c, ws):
    """TensorRT-LLM's XQA through FlashInfer over cache `c` (in its default layout, HND)."""
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    return lambda: trtllm_batch_decode_with_kv_cache(
        c.q, c.kv, ws, c.tables, c.seq_lens, max(c.lens),
        bmm1_scale=1.0 / math.sqrt(c.d), bmm2_scale=1.0, kv_layout=c.layout, backend="xqa")


# name -> (runner, the cache layout it takes)
PAGED = {"fi": (fi_run, "NHD"), "xqa": (xqa_run, "HND")}
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def check(name, kv, hq, hkv, d, ws):
    """A paged peer against the f32 reference on mixed lengths: (max |error| of each sequence
    over that sequence's largest |output|, worst sequence)."""
    run, layout = PAGED[name]
    c = Paged([1, 17, 300, 1024, 4097], hq, hkv, d, KV_DTYPES[kv], layout, seed=3)
    out, ref = run(c, ws)().float(), c.reference()
    per_seq = (out - ref).abs().amax(dim=(1, 2)) / ref.abs().amax(dim=(1, 2))
    return per_seq.max().item()


def main():
    a = parse_args("cudnn,fi,xqa", 30)
    peers = a.peers.split(",")
    flush = start()
    paged = [p for p in peers if p in PAGED]
    if paged and not have_flashinfer():
        paged = []
    ws = {p: torch.zeros(128 << 20, dtype=torch.uint8, device=DEV) for p in paged}
    usable = {}  # (peer, kv, q heads, kv heads, head_dim) -> passed its check
    for p in paged:
        for kv in KV_DTYPES:
            for hq, hkv, d in dict.fromkeys((hq, hkv, d) for _, _, _, hq, hkv, d in GRID):
                try:
                    err = check(p, kv, hq, hkv, d, ws[p])
                    # bf16 outputs err by a few of their ulps (0.4-0.7 %); XQA's FP8 kernel
                    # also rounds q and P to E4M3 (3.6-3.8 %); a broken kernel errs by O(1).
                    ok = err < 0.1
                    print(f"check {p} {kv} {hq}/{hkv} d={d}: max |err| / max |out| {err:.4f} "
                          f"{'ok' if ok else 'WRONG'}")
                except Exception as e:  # noqa: BLE001 - refused or not built: reported, skipped
                    ok = False
                    print(f"check {p} {kv} {hq}/{hkv} d={d}: refused: "
                          f"{str(e).splitlines()[0][:100]}")
                usable[(p, kv, hq, hkv, d)] = ok
    print("| case | B | L | heads q/kv | d | peer | KV | µs | GB/s | % ceiling |")
    print("|---|---:|---:|---|---:|---|---|---:|---:|---:|")
    rows = []

    def report(row, us, nbytes):
        gbps = nbytes / us / 1e3
        pct = f"{100 * gbps / a.ceiling:.1f}" if a.ceiling else ""
        print(f"| {row['case']} | {row['batch']} | {row['context_len']} | {row['q_heads']}/"
              f"{row['kv_heads']} | {row['head_dim']} | {row['peer']} | {row['kv']} | {us:.1f} | "
              f"{gbps:.0f} | {pct} |")
        row.update(us=us, gbps=gbps, bytes=nbytes)

    def refused(row, why):
        print(f"| {row['case']} | {row['batch']} | {row['context_len']} | {row['q_heads']}/"
              f"{row['kv_heads']} | {row['head_dim']} | {row['peer']} | {row['kv']} | "
              f"refused: {why[:60]} | | |")
        row["error"] = why

    for case, b, l, hq, hkv, d in GRID:
        shape = dict(case=case, batch=b, context_len=l, q_heads=hq, kv_heads=hkv, head_dim=d)
        if "cudnn" in peers:
            row = dict(shape, peer="cudnn-dense", kv="bf16")
            g = torch.Generator(device=DEV).manual_seed(7)
            mk = lambda h, n: torch.randn(b, h, n, d, device=DEV, dtype=torch.bfloat16, generator=g)  # noqa: E731
            q, k, v = mk(hq, 1), mk(hkv, l), mk(hkv, l)

            def run():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv)

            try:
                report(row, time_us(run, flush, a.iters), 2 * b * hkv * l * d * 2 + b * hq * d * 2)
            except RuntimeError as e:
                refused(row, str(e).splitlines()[0])
            rows.append(row)
            del q, k, v
            torch.cuda.empty_cache()
        for p in paged:
            for kv, dt in KV_DTYPES.items():
                row = dict(shape, peer=p, kv=kv)
                if not usable.get((p, kv, hq, hkv, d), False):
                    refused(row, "not built or failed its check")
                    rows.append(row)
                    continue
                try:
                    c = Paged([l] * b, hq, hkv, d, dt, PAGED[p][1])
                    fn = PAGED[p][0](c, ws[p])
                    nbytes = 2 * b * hkv * l * d * dt.itemsize + b * hq * d * 2 + c.used_pages * 4
                    report(row, time_us(fn, flush, a.iters), nbytes)
                    del c, fn
                except Exception as e:  # noqa: BLE001 - a refusal is a result
                    refused(row, str(e).splitlines()[0])
                rows.append(row)
                torch.cuda.empty_cache()
    write_json(a.json, a.ceiling, rows)


if __name__ == "__main__":
    main()
