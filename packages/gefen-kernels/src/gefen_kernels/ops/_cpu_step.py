"""The CPU step: the block, factored and Muon-momentum ops on CPU tensors, bit-identical to
their PyTorch references (docs/algorithm.md#step, docs/algorithm.md#gefenmuon).

The public ops (:func:`gefen_kernels.ops.block_step`, :func:`~gefen_kernels.ops.factored_step`,
:func:`~gefen_kernels.ops.muon_momentum`) run these on CPU tensors, and :func:`step_list_cpu`
steps a whole list of tensors in one native call (the CPU route of
:func:`gefen_kernels.op_step` and of ``fused_step`` off CUDA). For every tensor the
second-moment statistics whose summation order the reference's torch reductions define (the
per-block sums of ``g^2``, the row/column sums, ``sum(r)``) and the block mode's ``torch.sqrt``
(not correctly rounded on every CPU build, so it is called, not re-implemented) are computed
with the reference's own torch calls on the same shapes and chunks, so they give the same bits;
the element-wise EMAs around them and everything after are the native kernel's
(``_cpu_step.c``): one pass per block for the new block max and one for the re-quantisation
and the parameter write, every operation the separately rounded fp32 operation of the canonical
rounding sequence (:mod:`gefen_kernels._numerics`). One native call takes every tensor's blocks
and splits them over ``torch.get_num_threads()`` threads of its own, once per call (no per-tensor
hand-off, no thread waiting on torch's OpenMP pool between tensors).

Temporaries: the statistics' chunk temporaries of the reference (at most a few MiB per
chunk, docs/algorithm.md#step) and ``4 * B`` bytes per block-mode tensor; the native pass
allocates nothing.

Where the native kernel cannot run (no C compiler, ``GEFEN_CPU_STEP=reference``, fp64
parameters or gradients of another dtype than fp32/bf16/fp16) these call the references.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _numerics
from .._numerics import f32
from . import _cpu_native
from ._chunks import block_groups
from ._search_table import search_table
from ._step_ref import ComputeScalars, make_scalars
from .block_step import _check as _check_block
from .block_step import block_step_reference
from .factored_step import _check as _check_factored
from .factored_step import (
    _check_stats,
    _finalize_reference,
    _row_col_sums,
    factored_step_reference,
)
from .muon_momentum import _check as _check_muon
from .muon_momentum import muon_momentum_reference
from .step_scalars import StepScalars

__all__ = ["block_step_cpu", "factored_step_cpu", "muon_momentum_cpu", "native_available",
           "step_list_cpu"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Below this many elements a call runs on the calling thread alone.
PARALLEL_MIN_ELEMENTS = 1 << 14
_MASK64 = (1 << 64) - 1
_F32 = torch.float32


def native_available() -> bool:
    """Whether the native CPU kernel is built and loaded (see ``_cpu_native.status()``)."""
    return _cpu_native.library() is not None


def _native(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype in _DTYPE_CODES for t in tensors) and (
        _cpu_native.library() is not None)


def _threads(elements: int) -> int:
    return 1 if elements < PARALLEL_MIN_ELEMENTS else max(1, torch.get_num_threads())


def _seed(seed: int, seed_tensor: Tensor | None) -> int:
    value = int(seed_tensor.reshape(()).item()) if seed_tensor is not None else int(seed)
    return value & _MASK64


def _shared(codebook: Tensor, sc: ComputeScalars, *, maximize: bool, stochastic_round: bool,
            keep: list[Any]) -> _cpu_native.Shared:
    table, _ = search_table(codebook)
    keep.append(table)
    return _cpu_native.Shared(codebook.data_ptr(), 0, table.data_ptr(), sc.beta1,
                              sc.one_minus_beta1, sc.eps, int(maximize), int(stochastic_round), 0)


_local = threading.local()


def _scratch(numel: int, slot: int) -> Tensor:
    """A reused fp32 buffer of ``numel <= CHUNK_ELEMENTS`` elements (two slots per thread, at
    most ``2 * CHUNK_ELEMENTS`` fp32 in all): the reference's per-chunk temporaries without an
    allocation (and its page faults) per tensor."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = [torch.empty(0, dtype=_F32), torch.empty(0, dtype=_F32)]
    if bufs[slot].numel() < numel:
        bufs[slot] = torch.empty(max(numel, 1 << 16), dtype=_F32)
    return bufs[slot][:numel]


