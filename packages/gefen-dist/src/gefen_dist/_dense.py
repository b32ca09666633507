"""Dense forms of Gefen's compact state, and back, for :class:`gefen_dist.GefenDCPState`.

A checkpoint holds every parameter's momentum and second moment in forms that do not depend
on the blocks or on the mode the saving optimizer used (docs/algorithm.md#checkpoint-format):

* momentum: fp32 ``c[q] * s``, shaped like the parameter;
* ``exp_avg_sq``: the fp32 second moment each element was stepped with, shaped like the
  parameter: a block's value repeated over its elements, or ``V_ij = r_i k_j / rbar`` for a
  factored matrix (docs/algorithm.md#factored-second-moment);
* for every 2-D parameter, also ``exp_avg_sq_row`` fp32 ``[R]`` and ``exp_avg_sq_col`` fp32
  ``[C]``: the factored statistics themselves, or, for a matrix stepped with per-block values,
  the row and column means of its dense second moment (the factorization Adafactor keeps).

A loading optimizer takes what its own mode needs, so either mode loads into the other. Within
one mode the round trip is exact where the blocks align; across modes it is the approximation
of re-factoring (or re-blocking) the second moment.

The column means and ``rbar`` are means over all rows, which a ``Shard(0)`` rank does not
hold: :func:`matrix_partials` gives each rank's part, one all-reduce sums them, and
:func:`matrix_stats` finishes.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "dense_block_values",
    "dense_momentum",
    "factored_dense",
    "matrix_partials",
    "matrix_stats",
    "reblock",
]

#: Elements dequantized at once when building a dense tensor (bounds the int64 index copy).
_CHUNK = 1 << 22
_FLT_MIN = float(torch.finfo(torch.float32).tiny)


def dense_momentum(
    codes: Tensor, scale: Tensor, codebook: Tensor, local_shape: tuple[int, ...]
) -> Tensor:
    """fp32 ``c[q] * s`` in the local parameter shape, dequantized in chunks of whole blocks."""
    blocks, period = codes.shape
    out = torch.empty(blocks, period, dtype=torch.float32, device=codes.device)
    cb = codebook.to(device=codes.device, dtype=torch.float32)
    step = max(1, _CHUNK // max(period, 1))
    for b in range(0, blocks, step):
        q = codes[b : b + step].long()
        torch.mul(cb[q], scale[b : b + step], out=out[b : b + step])
    return out.reshape(local_shape)


def dense_block_values(values: Tensor, period: int, local_shape: tuple[int, ...]) -> Tensor:
    """fp32 ``[B, 1]`` -> each block's value repeated over its ``period`` elements."""
    return values.to(torch.float32).expand(-1, period).reshape(local_shape).contiguous()


def factored_dense(row: Tensor, col: Tensor, inv_rbar: float) -> Tensor:
    """fp32 ``V_ij = (r_i * k_j) * (1 / rbar)`` for the local rows, in the factored step's
    order of operations (docs/algorithm.md#factored-second-moment)."""
    inv = torch.tensor(inv_rbar, dtype=torch.float32, device=row.device)
    return torch.outer(row.to(torch.float32), col.to(torch.float32)).mul_(inv)


def matrix_partials(
    state: tuple[Tensor, ...] | None,
    factored: bool,
    period: int,
    local_shape: tuple[int, ...],
    cols: int,
) -> tuple[Tensor, Tensor]:
    """One rank's part of a matrix slot's global statistics: ``(local, partial)``.

    Factored (``state = (codes, scale, r, k)``): ``local`` is ``r``, ``partial`` fp64 ``[1]``
    ``sum(r)``. Per-block (``state = (codes, scale, v)``): ``local`` the fp32 row means of the
    dense second moment over this rank's rows, ``partial`` fp64 ``[C]`` its column sums.
    Uninitialized (``state is None``): zeros of the same shapes. The partials of all ranks
    are summed (one all-reduce) before :func:`matrix_stats`.
    """
    rows = local_shape[0]
    if factored:
        if state is None:
            return torch.zeros(rows, dtype=torch.float32), torch.zeros(1, dtype=torch.float64)
        r = state[2]
        return r, r.detach().to(torch.float64).sum().reshape(1).cpu()
    if state is None:
        return torch.zeros(rows, dtype=torch.float32), torch.zeros(cols, dtype=torch.float64)
    v = dense_block_values(state[2], period, local_shape).to(torch.float64)
    row = (v.sum(dim=1) / cols).to(torch.float32)
    return row, v.sum(dim=0).cpu()


def matrix_stats(
    state: tuple[Tensor, ...] | None,
    factored: bool,
    local: Tensor,
    total: Tensor,
    global_rows: int,
    cols: int,
) -> tuple[Tensor, Tensor, float]:
    """``(row, col, inv_rbar)`` of a matrix slot from its summed partial ``total``.

    Factored: the state's ``r`` and ``k`` and ``1 / max(f32(sum r / R), FLT_MIN)``, the
    ``rbar`` of the step. Per-block: the row means and ``col = f32(column sums / R)``;
    ``inv_rbar`` is unused (0). Uninitialized: zeros.
    """
    if state is None:
        return local, torch.zeros(cols, dtype=torch.float32), 0.0
    if factored:
        mean = float(torch.tensor(float(total[0]) / max(global_rows, 1), dtype=torch.float32))
        return local, state[3], float(torch.tensor(1.0 / max(mean, _FLT_MIN), dtype=torch.float32))
    return local, (total / max(global_rows, 1)).to(torch.float32), 0.0


def reblock(
    momentum: Tensor, second_moment: Tensor, period: int, codebook: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Dense local fp32 momentum and second moment -> ``(codes, scale, exp_avg_sq)``.

    ``s_b = max|m|``, ``q = nearest(m / s_b)`` (0 where ``s_b = 0``), ``v_b`` = the mean of the
    dense second moment over the block, accumulated in fp64 (exact for a block of equal values).
    """
    from gefen_kernels.ops.quantize import quantize_nearest_reference

    m = momentum.reshape(-1, period).to(torch.float32)
    scale = m.abs().amax(dim=1, keepdim=True) if m.numel() else m.new_zeros(0, 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    z = torch.where(scale > 0, m / safe, torch.zeros_like(m))
    codes = quantize_nearest_reference(z, codebook.to(m.device)).reshape(-1, period)
    v = second_moment.reshape(-1, period).to(torch.float64).mean(dim=1, keepdim=True)
    return codes.to(torch.uint8).contiguous(), scale.contiguous(), v.to(torch.float32)
