#!/usr/bin/env python3
"""Bank and sector model of the decode kernel's shared-memory code rows (cuda/decode/frag.cuh).

For every format and head_dim the kernel is built for, this mirrors frag.cuh's row layout
(pitch, rotated load order, XOR swizzle) and checks, per 16-token chunk:
  - that the stored layout is a bijection of the chunk's 16-byte units (the copies and the
    reads agree on one permutation);
  - that every copied 32-byte global sector lands in one aligned 32-byte piece of shared
    memory (what keeps the L2 -> SM traffic at one sector per sector, docs/PERFORMANCE.md v12);
  - the extra shared-memory wavefronts of the K and V reads (0: conflict-free).
It reads no source: keep it in step with frag.cuh when a layout changes.
    python3 scripts/bank_model.py        # one line per (format, head_dim, role)
"""

DIMS = (64, 80, 96, 112, 128, 192, 256)


def load_width(b):
    return 16 if b % 16 == 0 else 8 if b % 8 == 0 else 4 if b % 4 == 0 else 2


def extra_wavefronts(addrs, width):
    """Wavefronts beyond one per phase for lanes reading `width` bytes at `addrs`."""
    per = {16: 8, 8: 16, 4: 32, 2: 32}[width]
    extra = 0
    for ph in range(0, len(addrs), per):
        banks = {}
        for a in addrs[ph:ph + per]:
            for w in range(max(width, 4) // 4):
                banks.setdefault((a // 4 + w) % 32, set()).add(a // 4 + w)
        extra += max(len(v) for v in banks.values()) - 1
    return extra


def stored(row, col, pitch, swz):
    return (row * pitch + col) ^ swz(row)


def sectors_whole(row_bytes, pitch, swz):
    for d in range(0, 16 * row_bytes, 32):
        a, b = (stored(*divmod(x, row_bytes), pitch, swz) for x in (d, d + 16))
        if a // 32 != b // 32:
            return False
    return True


def bijective(row_bytes, pitch, swz):
    units = {stored(r, c, pitch, swz) // 16 for r in range(16) for c in range(0, row_bytes, 16)}
    return len(units) == 16 * row_bytes // 16


def k_layout(bits, d, grouped):
    row = d * bits // 8
    if grouped:  # INT4 K, read by ldmatrix
        swz_on = row in (32, 64, 128)
        pitch = row if swz_on else row + 16
        sh = {32: lambda r: (r >> 2) & 1, 64: lambda r: (r >> 1) & 3, 128: lambda r: r & 7}
        swz = (lambda r: sh[row](r) << 4) if swz_on else (lambda r: 0)
        addrs = []
        for g2 in range(max(1, d // 64)):
            for lane in range(32):
                r, c = ((lane >> 3) & 1) * 8 + (lane & 7), (lane >> 4) + 2 * g2
                addrs.append(stored(r, 16 * c, pitch, swz))
        return row, pitch, swz, extra_wavefronts(addrs, 16)
    kch = row // 4
    kvec = load_width(kch)
    knv = kch // kvec
    swz_on = kvec == 16 and row % 128 == 0 and knv in (2, 8)
    pitch = row + (0 if swz_on else {2: 16, 4: 32, 8: 16}.get(knv, 0))
    rot = (lambda t: (t & 1) if knv == 2 else t) if swz_on else \
        (lambda t: {4: t >> 1, 8: 2 * t}.get(knv, 0))
    swz = (lambda r: (r & 1) << (5 if knv == 2 else 6)) if swz_on else (lambda r: 0)
    extra = 0
    for v in range(knv):
        for h in range(2):
            addrs = []
            for lane in range(32):
                g, t = divmod(lane, 4)
                col = t * kch + ((v + rot(t)) % knv) * kvec
                addrs.append(stored(8 * h + g, col, pitch, swz))
            extra += extra_wavefronts(addrs, kvec)
    return row, pitch, swz, extra


def v_layout(bits, d, grouped):
    row = d * bits // 8
    vch = row // 8
    vvec = 8 if grouped else load_width(vch)
    vnv = max(1, vch // vvec)
    swz_on = row % 128 == 0 or row in (32, 64)
    pitch = row if swz_on else row + 16
    swz = (lambda r: ((r >> 1) & 3) << 5) if swz_on else (lambda r: 0)
    extra = 0
    for e in (0, 1, 8, 9):
        if grouped:  # lane g reads word g of each 64-element group, 4-byte loads
            for grp in range(max(1, d // 64)):
                addrs = [stored(2 * (l % 4) + e, grp * 32 + 4 * (l // 4), pitch, swz)
                         for l in range(32)]
                extra += extra_wavefronts(addrs, 4)
        else:
            for v in range(vnv):
                addrs = []
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    rot = (g & 1) if (vvec == 16 and vnv >= 2) else 0
                    addrs.append(stored(2 * t + e, g * vch + ((v + rot) % vnv) * vvec, pitch, swz))
                extra += extra_wavefronts(addrs, vvec)
    return row, pitch, swz, extra


def main():
    formats = (("f16/bf16", 16, False, False, DIMS), ("fp8", 8, False, False, DIMS),
               ("int4-k32", 4, True, False, (64, 96, 128, 192, 256)),
               ("int4-v64", 4, False, True, (64, 128, 192, 256)))
    print(f"{'format':10} {'d':>4} role {'row':>4} {'pitch':>5} sectors-whole bijective extra-wavefronts")
    for name, bits, k_grouped, v_grouped, dims in formats:
        for d in dims:
            roles = []
            if not v_grouped:
                roles.append(("K", k_layout(bits, d, k_grouped)))
            if not k_grouped:
                roles.append(("V", v_layout(bits, d, v_grouped)))
            for role, (row, pitch, swz, extra) in roles:
                print(f"{name:10} {d:4} {role:4} {row:4} {pitch:5} {str(sectors_whole(row, pitch, swz)):13} "
                      f"{str(bijective(row, pitch, swz)):9} {extra}")


if __name__ == "__main__":
    main()
