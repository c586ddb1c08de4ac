#!/usr/bin/env python3
"""Independent cross-check of kvq's streaming-read ceiling (examples/read_ceiling.rs).

Reads the same kind of buffer as the crate's probe (4 GiB of 32-bit words seed + i * 0x9E3779B9,
as kvq_stream_fill writes them) with a sweep of Triton streaming-read kernels (tile size, warps,
loads in flight; one tile per program, and persistent grids of SMs x k), with torch's x.sum() and
with a torch device-to-device copy. Every read kernel's checksum (word sum mod 2^32) is compared
with the closed form, so a kernel that skips bytes cannot win. Timing: CUDA events around each
run, the L2 flushed before each by *reading* a 256 MiB buffer (a write would leave dirty lines
whose write-back lands in the timed run), rounds x reps runs after a warm-up, median.

    python3 scripts/read_ceiling.py [--gib 4] [--rounds 3] [--reps 11] [--json OUT]

Prints a table and last `BEST <kernel> <GB/s>` (read kernels only; the copy is listed apart).
Needs torch and triton with a CUDA GPU; `--device cpu` under TRITON_INTERPRET=1 only tests the
script itself (tiny buffers, wall-clock times).
"""

import argparse
import json
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

FILL_STEP = 0x9E3779B9  # KVQ_STREAM_FILL_STEP in cuda/kvq.h
SEED = 0x6B767121  # the seed kvq::cuda::bench::read_ceiling fills with
FLUSH_BYTES = 256 << 20