def _squares(g: Tensor) -> Tensor:
    """``g.to(fp32) * g.to(fp32)`` (the reference's values) in scratch memory, shaped as ``g``."""
    numel = g.numel()
    if g.dtype != _F32:
        g = _scratch(numel, 1).view(g.shape).copy_(g)
    return torch.mul(g, g, out=_scratch(numel, 0).view(g.shape))


def _block_sqrt_v(grad: Tensor, exp_avg_sq: Tensor, num_blocks: int, period: int,
                  sc: ComputeScalars, lib: Any) -> Tensor:
    """docs/algorithm.md#block-second-moment steps 1-2 as ``block_step_reference`` computes
    them, chunk for chunk: the per-block sums of ``g^2`` (the same torch reductions over the
    same shapes give the same sums), the EMA of ``exp_avg_sq`` in place (native, the same
    operations) and ``torch.sqrt`` of it (fp32 ``[B]``, what the native pass turns into
    ``sigma``)."""
    chunk = _numerics.CHUNK_ELEMENTS
    if period <= chunk and num_blocks <= chunk // period:
        # One group of one tile (the usual case): the same reduction of the same [B, P] view.
        block_sums = _squares(grad.view(num_blocks, period)).sum(dim=1, keepdim=True)
        lib.gefen_cpu_block_v(exp_avg_sq.data_ptr(), block_sums.data_ptr(), num_blocks, period,
                              sc.beta2, sc.one_minus_beta2)
        return torch.sqrt(exp_avg_sq).reshape(-1)
    flat_g = grad.view(-1)
    parts: list[Tensor] = []
    for group in block_groups(num_blocks, period):
        rows = group.stop - group.first if len(group.tiles) == 1 else 1
        sumsq: Tensor | None = None
        for start, end in group.tiles:
            tile_sum = _squares(flat_g[start:end].view(rows, -1)).sum(dim=1, keepdim=True)
            sumsq = tile_sum if sumsq is None else sumsq + tile_sum
        assert sumsq is not None
        v_slot = exp_avg_sq[group.first:group.stop]
        lib.gefen_cpu_block_v(v_slot.data_ptr(), sumsq.data_ptr(), group.stop - group.first,
                              period, sc.beta2, sc.one_minus_beta2)
        parts.append(torch.sqrt(v_slot).reshape(-1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _factored_total(grad: Tensor, row: Tensor, col: Tensor, sc: ComputeScalars,
                    lib: Any) -> Tensor:
    """docs/algorithm.md#factored-second-moment steps 1-2 as ``factored_step_reference``
    computes them: the row and column sums of ``g^2`` (torch, the reference's chunks), the
    EMAs of ``row`` and ``col`` in place (native, the same operations), and ``sum(row)`` (torch),
    from which the native pass takes ``1 / rbar``. Returns that 0-dim sum."""
    rows, cols = grad.shape
    chunk = _numerics.CHUNK_ELEMENTS
    if cols <= chunk and chunk // cols >= rows:
        # The reference's loop has one iteration: the same two reductions of the same square.
        sq = _squares(grad)
        row_sum, col_sum = sq.sum(dim=1), sq.sum(dim=0)
    else:
        row_sum, col_sum = _row_col_sums(grad, _F32)
    lib.gefen_cpu_factored_ema(row.data_ptr(), row_sum.data_ptr(), rows, f32(1.0 / cols),
                               sc.beta2, sc.one_minus_beta2)
    lib.gefen_cpu_factored_ema(col.data_ptr(), col_sum.data_ptr(), cols, f32(1.0 / rows),
                               sc.beta2, sc.one_minus_beta2)
    return row.sum()


def _desc(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor, sc: ComputeScalars,
          seed: int) -> _cpu_native.TensorDesc:
    num_blocks, period = codes.shape
    if sc.capturable:
        lr, bc2, bc1_recip, decay = (float(v) for v in (sc.lr, sc.bc2, sc.bc1_recip, sc.decay))
        write = lr != 0.0
    else:
        lr, bc2, bc1_recip, decay = (sc.lr, sc.bc2, sc.bc1_recip, sc.decay)  # type: ignore[assignment]
        write = not sc.lr_is_host_zero
    d = _cpu_native.TensorDesc()
    d.param, d.grad, d.codes, d.scale = (param.data_ptr(), grad.data_ptr(), codes.data_ptr(),
                                         scale.data_ptr())
    d.num_blocks, d.period = num_blocks, period
    d.pdt, d.gdt = _DTYPE_CODES[param.dtype], _DTYPE_CODES[grad.dtype]
    d.write_param = int(write)
    d.lr, d.bc2, d.bc1_recip, d.decay = lr, bc2, bc1_recip, decay
    d.seed = seed
    return d


def _run(descs: list[_cpu_native.TensorDesc], shared: _cpu_native.Shared, *,
         muon: bool = False) -> None:
    lib = _cpu_native.library()
    assert lib is not None
    array = (_cpu_native.TensorDesc * len(descs))(*descs)
    elements = sum(d.num_blocks * d.period for d in descs)
    lib.gefen_cpu_run(array, len(descs), ctypes.byref(shared), _threads(elements), int(muon))


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
    sc = make_scalars(dtype=_F32, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      bc1_recip=bc1_recip, bc2=bc2_rsqrt, decay=decay, hyper=hyper)
    lib = _cpu_native.library()
    num_blocks, period = codes.shape
    sqrt_v = _block_sqrt_v(grad, exp_avg_sq, num_blocks, period, sc, lib)
    d = _desc(param, grad, codes, scale, sc, _seed(seed, seed_tensor))
    d.sqrt_v = sqrt_v.data_ptr()
    keep: list[Any] = [sqrt_v]
    _run([d], _shared(codebook, sc, maximize=maximize, stochastic_round=stochastic_round,
                      keep=keep))


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
    sc = make_scalars(dtype=_F32, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      bc1_recip=bc1_recip, bc2=bc2_recip, decay=decay, hyper=hyper)
    d = _desc(param, grad, codes, scale, sc, _seed(seed, seed_tensor))
    keep: list[Any] = []
    # docs/algorithm.md#factored-second-moment steps 1-2, as the reference computes them.
    if stats is not None:
        assert global_rows is not None
        d.inv_rbar = float(_finalize_reference(exp_avg_sq_row, exp_avg_sq_col, stats,
                                               global_rows, sc))
    else:
        total = _factored_total(grad, exp_avg_sq_row, exp_avg_sq_col, sc, _cpu_native.library())
        keep.append(total)
        d.r_total = total.data_ptr()
    d.factored, d.rows, d.ncols = 1, rows, cols
    d.r, d.k = exp_avg_sq_row.data_ptr(), exp_avg_sq_col.data_ptr()
    _run([d], _shared(codebook, sc, maximize=maximize, stochastic_round=stochastic_round,
                      keep=keep))


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
    b = f32(beta)
    # The codeword as the gradient dtype sees it (docs/algorithm.md#gefenmuon).
    cb_out = codebook.to(grad.dtype).to(torch.float32)
    table, _ = search_table(codebook)
    num_blocks, period = codes.shape
    shared = _cpu_native.Shared(codebook.data_ptr(), cb_out.data_ptr(), table.data_ptr(), b,
                                f32(1.0 - b), 0.0, int(maximize), int(stochastic_round),
                                int(nesterov))
    d = _cpu_native.TensorDesc()
    d.param, d.grad, d.codes, d.scale = (result.data_ptr(), grad.data_ptr(), codes.data_ptr(),
                                         scale.data_ptr())
    d.num_blocks, d.period = num_blocks, period
    d.pdt = d.gdt = _DTYPE_CODES[grad.dtype]
    d.seed = _seed(seed, seed_tensor)
    _run([d], shared, muon=True)
    return result


def step_list_cpu(
    params: Sequence[Tensor], grads: Sequence[Tensor], exp_avg_codes: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor | None],
    exp_avg_sq_rows: Sequence[Tensor | None], exp_avg_sq_cols: Sequence[Tensor | None],
    scalars: Sequence[StepScalars], *, codebook: Tensor, beta1: float, beta2: float, eps: float,
    maximize: bool, stochastic_round: bool, seeds: Sequence[int] | None,
) -> list[int]:
    """Steps the tensors of a list that the native kernel takes, in one native call: each the
    public op's CPU step (:func:`block_step_cpu` / :func:`factored_step_cpu`, the reference's
    bits) with the scalars ``scalars[i]`` (already rounded to fp32) and seed ``seeds[i]`` (or 0).
    Entry ``i`` is in block mode when ``exp_avg_sqs[i]`` is a tensor. Returns the indices it did
    not step (not native-eligible: another device or dtype, a non-contiguous tensor); the caller
    steps those through the ops. Every stepped tensor is validated before anything is mutated
    (the ops' errors, the ops' messages)."""
    n = len(params)
    if n == 0 or _cpu_native.library() is None:
        return list(range(n))
    lib = _cpu_native.library()
    rest: list[int] = []
    take: list[int] = []
    contiguous: dict[int, Tensor] = {}
    for i in range(n):
        p, g = params[i], grads[i]
        if (p.device.type != "cpu" or p.dtype not in _DTYPE_CODES or g.dtype not in _DTYPE_CODES
                or not p.is_contiguous() or g.device.type != "cpu"):
            rest.append(i)
            continue
        # The ops step the logical row-major order (docs/algorithm.md#state-layout).
        g = contiguous[i] = g if g.is_contiguous() else g.contiguous()
        sq = exp_avg_sqs[i]
        if sq is not None:
            _check_block(p, g, exp_avg_codes[i], exp_avg_scales[i], sq, codebook, beta1, beta2,
                         eps, 0 if seeds is None else seeds[i], None, None, allow_fp64=False)
        else:
            row, col = exp_avg_sq_rows[i], exp_avg_sq_cols[i]
            assert row is not None and col is not None
            _check_factored(p, g, exp_avg_codes[i], exp_avg_scales[i], row, col, codebook,
                            beta1, beta2, eps, 0 if seeds is None else seeds[i], None, None,
                            allow_fp64=False)
        if p.numel() > 0:
            take.append(i)
    if not take:
        return rest
    cache: dict[StepScalars, ComputeScalars] = {}
    descs: list[_cpu_native.TensorDesc] = []
    keep: list[Any] = []
    sc = None
    for i in take:
        param, grad = params[i], contiguous[i]
        sq = exp_avg_sqs[i]
        hs = scalars[i]
        sc = cache.get(hs)
        if sc is None:
            sc = make_scalars(dtype=_F32, lr=hs.lr, beta1=beta1, beta2=beta2, eps=eps,
                              bc1_recip=hs.bc1_recip, bc2=hs.bc2, decay=hs.decay, hyper=None)
            cache[hs] = sc
        codes = exp_avg_codes[i]
        d = _desc(param, grad, codes, exp_avg_scales[i], sc,
                  0 if seeds is None else int(seeds[i]) & _MASK64)
        if sq is not None:
            sqrt_v = _block_sqrt_v(grad, sq, int(codes.shape[0]), int(codes.shape[1]), sc, lib)
            keep.append(sqrt_v)
            d.sqrt_v = sqrt_v.data_ptr()
        else:
            row, col = exp_avg_sq_rows[i], exp_avg_sq_cols[i]
            assert row is not None and col is not None
            total = _factored_total(grad, row, col, sc, lib)
            keep.append(total)
            d.r_total = total.data_ptr()
            d.factored, d.rows, d.ncols = 1, int(param.shape[0]), int(param.shape[1])
            d.r, d.k = row.data_ptr(), col.data_ptr()
        descs.append(d)
    assert sc is not None
    _run(descs, _shared(codebook, sc, maximize=maximize, stochastic_round=stochastic_round,
                        keep=keep))
    return rest


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
