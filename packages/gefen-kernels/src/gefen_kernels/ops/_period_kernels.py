"""Triton path of :mod:`.period_scores`: every candidate's score in three launches per chunk.

Same scores as the reference (§1.7.2, §1.7.3, the module docstring of :mod:`.period_scores`),
to fp64 rounding: the chunk-local exclusive prefix ``E`` is formed as the reference's (fp64
tile scans plus fp64 tile offsets, over 8M-element chunks instead of 512K, tile totals summed
by a tree) and each block's sum, mean and term use the reference's expressions; the terms are
added in another fixed order. Per chunk:

1. :func:`_period_prefix_kernel` (one program per ``TILE`` elements): the transform, the
   tile-local inclusive fp64 scans and tile totals, and (Variant L) the tile's part of the
   ``p = 1`` score, ``sum |x_i - x_{i-1}|`` over the pairs ending in the tile (the element
   before the tile is loaded and transformed again, so no values are stored).
2. The tile offsets, an exclusive fp64 ``cumsum`` of the totals (torch).
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
nothing is read back until the caller reads the scores. The reference's per-chunk torch glue
(about ninety small launches) and its ``O(block ends)`` int64 temporaries are gone, so a chunk
can be 8M elements (64 MiB of fp64 scans; 128 MiB for Variant V) instead of 2M.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._triton import jit, tl, triton
from ._triton_helpers import LAUNCH_OPTIONS

__all__ = ["host_to_device", "scores_triton"]

TILE = 1024  # elements per prefix program (one fp64 scan each)
ENDS_PER_PROGRAM = 1024  # block ends per terms program
CARRY_LANES = 256  # partial sums the carry kernel adds per iteration


@jit
def _period_prefix_kernel(g_ptr, pre_ptr, tot_ptr, one_ptr, n, stride_a, has_prev,
                          LOG_CONTRAST: tl.constexpr, TILE: tl.constexpr):
    """Transform one tile of a chunk and scan it in fp64.

    g_ptr: the chunk, ``[n]`` contiguous fp32/bf16/fp16 (converted to fp32); when
    ``has_prev`` is 1 the element before it is read too. pre_ptr: fp64 ``[A, stride_a]``,
    the tile-local *inclusive* prefix of each row (``A = 1``: ``x = ln(f32(g*g) + 1e-12)``;
    ``A = 2``: ``y = g^2`` in fp64 and ``y^2``). tot_ptr: fp64 ``[A, num_tiles]``, each tile's
    total. one_ptr: fp64 ``[num_tiles]`` (LOG_CONTRAST), the tile's ``sum |x_i - x_{i-1}|``
    over its elements ``i`` that have a predecessor. Offsets are int64; padding lanes add 0.
    """
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * TILE + tl.arange(0, TILE).to(tl.int64)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    num_tiles = tl.num_programs(0)
    if LOG_CONTRAST:
        x = tl.log((g * g).to(tl.float64) + 1e-12)
        x = tl.where(mask, x, 0.0)
        tl.store(pre_ptr + offs, tl.cumsum(x, axis=0), mask=mask)
        tl.store(tot_ptr + pid, tl.sum(x, axis=0))
        # The predecessor of every element, transformed again (an fp64 log is cheaper than
        # storing and re-reading 8 bytes per element).
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
    candidate ``c``); the first one (``k == 0``) adds the part left open by earlier chunks."""
    here = _prefix_at(pre_ptr, off_ptr, pos, row, stride_a, num_tiles, mask, TILE)
    before = _prefix_at(pre_ptr, off_ptr, pos - p, row, stride_a, num_tiles, mask & (k > 0),
                        TILE)
    return tl.where(k == 0, tl.load(open_ptr + row * K + c) + here, here - before)


