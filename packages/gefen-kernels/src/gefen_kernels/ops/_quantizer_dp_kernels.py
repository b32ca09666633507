"""Triton kernels of :mod:`.quantizer_dp` (docs/algorithm.md#codebook-solver): the first, middle
and last layers of the dynamic program. The launcher and the prefix sums are in
:mod:`.quantizer_dp`."""

from __future__ import annotations

from .._triton import jit, tl

_INT32_MAX = tl.constexpr(2**31 - 1) if tl is not None else 2**31 - 1


@jit(do_not_specialize=["rows"])
def _dp_first_layer_kernel(pref_ptr, d_ptr, arg_ptr, m, rows,  # type: ignore[no-untyped-def]
                           BLOCK: tl.constexpr):
    """Layer 1 (fixed centre -1) on rows ``j = 1 .. rows``: ``D_1[j]`` into row 1 of d_ptr
    (fp64 ``[2, m + 1]``) and ``a_1 = 1`` into row 1 of arg_ptr (int32 ``[K, rows]``)."""
    stride = m + 1
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < rows
    j = r + 1
    w = tl.load(pref_ptr + j, mask=ok, other=1.0)
    s1 = tl.load(pref_ptr + stride + j, mask=ok, other=0.0)
    s2 = tl.load(pref_ptr + 2 * stride + j, mask=ok, other=0.0)
    tl.store(d_ptr + stride + j, (s2 + 2.0 * s1) + w, mask=ok)
    tl.store(arg_ptr + rows + r, tl.full([BLOCK], 1, tl.int32), mask=ok)


@jit
def _free_values(pref_ptr, dprev, stride, wj, s1j, s2j, i, ok):  # type: ignore[no-untyped-def]
    """``D_{k-1}[i-1] + (s2 - s1*s1/w)`` of segments ``[i..j]``, in the textbook's order;
    ``wj, s1j, s2j`` are the prefix sums at ``j``."""
    im1 = i - 1
    ww = wj - tl.load(pref_ptr + im1, mask=ok, other=0.0)
    s1 = s1j - tl.load(pref_ptr + stride + im1, mask=ok, other=0.0)
    s2 = s2j - tl.load(pref_ptr + 2 * stride + im1, mask=ok, other=0.0)
    q = s1 * s1
    q = q / ww
    cost = s2 - q
    return tl.load(dprev + im1, mask=ok, other=0.0) + cost


@jit(do_not_specialize=["k", "rows"])
def _dp_layer_kernel(pref_ptr, d_ptr, arg_ptr, m, k, rows,  # type: ignore[no-untyped-def]
                     BR: tl.constexpr, BC: tl.constexpr):
    """Free layer ``k``: rows ``r0 .. r0 + BR - 1`` of program ``r0 / BR`` (module docstring).

    pref_ptr: fp64 ``[3, m + 1]``. d_ptr: fp64 ``[2, m + 1]``, ``D_k[j]`` in row ``k & 1``.
    arg_ptr: int32 ``[K, rows]``, ``a_k(k + r)`` at ``[k, r]``.
    """
    stride = m + 1
    dprev = d_ptr + ((k - 1) & 1) * stride
    dcur = d_ptr + (k & 1) * stride
    aprev = arg_ptr + (k - 1) * rows
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = r < rows
    j = k + r
    wj = tl.load(pref_ptr + j, mask=ok, other=1.0)
    s1j = tl.load(pref_ptr + stride + j, mask=ok, other=0.0)
    s2j = tl.load(pref_ptr + 2 * stride + j, mask=ok, other=0.0)
    # a_{k-1}(j) is row r + 1 of layer k - 1; the top row (r = rows - 1) has none and takes
    # a_{k-1}(j - 1).
    lo = tl.load(aprev + tl.minimum(r + 1, rows - 1), mask=ok, other=0)
    lo = tl.minimum(tl.maximum(lo, k), j)  # j: keep the window non-empty under rounding
    first = tl.min(tl.where(ok, lo, _INT32_MAX), 0)
    last = tl.max(tl.where(ok, j, 0), 0)
    best_v = tl.full([BR], float("inf"), tl.float64)
    best_i = lo
    cols = tl.arange(0, BC)
    for i0 in range(first, last + 1, BC):
        # Full [BR, BC]: Triton 3.3's loads do not broadcast a pointer up to its mask.
        i = tl.broadcast_to(i0 + cols[None, :], [BR, BC])
        inside = ok[:, None] & (i >= lo[:, None]) & (i <= j[:, None])
        v = _free_values(pref_ptr, dprev, stride, wj[:, None], s1j[:, None], s2j[:, None], i,
                         inside)
        v = tl.where(inside, v, float("inf"))
        vmin = tl.min(v, 1)
        imin = tl.min(tl.where(inside & (v == vmin[:, None]), i, _INT32_MAX), 1)
        better = vmin < best_v  # later tiles hold larger i: strict improvement only
        best_i = tl.where(better, imin, best_i)
        best_v = tl.where(better, vmin, best_v)
    tl.store(arg_ptr + k * rows + r, best_i, mask=ok)
    # The winner's own bits (+0.0 and -0.0 tie in the comparisons above).
    tl.store(dcur + j, _free_values(pref_ptr, dprev, stride, wj, s1j, s2j, best_i, ok), mask=ok)


