"""PyTorch building blocks of the codeword search (docs/algorithm.md#quantizer), shared by every
reference op.

Kept apart from :mod:`gefen_kernels.ops.quantize` so the step references can use them without
going through the custom-op layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._numerics import HISTOGRAM_BINS, NUM_CODEWORDS, SR_MUL0, SR_MUL1, SR_MUL2, to_signed64
from ._search_table import search_table

_M0 = to_signed64(SR_MUL0)
_M1 = to_signed64(SR_MUL1)
_M2 = to_signed64(SR_MUL2)


def _lshr(z: Tensor, k: int) -> Tensor:
    # torch's >> on int64 is arithmetic; mask off the copies of the sign bit for a logical shift.
    return (z >> k) & ((1 << (64 - k)) - 1)


def sr_uniform_int64(seed: int | Tensor, index: Tensor) -> Tensor:
    """docs/algorithm.md#stochastic-rounding hash: fp32 uniforms in [0, 1) with 24 random bits, from
    int64 ``index``.

    ``seed`` is a Python int (two's complement) or an int64 tensor broadcastable to ``index``.
    All arithmetic is int64 with wrapping multiplication, i.e. arithmetic modulo 2**64.
    """
    if isinstance(seed, int):
        seed = to_signed64(seed)
    z = (index + 1) * _M0 + seed
    z = (z ^ _lshr(z, 30)) * _M1
    z = (z ^ _lshr(z, 27)) * _M2
    z = z ^ _lshr(z, 31)
    return _lshr(z, 40).to(torch.float32) * (2.0**-24)


def _lower_bound(x: Tensor, codebook: Tensor) -> Tensor:
    """``searchsorted(codebook, x, right=False)`` via the docs/algorithm.md#quantizer bucket table
    (int32 result).

    Every codeword below ``L[b]`` is below ``x`` and every one from ``L[b + 1]`` on is above
    it (see :mod:`gefen_kernels.ops._search_table`), so a branchless binary search over the
    at most ``widest`` codewords of bucket ``b`` (``steps`` probes) gives the same lower bound
    as the full search for every ``x``; NaN only needs some valid index (callers mask it).
    int32 indices halve the memory traffic of the int64 ones on CPU.
    """
    if (x.dtype != torch.float32 or codebook.dtype != torch.float32 or x.device.type != "cpu"
            or x.dim() != 1):
        return torch.searchsorted(codebook, x, right=False)
    table, steps = search_table(codebook)
    if table is codebook:
        return torch.searchsorted(codebook, x, right=False)
    # Same fp32 operations as build_search_table, so x and the codewords share the bucket map.
    bucket = (x + 1.0).mul_(float(HISTOGRAM_BINS // 2)).floor_()
    bucket = bucket.nan_to_num_(nan=0.0).clamp_(0, HISTOGRAM_BINS - 1).to(torch.int32)
    base = table.index_select(0, bucket)
    count = table.index_select(0, bucket.add_(1)).sub_(base)
    del bucket
    # With count == 0 a probe reads the first codeword of a higher bucket (above x, so it does
    # not move) or, past the last bucket, this +inf padding.
    padded = torch.cat([codebook, codebook.new_full((1,), float("inf"))])
    for _ in range(steps):
        half = count >> 1
        mid = base + half
        less = padded.index_select(0, mid) < x
        base = torch.where(less, mid.add_(1), base)
        count = torch.where(less, count.sub_(half).sub_(1), half)
    return base


def _brackets(x: Tensor, codebook: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """lower_bound, R = clamp(j, 0, K-1), L = max(R-1, 0) (docs/algorithm.md#quantizer) for fp32
    ``x``."""
    j = _lower_bound(x, codebook)
    right = j.clamp_(max=NUM_CODEWORDS - 1)
    left = (right - 1).clamp_(min=0)
    return j, right, left


def nearest_codes(x: Tensor, codebook: Tensor) -> Tensor:
    """Nearest codeword index (int64) of fp32 ``x``; ties to the lower index; NaN -> 0."""
    if x.dim() != 1:
        return nearest_codes(x.reshape(-1), codebook).view(x.shape)
    _, right, left = _brackets(x, codebook)
    d_left = torch.sub(x, codebook.index_select(0, left)).abs_()
    d_right = torch.sub(x, codebook.index_select(0, right)).abs_()
    # left == right (x at or below c[0]) gives equal distances, hence left: ties to the lower.
    q = left.add_(torch.gt(d_left, d_right))
    del d_left, d_right, right
    # Above +1 must give 255 even where fp32 distances to c[254] and c[255] tie (|x| huge).
    q.masked_fill_(x > codebook[NUM_CODEWORDS - 1], NUM_CODEWORDS - 1)
    return q.masked_fill_(torch.isnan(x), 0).long()


def toward_zero_pick_left(x: Tensor, c_left: Tensor, c_right: Tensor,
                          pick_left_nearest: Tensor) -> Tensor:
    """Whether the toward-zero rounding of ``x`` takes ``L`` (else ``R``), from the bracket
    ``c_left = c[L] <= x <= c[R] = c_right`` of docs/algorithm.md#toward-zero-rounding
    (docs/algorithm.md#toward-zero-rounding).

    ``x > 0`` takes the largest codeword not above ``x`` (``L`` unless ``c[R] == x``), ``x <= 0``
    the smallest one not below it (``R``): the codeword of largest magnitude not exceeding
    ``|x|``, the zero codeword when ``|x|`` is below the smallest nonzero one. Where the bracket
    straddles 0 (``c[L] < 0 < c[R]``: a codebook saved before the zero codeword existed), the
    nearest rounding's choice ``pick_left_nearest`` is kept, so such a codebook rounds near 0
    as it always did and never across 0. Above ``+1`` and below ``-1`` this gives the end
    codewords, as nearest rounding does.
    """
    straddle = (c_left < 0) & (c_right > 0)
    floor_left = (c_right > x) & (x > 0)
    return torch.where(straddle, pick_left_nearest, floor_left)


def toward_zero_codes(x: Tensor, codebook: Tensor) -> Tensor:
    """Toward-zero rounding (int64 codes) of fp32 ``x``; NaN -> 0.

    The rounding of momentum values whose gradient is exactly zero, in both rounding modes
    (docs/algorithm.md#toward-zero-rounding): see :func:`toward_zero_pick_left`. With a
    codebook that holds an exact 0, ``|c[q]| <= |x|`` on the same side of 0, so a coordinate
    that keeps a zero gradient has its momentum shrink by at least ``beta1`` per step until it
    is exactly 0.
    """
    if x.dim() != 1:
        return toward_zero_codes(x.reshape(-1), codebook).view(x.shape)
    _, right, left = _brackets(x, codebook)
    c_left = codebook.index_select(0, left)
    c_right = codebook.index_select(0, right)
    nearest_left = torch.sub(x, c_left).abs_() <= torch.sub(x, c_right).abs_()
    pick_left = toward_zero_pick_left(x, c_left, c_right, nearest_left)
    q = torch.where(pick_left, left, right)
    return q.masked_fill_(torch.isnan(x), 0).long()


def round_codes(x: Tensor, codebook: Tensor, zero_grad: Tensor | None, *,
                stochastic: bool, u: Tensor | None = None) -> Tensor:
    """The docs/algorithm.md#stochastic-rounding codes of fp32 ``x`` (1-D) for a step: nearest or
    stochastic rounding, and toward-zero rounding where ``zero_grad`` (bool, same shape) marks an
    exactly-zero gradient (docs/algorithm.md#toward-zero-rounding). Int64 codes.

    Raises:
        ValueError: ``stochastic`` without the uniforms ``u``.
    """
    if stochastic:
        if u is None:
            raise ValueError("stochastic rounding needs its uniforms: pass u")
        q = stochastic_codes(x, codebook, u)
    else:
        q = nearest_codes(x, codebook)
    if zero_grad is not None:
        where = torch.nonzero(zero_grad.reshape(-1)).flatten()
        if where.numel():
            q.index_copy_(0, where, toward_zero_codes(x.index_select(0, where), codebook))
    return q


def stochastic_codes(x: Tensor, codebook: Tensor, u: Tensor) -> Tensor:
    """Stochastic rounding (docs/algorithm.md#stochastic-rounding) of fp32 ``x`` with fp32 uniforms
    ``u``; NaN -> 0."""
    if x.dim() != 1:
        u = u.expand(x.shape).reshape(-1)
        return stochastic_codes(x.reshape(-1), codebook, u).view(x.shape)
    _, right, left = _brackets(x, codebook)
    c_left = codebook.index_select(0, left)
    c_right = codebook.index_select(0, right)
    width = c_right - c_left
    clamped = torch.minimum(torch.maximum(x, c_left), c_right)
    p_up = torch.where(width > 0, (clamped - c_left) / torch.where(width > 0, width, 1.0), 0.0)
    q = torch.where(u < p_up, right, left)
    return torch.where(torch.isnan(x), 0, q).long()