@jit
def _period_terms_kernel(pre_ptr, off_ptr, cand_ptr, table_ptr, open_ptr, last_ptr, closed_ptr,
                         part_ptr, K, stride_a, num_tiles, LOG_CONTRAST: tl.constexpr,
                         TILE: tl.constexpr, KB: tl.constexpr, KP2: tl.constexpr):
    """Program ``pid``: block ends ``[j * KB, (j + 1) * KB)`` of candidate ``c``, where ``c`` is
    the last candidate whose first program is ``<= pid`` and ``j = pid - start[c]``.

    table_ptr: int64 ``[3, K]``: each candidate's first block end in the chunk (a local
    position in ``1..p``), its number of ends, its first program. part_ptr: fp64, one sum of
    terms per program. Terms as the reference: Variant L ``|mu_k - mu_{k-1}|`` (``mu_{-1}`` from
    the last closed block of an earlier chunk; none: 0), Variant V ``max(0, m2 - m1^2)``
    (NaN-propagating).
    """
    pid = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, KP2)
    starts = tl.load(table_ptr + 2 * K + lanes, mask=lanes < K, other=pid + 1)
    c = tl.sum((starts <= pid).to(tl.int64), axis=0) - 1
    p = tl.load(cand_ptr + c)
    first = tl.load(table_ptr + c)
    cnt = tl.load(table_ptr + K + c)
    k = (pid - tl.load(table_ptr + 2 * K + c)) * KB + tl.arange(0, KB).to(tl.int64)
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
    tl.store(part_ptr + pid, tl.sum(tl.where(valid, term, 0.0), axis=0))


@jit
def _period_carry_kernel(pre_ptr, off_ptr, cand_ptr, table_ptr, open_ptr, last_ptr, closed_ptr,
                         part_ptr, acc_ptr, one_ptr, one_acc_ptr, n, K, num_parts, stride_a,
                         num_tiles, LOG_CONTRAST: tl.constexpr, TILE: tl.constexpr,
                         RB: tl.constexpr):
    """Program ``c < K``: ``acc[c] +=`` its terms programs' sums in program order, then the
    carries for the next chunk. Program ``K``: the ``p = 1`` running sum (Variant L: the tiles'
    parts in order; Variant V: the chunk's ``sum y``, which only carries a NaN)."""
    c = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, RB).to(tl.int64)
    last = tl.full([1], 0, tl.int64) + n  # E[n]: the chunk's total
    if c == K:
        if LOG_CONTRAST:
            one = tl.load(one_acc_ptr)
            t = c * 0
            while t < num_tiles:
                one += tl.sum(tl.load(one_ptr + t + lanes, mask=t + lanes < num_tiles,
                                      other=0.0), axis=0)
                t += RB
            tl.store(one_acc_ptr, one)
        else:
            y_sum = tl.sum(_prefix_at(pre_ptr, off_ptr, last, 0, stride_a, num_tiles,
                                      last > 0, TILE), axis=0)
            tl.store(one_acc_ptr, tl.load(one_acc_ptr) + y_sum)
    else:
        start = tl.load(table_ptr + 2 * K + c)
        stop = tl.where(c + 1 < K, tl.load(table_ptr + 2 * K + c + 1, mask=c + 1 < K),
                        num_parts)
        acc = tl.load(acc_ptr + c)
        i = start
        while i < stop:
            acc += tl.sum(tl.load(part_ptr + i + lanes, mask=i + lanes < stop, other=0.0),
                          axis=0)
            i += RB
        tl.store(acc_ptr + c, acc)
        p = tl.load(cand_ptr + c)
        first = tl.load(table_ptr + c)
        cnt = tl.load(table_ptr + K + c)
        end = tl.full([1], 0, tl.int64) + first + (cnt - 1) * p  # the last block end, if any
        if cnt > 0:
            if LOG_CONTRAST:  # before the open sums below change: the last block may be k = 0
                last_sum = _block_sums(pre_ptr, off_ptr, open_ptr, K, c, end, end * 0 + cnt - 1,
                                       p, 0, stride_a, num_tiles, end > 0, TILE)
                tl.store(last_ptr + c, tl.sum(last_sum, axis=0))
            tl.store(closed_ptr + c, 1.0)
        for row in tl.static_range(1 if LOG_CONTRAST else 2):
            total = tl.sum(_prefix_at(pre_ptr, off_ptr, last, row, stride_a, num_tiles,
                                      last > 0, TILE), axis=0)
            if cnt > 0:
                at_end = tl.sum(_prefix_at(pre_ptr, off_ptr, end, row, stride_a, num_tiles,
                                           end > 0, TILE), axis=0)
                tl.store(open_ptr + row * K + c, total - at_end)
            else:
                tl.store(open_ptr + row * K + c, tl.load(open_ptr + row * K + c) + total)


