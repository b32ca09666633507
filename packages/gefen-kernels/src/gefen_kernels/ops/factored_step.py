"""Fused Gefen step, factored second-moment mode (docs/algorithm.md#factored-second-moment).

For a 2-D parameter ``[R, C]`` whose momentum is kept in ``B`` blocks of ``P`` elements of the
row-major flattening (as in block mode), in place on ``param``, ``codes``, ``scale``,
``exp_avg_sq_row`` (``r``, fp32 ``[R]``) and ``exp_avg_sq_col`` (``k``, fp32 ``[C]``):

1. ``r <- beta2 * r + (1 - beta2) * mean_j g_ij^2``;
   ``k <- beta2 * k + (1 - beta2) * mean_i g_ij^2``
2. ``rbar = max(mean(r), FLT_MIN)``; ``V_ij = r_i * k_j / rbar``;
   ``sigma_ij = bc1_recip / (sqrt(V_ij * bc2_recip) + eps)``
3. the momentum re-quantisation of block mode; ``p <- fp(fp(p * decay) - lr * sigma * mhat)``,
   with ``mhat = 0`` where ``V_ij == 0`` (see the non-finite/zero policy in
   :mod:`gefen_kernels._numerics`: rows and columns whose gradient was always zero never move).

Row-sharded parameters (a ``Shard(0)`` DTensor's local rows,
docs/algorithm.md#factored-second-moment, docs/algorithm.md#distributed) split steps 1-2 at the one
place that needs the other shards: :func:`factored_partial_stats` computes, without mutating
anything, this shard's ``r'`` (its rows are complete locally), the column sums of ``g^2`` over its
rows and ``sum(r')``; the caller sums the last ``C + 1`` values over the shards (one all-reduce,
outside this package) and passes them back as ``stats`` with the global row count to
:func:`factored_step`, which then applies ``k'``/``rbar`` and the update. With one shard and no
reduction the result is bit-identical to the one-call step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _numerics
from .. import _validation as V
from .._numerics import FLT_MIN, f32
from .._triton import require_triton
from ._device import check_device_for_triton, on_tensor_device, use_triton
from ._factored_step_kernels import (
    _FIN_COLS,
    _FIN_CONSTS,
    _FIN_ROWS,
    _cdiv,
    _factored_finalize_kernel,
    _factored_stats_kernel,
    stats_items_per_program,
    stats_layout,
    stats_prefetch,
)
from ._step_kernels import launch_step
from ._step_ref import ComputeScalars, denominator, make_scalars, run_step
from ._triton_helpers import LAUNCH_OPTIONS

__all__ = [
    "factored_finalize_stats",
    "factored_partial_stats",
    "factored_partial_stats_reference",
    "factored_step",
    "factored_step_reference",
    "factored_step_triton",
]


def _check(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor, row: Tensor, col: Tensor,
           codebook: Tensor, beta1: float, beta2: float, eps: float, seed: int,
           hyper: Tensor | None, seed_tensor: Tensor | None, *, allow_fp64: bool) -> None:
    V.check_param_grad(param, grad, allow_fp64=allow_fp64)
    if param.dim() != 2:
        raise ValueError(f"factored_step needs a 2-D param [R, C], got shape {list(param.shape)}")
    if tuple(grad.shape) != tuple(param.shape):
        raise ValueError(f"grad shape {list(grad.shape)} != param shape {list(param.shape)}")
    num_blocks, period = V.check_blocks(codes, param.numel())
    dev = param.device
    rows, cols = int(param.shape[0]), int(param.shape[1])
    V.check_state("codes", codes, torch.uint8, (num_blocks, period), dev)
    V.check_state("scale", scale, torch.float32, (num_blocks, 1), dev)
    V.check_state("exp_avg_sq_row", row, torch.float32, (rows,), dev)
    V.check_state("exp_avg_sq_col", col, torch.float32, (cols,), dev)
    V.check_codebook(codebook, dev)
    V.check_betas(beta1, beta2, eps)
    V.check_seed(seed)
    V.check_hyper(hyper, seed_tensor, dev)


def _row_col_sums(grad: Tensor, cdt: torch.dtype) -> tuple[Tensor, Tensor]:
    """fp32 (fp64 for fp64 params) sums of ``g^2`` over each row and each column, chunked."""
    rows, cols = grad.shape
    row_sum = torch.zeros(rows, dtype=cdt, device=grad.device)
    col_sum = torch.zeros(cols, dtype=cdt, device=grad.device)
    chunk = _numerics.CHUNK_ELEMENTS
    if cols <= chunk:
        per = max(1, chunk // cols)
        for r0 in range(0, rows, per):
            g = grad[r0:r0 + per].to(cdt)
            sq = g * g
            row_sum[r0:r0 + per] = sq.sum(dim=1)
            col_sum += sq.sum(dim=0)
    else:
        for r in range(rows):
            for c0 in range(0, cols, chunk):
                g = grad[r, c0:c0 + chunk].to(cdt)
                sq = g * g
                row_sum[r] += sq.sum()
                col_sum[c0:c0 + chunk] += sq
    return row_sum, col_sum


def _ema(state: Tensor, total: Tensor, inv_count: float, sc: ComputeScalars) -> Tensor:
    """r' = f32(f32(b2 * r) + f32((1 - b2) * f32(sum * f32(1/C)))) (no device scalars)."""
    inv = f32(inv_count) if sc.dtype == torch.float32 else inv_count
    return (state.to(sc.dtype) * sc.beta2) + ((total * inv) * sc.one_minus_beta2)


