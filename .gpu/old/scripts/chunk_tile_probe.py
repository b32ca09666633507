"""Whole blocks packed densely into one program: does it beat the power-of-two tile? (diagnostic)

    PYTHONPATH=<packages>/src:scripts python scripts/chunk_tile_probe.py > chunk_probe.txt

The production tile kernel holds each block in a ``[BPP, P2]`` register tile, ``P2`` the next
power of two at or above the period, so a period just above a power of two runs up to half
its lanes masked: GPT-2's searched periods 1152, 1392 and 1536 run 44, 32 and 25 % of them
idle (``docs/results/cpu-tile-lanes/``). Where the period is not a multiple of 16 or does not
divide the column count, factored mode also gathers the column statistics with scalar loads.

The candidate here keeps the production per-element helpers and order, but lays a program's
work out as ``[NCH, 16]``: ``NCH`` chunks of 16 consecutive elements, the program's
``K = 16 NCH // P`` whole consecutive blocks packed densely (``P % 16 == 0``: every chunk lies
in one block, and, with the column count a multiple of 16, in one row). The block max is a
max per chunk, then per block over its chunks (a ``[KP2, NCH]`` masked max); the column
statistics of a chunk are 16 contiguous floats from a column that is a multiple of 16. Codes,
scales and factored-mode parameters must equal production's bit for bit (the max is
order-independent); block mode sums ``g^2`` in another order, so its second moment (and
parameters) may differ by an ulp, and the script counts them. ``--device cpu`` runs it under
``TRITON_INTERPRET=1`` on small shapes.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys

import kernel_ablation  # ROWS, NCOLS and DEVICE are set on it
import torch
import triton
import triton.language as tl
from kernel_ablation import Case, _check, _time

from gefen_kernels.ops._step_kernels import (
    _apply,
    _block_sigma,
    _factored_sigma,
    _momentum,
    _row_col,
)
from gefen_kernels.ops._triton_helpers import LAUNCH_OPTIONS


@triton.jit
def _chunk_kernel(  # type: ignore[no-untyped-def]
    p_ptr,
    g_ptr,
    q_ptr,
    s_ptr,
    v_ptr,
    row_ptr,
    col_ptr,
    inv_rbar_ptr,
    cb_ptr,
    table_ptr,
    num_blocks,
    period,
    k_blocks,
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
    NCH: tl.constexpr,
    KP2: tl.constexpr,
    FACTORED: tl.constexpr,
    STEPS: tl.constexpr,
):
    """Program ``pid`` steps blocks ``[pid K, pid K + K)`` (``K = k_blocks``)."""
    blk0 = tl.program_id(0) * k_blocks
    nblk = tl.minimum(k_blocks, num_blocks - blk0)
    chunks = tl.arange(0, NCH)
    seg = chunks // (period // 16)  # the chunk's block, counted from blk0
    cvalid = seg < nblk
    lanes = tl.arange(0, 16)
    coffs = tl.multiple_of(blk0 * period + chunks * 16, 16)
    offs = coffs[:, None] + lanes[None, :]
    mask = cvalid[:, None] & (lanes < 16)[None, :]
    s_old = tl.load(s_ptr + blk0 + seg, mask=cvalid, other=0.0)
    g, m = _momentum(g_ptr, q_ptr, cb_ptr, offs, mask, s_old[:, None], b1, omb1, False)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    big_v = p  # unused in block mode
    sigma_elem = p
    if FACTORED:
        row, col0 = _row_col(coffs, ncols, ncols_magic, ncols_shift, False)
        col0 = tl.multiple_of(col0, 16)
        r = tl.load(row_ptr + row, mask=cvalid, other=0.0)[:, None]
        k = tl.load(col_ptr + (col0[:, None] + lanes[None, :]), mask=mask, other=0.0)
        big_v, sigma_elem = _factored_sigma(r, k, inv_rbar_ptr, bc2, bc1, eps)
    segs = tl.arange(0, KP2)
    sel = segs[:, None] == seg[None, :]
    bvalid = segs < nblk
    cmax = tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1)
    cnan = tl.max((mask & (m != m)).to(tl.int32), axis=1)
    bmax = tl.max(tl.where(sel, cmax[None, :], 0.0), axis=1)
    bnan = tl.max(tl.where(sel, cnan[None, :], 0), axis=1)
    s_blk = tl.where(bnan > 0, float("nan"), bmax)
    # Each chunk's block value: exactly one term of the sum is not +0.0.
    s_new = tl.sum(tl.where(sel, s_blk[:, None], 0.0), axis=0)
    sigma = s_new  # unused in factored mode
    if not FACTORED:
        csum = tl.sum(g * g, axis=1)
        bsum = tl.sum(tl.where(sel, csum[None, :], 0.0), axis=1)
        v_old = tl.load(v_ptr + blk0 + segs, mask=bvalid, other=0.0)
        v_new, sig_blk = _block_sigma(bsum, v_old, period, b2, omb2, eps, bc2, bc1)
        tl.store(v_ptr + blk0 + segs, v_new, mask=bvalid)
        sigma = tl.sum(tl.where(sel, sig_blk[:, None], 0.0), axis=0)
    _apply(
        p_ptr,
        q_ptr,
        cb_ptr,
        table_ptr,
        offs,
        mask,
        m,
        s_new[:, None],
        sigma[:, None],
        p,
        big_v,
        sigma_elem,
        lr,
        decay,
        0,
        FACTORED,
        False,
        STEPS,
    )
    tl.store(s_ptr + blk0 + segs, s_blk, mask=bvalid)


def _launch(case: Case, nch: int) -> None:
    """One candidate step on ``case``'s state, with ``nch`` chunks per program."""
    period = case.period
    k_blocks = nch * 16 // period
    num_blocks = case.p.numel() // period
    args = case.args()
    b1, omb1, b2, omb2, eps = case.plan._floats
    _, _, ncols, magic, shift = case.plan._ints
    lr, bc2, bc1, decay = args[-4:]
    dummy = case.codebook
    _chunk_kernel[(triton.cdiv(num_blocks, k_blocks),)](
        case.p,
        case.g,
        case.codes,
        case.scale,
        case.sq if case.sq is not None else dummy,
        case.row if case.row is not None else dummy,
        case.col if case.col is not None else dummy,
        case.inv_rbar if case.inv_rbar is not None else dummy,
        case.codebook,
        case.plan._table,
        num_blocks,
        period,
        k_blocks,
        ncols,
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
        NCH=nch,
        KP2=triton.next_power_of_2(k_blocks),
        FACTORED=case.factored,
        STEPS=case.plan._consts["STEPS"],
        num_warps=max(1, nch // 32),
        **LAUNCH_OPTIONS,
    )


# (rows, columns, period): GPT-2's searched periods on its column counts (taller than its
# matrices, to fill the GPU), and a Llama matrix with a power-of-two period for comparison.
CASES = [(12288, 3072, 1152), (12288, 2304, 1536), (50257, 768, 1392), (8192, 8192, 2048)]
CPU_CASES = [(24, 3072, 1152), (24, 2304, 1536), (29, 768, 1392), (8, 8192, 2048)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="launches timed per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--chunks", default="128,256,512", help="chunks of 16 elements per program (32 per warp)"
    )
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    kernel_ablation.DEVICE = torch.device(args.device)
    cuda = args.device == "cuda"
    if cuda:
        print(
            f"device: {torch.cuda.get_device_name()}, triton {triton.__version__}, "
            f"torch {torch.__version__}"
        )
    print(
        f"{args.rounds} interleaved rounds of {args.reps} launches: the median round (ms) "
        f"and its range; % of a copy of the same 8 B/param"
    )
    print(f"\n{'case':34s} {'variant':16s} {'ms':>7s} {'range':>15s} {'% copy':>7s}  check")
    prod = importlib.import_module("gefen_kernels.ops._step_kernels")
    for rows, cols, period in CASES if cuda else CPU_CASES:
        kernel_ablation.ROWS, kernel_ablation.NCOLS = rows, cols
        copy_ms = float("nan")
        if cuda:
            src = torch.empty(rows * cols * 4, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copy_ms = _time(functools.partial(dst.copy_, src), args.reps)
            del src, dst
        for factored in (True, False):
            case = Case(period, factored)
            tag = f"{'factored' if factored else 'block'} [{rows}, {cols}] P={period}"
            runs = {"production": functools.partial(case.launch, prod)}
            for nch in (int(x) for x in args.chunks.split(",")):
                if nch * 16 >= period:
                    runs[f"chunks={nch} K={nch * 16 // period}"] = functools.partial(
                        _launch, case, nch
                    )
            times: dict[str, list[float]] = {name: [] for name in runs}
            failed: dict[str, str] = {}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    if name in failed:
                        continue
                    try:
                        times[name].append(_time(run, args.reps))
                    except Exception as exc:  # a configuration that does not compile or fit
                        failed[name] = f"failed: {type(exc).__name__}: {exc}"[:160]
            for name, run in runs.items():
                if name in failed:
                    print(f"{tag:34s} {name:16s} {failed[name]}")
                    continue
                check = "" if name == "production" else _check(case, run)
                ts = sorted(times[name])
                ms = ts[len(ts) // 2]
                print(
                    f"{tag:34s} {name:16s} {ms:7.3f} {ts[0]:7.3f}-{ts[-1]:<7.3f} "
                    f"{copy_ms / ms:7.0%}  {check}"
                )
                sys.stdout.flush()
            case = None  # type: ignore[assignment]
            if cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
