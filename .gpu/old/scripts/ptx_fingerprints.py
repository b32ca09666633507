"""Fingerprint the PTX of every step tile kernel configuration, to show a change left it alone.

    cd packages/gefen-kernels && python ../../scripts/ptx_fingerprints.py OUT.json
    python scripts/ptx_fingerprints.py --compare BEFORE.json AFTER.json

Records the launches of ``tests/compile_check.py``'s scenarios (of the tree it is run in),
compiles each ``_step_tile_kernel`` and ``_group_tile_kernel`` configuration to PTX for sm_90
on the CPU, drops the debug lines (``.loc``, ``.file``, comments, labels, the debug sections:
they carry source line numbers) and stores a SHA-1 per configuration. A constexpr equal to 0
that only the newer tree has (``TAIL``) is left out of the key, so both trees name the same
configuration alike. ``--compare`` prints how many shared configurations have the same PTX.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys


def fingerprints(out: str) -> None:
    sys.path.insert(0, "tests")
    import compile_check as cc

    result = {}
    for launch in cc.record_launches(cc.scenarios()):
        if launch.kernel.__name__ not in ("_step_tile_kernel", "_group_tile_kernel"):
            continue
        key = re.sub(r",? ?'TAIL': 0", "", launch.describe())
        ptx = str(cc.compile_launch(launch, "ptx"))
        body = "\n".join(
            line
            for line in ptx.splitlines()
            if not line.strip().startswith((".loc", ".file", "//", "$L__"))
        )
        body = body.split(".section")[0]
        result[key] = hashlib.sha1(body.encode()).hexdigest()
    with open(out, "w") as f:
        json.dump(result, f, indent=0, sort_keys=True)
    print(f"{len(result)} configurations")


def compare(before: str, after: str) -> None:
    with open(before) as f:
        a = json.load(f)
    with open(after) as f:
        b = json.load(f)
    shared = sorted(set(a) & set(b))
    same = sum(a[k] == b[k] for k in shared)
    print(f"{len(a)} before, {len(b)} after, {len(shared)} shared, {same} with the same PTX")
    for k in shared:
        if a[k] != b[k]:
            print("  differs:", k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
    elif args.out:
        fingerprints(args.out)
    else:
        parser.error("give OUT.json or --compare BEFORE AFTER")


if __name__ == "__main__":
    main()
