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
from .._triton import jit, program_elements, require_triton, tl
from ._dispatch import check_device_for_triton, on_tensor_device, use_triton
from ._step_kernels import launch_step
from ._step_ref import StepScalars, denominator, make_scalars, run_step
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


def _ema(state: Tensor, total: Tensor, inv_count: float, sc: StepScalars) -> Tensor:
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


def _stats_scalars(cdt: torch.dtype, beta2: float) -> StepScalars:
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
                        sc: StepScalars) -> Tensor:
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


# --------------------------------------------------------------------------------------------
# Triton: row/column statistics kernel + the shared update kernels of _step_kernels.py
# --------------------------------------------------------------------------------------------

# Statistics kernel: one program per (row strip, column split); a split is `tiles_per_split`
# consecutive [RB, CB] column tiles (one, unless the row partials would exceed their bound).
_STATS_TILE = 8192  # elements of one [RB, CB] tile: 16 KiB of bf16 in flight per iteration
_STATS_CB = 256  # columns per tile: one warp's 32 lanes x 8 bf16 (16-byte vectors) per row
_STATS_PROGRAMS = 2048  # about 15 programs per SM on a 132-SM H200 (short last wave)
# Row strips of at least this many [RB, CB] chunks where the rows allow: a strip's column sums
# stay in registers from chunk to chunk and are reduced across warps and stored once per
# strip, not once per chunk. Part of the layout: it sets the column sums' order. H200,
# grouped statistics + finalize of the Llama-3.2-1B
# 2-D set: 3.23 ms with one chunk per strip (the layout before 2026-11-30), 1.46 with 4, 1.16
# with 8, 1.01 with 16, 0.95 with 32. Taller strips leave fewer programs, which a one-tensor
# launch feels: bf16 [2048, 8192] alone took 0.08 ms with 1 or 8 chunks, 0.15 with 16. 8 was
# chosen when Llama's 11 loop-route [2048, 8192] tensors still had one-tensor statistics
# launches (the full step: 11.76 ms with 8, 12.15 with 16, other calls); they are grouped
# since, and 16 or 32 have not been measured in the full step again. One-tensor launches
# remain for unaligned tensors, the CUDA-graph path and the custom ops.
_STATS_STRIP_CHUNKS = 8
# Work items (one row strip x one split) per program: enough [RB, CB] chunks per program
# (_STATS_CHUNKS) to amortise its start and keep the next chunk's load in flight, but at
# least _STATS_MIN_PROGRAMS programs per tensor while items allow, so one tensor still fills
# the GPU. Speed only: the sums do not depend on these. H200 sweep (bit-identical, within 3%
# of each other): 4, 8 or 16 chunks alike; 256 minimum
# programs 1-2% faster than 512 on every case (not yet adopted: one run).
_STATS_CHUNKS = 8
_STATS_MIN_PROGRAMS = 512
# Prefetch the next chunk (one more chunk of registers: 80 -> 99 registers for bf16, still two
# 8-warp programs per SM) for gradients of at most this many bytes per element. Speed only. On
# the H200 fp32 gradients also gained from it (4 x [8192, 2048]: 0.193 -> 0.174 ms, 128 -> 173
# registers), not adopted untested with the GPU suite.
_STATS_PREFETCH_MAX_BYTES = 2
_STATS_MAX_ROW_PROGRAMS = 512  # bounds the column partials the finalize sums per column
_STATS_MAX_SPLITS = 1024  # bounds the row partials the finalize sums per row
_STATS_ROW_PART_FLOATS = 1 << 20  # row partials beyond R floats: <= 4 MiB
_STATS_COL_PART_FLOATS = 1 << 20  # column partials beyond C floats: <= 4 MiB
# Finalize kernel: [_FIN_SR, _FIN_ROWS] row-partial chunks, [_FIN_SP, _FIN_COLS] column-partial
# chunks, _FIN_TOTAL block sums of r' per iteration of the last program.
_FIN_ROWS = 256
_FIN_SR = 16
_FIN_COLS = 64
_FIN_SP = 64
_FIN_TOTAL = 1024


@jit
def _factored_stats_kernel(g_ptr, row_part_ptr, col_part_ptr, ticket_ptr, nrows, ncols,  # type: ignore[no-untyped-def]
                           n_col_tiles, n_splits, tiles_per_split, rows_per_program,
                           items_per_program, RB: tl.constexpr, CB: tl.constexpr,
                           PREFETCH: tl.constexpr):
    """The statistics of one gradient: program ``pid`` runs :func:`_stats_program`."""
    _stats_program(tl.program_id(0), g_ptr, row_part_ptr, col_part_ptr, ticket_ptr, nrows,
                   ncols, n_col_tiles, n_splits, tiles_per_split, rows_per_program,
                   items_per_program, RB, CB, PREFETCH)