def host_to_device(values: list[int], device: torch.device) -> Tensor:
    """int64 tensor on ``device`` without a blocking copy (a pageable copy would sync CUDA)."""
    host = torch.tensor(values, dtype=torch.int64)
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
    one_parts = torch.empty(max_tiles if log_contrast else 1, dtype=torch.float64, device=dev)
    # Each chunk's table, int64 [3, K]: every candidate's block ends in [start, start + n)
    # start at local position p - start % p (in 1..p), then every p; its terms programs follow
    # the previous candidate's. All tables and the candidates go in one asynchronous copy.
    starts = list(range(0, numel, chunk))
    host = list(ps) if k else [1]
    parts_per_chunk = []
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
    tables = host_to_device(host, dev)
    cand_dev = tables[:kk]
    parts = torch.empty(max(max(parts_per_chunk), 1), dtype=torch.float64, device=dev)
    for i, (start, num_parts) in enumerate(zip(starts, parts_per_chunk)):
        n = min(chunk, numel - start)
        num_tiles = triton.cdiv(n, TILE)
        stride_a = num_tiles * TILE
        pre = scan.view(-1)[:rows * stride_a]
        tot = totals.view(-1)[:rows * num_tiles]
        src = flat[start:start + n]
        if convert:  # with the predecessor the p = 1 term reads
            lo = max(start - 1, 0)
            src = flat[lo:start + n].to(torch.float32)[start - lo:]
        _period_prefix_kernel[(num_tiles,)](src, pre, tot, one_parts, n,
                                            stride_a, int(start > 0),
                                            LOG_CONTRAST=log_contrast, TILE=TILE, num_warps=4,
                                            **LAUNCH_OPTIONS)
        tot2 = tot.view(rows, num_tiles)
        offsets = torch.cumsum(tot2, dim=1).sub_(tot2)  # exclusive, fp64, in tile order
        table = tables[kk + 3 * kk * i:kk + 3 * kk * (i + 1)]
        args = (pre, offsets, cand_dev, table, open_sum, last_sum, closed, parts)
        if num_parts:
            _period_terms_kernel[(num_parts,)](*args, k, stride_a, num_tiles,
                                               LOG_CONTRAST=log_contrast, TILE=TILE,
                                               KB=ENDS_PER_PROGRAM,
                                               KP2=triton.next_power_of_2(k), num_warps=4,
                                               **LAUNCH_OPTIONS)
        _period_carry_kernel[(k + 1,)](*args, acc, one_parts, one_acc, n, k, num_parts,
                                       stride_a, num_tiles, LOG_CONTRAST=log_contrast,
                                       TILE=TILE, RB=CARRY_LANES, num_warps=4,
                                       **LAUNCH_OPTIONS)
    if k:
        blocks = numel / cand_dev.to(torch.float64)  # exact: p divides N
        scores = acc / (blocks - 1.0) if log_contrast else torch.sqrt(acc / blocks)
    if has_one:
        out[0] = one_acc[0] / float(numel - 1) if log_contrast else 0.0 * one_acc[0]
        if k:
            out[1:] = scores
    else:
        out.copy_(scores)
    return out