def _rbar_reciprocal(r: Tensor, rows: int) -> Tensor:
    """f32(1 / max(f32(f32(sum r) / f32(R)), FLT_MIN)), a 0-dim tensor (no host sync)."""
    return _inv_rbar_from_total(r.sum(), rows)


def _inv_rbar_from_total(total: Tensor, rows: int) -> Tensor:
    """``1 / max(total / R, FLT_MIN)`` from the 0-dim ``sum r`` (the same ops as above)."""
    return torch.reciprocal(torch.clamp(total / float(rows), min=FLT_MIN))


def _compute_dtype(param: Tensor) -> torch.dtype:
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def _check_stats(stats: Tensor | None, global_rows: int | None, param: Tensor) -> None:
    """``stats``: ``[R + C + 1]`` in the compute dtype on ``param``'s device, with
    ``global_rows >= max(R, 1)``; or both ``None``."""
    if stats is None:
        if global_rows is not None:
            raise ValueError("global_rows is given without stats; pass both or neither")
        return
    rows, cols = int(param.shape[0]), int(param.shape[1])
    if not isinstance(global_rows, int) or isinstance(global_rows, bool) \
            or global_rows < max(rows, 1):
        raise ValueError(f"global_rows must be an int >= max(local rows {rows}, 1) with stats, "
                         f"got {global_rows!r}")
    V.check_state("stats", stats, _compute_dtype(param), (rows + cols + 1,), param.device)


def _stats_scalars(cdt: torch.dtype, beta2: float) -> ComputeScalars:
    return make_scalars(dtype=cdt, lr=0.0, beta1=0.0, beta2=beta2, eps=0.0, bc1_recip=1.0,
                        bc2=1.0, decay=1.0, hyper=None)


def _partial_stats_reference(grad: Tensor, row: Tensor, cdt: torch.dtype,
                             beta2: float) -> Tensor:
    rows, cols = grad.shape
    out = torch.zeros(rows + cols + 1, dtype=cdt, device=grad.device)
    if grad.numel() == 0:
        out[:rows] = row.to(torch.float32)
        return out
    row_sum, col_sum = _row_col_sums(grad, cdt)
    # Rounded to the fp32 state first, as the one-call step stores r' before summing it.
    r_new = _ema(row, row_sum, 1.0 / cols, _stats_scalars(cdt, beta2)).to(torch.float32)
    out[:rows] = r_new
    out[rows:rows + cols] = col_sum
    out[rows + cols] = r_new.to(cdt).sum()
    return out