@jit
def _stats_item(w, nrows, n_col_tiles, n_splits, tiles_per_split, rows_per_program):  # type: ignore[no-untyped-def]
    """Work item ``w`` of the statistics kernel: ``(row strip, split, first row, row stop,
    first tile, tile stop)``."""
    pr = w // n_splits
    ps = w - pr * n_splits
    first = pr * rows_per_program
    t0 = ps * tiles_per_split
    return (pr, ps, first, tl.minimum(first + rows_per_program, nrows), t0,
            tl.minimum(t0 + tiles_per_split, n_col_tiles))


@jit
def _stats_load(g_ptr, start, t, stop, lanes, lane_offs, ncols, CB: tl.constexpr):  # type: ignore[no-untyped-def]
    """The ``[RB, CB]`` chunk of rows ``start ..`` (below ``stop``) and column tile ``t`` in
    the gradient's dtype (half the registers of fp32 while it waits for its turn), zero outside
    the matrix (``stop = 0``: none)."""
    cols = t * CB + tl.arange(0, CB)
    rmask = start + lanes < stop
    base = g_ptr + start.to(tl.int64) * ncols
    return tl.load(base + lane_offs[:, None] + cols[None, :],
                   mask=rmask[:, None] & (cols < ncols)[None, :], other=0.0)


