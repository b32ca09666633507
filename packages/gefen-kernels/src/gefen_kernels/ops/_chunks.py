"""Chunking of the PyTorch references over whole blocks (docs/algorithm.md#step: bounded
temporaries)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .. import _numerics


@dataclass(frozen=True)
class BlockGroup:
    """Blocks ``[first, stop)`` processed together, split into element tiles.

    When a block fits in a chunk, a group holds as many whole blocks as fit and has one tile
    covering all of them (viewed as ``[stop - first, P]``). When the period exceeds the chunk,
    a group is a single block and its tiles are consecutive slices of it (each ``[1, width]``).
    """

    first: int
    stop: int
    tiles: tuple[tuple[int, int], ...]  # flat [start, end) element ranges, in order


def block_groups(num_blocks: int, period: int) -> Iterator[BlockGroup]:
    chunk = _numerics.CHUNK_ELEMENTS
    if period <= chunk:
        per_group = max(1, chunk // period)
        for first in range(0, num_blocks, per_group):
            stop = min(num_blocks, first + per_group)
            yield BlockGroup(first, stop, ((first * period, stop * period),))
        return
    for block in range(num_blocks):
        base = block * period
        tiles = tuple(
            (base + lo, base + min(period, lo + chunk)) for lo in range(0, period, chunk)
        )
        yield BlockGroup(block, block + 1, tiles)
