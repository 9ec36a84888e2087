#!/usr/bin/env python3
"""Where a kernel's warps spend their time, by SASS loop, from an Nsight Compute report.

Reads the per-instruction table of one kernel launch, as the H200 runs of tools/PERF_LOG.md took
it (here the qwen3-30b-a3b T = 256 FC1; --launch-skip 5 for its FC2):

  ncu --clock-control none --kernel-name regex:moe_gemm_wg --launch-skip 4 --launch-count 1 \
      --section WarpStateStats --section SourceCounters --section SchedulerStats \
      --import-source no -o REPORT build/tools/bench/moejit_bench_moe --section marlin \
      --models qwen3-30b-a3b --tokens 256 --no-dense --gap-ms 5
  ncu --import REPORT.ncu-rep --page source --csv --print-source sass > SOURCE.csv

(the SourceCounters section gives the warp stall samples per instruction), finds the
loops (backward branches), and prints for each loop and for everything outside the loops the
share of warp samples (time a warp is resident there) against the share of instructions executed
(work), with the largest stall reasons. A region whose samples share is well above its
instructions share is where warps wait; tools/PERF_LOG.md "the warpgroup FC1's stalls by reason
and by instruction" is the first reading of this kind.

Usage: tools/prof/ncu_loops.py SOURCE.csv [--min-len N] [--top K] [--hot K]
  --min-len N  loops shorter than N instructions are folded into their surroundings (default 60)
  --top K      also list the K instructions with the most samples outside the loops (default 0)
  --hot K      also list, in address order, the K instructions with the most samples inside the
               loop that holds the most samples, each with its two largest stall reasons, and
               that loop's stall totals (default 0). A copy block whose every LDGSTS stalls on
               `wait` and whose address instructions stall on `long_sb` is what the fifty-first
               session's persistent tile showed where ptxas formed eight copies' addresses in one
               to three register pairs (tools/PERF_LOG.md).
"""

import argparse
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_table(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    # The first row names the kernel; the second holds the column names.
    for i, row in enumerate(rows):
        if row and row[0] == "Address":
            header = row
            body = [r for r in rows[i + 1:] if len(r) == len(header)]
            return header, body
    sys.exit(f"{path}: no 'Address' header row: is this ncu --page source --csv output?")


def number(text):
    text = text.replace(",", "").strip()
    return int(float(text)) if text else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source_csv")
    parser.add_argument("--min-len", type=int, default=60)
    parser.add_argument("--top", type=int, default=0)
    parser.add_argument("--hot", type=int, default=0)
    args = parser.parse_args()

    header, body = read_table(args.source_csv)
    column = {name: i for i, name in enumerate(header)}
    for needed in ("Address", "Source", SAMPLES, EXECUTED):
        if needed not in column:
            sys.exit(f"{args.source_csv}: no column '{needed}' (the report needs SourceCounters)")
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]

    address = [int(r[column["Address"]], 16) for r in body]
    index_of = {a: i for i, a in enumerate(address)}
    samples = [number(r[column[SAMPLES]]) for r in body]
    executed = [number(r[column[EXECUTED]]) for r in body]
    total_samples = sum(samples) or 1
    total_executed = sum(executed) or 1

    # Innermost-first loops: a backward branch to an address in the kernel.
    loops = []
    for i, row in enumerate(body):
        match = re.search(r"\bBRA\S*\s+(0x[0-9a-f]+)", row[column["Source"]])
        if match:
            target = int(match.group(1), 16)
            if target < address[i] and target in index_of and i - index_of[target] + 1 >= args.min_len:
                loops.append((index_of[target], i))
    # Keep the innermost loops only: an outer loop's own share is what its inner loops leave.
    inner = [l for l in loops if not any(o != l and l[0] <= o[0] and o[1] <= l[1] for o in loops)]
    inside = set()
    for first, last in inner:
        inside.update(range(first, last + 1))

    def stalls_by_reason(indices):
        """(samples, reason) for every stall reason over `indices`, largest first."""
        return sorted(((sum(number(body[i][column[r]]) for i in indices), r[len("stall_"):])
                       for r in reasons), reverse=True)

    def report(name, indices):
        s = sum(samples[i] for i in indices)
        e = sum(executed[i] for i in indices)
        by_reason = stalls_by_reason(indices)[:3]
        top = ", ".join(f"{reason} {100 * count / max(s, 1):.0f}%" for count, reason in by_reason)
        print(f"{name:28s} samples {100 * s / total_samples:5.1f}%  instructions "
              f"{100 * e / total_executed:5.1f}%  ({top})")

    print(f"{total_samples} warp samples, {total_executed} warp instructions executed")
    idle = 0
    for first, last in sorted(inner):
        if not any(executed[i] for i in range(first, last + 1)):
            idle += 1  # an instance this launch never ran (another width, say)
            continue
        report(f"loop {first}-{last} ({last - first + 1} instr, {executed[last]} passes)",
               range(first, last + 1))
    if idle:
        print(f"({idle} loops never executed in this launch)")
    outside = [i for i in range(len(body)) if i not in inside]
    report("outside the loops", outside)
    if args.top:
        print(f"\ninstructions outside the loops with the most samples:")
        for i in sorted(outside, key=lambda k: -samples[k])[:args.top]:
            print(f"  {i:6d} {samples[i]:6d} samples  {executed[i]:9d} executed  "
                  f"{body[i][column['Source']].strip()[:70]}")
    if args.hot and inner:
        first, last = max(inner, key=lambda l: sum(samples[k] for k in range(l[0], l[1] + 1)))
        indices = range(first, last + 1)
        print(f"\nloop {first}-{last}: its {args.hot} instructions with the most samples "
              f"(% of all samples; the two largest stall reasons):")
        for i in sorted(sorted(indices, key=lambda k: -samples[k])[:args.hot]):
            stalls = ", ".join(f"{reason} {count}" for count, reason in stalls_by_reason([i])[:2])
            print(f"  {i:6d} {100 * samples[i] / total_samples:5.2f}%  {stalls:34s} "
                  f"{body[i][column['Source']].strip()[:70]}")
        totals = stalls_by_reason(indices)[:10]
        print("  stall totals: " + ", ".join(f"{reason} {count}" for count, reason in totals))


if __name__ == "__main__":
    main()
