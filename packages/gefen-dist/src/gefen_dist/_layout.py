"""Global layouts of Gefen's per-shard state, so DCP and FSDP2 tools can shard and gather it.

A ``Shard(0)`` parameter of global shape ``[R, ...]`` (``row_numel = prod(shape[1:])``) keeps,
on each rank, compact state for its local rows: codes uint8 ``[B, P]`` and per-block fp32
``[B, 1]`` tensors (``B = local_numel / P``), with blocks that never straddle a shard boundary
(:func:`gefen_dist.sharded.sharded_period`). This module maps that state to tensors whose
dim 0 is the parameter's row dimension, so they chunk across ranks exactly like the parameter:

* codes: the parameter's own shape (uint8), a pure reshape;
* per-block values: ``[R, row_numel / u]`` with ``u = gcd(P, row_numel)``; unit ``j`` of row
  ``i`` covers flat elements ``[i * row_numel + j * u, ... + u)``, which lie in one block, and
  holds that block's value (each block value repeated ``P / u`` times). ``u = P`` when ``P``
  divides the row (no repetition); ``u = row_numel`` when a block spans whole rows.

Both maps are pure copies: converting back picks each block's first unit, so a round trip is
bit-exact. All functions work on local tensors (pass ``to_local()`` of a DTensor).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "block_values_from_units",
    "block_values_to_units",
    "codes_from_param_shape",
    "codes_to_param_shape",
    "unit_size",
    "units_shape",
]


def unit_size(period: int, global_shape: tuple[int, ...]) -> int:
    """``u = gcd(P, row_numel)``: elements per unit of the per-block layout."""
    row_numel = math.prod(global_shape[1:])
    return math.gcd(period, row_numel)


def units_shape(period: int, rows: int, global_shape: tuple[int, ...]) -> tuple[int, int]:
    """Shape ``[rows, row_numel / u]`` of the per-block layout for ``rows`` rows."""
    row_numel = math.prod(global_shape[1:])
    return rows, row_numel // unit_size(period, global_shape)


def codes_to_param_shape(codes: Tensor, local_shape: tuple[int, ...]) -> Tensor:
    """uint8 ``[B, P]`` -> the local parameter shape (a view when contiguous)."""
    return codes.reshape(local_shape)


def codes_from_param_shape(codes: Tensor, period: int) -> Tensor:
    """Param-shaped uint8 codes -> contiguous ``[B, P]``.

    Raises:
        ValueError: the numel is not a multiple of ``period``.
    """
    if codes.numel() % period:
        raise ValueError(f"{codes.numel()} codes are not a whole number of blocks of {period}")
    return codes.reshape(-1, period).contiguous()


def block_values_to_units(values: Tensor, period: int, local_shape: tuple[int, ...],
                          global_shape: tuple[int, ...]) -> Tensor:
    """Per-block ``[B, 1]`` -> per-unit ``[local_rows, row_numel / u]`` (block value repeated).

    Raises:
        ValueError: the local shard is not a whole number of blocks.
    """
    rows = local_shape[0] if local_shape else 1
    shape = units_shape(period, rows, global_shape)
    u = unit_size(period, global_shape)
    if values.numel() * period != rows * math.prod(global_shape[1:]):
        raise ValueError(
            f"{values.numel()} blocks of {period} do not cover a shard of {rows} rows"
        )
    return values.reshape(-1).repeat_interleave(period // u).reshape(shape)


def block_values_from_units(units: Tensor, period: int,
                            global_shape: tuple[int, ...]) -> Tensor:
    """Per-unit ``[rows, row_numel / u]`` -> per-block ``[B, 1]`` (first unit of each block).

    Raises:
        ValueError: the units are not a whole number of blocks.
    """
    u = unit_size(period, global_shape)
    per_block = period // u
    flat = units.reshape(-1)
    if flat.numel() % per_block:
        raise ValueError(f"{flat.numel()} units are not a whole number of blocks of {period}")
    return flat[::per_block].reshape(-1, 1).contiguous().to(torch.float32)
