"""The factored step split in two: quantise in a tile pass, update in a flat pass? (diagnostic)

    PYTHONPATH=<packages>/src:scripts python scripts/split_step_probe.py > split_probe.txt

The production factored tile kernel does everything in one pass per block: the momentum, the
block max, the quantiser, the per-element ``V`` and ``sigma`` (an IEEE square root and a
division) and the parameter write, in a ``[BPP, P2]`` register tile. It is bound by
instruction issue at about 99 instructions per element (``docs/internals/kernel-notes.md``,
seventeenth session). The codes and scales do not depend on the second moment, so the work
can be cut in two passes (kernel notes, "9 B/param factored"):

* ``quant``: a tile pass over whole blocks that reads the gradient and the codes, computes the
  momentum and the block max, quantises, and writes the new codes and scales (4 B/param);
* ``update``: a flat pass in chunks of 16 elements that reads the new codes, the scales, the
  row and column statistics and the parameter, and writes the parameter (5 B/param). It has
  no reduction, so it needs no block-shaped tile, and a chunk lies in one row and one block
  whenever the period and the column count are multiples of 16 (GPT-2's periods included);
* ``strip`` (the 9 B/param form, blocks in rows only): ``quant`` that also sums ``g^2`` per
  block and per column over a strip of rows, so the statistics pass's own read of the
  gradient goes away. Its column partials would be reduced by a finalize launch (not timed),
  and its sums are neither checked nor used (``update`` reads production's statistics).

Since ``321c30c`` production itself splits where blocks cross rows
(``_step_kernels.flat_update``); the ``fused tile`` row is the one-pass kernel there, and the
``tile (production)`` rows of ``docs/results/h200-2026-12-02-session20/`` are it everywhere.
The split must give production's codes, scales and parameters bit for bit (the same
helpers in the same order); the script checks it. The cases decay the parameters
(``Case.args``), so the update pass always rounds the decayed parameter, as production does
unless the decay is 1. It times, interleaved: production's
statistics pass and tile kernel, ``quant``, ``update`` and ``strip``, on bf16 matrices with
Llama's and GPT-2's periods. Ablations (timed only; their results differ on purpose):
``quant`` with the approximate division for ``m / s'``, ``update`` with the approximate square
root and division in ``sigma``, or with no ``sigma``. ``--ncu`` launches each kernel once on
two cases, for Nsight Compute's counts (``docs/results/h200-2026-12-02-session20/``).
``--device cpu`` runs it under ``TRITON_INTERPRET=1`` on small shapes.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from typing import Any

import kernel_ablation  # ROWS, NCOLS and DEVICE are set on it
import torch
import triton
import triton.language as tl
from kernel_ablation import Case, _check, _time

from gefen_kernels.ops._step_kernels import (
    _factored_sigma,
    _momentum,
    _row_col,
    ncols_divider,
    tile_shape,
)
from gefen_kernels.ops._triton_helpers import (
    LAUNCH_OPTIONS,
    tl_codewords,
    tl_nan_max,
    tl_quantize_nearest,
    tl_round_to,
)
from gefen_kernels.ops.factored_step import factored_stats_triton


@triton.jit
def _quantise_store(  # type: ignore[no-untyped-def]
    q_ptr, cb_ptr, table_ptr, offs, mask, m, zero, s_new, STEPS: tl.constexpr,
    FAST: tl.constexpr = 0
):
    """Production's ``_apply`` up to the code store (``zero``: the gradient is exactly 0, the
    toward-zero lookup). ``FAST`` (an ablation, other codes): ``m / s'`` by the approximate
    division instead of ``div_rn``."""
    positive = s_new > 0
    if FAST:
        z = tl.where(positive, tl.fdiv(m, tl.where(positive, s_new, 1.0)), 0.0)
    else:
        z = tl.where(positive, tl.math.div_rn(m, tl.where(positive, s_new, 1.0)), 0.0)
    q, _ = tl_quantize_nearest(z, cb_ptr, table_ptr, STEPS, zero)
    tl.store(q_ptr + offs, q.to(tl.uint8), mask=mask)


@triton.jit
def _piece(g_ptr, q_ptr, cb_ptr, blocks, bmask, cols, s_old, period, b1, omb1):  # type: ignore[no-untyped-def]
    mask = bmask[:, None] & (cols < period)[None, :]
    offs = blocks[:, None] * period + cols[None, :]
    g, m = _momentum(g_ptr, q_ptr, cb_ptr, offs, mask, s_old[:, None], b1, omb1, False)
    return offs, mask, g, m


@triton.jit
def _quant_kernel(  # type: ignore[no-untyped-def]
    g_ptr,
    q_ptr,
    s_ptr,
    cb_ptr,
    table_ptr,
    num_blocks,
    period,
    b1,
    omb1,
    BPP: tl.constexpr,
    P2: tl.constexpr,
    TAIL: tl.constexpr,
    STEPS: tl.constexpr,
    FAST: tl.constexpr = 0,
):
    """Blocks ``[pid BPP, (pid + 1) BPP)``: new codes and scales, no parameter write.
    ``FAST``: see :func:`_quantise_store`."""
    blocks = tl.program_id(0) * BPP + tl.arange(0, BPP)
    bmask = blocks < num_blocks
    s_old = tl.load(s_ptr + blocks, mask=bmask, other=0.0)
    if TAIL == 0:
        offs, mask, g, m = _piece(
            g_ptr, q_ptr, cb_ptr, blocks, bmask, tl.arange(0, P2), s_old, period, b1, omb1
        )
        s_new = tl_nan_max(tl.where(mask, tl.abs(m), 0.0), mask & (m != m), 1)
        _quantise_store(q_ptr, cb_ptr, table_ptr, offs, mask, m, g == 0.0, s_new[:, None], STEPS,
                        FAST)
    else:
        offs, mask, g, m = _piece(
            g_ptr, q_ptr, cb_ptr, blocks, bmask, tl.arange(0, P2 // 2), s_old, period, b1, omb1
        )
        offs_t, mask_t, g_t, m_t = _piece(
            g_ptr,
            q_ptr,
            cb_ptr,
            blocks,
            bmask,
            tl.arange(0, TAIL) + P2 // 2,
            s_old,
            period,
            b1,
            omb1,
        )
        s_max = tl.maximum(
            tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1),
            tl.max(tl.where(mask_t, tl.abs(m_t), 0.0), axis=1),
        )
        any_nan = tl.maximum(
            tl.max((mask & (m != m)).to(tl.int32), axis=1),
            tl.max((mask_t & (m_t != m_t)).to(tl.int32), axis=1),
        )
        s_new = tl.where(any_nan > 0, float("nan"), s_max)
        _quantise_store(q_ptr, cb_ptr, table_ptr, offs, mask, m, g == 0.0, s_new[:, None], STEPS,
                        FAST)
        _quantise_store(q_ptr, cb_ptr, table_ptr, offs_t, mask_t, m_t, g_t == 0.0, s_new[:, None],
                        STEPS, FAST)
    tl.store(s_ptr + blocks, s_new, mask=bmask)


@triton.jit
def _strip_kernel(  # type: ignore[no-untyped-def]
    g_ptr,
    q_ptr,
    s_ptr,
    cb_ptr,
    table_ptr,
    rowpart_ptr,
    colpart_ptr,
    nrows,
    ncols,
    period,
    rows_per_program,
    b1,
    omb1,
    P2: tl.constexpr,
    STEPS: tl.constexpr,
):
    """Blocks in rows (``period | ncols``): program ``(j, s)`` steps block column ``j`` of rows
    ``[s R, (s + 1) R)``, one block per iteration, and writes each block's ``sum g^2`` to
    ``rowpart[row, j]`` and its columns' ``sum g^2`` over the strip to ``colpart[s, cols]``."""
    j = tl.program_id(0)
    strip = tl.program_id(1)
    bpr = ncols // period
    cols = tl.arange(0, P2)
    cmask = cols < period
    col_acc = tl.zeros([P2], dtype=tl.float32)
    row = strip * rows_per_program
    stop = tl.minimum(row + rows_per_program, nrows)
    while row < stop:
        block = row * bpr + j
        offs = block * period + cols
        s_old = tl.load(s_ptr + block)
        g, m = _momentum(g_ptr, q_ptr, cb_ptr, offs, cmask, s_old, b1, omb1, False)
        s_new = tl_nan_max(tl.where(cmask, tl.abs(m), 0.0), cmask & (m != m), 0)
        _quantise_store(q_ptr, cb_ptr, table_ptr, offs, cmask, m, g == 0.0, s_new, STEPS)
        tl.store(s_ptr + block, s_new)
        sq = g * g
        tl.store(rowpart_ptr + block, tl.sum(sq, axis=0))
        col_acc += sq
        row += 1
    tl.store(colpart_ptr + strip * ncols + j * period + cols, col_acc, mask=cmask)


