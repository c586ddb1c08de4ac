"""What the peer scripts (peer_decode.py, peer_prefill.py) share: the device, the page size,
their command line, and the timing of one call as kvq's benches time theirs."""

import argparse
import json
import math
import statistics

import torch

PAGE = 16
DEV = "cuda"


def parse_args(peers, iters):
    """--ceiling, --iters, --json and --peers (default `peers`, a comma-separated list)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ceiling", type=float, help="read ceiling in GB/s for the % column")
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--peers", default=peers, help=f"comma-separated: {peers.replace(',', ', ')}")
    return ap.parse_args()


def start():
    """Print the device and its libraries; return the buffer whose read flushes the L2."""
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    return torch.ones(256 << 20 >> 2, device=DEV, dtype=torch.int32)


def have_flashinfer():
    """Whether FlashInfer imports (its version printed), else why not."""
    try:
        import flashinfer

        print(f"flashinfer {flashinfer.__version__}")
        return True
    except Exception as e:  # noqa: BLE001 - any import failure means: no FlashInfer peers
        print(f"flashinfer unavailable ({type(e).__name__}: {str(e)[:120]}): cuDNN only")
        return False


def time_us(fn, flush, iters):
    """Median GPU time of fn() in µs over `iters` runs, each after an L2 flush (a read of
    `flush`) and ~0.1 ms of GPU spin, so that the host's launch cost is not timed."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        flush.sum()
        torch.cuda._sleep(200_000)  # ~0.1 ms of GPU time while the host queues the call
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(ts)


def write_json(path, ceiling, rows):
    """The rows, with the device and the ceiling they were measured against, to `path` (if any)."""
    if path:
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), ceiling=ceiling, rows=rows), f,
                      indent=1)


def scattered_pages(lens, seed):
    """Pages for sequences of `lens` tokens, scattered by a random permutation: the pages'
    indptr and indices, each last page's length, and the page count (int32 tensors on the CPU)."""
    per = [math.ceil(n / PAGE) for n in lens]
    total = sum(per)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    indptr = torch.tensor([0] + list(torch.tensor(per).cumsum(0)), dtype=torch.int32)
    last = torch.tensor([(n - 1) % PAGE + 1 for n in lens], dtype=torch.int32)
    return indptr, perm.to(torch.int32), last, total


def random_cache(shape, dtype, g):
    """A cache of `shape` (pages first) of N(0, 0.25) values drawn from generator `g`, filled in
    slices: a bf16 cache of B=64 L=16k is 4.3 GB, its f32 source twice that."""
    kv = torch.empty(shape, device=DEV, dtype=dtype)
    for s in range(0, shape[0], 4096):
        n = min(4096, shape[0] - s)
        draw = torch.randn((n,) + tuple(shape[1:]), device=DEV, generator=g)
        kv[s : s + n] = (draw * 0.5).to(dtype)
    return kv
