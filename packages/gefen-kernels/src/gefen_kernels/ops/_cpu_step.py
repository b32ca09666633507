"""The CPU step: the block, factored and Muon-momentum ops on CPU tensors, bit-identical to
their PyTorch references (docs/algorithm.md#step, docs/algorithm.md#gefenmuon).

The public ops (:func:`gefen_kernels.ops.block_step`, :func:`~gefen_kernels.ops.factored_step`,
:func:`~gefen_kernels.ops.muon_momentum`) run these on CPU tensors. Each one does in PyTorch
exactly what its reference does for the second-moment statistics (the per-block sums of
``g^2``, the row/column sums and their EMAs, with the same torch reductions over the same
chunks, so the same summation order) and hands the element-wise rest, the part the reference
spends a dozen full passes and fp32 temporaries on, to the native kernel of ``_cpu_step.c``:
one pass per block for the new block max and one for the re-quantisation and the parameter
write, every operation the separately rounded fp32 operation of the canonical rounding
sequence (:mod:`gefen_kernels._numerics`). Blocks are split over ``torch.get_num_threads()``
threads (the native calls release the GIL).

Temporaries: the statistics' chunk temporaries of the reference (at most a few MiB per
chunk, docs/algorithm.md#step); the native pass allocates nothing.

Where the native kernel cannot run (no C compiler, ``GEFEN_CPU_STEP=reference``, fp64
parameters or gradients of another dtype than fp32/bf16/fp16) these call the references.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._numerics import f32
from . import _cpu_native
from ._chunks import block_groups
from ._search_table import search_table
from ._step_ref import ComputeScalars, denominator, make_scalars
from .block_step import _check as _check_block
from .block_step import _second_moment, block_step_reference
from .factored_step import _check as _check_factored
from .factored_step import (
    _check_stats,
    _ema,
    _finalize_reference,
    _rbar_reciprocal,
    _row_col_sums,
    factored_step_reference,
)
from .muon_momentum import _check as _check_muon
from .muon_momentum import muon_momentum_reference

__all__ = ["block_step_cpu", "factored_step_cpu", "muon_momentum_cpu", "native_available"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Below this many elements a tensor is stepped on the calling thread alone.
PARALLEL_MIN_ELEMENTS = 1 << 16
_MASK64 = (1 << 64) - 1

_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_size = 0


def native_available() -> bool:
    """Whether the native CPU kernel is built and loaded (see ``_cpu_native.status()``)."""
    return _cpu_native.library() is not None


def _native(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype in _DTYPE_CODES for t in tensors) and (
        _cpu_native.library() is not None)


def _executor(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="gefen-cpu-step")
            _pool_size = workers
        return _pool


def _over_blocks(run: Callable[[int, int], None], num_blocks: int, period: int) -> None:
    """``run(first, stop)`` over contiguous block ranges covering ``[0, num_blocks)``, in
    parallel on ``torch.get_num_threads()`` threads (the calling thread takes the first)."""
    parts = min(torch.get_num_threads(), num_blocks)
    if parts <= 1 or num_blocks * period < PARALLEL_MIN_ELEMENTS:
        run(0, num_blocks)
        return
    bounds = [num_blocks * i // parts for i in range(parts + 1)]
    pool = _executor(parts - 1)
    futures = [pool.submit(run, bounds[i], bounds[i + 1]) for i in range(1, parts)]
    try:
        run(bounds[0], bounds[1])
    finally:
        for fut in futures:
            fut.result()


def _seed(seed: int, seed_tensor: Tensor | None) -> int:
    value = int(seed_tensor.reshape(()).item()) if seed_tensor is not None else int(seed)
    return value & _MASK64


def _step(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor, codebook: Tensor,
          sc: ComputeScalars, *, sigma_block: Tensor | None, r: Tensor | None, k: Tensor | None,
          inv_rbar: float, maximize: bool, stochastic_round: bool, seed: int) -> None:
    lib = _cpu_native.library()
    assert lib is not None
    num_blocks, period = codes.shape
    table, _ = search_table(codebook)
    write = (float(sc.lr) != 0.0) if sc.capturable else not sc.lr_is_host_zero
    pdt, gdt = _DTYPE_CODES[param.dtype], _DTYPE_CODES[grad.dtype]
    ncols = int(param.shape[1]) if r is not None else 1
    args = (float(sc.eps), float(sc.lr), float(sc.bc2), float(sc.bc1_recip), float(sc.decay),
            int(maximize), int(stochastic_round), seed, int(write))
    ptrs = (param.data_ptr(), grad.data_ptr(), codes.data_ptr(), scale.data_ptr(),
            0 if sigma_block is None else sigma_block.data_ptr(),
            0 if r is None else r.data_ptr(), 0 if k is None else k.data_ptr(),
            codebook.data_ptr(), table.data_ptr())

    def run(first: int, stop: int) -> None:
        lib.gefen_cpu_step(ptrs[0], pdt, ptrs[1], gdt, ptrs[2], ptrs[3], first, stop, period,
                           ptrs[4], ptrs[5], ptrs[6], ncols, inv_rbar, ptrs[7], ptrs[8],
                           sc.beta1, sc.one_minus_beta1, *args)

    _over_blocks(run, num_blocks, period)


def block_step_cpu(
    param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor, exp_avg_sq: Tensor,
    codebook: Tensor, *, lr: float, beta1: float, beta2: float, eps: float, bc1_recip: float,
    bc2_rsqrt: float, decay: float, maximize: bool = False, stochastic_round: bool = False,
    seed: int = 0, hyper: Tensor | None = None, seed_tensor: Tensor | None = None,
) -> None:
    """:func:`gefen_kernels.ops.block_step_reference` on CPU tensors, bit for bit, through the
    native kernel (the reference itself where that cannot run). Same arguments and errors."""
    kwargs: dict[str, Any] = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, bc1_recip=bc1_recip,
                  bc2_rsqrt=bc2_rsqrt, decay=decay, maximize=maximize,
                  stochastic_round=stochastic_round, seed=seed, hyper=hyper,
                  seed_tensor=seed_tensor)
    if not _native(param, grad):
        block_step_reference(param, grad, codes, scale, exp_avg_sq, codebook, **kwargs)
        return
    _check_block(param, grad, codes, scale, exp_avg_sq, codebook, beta1, beta2, eps, seed,
                 hyper, seed_tensor, allow_fp64=False)
    if param.numel() == 0:
        return
    cdt = torch.float32
    sc = make_scalars(dtype=cdt, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      bc1_recip=bc1_recip, bc2=bc2_rsqrt, decay=decay, hyper=hyper)
    num_blocks, period = codes.shape
    flat_g = grad.view(-1)
    sigma = torch.empty(num_blocks, 1, dtype=cdt)
    # The reference's statistics, chunk for chunk (docs/algorithm.md#block-second-moment
    # steps 1-2): the same reductions over the same shapes give the same sums.
    for group in block_groups(num_blocks, period):
        rows = group.stop - group.first if len(group.tiles) == 1 else 1
        sumsq: Tensor | None = None
        for start, end in group.tiles:
            g = flat_g[start:end].view(rows, -1).to(cdt)
            tile_sum = (g * g).sum(dim=1, keepdim=True)
            sumsq = tile_sum if sumsq is None else sumsq + tile_sum
            del g
        assert sumsq is not None
        v_slot = exp_avg_sq[group.first:group.stop]
        v_slot.copy_(_second_moment(v_slot.to(cdt), sumsq, period, sc))
        h = torch.sqrt(v_slot.to(cdt)) * sc.bc2
        sigma[group.first:group.stop] = denominator(h, sc)
    _step(param, grad, codes, scale, codebook, sc, sigma_block=sigma, r=None, k=None,
          inv_rbar=0.0, maximize=maximize, stochastic_round=stochastic_round,
          seed=_seed(seed, seed_tensor))


def factored_step_cpu(
    param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor, exp_avg_sq_row: Tensor,
    exp_avg_sq_col: Tensor, codebook: Tensor, *, lr: float, beta1: float, beta2: float,
    eps: float, bc1_recip: float, bc2_recip: float, decay: float, maximize: bool = False,
    stochastic_round: bool = False, seed: int = 0, hyper: Tensor | None = None,
    seed_tensor: Tensor | None = None, stats: Tensor | None = None,
    global_rows: int | None = None,
) -> None:
    """:func:`gefen_kernels.ops.factored_step_reference` on CPU tensors, bit for bit, through
    the native kernel (the reference itself where that cannot run). Same arguments and
    errors."""
    kwargs: dict[str, Any] = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, bc1_recip=bc1_recip,
                  bc2_recip=bc2_recip, decay=decay, maximize=maximize,
                  stochastic_round=stochastic_round, seed=seed, hyper=hyper,
                  seed_tensor=seed_tensor, stats=stats, global_rows=global_rows)
    if not _native(param, grad):
        factored_step_reference(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col,
                                codebook, **kwargs)
        return
    _check_factored(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col, codebook,
                    beta1, beta2, eps, seed, hyper, seed_tensor, allow_fp64=False)
    _check_stats(stats, global_rows, param)
    if param.numel() == 0:
        return
    rows, cols = param.shape
    cdt = torch.float32
    sc = make_scalars(dtype=cdt, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      bc1_recip=bc1_recip, bc2=bc2_recip, decay=decay, hyper=hyper)
    # docs/algorithm.md#factored-second-moment steps 1-2, as the reference computes them.
    if stats is not None:
        assert global_rows is not None
        inv_rbar = _finalize_reference(exp_avg_sq_row, exp_avg_sq_col, stats, global_rows, sc)
    else:
        row_sum, col_sum = _row_col_sums(grad, cdt)
        exp_avg_sq_row.copy_(_ema(exp_avg_sq_row, row_sum, 1.0 / cols, sc))
        exp_avg_sq_col.copy_(_ema(exp_avg_sq_col, col_sum, 1.0 / rows, sc))
        del row_sum, col_sum
        inv_rbar = _rbar_reciprocal(exp_avg_sq_row, rows)
    _step(param, grad, codes, scale, codebook, sc, sigma_block=None, r=exp_avg_sq_row,
          k=exp_avg_sq_col, inv_rbar=float(inv_rbar), maximize=maximize,
          stochastic_round=stochastic_round, seed=_seed(seed, seed_tensor))


def muon_momentum_cpu(
    grad: Tensor, codes: Tensor, scale: Tensor, codebook: Tensor, *, beta: float,
    nesterov: bool, maximize: bool = False, stochastic_round: bool = False, seed: int = 0,
    seed_tensor: Tensor | None = None, out: Tensor | None = None,
) -> Tensor:
    """:func:`gefen_kernels.ops.muon_momentum_reference` on CPU tensors, bit for bit, through
    the native kernel (the reference itself where that cannot run). Same arguments, result
    and errors."""
    if not _native(grad):
        return muon_momentum_reference(grad, codes, scale, codebook, beta=beta,
                                       nesterov=nesterov, maximize=maximize,
                                       stochastic_round=stochastic_round, seed=seed,
                                       seed_tensor=seed_tensor, out=out)
    _check_muon(grad, codes, scale, codebook, beta, seed, seed_tensor, out)
    result = torch.empty_like(grad) if out is None else out
    if grad.numel() == 0:
        return result
    lib = _cpu_native.library()
    assert lib is not None
    b = f32(beta)
    omb = f32(1.0 - b)
    # The codeword as the gradient dtype sees it (docs/algorithm.md#gefenmuon).
    cb_out = codebook.to(grad.dtype).to(torch.float32)
    table, _ = search_table(codebook)
    num_blocks, period = codes.shape
    gdt = _DTYPE_CODES[grad.dtype]
    seed_value = _seed(seed, seed_tensor)
    ptrs = (grad.data_ptr(), codes.data_ptr(), scale.data_ptr(), result.data_ptr(),
            codebook.data_ptr(), cb_out.data_ptr(), table.data_ptr())

    def run(first: int, stop: int) -> None:
        lib.gefen_cpu_muon(ptrs[0], gdt, ptrs[1], ptrs[2], first, stop, period, ptrs[3],
                           ptrs[4], ptrs[5], ptrs[6], b, omb, int(maximize),
                           int(stochastic_round), seed_value, int(nesterov))

    _over_blocks(run, num_blocks, period)
    return result


# The public ops' CPU kernels (registered here so the op modules stay as they are).
@torch.library.register_kernel("gefen::block_step", "cpu")
def _block_step_kernel(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor,
                       exp_avg_sq: Tensor, codebook: Tensor, hyper: Tensor | None,
                       seed_tensor: Tensor | None, lr: float, beta1: float, beta2: float,
                       eps: float, bc1_recip: float, bc2_rsqrt: float, decay: float,
                       maximize: bool, stochastic_round: bool, seed: int) -> None:
    block_step_cpu(param, grad, codes, scale, exp_avg_sq, codebook, lr=lr, beta1=beta1,
                   beta2=beta2, eps=eps, bc1_recip=bc1_recip, bc2_rsqrt=bc2_rsqrt, decay=decay,
                   maximize=maximize, stochastic_round=stochastic_round, seed=seed, hyper=hyper,
                   seed_tensor=seed_tensor)


@torch.library.register_kernel("gefen::factored_step", "cpu")
def _factored_step_kernel(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor,
                          exp_avg_sq_row: Tensor, exp_avg_sq_col: Tensor, codebook: Tensor,
                          hyper: Tensor | None, seed_tensor: Tensor | None, lr: float,
                          beta1: float, beta2: float, eps: float, bc1_recip: float,
                          bc2_recip: float, decay: float, maximize: bool,
                          stochastic_round: bool, seed: int, stats: Tensor | None = None,
                          global_rows: int = 0) -> None:
    factored_step_cpu(param, grad, codes, scale, exp_avg_sq_row, exp_avg_sq_col, codebook,
                      lr=lr, beta1=beta1, beta2=beta2, eps=eps, bc1_recip=bc1_recip,
                      bc2_recip=bc2_recip, decay=decay, maximize=maximize,
                      stochastic_round=stochastic_round, seed=seed, hyper=hyper,
                      seed_tensor=seed_tensor, stats=stats,
                      global_rows=global_rows if stats is not None else None)


@torch.library.register_kernel("gefen::muon_momentum", "cpu")
def _muon_momentum_kernel(grad: Tensor, codes: Tensor, scale: Tensor, codebook: Tensor,
                          seed_tensor: Tensor | None, out: Tensor, beta: float, nesterov: bool,
                          maximize: bool, stochastic_round: bool, seed: int) -> None:
    muon_momentum_cpu(grad, codes, scale, codebook, beta=beta, nesterov=nesterov,
                      maximize=maximize, stochastic_round=stochastic_round, seed=seed,
                      seed_tensor=seed_tensor, out=out)