def _finalize_reference(row: Tensor, col: Tensor, stats: Tensor, global_rows: int,
                        sc: ComputeScalars) -> Tensor:
    """Install ``r'`` and the ``k`` EMA from (reduced) ``stats``; returns ``1/rbar`` (0-dim)."""
    rows, cols = row.numel(), col.numel()
    row.copy_(stats[:rows])
    col.copy_(_ema(col, stats[rows:rows + cols], 1.0 / global_rows, sc))
    return _inv_rbar_from_total(stats[rows + cols], global_rows)


def factored_partial_stats_reference(param: Tensor, grad: Tensor, exp_avg_sq_row: Tensor,
                                     exp_avg_sq_col: Tensor, *, beta2: float) -> Tensor:
    """This shard's part of docs/algorithm.md#factored-second-moment steps 1-2, for a row-sharded
    parameter; mutates nothing.

    Args:
        param, grad: the local rows ``[R, C]`` (contiguous; grad any float dtype).
        exp_avg_sq_row: fp32 ``[R]`` (this shard's rows); exp_avg_sq_col: fp32 ``[C]``.
        beta2: as in :func:`factored_step_reference`.

    Returns:
        ``stats`` ``[R + C + 1]`` in fp32 (fp64 for fp64 params): ``[:R]`` the new row
        statistics ``r'`` (already rounded to fp32), ``[R:R + C]`` the column sums of ``g^2``
        over these rows, ``[R + C]`` ``sum(r')``. Sum ``stats[R:]`` over the shards (every
        shard, empty ones adding zeros) and pass it to :func:`factored_step` as ``stats`` with
        ``global_rows``; unreduced with ``global_rows = R`` it reproduces the one-call step
        bit for bit.

    Raises:
        TypeError, ValueError: bad dtype, shape, device or ``beta2``.
    """
    _check_partial(param, grad, exp_avg_sq_row, exp_avg_sq_col, beta2)
    return _partial_stats_reference(grad, exp_avg_sq_row, _compute_dtype(param), beta2)


def factored_partial_stats(param: Tensor, grad: Tensor, exp_avg_sq_row: Tensor,
                           exp_avg_sq_col: Tensor, *, beta2: float) -> Tensor:
    """:func:`factored_partial_stats_reference` through the statistics kernels on CUDA with
    Triton (fp32 ``stats``, fixed-order sums, two launches, no host sync), else the reference.

    Raises:
        TypeError, ValueError: as the reference.
    """
    _check_partial(param, grad, exp_avg_sq_row, exp_avg_sq_col, beta2)
    if use_triton(param) and param.dtype != torch.float64:
        return _partial_stats_triton(_triton_grad(grad), exp_avg_sq_row, beta2)
    return _partial_stats_reference(grad, exp_avg_sq_row, _compute_dtype(param), beta2)


