#!/usr/bin/env python3
"""Searches the MXFP4 kernel layout's bit placements (kernels/moe/layout.cuh).

A 32-bit word holds the 8 E2M1 codes of four bf16x2 A registers. Register r is built from the word
w by one of these forms, and must hold its two codes' magnitudes at bits 8..6 / 24..22 and their
signs at bits 15 / 31 (MAG = 0x01C001C0, SIGN = 0x80008000), zero elsewhere:

  mask      w & (MAG | SIGN)                              1 op
  shift     (w << s) & (MAG | SIGN), or >>                2 ops
  two       ((w << a) & MAG) | ((w << b) & SIGN)          4 ops (3 if a or b is 0)
  multiply  ((w & sources) * (2^a + 2^b)) & (MAG | SIGN)  3 ops (left shifts a != b only, when
            the two shifted copies neither overlap nor reach each other's target bits)

A layout is valid when the four registers' source bits tile the word. This prints the cheapest
layouts (integer ops a word, then ALU-pipe ops: masks, and right shifts, which ptxas puts on SHF;
left shifts and the multiply go to the FMA pipe as IMAD) and checks that layout.cuh's
mag_shift / sign_shift table is one of them.

With --fp8 it also prices each layout for the fp8 tensor core (wgmma .e4m3, A in registers): the
same word then fills two registers of four e4m3 bytes, row g's (a0 and a2's codes) and row g + 8's
(a1 and a3's), each code's magnitude at byte bits 4..2 and its sign at bit 7 (E2M1 placed in
e4m3 is the value times 2^-6, subnormals included). Which byte takes which K is free (the
activations in shared memory can be stored in the same K order), but the same for both rows. A
register's cost is counted in the same forms, generalized: its codes' fields grouped by shift,
one mask (fused with the OR) per group and one shift per non-zero shift, and any two or more
left-shift groups merged into one multiply (3 ops) when their copies neither overlap nor reach
each other's targets. It prints, per bf16 cost, the cheapest fp8 cost any such layout allows.

Usage: tools/gen/layout_search.py [--fp8] [path/to/layout.cuh]
"""

import itertools
import pathlib
import re
import sys

FULL = (1 << 32) - 1
MAG_TARGETS = (6, 7, 8, 22, 23, 24)
SIGN_TARGETS = (15, 31)


def bits(positions):
    m = 0
    for p in positions:
        m |= 1 << p
    return m


MAG = bits(MAG_TARGETS)
SIGN = bits(SIGN_TARGETS)


def sources(mag_left, sign_left):
    """Source bits of a register whose magnitudes move left by mag_left, signs by sign_left
    (negative: right); None when a source falls outside the word."""
    src = [p - mag_left for p in MAG_TARGETS] + [p - sign_left for p in SIGN_TARGETS]
    if min(src) < 0 or max(src) > 31 or len(set(src)) != len(src):
        return None
    return bits(src)


def forms():
    """Every (source mask, ops, alu ops, form, mag_left, sign_left) a register can take."""
    out = []
    for a, b in itertools.product(range(-31, 32), repeat=2):
        m = sources(a, b)
        if m is None:
            continue
        right = (a < 0) + (b < 0 and b != a)
        if a == b:
            out.append((m, 1 + (a != 0), 1 + (a < 0), "mask" if a == 0 else "shift", a, b))
            continue
        ops = 2 + (a != 0) + (b != 0)
        out.append((m, ops, 2 + right, "two", a, b))
        if a > 0 and b > 0:
            by_a, by_b = (m << a) & FULL, (m << b) & FULL
            if not by_a & by_b and by_a & (MAG | SIGN) == MAG and by_b & (MAG | SIGN) == SIGN:
                out.append((m, 3, 2, "multiply", a, b))
    return out


def cheapest_tilings(all_forms):
    best = {}
    for f in all_forms:
        if f[0] not in best or f[1:3] < best[f[0]][1:3]:
            best[f[0]] = f
    by_low = {}
    for m in best:
        by_low.setdefault((m & -m).bit_length() - 1, []).append(m)
    found = []

    def extend(used, chosen):
        if used == FULL:
            found.append([best[m] for m in chosen])
            return
        if len(chosen) == 4:
            return
        free = ~used & FULL
        for m in by_low.get((free & -free).bit_length() - 1, []):
            if not m & used:
                extend(used | m, chosen + [m])

    extend(0, [])
    found.sort(key=lambda t: (sum(f[1] for f in t), sum(f[2] for f in t)))
    return found


def read_layout(args):
    default = pathlib.Path(__file__).resolve().parents[2] / "kernels" / "moe" / "layout.cuh"
    return pathlib.Path(args[0] if args else default).read_text()


def field(pos, width):
    return ((1 << width) - 1) << pos