@jit
def _stats_program(pid, g_ptr, row_part_ptr, col_part_ptr, ticket_ptr, nrows, ncols,  # type: ignore[no-untyped-def]
                   n_col_tiles, n_splits, tiles_per_split, rows_per_program, items_per_program,
                   RB: tl.constexpr, CB: tl.constexpr, PREFETCH: tl.constexpr):
    """Partial sums of g^2 (fp32) of ``items_per_program`` consecutive work items of a
    ``[R, C]`` gradient. Work item ``w`` is the ``[rows_per_program, tiles_per_split * CB]``
    block of row strip ``w // n_splits`` and split ``w % n_splits``; program ``pid`` does
    items ``pid * items_per_program ..`` (below ``n_row_programs * n_splits``) in order.

    g_ptr: ``[R, C]`` contiguous (fp32/bf16/fp16). row_part_ptr: fp32 ``[n_splits, R]``, the
    sum of each row over a split's columns (tile by tile in column order). col_part_ptr:
    fp32 ``[n_row_programs, C]``, the sum of each column over a strip's rows. ticket_ptr:
    int32 ``[1]``, zeroed here for the finalize kernel's ticket.

    The column sums accumulate in a ``[RB, CB]`` register tile, reduced across warps once per
    column tile; with ``CB = 256`` (bf16/fp16: 32 lanes x 16 bytes) each warp holds whole rows,
    so the per-iteration row sums are warp shuffles only, and they are stored contiguously
    (``[n_splits, R]``). Later tiles of a split add to the row sums stored by the earlier ones
    (read back after a CTA barrier; the same program wrote them). Tile offsets are int32, the
    row base int64, so no offset overflows below ``2**31`` columns. Fixed order, no atomics.

    Speed (same sums, bit for bit, as one item per program without prefetch): the chunks of a
    program's items form one sequence, and the load of the next ``[RB, CB]`` chunk (possibly
    of the next tile or item) is issued before the current one is reduced, so one load is
    always in flight per warp; several items per program amortise the per-program start (the
    grouped kernel's table lookups) over more bytes. The arithmetic on each chunk and the
    order of every sum are those of the one-item loop (``acc`` restarts from zeros at each
    tile, the row sums of a split's first tile add to a masked 0.0).

    Measured on an H200 (Triton 3.6), grouped statistics + finalize launch, old (one
    item per program, no prefetch) -> this: 16 x bf16 ``[8192, 2048]`` 0.978 -> 0.842 ms,
    16 x ``[2048, 8192]`` 0.954 -> 0.814 ms, ``[128256, 2048]`` 0.317 -> 0.222 ms (1.66 -> 2.37
    TB/s of gradient read; copy 4.28 TB/s), the Llama-3.2-1B 2-D set 3.51 -> 3.13 ms, 4 x fp32
    ``[8192, 2048]`` 0.212 -> 0.193 ms; every scratch word and ``r``/``k`` bit-identical. The
    prefetch gives most of the gain on items of many chunks (the embedding: 0.284 ms without
    it). Items of one chunk (``rows_per_program = RB``, then every Llama shape but the
    embedding) ran near 0.65 TB/s, bound by the per-item column reduction: the layout now
    gives strips of ``_STATS_STRIP_CHUNKS`` chunks where the rows allow (a new column-sum
    order; see that constant for the effect).
    """
    if pid == 0:
        tl.store(ticket_ptr, 0)
    n_items = tl.cdiv(nrows, rows_per_program) * n_splits
    w = pid * items_per_program
    w_end = tl.minimum(w + items_per_program, n_items)
    lanes = tl.arange(0, RB)
    lane_offs = lanes.to(tl.int64) * ncols
    pr, ps, first, stop, t0, t_end = _stats_item(w, nrows, n_col_tiles, n_splits,
                                                 tiles_per_split, rows_per_program)
    t = t0
    start = first
    if PREFETCH:
        g = _stats_load(g_ptr, start, t, tl.where(w < w_end, stop, 0), lanes, lane_offs,
                        ncols, CB)
    acc = tl.zeros([RB, CB], dtype=tl.float32)
    # while, not range(): Triton 3.3's interpreter cannot take a runtime loop bound.
    while w < w_end:
        # The position of the next chunk: the next rows of this tile, else the first rows of
        # the next tile of this split, else the first chunk of the next item.
        n_w = w
        n_pr = pr
        n_ps = ps
        n_first = first
        n_stop = stop
        n_t0 = t0
        n_t_end = t_end
        n_t = t
        n_start = start + RB
        if n_start >= stop:
            n_start = first
            n_t = t + 1
            if n_t >= t_end:
                n_w = w + 1
                n_pr, n_ps, n_first, n_stop, n_t0, n_t_end = _stats_item(
                    n_w, nrows, n_col_tiles, n_splits, tiles_per_split, rows_per_program)
                n_t = n_t0
                n_start = n_first
        if PREFETCH:
            g_next = _stats_load(g_ptr, n_start, n_t, tl.where(n_w < w_end, n_stop, 0), lanes,
                                 lane_offs, ncols, CB)
        else:
            g = _stats_load(g_ptr, start, t, stop, lanes, lane_offs, ncols, CB)
        # The current chunk: rows start .. of tile t of item w.
        rows = start + lanes
        rmask = rows < stop
        g32 = g.to(tl.float32)
        sq = g32 * g32
        acc += sq
        row_part = row_part_ptr + ps.to(tl.int64) * nrows
        # +0.0 for the first tile of the split: exact, so one store order for every split.
        prev = tl.load(row_part + rows, mask=rmask & (lanes * 0 + t > t0), other=0.0)
        tl.store(row_part + rows, prev + tl.sum(sq, axis=1), mask=rmask)
        if start + RB >= stop:
            cols = t * CB + tl.arange(0, CB)
            tl.store(col_part_ptr + pr.to(tl.int64) * ncols + cols, tl.sum(acc, axis=0),
                     mask=cols < ncols)
            acc = tl.zeros([RB, CB], dtype=tl.float32)
            # The next tile reads the row sums other threads of this program stored.
            tl.debug_barrier()
        if PREFETCH:
            g = g_next
        w = n_w
        pr = n_pr
        ps = n_ps
        first = n_first
        stop = n_stop
        t0 = n_t0
        t_end = n_t_end
        t = n_t
        start = n_start


@jit
def _factored_finalize_kernel(row_part_ptr, col_part_ptr, row_in_ptr, row_out_ptr, col_ptr,  # type: ignore[no-untyped-def]
                              col_sum_ptr, total_ptr, inv_rbar_ptr, block_sum_ptr, ticket_ptr,
                              nrows, ncols, n_splits, n_row_programs, rbar_rows, inv_c, inv_r,
                              b2, omb2, PHASE: tl.constexpr, FR: tl.constexpr,
                              SR: tl.constexpr, FC: tl.constexpr, SP: tl.constexpr,
                              FT: tl.constexpr):
    """The finalize of one tensor: program ``pid`` runs :func:`_finalize_program`."""
    _finalize_program(tl.program_id(0), row_part_ptr, col_part_ptr, row_in_ptr, row_out_ptr,
                      col_ptr, col_sum_ptr, total_ptr, inv_rbar_ptr, block_sum_ptr, ticket_ptr,
                      nrows, ncols, n_splits, n_row_programs, rbar_rows, inv_c, inv_r, b2, omb2,
                      PHASE, FR, SR, FC, SP, FT)