def factored_finalize_stats(exp_avg_sq_row: Tensor, exp_avg_sq_col: Tensor, stats: Tensor, *,
                            beta2: float, global_rows: int, reference: bool = False) -> Tensor:
    """Install ``r' = stats[:R]`` and ``k <- beta2 k + (1 - beta2) stats[R:R+C] / global_rows``
    in place; returns ``1/rbar`` with ``rbar = max(stats[R+C] / global_rows, FLT_MIN)``.

    What :func:`factored_step` does with ``stats`` before its update, for a shard that has no
    update to make (an empty ``Shard(0)`` shard, ``R = 0``), so its replicated ``k`` stays
    identical to the other shards'. Triton on CUDA unless ``reference``.

    Args:
        exp_avg_sq_row: fp32 ``[R]`` (``R`` may be 0); exp_avg_sq_col: fp32 ``[C]``.
        stats: reduced ``[R + C + 1]`` (fp32, or fp64 on the reference path).
        beta2, global_rows: as in :func:`factored_step`.

    Returns:
        ``1/rbar``: fp32 ``[1]`` (Triton) or a 0-dim tensor of ``stats``' dtype (reference).

    Raises:
        ValueError: shapes, dtypes or devices that do not match, ``global_rows < max(R, 1)``.
    """
    rows, cols = exp_avg_sq_row.numel(), exp_avg_sq_col.numel()
    dev = exp_avg_sq_col.device
    V.check_state("exp_avg_sq_row", exp_avg_sq_row, torch.float32, (rows,), dev)
    V.check_state("exp_avg_sq_col", exp_avg_sq_col, torch.float32, (cols,), dev)
    if not isinstance(stats, Tensor) or stats.dtype not in (torch.float32, torch.float64):
        raise ValueError("stats must be an fp32 or fp64 tensor")
    V.check_state("stats", stats, stats.dtype, (rows + cols + 1,), dev)
    if not isinstance(global_rows, int) or isinstance(global_rows, bool) \
            or global_rows < max(rows, 1):
        raise ValueError(f"global_rows must be an int >= max({rows}, 1), got {global_rows!r}")
    V.check_betas(0.0, beta2, 0.0)
    if not reference and use_triton(exp_avg_sq_col) and stats.dtype == torch.float32:
        return _finalize_triton(exp_avg_sq_row, exp_avg_sq_col, stats, global_rows, beta2)
    return _finalize_reference(exp_avg_sq_row, exp_avg_sq_col, stats, global_rows,
                               _stats_scalars(stats.dtype, beta2))


def _check_partial(param: Tensor, grad: Tensor, row: Tensor, col: Tensor, beta2: float) -> None:
    V.check_param_grad(param, grad, allow_fp64=True)
    if param.dim() != 2:
        raise ValueError(f"factored statistics need a 2-D param [R, C], got shape "
                         f"{list(param.shape)}")
    if tuple(grad.shape) != tuple(param.shape):
        raise ValueError(f"grad shape {list(grad.shape)} != param shape {list(param.shape)}")
    V.check_state("exp_avg_sq_row", row, torch.float32, (int(param.shape[0]),), param.device)
    V.check_state("exp_avg_sq_col", col, torch.float32, (int(param.shape[1]),), param.device)
    V.check_betas(0.0, beta2, 0.0)


def _triton_grad(grad: Tensor) -> Tensor:
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return grad.to(torch.float32)
    return grad


