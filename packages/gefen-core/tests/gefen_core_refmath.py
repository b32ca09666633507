"""An independent float64 implementation of the Gefen update (docs/algorithm.md#histogram,
docs/algorithm.md#quantizer, docs/algorithm.md#block-second-moment,
docs/algorithm.md#factored-second-moment), written from the spec for the tests. It shares no code
with gefen_core or gefen_kernels."""

from __future__ import annotations

import torch
from torch import Tensor

FLT_MIN = 1.1754943508222875e-38


def nearest_codes(z: Tensor, codebook: Tensor) -> Tensor:
    """docs/algorithm.md#quantizer nearest codeword, ties to the lower index, on float64 values."""
    c = codebook.to(torch.float64)
    j = torch.searchsorted(c, z.contiguous(), right=False)
    right = j.clamp(0, c.numel() - 1)
    left = (right - 1).clamp(min=0)
    take_left = (z - c[left]).abs() <= (z - c[right]).abs()
    return torch.where(take_left, left, right)


def histogram(grad: Tensor, period: int) -> Tensor:
    """docs/algorithm.md#histogram: int64 [4096] counts of block-normalised values (fp32
    normalisation)."""
    g = grad.detach().reshape(-1, period).to(torch.float32)
    amax = g.abs().amax(dim=1, keepdim=True)
    z = torch.where(amax > 0, g / torch.where(amax > 0, amax, torch.ones_like(amax)),
                    torch.zeros_like(g))
    bins = torch.clamp(torch.floor((z + 1) * 2048), 0, 4095).to(torch.int64)
    return torch.bincount(bins.reshape(-1), minlength=4096)


def gefen_step64(
    param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor, codebook: Tensor, *,
    exp_avg_sq: Tensor | None = None, row: Tensor | None = None, col: Tensor | None = None,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
    sq_step: int, maximize: bool = False,
) -> dict[str, Tensor]:
    """One step in float64 from the given (pre-step) state; returns the new state.

    Block mode when ``exp_avg_sq`` is given, factored mode (2-D ``param``) when ``row`` and
    ``col`` are given. ``step``/``sq_step`` are the ages *after* this step's increment.
    """
    f64 = torch.float64
    p = param.detach().to(f64).clone()
    g = grad.detach().to(f64)
    if maximize:
        g = -g
    blocks, period = codes.shape
    c = codebook.to(f64)
    gb = g.reshape(blocks, period)
    # Bias corrections in fp64 from the exact betas; for fp32/bf16/fp16 parameters the EMAs use
    # the betas cast to fp32 with 1 - beta formed in fp32 (docs/algorithm.md#block-second-moment
    # canonical rounding; exact in fp64 by Sterbenz), fp64 parameters keep fp64 betas
    # (docs/algorithm.md#state-layout).
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** sq_step
    if param.dtype != torch.float64:
        beta1 = float(torch.tensor(beta1, dtype=torch.float32))
        beta2 = float(torch.tensor(beta2, dtype=torch.float32))
    out: dict[str, Tensor] = {}
    if exp_avg_sq is not None:
        v = beta2 * exp_avg_sq.to(f64) + (1 - beta2) * (gb * gb).mean(dim=1, keepdim=True)
        sigma = (1.0 / bc1) / (torch.sqrt(v) / bc2 ** 0.5 + eps)  # [B, 1]
        sigma_flat = sigma.expand(blocks, period).reshape(-1)
        out["exp_avg_sq"] = v
        zero_v = torch.zeros_like(sigma_flat, dtype=torch.bool)
    else:
        assert row is not None and col is not None and p.ndim == 2
        g2 = g * g
        r = beta2 * row.to(f64) + (1 - beta2) * g2.mean(dim=1)
        k = beta2 * col.to(f64) + (1 - beta2) * g2.mean(dim=0)
        rbar = max(float(r.mean()), FLT_MIN)
        big_v = r[:, None] * k[None, :] / rbar
        sigma_flat = ((1.0 / bc1) / (torch.sqrt(big_v / bc2) + eps)).reshape(-1)
        # contracts.md: rows/columns whose gradient is always zero must not drift (V == 0).
        zero_v = (big_v == 0).reshape(-1)
        out["exp_avg_sq_row"], out["exp_avg_sq_col"] = r, k
    if weight_decay != 0:
        p = p * (1 - lr * weight_decay)
    m = beta1 * (scale.to(f64) * c[codes.long()]) + (1 - beta1) * gb
    s = m.abs().amax(dim=1, keepdim=True)
    z = torch.where(s > 0, m / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(m))
    q = nearest_codes(z.reshape(-1), codebook).reshape(blocks, period)
    mhat = (c[q] * s).reshape(-1)
    update = torch.where(zero_v, torch.zeros_like(mhat), lr * sigma_flat * mhat)
    out["param"] = (p.reshape(-1) - update).reshape(param.shape)
    out["exp_avg_codes"] = q
    out["exp_avg_scale"] = s
    out["momentum"] = m
    return out