@triton.jit
def _update_kernel(  # type: ignore[no-untyped-def]
    p_ptr,
    q_ptr,
    s_ptr,
    row_ptr,
    col_ptr,
    inv_rbar_ptr,
    cb_ptr,
    n,
    ncols,
    ncols_magic,
    ncols_shift,
    period,
    per_magic,
    per_shift,
    lr,
    bc2,
    bc1,
    eps,
    decay,
    NCH: tl.constexpr,
    SIGMA: tl.constexpr = 0,
):
    """Elements ``[pid 16 NCH, (pid + 1) 16 NCH)`` as ``NCH`` chunks of 16, each inside one
    row and one block: production's ``_apply`` from ``m^ = c[q'] s'`` on, for new codes and
    scales already written. ``SIGMA`` (ablations, other parameters): 0 production's
    ``sigma``; 1 the same expression with the approximate square root and division; 2 no
    ``sigma`` (``V`` only)."""
    chunks = tl.arange(0, NCH)
    lanes = tl.arange(0, 16)
    coffs = tl.program_id(0) * (NCH * 16) + chunks * 16
    coffs = tl.multiple_of(coffs, 16)
    cvalid = coffs < n
    offs = coffs[:, None] + lanes[None, :]
    mask = cvalid[:, None] & (lanes < 16)[None, :]
    block, _ = _row_col(coffs, period, per_magic, per_shift, False)
    row, col0 = _row_col(coffs, ncols, ncols_magic, ncols_shift, False)
    col0 = tl.multiple_of(col0, 16)
    s_new = tl.load(s_ptr + block, mask=cvalid, other=0.0)[:, None]
    r = tl.load(row_ptr + row, mask=cvalid, other=0.0)[:, None]
    k = tl.load(col_ptr + (col0[:, None] + lanes[None, :]), mask=mask, other=0.0)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    code = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
    if SIGMA == 0:
        big_v, sigma = _factored_sigma(r, k, inv_rbar_ptr, bc2, bc1, eps)
    elif SIGMA == 1:
        big_v = (r * k) * tl.load(inv_rbar_ptr)
        sigma = tl.fdiv(1.0, tl.sqrt(big_v * bc2) + eps) * bc1
    else:
        big_v = (r * k) * tl.load(inv_rbar_ptr)
        sigma = bc1
    mhat = tl_codewords(cb_ptr, code) * s_new
    mhat = tl.where(big_v == 0.0, 0.0, mhat)
    u = (mhat * sigma) * lr
    # Production skips this rounding when decay == 1; the probe's cases decay (Case.args).
    decayed = tl_round_to(p.to(tl.float32) * decay, p.dtype).to(tl.float32)
    tl.store(p_ptr + offs, tl_round_to(decayed - u, p.dtype), mask=mask)