@jit(do_not_specialize=["kk", "rows"])
def _dp_last_layer_kernel(pref_ptr, d_ptr, arg_ptr, code_ptr, cost_ptr,  # type: ignore[no-untyped-def]
                          m, kk, rows, BLOCK: tl.constexpr):
    """Layer ``K`` (the one row ``j = m``, fixed centre +1, ``i = K .. m``, leftmost minimum)
    and the backtracking: codewords into code_ptr (fp64 ``[K]``), the cost into cost_ptr."""
    stride = m + 1
    w_ptr = pref_ptr
    s1_ptr = pref_ptr + stride
    dprev = d_ptr + ((kk - 1) & 1) * stride
    wm = tl.load(w_ptr + m)
    s1m = tl.load(s1_ptr + m)
    s2m = tl.load(pref_ptr + 2 * stride + m)
    lanes = tl.arange(0, BLOCK)
    best_v = tl.full([], float("inf"), tl.float64)
    best_i = tl.full([], 0, tl.int32)
    for i0 in range(kk, m + 1, BLOCK):
        i = i0 + lanes
        ok = i <= m
        im1 = i - 1
        ww = wm - tl.load(w_ptr + im1, mask=ok, other=0.0)
        s1 = s1m - tl.load(s1_ptr + im1, mask=ok, other=0.0)
        s2 = s2m - tl.load(pref_ptr + 2 * stride + im1, mask=ok, other=0.0)
        v = tl.load(dprev + im1, mask=ok, other=0.0) + ((s2 - 2.0 * s1) + ww)
        v = tl.where(ok, v, float("inf"))
        vmin = tl.min(v, 0)
        imin = tl.min(tl.where(ok & (v == vmin), i, _INT32_MAX), 0)
        better = vmin < best_v  # later blocks hold larger i: strict improvement only
        best_i = tl.where(better, imin, best_i)
        best_v = tl.where(better, vmin, best_v)
    # The winner's own bits (+0.0 and -0.0 tie in the comparisons above).
    im1 = best_i - 1
    best_v = tl.load(dprev + im1) + (((s2m - tl.load(pref_ptr + 2 * stride + im1))
                                      - 2.0 * (s1m - tl.load(s1_ptr + im1)))
                                     + (wm - tl.load(w_ptr + im1)))
    tl.store(cost_ptr, best_v)
    tl.store(code_ptr, -1.0)
    tl.store(code_ptr + kk - 1, 1.0)
    # Backtrack: segment t + 1 = [start..end] gives codeword t, for layers kk - 1 .. 2.
    end = best_i - 1
    for s in range(0, kk - 2):
        layer = kk - 1 - s
        start = tl.load(arg_ptr + layer * rows + (end - layer))
        mean = (tl.load(s1_ptr + end) - tl.load(s1_ptr + start - 1)) / (
            tl.load(w_ptr + end) - tl.load(w_ptr + start - 1))
        tl.store(code_ptr + layer - 1, mean)
        end = start - 1