def register_ops(fields):
    """Integer ops of a register made of `fields` [(target bit, width, left shift)]: one mask a
    shift group and one op a non-zero shift, less what merging left-shift groups into one
    multiply saves."""
    groups = {}
    for target, width, s in fields:
        g = groups.setdefault(s, [0, 0])
        g[0] |= field(target, width)
        g[1] |= field(target - s, width)
    plain = sum(1 + (s != 0) for s in groups)
    best = plain
    left = [s for s in groups if s >= 0]
    for k in range(2, len(left) + 1):
        for merged in itertools.combinations(left, k):
            src = 0
            targets = 0
            for s in merged:
                src |= groups[s][1]
                targets |= groups[s][0]
            seen = 0
            ok = True
            for s in merged:
                copy = (src << s) & FULL
                if copy & seen or copy & targets != groups[s][0]:
                    ok = False
                    break
                seen |= copy
            if ok:
                best = min(best, plain - sum(1 + (s != 0) for s in merged) + 3)
    return best


def fp8_ops(left_shifts):
    """Integer ops of a word's two e4m3 registers for a layout given as the four bf16 registers'
    (magnitude, sign) left shifts in pair order a0..a3, at the best byte order."""
    # Code (pair, half): its magnitude's lowest bit and its sign bit in the word.
    code = {}
    for pair, (a, b) in enumerate(left_shifts):
        for half in range(2):
            code[(pair, half)] = (MAG_TARGETS[3 * half] - a, SIGN_TARGETS[half] - b)
    best = None
    for order in itertools.permutations(range(4)):  # byte of K class (pair >> 1, half)
        ops = 0
        for row in range(2):
            fields = []
            for k_block in range(2):
                for half in range(2):
                    mag, sign = code[(row + 2 * k_block, half)]
                    byte = order[2 * k_block + half]
                    fields.append((8 * byte + 2, 3, 8 * byte + 2 - mag))
                    fields.append((8 * byte + 7, 1, 8 * byte + 7 - sign))
            ops += register_ops(fields)
        best = ops if best is None else min(best, ops)
    return best


def fp8_frontier(tilings, least, ours):
    print(f"fp8 (two e4m3 registers a word): layout.cuh's table takes {fp8_ops(ours)} ops")
    cheapest = {}
    for t in tilings:
        ops = sum(f[1] for f in t)
        if ops > least + 3:
            break
        for order in itertools.permutations(t):
            f8 = fp8_ops([(f[4], f[5]) for f in order])
            if ops not in cheapest or f8 < cheapest[ops][0]:
                cheapest[ops] = (f8, order)
    for ops in sorted(cheapest):
        f8, order = cheapest[ops]
        desc = ", ".join(f"{f[3]}({f[4]:+d},{f[5]:+d})" for f in order)
        print(f"  bf16 {ops} ops: fp8 at best {f8} ops ({desc})")


def negated_table(text, fn):
    """The four values of layout.cuh's `fn` (pair == 0 ? x0 : pair == 1 ? x1 : pair == 2 ? x2 :
    x3), as left shifts."""
    body = re.search(fn + r"\(i32 pair\) \{\s*return ([^;]*);", text).group(1)
    values = [int(v) for v in re.findall(r"\?\s*(-?\d+)", body)] + [int(body.split(":")[-1])]
    return [-v for v in values[:4]]


def main():
    args = sys.argv[1:]
    fp8 = "--fp8" in args
    args = [a for a in args if a != "--fp8"]
    tilings = cheapest_tilings(forms())
    least = sum(f[1] for f in tilings[0])
    print(f"{len(tilings)} layouts; fewest integer ops a word: {least}")
    for t in tilings:
        if sum(f[1] for f in t) > least + 1:
            break
        desc = ", ".join(f"{f[3]}({f[4]:+d},{f[5]:+d})" for f in t)
        print(f"  {sum(f[1] for f in t)} ops, {sum(f[2] for f in t)} on the ALU: {desc}")
    # layout.cuh's table (its shifts are right shifts when positive, left when negative).
    ours = list(zip(*(negated_table(read_layout(args), fn) for fn in ("mag_shift", "sign_shift"))))
    print(f"layout.cuh (left shifts, magnitude and sign per register): {ours}")
    ours_masks = sorted(sources(a, b) for a, b in ours)
    cheapest = [sorted(f[0] for f in t) for t in tilings if sum(f[1] for f in t) == least]
    if ours_masks not in cheapest:
        print("layout.cuh's table is not among the cheapest layouts")
        return 1
    print("layout.cuh's table is among the cheapest layouts")
    if fp8:
        fp8_frontier(tilings, least, ours)
    return 0


if __name__ == "__main__":
    sys.exit(main())
