#!/usr/bin/env python3
"""The peers beside kvq's prefill grid (examples/prefill_bench.rs), at its shapes: Llama-3-8B
heads (32 q / 8 KV, head_dim 128), pages of 16 scattered through a random block table, bf16
queries and output, causal with each sequence's new tokens at the end of its keys (query i of n
sees the keys up to len - n + i, as kvq and FlashInfer align it).

    python3 scripts/peer_prefill.py [--ceiling GBPS] [--iters 20] [--json OUT] [--peers cudnn,fa2,fa3]

Peers: torch's cuDNN SDPA over dense bf16 K/V (no pages, no table; the prompt shapes only, where
its top-left causal mask is the same as the bottom-right one), and where `flashinfer` imports,
FlashInfer 0.7.2's BatchPrefillWithPagedKVCacheWrapper: backend fa2 over bf16 and FP8 E4M3
caches (bf16 queries), backend fa3 over a bf16 cache, and fa3 over an FP8 cache with FP8 queries
(FP8 tensor cores: another precision, shown for reference; fa3 takes an FP8 cache only so).
FlashInfer's kernels come prebuilt for sm_90a (scripts/stage-flashinfer.sh). Each FlashInfer
backend is first checked against an f32 reference on a small ragged batch; one that fails is
not timed.

Timing as peer_decode.py (L2 flushed by a 256 MiB read, the GPU kept busy while the host queues
the call, CUDA events, median). TFLOP/s count causal FLOPs once (4 * head_dim per visible
(query, key) pair and query head), as prefill_bench does; GB/s count K, V, q and the table
entries used, and with --ceiling (the best read of scripts/read_ceiling.py in the same call)
each row gets its % of it, which matters for the memory-bound extend shapes.
"""

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from peer_common import (DEV, PAGE, have_flashinfer, parse_args, random_cache, scattered_pages,
                         start, time_us, write_json)

HQ, HKV, D = 32, 8, 128


# (name, [(new tokens, context) per sequence]): prefill_bench's shapes, less its routed one.
GRID = [
    ("prompt 4k, B=1", [(4096, 4096)]),
    ("prompt 4k, B=4", [(4096, 4096)] * 4),
    ("2k chunk after 30k, B=1", [(2048, 32768)]),
    ("extend 16 after 16k, B=32", [(16, 16384)] * 32),
    ("extend 64 after 16k, B=8", [(64, 16384)] * 8),
    ("extend 16 after 128k, B=1", [(16, 131072)]),
    ("mixed: 63 decodes after 16k + 1k chunk", [(1, 16384)] * 63 + [(1024, 4096)]),
]
FP8 = torch.float8_e4m3fn
# name -> (FlashInfer backend, query dtype, cache dtype)
FI = {
    "fa2 bf16": ("fa2", torch.bfloat16, torch.bfloat16),
    "fa2 bf16 q, fp8 KV": ("fa2", torch.bfloat16, FP8),
    "fa3 bf16": ("fa3", torch.bfloat16, torch.bfloat16),
    "fa3 fp8 q + KV": ("fa3", FP8, FP8),
}


def pairs(seqs):
    """Visible (query, key) pairs of a causal step."""
    return sum(n * (l - n) + n * (n + 1) / 2 for n, l in seqs)


class Paged:
    """A step over a paged cache: per sequence `n` new tokens (q rows) after `l - n` cached ones,
    its `l` keys in pages scattered by a random permutation (NHD: [pages, 2, PAGE, kv heads, d])."""

    def __init__(self, seqs, q_dtype, kv_dtype, seed=7):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.seqs = seqs
        lens = [l for _, l in seqs]
        self.kv_indptr, self.indices, self.last, total = scattered_pages(lens, seed)
        self.qo_indptr = torch.tensor([0] + list(torch.tensor([n for n, _ in seqs]).cumsum(0)),
                                      dtype=torch.int32)
        self.kv = random_cache((total, 2, PAGE, HKV, D), kv_dtype, g)
        rows = int(self.qo_indptr[-1])
        self.q = (torch.randn(rows, HQ, D, device=DEV, generator=g) * 0.5).to(q_dtype)
        self.used_pages = total
        self.qo_indptr, self.kv_indptr = self.qo_indptr.to(DEV), self.kv_indptr.to(DEV)
        self.indices, self.last = self.indices.to(DEV), self.last.to(DEV)

    def reference(self):
        """Attention in f32 from the step's own (rounded) q and cache values."""
        q, kv = self.q.float(), self.kv.float()
        out = torch.empty_like(q)
        group = HQ // HKV
        for b, (n, l) in enumerate(self.seqs):
            pages = self.indices[self.kv_indptr[b] : self.kv_indptr[b + 1]].long()
            side = lambda i: kv[pages, i].reshape(-1, HKV, D)[:l].repeat_interleave(group, dim=1)  # noqa: E731
            q0 = int(self.qo_indptr[b])
            s = torch.einsum("qhd,lhd->hql", q[q0 : q0 + n], side(0)) / math.sqrt(D)
            keys = torch.arange(l, device=DEV)
            seen = keys[None, :] <= (l - n + torch.arange(n, device=DEV))[:, None]
            s = s.masked_fill(~seen[None], float("-inf"))
            out[q0 : q0 + n] = torch.einsum("hql,lhd->qhd", s.softmax(-1), side(1))
        return out


