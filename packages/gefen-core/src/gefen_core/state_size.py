"""Optimizer-state size of Gefen for a set of parameter shapes (docs/algorithm.md#state-layout).

``python -m gefen_core.state_size`` prints the state bytes per parameter of Gefen for a
GPT-2 (124M) and a Llama-3.2-1B parameter set built from their shapes (nothing is downloaded),
with the defaults (factored second moment for 2-D tensors whose sides are both at least
``min_dim_size_to_factor = 128``, docs/algorithm.md#factoring-rule), with every 2-D tensor
factored (``min_dim_size_to_factor = 0``), and in block mode.

The block period of each tensor is the one the period search settles on for gradients without
block structure (the search finds no period, so the memory-safe fallback of
docs/algorithm.md#period-search decides); a real search that finds structure picks a period ``>= 8``
of its own, and the byte counts per tensor below hold for any period.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from .period import memory_safe_fallback

Shape = tuple[int, ...]


def state_bytes(shape: Shape, period: int, *, factored: bool,
                min_dim_size_to_factor: int = 0) -> int:
    """Persistent state bytes of one tensor: uint8 codes (1 B/element), an fp32 scale per
    block, and an fp32 second moment per block (block mode) or per row and column (factored:
    2-D with both sides at least ``min_dim_size_to_factor``). The 0-dim counters and the
    shared 1 KiB codebook are not counted."""
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0:
        return 0
    blocks = numel // period
    factored = factored and len(shape) == 2 and min(shape) >= min_dim_size_to_factor
    second = 4 * (shape[0] + shape[1]) if factored else 4 * blocks
    return numel + 4 * blocks + second


def default_period(shape: Shape) -> int:
    """The period of a tensor whose gradient has no block structure (docs/algorithm.md#period-search
    gates, docs/algorithm.md#period-search)."""
    numel = 1
    for d in shape:
        numel *= d
    return 1 if numel <= 1 else memory_safe_fallback(numel, shape)


def gpt2_124m_shapes() -> list[Shape]:
    """GPT-2 small: 12 layers, d=768, vocab 50257, context 1024, head tied to the embedding."""
    d, ff = 768, 3072
    shapes: list[Shape] = [(50257, d), (1024, d)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,),
                   (d, ff), (ff,), (ff, d), (d,)]
    return shapes + [(d,), (d,)]


def llama32_1b_shapes(*, tied_head: bool = True) -> list[Shape]:
    """Llama-3.2-1B: 16 layers, d=2048, MLP 8192, 32 query / 8 key-value heads of 64,
    vocab 128256; the released model ties the head to the embedding."""
    d, ff, kv, vocab = 2048, 8192, 512, 128256
    shapes: list[Shape] = [(vocab, d)]
    for _ in range(16):
        shapes += [(d, d), (kv, d), (kv, d), (d, d), (ff, d), (ff, d), (d, ff), (d,), (d,)]
    shapes.append((d,))
    if not tied_head:
        shapes.append((vocab, d))
    return shapes


def bytes_per_param(shapes: Iterable[Shape], *, factored: bool,
                    min_dim_size_to_factor: int = 128) -> tuple[int, int]:
    """(total state bytes, total parameters) for Gefen with the default periods."""
    total = params = 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        total += state_bytes(shape, default_period(shape), factored=factored,
                             min_dim_size_to_factor=min_dim_size_to_factor)
        params += numel
    return total, params


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gefen_core.state_size",
        description="Gefen optimizer-state bytes per parameter for model shapes (no download).")
    parser.add_argument("--untied-head", action="store_true",
                        help="give Llama-3.2-1B a separate output head (1.5e9 parameters)")
    args = parser.parse_args(argv)
    models = {
        "gpt2-124m": gpt2_124m_shapes(),
        "llama-3.2-1b" + ("-untied" if args.untied_head else ""):
            llama32_1b_shapes(tied_head=not args.untied_head),
    }
    print(f"{'model':<22}{'params':>15}{'mode':>18}{'state MiB':>12}{'bytes/param':>13}")
    for name, shapes in models.items():
        for mode, factored, min_dim in (("default", True, 128), ("all 2-D factored", True, 0),
                                        ("block", False, 0)):
            total, params = bytes_per_param(shapes, factored=factored,
                                            min_dim_size_to_factor=min_dim)
            print(f"{name:<22}{params:>15,}{mode:>18}{total / 2**20:>12.1f}"
                  f"{total / params:>13.4f}")


if __name__ == "__main__":
    main()
