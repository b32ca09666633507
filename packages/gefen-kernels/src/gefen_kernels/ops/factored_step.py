"""Fused Gefen step, factored second-moment mode (ALGORITHM.md §1.11, §3.7).

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
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _numerics
from .. import _validation as V
from .._numerics import FLT_MIN, f32
from .._triton import jit, program_elements, require_triton, tl
from ._dispatch import check_device_for_triton, use_triton
from ._step_kernels import launch_step
from ._step_ref import StepScalars, denominator, make_scalars, run_step
from ._triton_helpers import LAUNCH_OPTIONS

__all__ = ["factored_step", "factored_step_reference", "factored_step_triton"]


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
    return torch.reciprocal(torch.clamp(r.sum() / float(rows), min=FLT_MIN))


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
) -> None:
    """PyTorch reference of the factored-mode step (§1.11), in place.

    Args:
        param, grad: contiguous ``[R, C]``; param fp32/bf16/fp16 or fp64 (fp64 arithmetic,
            fp32 state); grad any float dtype.
        codes: uint8 ``[B, P]``; scale: fp32 ``[B, 1]`` (``B * P == R * C``).
        exp_avg_sq_row: fp32 ``[R]``; exp_avg_sq_col: fp32 ``[C]``.
        codebook: fp32 ``[256]``, sorted, endpoints -1 and +1.
        bc1_recip: ``1 / (1 - beta1**step)``; bc2_recip: ``1 / (1 - beta2**step_f)`` (not its
            root); decay: ``1 - lr * weight_decay``.
        hyper: optional fp32 ``[4]`` ``[lr, bc2_recip, bc1_recip, decay]`` on the device.
        Other arguments as :func:`gefen_kernels.ops.block_step.block_step_reference`.

    Raises:
        TypeError, ValueError: bad dtype, shape, device, contiguity or hyperparameter, before
            anything is modified.
    """
    _check(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col, codebook, beta1, beta2,
           eps, seed, hyper, seed_tensor, allow_fp64=True)
    if param.numel() == 0:
        return
    rows, cols = param.shape
    cdt = torch.float64 if param.dtype == torch.float64 else torch.float32
    sc = make_scalars(dtype=cdt, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      bc1_recip=bc1_recip, bc2=bc2_recip, decay=decay, hyper=hyper)
    row_sum, col_sum = _row_col_sums(grad, cdt)
    exp_avg_sq_row.copy_(_ema(exp_avg_sq_row, row_sum, 1.0 / cols, sc))
    exp_avg_sq_col.copy_(_ema(exp_avg_sq_col, col_sum, 1.0 / rows, sc))
    del row_sum, col_sum
    r = exp_avg_sq_row.to(cdt)
    k = exp_avg_sq_col.to(cdt)
    inv_rbar = _rbar_reciprocal(r, rows)

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

_STATS_TILE = 4096  # elements of one [RB, CB] tile of the statistics kernel
_STATS_MAX_CB = 512  # columns per statistics program (row partials: R * ceil(C / 512) floats)
_STATS_PROGRAMS = 1024  # about 8 programs per SM on a 132-SM H200
_FINALIZE_BLOCK = 1024  # rows or columns per iteration of the finalize kernel


@jit
def _factored_stats_kernel(g_ptr, row_part_ptr, col_part_ptr, nrows, ncols, n_col_tiles,  # type: ignore[no-untyped-def]
                           rows_per_program, RB: tl.constexpr, CB: tl.constexpr):
    """Partial sums of g^2 (fp32) of a ``[rows_per_program, CB]`` strip of a ``[R, C]`` gradient.

    g_ptr: ``[R, C]`` contiguous (fp32/bf16/fp16). row_part_ptr: fp32 ``[R, n_col_tiles]``
    (row sums over this program's columns); col_part_ptr: fp32 ``[n_row_programs, C]``
    (column sums over this program's rows, accumulated in row order). Reduced afterwards in a
    fixed order, so the result is deterministic (no atomics). The grid depends only on the
    shape, so the scratch is bounded (``R * n_col_tiles + n_row_programs * C`` floats, a few
    MiB at most) however many rows there are. Offsets are int64.
    """
    pid = tl.program_id(0).to(tl.int64)
    pr = pid // n_col_tiles
    pc = pid % n_col_tiles
    cols = pc * CB + tl.arange(0, CB).to(tl.int64)
    cmask = cols < ncols
    col_acc = tl.zeros([CB], dtype=tl.float32)
    lanes = tl.arange(0, RB).to(tl.int64)
    first = pr * rows_per_program
    stop = tl.minimum(first + rows_per_program, nrows)
    start = first
    # while, not range(): Triton 3.3's interpreter cannot take a runtime loop bound.
    while start < stop:
        rows = start + lanes
        rmask = rows < stop
        mask = rmask[:, None] & cmask[None, :]
        g = tl.load(g_ptr + rows[:, None] * ncols + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        sq = g * g
        tl.store(row_part_ptr + rows * n_col_tiles + pc, tl.sum(sq, axis=1), mask=rmask)
        col_acc += tl.sum(sq, axis=0)
        start += RB
    tl.store(col_part_ptr + pr * ncols + cols, col_acc, mask=cmask)


@jit
def _factored_finalize_kernel(row_part_ptr, col_part_ptr, row_ptr, col_ptr, inv_rbar_ptr,  # type: ignore[no-untyped-def]
                              nrows, ncols, n_col_tiles, n_row_programs, inv_c, inv_r, b2, omb2,
                              BLOCK: tl.constexpr):
    """Reduce the partials in a fixed order and apply the r/k EMA; program 0 also writes 1/rbar.

    Program 0: ``r' = f32(f32(b2 * r) + f32(f32(rowsum * f32(1/C)) * (1 - b2)))`` for every
    row (the reference's ``_ema``), then ``1/rbar = f32(1 / max(f32(f32(sum r') / f32(R)),
    FLT_MIN))`` into ``inv_rbar_ptr[0]``. Programs ``1 ..``: ``k'`` for ``BLOCK`` columns each.
    """
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    if pid == 0:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        start = nrows * 0
        while start < nrows:
            idx = start + lanes
            mask = idx < nrows
            total = tl.zeros([BLOCK], dtype=tl.float32)
            t = n_col_tiles * 0
            while t < n_col_tiles:
                total += tl.load(row_part_ptr + idx * n_col_tiles + t, mask=mask, other=0.0)
                t += 1
            r_new = tl.load(row_ptr + idx, mask=mask, other=0.0) * b2 + (total * inv_c) * omb2
            tl.store(row_ptr + idx, r_new, mask=mask)
            acc += tl.where(mask, r_new, 0.0)
            start += BLOCK
        # `nrows` may be the Python int 1 (specialised): the fp32 zero converts it either way.
        mean = tl.math.div_rn(tl.sum(acc, axis=0), tl.zeros([], dtype=tl.float32) + nrows)
        # NaN-propagating floor, as torch.clamp (GPU max instructions would drop the NaN).
        rbar = tl.where(mean != mean, mean, tl.maximum(mean, 1.1754943508222875e-38))
        tl.store(inv_rbar_ptr, tl.math.div_rn(1.0, rbar))
    else:
        idx = (pid - 1).to(tl.int64) * BLOCK + lanes
        mask = idx < ncols
        total = tl.zeros([BLOCK], dtype=tl.float32)
        p = n_row_programs * 0
        while p < n_row_programs:
            total += tl.load(col_part_ptr + p * ncols + idx, mask=mask, other=0.0)
            p += 1
        k_new = tl.load(col_ptr + idx, mask=mask, other=0.0) * b2 + (total * inv_r) * omb2
        tl.store(col_ptr + idx, k_new, mask=mask)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # not triton.cdiv: that is a jit function, slow to call from Python


def stats_layout(rows: int, cols: int) -> tuple[int, int, int, int, int]:
    """(RB, CB, n_col_tiles, n_row_programs, rows_per_program) of the statistics kernel for a
    ``[rows, cols]`` gradient (a function of the shape only, so the sums' order is fixed)."""
    tile = program_elements(_STATS_TILE)
    cb = min(_STATS_MAX_CB, 1 << max(0, (cols - 1).bit_length()))
    rb = max(1, tile // cb)
    n_col_tiles = _cdiv(cols, cb)
    want = max(1, min(_cdiv(rows, rb), _cdiv(_STATS_PROGRAMS, n_col_tiles)))
    rows_per_program = _cdiv(_cdiv(rows, want), rb) * rb
    n_row_programs = _cdiv(rows, rows_per_program)
    return rb, cb, n_col_tiles, n_row_programs, rows_per_program


def _stats_partials(grad: Tensor, layout: tuple[int, int, int, int, int] | None = None,
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Row partials fp32 ``[R, n_col_tiles]``, column partials fp32 ``[n_row_programs, C]``
    of ``g^2``, and one spare fp32 ``[1]`` (for ``1/rbar``), in one scratch allocation."""
    rows, cols = grad.shape
    rb, cb, n_col_tiles, n_row_programs, rows_per_program = (
        layout if layout is not None else stats_layout(rows, cols))
    n_rows_part = rows * n_col_tiles
    scratch = torch.empty(n_rows_part + n_row_programs * cols + 1, dtype=torch.float32,
                          device=grad.device)
    row_part = scratch[:n_rows_part].view(rows, n_col_tiles)
    col_part = scratch[n_rows_part:n_rows_part + n_row_programs * cols].view(n_row_programs, cols)
    _factored_stats_kernel[(n_row_programs * n_col_tiles,)](
        grad, row_part, col_part, rows, cols, n_col_tiles, rows_per_program, RB=rb, CB=cb,
        num_warps=8, **LAUNCH_OPTIONS)
    return row_part, col_part, scratch[-1:]


def _row_col_sums_triton(grad: Tensor) -> tuple[Tensor, Tensor]:
    """Row and column sums of ``g^2`` (fp32, fixed order) from the statistics kernel."""
    row_part, col_part, _ = _stats_partials(grad)
    return row_part.sum(dim=1), col_part.sum(dim=0)


def factored_stats_triton(grad: Tensor, exp_avg_sq_row: Tensor, exp_avg_sq_col: Tensor, *,
                          beta2: float,
                          layout: tuple[int, int, int, int, int] | None = None) -> Tensor:
    """Steps 1-2 of §1.11 in two launches: the r/k EMA in place; returns ``1/rbar`` as an fp32
    ``[1]`` device tensor. One allocation (the partials), no host synchronisation, no torch op
    in between. ``grad`` is ``[R, C]`` contiguous fp32/bf16/fp16; ``layout`` is
    :func:`stats_layout` of its shape (computed here when not given).

    The EMA is the reference's expression (:func:`_ema`), so ``r``/``k`` differ from it only
    through the summation order of ``sum g^2`` (a few fp32 ulps).
    """
    rows, cols = grad.shape
    row_part, col_part, inv_rbar = _stats_partials(grad, layout)
    b2 = f32(beta2)
    block = _FINALIZE_BLOCK
    _factored_finalize_kernel[(1 + _cdiv(cols, block),)](
        row_part, col_part, exp_avg_sq_row, exp_avg_sq_col, inv_rbar, rows, cols,
        row_part.shape[1], col_part.shape[0], f32(1.0 / cols), f32(1.0 / rows), b2,
        f32(1.0 - b2), BLOCK=block, num_warps=4, **LAUNCH_OPTIONS)
    return inv_rbar


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
) -> None:
    """Triton factored-mode step; same signature and contract as the reference.

    Three launches: the statistics kernel (row and column partial sums of ``g^2``), the
    finalize kernel (fixed-order sums, the r/k EMA with the reference's exact expression,
    ``1/rbar`` as a device scalar: no host sync), then the shared update kernel with ``sigma``
    per element in registers. Codes and scales equal the reference's bit for
    bit; ``r``/``k`` may differ by fp32 ulps (summation order), parameters accordingly.

    Raises:
        ImportError: Triton is not installed. TypeError, ValueError: as the reference, plus
            fp64 params and non-CUDA tensors outside the interpreter.
    """
    _check(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col, codebook, beta1, beta2,
           eps, seed, hyper, seed_tensor, allow_fp64=False)
    require_triton("the Triton Gefen factored step")
    check_device_for_triton(param)
    if param.numel() == 0:
        return
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        grad = grad.to(torch.float32)
    rows, cols = param.shape
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
                      seed: int) -> None:
    factored_step_reference(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col, codebook,
                            lr=lr, beta1=beta1, beta2=beta2, eps=eps, bc1_recip=bc1_recip,
                            bc2_recip=bc2_recip, decay=decay, maximize=maximize,
                            stochastic_round=stochastic_round, seed=seed, hyper=hyper,
                            seed_tensor=seed_tensor)


@_factored_step_op.register_kernel("cuda")
def _factored_step_cuda(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor,
                        exp_avg_sq_row: Tensor, exp_avg_sq_col: Tensor, codebook: Tensor,
                        hyper: Tensor | None, seed_tensor: Tensor | None, lr: float,
                        beta1: float, beta2: float, eps: float, bc1_recip: float,
                        bc2_recip: float, decay: float, maximize: bool,
                        stochastic_round: bool, seed: int) -> None:
    impl = (factored_step_triton if use_triton(param) and param.dtype != torch.float64
            else factored_step_reference)
    impl(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col, codebook, lr=lr,
         beta1=beta1, beta2=beta2, eps=eps, bc1_recip=bc1_recip, bc2_recip=bc2_recip,
         decay=decay, maximize=maximize, stochastic_round=stochastic_round, seed=seed,
         hyper=hyper, seed_tensor=seed_tensor)


@_factored_step_op.register_fake
def _factored_step_fake(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor,
                        exp_avg_sq_row: Tensor, exp_avg_sq_col: Tensor, codebook: Tensor,
                        hyper: Tensor | None, seed_tensor: Tensor | None, lr: float,
                        beta1: float, beta2: float, eps: float, bc1_recip: float,
                        bc2_recip: float, decay: float, maximize: bool,
                        stochastic_round: bool, seed: int) -> None:
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
) -> None:
    """Factored-mode step through ``torch.ops.gefen.factored_step`` (arguments as the reference).

    CUDA tensors take the Triton path when Triton is available (fp64: the reference); CPU
    tensors the reference. Validated here before anything is mutated; compile- and
    CUDA-graph-safe (with ``hyper``/``seed_tensor``).
    """
    _check(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col, codebook, beta1, beta2,
           eps, seed, hyper, seed_tensor, allow_fp64=True)
    torch.ops.gefen.factored_step(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col,
                                  codebook, hyper, seed_tensor, float(lr), float(beta1),
                                  float(beta2), float(eps), float(bc1_recip), float(bc2_recip),
                                  float(decay), bool(maximize), bool(stochastic_round),
                                  int(seed))