def fi_run(name, c, ws):
    """FlashInfer's paged prefill (`name` in FI) over step `c`, planned once."""
    import flashinfer

    backend, q_dtype, kv_dtype = FI[name]
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(c.qo_indptr, c.kv_indptr, c.indices, c.last, HQ, HKV, D, PAGE, causal=True,
           q_data_type=q_dtype, kv_data_type=kv_dtype, o_data_type=torch.bfloat16)
    return lambda: w.run(c.q, c.kv)


def check(name, ws):
    """A FlashInfer backend against the f32 reference on a ragged step: max |error| of each
    sequence over that sequence's largest |output|, worst sequence."""
    _, q_dtype, kv_dtype = FI[name]
    c = Paged([(1, 17), (33, 300), (100, 100), (16, 1024), (200, 4097)], q_dtype, kv_dtype, seed=3)
    out, ref = fi_run(name, c, ws)().float(), c.reference()
    worst = 0.0
    for b, (n, _) in enumerate(c.seqs):
        q0 = int(c.qo_indptr[b])
        o, r = out[q0 : q0 + n], ref[q0 : q0 + n]
        worst = max(worst, ((o - r).abs().max() / r.abs().max()).item())
    return worst


def main():
    a = parse_args("cudnn,fa2,fa3", 20)
    peers = a.peers.split(",")
    flush = start()
    fi = [n for n, (backend, _, _) in FI.items() if backend in peers]
    if fi and not have_flashinfer():
        fi = []
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)
    usable = {}
    for name in fi:
        try:
            err = check(name, ws)
            # bf16 outputs err by a few of their ulps; FP8 queries round q (and fa3's P) to
            # E4M3, a few percent; a broken kernel errs by O(1).
            usable[name] = err < 0.1
            print(f"check {name}: max |err| / max |out| {err:.4f} "
                  f"{'ok' if usable[name] else 'WRONG'}")
        except Exception as e:  # noqa: BLE001 - refused or not built: reported, skipped
            usable[name] = False
            print(f"check {name}: refused: {str(e).splitlines()[0][:100]}")
    print("| shape | peer | µs | TFLOP/s | GB/s | % ceiling |")
    print("|---|---|---:|---:|---:|---:|")
    rows = []

    def report(row, us, flops, nbytes):
        gbps = nbytes / us / 1e3
        pct = f"{100 * gbps / a.ceiling:.1f}" if a.ceiling else ""
        print(f"| {row['shape']} | {row['peer']} | {us:.1f} | {flops / us / 1e6:.0f} | "
              f"{gbps:.0f} | {pct} |")
        row.update(us=us, tflops=flops / us / 1e6, gbps=gbps, bytes=nbytes)

    def refused(row, why):
        print(f"| {row['shape']} | {row['peer']} | refused: {why[:70]} | | | |")
        row["error"] = why

    for shape, seqs in GRID:
        flops = 4 * D * HQ * pairs(seqs)
        keys = sum(l for _, l in seqs)
        q_rows = sum(n for n, _ in seqs)
        if "cudnn" in peers and all(n == l for n, l in seqs):
            row = dict(shape=shape, peer="cudnn-dense bf16")
            b, n = len(seqs), seqs[0][0]
            g = torch.Generator(device=DEV).manual_seed(7)
            mk = lambda h: torch.randn(b, h, n, D, device=DEV, dtype=torch.bfloat16, generator=g) * 0.5  # noqa: E731
            q, k, v = mk(HQ), mk(HKV), mk(HKV)

            def run():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            try:
                report(row, time_us(run, flush, a.iters), flops,
                       2 * keys * HKV * D * 2 + q_rows * HQ * D * 2)
            except RuntimeError as e:
                refused(row, str(e).splitlines()[0])
            rows.append(row)
            del q, k, v
            torch.cuda.empty_cache()
        for name in fi:
            row = dict(shape=shape, peer=f"flashinfer {name}")
            if not usable[name]:
                refused(row, "not built or failed its check")
                rows.append(row)
                continue
            _, q_dtype, kv_dtype = FI[name]
            try:
                c = Paged(seqs, q_dtype, kv_dtype)
                fn = fi_run(name, c, ws)
                nbytes = (2 * keys * HKV * D * kv_dtype.itemsize + q_rows * HQ * D * q_dtype.itemsize
                          + c.used_pages * 4)
                report(row, time_us(fn, flush, a.iters), flops, nbytes)
                del c, fn
            except Exception as e:  # noqa: BLE001 - a refusal is a result
                refused(row, str(e).splitlines()[0])
            rows.append(row)
            torch.cuda.empty_cache()
    write_json(a.json, a.ceiling, rows)


if __name__ == "__main__":
    main()
