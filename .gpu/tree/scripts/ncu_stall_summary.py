"""Summarise an Nsight Compute source-page export per kernel (diagnostic).

    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > source.csv
    python scripts/ncu_stall_summary.py source.csv[.gz]

Prints, for each kernel in the export, the warp-stall reasons as a share of all stall samples,
and the share of samples and of executed warp instructions per SASS opcode (the mnemonic
before the first dot): where a latency-bound kernel waits, and which instructions it issues.
"""

from __future__ import annotations

import argparse
import csv
import gzip
from collections import Counter


def _kernels(path: str) -> list[tuple[str, list[str], list[list[str]]]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    out: list[tuple[str, list[str], list[list[str]]]] = []
    header: list[str] = []
    for row in rows:
        if row and row[0] == "Kernel Name":
            out.append((row[1], header, []))
        elif row and row[0] == "Address":
            header = row
            out[-1] = (out[-1][0], header, out[-1][2])
        elif out and row and row[0].startswith("0x"):
            out[-1][2].append(row)
    return out


def _opcode(source: str) -> str:
    words = source.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv export (optionally gzipped)")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for name, header, rows in _kernels(args.csv):
        col = {h: i for i, h in enumerate(header)}
        samples_col, inst_col = (
            col["Warp Stall Sampling (All Samples)"],
            col["Instructions Executed"],
        )
        reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        samples = sum(int(r[samples_col]) for r in rows)
        insts = sum(int(r[inst_col]) for r in rows)
        stall: Counter[str] = Counter()
        by_op: Counter[str] = Counter()
        inst_op: Counter[str] = Counter()
        for r in rows:
            op = _opcode(r[col["Source"]])
            by_op[op] += int(r[samples_col])
            inst_op[op] += int(r[inst_col])
            for h in reasons:
                stall[h] += int(r[col[h]] or 0)
        print(
            f"{name}: {len(rows)} SASS instructions, {samples} stall samples, "
            f"{insts} warp instructions executed"
        )
        print(
            "  stall reasons (% of samples):",
            ", ".join(f"{h[6:]} {100 * v / samples:.1f}" for h, v in stall.most_common(args.top)),
        )
        print(
            "  samples by opcode (%):",
            ", ".join(f"{o} {100 * v / samples:.1f}" for o, v in by_op.most_common(args.top)),
        )
        print(
            "  executed by opcode (%):",
            ", ".join(f"{o} {100 * v / insts:.1f}" for o, v in inst_op.most_common(args.top)),
        )


if __name__ == "__main__":
    main()
