"""What the peer scripts (peer_decode.py, peer_prefill.py) share: the device, the page size,
their command line, and the timing of one call as kvq's benches time theirs."""

import argparse
import json
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
