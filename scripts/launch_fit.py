#!/usr/bin/env python3
"""Replay and refit the decode launch model (src/cuda/decode/heuristic.rs) on launch sweeps.

    python3 scripts/launch_fit.py SWEEP.md[@BPC]... [--extra MORE.md[@BPC]]... [--search N] [--seed S]

SWEEP.md (or .md.gz) is the output of `examples/decode_sweep.rs` (one markdown row per timed launch, `*` on
the plan's own): every (warps, stages) that fits at the split counts given to `--splits`, with
each launch's blocks per SM and stage bytes, the model's inputs. `--extra` adds rows of other
runs of the tool (e.g. `--launch` comparisons) for launches the sweeps did not time. BPC is the
device's peak memory bytes per SM cycle (`Machine` in heuristic.rs), read from the file's
device line where the tool printed one ("... 12.83 bytes per SM cycle"), else given after `@`,
else the reference H200's; groups of different devices are fitted together.

Prints, per (shape, format) group, the launch the model picks with the parameters below and its
regret (its time over the best timed launch); a pick at a split count the sweep did not time
is priced at the nearest count timed. With `--search N`, N random parameter sets and a
coordinate descent from the best, minimizing the mean log regret plus a fifth of the worst.

The model here must stay the one in heuristic.rs: `choose` mirrors `choose_launch`, `PARAMS`
its constants. Shapes it knows are the standard grid's (`CASES`, `HEAD_DIM`); add a case there
to fit on a new one. The session 24 fit (docs/PERFORMANCE.md), an H200 and an H100:

    python3 scripts/launch_fit.py docs/bench/launch_sweep.md.gz \
        docs/bench/launch_sweep_h100.md.gz@12.83 --extra docs/bench/launch_abba.md
"""

import argparse
import collections
import gzip
import math
import random
import re

SMS = 132
MAX_SPLITS = 256
MIN_SPLIT_TOKENS = 256
SPLIT_MULTIPLE = 32

# Bytes per element and bits of the formats as decode_sweep prints them.
BPE = {"bf16": 2.0, "f16": 2.0, "fp8-e4m3": 1.0, "fp8-e5m2": 1.0, "int4-k32": 0.5625, "int4-v64": 0.5625}
BITS = {"bf16": 16, "f16": 16, "fp8-e4m3": 8, "fp8-e5m2": 8, "int4-k32": 4, "int4-v64": 4}
# case -> (KV heads, query heads); query tiles hold 8 rows.
CASES = {"llama3-8b": (8, 32), "8x22b-tp8": (1, 6), "mha-32": (32, 32), "gqa-d64": (8, 32), "gqa-d256": (4, 16)}

# heuristic.rs: REFERENCE_BYTES_PER_SM_CYCLE (the H200's), RateModel::new (inflight target,
# full-rate warps per class of the narrowest side: 16-bit, FP8, INT4; INT4's scale with the
# device's feed), WAVE_OVERHEAD_TOKENS (scales with the feed), SPLIT_COST_TOKENS, TOLERANCE.
REFERENCE_BPC = 2.0 * 3_201_000.0 * 1e3 * 6144.0 / 8.0 / (132.0 * 1_980_000.0 * 1e3)  # 18.81
PARAMS = dict(t16=64 << 10, t8=12 << 10, t4=24 << 10, w16=6, w8=9, w4=12, wave=3072.0, split=8.0, tol=1.01)

SPACE = dict(
    t16=[48 << 10, 64 << 10, 96 << 10, 128 << 10],
    t8=[12 << 10, 16 << 10, 24 << 10, 32 << 10, 48 << 10],
    t4=[12 << 10, 16 << 10, 24 << 10, 32 << 10],
    w16=[6, 7, 8, 9, 10, 12],
    w8=[8, 9, 10, 11, 12, 14],
    w4=[10, 11, 12, 14, 16, 20],
    wave=[512.0, 768.0, 1024.0, 1536.0, 2048.0, 2560.0, 3072.0, 4096.0],
    split=[0.0, 4.0, 8.0, 16.0, 32.0],
    tol=[1.0, 1.01, 1.02, 1.03],
)


