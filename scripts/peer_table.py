#!/usr/bin/env python3
"""The bracket's table from what `gpu-check.sh peers` leaves in its output folder: kvq's two
grids (decode_bench.json, grid2/decode_bench.json), the peers (peers.json) and the reads
(read_ceiling*.log), one markdown row per grid shape.

    python3 scripts/peer_table.py DIR

Cells: µs (kvq: first / second grid) and, in brackets, % of the higher of kvq's probe and
Triton's read in the same call (kvq: the range over its two grids); "—" where a peer was not run
or refused the shape. No GPU needed.
"""

import json
import re
import sys
from pathlib import Path

# (column, source, K / kind, V / KV dtype)
COLUMNS = [
    ("kvq bf16", "kvq", "bf16", "bf16"),
    ("FlashInfer bf16", "fi", "bf16", None),
    ("XQA bf16", "xqa", "bf16", None),
    ("cuDNN bf16 dense", "cudnn-dense", "bf16", None),
    ("kvq fp8", "kvq", "fp8-e4m3", "fp8-e4m3"),
    ("FlashInfer fp8", "fi", "fp8", None),
    ("XQA fp8", "xqa", "fp8", None),
    ("kvq int4", "kvq", "int4-k32", "int4-v64"),
]


def main():
    d = Path(sys.argv[1])
    grids = [json.loads((d / p).read_text()) for p in ("decode_bench.json", "grid2/decode_bench.json")]
    reads = {f"grid {i + 1}'s probe": g["ceiling_gbps"] for i, g in enumerate(grids)}
    for log in sorted(d.glob("read_ceiling*.log")):
        for x in re.findall(r"^BEST (\S+) ([\d.]+)", log.read_text(), re.M):
            reads[x[0]] = float(x[1])
    ceiling = max(reads.values())
    peers = json.loads((d / "peers.json").read_text())["rows"]
    print(f"{grids[0]['device']}: reads (GB/s) " + ", ".join(f"{k} {v:.1f}" for k, v in reads.items())
          + f"; the ceiling used {ceiling:.0f}\n")

    def shape(r):
        return r["case"], r["batch"], r["context_len"]

    kvq = {}
    for g in grids:
        for r in g["rows"]:
            kvq.setdefault(shape(r) + (r["k_format"], r["v_format"]), []).append(r)
    peer = {shape(r) + (r["peer"], r["kv"]): r for r in peers if "us" in r}
    pct = lambda nbytes, us: 100 * nbytes / us / 1e3 / ceiling  # noqa: E731

    print("| shape | " + " | ".join(c[0] for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    shapes = list(dict.fromkeys(shape(r) for r in grids[0]["rows"]))
    for s in shapes:
        cells = []
        for _, source, a, b in COLUMNS:
            if source == "kvq":
                rs = kvq.get(s + (a, b), [])
                ps = sorted(pct(r["bytes"], r["median_us"]) for r in rs)
                cells.append(" / ".join(f"{r['median_us']:.1f}" for r in rs) +
                             f" ({ps[0]:.1f}-{ps[-1]:.1f})" if rs else "—")
            else:
                r = peer.get(s + (source, a))
                cells.append(f"{r['us']:.1f} ({pct(r['bytes'], r['us']):.1f})" if r else "—")
        print(f"| {s[0]} B={s[1]} L={s[2] // 1024}k | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
