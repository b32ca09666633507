"""Triton kernels of the Gefen step, shared by ``block_step`` and ``factored_step``.

The two modes differ only in the denominator: per block from ``exp_avg_sq`` (``FACTORED=False``)
or per element from the row/column statistics (``FACTORED=True``, ``sigma`` computed in
registers from ``r[row]``, ``k[col]`` and ``1/rbar``). Three routes cover every period; all
produce bit-identical codes and scales (the block max is order-independent) and the same
parameters for the same second moment:

* ``tile``: one program holds ``BPP`` whole blocks as a ``[BPP, P2]`` register tile
  (``P2`` = next power of two >= P, ``BPP * P2 >= 2048``), so small blocks share a program and
  every byte is touched once: grad read, param read+write, codes read+write (8 B/param for
  bf16 params). Used for ``P <= 4096``. In factored mode a period just above a power of two
  is held as a ``[BPP, P2 / 2]`` head and a narrower tail (:func:`tile_shape`), and where the
  blocks cross rows (:func:`flat_update`) the tile only quantises and a flat launch in
  16-element chunks updates the parameter (9 B/param instead of 8: codes are read back).
* ``loop``: one program per block, looping over it in tiles twice (max and sum of squares,
  then quantise and write); the second sweep re-reads grad and codes from L2. Used for long
  blocks when there are enough of them to fill the GPU.
* ``split``: few long blocks: each block is split over ``S`` programs. Phase 1 writes partial
  max / sum of squares per (block, split) to scratch; a fixed-order reduction (torch) gives the
  block max, the second moment and ``sigma``; phase 2 recomputes the momentum, quantises and
  writes; the new scales are copied last (phase 2 still reads the old ones). No atomics: the
  result is deterministic.

Pointer arguments: ``p_ptr`` param (fp32/bf16/fp16, ``N``), ``g_ptr`` grad (``N``, fp32/bf16/
fp16), ``q_ptr`` uint8 codes ``[B, P]``, ``s_ptr`` fp32 scales ``[B]``, ``v_ptr`` fp32 second
moment ``[B]`` (block mode), ``row_ptr``/``col_ptr`` fp32 ``[R]``/``[C]`` and ``inv_rbar_ptr``
fp32 ``[1]`` (factored mode), ``cb_ptr`` fp32 ``[256]``, ``hyper_ptr`` fp32 ``[4]``
(``HYPER``), ``seed_ptr`` int64 ``[1]`` (``SEED_PTR``), ``table_ptr`` the packed int64 search
table of :func:`._decision_table.kernel_table` (``STEPS`` probes; ``STEPS=0``: full search, table
unused). All arithmetic is fp32. Constexprs: ``FACTORED`` mode, ``MAXIMIZE`` negate grad,
``STOCHASTIC`` rounding, ``HYPER``/``SEED_PTR`` read scalars from device memory (CUDA-graph
capturable), ``OFFS64`` int64 offsets (tensors near 2**31 elements, :func:`needs_int64`; else
int32: half the address arithmetic, and 32-bit row/column division in factored mode).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .._numerics import f32, to_signed64
from .._triton import jit, program_elements, require_triton, tl, triton
from ._decision_table import kernel_table
from ._device import check_device_for_triton
from ._step_ref import denominator
from ._triton_helpers import (
    LAUNCH_OPTIONS,
    tl_momentum_ema,
    tl_nan_max,
    tl_quantize_nearest,
    tl_quantize_stochastic,
    tl_round_to,
)
from ._triton_helpers import tl_codewords as _codewords  # c[code] (a register gather)

TILE_MAX_PERIOD = 4096  # tile route up to this period
TILE_ELEMENTS = 2048  # elements per program in the tile route (at least one whole block)
LOOP_TILE = 2048  # elements per iteration in the loop and split routes
SPLIT_ELEMENTS = 16384  # elements of one block per program in the split route


@jit
def _index(x, OFFS64: tl.constexpr):  # type: ignore[no-untyped-def]
    """Integer ``x`` (int32 or the constant 1) widened to int64 when ``OFFS64``: tensors
    near 2**31 elements; otherwise kept 32-bit (cheaper address arithmetic, and a 32-bit
    row/column division in factored mode)."""
    if OFFS64:
        # Not .to(): `period` may be the Python int 1 (Triton specialises ints equal to 1).
        return x + tl.zeros([], dtype=tl.int64)
    else:
        return x


def needs_int64(num_blocks: int, period: int, *, split_elements: int = SPLIT_ELEMENTS,
                loop_tile: int = LOOP_TILE) -> bool:
    """Whether a ``[num_blocks, period]`` launch needs int64 offsets: any offset a program
    forms, masked lanes included (a tile's last blocks, a loop's or split's last tile),
    could pass 2**31 - 1. ``split_elements`` and ``loop_tile``: the launch's own (tests pass
    other values than the defaults); the tile is the widest a program gets here."""
    tile = max(program_elements(TILE_ELEMENTS), loop_tile)
    slack = 4 * max(SPLIT_ELEMENTS, split_elements, loop_tile)
    return (num_blocks + tile + 2) * max(period, 1) + slack >= 2**31


@jit
def _load_scalars(hyper_ptr, lr, bc2, bc1, decay, HYPER: tl.constexpr):  # type: ignore[no-untyped-def]
    if HYPER:
        lr = tl.load(hyper_ptr + 0)
        bc2 = tl.load(hyper_ptr + 1)
        bc1 = tl.load(hyper_ptr + 2)
        decay = tl.load(hyper_ptr + 3)
    return lr, bc2, bc1, decay


@jit
def _load_seed(seed_ptr, seed, SEED_PTR: tl.constexpr):  # type: ignore[no-untyped-def]
    if SEED_PTR:
        s = tl.load(seed_ptr)
    else:
        s = seed.to(tl.int64)
    return s.to(tl.uint64, bitcast=True)


@jit
def _block_sigma(sumsq, v_old, period, b2, omb2, eps, bc2, bc1):
    """v' = b2 v + (1-b2) f32(sumsq / P); sigma = f32(1/f32(f32(sqrt(v') * bc2) + eps)) * bc1."""
    # `period` may arrive as the Python int 1 (Triton specialises int arguments equal to 1):
    # adding it to an fp32 zero converts it (round to nearest, as .to would) in either case.
    mean = tl.math.div_rn(sumsq, tl.zeros([], dtype=tl.float32) + period)
    v_new = b2 * v_old + omb2 * mean
    return v_new, _sigma_from_v(v_new, eps, bc2, bc1)


@jit
def _sigma_from_v(v_new, eps, bc2, bc1):  # type: ignore[no-untyped-def]
    """sigma = f32(1/f32(f32(sqrt(v') * bc2) + eps)) * bc1 (the second half of _block_sigma)."""
    h = tl.math.sqrt_rn(v_new) * bc2
    h = h + eps
    return tl.math.div_rn(1.0, h) * bc1


@jit
def _momentum(g_ptr, q_ptr, cb_ptr, offs, mask, s_old, b1, omb1, MAXIMIZE: tl.constexpr):  # type: ignore[no-untyped-def]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        # Not `-g`: Triton lowers unary minus to `0 - g`, which turns -(+0.0) into +0.0 on the
        # GPU (the interpreter and torch give -0.0); the sign of a zero reaches the Nesterov
        # output of the Muon kernel. Multiplying by -1 is exact and keeps it.
        g = g * -1.0
    code = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
    m = tl_momentum_ema(b1, omb1, s_old, _codewords(cb_ptr, code), g)
    return g, m


@jit
def _sweep_block(g_ptr, q_ptr, cb_ptr, base, lanes, period, s_old, b1, omb1,  # type: ignore[no-untyped-def]
                 MAXIMIZE: tl.constexpr, TILE: tl.constexpr):
    """First sweep of the loop routes (Gefen and Muon): the block's new scale ``max |m|``
    (NaN-propagating) and ``sum g^2``, over ``period`` elements from ``base`` in ``TILE``
    steps. The second sweep recomputes ``m`` (from L2) instead of holding the block."""
    acc_max = tl.zeros([TILE], dtype=tl.float32)
    acc_nan = tl.zeros([TILE], dtype=tl.int32)
    acc_sq = tl.zeros([TILE], dtype=tl.float32)
    # while, not range(): Triton 3.3's interpreter cannot take a runtime loop bound.
    start = period * 0
    while start < period:
        mask = start + lanes < period
        offs = base + start + lanes
        g, m = _momentum(g_ptr, q_ptr, cb_ptr, offs, mask, s_old, b1, omb1, MAXIMIZE)
        acc_max = tl.maximum(acc_max, tl.where(mask, tl.abs(m), 0.0))
        acc_nan = acc_nan | (mask & (m != m)).to(tl.int32)
        acc_sq += g * g
        start += TILE
    return tl_nan_max(acc_max, acc_nan, 0), tl.sum(acc_sq, axis=0)


@functools.lru_cache(maxsize=1024)  # per-step launchers ask again for the same few sizes
def ncols_divider(ncols: int) -> tuple[int, int]:
    """``(magic, shift)`` such that ``n // ncols == umulhi(2 * n, magic) >> shift`` for every
    ``0 <= n < 2**31`` (Granlund and Montgomery 1994, Theorem 4.2 with N = 31: ``shift =
    ceil(log2(ncols))``, ``magic = ceil(2**(31 + shift) / ncols) < 2**32``). ``magic`` is
    returned as the int32 with the same bits, the type the kernels take it in."""
    if not 1 <= ncols < 2**31:
        raise ValueError(f"ncols must be in [1, 2**31), got {ncols}")
    shift = (ncols - 1).bit_length()
    magic = -(-(1 << (31 + shift)) // ncols)
    return (magic - (1 << 32) if magic >= 1 << 31 else magic), shift


@jit
def _row_col(offs, ncols, ncols_magic, ncols_shift, OFFS64: tl.constexpr):  # type: ignore[no-untyped-def]
    """``(offs // ncols, offs % ncols)`` of non-negative offsets. int32 offsets divide by a
    multiply-high and a shift (:func:`ncols_divider`): the hardware has no integer divider and
    the generic division is about twenty instructions per element."""
    if OFFS64:
        row = offs // ncols
    else:
        two_n = offs.to(tl.uint32, bitcast=True) << 1
        high = tl.umulhi(two_n, ncols_magic.to(tl.uint32, bitcast=True))
        row = (high >> ncols_shift.to(tl.uint32)).to(tl.int32, bitcast=True)
    return row, offs - row * ncols


@jit
def _stored_block_scalars(s_ptr, v_ptr, eps, bc2, bc1, FACTORED: tl.constexpr):  # type: ignore[no-untyped-def]
    """The block's new scale and (block mode) sigma, read back after a CTA barrier from where
    the loop routes just stored them, so every thread quantises and updates with the one
    stored value. On H200 runs (Triton 3.6) the loop route, which used each thread's own copy
    of the block reductions, gave parameter updates off by a few percent in some lanes of a
    few blocks per 64M-element step, differently on each run, while the stored scale and
    second moment matched the reference. The split route, which reads its block values from
    memory, never did."""
    tl.debug_barrier()
    s_new = tl.load(s_ptr, cache_modifier=".cg")
    sigma = s_new  # unused in factored mode
    if not FACTORED:
        sigma = _sigma_from_v(tl.load(v_ptr, cache_modifier=".cg"), eps, bc2, bc1)
    return s_new, sigma


@jit
def _update_inputs(p_ptr, row_ptr, col_ptr, inv_rbar_ptr, offs, mask, ncols, ncols_magic,  # type: ignore[no-untyped-def]
                   ncols_shift, bc2, bc1, eps, FACTORED: tl.constexpr, OFFS64: tl.constexpr):
    """The parameter values and (factored mode) the per-element ``V`` and ``sigma`` of
    ``offs``. Called before the block reduction and the quantisation, so these loads are in
    flight while they run instead of after them (the tile route is latency-bound otherwise)."""
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    big_v = p  # unused in block mode
    sigma = p
    if FACTORED:
        row, col = _row_col(offs, ncols, ncols_magic, ncols_shift, OFFS64)
        r = tl.load(row_ptr + row, mask=mask, other=0.0)
        k = tl.load(col_ptr + col, mask=mask, other=0.0)
        big_v, sigma = _factored_sigma(r, k, inv_rbar_ptr, bc2, bc1, eps)
    return p, big_v, sigma


@jit
def _factored_sigma(r, k, inv_rbar_ptr, bc2, bc1, eps):  # type: ignore[no-untyped-def]
    """``V = f32(f32(r k) * f32(1/rbar))`` and
    ``sigma = f32(f32(1/f32(f32(sqrt(f32(V * bc2))) + eps)) * bc1)``, per element
    (docs/algorithm.md#factored-second-moment)."""
    big_v = (r * k) * tl.load(inv_rbar_ptr)
    h = tl.math.sqrt_rn(big_v * bc2)
    h = h + eps
    return big_v, tl.math.div_rn(1.0, h) * bc1


@jit
def _row_update_inputs(p_ptr, row_ptr, col_ptr, inv_rbar_ptr, blocks, bmask, cols, offs, mask,  # type: ignore[no-untyped-def]
                       period, ncols, ncols_magic, ncols_shift, bc2, bc1, eps,
                       OFFS64: tl.constexpr):
    """:func:`_update_inputs` in factored mode for a tile of whole blocks that each lie in one
    row, starting at a column that is a multiple of 16 (:func:`blocks_in_rows`): one row
    statistic per block, and the block's column statistics contiguous, so they load as
    16-byte vectors. The per-element form gathers ``k`` with scalar loads that span 16 cache
    lines per warp instruction (the tile holds 16 consecutive elements per thread). The same
    values, so the same bits; on the H200 the factored tile kernel took 13-16 % less time
    (bf16 [8192, 8192], P = 2048 and 256)."""
    brow, bcol = _row_col(blocks * period, ncols, ncols_magic, ncols_shift, OFFS64)
    bcol = tl.multiple_of(bcol, 16)
    r = tl.load(row_ptr + brow, mask=bmask, other=0.0)[:, None]
    k = tl.load(col_ptr + (bcol[:, None] + cols[None, :]), mask=mask, other=0.0)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    big_v, sigma = _factored_sigma(r, k, inv_rbar_ptr, bc2, bc1, eps)
    return p, big_v, sigma


@jit
def _apply(p_ptr, q_ptr, cb_ptr, table_ptr, offs, mask, m, zero, s_new, sigma_block, p, big_v,  # type: ignore[no-untyped-def]
           sigma_elem, lr, decay, seed_u, FACTORED: tl.constexpr, STOCHASTIC: tl.constexpr,
           STEPS: tl.constexpr):
    """Normalise, quantise, write codes and (lr != 0) the parameter update for ``offs``;
    ``zero``: the gradient is exactly 0 (:func:`_quantise`); ``p``, ``big_v``, ``sigma_elem``
    from :func:`_update_inputs`."""
    codeword = _quantise(q_ptr, cb_ptr, table_ptr, offs, mask, m, zero, s_new, seed_u,
                         STOCHASTIC, STEPS)
    _write_param(p_ptr, offs, mask, codeword, s_new, sigma_block, p, big_v, sigma_elem, lr,
                 decay, FACTORED)


@jit
def _quantise(q_ptr, cb_ptr, table_ptr, offs, mask, m, zero, s_new, seed_u,  # type: ignore[no-untyped-def]
              STOCHASTIC: tl.constexpr, STEPS: tl.constexpr):
    """Normalise ``m`` by the block's new scale, quantise, write the codes of ``offs``; returns
    the new codewords ``c[q']``. Where ``zero`` (the element's gradient is exactly 0) the
    rounding is toward zero (docs/algorithm.md#toward-zero-rounding)."""
    positive = s_new > 0
    z = tl.where(positive, tl.math.div_rn(m, tl.where(positive, s_new, 1.0)), 0.0)
    if STOCHASTIC:
        q, codeword = tl_quantize_stochastic(z, cb_ptr, table_ptr, STEPS, seed_u, offs, zero)
    else:
        q, codeword = tl_quantize_nearest(z, cb_ptr, table_ptr, STEPS, zero)
    tl.store(q_ptr + offs, q.to(tl.uint8), mask=mask)
    return codeword


@jit
def _write_param(p_ptr, offs, mask, codeword, s_new, sigma_block, p, big_v, sigma_elem, lr,  # type: ignore[no-untyped-def]
                 decay, FACTORED: tl.constexpr):
    """(lr != 0) The parameter update of ``offs`` from the new codewords and scale:
    ``p <- fp(fp(p * decay) - f32(f32(c[q'] s' sigma) lr))`` (docs/algorithm.md#block-second-moment
    step 5)."""
    if lr != 0.0:
        mhat = codeword * s_new
        if FACTORED:
            sigma = sigma_elem
            # Row or column never had a gradient: exact momentum 0, no update (_numerics).
            mhat = tl.where(big_v == 0.0, 0.0, mhat)
        else:
            sigma = sigma_block
        u = (mhat * sigma) * lr
        if decay == 1.0:
            # p * 1 is p and p is already in p's dtype: the rounding below is the identity
            # (a NaN p stays NaN; GPU arithmetic canonicalises it in `decayed - u` either way).
            decayed = p.to(tl.float32)
        else:
            decayed = tl_round_to(p.to(tl.float32) * decay, p.dtype).to(tl.float32)
        tl.store(p_ptr + offs, tl_round_to(decayed - u, p.dtype), mask=mask)


@jit
def _flat_update(pid, p_ptr, q_ptr, s_ptr, row_ptr, col_ptr, inv_rbar_ptr, cb_ptr, numel16,  # type: ignore[no-untyped-def]
                 period, period_magic, period_shift, ncols, ncols_magic, ncols_shift, bc2, bc1,
                 eps, lr, decay, CHUNKS: tl.constexpr):
    """The parameter update of a factored tensor whose codes and scales the tile route has
    just written (``FLAT_UPDATE``, :func:`flat_update`): elements ``[pid 16 CHUNKS,
    (pid + 1) 16 CHUNKS)`` as ``CHUNKS`` chunks of 16, each inside one row and one block (the
    period and the column count are multiples of 16), so a chunk takes one scale, one row
    statistic and 16 contiguous column statistics. ``numel16``: elements / 16. The same
    operations as the tile's own update (:func:`_write_param`, :func:`_factored_sigma`) on the
    same values, so the same bits; int32 offsets only."""
    chunks = tl.arange(0, CHUNKS)
    lanes = tl.arange(0, 16)
    coffs = tl.multiple_of(pid * (CHUNKS * 16) + chunks * 16, 16)
    cvalid = coffs < numel16 * 16
    offs = coffs[:, None] + lanes[None, :]
    mask = cvalid[:, None] & (lanes < 16)[None, :]
    block, _ = _row_col(coffs, period, period_magic, period_shift, False)
    row, col0 = _row_col(coffs, ncols, ncols_magic, ncols_shift, False)
    col0 = tl.multiple_of(col0, 16)
    s_new = tl.load(s_ptr + block, mask=cvalid, other=0.0)[:, None]
    r = tl.load(row_ptr + row, mask=cvalid, other=0.0)[:, None]
    k = tl.load(col_ptr + (col0[:, None] + lanes[None, :]), mask=mask, other=0.0)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    code = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
    big_v, sigma = _factored_sigma(r, k, inv_rbar_ptr, bc2, bc1, eps)
    _write_param(p_ptr, offs, mask, _codewords(cb_ptr, code), s_new, sigma, p, big_v, sigma,
                 lr, decay, True)


@jit
def _tile_piece(p_ptr, g_ptr, q_ptr, row_ptr, col_ptr, inv_rbar_ptr, cb_ptr, blocks, bmask,  # type: ignore[no-untyped-def]
                cols, s_old, period, ncols, ncols_magic, ncols_shift, b1, omb1, bc2, bc1, eps,
                MAXIMIZE: tl.constexpr, OFFS64: tl.constexpr, IN_ROW: tl.constexpr,
                FLAT_UPDATE: tl.constexpr):
    """Factored mode, columns ``cols`` of ``blocks``: ``(offs, mask, m, zero, p, V, sigma)`` of
    that ``[BPP, len(cols)]`` piece (:func:`_momentum`, ``zero`` where the gradient is exactly
    0, then :func:`_row_update_inputs` where ``IN_ROW``, else :func:`_update_inputs`; with
    ``FLAT_UPDATE`` neither, and ``p``, ``V`` and ``sigma`` are ``m``, unused)."""
    mask = bmask[:, None] & (cols < period)[None, :]
    offs = blocks[:, None] * period + cols[None, :]
    g, m = _momentum(g_ptr, q_ptr, cb_ptr, offs, mask, s_old[:, None], b1, omb1, MAXIMIZE)
    zero = g == 0.0
    if FLAT_UPDATE:
        p, big_v, sigma = m, m, m
    elif IN_ROW:
        p, big_v, sigma = _row_update_inputs(p_ptr, row_ptr, col_ptr, inv_rbar_ptr, blocks,
                                             bmask, cols, offs, mask, period, ncols,
                                             ncols_magic, ncols_shift, bc2, bc1, eps, OFFS64)
    else:
        p, big_v, sigma = _update_inputs(p_ptr, row_ptr, col_ptr, inv_rbar_ptr, offs, mask,
                                         ncols, ncols_magic, ncols_shift, bc2, bc1, eps, True,
                                         OFFS64)
    return offs, mask, m, zero, p, big_v, sigma


@jit
def _tile_blocks(pid, p_ptr, g_ptr, q_ptr, s_ptr, v_ptr, row_ptr, col_ptr, inv_rbar_ptr, cb_ptr,  # type: ignore[no-untyped-def]
                 table_ptr, num_blocks, period, ncols, ncols_magic, ncols_shift, b1, omb1, b2,
                 omb2, eps, lr, bc2, bc1, decay, seed_u, BPP: tl.constexpr, P2: tl.constexpr,
                 FACTORED: tl.constexpr, MAXIMIZE: tl.constexpr, STOCHASTIC: tl.constexpr,
                 STEPS: tl.constexpr, OFFS64: tl.constexpr, IN_ROW: tl.constexpr,
                 TAIL: tl.constexpr, FLAT_UPDATE: tl.constexpr):
    """The tile route's work for program ``pid`` of one tensor: blocks
    ``[pid * BPP, (pid + 1) * BPP)`` as a ``[BPP, P2]`` register tile. ``OFFS64``: int64
    offsets, else int32 (``pid``, ``num_blocks`` and ``period`` must then be int32).
    ``IN_ROW``: :func:`blocks_in_rows` holds (factored mode only).

    ``TAIL > 0`` (factored mode, :func:`tile_shape`): the blocks are held as a
    ``[BPP, P2 // 2]`` head, every lane inside the block, and a ``[BPP, TAIL]`` tail for the
    rest, so a period just above a power of two runs on ``P2 / 2 + TAIL`` lanes instead of
    ``P2`` (masked lanes execute the arithmetic too): 1152 on 1152 lanes, not 2048. The same
    bits as the one tile (a max does not depend on its order, and factored mode has no block
    sum).

    ``FLAT_UPDATE`` (factored mode, :func:`flat_update`): the tile quantises and writes codes
    and scales only; :func:`_flat_update` then updates the parameter."""
    period = _index(period, OFFS64)
    num_blocks = _index(num_blocks, OFFS64)
    blocks = _index(pid, OFFS64) * BPP + _index(tl.arange(0, BPP), OFFS64)
    if TAIL == 0:
        cols = _index(tl.arange(0, P2), OFFS64)
        bmask = blocks < num_blocks
        mask = bmask[:, None] & (cols < period)[None, :]
        offs = blocks[:, None] * period + cols[None, :]
        s_old = tl.load(s_ptr + blocks, mask=bmask, other=0.0)
        g, m = _momentum(g_ptr, q_ptr, cb_ptr, offs, mask, s_old[:, None], b1, omb1, MAXIMIZE)
        if FLAT_UPDATE:
            p, big_v, sigma_elem = m, m, m  # unused: _flat_update writes the parameter
        elif FACTORED and IN_ROW:
            p, big_v, sigma_elem = _row_update_inputs(p_ptr, row_ptr, col_ptr, inv_rbar_ptr,
                                                      blocks, bmask, cols, offs, mask, period,
                                                      ncols, ncols_magic, ncols_shift, bc2, bc1,
                                                      eps, OFFS64)
        else:
            p, big_v, sigma_elem = _update_inputs(p_ptr, row_ptr, col_ptr, inv_rbar_ptr, offs,
                                                  mask, ncols, ncols_magic, ncols_shift, bc2,
                                                  bc1, eps, FACTORED, OFFS64)
        s_new = tl_nan_max(tl.where(mask, tl.abs(m), 0.0), mask & (m != m), 1)
        sigma = s_new  # unused in factored mode
        if not FACTORED:
            v_old = tl.load(v_ptr + blocks, mask=bmask, other=0.0)
            v_new, sigma = _block_sigma(tl.sum(g * g, axis=1), v_old, period, b2, omb2, eps,
                                        bc2, bc1)
            tl.store(v_ptr + blocks, v_new, mask=bmask)
        if FLAT_UPDATE:
            _quantise(q_ptr, cb_ptr, table_ptr, offs, mask, m, g == 0.0, s_new[:, None],
                      seed_u, STOCHASTIC, STEPS)
        else:
            _apply(p_ptr, q_ptr, cb_ptr, table_ptr, offs, mask, m, g == 0.0, s_new[:, None],
                   sigma[:, None], p, big_v, sigma_elem, lr, decay, seed_u, FACTORED,
                   STOCHASTIC, STEPS)
        tl.store(s_ptr + blocks, s_new, mask=bmask)
    else:
        tl.static_assert(FACTORED, "a head and a tail piece in factored mode only (tile_shape)")
        bmask = blocks < num_blocks
        s_old = tl.load(s_ptr + blocks, mask=bmask, other=0.0)
        offs, mask, m, zero, p, big_v, sigma_elem = _tile_piece(
            p_ptr, g_ptr, q_ptr, row_ptr, col_ptr, inv_rbar_ptr, cb_ptr, blocks, bmask,
            _index(tl.arange(0, P2 // 2), OFFS64), s_old, period, ncols, ncols_magic,
            ncols_shift, b1, omb1, bc2, bc1, eps, MAXIMIZE, OFFS64, IN_ROW, FLAT_UPDATE)
        offs_t, mask_t, m_t, zero_t, p_t, big_v_t, sigma_t = _tile_piece(
            p_ptr, g_ptr, q_ptr, row_ptr, col_ptr, inv_rbar_ptr, cb_ptr, blocks, bmask,
            _index(tl.arange(0, TAIL) + P2 // 2, OFFS64), s_old, period, ncols, ncols_magic,
            ncols_shift, b1, omb1, bc2, bc1, eps, MAXIMIZE, OFFS64, IN_ROW, FLAT_UPDATE)
        # tl_nan_max over both pieces: a NaN in either makes the block's scale NaN.
        s_max = tl.maximum(tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1),
                           tl.max(tl.where(mask_t, tl.abs(m_t), 0.0), axis=1))
        any_nan = tl.maximum(tl.max((mask & (m != m)).to(tl.int32), axis=1),
                             tl.max((mask_t & (m_t != m_t)).to(tl.int32), axis=1))
        s_new = tl.where(any_nan > 0, float("nan"), s_max)
        if FLAT_UPDATE:
            _quantise(q_ptr, cb_ptr, table_ptr, offs, mask, m, zero, s_new[:, None], seed_u,
                      STOCHASTIC, STEPS)
            _quantise(q_ptr, cb_ptr, table_ptr, offs_t, mask_t, m_t, zero_t, s_new[:, None],
                      seed_u, STOCHASTIC, STEPS)
        else:
            _apply(p_ptr, q_ptr, cb_ptr, table_ptr, offs, mask, m, zero, s_new[:, None],
                   s_new[:, None], p, big_v, sigma_elem, lr, decay, seed_u, True, STOCHASTIC,
                   STEPS)
            _apply(p_ptr, q_ptr, cb_ptr, table_ptr, offs_t, mask_t, m_t, zero_t,
                   s_new[:, None], s_new[:, None], p_t, big_v_t, sigma_t, lr, decay, seed_u,
                   True, STOCHASTIC, STEPS)
        tl.store(s_ptr + blocks, s_new, mask=bmask)


# num_blocks only bounds masks: specialising it (== 1, % 16) would only multiply the compiled
# variants a model's first step has to JIT; period's divisibility does help (aligned rows).
@jit(do_not_specialize=["seed", "num_blocks", "ncols_magic", "ncols_shift"])
def _step_tile_kernel(p_ptr, g_ptr, q_ptr, s_ptr, v_ptr, row_ptr, col_ptr, inv_rbar_ptr, cb_ptr,  # type: ignore[no-untyped-def]
                      table_ptr, hyper_ptr, seed_ptr, num_blocks, period, ncols, ncols_magic,
                      ncols_shift, b1, omb1, b2, omb2, eps, lr, bc2, bc1, decay, seed,
                      BPP: tl.constexpr, P2: tl.constexpr, FACTORED: tl.constexpr,
                      MAXIMIZE: tl.constexpr, STOCHASTIC: tl.constexpr, HYPER: tl.constexpr,
                      SEED_PTR: tl.constexpr, STEPS: tl.constexpr, OFFS64: tl.constexpr,
                      IN_ROW: tl.constexpr, TAIL: tl.constexpr, FLAT_UPDATE: tl.constexpr):
    """Tile route: program ``pid`` owns blocks ``[pid * BPP, (pid + 1) * BPP)``."""
    lr, bc2, bc1, decay = _load_scalars(hyper_ptr, lr, bc2, bc1, decay, HYPER)
    _tile_blocks(tl.program_id(0), p_ptr, g_ptr, q_ptr, s_ptr, v_ptr, row_ptr,
                 col_ptr, inv_rbar_ptr, cb_ptr, table_ptr, num_blocks, period, ncols, ncols_magic,
                 ncols_shift, b1, omb1, b2, omb2, eps, lr, bc2, bc1, decay,
                 _load_seed(seed_ptr, seed, SEED_PTR), BPP,
                 P2, FACTORED, MAXIMIZE, STOCHASTIC, STEPS, OFFS64, IN_ROW, TAIL, FLAT_UPDATE)


@jit(do_not_specialize=["numel16", "period_magic", "period_shift", "ncols_magic",
                        "ncols_shift"])
def _step_update_kernel(p_ptr, q_ptr, s_ptr, row_ptr, col_ptr, inv_rbar_ptr, cb_ptr, hyper_ptr,  # type: ignore[no-untyped-def]
                        numel16, period, period_magic, period_shift, ncols, ncols_magic,
                        ncols_shift, eps, lr, bc2, bc1, decay, HYPER: tl.constexpr,
                        CHUNKS: tl.constexpr):
    """The flat update after a ``FLAT_UPDATE`` tile launch (:func:`_flat_update`)."""
    lr, bc2, bc1, decay = _load_scalars(hyper_ptr, lr, bc2, bc1, decay, HYPER)
    _flat_update(tl.program_id(0), p_ptr, q_ptr, s_ptr, row_ptr, col_ptr, inv_rbar_ptr, cb_ptr,
                 numel16, period, period_magic, period_shift, ncols, ncols_magic, ncols_shift,
                 bc2, bc1, eps, lr, decay, CHUNKS)


@jit(do_not_specialize=["seed", "num_blocks", "ncols_magic", "ncols_shift"])
def _step_loop_kernel(p_ptr, g_ptr, q_ptr, s_ptr, v_ptr, row_ptr, col_ptr, inv_rbar_ptr, cb_ptr,  # type: ignore[no-untyped-def]
                      table_ptr, hyper_ptr, seed_ptr, num_blocks, period, ncols, ncols_magic,
                      ncols_shift, b1, omb1, b2, omb2, eps, lr, bc2, bc1, decay, seed,
                      TILE: tl.constexpr, FACTORED: tl.constexpr, MAXIMIZE: tl.constexpr,
                      STOCHASTIC: tl.constexpr, HYPER: tl.constexpr, SEED_PTR: tl.constexpr,
                      STEPS: tl.constexpr, OFFS64: tl.constexpr):
    """Loop route: program ``pid`` owns block ``pid`` and sweeps it twice in ``TILE`` steps."""
    block = _index(tl.program_id(0), OFFS64)
    period = _index(period, OFFS64)
    base = block * period
    lanes = _index(tl.arange(0, TILE), OFFS64)
    lr, bc2, bc1, decay = _load_scalars(hyper_ptr, lr, bc2, bc1, decay, HYPER)
    s_old = tl.load(s_ptr + block)
    s_new, sumsq = _sweep_block(g_ptr, q_ptr, cb_ptr, base, lanes, period, s_old, b1, omb1,
                                MAXIMIZE, TILE)
    if not FACTORED:
        v_new, _ = _block_sigma(sumsq, tl.load(v_ptr + block), period, b2, omb2, eps, bc2, bc1)
        tl.store(v_ptr + block, v_new)
    tl.store(s_ptr + block, s_new)  # s_old is in registers already
    s_new, sigma = _stored_block_scalars(s_ptr + block, v_ptr + block, eps, bc2, bc1, FACTORED)
    seed_u = _load_seed(seed_ptr, seed, SEED_PTR)
    start = period * 0
    while start < period:
        mask = start + lanes < period
        offs = base + start + lanes
        g, m = _momentum(g_ptr, q_ptr, cb_ptr, offs, mask, s_old, b1, omb1, MAXIMIZE)
        p, big_v, sigma_elem = _update_inputs(p_ptr, row_ptr, col_ptr, inv_rbar_ptr, offs, mask,
                                              ncols, ncols_magic, ncols_shift, bc2, bc1,
                                              eps, FACTORED, OFFS64)
        _apply(p_ptr, q_ptr, cb_ptr, table_ptr, offs, mask, m, g == 0.0, s_new, sigma, p,
               big_v, sigma_elem, lr, decay, seed_u, FACTORED, STOCHASTIC, STEPS)
        start += TILE


@jit
def _step_partial_kernel(g_ptr, q_ptr, s_ptr, cb_ptr, part_max_ptr, part_sq_ptr, period,  # type: ignore[no-untyped-def]
                         num_splits, b1, omb1, SPLIT: tl.constexpr, TILE: tl.constexpr,
                         FACTORED: tl.constexpr, MAXIMIZE: tl.constexpr,
                         OFFS64: tl.constexpr):
    """Split route, phase 1: max |m| (NaN-propagating) and sum g^2 of one slice of a block."""
    pid = _index(tl.program_id(0), OFFS64)
    period = _index(period, OFFS64)
    block = pid // num_splits
    split = pid % num_splits
    lanes = _index(tl.arange(0, TILE), OFFS64)
    s_old = tl.load(s_ptr + block)
    acc_max = tl.zeros([TILE], dtype=tl.float32)
    acc_nan = tl.zeros([TILE], dtype=tl.int32)
    acc_sq = tl.zeros([TILE], dtype=tl.float32)
    lo = split * SPLIT
    for start in range(0, SPLIT, TILE):
        pos = lo + start + lanes
        mask = pos < period
        offs = block * period + pos
        g, m = _momentum(g_ptr, q_ptr, cb_ptr, offs, mask, s_old, b1, omb1, MAXIMIZE)
        acc_max = tl.maximum(acc_max, tl.where(mask, tl.abs(m), 0.0))
        acc_nan = acc_nan | (mask & (m != m)).to(tl.int32)
        acc_sq += g * g
    tl.store(part_max_ptr + block * num_splits + split, tl_nan_max(acc_max, acc_nan, 0))
    if not FACTORED:
        tl.store(part_sq_ptr + block * num_splits + split, tl.sum(acc_sq, axis=0))


@jit(do_not_specialize=["seed", "ncols_magic", "ncols_shift"])
def _step_apply_kernel(p_ptr, g_ptr, q_ptr, s_ptr, s_new_ptr, sigma_ptr, row_ptr, col_ptr,  # type: ignore[no-untyped-def]
                       inv_rbar_ptr, cb_ptr, table_ptr, hyper_ptr, seed_ptr, period, ncols,
                       ncols_magic, ncols_shift, num_splits, b1, omb1, eps, lr, bc2, bc1,
                       decay, seed,
                       SPLIT: tl.constexpr, TILE: tl.constexpr, FACTORED: tl.constexpr,
                       MAXIMIZE: tl.constexpr, STOCHASTIC: tl.constexpr, HYPER: tl.constexpr,
                       SEED_PTR: tl.constexpr, STEPS: tl.constexpr, OFFS64: tl.constexpr):
    """Split route, phase 2: recompute m with the old scale, quantise with the new one, write."""
    pid = _index(tl.program_id(0), OFFS64)
    period = _index(period, OFFS64)
    block = pid // num_splits
    split = pid % num_splits
    lanes = _index(tl.arange(0, TILE), OFFS64)
    lr, bc2, bc1, decay = _load_scalars(hyper_ptr, lr, bc2, bc1, decay, HYPER)
    s_old = tl.load(s_ptr + block)
    s_new = tl.load(s_new_ptr + block)
    sigma = s_new
    if not FACTORED:
        sigma = tl.load(sigma_ptr + block)
    seed_u = _load_seed(seed_ptr, seed, SEED_PTR)
    lo = split * SPLIT
    for start in range(0, SPLIT, TILE):
        pos = lo + start + lanes
        mask = pos < period
        offs = block * period + pos
        g, m = _momentum(g_ptr, q_ptr, cb_ptr, offs, mask, s_old, b1, omb1, MAXIMIZE)
        p, big_v, sigma_elem = _update_inputs(p_ptr, row_ptr, col_ptr, inv_rbar_ptr, offs, mask,
                                              ncols, ncols_magic, ncols_shift, bc2, bc1,
                                              eps, FACTORED, OFFS64)
        _apply(p_ptr, q_ptr, cb_ptr, table_ptr, offs, mask, m, g == 0.0, s_new, sigma, p,
               big_v, sigma_elem, lr, decay, seed_u, FACTORED, STOCHASTIC, STEPS)


def blocks_in_rows(factored: bool, period: int, ncols: int) -> bool:
    """The tile route's ``IN_ROW``: factored mode, and every ``[period]`` block lies inside one
    row starting at a column that is a multiple of 16 (the period is a multiple of 16 and
    divides the column count)."""
    return factored and period % 16 == 0 and ncols % period == 0


# Elements per program of the flat update (FLAT_CHUNKS chunks of 16, four warps).
FLAT_CHUNKS = 128
FLAT_WARPS = 4


def flat_update(factored: bool, period: int, ncols: int, offs64: bool) -> bool:
    """Whether the tile route splits a factored step in two: the tile quantises and writes
    codes and scales (``FLAT_UPDATE``), then :func:`_flat_update` updates the parameter in
    chunks of 16 elements. Where the blocks do not lie in rows (:func:`blocks_in_rows` fails)
    but the period and the column count are multiples of 16, with int32 offsets.

    The tile otherwise finds each element's row and column and gathers its column statistic
    alone, and a period that does not fill its power-of-two tile runs masked lanes through
    the whole update. On an H200 (bf16) the two passes took 0.160
    against 0.208 ms at P = 1536 on 2304 columns, 0.206 against 0.291 ms at P = 1392 on 768
    and 0.225 against 0.233 ms at P = 1152 on 3072 (a head-and-tail tile), with the same
    bits. Where blocks lie in rows the fused tile stays: the split gained only 3.5 % there,
    for a second launch per class."""
    return (factored and not offs64 and period % 16 == 0 and ncols % 16 == 0
            and not blocks_in_rows(factored, period, ncols))


def tile_warps(elements: int) -> int:
    """Warps of a tile-route program holding ``elements`` elements. Four for the usual
    2048-element tile: on an H200 a [8192, 2048] bf16 step took
    0.154 ms with 4 warps against 0.187 ms with 8 (block mode) and 0.263 against 0.401 ms
    (factored); the wider 4096-element tiles keep 8."""
    return 4 if elements <= 2048 else 8


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tile_shape(period: int, factored: bool) -> tuple[int, int, int]:
    """``(P2, BPP, TAIL)`` of the tile route (the constexprs of :func:`_tile_blocks`): ``P2``
    the next power of two at or above ``period``, ``BPP`` blocks per program, and ``TAIL`` the
    width of the tail piece, or 0 for one ``[BPP, P2]`` tile.

    In factored mode a period with ``P2 / 2 < P <= 5 P2 / 8`` is held as a ``P2 / 2`` head and
    a tail of the next power of two at or above ``P - P2 / 2`` lanes, where that is at least
    16: 1152 (GPT-2's most common searched period) runs on 1024 + 128 lanes instead of 2048.
    On the H200 this took the factored tile kernel from 0.609 to 0.394 ms at P = 1152 and from
    0.519 to 0.441 ms at 1280; a tail at 1344 or 1536 (up to ``3 P2 / 4``) took only 3-4 % off,
    not worth a launch class of its own. Block mode keeps one tile: a tail would reorder its sum of
    squares."""
    p2 = _next_pow2(period)
    bpp = max(1, program_elements(TILE_ELEMENTS) // p2)
    tail = 0
    if factored and p2 // 2 < period <= 5 * p2 // 8:
        tail = _next_pow2(period - p2 // 2)
        if tail < 16:
            tail = 0
    return p2, bpp, tail


def choose_route(num_blocks: int, period: int, device: torch.device) -> str:
    """Performance-only routing (all routes give the same codes and scales)."""
    if period <= TILE_MAX_PERIOD:
        return "tile"
    if period <= SPLIT_ELEMENTS:
        # One split per block: the split route would run the loop route's programs as two
        # launches with torch's merge between them (about nine launches for one tensor).
        return "loop"
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 8
    return "loop" if num_blocks >= 4 * sms else "split"


def launch_step(
    param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor, *,
    exp_avg_sq: Tensor | None, row: Tensor | None, col: Tensor | None,
    inv_rbar: Tensor | None, ncols: int, codebook: Tensor,
    lr: float, beta1: float, beta2: float, eps: float, bc1_recip: float, bc2: float,
    decay: float, maximize: bool, stochastic_round: bool, seed: int,
    hyper: Tensor | None, seed_tensor: Tensor | None,
    route: str | None = None, split_elements: int = SPLIT_ELEMENTS,
    loop_tile: int = LOOP_TILE, use_table: bool = True,
) -> None:
    """Launch the step kernels (block mode when ``exp_avg_sq`` is given, else factored)."""
    require_triton("the Triton Gefen step")
    check_device_for_triton(param)
    num_blocks, period = codes.shape
    if num_blocks * period == 0:
        return
    factored = exp_avg_sq is None
    dummy = codebook
    b1, b2 = f32(beta1), f32(beta2)
    common = dict(
        FACTORED=factored, MAXIMIZE=bool(maximize), STOCHASTIC=bool(stochastic_round),
    )
    scal = dict(lr=f32(lr), bc2=f32(bc2), bc1=f32(bc1_recip), decay=f32(decay))
    hyper_ptr = hyper if hyper is not None else dummy
    seed_ptr = seed_tensor if seed_tensor is not None else dummy
    table, steps = (kernel_table(codebook, stochastic=bool(stochastic_round)) if use_table
                    else (codebook, 0))
    offs64 = needs_int64(num_blocks, period, split_elements=split_elements, loop_tile=loop_tile)
    flags = dict(HYPER=hyper is not None, SEED_PTR=seed_tensor is not None, STEPS=steps,
                 OFFS64=offs64)
    v_ptr = exp_avg_sq if exp_avg_sq is not None else dummy
    row_ptr = row if row is not None else dummy
    col_ptr = col if col is not None else dummy
    inv_ptr = inv_rbar if inv_rbar is not None else dummy
    flat_p, flat_g = param.view(-1), grad.view(-1)
    magic, shift = ncols_divider(ncols)
    route = route or choose_route(num_blocks, period, param.device)
    if route == "tile":
        p2, bpp, tail = tile_shape(period, factored)
        grid = (triton.cdiv(num_blocks, bpp),)
        flat = flat_update(factored, period, ncols, offs64)
        _step_tile_kernel[grid](
            flat_p, flat_g, codes, scale, v_ptr, row_ptr, col_ptr, inv_ptr, codebook, table,
            hyper_ptr, seed_ptr, num_blocks, period, ncols, magic, shift, b1, f32(1.0 - b1), b2,
            f32(1.0 - b2), f32(eps), scal["lr"], scal["bc2"], scal["bc1"], scal["decay"],
            to_signed64(seed), BPP=bpp, P2=p2, **common, **flags,
            IN_ROW=blocks_in_rows(factored, period, ncols), TAIL=tail, FLAT_UPDATE=flat,
            num_warps=tile_warps(bpp * p2), **LAUNCH_OPTIONS)
        if flat:
            launch_flat_update(flat_p, codes, scale, row_ptr, col_ptr, inv_ptr, codebook,
                               hyper, ncols=ncols, eps=f32(eps), **scal)
    elif route == "loop":
        _step_loop_kernel[(num_blocks,)](
            flat_p, flat_g, codes, scale, v_ptr, row_ptr, col_ptr, inv_ptr, codebook, table,
            hyper_ptr, seed_ptr, num_blocks, period, ncols, magic, shift, b1, f32(1.0 - b1), b2,
            f32(1.0 - b2), f32(eps), scal["lr"], scal["bc2"], scal["bc1"], scal["decay"],
            to_signed64(seed), TILE=loop_tile, **common, **flags, num_warps=8,
            **LAUNCH_OPTIONS)
    elif route == "split":
        num_splits = triton.cdiv(period, split_elements)
        part_max = torch.empty(num_blocks, num_splits, dtype=torch.float32, device=param.device)
        part_sq = torch.empty_like(part_max) if not factored else part_max
        # One flat grid axis: CUDA caps grid y at 65535, which blocks or splits can exceed.
        _step_partial_kernel[(num_blocks * num_splits,)](
            flat_g, codes, scale, codebook, part_max, part_sq, period, num_splits, b1,
            f32(1.0 - b1), SPLIT=split_elements, TILE=min(loop_tile, split_elements),
            FACTORED=factored, MAXIMIZE=bool(maximize), OFFS64=offs64, num_warps=8,
            **LAUNCH_OPTIONS)
        s_new = part_max.amax(dim=1)  # NaN-propagating, order-independent
        sigma = s_new
        if exp_avg_sq is not None:
            # The same IEEE operations as _block_sigma, in torch (fixed-order sum).
            sumsq = part_sq.sum(dim=1)
            bc2_s: float | Tensor = hyper[1] if hyper is not None else scal["bc2"]
            bc1_s: float | Tensor = hyper[2] if hyper is not None else scal["bc1"]
            mean = sumsq / float(period)
            v_new = (exp_avg_sq.view(-1) * b2) + (mean * f32(1.0 - b2))
            exp_avg_sq.view(-1).copy_(v_new)
            h = torch.sqrt(v_new) * bc2_s
            sigma = torch.reciprocal(h + f32(eps)) * bc1_s
        _step_apply_kernel[(num_blocks * num_splits,)](
            flat_p, flat_g, codes, scale, s_new, sigma, row_ptr, col_ptr, inv_ptr, codebook,
            table, hyper_ptr, seed_ptr, period, ncols, magic, shift, num_splits, b1,
            f32(1.0 - b1), f32(eps),
            scal["lr"], scal["bc2"], scal["bc1"], scal["decay"], to_signed64(seed),
            SPLIT=split_elements, TILE=min(loop_tile, split_elements), **common, **flags,
            num_warps=8, **LAUNCH_OPTIONS)
        scale.view(-1).copy_(s_new)
    else:
        raise ValueError(f"unknown route {route!r}; expected 'tile', 'loop' or 'split'")


def launch_flat_update(param: Tensor, codes: Tensor, scale: Tensor, row: Tensor, col: Tensor,
                       inv_rbar: Tensor, codebook: Tensor, hyper: Tensor | None, *, ncols: int,
                       eps: float, lr: float, bc2: float, bc1: float, decay: float) -> None:
    """The :func:`_flat_update` launch after a ``FLAT_UPDATE`` tile launch on the same
    tensors (``codes`` ``[B, P]``; scalars rounded to fp32; ``hyper``: read them on the
    device instead)."""
    num_blocks, period = codes.shape
    numel = num_blocks * period
    period_magic, period_shift = ncols_divider(period)
    magic, shift = ncols_divider(ncols)
    _step_update_kernel[(triton.cdiv(numel, 16 * FLAT_CHUNKS),)](
        param, codes, scale, row, col, inv_rbar, codebook,
        hyper if hyper is not None else codebook, numel // 16, period, period_magic,
        period_shift, ncols, magic, shift, eps, lr, bc2, bc1, decay, HYPER=hyper is not None,
        CHUNKS=FLAT_CHUNKS, num_warps=FLAT_WARPS, **LAUNCH_OPTIONS)


__all__ = ["blocks_in_rows", "choose_route", "denominator", "flat_update", "launch_flat_update",
           "launch_step", "ncols_divider", "tile_shape", "tile_warps"]
