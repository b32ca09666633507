"""PyTorch building blocks of the codeword search (§1.9), shared by every reference op.

Kept apart from :mod:`gefen_kernels.ops.quantize` so the step references can use them without
going through the custom-op layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._numerics import NUM_CODEWORDS, SR_MUL0, SR_MUL1, SR_MUL2, to_signed64

_M0 = to_signed64(SR_MUL0)
_M1 = to_signed64(SR_MUL1)
_M2 = to_signed64(SR_MUL2)


def _lshr(z: Tensor, k: int) -> Tensor:
    # torch's >> on int64 is arithmetic; mask off the copies of the sign bit for a logical shift.
    return (z >> k) & ((1 << (64 - k)) - 1)


def sr_uniform_int64(seed: int | Tensor, index: Tensor) -> Tensor:
    """§1.9 hash: fp32 uniforms in [0, 1) with 24 random bits, from int64 ``index``.

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


def _brackets(x: Tensor, codebook: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """lower_bound, R = clamp(j, 0, K-1), L = max(R-1, 0) (§1.9) for fp32 ``x``."""
    j = torch.searchsorted(codebook, x, right=False)
    right = j.clamp_(max=NUM_CODEWORDS - 1)
    left = (right - 1).clamp_(min=0)
    return j, right, left


def nearest_codes(x: Tensor, codebook: Tensor) -> Tensor:
    """Nearest codeword index (int64) of fp32 ``x``; ties to the lower index; NaN -> 0."""
    above = x > codebook[NUM_CODEWORDS - 1]
    _, right, left = _brackets(x, codebook)
    d_left = (x - codebook[left]).abs_()
    d_right = (x - codebook[right]).abs_()
    q = torch.where(d_left <= d_right, left, right)
    # Above +1 must give 255 even where fp32 distances to c[254] and c[255] tie (|x| huge).
    q = torch.where(above, NUM_CODEWORDS - 1, q)
    return torch.where(torch.isnan(x), 0, q)


def stochastic_codes(x: Tensor, codebook: Tensor, u: Tensor) -> Tensor:
    """Stochastic rounding (§1.9) of fp32 ``x`` with fp32 uniforms ``u``; NaN -> 0."""
    _, right, left = _brackets(x, codebook)
    c_left = codebook[left]
    c_right = codebook[right]
    width = c_right - c_left
    clamped = torch.minimum(torch.maximum(x, c_left), c_right)
    p_up = torch.where(width > 0, (clamped - c_left) / torch.where(width > 0, width, 1.0), 0.0)
    q = torch.where(u < p_up, right, left)
    return torch.where(torch.isnan(x), 0, q)