@jit
def _finalize_program(pid, row_part_ptr, col_part_ptr, row_in_ptr, row_out_ptr, col_ptr,  # type: ignore[no-untyped-def]
                      col_sum_ptr, total_ptr, inv_rbar_ptr, block_sum_ptr, ticket_ptr, nrows,
                      ncols, n_splits, n_row_programs, rbar_rows, inv_c, inv_r, b2, omb2,
                      PHASE: tl.constexpr, FR: tl.constexpr, SR: tl.constexpr,
                      FC: tl.constexpr, SP: tl.constexpr, FT: tl.constexpr):
    """Reduce the partials in a fixed order and apply the r/k EMA, in parallel.

    Programs ``0 .. cdiv(R, FR) - 1`` own ``FR`` rows each, the others ``FC`` columns each.

    PHASE 0 (one call): a row program computes ``r' = f32(f32(b2 * r) + f32(f32(rowsum *
    f32(1/C)) * (1 - b2)))`` (the reference's ``_ema``; ``rowsum`` the ``n_splits`` partials of
    ``row_part_ptr`` ``[n_splits, R]`` summed in ``[SR, FR]`` chunks) from ``row_in_ptr`` to
    ``row_out_ptr`` (both ``r``) and stores the sum of its block of ``r'`` in
    ``block_sum_ptr[pid]``; then it takes a ticket (an int32 atomic on ``ticket_ptr``, zeroed by
    the statistics kernel). The program with the last ticket sums the block sums in index order
    (so the result does not depend on which program is last) and writes ``1/rbar = f32(1 /
    max(f32(f32(sum r') / f32(rbar_rows)), FLT_MIN))`` into ``inv_rbar_ptr[0]``. A column
    program writes ``k'`` from ``col_part_ptr`` ``[n_row_programs, C]`` summed in ``[SP, FC]``
    chunks.
    PHASE 1 (partial, mutates no state): as PHASE 0 with ``r'`` into ``row_out_ptr``
    (scratch), ``sum r'`` into ``total_ptr[0]`` and the column sums into ``col_sum_ptr``.
    PHASE 2 (finalize from reduced sums): ``row_in_ptr`` (r') copied to ``row_out_ptr`` (r),
    ``1/rbar`` from ``total_ptr[0]`` by program 0, ``k'`` from ``col_sum_ptr``. Each quantity
    has the PHASE 0 arithmetic and summation order, so PHASE 1 + 2 with unreduced sums equal
    PHASE 0 bit for bit.
    """
    n_row_blocks = tl.cdiv(nrows, FR)
    if PHASE == 2:
        if pid == 0:
            r_sum = tl.load(total_ptr)
            # `rbar_rows` may be the Python int 1 (specialised): the fp32 zero converts it.
            mean = tl.math.div_rn(r_sum, tl.zeros([], dtype=tl.float32) + rbar_rows)
            # NaN-propagating floor, as torch.clamp (GPU max instructions would drop the NaN).
            rbar = tl.where(mean != mean, mean, tl.maximum(mean, 1.1754943508222875e-38))
            tl.store(inv_rbar_ptr, tl.math.div_rn(1.0, rbar))
    if pid < n_row_blocks:
        rows = pid * FR + tl.arange(0, FR)
        rmask = rows < nrows
        if PHASE == 2:
            tl.store(row_out_ptr + rows, tl.load(row_in_ptr + rows, mask=rmask), mask=rmask)
        else:
            row_total = tl.zeros([FR], dtype=tl.float32)
            j = 0
            while j < n_splits:
                js = j + tl.arange(0, SR)
                row_chunk = tl.load(row_part_ptr + js[:, None] * nrows + rows[None, :],
                                    mask=(js < n_splits)[:, None] & rmask[None, :], other=0.0)
                row_total += tl.sum(row_chunk, axis=0)
                j += SR
            r_new = tl.load(row_in_ptr + rows, mask=rmask, other=0.0) * b2 + \
                (row_total * inv_c) * omb2
            tl.store(row_out_ptr + rows, r_new, mask=rmask)
            tl.store(block_sum_ptr + pid, tl.sum(tl.where(rmask, r_new, 0.0), axis=0))
            # Every thread's store above precedes the release of the ticket.
            tl.debug_barrier()
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
            if ticket == n_row_blocks - 1:
                acc = tl.zeros([FT], dtype=tl.float32)
                i = 0
                while i < n_row_blocks:
                    idx = i + tl.arange(0, FT)
                    # .cg: from L2, where the other programs' block sums are.
                    acc += tl.load(block_sum_ptr + idx, mask=idx < n_row_blocks, other=0.0,
                                   cache_modifier=".cg")
                    i += FT
                r_sum = tl.sum(acc, axis=0)
                if PHASE == 1:
                    tl.store(total_ptr, r_sum)
                else:
                    mean = tl.math.div_rn(r_sum, tl.zeros([], dtype=tl.float32) + rbar_rows)
                    rbar = tl.where(mean != mean, mean,
                                    tl.maximum(mean, 1.1754943508222875e-38))
                    tl.store(inv_rbar_ptr, tl.math.div_rn(1.0, rbar))
    else:
        cols = (pid - n_row_blocks) * FC + tl.arange(0, FC)
        cmask = cols < ncols
        if PHASE == 2:
            col_total = tl.load(col_sum_ptr + cols, mask=cmask, other=0.0)
        else:
            col_total = tl.zeros([FC], dtype=tl.float32)
            p = 0
            while p < n_row_programs:
                ps = p + tl.arange(0, SP)
                col_chunk = tl.load(col_part_ptr + ps[:, None] * ncols + cols[None, :],
                                    mask=(ps < n_row_programs)[:, None] & cmask[None, :],
                                    other=0.0)
                col_total += tl.sum(col_chunk, axis=0)
                p += SP
        if PHASE == 1:
            tl.store(col_sum_ptr + cols, col_total, mask=cmask)
        else:
            k_new = tl.load(col_ptr + cols, mask=cmask, other=0.0) * b2 + \
                (col_total * inv_r) * omb2
            tl.store(col_ptr + cols, k_new, mask=cmask)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # not triton.cdiv: that is a jit function, slow to call from Python


