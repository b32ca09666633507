"""Does a persistent tile kernel fed by pipelined TMA loads beat the step tile kernel? (diagnostic)

    PYTHONPATH=<packages>/src:scripts python scripts/tma_tile_probe.py > tma_probe.txt

The production tile kernel (``_step_tile_kernel``) gives each program one register tile: it
loads the tile, reduces it, quantises and stores, and only the other resident programs hide
its load latency (the sixteenth session: 31 % occupancy, 0.29 ms per 67M elements against
0.134 ms for a copy of the same bytes). This probe times a candidate that keeps the same
per-element arithmetic (the production helpers, called in the same order) but

* is persistent: ``programs_per_sm x SMs`` programs step through the blocks;
* reads the gradient, codes, parameter and (factored) column statistics with tensor-memory
  -accelerator descriptors over ``[N / 256, 256]`` views, in a ``tl.range`` loop of
  ``num_stages`` stages, so Triton's pipeliner issues the next blocks' loads while this
  block is computed; the codes and parameters are stored through the same descriptors.

Only blocks that are rows of that view qualify (``P % 256 == 0``, and in factored mode
``P`` divides the column count): Llama's ``P = 2048``. Factored mode must be bit-identical to
production (codes, scales, parameters: the block max is order-independent); block mode sums
``g^2`` in another order, so its second moment and parameters may differ by an ulp, and the
script prints how many do. Needs Triton with ``tl.range`` pipelining of tensor descriptors
(3.6 on the H200). ``--device cpu`` runs it under ``TRITON_INTERPRET=1`` on 16 rows.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import sys

import kernel_ablation  # DEVICE and ROWS are set on it
import torch
import triton
import triton.language as tl
from kernel_ablation import Case, _check, _time
from triton.tools.tensor_descriptor import TensorDescriptor

from gefen_kernels.ops._step_kernels import (
    _block_sigma,
    _codewords,
    _factored_sigma,
    _load_scalars,
    _row_col,
    tl_momentum_ema,
    tl_nan_max,
    tl_quantize_nearest,
    tl_round_to,
)
from gefen_kernels.ops._triton_helpers import (
    LAUNCH_OPTIONS,
    STAGED_CODES32,
    STAGED_THRESHOLDS32,
    _bucket,
    _gather,
)

W = 256  # width of the [N / W, W] views the descriptors read


@triton.jit
def _tma_tile_kernel(  # type: ignore[no-untyped-def]
    p_desc,
    g_desc,
    q_desc,
    k_desc,
    p_out_ptr,
    q_ptr,
    s_ptr,
    v_ptr,
    row_ptr,
    inv_rbar_ptr,
    cb_ptr,
    table_ptr,
    hyper_ptr,
    num_blocks,
    period,
    ncols,
    ncols_magic,
    ncols_shift,
    b1,
    omb1,
    b2,
    omb2,
    eps,
    lr,
    bc2,
    bc1,
    decay,
    R: tl.constexpr,
    FACTORED: tl.constexpr,
    STEPS: tl.constexpr,
    NS: tl.constexpr,
    HOIST: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    """Blocks ``pid, pid + programs, ...``; block ``b`` is rows ``[b R, (b + 1) R)`` of the
    ``[N / 256, 256]`` views (``R = P / 256``)."""
    lr, bc2, bc1, decay = _load_scalars(hyper_ptr, lr, bc2, bc1, decay, False)
    # HOIST: the codebook and the staged section in registers once per program, not per block.
    cb = tl.load(cb_ptr + tl.arange(0, 256))
    # Both roundings' sections (nearest, then toward zero for zero gradients).
    words = tl.load(table_ptr.to(tl.pointer_type(tl.int32)) + STAGED_CODES32 + tl.arange(0, 2048))
    thresholds = tl.load(
        table_ptr.to(tl.pointer_type(tl.float32)) + STAGED_THRESHOLDS32 + tl.arange(0, 512)
    )
    offs = tl.arange(0, R)[:, None] * 256 + tl.arange(0, 256)[None, :]
    for blk in tl.range(tl.program_id(0), num_blocks, tl.num_programs(0), num_stages=NS):
        g = g_desc.load([blk * R, 0]).to(tl.float32)
        code = q_desc.load([blk * R, 0]).to(tl.int32)
        p = p_desc.load([blk * R, 0])
        s_old = tl.load(s_ptr + blk)
        if HOIST:
            m = tl_momentum_ema(b1, omb1, s_old, _gather(cb, code), g)
        else:
            m = tl_momentum_ema(b1, omb1, s_old, _codewords(cb_ptr, code), g)
        if FACTORED:
            brow, bcol = _row_col(blk * period, ncols, ncols_magic, ncols_shift, False)
            k = k_desc.load([bcol // 256, 0])
            r = tl.load(row_ptr + brow)
            big_v, sigma = _factored_sigma(r, k, inv_rbar_ptr, bc2, bc1, eps)
        else:
            sumsq = tl.sum(tl.sum(g * g, axis=1), axis=0)
            v_new, sigma = _block_sigma(
                sumsq, tl.load(v_ptr + blk), period, b2, omb2, eps, bc2, bc1
            )
            tl.store(v_ptr + blk, v_new)
            big_v = sigma
        absm = tl.abs(m)
        s_new = tl_nan_max(tl.max(absm, axis=1), tl.max((m != m).to(tl.int32), axis=1), 0)
        positive = s_new > 0
        z = tl.where(positive, tl.math.div_rn(m, tl.where(positive, s_new, 1.0)), 0.0)
        if HOIST:  # tl_quantize_nearest's staged branch, on the hoisted tensors
            b = _bucket(z)
            zi = (g == 0.0).to(tl.int32)
            q_lo = (_gather(words, (b >> 2) + zi * 1024) >> ((b & 3) * 8)) & 255
            q = q_lo + (z > _gather(thresholds, q_lo + zi * 256)).to(tl.int32)
            codeword = _gather(cb, q)
        else:
            q, codeword = tl_quantize_nearest(z, cb_ptr, table_ptr, STEPS, g == 0.0)
        base = blk * period
        if TMA_STORE:
            q_desc.store([blk * R, 0], q.to(tl.uint8))
        else:
            tl.store(q_ptr + (base + offs), q.to(tl.uint8))
        mhat = codeword * s_new
        if FACTORED:
            mhat = tl.where(big_v == 0.0, 0.0, mhat)
        u = (mhat * sigma) * lr
        decayed = tl_round_to(p.to(tl.float32) * decay, p.dtype).to(tl.float32)
        if TMA_STORE:
            p_desc.store([blk * R, 0], tl_round_to(decayed - u, p.dtype))
        else:
            tl.store(p_out_ptr + (base + offs), tl_round_to(decayed - u, p.dtype))
        tl.store(s_ptr + blk, s_new)


def _launch(case: Case, stages: int, per_sm: int, warps: int, hoist: bool, tma_store: bool) -> None:
    """One candidate step on ``case``'s state (its production arguments, re-packed)."""
    period = case.period
    rows = period // W
    n = case.p.numel()
    p_d = TensorDescriptor(case.p.view(-1, W), [n // W, W], [W, 1], [rows, W])
    g_d = TensorDescriptor(case.g.view(-1, W), [n // W, W], [W, 1], [rows, W])
    q_d = TensorDescriptor(case.codes.view(-1, W), [n // W, W], [W, 1], [rows, W])
    if case.col is not None:
        k_d = TensorDescriptor(case.col.view(-1, W), [case.col.numel() // W, W], [W, 1], [rows, W])
    else:  # block mode never reads it
        k_d = g_d
    args = case.args()
    num_blocks = n // period
    b1, omb1, b2, omb2, eps = case.plan._floats
    magic, shift = case.plan._ints[3], case.plan._ints[4]
    lr, bc2, bc1, decay = args[-4:]
    if kernel_ablation.DEVICE.type == "cuda":
        sms = torch.cuda.get_device_properties(kernel_ablation.DEVICE).multi_processor_count
    else:
        sms = 2
    grid = (min(num_blocks, sms * per_sm),)
    dummy = case.codebook
    _tma_tile_kernel[grid](
        p_d,
        g_d,
        q_d,
        k_d,
        case.p,
        case.codes,
        case.scale,
        case.sq if case.sq is not None else dummy,
        case.row if case.row is not None else dummy,
        case.inv_rbar if case.inv_rbar is not None else dummy,
        case.codebook,
        case.plan._table,
        dummy,
        num_blocks,
        period,
        8192,
        magic,
        shift,
        b1,
        omb1,
        b2,
        omb2,
        eps,
        lr,
        bc2,
        bc1,
        decay,
        R=rows,
        FACTORED=case.factored,
        STEPS=case.plan._consts["STEPS"],
        NS=stages,
        HOIST=hoist,
        TMA_STORE=tma_store,
        num_warps=warps,
        **LAUNCH_OPTIONS,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--per-sm", default="2,4,8")
    parser.add_argument("--warps", default="4")
    parser.add_argument(
        "--hoist",
        default="0,1",
        help="0: codebook and tables loaded per block, 1: once per program",
    )
    parser.add_argument(
        "--tma-store", default="0,1", help="1: codes and parameters stored through the descriptors"
    )
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    kernel_ablation.DEVICE = torch.device(args.device)
    kernel_ablation.ROWS = 8192 if args.device == "cuda" else 16
    n = kernel_ablation.ROWS * 8192
    if args.device == "cuda":
        src = torch.empty(n * 4, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = _time(functools.partial(dst.copy_, src), args.reps)
        del src, dst
        print(
            f"device: {torch.cuda.get_device_name()}, triton {triton.__version__}, "
            f"torch {torch.__version__}"
        )
        print(f"copy of 8 B/param for {n} elements: {copy_ms:.3f} ms")
    else:
        copy_ms = float("nan")
    print(f"\n{'case':22s} {'variant':28s} {'ms':>7s} {'% copy':>7s}  check")
    for factored in (True, False):
        case = Case(2048, factored)
        mode = "factored" if factored else "block"
        tag = f"{mode} P=2048"
        prod = importlib.import_module("gefen_kernels.ops._step_kernels")
        ms = _time(functools.partial(case.launch, prod), args.reps)
        print(f"{tag:22s} {'production':28s} {ms:7.3f} {copy_ms / ms:7.0%}")
        configs = itertools.product(
            (int(w) for w in args.warps.split(",")),
            (int(x) for x in args.stages.split(",")),
            (int(x) for x in args.per_sm.split(",")),
            (bool(int(x)) for x in args.hoist.split(",")),
            (bool(int(x)) for x in args.tma_store.split(",")),
        )
        for warps, stages, per_sm, hoist, tma_store in configs:
            run = functools.partial(_launch, case, stages, per_sm, warps, hoist, tma_store)
            try:
                ms = _time(run, args.reps)
                check = _check(case, run)
            except Exception as exc:  # a configuration that does not compile or fit
                ms, check = float("nan"), f"failed: {type(exc).__name__}: {exc}"[:160]
            name = (
                f"s={stages} {per_sm}/SM w={warps}{' hoist' if hoist else ''}"
                f"{' tma-st' if tma_store else ''}"
            )
            print(f"{tag:22s} {name:28s} {ms:7.3f} {copy_ms / ms:7.0%}  {check}")
            sys.stdout.flush()
        case = None  # type: ignore[assignment]
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
