"""The chunked PyTorch step shared by the block and factored references
(docs/algorithm.md#block-second-moment, docs/algorithm.md#factored-second-moment).

One implementation of the momentum re-quantisation and parameter write; the two modes differ
only in the denominator ``sigma`` (per block, or per element from row/column statistics). The
rounding sequence is the one documented in :mod:`gefen_kernels._numerics`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .._numerics import f32, momentum_ema
from ._chunks import block_groups
from ._quant_ref import round_codes, sr_uniform_int64

Scalar = float | Tensor


@dataclass
class ComputeScalars:
    """Scalars of one step, already rounded to the compute dtype.

    Host values are Python floats holding the fp32-rounded value (fp64 values on the fp64
    path): torch converts a Python scalar to the tensor's dtype exactly then, so every product
    is rounded once, and no device tensor is created (keeps CUDA-graph capture legal).
    ``hyper`` values are 0-dim views into the fp32 device tensor.
    """

    dtype: torch.dtype
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    eps: float
    lr: Scalar
    bc2: Scalar  # bc2_rsqrt (block) or bc2_recip (factored)
    bc1_recip: Scalar
    decay: Scalar
    lr_is_host_zero: bool
    capturable: bool  # lr came from a device tensor: never branch on it on the host


def make_scalars(*, dtype: torch.dtype, lr: float, beta1: float, beta2: float, eps: float,
                 bc1_recip: float, bc2: float, decay: float,
                 hyper: Tensor | None) -> ComputeScalars:
    if dtype == torch.float32:
        b1, b2 = f32(beta1), f32(beta2)
        omb1, omb2 = f32(1.0 - b1), f32(1.0 - b2)
        host = [f32(lr), f32(bc2), f32(bc1_recip), f32(decay)]
        eps_v = f32(eps)
    else:
        b1, b2, omb1, omb2 = beta1, beta2, 1.0 - beta1, 1.0 - beta2
        host = [lr, bc2, bc1_recip, decay]
        eps_v = eps
    values: list[Scalar]
    if hyper is not None:
        hv = hyper.to(dtype)
        values = [hv[0], hv[1], hv[2], hv[3]]
        host_zero = False
    else:
        values = list(host)
        host_zero = lr == 0.0
    return ComputeScalars(dtype, b1, omb1, b2, omb2, eps_v, values[0], values[1], values[2],
                       values[3], host_zero, hyper is not None)


def denominator(h: Tensor, sc: ComputeScalars) -> Tensor:
    """``sigma = f32(f32(1 / f32(h + eps)) * bc1_recip)`` from ``h`` (the scaled sqrt)."""
    h = h + sc.eps
    return torch.reciprocal(h) * sc.bc1_recip


def run_step(
    param: Tensor,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    codebook: Tensor,
    sc: ComputeScalars,
    *,
    maximize: bool,
    stochastic_round: bool,
    seed: int | Tensor,
    block_sigma: Callable[[int, int, Tensor | None], Tensor] | None,
    element_sigma: Callable[[int, int], tuple[Tensor, Tensor]] | None,
) -> None:
    """Momentum EMA, re-quantisation and parameter update over chunks of whole blocks.

    ``block_sigma(first, stop, sumsq)`` (block mode) receives the per-block ``sum g^2`` of
    blocks ``[first, stop)`` in the compute dtype, updates the second moment and returns
    ``sigma`` per block ``[n, 1]``. ``element_sigma(start, end)`` (factored mode) returns
    ``(sigma, V)`` for flat elements ``[start, end)``.
    """
    num_blocks, period = codes.shape
    cdt = sc.dtype
    pdt = param.dtype
    flat_p = param.view(-1)
    flat_g = grad.view(-1)
    flat_q = codes.view(-1)
    cb = codebook.to(cdt)
    for group in block_groups(num_blocks, period):
        nb = group.stop - group.first
        s_old = scale[group.first:group.stop].to(cdt)  # [nb, 1]
        single = len(group.tiles) == 1

        def load(start: int, end: int, rows: int, s_old: Tensor) -> tuple[Tensor, Tensor]:
            g = flat_g[start:end].view(rows, -1).to(cdt)
            if maximize:
                g = g.neg()
            m = momentum_ema(sc.beta1, sc.one_minus_beta1, s_old,
                             cb.index_select(0, flat_q[start:end].int()).view(rows, -1), g)
            return g, m

        rows = nb if single else 1

        # Pass 1: new block max (NaN-propagating) and, in block mode, sum of squares.
        amax: Tensor | None = None
        sumsq: Tensor | None = None
        kept: tuple[Tensor, Tensor] | None = None
        for start, end in group.tiles:
            g, m = load(start, end, rows, s_old)
            tile_max = m.abs().amax(dim=1, keepdim=True)
            amax = tile_max if amax is None else torch.maximum(amax, tile_max)
            if block_sigma is not None:
                tile_sum = (g * g).sum(dim=1, keepdim=True)
                sumsq = tile_sum if sumsq is None else sumsq + tile_sum
            if single:
                kept = (g, m)
            del g, m
        assert amax is not None
        # The stored scale is fp32; the fp64 path uses the stored value so mhat = c[q] * s.
        s_new = amax.to(torch.float32).to(cdt)
        sigma_b = block_sigma(group.first, group.stop, sumsq) if block_sigma is not None else None
        positive = s_new > 0
        s_div = torch.where(positive, s_new, torch.ones_like(s_new))

        # Pass 2: normalise, quantise, write codes and parameters.
        for start, end in group.tiles:
            g, m = kept if kept is not None else load(start, end, rows, s_old)
            z = torch.where(positive, m / s_div, torch.zeros_like(m)).to(torch.float32)
            zf = z.view(-1)
            uniform = None
            if stochastic_round:
                index = torch.arange(start, end, device=param.device, dtype=torch.int64)
                uniform = sr_uniform_int64(seed, index)
            # An exactly-zero gradient rounds toward zero (docs/algorithm.md#toward-zero-rounding).
            q = round_codes(zf, codebook, g.view(-1) == 0, stochastic=stochastic_round, u=uniform)
            del z, zf, m, g, uniform
            mhat = cb.index_select(0, q).view(s_new.shape[0], -1) * s_new
            flat_q[start:end].copy_(q.view(-1))
            del q
            if sc.lr_is_host_zero:
                continue
            if sigma_b is not None:
                sigma = sigma_b
            else:
                assert element_sigma is not None
                sigma, v_elem = element_sigma(start, end)
                sigma = sigma.view(mhat.shape)
                # A zero V means the row or column never had a gradient: exact momentum 0.
                mhat = torch.where(v_elem.view(mhat.shape) == 0, torch.zeros_like(mhat), mhat)
            u = (mhat * sigma) * sc.lr
            p_view = flat_p[start:end].view(mhat.shape)
            p_old = p_view.to(cdt)
            decayed = (p_old * sc.decay).to(pdt).to(cdt)
            new = (decayed - u).to(pdt)
            if sc.capturable:
                new = torch.where(torch.as_tensor(sc.lr) == 0, p_view, new)
            p_view.copy_(new)
            del u, p_old, decayed, new, mhat
        scale[group.first:group.stop].copy_(s_new)
