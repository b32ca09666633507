"""How many of the tile kernel's lanes a benchmark parameter set leaves masked (CPU).

    python scripts/tile_lanes.py --models gpt2,llama > tile_lanes.txt

For each distinct shape of ``gefen-bench``'s GPT-2- and Llama-3.2-1B-shaped sets, searches the
period on a random-normal bf16 gradient (what ``gefen-bench step`` steps; the reference scores
on the CPU, which can differ from the Triton path's only in fp64 rounding) and reports the
tile route's register tile: ``P2``, the next power of two at or above the period, holds each
block, so ``1 - P / P2`` of its lanes carry no element. The total weights each shape by its
parameters. Periods above 4096 take the loop or split route and are listed as such.
"""

from __future__ import annotations

import argparse

import torch

from gefen_bench.param_sets import shapes_for
from gefen_core.period import search_periods
from gefen_kernels.ops._step_kernels import TILE_MAX_PERIOD


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    args = parser.parse_args()
    for model in args.models.split(","):
        shapes = shapes_for(model)
        counts: dict[tuple[int, ...], int] = {}
        names: dict[tuple[int, ...], str] = {}
        for name, shape in shapes:
            counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
            names.setdefault(tuple(shape), name)
        gen = torch.Generator().manual_seed(0)
        total = masked_weighted = 0.0
        print(f"=== {model}: {len(shapes)} tensors, {len(counts)} distinct shapes")
        for shape, count in counts.items():
            grad = torch.randn(shape, generator=gen).to(torch.bfloat16)
            period = search_periods([grad], [shape])[0]
            params = grad.numel() * count
            total += params
            if period > TILE_MAX_PERIOD:
                print(
                    f"{names[shape]:40s} {str(shape):16s} x{count:<3d} period {period:6d} "
                    "loop/split route"
                )
                continue
            p2 = 1 << (period - 1).bit_length()
            masked = 1.0 - period / p2
            masked_weighted += masked * params
            print(
                f"{names[shape]:40s} {str(shape):16s} x{count:<3d} period {period:6d} "
                f"P2 {p2:5d} masked {masked:5.1%}"
            )
        print(f"parameter-weighted masked lanes of the tile route: {masked_weighted / total:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
