"""Triton path of :mod:`.period_scores`: every candidate's score in four launches per chunk,
and the scores of many tensors in four launches per round.

Same scores as the reference (docs/algorithm.md#period-search, the module docstring of
:mod:`.period_scores`), to fp64 rounding: the chunk-local exclusive prefix ``E`` is formed as the
reference's (fp64 tile scans plus fp64 tile offsets, over 8M-element chunks instead of 512K) and
each block's sum, mean and term use the reference's expressions; the tile offsets are scanned in
blocks and the terms added in another fixed order. Per chunk (:func:`scores_triton`):

1. :func:`_period_prefix_kernel` (one program per ``TILE`` elements): the transform, the
   tile-local inclusive fp64 scans and tile totals, and (Variant L) the tile's part of the
   ``p = 1`` score, ``sum |x_i - x_{i-1}|`` over the pairs ending in the tile (the element
   before the tile is loaded and transformed again, so no values are stored).
2. :func:`_period_offsets_kernel` (one program per row of totals): the tile offsets, an
   exclusive fp64 scan of the totals in blocks of ``SCAN_LANES`` (a tree scan per block plus
   the running total of the blocks before it). ``torch.cumsum`` did this before; on CUDA it
   is documented as nondeterministic for floating point and raises under
   ``torch.use_deterministic_algorithms(True)``.
3. :func:`_period_terms_kernel`: every candidate's block ends in the chunk, ``KB`` consecutive
   ends per program; ``E`` at a position is read as ``scan + offset``. A program writes the
   sum of its terms (a fixed-order tree): no atomics, deterministic.
4. :func:`_period_carry_kernel` (one program per candidate, one for ``p = 1``): adds the
   candidate's program sums to its running score sum in program order and updates what the
   next chunk needs: the sums of the block left open, of the last closed block, and whether
   one exists. It reads the carries the terms kernel read and writes them after it (stream
   order).

The host computes each chunk's first block end and number of ends per candidate (Python
ints, as the reference does) and sends all of them with one asynchronous copy per tensor;
nothing is read back until the caller reads the scores.

**Many tensors** (:func:`scores_triton_many`). The per-tensor path cost about 1.3 ms of host
time per tensor on an H200 (launches, allocations, one pinned copy), whatever its size. The
batched path cuts every tensor into the same chunks and packs chunks of different tensors
into *rounds* (a tensor's chunks in order, at most one per round, so its carries pass from
round to round as from chunk to chunk) whose tile scans fit one scratch buffer of
``round_elements`` elements per row. A round is four launches whatever the number of tensors
in it: :func:`_multi_prefix_kernel` (once per gradient dtype and alignment class present),
:func:`_period_offsets_kernel`, :func:`_multi_terms_kernel`, :func:`_multi_carry_kernel`.
Each program finds its work in int64 tables sent with one host-to-device copy for all
rounds: a *segment* (one chunk of one tensor) table, a *pair* (segment, candidate) table and
a table of the segments whose tensor scores ``p = 1``; programs of the prefix and terms
launches find their segment or pair through maps expanded on the device with
``repeat_interleave`` (one each for all rounds). The scratch is allocated once, for the
largest round, and the carries of all tensors live in one zeroed buffer indexed by *slot*
(a candidate's position in the concatenated output). Each program runs exactly the work of
its per-tensor twin (the shared ``@jit`` helpers below) on its own tensor's values and
carries, so a tensor's scores do not depend on the other tensors of the call.

Bit-identity with :func:`scores_triton`: the same helpers, the same offsets kernel and the
same final torch expressions (with tensor divisors: CUDA turns a division by a Python float
into a multiplication by its reciprocal), so in Triton's interpreter the scores are equal bit
for bit (tested). Compiled, a reduction's order follows the register layout Triton picks from
what it knows of pointer and integer alignment; the batched kernels derive every pointer from
a kernel argument of the same alignment as the per-tensor launch's (gradients as ``base +
off16 * G_VEC`` for 16-byte-aligned chunks, one launch per alignment class; each segment's
scratch at an even tile base, so 16-byte aligned like the per-tensor launch's fresh buffers),
and ``tests/compile_check.py --compare-layouts`` checks that each pair of kernels compiles to
the same layouts for sm_90 (not yet confirmed by running both on a GPU). Their round-dependent
ints are not specialised and their tables are padded to 16 bytes, so a call compiles one
variant of each kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .._triton import jit, tl, triton
from ._triton_helpers import LAUNCH_OPTIONS

__all__ = ["host_to_device", "plan_rounds", "scores_triton", "scores_triton_many"]

TILE = 1024  # elements per prefix program (one fp64 scan each)
ENDS_PER_PROGRAM = 1024  # block ends per terms program
CARRY_LANES = 256  # partial sums the carry kernel adds per iteration
SCAN_LANES = 1024  # tile totals the offsets kernel scans per iteration

# Columns of the int64 tables (the kernels index them with these literals).
# Segment: gradient offset from its class base (16-byte units when aligned, else elements),
# chunk length, whether an element precedes the chunk (2: the tensor does not score p = 1),
# first program in the prefix launch, tile base in the round's scratch / 2, number of tiles.
SEG_COLS = 6
# Pair: segment, slot, p, first block end (1..p), number of ends, first terms program in the
# round, number of terms programs.
PAIR_COLS = 7
# Segments whose tensor scores p = 1: segment, slot of p = 1.
ONE_COLS = 2


# --------------------------------------------------------------------------------------------
# Per-program work, shared by the per-tensor and the batched kernels
# --------------------------------------------------------------------------------------------
@jit
def _prefix_tile(g_ptr, pre_ptr, tot_ptr, one_ptr, pid, n, stride_a, num_tiles, has_prev,
                 LOG_CONTRAST: tl.constexpr, TILE: tl.constexpr):
    """Transform tile ``pid`` of a chunk and scan it in fp64.

    g_ptr: the chunk, ``[n]`` contiguous fp32/bf16/fp16 (converted to fp32); when
    ``has_prev`` is 1 the element before it is read too. pre_ptr: fp64 ``[A, stride_a]``,
    the tile-local *inclusive* prefix of each row (``A = 1``: ``x = ln(f32(g*g) + 1e-12)``;
    ``A = 2``: ``y = g^2`` in fp64 and ``y^2``). tot_ptr: fp64 ``[A, num_tiles]``, each tile's
    total. one_ptr: fp64 ``[num_tiles]`` (LOG_CONTRAST), the tile's ``sum |x_i - x_{i-1}|``
    over its elements ``i`` that have a predecessor; not written when ``has_prev`` is 2 (the
    tensor does not score ``p = 1``: its second fp64 log per element is skipped). Offsets are
    int64; padding lanes add 0.
    """
    offs = pid * TILE + tl.arange(0, TILE).to(tl.int64)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if LOG_CONTRAST:
        x = tl.log((g * g).to(tl.float64) + 1e-12)
        x = tl.where(mask, x, 0.0)
        tl.store(pre_ptr + offs, tl.cumsum(x, axis=0), mask=mask)
        tl.store(tot_ptr + pid, tl.sum(x, axis=0))
        if has_prev < 2:
            # The predecessor of every element, transformed again (an fp64 log is cheaper
            # than storing and re-reading 8 bytes per element).
            has = mask & (offs + has_prev > 0)  # has_prev: 0 or 1
            gp = tl.load(g_ptr + offs - 1, mask=has, other=0.0).to(tl.float32)
            xp = tl.log((gp * gp).to(tl.float64) + 1e-12)
            tl.store(one_ptr + pid, tl.sum(tl.where(has, tl.abs(x - xp), 0.0), axis=0))
    else:
        g64 = g.to(tl.float64)
        y = g64 * g64
        y2 = y * y
        tl.store(pre_ptr + offs, tl.cumsum(y, axis=0), mask=mask)
        tl.store(pre_ptr + stride_a + offs, tl.cumsum(y2, axis=0), mask=mask)
        tl.store(tot_ptr + pid, tl.sum(y, axis=0))
        tl.store(tot_ptr + num_tiles + pid, tl.sum(y2, axis=0))


@jit
def _prefix_at(pre_ptr, off_ptr, i, row, stride_a, num_tiles, mask, TILE: tl.constexpr):
    """``E[i]``, the chunk-local exclusive prefix at ``i >= 1`` of ``row``: the inclusive tile
    scan at ``i - 1`` plus its tile's offset (the reference's ``scan + offsets``)."""
    j = tl.maximum(i - 1, 0)
    scan = tl.load(pre_ptr + row * stride_a + j, mask=mask, other=0.0)
    return scan + tl.load(off_ptr + row * num_tiles + j // TILE, mask=mask, other=0.0)


@jit
def _block_sums(pre_ptr, off_ptr, open_ptr, K, c, pos, k, p, row, stride_a, num_tiles, mask,
                TILE: tl.constexpr):
    """Sums of row ``row`` over the blocks ending at ``pos`` (the ``k``-th end in the chunk of
    the candidate in carry slot ``c`` of ``K``); the first one (``k == 0``) adds the part left
    open by earlier chunks."""
    here = _prefix_at(pre_ptr, off_ptr, pos, row, stride_a, num_tiles, mask, TILE)
    before = _prefix_at(pre_ptr, off_ptr, pos - p, row, stride_a, num_tiles, mask & (k > 0),
                        TILE)
    return tl.where(k == 0, tl.load(open_ptr + row * K + c) + here, here - before)


@jit
def _terms_sum(pre_ptr, off_ptr, open_ptr, last_ptr, closed_ptr, K, c, p, first, cnt, j,
               stride_a, num_tiles, LOG_CONTRAST: tl.constexpr, TILE: tl.constexpr,
               KB: tl.constexpr):
    """Sum of the terms of block ends ``[j * KB, (j + 1) * KB)`` of the candidate ``p`` in
    carry slot ``c`` (its first end at local position ``first``, ``cnt`` ends in the chunk).
    Terms as the reference: Variant L ``|mu_k - mu_{k-1}|`` (``mu_{-1}`` from the last closed
    block of an earlier chunk; none: 0), Variant V ``max(0, m2 - m1^2)`` (NaN-propagating)."""
    k = j * KB + tl.arange(0, KB).to(tl.int64)
    valid = k < cnt
    pos = first + k * p
    pf = p.to(tl.float64)
    sums = _block_sums(pre_ptr, off_ptr, open_ptr, K, c, pos, k, p, 0, stride_a, num_tiles,
                       valid, TILE)
    if LOG_CONTRAST:
        mean = sums / pf
        prev_sums = _block_sums(pre_ptr, off_ptr, open_ptr, K, c, pos - p, k - 1, p, 0,
                                stride_a, num_tiles, valid & (k > 0), TILE)
        prev = tl.where(k == 0, tl.load(last_ptr + c) / pf, prev_sums / pf)
        none_closed = (k == 0) & (tl.load(closed_ptr + c + k * 0) == 0.0)
        term = tl.where(none_closed, 0.0, tl.abs(mean - prev))
    else:
        sq = _block_sums(pre_ptr, off_ptr, open_ptr, K, c, pos, k, p, 1, stride_a, num_tiles,
                         valid, TILE)
        m1 = sums / pf
        term = sq / pf - m1 * m1
        term = tl.where(term < 0.0, 0.0, term)  # clamp(min=0) that keeps a NaN
    return tl.sum(tl.where(valid, term, 0.0), axis=0)


@jit
def _carry_candidate(pre_ptr, off_ptr, open_ptr, last_ptr, closed_ptr, acc_ptr, part_ptr, K, c,
                     p, first, cnt, start, stop, n, stride_a, num_tiles,
                     LOG_CONTRAST: tl.constexpr, TILE: tl.constexpr, RB: tl.constexpr):
    """``acc[c] +=`` the terms programs' sums ``part[start:stop]`` in program order, then the
    carries of slot ``c`` for the next chunk."""
    lanes = tl.arange(0, RB).to(tl.int64)
    last = tl.full([1], 0, tl.int64) + n  # E[n]: the chunk's total
    acc = tl.load(acc_ptr + c)
    i = start
    while i < stop:
        acc += tl.sum(tl.load(part_ptr + i + lanes, mask=i + lanes < stop, other=0.0), axis=0)
        i += RB
    tl.store(acc_ptr + c, acc)
    end = tl.full([1], 0, tl.int64) + first + (cnt - 1) * p  # the last block end, if any
    if cnt > 0:
        if LOG_CONTRAST:  # before the open sums below change: the last block may be k = 0
            last_sum = _block_sums(pre_ptr, off_ptr, open_ptr, K, c, end, end * 0 + cnt - 1, p,
                                   0, stride_a, num_tiles, end > 0, TILE)
            tl.store(last_ptr + c, tl.sum(last_sum, axis=0))
        tl.store(closed_ptr + c, 1.0)
    for row in tl.static_range(1 if LOG_CONTRAST else 2):
        total = tl.sum(_prefix_at(pre_ptr, off_ptr, last, row, stride_a, num_tiles, last > 0,
                                  TILE), axis=0)
        if cnt > 0:
            at_end = tl.sum(_prefix_at(pre_ptr, off_ptr, end, row, stride_a, num_tiles, end > 0,
                                       TILE), axis=0)
            tl.store(open_ptr + row * K + c, total - at_end)
        else:
            tl.store(open_ptr + row * K + c, tl.load(open_ptr + row * K + c) + total)


@jit
def _carry_one(pre_ptr, off_ptr, one_ptr, one_acc_ptr, n, stride_a, num_tiles, t,
               LOG_CONTRAST: tl.constexpr, TILE: tl.constexpr, RB: tl.constexpr):
    """The ``p = 1`` running sum (Variant L: the tiles' parts in order, from ``t = 0``;
    Variant V: the chunk's ``sum y``, which only carries a NaN)."""
    lanes = tl.arange(0, RB).to(tl.int64)
    last = tl.full([1], 0, tl.int64) + n  # E[n]: the chunk's total
    if LOG_CONTRAST:
        one = tl.load(one_acc_ptr)
        while t < num_tiles:
            one += tl.sum(tl.load(one_ptr + t + lanes, mask=t + lanes < num_tiles, other=0.0),
                          axis=0)
            t += RB
        tl.store(one_acc_ptr, one)
    else:
        y_sum = tl.sum(_prefix_at(pre_ptr, off_ptr, last, 0, stride_a, num_tiles, last > 0,
                                  TILE), axis=0)
        tl.store(one_acc_ptr, tl.load(one_acc_ptr) + y_sum)


# --------------------------------------------------------------------------------------------
# One tensor
# --------------------------------------------------------------------------------------------
@jit
def _period_prefix_kernel(g_ptr, pre_ptr, tot_ptr, one_ptr, n, stride_a, has_prev,
                          LOG_CONTRAST: tl.constexpr, TILE: tl.constexpr):
    """Program ``pid``: :func:`_prefix_tile` of tile ``pid`` (``num_tiles`` programs)."""
    pid = tl.program_id(0).to(tl.int64)
    _prefix_tile(g_ptr, pre_ptr, tot_ptr, one_ptr, pid, n, stride_a, tl.num_programs(0),
                 has_prev, LOG_CONTRAST, TILE)


@jit(do_not_specialize=["seg_base"])
def _period_offsets_kernel(tot_ptr, off_ptr, seg_ptr, seg_base, ROWS: tl.constexpr,
                           SB: tl.constexpr):
    """Program ``pid``: row ``pid % ROWS`` of segment ``seg_base + pid // ROWS``; the
    exclusive fp64 prefix of its tile totals, ``off[j] = sum_{i < j} tot[i]``.

    seg_ptr: int64 ``[S, SEG_COLS]`` (module constants); the segment's totals and offsets
    are fp64 ``[ROWS, tiles]`` at ``2 * ROWS * column 4`` in tot_ptr and off_ptr. Blocks of
    ``SB``: ``off[j] = carry + inclusive_scan(s)[j]`` with ``s[j] = tot[j - 1]`` (``s[0] =
    0``), ``carry`` the previous blocks' scan at their last lane.
    """
    pid = tl.program_id(0).to(tl.int64)
    seg = seg_ptr + (seg_base + pid // ROWS) * 6
    tiles = tl.load(seg + 5)
    base = tl.load(seg + 4) * (2 * ROWS) + (pid % ROWS) * tiles
    lanes = tl.arange(0, SB).to(tl.int64)
    carry = tl.zeros([], tl.float64)
    b = tiles * 0
    while b < tiles:
        j = b + lanes
        s = tl.load(tot_ptr + base + j - 1, mask=(j >= 1) & (j < tiles), other=0.0)
        scan = tl.cumsum(s, axis=0)
        tl.store(off_ptr + base + j, carry + scan, mask=j < tiles)
        carry += tl.sum(tl.where(lanes == SB - 1, scan, 0.0), axis=0)
        b += SB


@jit
def _period_terms_kernel(pre_ptr, off_ptr, cand_ptr, table_ptr, open_ptr, last_ptr, closed_ptr,
                         part_ptr, K, stride_a, num_tiles, LOG_CONTRAST: tl.constexpr,
                         TILE: tl.constexpr, KB: tl.constexpr, KP2: tl.constexpr):
    """Program ``pid``: block ends ``[j * KB, (j + 1) * KB)`` of candidate ``c``, where ``c`` is
    the last candidate whose first program is ``<= pid`` and ``j = pid - start[c]``.

    table_ptr: int64 ``[3, K]``: each candidate's first block end in the chunk (a local
    position in ``1..p``), its number of ends, its first program. part_ptr: fp64, one sum of
    terms per program (:func:`_terms_sum`).
    """
    pid = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, KP2)
    starts = tl.load(table_ptr + 2 * K + lanes, mask=lanes < K, other=pid + 1)
    c = tl.sum((starts <= pid).to(tl.int64), axis=0) - 1
    total = _terms_sum(pre_ptr, off_ptr, open_ptr, last_ptr, closed_ptr, K, c,
                       tl.load(cand_ptr + c), tl.load(table_ptr + c),
                       tl.load(table_ptr + K + c), pid - tl.load(table_ptr + 2 * K + c),
                       stride_a, num_tiles, LOG_CONTRAST, TILE, KB)
    tl.store(part_ptr + pid, total)


@jit
def _period_carry_kernel(pre_ptr, off_ptr, cand_ptr, table_ptr, open_ptr, last_ptr, closed_ptr,
                         part_ptr, acc_ptr, one_ptr, one_acc_ptr, n, K, num_parts, stride_a,
                         num_tiles, LOG_CONTRAST: tl.constexpr, TILE: tl.constexpr,
                         RB: tl.constexpr):
    """Program ``c < K``: :func:`_carry_candidate` of candidate ``c``. Program ``K``:
    :func:`_carry_one`."""
    c = tl.program_id(0).to(tl.int64)
    if c == K:
        _carry_one(pre_ptr, off_ptr, one_ptr, one_acc_ptr, n, stride_a, num_tiles, c * 0,
                   LOG_CONTRAST, TILE, RB)
    else:
        start = tl.load(table_ptr + 2 * K + c)
        stop = tl.where(c + 1 < K, tl.load(table_ptr + 2 * K + c + 1, mask=c + 1 < K),
                        num_parts)
        _carry_candidate(pre_ptr, off_ptr, open_ptr, last_ptr, closed_ptr, acc_ptr, part_ptr,
                         K, c, tl.load(cand_ptr + c), tl.load(table_ptr + c),
                         tl.load(table_ptr + K + c), start, stop, n, stride_a, num_tiles,
                         LOG_CONTRAST, TILE, RB)


def host_to_device(values: list[int] | Tensor, device: torch.device) -> Tensor:
    """int64 tensor on ``device`` without a blocking copy (a pageable copy would sync CUDA)."""
    host = torch.as_tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def scores_triton(grad: Tensor, cands: list[int], variant: str, chunk: int) -> Tensor:
    """The scores of ``cands`` (checked, ascending divisors of ``grad.numel()``), fp64
    ``[len(cands)]`` on ``grad``'s device; ``chunk`` elements per pass (module docstring)."""
    dev = grad.device
    numel = grad.numel()
    out = torch.empty(len(cands), dtype=torch.float64, device=dev)
    if not cands:
        return out
    flat = grad.view(-1)
    # fp64 gradients: the transform starts from fp32 anyway; converted chunk by chunk below.
    convert = flat.dtype not in (torch.float32, torch.bfloat16, torch.float16)
    log_contrast = variant == "log_contrast"
    rows = 1 if log_contrast else 2
    has_one = cands[0] == 1
    ps = cands[1:] if has_one else cands
    k = len(ps)
    kk = max(k, 1)  # non-empty buffers even when p = 1 is the only candidate
    # Running state, one zeroed buffer: the open block's sums [rows, K], the last closed
    # block's sum [K], whether one exists [K], the score sums [K], the p = 1 sum [1].
    state = torch.zeros(rows * kk + 3 * kk + 1, dtype=torch.float64, device=dev)
    open_sum, last_sum, closed, acc, one_acc = state.split([rows * kk, kk, kk, kk, 1])
    span = min(chunk, numel)
    max_tiles = triton.cdiv(span, TILE)
    scan = torch.empty(rows, max_tiles * TILE, dtype=torch.float64, device=dev)
    totals = torch.empty(rows, max_tiles, dtype=torch.float64, device=dev)
    offsets = torch.empty_like(totals)
    one_parts = torch.empty(max_tiles if log_contrast else 1, dtype=torch.float64, device=dev)
    # Each chunk's table, int64 [3, K]: every candidate's block ends in [start, start + n)
    # start at local position p - start % p (in 1..p), then every p; its terms programs follow
    # the previous candidate's. Then one segment row per chunk for the offsets kernel. All
    # tables and the candidates go in one asynchronous copy.
    starts = list(range(0, numel, chunk))
    host = list(ps) if k else [1]
    parts_per_chunk = []
    segments: list[int] = []
    for start in starts:
        n = min(chunk, numel - start)
        firsts = [p - start % p for p in ps]
        counts = [0 if f > n else (n - f) // p + 1 for f, p in zip(firsts, ps)]
        progs, num_parts = [], 0
        for cnt in counts:
            progs.append(num_parts)
            num_parts += -(-cnt // ENDS_PER_PROGRAM)
        host += (firsts + counts + progs) if k else [1, 0, 0]
        parts_per_chunk.append(num_parts)
        segments += [0, n, int(start > 0), 0, 0, triton.cdiv(n, TILE)]
    seg_at = len(host)
    tables = host_to_device(host + segments + [numel], dev)
    cand_dev = tables[:kk]
    seg_table = tables[seg_at:-1]
    parts = torch.empty(max(max(parts_per_chunk), 1), dtype=torch.float64, device=dev)
    for i, (start, num_parts) in enumerate(zip(starts, parts_per_chunk)):
        n = min(chunk, numel - start)
        num_tiles = triton.cdiv(n, TILE)
        stride_a = num_tiles * TILE
        pre = scan.view(-1)[:rows * stride_a]
        tot = totals.view(-1)[:rows * num_tiles]
        off = offsets.view(-1)[:rows * num_tiles]
        src = flat[start:start + n]
        if convert:  # with the predecessor the p = 1 term reads
            lo = max(start - 1, 0)
            src = flat[lo:start + n].to(torch.float32)[start - lo:]
        _period_prefix_kernel[(num_tiles,)](src, pre, tot, one_parts, n,
                                            stride_a, int(start > 0) if has_one else 2,
                                            LOG_CONTRAST=log_contrast, TILE=TILE, num_warps=4,
                                            **LAUNCH_OPTIONS)
        _period_offsets_kernel[(rows,)](tot, off, seg_table, i, ROWS=rows, SB=SCAN_LANES,
                                        num_warps=4, **LAUNCH_OPTIONS)
        table = tables[kk + 3 * kk * i:kk + 3 * kk * (i + 1)]
        args = (pre, off, cand_dev, table, open_sum, last_sum, closed, parts)
        if num_parts:
            _period_terms_kernel[(num_parts,)](*args, k, stride_a, num_tiles,
                                               LOG_CONTRAST=log_contrast, TILE=TILE,
                                               KB=ENDS_PER_PROGRAM,
                                               KP2=triton.next_power_of_2(k), num_warps=4,
                                               **LAUNCH_OPTIONS)
        # Program k carries p = 1, only when it is scored (one_parts is unwritten otherwise).
        _period_carry_kernel[(k + int(has_one),)](
            *args, acc, one_parts, one_acc, n, k, num_parts, stride_a, num_tiles,
            LOG_CONTRAST=log_contrast, TILE=TILE, RB=CARRY_LANES, num_warps=4, **LAUNCH_OPTIONS)
    if k:
        # Two fp64 tensors: `int / tensor` would multiply by the reciprocal (not exact).
        p64 = cand_dev.to(torch.float64)
        blocks = torch.full_like(p64, float(numel)) / p64  # exact: p divides N
        scores = acc / (blocks - 1.0) if log_contrast else torch.sqrt(acc / blocks)
    if has_one:
        # A device divisor: CUDA turns `tensor / python_float` into a multiplication by the
        # reciprocal, which scores_triton_many's per-slot division would not match.
        numel_dev = tables[-1:].to(torch.float64)
        out[0] = (one_acc / (numel_dev - 1.0))[0] if log_contrast else 0.0 * one_acc[0]
        if k:
            out[1:] = scores
    else:
        out.copy_(scores)
    return out


# --------------------------------------------------------------------------------------------
# Many tensors
# --------------------------------------------------------------------------------------------
@jit
def _segment(seg_ptr, s, ROWS: tl.constexpr, TILE: tl.constexpr):
    """Segment ``s``'s chunk length, tiles and tile base in the round's scratch (even, so
    every per-segment pointer below is 16-byte aligned like a fresh per-tensor buffer)."""
    seg = seg_ptr + s * 6
    return tl.load(seg + 1), tl.load(seg + 5), tl.load(seg + 4) * 2


@jit(do_not_specialize=["map_base"])
def _multi_prefix_kernel(g_base, map_ptr, seg_ptr, pre_ptr, tot_ptr, one_ptr, map_base,
                         LOG_CONTRAST: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
                         G_VEC: tl.constexpr):
    """Program ``pid``: :func:`_prefix_tile` of one tile of segment ``map[map_base + pid]``.

    g_base: the class's base gradient (fp32/bf16/fp16; segment column 0 is the chunk's
    offset from it in units of ``G_VEC`` elements: 16 bytes when the class is aligned, else
    1). map_ptr: int64, segment per program. pre_ptr, tot_ptr, one_ptr: fp64 scratch of the
    round; a segment with tile base ``tb`` has its scans at ``tb * ROWS * TILE``
    (``[ROWS, tiles * TILE]``), its totals at ``tb * ROWS`` (``[ROWS, tiles]``), its ``p = 1``
    parts at ``tb``.
    """
    pid = tl.program_id(0).to(tl.int64)
    s = tl.load(map_ptr + map_base + pid)
    n, tiles, tb = _segment(seg_ptr, s, ROWS, TILE)
    seg = seg_ptr + s * 6
    g_ptr = g_base + tl.load(seg) * G_VEC
    _prefix_tile(g_ptr, pre_ptr + tb * (ROWS * TILE), tot_ptr + tb * ROWS, one_ptr + tb,
                 pid - tl.load(seg + 3), n, tiles * TILE, tiles, tl.load(seg + 2),
                 LOG_CONTRAST, TILE)


@jit(do_not_specialize=["G", "map_base"])
def _multi_terms_kernel(map_ptr, seg_ptr, pair_ptr, pre_ptr, off_ptr, open_ptr, last_ptr,
                        closed_ptr, part_ptr, G, map_base, LOG_CONTRAST: tl.constexpr,
                        ROWS: tl.constexpr, TILE: tl.constexpr, KB: tl.constexpr):
    """Program ``pid``: :func:`_terms_sum` of pair ``map[map_base + pid]`` (int64
    ``[P, PAIR_COLS]`` rows), written to ``part[pid]``. open/last/closed: fp64 carries of
    every slot (``open`` ``[ROWS, G]``; ``G``, the row stride, is the number of slots rounded up
    to even)."""
    pid = tl.program_id(0).to(tl.int64)
    pair = pair_ptr + tl.load(map_ptr + map_base + pid) * 7
    n, tiles, tb = _segment(seg_ptr, tl.load(pair), ROWS, TILE)
    total = _terms_sum(pre_ptr + tb * (ROWS * TILE), off_ptr + tb * ROWS, open_ptr, last_ptr,
                       closed_ptr, G, tl.load(pair + 1), tl.load(pair + 2), tl.load(pair + 3),
                       tl.load(pair + 4), pid - tl.load(pair + 5), tiles * TILE, tiles,
                       LOG_CONTRAST, TILE, KB)
    tl.store(part_ptr + pid, total)


@jit(do_not_specialize=["G", "pair_base", "num_pairs", "one_base"])
def _multi_carry_kernel(seg_ptr, pair_ptr, one_tab_ptr, pre_ptr, off_ptr, open_ptr, last_ptr,
                        closed_ptr, acc_ptr, part_ptr, one_ptr, G, pair_base, num_pairs,
                        one_base, LOG_CONTRAST: tl.constexpr, ROWS: tl.constexpr,
                        TILE: tl.constexpr, RB: tl.constexpr):
    """Program ``pid < num_pairs``: :func:`_carry_candidate` of pair ``pair_base + pid``.
    Then one program per row ``one_base + pid - num_pairs`` of the ``p = 1`` table:
    :func:`_carry_one` into ``acc[slot]``. (The branches are in the per-tensor kernel's order,
    so ``compile_check.py --compare-layouts`` can match their layouts one by one.)"""
    pid = tl.program_id(0).to(tl.int64)
    if pid >= num_pairs:
        one = one_tab_ptr + (one_base + pid - num_pairs) * 2
        n, tiles, tb = _segment(seg_ptr, tl.load(one), ROWS, TILE)
        _carry_one(pre_ptr + tb * (ROWS * TILE), off_ptr + tb * ROWS, one_ptr + tb,
                   acc_ptr + tl.load(one + 1), n, tiles * TILE, tiles, pid * 0, LOG_CONTRAST,
                   TILE, RB)
    else:
        pair = pair_ptr + (pair_base + pid) * 7
        n, tiles, tb = _segment(seg_ptr, tl.load(pair), ROWS, TILE)
        start = tl.load(pair + 5)
        _carry_candidate(pre_ptr + tb * (ROWS * TILE), off_ptr + tb * ROWS, open_ptr, last_ptr,
                         closed_ptr, acc_ptr, part_ptr, G, tl.load(pair + 1),
                         tl.load(pair + 2), tl.load(pair + 3), tl.load(pair + 4), start,
                         start + tl.load(pair + 6), n, tiles * TILE, tiles, LOG_CONTRAST,
                         TILE, RB)


def _even_tiles(n: int) -> int:
    """Tiles a chunk of ``n`` elements takes in the round's scratch (even: aligned bases)."""
    return -(-n // (2 * TILE)) * 2


def plan_rounds(numels: Sequence[int], chunk: int, round_elements: int) -> list[list[int]]:
    """The tensors that run a chunk in each round, in order (module docstring).

    Tensor ``t`` runs its chunks ``0, 1, ...`` in successive rounds it belongs to. A round takes
    tensors with the most chunks left first (ties: lower index), each while the round's tiles
    (:func:`_even_tiles`) fit ``round_elements``; the first always fits. So the number of rounds
    is at least the largest tensor's chunk count and about ``sum(numels) / round_elements``
    when that is larger.
    """
    chunks = [-(-n // chunk) for n in numels]
    done = [0] * len(numels)
    active = [t for t, c in enumerate(chunks) if c]
    rounds = []
    while active:
        active.sort(key=lambda t: (done[t] - chunks[t], t))
        members: list[int] = []
        used = 0
        for t in active:
            need = _even_tiles(min(chunk, numels[t] - done[t] * chunk)) * TILE
            if members and used + need > round_elements:
                if used + 2 * TILE > round_elements:
                    break  # full: every chunk takes at least two tiles
                continue
            members.append(t)
            used += need
        for t in members:
            done[t] += 1
        active = [t for t in active if done[t] < chunks[t]]
        rounds.append(members)
    return rounds


def _exclusive(x: Tensor) -> Tensor:
    return torch.cumsum(x, 0) - x


@dataclass
class _Class:
    """The segments of one round that one prefix launch serves: one gradient dtype, chunks
    16-byte aligned or not. ``base`` is the first chunk (a view); offsets are measured from
    it in ``unit`` bytes."""

    key: tuple[torch.dtype, bool]
    base: Tensor
    ptr: int
    unit: int
    map_base: int  # first entry of the prefix map
    programs: int = 0


@dataclass
class _Round:
    """One round: its prefix launches, its ranges in the tables and its terms launch."""

    classes: list[_Class]
    segs: tuple[int, int]  # segment range
    tiles: int  # even tiles of scratch
    pairs: tuple[int, int] = (0, 0)  # pair range
    ones: tuple[int, int] = (0, 0)  # range in the p = 1 table
    terms_base: int = 0  # first entry of the terms map
    programs: int = 0  # terms programs


def scores_triton_many(grads: Sequence[Tensor], cands_list: Sequence[list[int]], variant: str,
                       chunk: int, round_elements: int) -> Tensor:
    """The scores of many tensors: fp64 ``[sum(len(c) for c in cands_list)]``, the scores of
    ``cands_list[i]`` for ``grads[i]`` concatenated in order, on the tensors' device.

    ``grads``: on one device; those with candidates contiguous fp32/bf16/fp16 tensors with at
    least one element, each pointer a multiple of its element size (the others are not read).
    ``cands_list``: checked, ascending divisors of each ``numel`` (any may be empty).
    ``chunk``: elements per chunk, as :func:`scores_triton`; ``round_elements``: tile-scan
    elements per round (``>= chunk``; the scratch is about ``8 * rows * round_elements``
    bytes). Equal to ``scores_triton(grads[i], cands_list[i], variant, chunk)`` concatenated,
    bit for bit in the interpreter (module docstring). Nothing is read back.
    """
    dev = grads[0].device
    log_contrast = variant == "log_contrast"
    rows = 1 if log_contrast else 2
    sizes = [len(c) for c in cands_list]
    num_slots = sum(sizes)
    if num_slots == 0:
        return torch.empty(0, dtype=torch.float64, device=dev)
    out_base = [0] * len(sizes)
    for t in range(1, len(sizes)):
        out_base[t] = out_base[t - 1] + sizes[t - 1]
    scored = [t for t, c in enumerate(cands_list) if c]
    has_one = [bool(c) and c[0] == 1 for c in cands_list]
    numels = [g.numel() for g in grads]
    itemsizes = [g.element_size() for g in grads]
    ptrs = [g.data_ptr() for g in grads]

    # Segments in round order; within a round grouped by prefix class.
    seg_rows: list[int] = []  # SEG_COLS per segment
    seg_tensor: list[int] = []
    seg_start: list[int] = []
    prefix_tiles: list[int] = []  # programs per segment, in prefix-map order
    rounds: list[_Round] = []
    done = [0] * len(grads)
    map_size = 0
    dtype_names = [str(g.dtype) for g in grads]
    for members in plan_rounds([numels[t] for t in scored], chunk, round_elements):
        chunks = []
        for t in (scored[i] for i in members):
            start = done[t] * chunk
            done[t] += 1
            ptr = ptrs[t] + start * itemsizes[t]
            chunks.append((dtype_names[t], ptr % 16 != 0, t, start, ptr))
        chunks.sort(key=lambda c: c[:2])
        classes: list[_Class] = []
        tb = 0
        first_seg = len(seg_tensor)
        for _, unaligned, t, start, ptr in chunks:
            key = (grads[t].dtype, not unaligned)
            if not classes or classes[-1].key != key:
                classes.append(_Class(key, grads[t].view(-1)[start:], ptr,
                                      itemsizes[t] if unaligned else 16, map_size))
            cls = classes[-1]
            n = min(chunk, numels[t] - start)
            tiles = triton.cdiv(n, TILE)
            seg_rows += [(ptr - cls.ptr) // cls.unit, n, int(start > 0) if has_one[t] else 2,
                         cls.programs, tb // 2, tiles]
            cls.programs += tiles
            map_size += tiles
            prefix_tiles.append(tiles)
            seg_tensor.append(t)
            seg_start.append(start)
            tb += _even_tiles(n)
        rounds.append(_Round(classes, (first_seg, len(seg_tensor)), tb))

    # Pairs (segment, candidate != 1) in segment order, computed with CPU tensors.
    cand_p: list[int] = []
    cand_slot: list[int] = []
    cand_first = [0] * len(grads)
    cand_k = [0] * len(grads)
    for t in scored:
        skip = int(has_one[t])
        cand_first[t] = len(cand_p)
        cand_k[t] = sizes[t] - skip
        cand_p += cands_list[t][skip:]
        cand_slot += range(out_base[t] + skip, out_base[t] + sizes[t])
    k_seg = torch.tensor([cand_k[t] for t in seg_tensor], dtype=torch.int64)
    num_pairs = int(k_seg.sum())
    seg_of = torch.repeat_interleave(torch.arange(len(seg_tensor)), k_seg,
                                     output_size=num_pairs)
    index = (torch.tensor([cand_first[t] for t in seg_tensor], dtype=torch.int64)[seg_of]
             + torch.arange(num_pairs) - _exclusive(k_seg)[seg_of])
    p = torch.tensor(cand_p, dtype=torch.int64)[index]
    chunk_start = torch.tensor(seg_start, dtype=torch.int64)[seg_of]
    chunk_len = torch.tensor(seg_rows[1::SEG_COLS], dtype=torch.int64)[seg_of]
    first = p - chunk_start % p
    count = torch.where(first > chunk_len, 0,
                        torch.div(chunk_len - first, p, rounding_mode="floor") + 1)
    progs = -torch.div(-count, ENDS_PER_PROGRAM, rounding_mode="floor")
    # A round's pairs are contiguous; its terms programs are numbered from 0 in pair order.
    prog_first = _exclusive(progs)
    pair_end = torch.cumsum(k_seg, 0).tolist()
    prog_end = (prog_first + progs).tolist()
    ones: list[int] = []
    for r in rounds:
        a, b = r.segs
        r.pairs = (pair_end[a - 1] if a else 0, pair_end[b - 1] if b else 0)
        if r.pairs[1] > r.pairs[0]:
            r.terms_base = prog_end[r.pairs[0] - 1] if r.pairs[0] else 0
            r.programs = prog_end[r.pairs[1] - 1] - r.terms_base
        one_a = len(ones) // ONE_COLS
        for s in range(a, b):
            if has_one[seg_tensor[s]]:
                ones += [s, out_base[seg_tensor[s]]]
        r.ones = (one_a, len(ones) // ONE_COLS)
    prog_first -= torch.repeat_interleave(
        torch.tensor([r.terms_base for r in rounds], dtype=torch.int64),
        torch.tensor([r.pairs[1] - r.pairs[0] for r in rounds], dtype=torch.int64),
        output_size=num_pairs)
    pairs = torch.stack([seg_of, torch.tensor(cand_slot, dtype=torch.int64)[index], p, first,
                         count, prog_first, progs], dim=1)
    # The final expressions' operands per slot: p and the tensor's numel.
    slot_p: list[int] = []
    slot_numel: list[int] = []
    for t, c in enumerate(cands_list):
        slot_p += c
        slot_numel += [numels[t]] * len(c)

    host = [torch.tensor(seg_rows, dtype=torch.int64), pairs.reshape(-1),
            torch.tensor(ones, dtype=torch.int64),
            torch.tensor(slot_p + slot_numel, dtype=torch.int64),
            torch.tensor(prefix_tiles, dtype=torch.int64), progs]
    # Each table padded to 16 bytes: every launch then sees the same pointer alignment, so
    # Triton compiles one variant per kernel, not one per combination of table lengths.
    lengths = [x.numel() for x in host]
    tables = host_to_device(torch.cat([torch.nn.functional.pad(x, (0, x.numel() % 2))
                                       for x in host]), dev)  # the one host-to-device copy
    seg_dev, pair_dev, one_dev, slot_dev, tiles_dev, progs_dev = (
        t[:n] for t, n in zip(tables.split([n + n % 2 for n in lengths]), lengths))
    prefix_map = torch.repeat_interleave(tiles_dev, output_size=map_size)
    terms_map = torch.repeat_interleave(progs_dev, output_size=prog_end[-1] if prog_end else 0)
    # Carries of every slot in one zeroed buffer: open sums [rows, G], the last closed block's
    # sum [G], whether one exists [G], the running score sums [G] (p = 1: its running sum);
    # G rounded up to even (aligned parts, as the tables).
    stride = num_slots + num_slots % 2
    state = torch.zeros((rows + 3) * stride, dtype=torch.float64, device=dev)
    open_sum, last_sum, closed, acc = state.split([rows * stride] + [stride] * 3)
    # One scratch for the largest round: scans, totals, offsets, p = 1 parts, terms sums (all
    # parts of even length: 16-byte aligned).
    max_tiles = max(r.tiles for r in rounds)
    max_parts = max(max(r.programs for r in rounds), 1)
    scratch_lengths = [rows * max_tiles * TILE, rows * max_tiles, rows * max_tiles, max_tiles,
                       -(-max_parts // 2) * 2]
    scratch = torch.empty(sum(scratch_lengths), dtype=torch.float64, device=dev)
    pre, tot, off, one_parts, parts = scratch.split(scratch_lengths)

    consts = {"LOG_CONTRAST": log_contrast, "ROWS": rows, "TILE": TILE, "num_warps": 4,
              **LAUNCH_OPTIONS}
    for r in rounds:
        for cls in r.classes:
            _multi_prefix_kernel[(cls.programs,)](
                cls.base, prefix_map, seg_dev, pre, tot, one_parts, cls.map_base,
                G_VEC=16 // cls.key[0].itemsize if cls.key[1] else 1, **consts)
        seg_a, seg_b = r.segs
        _period_offsets_kernel[((seg_b - seg_a) * rows,)](tot, off, seg_dev, seg_a, ROWS=rows,
                                                          SB=SCAN_LANES, num_warps=4,
                                                          **LAUNCH_OPTIONS)
        if r.programs:
            _multi_terms_kernel[(r.programs,)](
                terms_map, seg_dev, pair_dev, pre, off, open_sum, last_sum, closed, parts,
                stride, r.terms_base, KB=ENDS_PER_PROGRAM, **consts)
        (pair_a, pair_b), (one_a, one_b) = r.pairs, r.ones
        _multi_carry_kernel[(pair_b - pair_a + one_b - one_a,)](
            seg_dev, pair_dev, one_dev, pre, off, open_sum, last_sum, closed, acc, parts,
            one_parts, stride, pair_a, pair_b - pair_a, one_a, RB=CARRY_LANES, **consts)
    # The per-tensor path's final expressions, per slot (p = 1: blocks = numel).
    p_slot, numel_slot = slot_dev.split(num_slots)
    blocks = numel_slot.to(torch.float64) / p_slot.to(torch.float64)  # exact: p divides N
    acc = acc[:num_slots]
    if log_contrast:
        return acc / (blocks - 1.0)
    return torch.where(p_slot == 1, 0.0 * acc, torch.sqrt(acc / blocks))