@triton.jit
def read_tiles(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr, EVEN: tl.constexpr,
               EVICT_FIRST: tl.constexpr):
    """One tile of BLOCK * ITERS words per program (ITERS loads of BLOCK issued before use)."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * (BLOCK * ITERS)
    base = x_ptr + start  # 64-bit base once; per-element offsets stay 32-bit
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.uint32)  # unsigned: wraps mod 2^32 everywhere
    for i in tl.static_range(ITERS):
        if EVEN:
            if EVICT_FIRST:
                v = tl.load(base + i * BLOCK + offs, eviction_policy="evict_first")
            else:
                v = tl.load(base + i * BLOCK + offs)
        else:
            rem = tl.minimum(n - start, BLOCK * ITERS).to(tl.int32)
            v = tl.load(base + i * BLOCK + offs, mask=i * BLOCK + offs < rem, other=0)
        acc += v.to(tl.uint32, bitcast=True)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def read_persistent(x_ptr, out_ptr, n_tiles, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Programs loop over tiles pid, pid + grid, ... (n_tiles * BLOCK * ITERS == n)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.uint32)
    for t in tl.range(pid, n_tiles, nprog):
        base = x_ptr + t.to(tl.int64) * (BLOCK * ITERS)
        for i in tl.static_range(ITERS):
            acc += tl.load(base + i * BLOCK + offs).to(tl.uint32, bitcast=True)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0).to(tl.int32, bitcast=True))


def word_sum(words, seed=SEED):
    """Sum mod 2^32 of words seed + i * FILL_STEP, i < words (kvq's probe::fill_word_sum)."""
    return (words * seed + FILL_STEP * (words * (words - 1) // 2)) % (1 << 32)


def fill(x, seed=SEED):
    """x (int32) = seed + i * FILL_STEP (mod 2^32), in chunks to bound the int64 temporaries."""
    n = x.numel()
    chunk = 1 << 26
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        v = (torch.arange(a, b, dtype=torch.int64, device=x.device) * FILL_STEP + seed) & 0xFFFFFFFF
        x[a:b] = (v - ((v >> 31) << 32)).to(torch.int32)


class Timer:
    """Median-ready times in seconds of fn, each run after a flush; CUDA events on a GPU."""

    def __init__(self, device, flush):
        self.device = device
        self.flush = flush

    def times(self, fn, reps, warmup=1):
        for _ in range(warmup):
            fn()
        if self.device.type != "cuda":
            out = []
            for _ in range(reps):
                self.flush()
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return out
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
        for s, e in ev:
            self.flush()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in ev]


def triton_configs(words, sms, interpret):
    """(name, launch(x) -> partials) for the sweep: tiles x warps x loads in flight."""
    configs = []
    # One tile per program: ITERS loads of BLOCK words, issued before any is summed; 8..64 words
    # (2..16 16-byte loads) per thread. ptxas decides how many are in flight at once (the sums
    # let it reuse registers early); the sweep covers the shapes, not the schedule.
    for block, warps, iters in [
        (1024, 4, 1), (1024, 4, 4), (2048, 4, 2), (2048, 8, 4), (4096, 4, 1), (4096, 4, 2),
        (4096, 8, 1), (4096, 8, 4), (8192, 8, 1), (8192, 8, 2), (16384, 8, 1), (8192, 16, 4),
    ]:
        per_thread = block * iters // (32 * warps)
        if not 4 <= per_thread <= 64:
            continue
        tile = block * iters
        even = words % tile == 0
        grid = triton.cdiv(words, tile)
        for evict in ([False, True] if (block, warps, iters) == (4096, 8, 4) else [False]):
            name = f"triton-b{block}-w{warps}-i{iters}" + ("-evict" if evict else "")

            def launch(x, block=block, warps=warps, iters=iters, even=even, grid=grid,
                       evict=evict):
                out = torch.empty(grid, dtype=torch.int32, device=x.device)
                kw = {} if interpret else {"num_warps": warps}
                read_tiles[(grid,)](x, out, words, BLOCK=block, ITERS=iters, EVEN=even,
                                    EVICT_FIRST=evict, **kw)
                return out

            configs.append((name, launch, per_thread))
    # Persistent grids of SMs x k programs (Triton's interpreter cannot run a loop that starts
    # at the program id, so the script test leaves them out).
    for block, warps, iters, k in [(4096, 8, 4, 2), (4096, 8, 2, 4), (2048, 4, 2, 8)]:
        tile = block * iters
        if words % tile or interpret:
            continue
        grid = min(sms * k, words // tile)
        name = f"triton-persistent-b{block}-w{warps}-i{iters}-k{k}"

        def launch(x, block=block, warps=warps, iters=iters, grid=grid, tile=tile):
            out = torch.empty(grid, dtype=torch.int32, device=x.device)
            kw = {} if interpret else {"num_warps": warps}
            read_persistent[(grid,)](x, out, words // tile, BLOCK=block, ITERS=iters, **kw)
            return out

        configs.append((name, launch, block * iters // (32 * warps)))
    return configs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="buffer size (default 4 GiB)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all kernels")
    ap.add_argument("--reps", type=int, default=11, help="timed runs per kernel and round")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu only tests the script")
    args = ap.parse_args()

    t_start = time.perf_counter()
    device = torch.device(args.device)
    interpret = device.type != "cuda"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("read_ceiling.py: no CUDA device")
        props = torch.cuda.get_device_properties(device)
        sms, dev_name = props.multi_processor_count, props.name
        flush_bytes = FLUSH_BYTES
    else:
        sms, dev_name, flush_bytes = 4, "cpu (script test only)", 1 << 16
    bytes_ = max(64, int(args.gib * (1 << 30)) // 64 * 64)
    words = bytes_ // 4
    x = torch.empty(words, dtype=torch.int32, device=device)
    fill(x)
    expected = word_sum(words)
    flush_buf = torch.ones(flush_bytes // 4, dtype=torch.int32, device=device)
    timer = Timer(device, lambda: flush_buf.sum())
    print(f"device: {dev_name} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}")
    print(f"buffer: {bytes_ / (1 << 30):.2f} GiB of int32 (kvq_stream_fill's sequence); "
          f"{args.rounds} rounds x {args.reps} timed runs per kernel after a warm-up, L2 flushed "
          f"by reading {flush_bytes >> 20} MiB before each, "
          f"{'CUDA events' if device.type == 'cuda' else 'wall clock'}, median")

    # Read kernels: (name, fn, check(result) -> bool, note)
    kernels = []
    for name, launch, per_thread in triton_configs(words, sms, interpret):
        kernels.append((name, launch,
                        lambda out: int(out.to(torch.int64).sum().item()) % (1 << 32) == expected,
                        f"{per_thread} words per thread per tile"))
    kernels.append(("torch-sum", lambda x: x.sum(),
                    lambda s: int(s.item()) % (1 << 32) == expected, "x.sum() (int64 result)"))

    results = []
    live = []
    for name, fn, check, note in kernels:
        try:
            ok = check(fn(x))
        except Exception as e:  # a config this Triton / GPU cannot build: skip it, say why
            results.append({"name": name, "note": f"failed: {type(e).__name__}: {e}"[:200]})
            continue
        if ok:
            live.append((len(results), fn))
        results.append({"name": name, "note": note if ok else "WRONG CHECKSUM", "times": []})
    for _ in range(max(1, args.rounds)):
        for at, fn in live:
            results[at]["times"] += timer.times(lambda fn=fn: fn(x), max(1, args.reps))
    for r in results:
        t = r.pop("times", [])
        if t:
            r["gbps"] = bytes_ / statistics.median(t) / 1e9
            r["slowest_gbps"] = bytes_ / max(t) / 1e9
            r["fastest_gbps"] = bytes_ / min(t) / 1e9

    # Device copy: bytes read and written, reported apart from the reads.
    dst = torch.empty_like(x)
    t = []
    for _ in range(max(1, args.rounds)):
        t += timer.times(lambda: dst.copy_(x), max(1, args.reps))
    copy = {"name": "torch-copy", "read_bytes": bytes_, "written_bytes": bytes_,
            "read_plus_write_gbps": 2 * bytes_ / statistics.median(t) / 1e9,
            "matches": bool(torch.equal(dst[:1 << 20], x[:1 << 20]))}
    del dst

    timed = [r for r in results if "gbps" in r]
    if not timed:
        sys.exit("read_ceiling.py: no read kernel passed its checksum")
    best = max(timed, key=lambda r: r["gbps"])
    print("\n| kernel | median GB/s | slowest | fastest | % of best | note |")
    print("|---|---:|---:|---:|---:|---|")
    for r in results:
        if "gbps" in r:
            print(f"| {r['name']} | {r['gbps']:.0f} | {r['slowest_gbps']:.0f} | "
                  f"{r['fastest_gbps']:.0f} | {100 * r['gbps'] / best['gbps']:.1f} | {r['note']} |")
        else:
            print(f"| {r['name']} | - | - | - | - | {r['note']} |")
    print(f"\ntorch-copy: {copy['read_bytes'] / (1 << 30):.2f} GiB read + "
          f"{copy['written_bytes'] / (1 << 30):.2f} GiB written: "
          f"{copy['read_plus_write_gbps']:.0f} GB/s (read + write)")
    bad = [r["name"] for r in results if r.get("note") == "WRONG CHECKSUM"]
    if bad:
        print(f"CHECK FAILED: {', '.join(bad)} read the wrong bytes (left out)")
    print(f"elapsed {time.perf_counter() - t_start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev_name, "sms": sms, "bytes": bytes_, "rounds": args.rounds,
                       "reps": args.reps, "kernels": results, "copy": copy,
                       "best": {"name": best["name"], "gbps": best["gbps"]}}, f, indent=2)
    print(f"BEST {best['name']} {best['gbps']:.1f}")
    return 3 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