def split_len(max_len, n):
    """heuristic.rs split_len: (split count really used, tokens per split)."""
    max_len = max(max_len, 1)
    st = -(-max_len // max(n, 1))
    st = -(-st // SPLIT_MULTIPLE) * SPLIT_MULTIPLE
    return -(-max_len // st), st


def split_range(max_len):
    return range(1, min(max(-(-max_len // MIN_SPLIT_TOKENS), 1), MAX_SPLITS) + 1)


def step_tokens(k, v, d):
    """decode/plan.cuh Cfg::STEP: two 16-token chunks per step when a chunk's rows are small."""
    def rows(f, role):
        if BITS[f] == 4:
            return d // 2 + (d // 32 * 2 if role == "k" else d // 64 * 4)
        return int(d * BPE[f])
    return 32 if 16 * (rows(k, "k") + rows(v, "v")) <= 2560 else 16


def choose(P, base, max_len, k, v, occ, step, splits, feed):
    """heuristic.rs choose_launch. occ: {(warps, stages): (blocks per SM, stage bytes)}; feed:
    the device's bytes per SM cycle over the reference's (Machine::feed)."""
    nb = min(BITS[k], BITS[v])
    cls = 16 if nb >= 16 else nb
    target, frw = P["t%d" % cls], P["w%d" % cls] * (feed if cls == 4 else 1.0)
    fixed = P["wave"] * feed * 4.0 / (BPE[k] + BPE[v])
    cands = []
    for (w, st), (ctas, sb) in occ.items():
        if ctas == 0:
            continue
        inflight = w * (st - 1) * sb

        def rate(n):
            return min(n * inflight / target, n * w / frw, 1.0)

        for s in splits:
            n, ln = split_len(max_len, s)
            tokens = -(-ln // (step * w)) * step * w
            blocks, slots = base * n, ctas * SMS
            full, rest = blocks // slots, blocks % slots
            t = full * (ctas * tokens / rate(ctas) + fixed)
            if rest:
                kk = -(-rest // SMS)
                t += kk * tokens / rate(kk) + fixed
            cands.append((t + n * P["split"], n, w, st))
    best = min(c[0] for c in cands)
    c = min((c for c in cands if c[0] <= best * P["tol"]), key=lambda c: (c[1], c[2], c[3]))
    return c[1], c[2], c[3]


def parse(specs, groups=None):
    """{(bpc, case, B, L, K, V): {'rows': {(splits, warps, stages): us}, 'occ': {...}, 'plan': ...}}
    from PATH[@BPC] specs."""
    groups = collections.OrderedDict() if groups is None else groups
    for spec in specs:
        path, _, given = spec.partition("@")
        bpc = float(given) if given else None
        for line in (gzip.open(path, "rt") if path.endswith(".gz") else open(path)):
            m = re.search(r"([0-9.]+) bytes per SM cycle", line)
            if m and bpc is None:
                bpc = float(m.group(1))
            if not line.startswith("| ") or line.startswith("| case"):
                continue
            f = [x.strip() for x in line.strip().strip("|").split("|")]
            if len(f) < 12 or f[0].startswith("---"):
                continue
            case, B, L, K, V, s, w, st, ctas, sb, us = f[:11]
            star = case.startswith("*")
            key = (bpc or REFERENCE_BPC, case.lstrip("*"), int(B), int(L), K, V)
            g = groups.setdefault(key, {"rows": {}, "occ": {}, "plan": None})
            launch = (int(s), int(w), int(st))
            g["rows"][launch] = min(float(us), g["rows"].get(launch, math.inf))
            g["occ"][(int(w), int(st))] = (int(ctas), int(sb))
            if star and g["plan"] is None:
                g["plan"] = launch
    return groups


def regrets(P, groups):
    out = []
    for key, g in groups.items():
        bpc, case, B, L, K, V = key
        kvh, qh = CASES[case]
        base = B * kvh * -(-(qh // kvh) // 8)
        d = 64 if case == "gqa-d64" else 256 if case == "gqa-d256" else 128
        feed = bpc / REFERENCE_BPC
        pick = choose(P, base, L, K, V, g["occ"], step_tokens(K, V, d), split_range(L), feed)
        rows = g["rows"]
        timed = pick
        if pick not in rows:
            counts = [s for (s, w, st) in rows if (w, st) == pick[1:]]
            timed = (min(counts, key=lambda s: abs(math.log(s / pick[0]))),) + pick[1:]
        out.append((key, pick, timed, rows[timed] / min(rows.values()) - 1))
    return out


def objective(P, groups):
    r = [x[3] for x in regrets(P, groups)]
    return sum(math.log1p(x) for x in r) / len(r) + 0.2 * max(r)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweeps", nargs="+")
    ap.add_argument("--extra", action="append", default=[])
    ap.add_argument("--search", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    groups = parse(a.sweeps)
    # Extra rows only add launches to groups the sweeps hold.
    extra = parse(a.extra)
    for key, g in extra.items():
        if key in groups:
            rows = groups[key]["rows"]
            for launch, us in g["rows"].items():
                rows[launch] = min(us, rows.get(launch, math.inf))
            groups[key]["occ"].update(g["occ"])
    P = dict(PARAMS)
    if a.search:
        rng = random.Random(a.seed)
        best = (objective(P, groups), P)
        for _ in range(a.search):
            Q = {k: rng.choice(v) for k, v in SPACE.items()}
            best = min(best, (objective(Q, groups), Q), key=lambda b: b[0])
        improved = True
        while improved:
            improved = False
            for k, vals in SPACE.items():
                for v in vals:
                    Q = dict(best[1], **{k: v})
                    o = objective(Q, groups)
                    if o < best[0] - 1e-12:
                        best, improved = (o, Q), True
        P = best[1]
        print("best parameters:", P)
    r = regrets(P, groups)
    for key, pick, timed, x in r:
        note = "" if pick == timed else f" (priced at {timed[0]} splits)"
        print(f"{key[0]:5.2f} {key[1]:10s} B={key[2]:<4d} L={key[3]:<7d} {key[4]:9s} pick {pick}  "
              f"regret {100 * x:5.1f} %{note}")
    for bpc in sorted({key[0] for key, *_ in r}, reverse=True):
        xs = [x for key, *_, x in r if key[0] == bpc]
        mean = math.expm1(sum(math.log1p(x) for x in xs) / len(xs))
        print(f"{bpc:.2f} bytes per SM cycle: mean regret {100 * mean:.2f} %, "
              f"worst {100 * max(xs):.1f} %, within 1 %: {sum(x < 0.01 for x in xs)}, "
              f"within 2 %: {sum(x < 0.02 for x in xs)} of {len(xs)}")


if __name__ == "__main__":
    main()