def factored_step_reference(
    param: Tensor,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    exp_avg_sq_row: Tensor,
    exp_avg_sq_col: Tensor,
    codebook: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    bc1_recip: float,
    bc2_recip: float,
    decay: float,
    maximize: bool = False,
    stochastic_round: bool = False,
    seed: int = 0,
    hyper: Tensor | None = None,
    seed_tensor: Tensor | None = None,
    stats: Tensor | None = None,
    global_rows: int | None = None,
) -> None:
    """PyTorch reference of the factored-mode step (docs/algorithm.md#factored-second-moment), in
    place.

    Args:
        param, grad: contiguous ``[R, C]``; param fp32/bf16/fp16 or fp64 (fp64 arithmetic,
            fp32 state); grad any float dtype.
        codes: uint8 ``[B, P]``; scale: fp32 ``[B, 1]`` (``B * P == R * C``).
        exp_avg_sq_row: fp32 ``[R]``; exp_avg_sq_col: fp32 ``[C]``.
        codebook: fp32 ``[256]``, sorted, endpoints -1 and +1.
        bc1_recip: ``1 / (1 - beta1**step)``; bc2_recip: ``1 / (1 - beta2**step_f)`` (not its
            root); decay: ``1 - lr * weight_decay``.
        hyper: optional fp32 ``[4]`` ``[lr, bc2_recip, bc1_recip, decay]`` on the device.
        stats: for a row-sharded parameter, :func:`factored_partial_stats_reference` of this
            shard with ``stats[R:]`` summed over every shard (fp32; fp64 for fp64 params,
            ``[R + C + 1]``); steps 1-2 then use it instead of this shard's gradient:
            ``r <- stats[:R]``, ``k <- beta2 k + (1 - beta2) stats[R:R+C] / global_rows``,
            ``rbar = max(stats[R+C] / global_rows, FLT_MIN)``. Not mutated.
        global_rows: the global row count; required with ``stats``, else ``None``.
        Other arguments as :func:`gefen_kernels.ops.block_step.block_step_reference`.

    Raises:
        TypeError, ValueError: bad dtype, shape, device, contiguity or hyperparameter, before
            anything is modified.
    """
    _check(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col, codebook, beta1, beta2,
           eps, seed, hyper, seed_tensor, allow_fp64=True)
    _check_stats(stats, global_rows, param)
    if param.numel() == 0:
        return
    rows, cols = param.shape
    cdt = _compute_dtype(param)
    sc = make_scalars(dtype=cdt, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      bc1_recip=bc1_recip, bc2=bc2_recip, decay=decay, hyper=hyper)
    if stats is not None:
        assert global_rows is not None
        inv_rbar = _finalize_reference(exp_avg_sq_row, exp_avg_sq_col, stats, global_rows, sc)
    else:
        row_sum, col_sum = _row_col_sums(grad, cdt)
        exp_avg_sq_row.copy_(_ema(exp_avg_sq_row, row_sum, 1.0 / cols, sc))
        exp_avg_sq_col.copy_(_ema(exp_avg_sq_col, col_sum, 1.0 / rows, sc))
        del row_sum, col_sum
        inv_rbar = _rbar_reciprocal(exp_avg_sq_row.to(cdt), rows)
    r = exp_avg_sq_row.to(cdt)
    k = exp_avg_sq_col.to(cdt)

    def element_sigma(start: int, end: int) -> tuple[Tensor, Tensor]:
        index = torch.arange(start, end, device=param.device, dtype=torch.int64)
        v_elem = (r[index // cols] * k[index % cols]) * inv_rbar
        del index
        h = torch.sqrt(v_elem * sc.bc2)
        return denominator(h, sc), v_elem

    run_step(param, grad, codes, scale, codebook, sc, maximize=maximize,
             stochastic_round=stochastic_round,
             seed=seed_tensor.view(()) if seed_tensor is not None else seed,
             block_sigma=None, element_sigma=element_sigma)


class _Partials:
    """Views into the one scratch allocation of a statistics launch (all fp32 but ``ticket``):
    ``row_part`` ``[n_splits, R]``, ``col_part`` ``[n_row_programs, C]``, ``block_sum``
    ``[cdiv(R, _FIN_ROWS)]``, ``spare`` ``[1]`` (``1/rbar``), ``ticket`` int32 ``[1]``."""

    __slots__ = ("block_sum", "col_part", "row_part", "spare", "ticket")

    def __init__(self, row_part: Tensor, col_part: Tensor, block_sum: Tensor, spare: Tensor,
                 ticket: Tensor) -> None:
        self.row_part, self.col_part, self.block_sum = row_part, col_part, block_sum
        self.spare, self.ticket = spare, ticket


def _stats_partials(grad: Tensor, layout: tuple[int, int, int, int, int] | None = None,
                    ) -> _Partials:
    """The statistics kernel's partial sums of ``g^2`` (one launch, one allocation)."""
    rows, cols = grad.shape
    rb, cb, splits, n_row_programs, rows_per_program = (
        layout if layout is not None else stats_layout(rows, cols))
    n_col_tiles = _cdiv(cols, cb)
    n_row = splits * rows
    n_col = n_row_programs * cols
    n_blocks = _cdiv(rows, _FIN_ROWS)
    scratch = torch.empty(n_row + n_col + n_blocks + 2, dtype=torch.float32, device=grad.device)
    parts = _Partials(scratch[:n_row].view(splits, rows),
                      scratch[n_row:n_row + n_col].view(n_row_programs, cols),
                      scratch[n_row + n_col:n_row + n_col + n_blocks], scratch[-2:-1],
                      scratch[-1:].view(torch.int32))
    items = stats_items_per_program((rb, cb, splits, n_row_programs, rows_per_program), cols)
    _factored_stats_kernel[(_cdiv(n_row_programs * splits, items),)](
        grad, parts.row_part, parts.col_part, parts.ticket, rows, cols, n_col_tiles, splits,
        _cdiv(n_col_tiles, splits), rows_per_program, items, RB=rb, CB=cb,
        PREFETCH=stats_prefetch(grad.element_size()), num_warps=8, **LAUNCH_OPTIONS)
    return parts


def _row_col_sums_triton(grad: Tensor) -> tuple[Tensor, Tensor]:
    """Row and column sums of ``g^2`` (fp32, fixed order) from the statistics kernel."""
    parts = _stats_partials(grad)
    return parts.row_part.sum(dim=0), parts.col_part.sum(dim=0)


def _finalize_grid(rows: int, cols: int) -> tuple[int]:
    return (max(1, _cdiv(rows, _FIN_ROWS) + _cdiv(cols, _FIN_COLS)),)



@on_tensor_device
def factored_stats_triton(grad: Tensor, exp_avg_sq_row: Tensor, exp_avg_sq_col: Tensor, *,
                          beta2: float,
                          layout: tuple[int, int, int, int, int] | None = None) -> Tensor:
    """Steps 1-2 of docs/algorithm.md#factored-second-moment in two launches: the r/k EMA in place;
    returns ``1/rbar`` as an fp32 ``[1]`` device tensor. One allocation (the partials), no host
    synchronisation, no torch op in between. ``grad`` is ``[R, C]`` contiguous fp32/bf16/fp16;
    ``layout`` is
    :func:`stats_layout` of its shape (computed here when not given).

    The EMA is the reference's expression (:func:`_ema`), so ``r``/``k`` differ from it only
    through the summation order of ``sum g^2`` (a few fp32 ulps).
    """
    rows, cols = grad.shape
    parts = _stats_partials(grad, layout)
    b2 = f32(beta2)
    inv_rbar = parts.spare
    _factored_finalize_kernel[_finalize_grid(rows, cols)](
        parts.row_part, parts.col_part, exp_avg_sq_row, exp_avg_sq_row, exp_avg_sq_col,
        inv_rbar, inv_rbar, inv_rbar, parts.block_sum, parts.ticket, rows, cols,
        parts.row_part.shape[0], parts.col_part.shape[0], rows, f32(1.0 / cols),
        f32(1.0 / rows), b2, f32(1.0 - b2), PHASE=0, **_FIN_CONSTS)
    return inv_rbar


def _partial_stats_triton(grad: Tensor, exp_avg_sq_row: Tensor, beta2: float) -> Tensor:
    """:func:`factored_partial_stats` on the kernels: fp32 ``[R + C + 1]``, two launches."""
    rows, cols = grad.shape
    out = torch.empty(rows + cols + 1, dtype=torch.float32, device=grad.device)
    if grad.numel() == 0:
        out.zero_()
        out[:rows] = exp_avg_sq_row
        return out
    parts = _stats_partials(grad)
    b2 = f32(beta2)
    _factored_finalize_kernel[_finalize_grid(rows, cols)](
        parts.row_part, parts.col_part, exp_avg_sq_row, out, out, out[rows:],
        out[rows + cols:], parts.spare, parts.block_sum, parts.ticket, rows, cols,
        parts.row_part.shape[0], parts.col_part.shape[0], rows, f32(1.0 / cols),
        f32(1.0 / rows), b2, f32(1.0 - b2), PHASE=1, **_FIN_CONSTS)
    return out


def _finalize_triton(exp_avg_sq_row: Tensor, exp_avg_sq_col: Tensor, stats: Tensor,
                     global_rows: int, beta2: float) -> Tensor:
    """PHASE 2 of the finalize kernel: one launch; returns ``1/rbar`` as fp32 ``[1]``."""
    rows, cols = exp_avg_sq_row.numel(), exp_avg_sq_col.numel()
    inv_rbar = torch.empty(1, dtype=torch.float32, device=stats.device)
    # An empty row vector may have no storage; with nrows = 0 its pointer is never read.
    row_out = exp_avg_sq_row if rows else stats
    b2 = f32(beta2)
    # The partial, block-sum and ticket pointers are never read in PHASE 2.
    _factored_finalize_kernel[_finalize_grid(rows, cols)](
        stats, stats, stats, row_out, exp_avg_sq_col, stats[rows:], stats[rows + cols:],
        inv_rbar, stats, stats, rows, cols, 1, 1, global_rows, f32(1.0 / max(cols, 1)),
        f32(1.0 / global_rows), b2, f32(1.0 - b2), PHASE=2, **_FIN_CONSTS)
    return inv_rbar


@on_tensor_device
def factored_step_triton(
    param: Tensor,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    exp_avg_sq_row: Tensor,
    exp_avg_sq_col: Tensor,
    codebook: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    bc1_recip: float,
    bc2_recip: float,
    decay: float,
    maximize: bool = False,
    stochastic_round: bool = False,
    seed: int = 0,
    hyper: Tensor | None = None,
    seed_tensor: Tensor | None = None,
    stats: Tensor | None = None,
    global_rows: int | None = None,
) -> None:
    """Triton factored-mode step; same signature and contract as the reference.

    Three launches: the statistics kernel (row and column partial sums of ``g^2``), the
    finalize kernel (fixed-order sums, the r/k EMA with the reference's exact expression,
    ``1/rbar`` as a device scalar: no host sync), then the shared update kernel with ``sigma``
    per element in registers. Codes and scales equal the reference's bit for
    bit; ``r``/``k`` may differ by fp32 ulps (summation order), parameters accordingly.
    With ``stats`` (a row shard, see the reference) the first two launches are replaced by one
    finalize launch that reads the reduced sums.

    Raises:
        ImportError: Triton is not installed. TypeError, ValueError: as the reference, plus
            fp64 params and non-CUDA tensors outside the interpreter.
    """
    _check(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col, codebook, beta1, beta2,
           eps, seed, hyper, seed_tensor, allow_fp64=False)
    _check_stats(stats, global_rows, param)
    require_triton("the Triton Gefen factored step")
    check_device_for_triton(param)
    if param.numel() == 0:
        return
    grad = _triton_grad(grad)
    rows, cols = param.shape
    if stats is not None:
        assert global_rows is not None
        inv_rbar = _finalize_triton(exp_avg_sq_row, exp_avg_sq_col, stats, global_rows, beta2)
    else:
        inv_rbar = factored_stats_triton(grad, exp_avg_sq_row, exp_avg_sq_col, beta2=beta2)
    launch_step(param, grad, codes, scale, exp_avg_sq=None, row=exp_avg_sq_row,
                col=exp_avg_sq_col, inv_rbar=inv_rbar, ncols=cols, codebook=codebook, lr=lr,
                beta1=beta1, beta2=beta2, eps=eps, bc1_recip=bc1_recip, bc2=bc2_recip,
                decay=decay, maximize=maximize, stochastic_round=stochastic_round, seed=seed,
                hyper=hyper, seed_tensor=seed_tensor)


# --------------------------------------------------------------------------------------------
# torch.library custom op
# --------------------------------------------------------------------------------------------


@torch.library.custom_op(
    "gefen::factored_step",
    mutates_args=("param", "codes", "scale", "exp_avg_sq_row", "exp_avg_sq_col"))
def _factored_step_op(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor,
                      exp_avg_sq_row: Tensor, exp_avg_sq_col: Tensor, codebook: Tensor,
                      hyper: Tensor | None, seed_tensor: Tensor | None, lr: float,
                      beta1: float, beta2: float, eps: float, bc1_recip: float,
                      bc2_recip: float, decay: float, maximize: bool, stochastic_round: bool,
                      seed: int, stats: Tensor | None = None, global_rows: int = 0) -> None:
    factored_step_reference(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col, codebook,
                            lr=lr, beta1=beta1, beta2=beta2, eps=eps, bc1_recip=bc1_recip,
                            bc2_recip=bc2_recip, decay=decay, maximize=maximize,
                            stochastic_round=stochastic_round, seed=seed, hyper=hyper,
                            seed_tensor=seed_tensor, stats=stats,
                            global_rows=global_rows if stats is not None else None)


@_factored_step_op.register_kernel("cuda")
def _factored_step_cuda(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor,
                        exp_avg_sq_row: Tensor, exp_avg_sq_col: Tensor, codebook: Tensor,
                        hyper: Tensor | None, seed_tensor: Tensor | None, lr: float,
                        beta1: float, beta2: float, eps: float, bc1_recip: float,
                        bc2_recip: float, decay: float, maximize: bool,
                        stochastic_round: bool, seed: int, stats: Tensor | None = None,
                        global_rows: int = 0) -> None:
    impl = (factored_step_triton if use_triton(param) and param.dtype != torch.float64
            else factored_step_reference)
    impl(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col, codebook, lr=lr,
         beta1=beta1, beta2=beta2, eps=eps, bc1_recip=bc1_recip, bc2_recip=bc2_recip,
         decay=decay, maximize=maximize, stochastic_round=stochastic_round, seed=seed,
         hyper=hyper, seed_tensor=seed_tensor, stats=stats,
         global_rows=global_rows if stats is not None else None)


@_factored_step_op.register_fake
def _factored_step_fake(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor,
                        exp_avg_sq_row: Tensor, exp_avg_sq_col: Tensor, codebook: Tensor,
                        hyper: Tensor | None, seed_tensor: Tensor | None, lr: float,
                        beta1: float, beta2: float, eps: float, bc1_recip: float,
                        bc2_recip: float, decay: float, maximize: bool,
                        stochastic_round: bool, seed: int, stats: Tensor | None = None,
                        global_rows: int = 0) -> None:
    return None


def factored_step(
    param: Tensor,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    exp_avg_sq_row: Tensor,
    exp_avg_sq_col: Tensor,
    codebook: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    bc1_recip: float,
    bc2_recip: float,
    decay: float,
    maximize: bool = False,
    stochastic_round: bool = False,
    seed: int = 0,
    hyper: Tensor | None = None,
    seed_tensor: Tensor | None = None,
    stats: Tensor | None = None,
    global_rows: int | None = None,
) -> None:
    """Factored-mode step through ``torch.ops.gefen.factored_step`` (arguments as the reference).

    CUDA tensors take the Triton path when Triton is available (fp64: the reference); CPU
    tensors the native CPU step (``ops._cpu_step``). ``stats``/``global_rows``: a row shard's
    reduced statistics (see :func:`factored_partial_stats`). Validated here before anything
    is mutated; compile- and CUDA-graph-safe (with ``hyper``/``seed_tensor``).
    """
    _check(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col, codebook, beta1, beta2,
           eps, seed, hyper, seed_tensor, allow_fp64=True)
    _check_stats(stats, global_rows, param)
    torch.ops.gefen.factored_step(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col,
                                  codebook, hyper, seed_tensor, float(lr), float(beta1),
                                  float(beta2), float(eps), float(bc1_recip), float(bc2_recip),
                                  float(decay), bool(maximize), bool(stochastic_round),
                                  int(seed), stats, int(global_rows or 0))