def stats_layout(rows: int, cols: int) -> tuple[int, int, int, int, int]:
    """(RB, CB, n_splits, n_row_programs, rows_per_program) of the statistics kernel for a
    ``[rows, cols]`` gradient: ``[RB, CB]`` tiles, ``n_row_programs x n_splits`` programs, each
    ``rows_per_program`` rows by ``ceil(ceil(cols / CB) / n_splits)`` column tiles. A function
    of the shape only, so the sums' order is fixed. ``CB`` depends on ``cols`` alone and
    ``n_splits`` is ``ceil(cols / CB)`` unless ``rows * ceil(cols / CB)`` exceeds 2**20 (or
    the split count 1024), so the row sums of a row shard equal the whole matrix's bit for bit
    below those sizes. Scratch: ``n_splits * rows + n_row_programs * cols`` floats, at most
    ``max(rows, 2**20) + max(cols, 2**20)`` (<= 8 MiB beyond the ``R + C`` of the state)."""
    tile = program_elements(_STATS_TILE)
    cb = min(_STATS_CB, 1 << max(0, (cols - 1).bit_length()))
    rb = max(1, tile // cb)
    n_col_tiles = _cdiv(cols, cb)
    splits = max(1, min(n_col_tiles, _STATS_MAX_SPLITS, _STATS_ROW_PART_FLOATS // max(rows, 1)))
    splits = _cdiv(n_col_tiles, _cdiv(n_col_tiles, splits))  # no empty split
    want = max(1, min(_cdiv(rows, rb * _STATS_STRIP_CHUNKS), _cdiv(_STATS_PROGRAMS, splits),
                      _STATS_MAX_ROW_PROGRAMS, _STATS_COL_PART_FLOATS // cols))
    rows_per_program = _cdiv(_cdiv(rows, want), rb) * rb
    n_row_programs = _cdiv(rows, rows_per_program)
    return rb, cb, splits, n_row_programs, rows_per_program


def stats_items_per_program(layout: tuple[int, int, int, int, int], cols: int) -> int:
    """Work items per program of the statistics kernel for a gradient of ``cols`` columns
    with :func:`stats_layout` ``layout`` (speed only; the sums do not depend on it)."""
    rb, cb, splits, n_row_programs, rows_per_program = layout
    chunks = _cdiv(rows_per_program, rb) * _cdiv(_cdiv(cols, cb), splits)
    items = n_row_programs * splits
    return max(1, min(_STATS_CHUNKS // chunks, items // _STATS_MIN_PROGRAMS))


def stats_prefetch(element_size: int) -> bool:
    """Whether the statistics kernel prefetches the next chunk (``PREFETCH``) for a gradient
    of ``element_size`` bytes per element (speed only; the sums do not depend on it)."""
    return element_size <= _STATS_PREFETCH_MAX_BYTES


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


_FIN_CONSTS = dict(FR=_FIN_ROWS, SR=_FIN_SR, FC=_FIN_COLS, SP=_FIN_SP, FT=_FIN_TOTAL,
                   num_warps=4, **LAUNCH_OPTIONS)


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
