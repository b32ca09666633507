"""Block-mode Gefen step over a list of tensors in few launches
(docs/algorithm.md#block-second-moment).

Models such as GPT-2 have ~150 parameter tensors, many small: one launch per tensor makes a
step launch-bound. ``multi_block_step`` groups the tensors by (parameter dtype, gradient dtype,
next power of two of the period, the period's specialisation) and runs each group in one
launch of the grouped tile kernel (:mod:`._group_kernels`, shared with the optimizer's
:mod:`.step_groups`); every program looks its tensor up in a small device table.
Per-tensor hyperparameters and seeds come from device tensors, so the step does no host
synchronisation once the tables are cached (CUDA-graph capturable after one eager call).

The result equals ``block_step`` applied to each tensor with ``hyper=hyper[i]`` and
``seed_tensor=seeds[i:i+1]``, bit for bit on the Triton path. Tensors with a period above
4096 (not tile-route material), another gradient dtype or a pointer that is not 16-byte
aligned are stepped one by one by ``block_step_triton``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._numerics import f32
from .._triton import program_elements, require_triton, triton
from ._decision_table import kernel_table
from ._device import check_device_for_triton, keeps_tables, on_tensor_device, use_triton
from ._group_kernels import _group_tile_kernel
from ._step_kernels import TILE_ELEMENTS, TILE_MAX_PERIOD, needs_int64, tile_warps
from ._triton_helpers import LAUNCH_OPTIONS
from .block_step import _check, block_step_reference, block_step_triton
from .step_groups import _spec, tile_meta_row

__all__ = ["multi_block_step", "multi_block_step_reference", "multi_block_step_triton"]

def _check_lists(params: list[Tensor], grads: list[Tensor], codes: list[Tensor],
                 scales: list[Tensor], exp_avg_sqs: list[Tensor], codebook: Tensor,
                 beta1: float, beta2: float, eps: float, hyper: Tensor,
                 seeds: Tensor) -> None:
    n = len(params)
    for name, lst in (("grads", grads), ("codes", codes), ("scales", scales),
                      ("exp_avg_sqs", exp_avg_sqs)):
        if len(lst) != n:
            raise ValueError(f"{name} has {len(lst)} tensors but params has {n}")
    if n == 0:
        return
    dev = params[0].device
    if not isinstance(hyper, Tensor) or hyper.dtype != torch.float32 or \
            tuple(hyper.shape) != (n, 4) or hyper.device != dev or not hyper.is_contiguous():
        raise ValueError(f"hyper must be a contiguous fp32 tensor [{n}, 4] on {dev} "
                         "(rows: lr, bc2_rsqrt, bc1_recip, decay)")
    if not isinstance(seeds, Tensor) or seeds.dtype != torch.int64 or \
            tuple(seeds.shape) != (n,) or seeds.device != dev or not seeds.is_contiguous():
        raise ValueError(f"seeds must be a contiguous int64 tensor [{n}] on {dev}")
    for i in range(n):
        if params[i].device != dev:
            raise ValueError(f"params[{i}] is on {params[i].device}, params[0] on {dev}")
        _check(params[i], grads[i], codes[i], scales[i], exp_avg_sqs[i], codebook, beta1,
               beta2, eps, 0, hyper[i], seeds[i:i + 1], allow_fp64=True)


def multi_block_step_reference(
    params: list[Tensor], grads: list[Tensor], codes: list[Tensor], scales: list[Tensor],
    exp_avg_sqs: list[Tensor], codebook: Tensor, *, beta1: float, beta2: float, eps: float,
    hyper: Tensor, seeds: Tensor, maximize: bool = False, stochastic_round: bool = False,
) -> None:
    """``block_step_reference`` on every tensor ``i`` with ``hyper[i]`` and ``seeds[i]``.

    Args:
        params, grads, codes, scales, exp_avg_sqs: lists of equal length; element ``i`` as in
            :func:`block_step_reference` (each tensor its own ``[B_i, P_i]``).
        hyper: fp32 ``[T, 4]`` on the device: per tensor ``[lr, bc2_rsqrt, bc1_recip, decay]``.
        seeds: int64 ``[T]`` on the device: per-tensor (salted) stochastic-rounding seeds.

    Raises:
        ValueError, TypeError: mismatched lists or any per-tensor check of ``block_step``,
            before anything is modified.
    """
    _check_lists(params, grads, codes, scales, exp_avg_sqs, codebook, beta1, beta2, eps, hyper,
                 seeds)
    for i in range(len(params)):
        block_step_reference(params[i], grads[i], codes[i], scales[i], exp_avg_sqs[i], codebook,
                             lr=0.0, beta1=beta1, beta2=beta2, eps=eps, bc1_recip=0.0,
                             bc2_rsqrt=0.0, decay=1.0, maximize=maximize,
                             stochastic_round=stochastic_round, hyper=hyper[i],
                             seed_tensor=seeds[i:i + 1])


_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TABLES: dict[tuple, tuple[Tensor, Tensor, Tensor, int]] = {}
_TABLES_MAX = 64


def _group_tables(members: list[int], params: list[Tensor], grads: list[Tensor],
                  codes: list[Tensor], scales: list[Tensor], exp_avg_sqs: list[Tensor], bpp: int,
                  spec: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, int]:
    """Device meta table, program map and gradient-offset table of one group (rows as
    :func:`.step_groups.tile_meta_row`, offsets from the group's first tensors), cached by
    the tensors' addresses."""
    key = (device, bpp, spec, tuple((i, params[i].data_ptr(), grads[i].data_ptr(),
                                     codes[i].data_ptr(), scales[i].data_ptr(),
                                     exp_avg_sqs[i].data_ptr(), tuple(codes[i].shape))
                                    for i in members))
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("multi_block_step: run one eager step with these tensors before "
                           "capturing a CUDA graph (its launch tables are built then)")
    m0 = members[0]
    bases = (params[m0], codes[m0], scales[m0])
    rows: list[list[int]] = []
    prog: list[int] = []
    gptr = [0] * len(params)
    for local, i in enumerate(members):
        num_blocks, period = codes[i].shape
        rows.append(tile_meta_row(params[i], codes[i], scales[i], exp_avg_sqs[i], None, bases,
                                  t=i, num_blocks=num_blocks, period=period, ncols=1, magic=0,
                                  shift=0, specs=(spec, 1), tile_first=len(prog)))
        prog.extend([local] * triton.cdiv(num_blocks, bpp))
        gptr[i] = (grads[i].data_ptr() - grads[m0].data_ptr()) // 16
    tables = (torch.tensor(rows, dtype=torch.int64).to(device),
              torch.tensor(prog, dtype=torch.int32).to(device),
              torch.tensor(gptr, dtype=torch.int64).to(device), len(prog))
    if keeps_tables():
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        _TABLES[key] = tables
    return tables


@on_tensor_device
def multi_block_step_triton(
    params: list[Tensor], grads: list[Tensor], codes: list[Tensor], scales: list[Tensor],
    exp_avg_sqs: list[Tensor], codebook: Tensor, *, beta1: float, beta2: float, eps: float,
    hyper: Tensor, seeds: Tensor, maximize: bool = False, stochastic_round: bool = False,
) -> None:
    """Triton twin of :func:`multi_block_step_reference`: one launch of the grouped tile
    kernel (:mod:`._group_kernels`) per group of tile-route tensors with the same (param
    dtype, grad dtype, power-of-two period class, period specialisation, offset width).
    Tensors with a longer period, another gradient dtype or a pointer that is not 16-byte
    aligned are stepped by :func:`block_step_triton`; every tensor's result equals
    ``block_step_triton``'s bit for bit.

    Raises:
        ImportError: Triton is not installed. ValueError, TypeError: as the reference, plus
            fp64 params and non-CUDA tensors outside the interpreter.
    """
    _check_lists(params, grads, codes, scales, exp_avg_sqs, codebook, beta1, beta2, eps, hyper,
                 seeds)
    if not params:
        return
    require_triton("multi_block_step (Triton path)")
    check_device_for_triton(params[0])
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if p.dtype == torch.float64:
            raise TypeError(f"params[{i}] is fp64: fp64 parameters take the reference path")
        num_blocks, period = codes[i].shape
        if num_blocks * period == 0:
            continue
        aligned = all(t.data_ptr() % 16 == 0
                      for t in (p, grads[i], codes[i], scales[i], exp_avg_sqs[i]))
        if period > TILE_MAX_PERIOD or grads[i].dtype not in _GRAD_DTYPES or not aligned:
            block_step_triton(p, grads[i], codes[i], scales[i], exp_avg_sqs[i], codebook,
                              lr=0.0, beta1=beta1, beta2=beta2, eps=eps, bc1_recip=0.0,
                              bc2_rsqrt=0.0, decay=1.0, maximize=maximize,
                              stochastic_round=stochastic_round, hyper=hyper[i],
                              seed_tensor=seeds[i:i + 1])
            continue
        p2 = 1 << max(0, (period - 1).bit_length())
        key = (p.dtype, grads[i].dtype, p2, _spec(period), needs_int64(num_blocks, period))
        groups.setdefault(key, []).append(i)
    table, steps = kernel_table(codebook, stochastic=bool(stochastic_round))
    b1, b2 = f32(beta1), f32(beta2)
    for (p_dtype, g_dtype, p2, spec, offs64), members in groups.items():
        bpp = max(1, program_elements(TILE_ELEMENTS) // p2)
        meta, prog, gptr, programs = _group_tables(members, params, grads, codes, scales,
                                                   exp_avg_sqs, bpp, spec, params[0].device)
        m0 = members[0]
        _group_tile_kernel[(programs,)](
            meta, prog, gptr, params[m0], grads[m0], codes[m0], scales[m0], codebook, codebook,
            table, hyper, seeds, b1, f32(1.0 - b1), b2, f32(1.0 - b2), f32(eps),
            P_VEC=16 // p_dtype.itemsize, G_VEC=16 // g_dtype.itemsize, BPP=bpp, P2=p2,
            FACTORED=False, MAXIMIZE=bool(maximize), STOCHASTIC=bool(stochastic_round),
            STEPS=steps, OFFS64=offs64, IN_ROW=False, TAIL=0, FLAT_UPDATE=False,
            SPEC_PERIOD=spec, SPEC_NCOLS=1,
            num_warps=tile_warps(bpp * p2), **LAUNCH_OPTIONS)


@torch.library.custom_op(
    "gefen::multi_block_step", mutates_args=("params", "codes", "scales", "exp_avg_sqs"))
def _multi_block_step_op(params: list[Tensor], grads: list[Tensor], codes: list[Tensor],
                         scales: list[Tensor], exp_avg_sqs: list[Tensor], codebook: Tensor,
                         hyper: Tensor, seeds: Tensor, beta1: float, beta2: float, eps: float,
                         maximize: bool, stochastic_round: bool) -> None:
    multi_block_step_reference(params, grads, codes, scales, exp_avg_sqs, codebook, beta1=beta1,
                               beta2=beta2, eps=eps, hyper=hyper, seeds=seeds,
                               maximize=maximize, stochastic_round=stochastic_round)


@_multi_block_step_op.register_kernel("cuda")
def _multi_block_step_cuda(params: list[Tensor], grads: list[Tensor], codes: list[Tensor],
                           scales: list[Tensor], exp_avg_sqs: list[Tensor], codebook: Tensor,
                           hyper: Tensor, seeds: Tensor, beta1: float, beta2: float,
                           eps: float, maximize: bool, stochastic_round: bool) -> None:
    fp64 = any(p.dtype == torch.float64 for p in params)
    impl = (multi_block_step_triton if params and use_triton(params[0]) and not fp64
            else multi_block_step_reference)
    impl(params, grads, codes, scales, exp_avg_sqs, codebook, beta1=beta1, beta2=beta2, eps=eps,
         hyper=hyper, seeds=seeds, maximize=maximize, stochastic_round=stochastic_round)


@_multi_block_step_op.register_fake
def _multi_block_step_fake(params: list[Tensor], grads: list[Tensor], codes: list[Tensor],
                           scales: list[Tensor], exp_avg_sqs: list[Tensor], codebook: Tensor,
                           hyper: Tensor, seeds: Tensor, beta1: float, beta2: float,
                           eps: float, maximize: bool, stochastic_round: bool) -> None:
    return None


def multi_block_step(
    params: list[Tensor], grads: list[Tensor], codes: list[Tensor], scales: list[Tensor],
    exp_avg_sqs: list[Tensor], codebook: Tensor, *, beta1: float, beta2: float, eps: float,
    hyper: Tensor, seeds: Tensor, maximize: bool = False, stochastic_round: bool = False,
) -> None:
    """Block-mode step of many tensors through ``torch.ops.gefen.multi_block_step``.

    Arguments as :func:`multi_block_step_reference`. CUDA: Triton (grouped launches) when
    available; otherwise the per-tensor reference.
    """
    _check_lists(params, grads, codes, scales, exp_avg_sqs, codebook, beta1, beta2, eps, hyper,
                 seeds)
    torch.ops.gefen.multi_block_step(list(params), list(grads), list(codes), list(scales),
                                     list(exp_avg_sqs), codebook, hyper, seeds, float(beta1),
                                     float(beta2), float(eps), bool(maximize),
                                     bool(stochastic_round))
