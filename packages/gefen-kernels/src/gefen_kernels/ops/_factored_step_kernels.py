"""Triton kernels of :mod:`.factored_step` (docs/algorithm.md#factored-second-moment): the row and
column statistics of ``g^2`` and their finalize, with their tuning constants and the launch layout
(:func:`stats_layout`), a function of the shape only, so the sums' order is fixed. The update
kernels are the shared ones of :mod:`._step_kernels`; the launchers are in :mod:`.factored_step`.
"""

from __future__ import annotations

from .._triton import jit, program_elements, tl
from ._triton_helpers import LAUNCH_OPTIONS

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


_FIN_CONSTS = dict(FR=_FIN_ROWS, SR=_FIN_SR, FC=_FIN_COLS, SP=_FIN_SP, FT=_FIN_TOTAL,
                   num_warps=4, **LAUNCH_OPTIONS)