def _scalars(case: Case) -> dict[str, Any]:
    b1, omb1, _, _, eps = case.plan._floats
    lr, bc2, bc1, decay = case.args()[-4:]
    num_blocks, period, ncols, magic, shift = case.plan._ints
    return dict(
        b1=b1,
        omb1=omb1,
        eps=eps,
        lr=lr,
        bc2=bc2,
        bc1=bc1,
        decay=decay,
        num_blocks=num_blocks,
        period=period,
        ncols=ncols,
        magic=magic,
        shift=shift,
    )


def _quant(case: Case, fast: int = 0) -> None:
    sc = _scalars(case)
    p2, bpp, tail = tile_shape(sc["period"], True)
    _quant_kernel[(triton.cdiv(sc["num_blocks"], bpp),)](
        case.g,
        case.codes,
        case.scale,
        case.codebook,
        case.plan._table,
        sc["num_blocks"],
        sc["period"],
        sc["b1"],
        sc["omb1"],
        BPP=bpp,
        P2=p2,
        TAIL=tail,
        STEPS=case.plan._consts["STEPS"],
        FAST=fast,
        num_warps=case.plan._consts["num_warps"],
        **LAUNCH_OPTIONS,
    )


def _strip(case: Case, scratch: dict[str, torch.Tensor], rows_per_program: int) -> None:
    sc = _scalars(case)
    rows, cols, period = case.p.shape[0], sc["ncols"], sc["period"]
    strips = triton.cdiv(rows, rows_per_program)
    if f"col{rows_per_program}" not in scratch:
        scratch["row"] = torch.empty(sc["num_blocks"], device=case.p.device)
        scratch[f"col{rows_per_program}"] = torch.empty(strips, cols, device=case.p.device)
    p2 = triton.next_power_of_2(period)
    _strip_kernel[(cols // period, strips)](
        case.g,
        case.codes,
        case.scale,
        case.codebook,
        case.plan._table,
        scratch["row"],
        scratch[f"col{rows_per_program}"],
        rows,
        cols,
        period,
        rows_per_program,
        sc["b1"],
        sc["omb1"],
        P2=p2,
        STEPS=case.plan._consts["STEPS"],
        num_warps=4 if p2 <= 2048 else 8,
        **LAUNCH_OPTIONS,
    )


def _update(case: Case, nch: int, warps: int, sigma: int = 0) -> None:
    sc = _scalars(case)
    # Each 16-element chunk must lie in one row and one block.
    assert sc["period"] % 16 == 0 and sc["ncols"] % 16 == 0, (sc["period"], sc["ncols"])
    n = case.p.numel()
    per_magic, per_shift = ncols_divider(sc["period"])
    _update_kernel[(triton.cdiv(n, 16 * nch),)](
        case.p,
        case.codes,
        case.scale,
        case.row,
        case.col,
        case.inv_rbar,
        case.codebook,
        n,
        sc["ncols"],
        sc["magic"],
        sc["shift"],
        sc["period"],
        per_magic,
        per_shift,
        sc["lr"],
        sc["bc2"],
        sc["bc1"],
        sc["eps"],
        sc["decay"],
        NCH=nch,
        SIGMA=sigma,
        num_warps=warps,
        **LAUNCH_OPTIONS,
    )


def _split(case: Case, nch: int, warps: int) -> None:
    _quant(case)
    _update(case, nch, warps)


def _strip_split(case: Case, scratch: dict[str, torch.Tensor], rows_per_program: int) -> None:
    _strip(case, scratch, rows_per_program)
    _update(case, 128, 4)


def _fused(case: Case) -> None:
    """The one-pass tile kernel, also where production now splits (``FLAT_UPDATE``)."""
    prod = importlib.import_module("gefen_kernels.ops._step_kernels")
    consts = dict(case.plan._consts, FLAT_UPDATE=False)
    prod._step_tile_kernel[case.plan._grid](*case.args(), 0, **consts)


def _stats(case: Case) -> None:
    factored_stats_triton(case.g, case.row, case.col, beta2=0.999, layout=case.plan._stats_layout)


# (rows, columns, period): Llama's matrices with its searched power-of-two periods, and
# GPT-2's periods on its column counts (taller than its matrices, to fill the GPU).
CASES = [
    (8192, 8192, 2048),
    (8192, 8192, 256),
    (12288, 3072, 1152),
    (12288, 2304, 1536),
    (50257, 768, 1392),
]
CPU_CASES = [(8, 8192, 2048), (8, 2048, 256), (24, 3072, 1152), (24, 2304, 1536), (29, 768, 1392)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="launches timed per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--ncu",
        action="store_true",
        help="one launch of each kernel and ablation on two cases, nothing else (under ncu)",
    )
    args = parser.parse_args()
    kernel_ablation.DEVICE = torch.device(args.device)
    cuda = args.device == "cuda"
    if args.ncu:
        for rows, cols, period in (CASES[0], CASES[2]):
            kernel_ablation.ROWS, kernel_ablation.NCOLS = rows, cols
            case = Case(period, True)
            _fused(case)
            for fast in (0, 1):
                _quant(case, fast)
            for sigma in (0, 1, 2):
                _update(case, 128, 4, sigma)
        torch.cuda.synchronize()
        return
    if cuda:
        print(
            f"device: {torch.cuda.get_device_name()}, triton {triton.__version__}, "
            f"torch {torch.__version__}"
        )
    print(
        f"{args.rounds} interleaved rounds of {args.reps} launches: the median round (ms) "
        f"and its range; % of a copy of the bytes the launch moves"
    )
    print(f"\n{'case':28s} {'launch':36s} {'ms':>7s} {'range':>15s} {'% copy':>7s}  check")
    prod = importlib.import_module("gefen_kernels.ops._step_kernels")
    for rows, cols, period in CASES if cuda else CPU_CASES:
        kernel_ablation.ROWS, kernel_ablation.NCOLS = rows, cols
        case = Case(period, True)
        scratch: dict[str, torch.Tensor] = {}
        in_rows = cols % period == 0
        # name -> (launch, bytes per element it moves, or None: no bit check)
        runs: dict[str, tuple[Any, float, bool]] = {
            "stats (production)": (functools.partial(_stats, case), 2.0, False),
            "fused tile": (functools.partial(_fused, case), 8.0, True),
            "production": (functools.partial(case.launch, prod), 8.0, False),
            "quant": (functools.partial(_quant, case), 4.0, False),
        }
        runs["quant, approximate m / s' (ablation)"] = (
            functools.partial(_quant, case, 1),
            4.0,
            False,
        )
        for sigma, what in ((1, "approximate sigma"), (2, "no sigma")):
            runs[f"update, {what} (ablation)"] = (
                functools.partial(_update, case, 128, 4, sigma),
                5.0,
                False,
            )
        for nch, warps in ((128, 4), (256, 8)):
            runs[f"update nch={nch} w={warps}"] = (
                functools.partial(_update, case, nch, warps),
                5.0,
                False,
            )
            runs[f"quant+update nch={nch} w={warps}"] = (
                functools.partial(_split, case, nch, warps),
                9.0,
                True,
            )
        if in_rows:
            for rpp in (16, 64):
                runs[f"strip rows={rpp}"] = (
                    functools.partial(_strip, case, scratch, rpp),
                    4.0,
                    False,
                )
                runs[f"strip+update rows={rpp}"] = (
                    functools.partial(_strip_split, case, scratch, rpp),
                    9.0,
                    True,
                )
        copy_ms = float("nan")
        if cuda:
            src = torch.empty(rows * cols * 4, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copy_ms = _time(functools.partial(dst.copy_, src), args.reps)  # 8 B/element
            del src, dst
        tag = f"[{rows}, {cols}] P={period}"
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, (run, _, _) in runs.items():
                times[name].append(_time(run, args.reps))
        for name, (run, nbytes, check) in runs.items():
            ts = sorted(times[name])
            ms = ts[len(ts) // 2]
            verdict = _check(case, run) if check else ""
            print(
                f"{tag:28s} {name:36s} {ms:7.3f} {ts[0]:7.3f}-{ts[-1]:<7.3f} "
                f"{copy_ms * nbytes / 8 / ms:7.0%}  {verdict}"
            )
            sys.stdout.flush()
        case = None  # type: ignore[assignment]
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
