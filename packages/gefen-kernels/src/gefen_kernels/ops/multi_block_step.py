"""Block-mode Gefen step over a list of tensors in few launches (ALGORITHM.md §1.10, §3.5).

Models such as GPT-2 have ~150 parameter tensors, many small: one launch per tensor makes a
step launch-bound. ``multi_block_step`` groups the tensors by (parameter dtype, gradient dtype,
next power of two of the period) and runs each group in one launch of the tile-route kernel;
every program looks its tensor up in a small device table (addresses, sizes, first program).
Per-tensor hyperparameters and seeds come from device tensors, so the step does no host
synchronisation once the tables are cached (CUDA-graph capturable after one eager call).

The result equals ``block_step`` applied to each tensor with ``hyper=hyper[i]`` and
``seed_tensor=seeds[i:i+1]``, bit for bit on the Triton path. Tensors with a period above
4096 (not tile-route material) are stepped one by one by ``block_step_triton``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._numerics import f32
from .._triton import jit, program_elements, require_triton, tl, triton
from ._dispatch import check_device_for_triton, use_triton
from ._search_table import kernel_table
from ._step_kernels import (
    TILE_ELEMENTS,
    TILE_MAX_PERIOD,
    _tile_blocks,
    needs_int64,
    tile_warps,
)
from ._triton_helpers import LAUNCH_OPTIONS
from .block_step import _check, block_step_reference, block_step_triton

__all__ = ["multi_block_step", "multi_block_step_reference", "multi_block_step_triton"]

_META_COLS = 9  # p, g, q, s, v addresses; num_blocks; period; first program; tensor index


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


@jit
def _multi_tile_kernel(meta_ptr, prog_ptr, cb_ptr, table_ptr, hyper_ptr, seed_ptr,  # type: ignore[no-untyped-def]
                       b1, omb1, b2, omb2, eps,
                       P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BPP: tl.constexpr,
                       P2: tl.constexpr, MAXIMIZE: tl.constexpr, STOCHASTIC: tl.constexpr,
                       STEPS: tl.constexpr, OFFS64: tl.constexpr):
    """Tile route over many tensors: program ``pid`` serves tensor ``prog_ptr[pid]``.

    meta_ptr: int64 ``[n, 9]`` rows (param, grad, codes, scale, exp_avg_sq addresses;
    num_blocks; period; the tensor's first program; its index into hyper/seeds). prog_ptr:
    int32 ``[programs]``. hyper_ptr: fp32 ``[T, 4]``; seed_ptr: int64 ``[T]``. P_DTYPE,
    G_DTYPE: element types of params and grads of this group. OFFS64: int64 offsets (a
    tensor of the group is near 2**31 elements), else int32. table_ptr: the packed search table
    (:func:`._search_table.kernel_table`).
    """
    pid = tl.program_id(0)
    row = meta_ptr + tl.load(prog_ptr + pid).to(tl.int64) * 9
    p_ptr = tl.load(row + 0).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DTYPE))
    q_ptr = tl.load(row + 2).to(tl.pointer_type(tl.uint8))
    s_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    # int32 offsets unless the group holds a tensor near 2**31 elements (OFFS64).
    num_blocks = tl.load(row + 5)
    period = tl.load(row + 6)
    local = pid.to(tl.int64) - tl.load(row + 7)
    if not OFFS64:
        num_blocks = num_blocks.to(tl.int32)
        period = period.to(tl.int32)
        local = local.to(tl.int32)
    t = tl.load(row + 8)
    lr = tl.load(hyper_ptr + t * 4 + 0)
    bc2 = tl.load(hyper_ptr + t * 4 + 1)
    bc1 = tl.load(hyper_ptr + t * 4 + 2)
    decay = tl.load(hyper_ptr + t * 4 + 3)
    seed_u = tl.load(seed_ptr + t).to(tl.uint64, bitcast=True)
    _tile_blocks(local, p_ptr, g_ptr, q_ptr, s_ptr, v_ptr, s_ptr, s_ptr, s_ptr, cb_ptr,
                 table_ptr, num_blocks, period, 1, 0, 0, b1, omb1, b2, omb2, eps, lr, bc2, bc1,
                 decay, seed_u, BPP, P2, False, MAXIMIZE, STOCHASTIC, STEPS, OFFS64)


_TL_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_TABLES: dict[tuple, tuple[Tensor, Tensor, int, int]] = {}
_TABLES_MAX = 64


def _group_tables(members: list[int], params: list[Tensor], grads: list[Tensor],
                  codes: list[Tensor], scales: list[Tensor], exp_avg_sqs: list[Tensor], p2: int,
                  device: torch.device) -> tuple[Tensor, Tensor, int, int]:
    """Device meta table and program map of one group, cached by the tensors' addresses."""
    bpp = max(1, program_elements(TILE_ELEMENTS) // p2)
    key = (device, bpp, tuple((i, params[i].data_ptr(), grads[i].data_ptr(),
                               codes[i].data_ptr(), scales[i].data_ptr(),
                               exp_avg_sqs[i].data_ptr(), tuple(codes[i].shape))
                              for i in members))
    hit = _TABLES.get(key)
    if hit is not None:
        return hit[0], hit[1], hit[2], hit[3]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("multi_block_step: run one eager step with these tensors before "
                           "capturing a CUDA graph (its launch tables are built then)")
    rows, prog = [], []
    first = 0
    for local, i in enumerate(members):
        num_blocks, period = codes[i].shape
        count = triton.cdiv(num_blocks, bpp)
        rows.append([params[i].data_ptr(), grads[i].data_ptr(), codes[i].data_ptr(),
                     scales[i].data_ptr(), exp_avg_sqs[i].data_ptr(), num_blocks, period,
                     first, i])
        prog.extend([local] * count)
        first += count
    meta = torch.tensor(rows, dtype=torch.int64).to(device)
    prog_t = torch.tensor(prog, dtype=torch.int32).to(device)
    if len(_TABLES) >= _TABLES_MAX:
        _TABLES.clear()
    _TABLES[key] = (meta, prog_t, first, bpp)
    return meta, prog_t, first, bpp


def multi_block_step_triton(
    params: list[Tensor], grads: list[Tensor], codes: list[Tensor], scales: list[Tensor],
    exp_avg_sqs: list[Tensor], codebook: Tensor, *, beta1: float, beta2: float, eps: float,
    hyper: Tensor, seeds: Tensor, maximize: bool = False, stochastic_round: bool = False,
) -> None:
    """Triton twin of :func:`multi_block_step_reference`: one launch per (param dtype,
    grad dtype, power-of-two period class) group of tile-route tensors.

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
        if period > TILE_MAX_PERIOD or grads[i].dtype not in _TL_DTYPES:
            block_step_triton(p, grads[i], codes[i], scales[i], exp_avg_sqs[i], codebook,
                              lr=0.0, beta1=beta1, beta2=beta2, eps=eps, bc1_recip=0.0,
                              bc2_rsqrt=0.0, decay=1.0, maximize=maximize,
                              stochastic_round=stochastic_round, hyper=hyper[i],
                              seed_tensor=seeds[i:i + 1])
            continue
        p2 = 1 << max(0, (period - 1).bit_length())
        groups.setdefault((p.dtype, grads[i].dtype, p2), []).append(i)
    table, steps = kernel_table(codebook, stochastic=bool(stochastic_round))
    b1, b2 = f32(beta1), f32(beta2)
    for (p_dtype, g_dtype, p2), members in groups.items():
        meta, prog, programs, bpp = _group_tables(members, params, grads, codes, scales,
                                                  exp_avg_sqs, p2, params[0].device)
        _multi_tile_kernel[(programs,)](
            meta, prog, codebook, table, hyper, seeds, b1, f32(1.0 - b1), b2, f32(1.0 - b2),
            f32(eps), P_DTYPE=getattr(tl, _tl_name(p_dtype)), G_DTYPE=getattr(
                tl, _tl_name(g_dtype)), BPP=bpp, P2=p2, MAXIMIZE=bool(maximize),
            STOCHASTIC=bool(stochastic_round), STEPS=steps,
            OFFS64=any(needs_int64(*codes[i].shape) for i in members),
            num_warps=tile_warps(bpp * p2), **LAUNCH_OPTIONS)


def _tl_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


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
