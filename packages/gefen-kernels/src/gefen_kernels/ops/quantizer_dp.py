"""The exact optimal 1-D quantizer's dynamic program (ALGORITHM.md §1.8.3) in one Triton launch.

Twin of ``gefen_core.codebook.optimal_quantizer`` for ``M >= K`` points (its ``_LayeredDP``):
the same codewords, cost and tie choices, bit for bit, as the textbook recurrence. The numpy
solver spends 70-110 ms of host time per call, bound by Python overhead over its 254 sequential
layers; here one program runs every layer on the device, and nothing is read back.

The recurrence (§1.8.3). Points ``1..M`` with fp64 prefix sums ``W, S1, S2`` (index 0 = 0,
accumulated left to right on the host: :func:`quantizer_prefix`). Segment ``[i..j]`` has
``w = W[j] - W[i-1]`` (likewise ``s1``, ``s2``), free cost ``s2 - s1*s1/w`` and, with the fixed
centre ``f``, ``(s2 - 2f*s1) + f*f*w``. Layer 1 is ``D1[j] = (S2[j] + 2*S1[j]) + W[j]``
(``f = -1``); layers ``k = 2..K-1`` are ``D_k[j] = min_i D_{k-1}[i-1] + (s2 - s1*s1/w)`` over
``i = k..j``, the leftmost minimiser (the textbook scans ``i`` upward and replaces only on strict
improvement), for the rows ``j = k .. k + R - 1`` (``R = M - K + 1``; other rows cannot lead to a
``K``-segment partition); layer ``K`` is the one row ``j = M`` with ``f = +1``. Backtracking the
argmins gives the segments; codeword ``t`` is the mean ``(S1[end] - S1[start-1]) /
(W[end] - W[start-1])`` of segment ``t + 1``, codeword 0 is -1, codeword ``K - 1`` is +1.

Which candidates a row looks at (``gefen_core.codebook``'s module docstring proves both facts):
the leftmost argmin is monotone in the row (fact 1, ``a_k(j) <= a_k(j+1)``) and across layers
(fact 2, ``a_{k-1}(j) <= a_k(j)``). Each free layer is a level-synchronous divide and conquer
over its rows, exactly as ``_LayeredDP._layer_dc``: rows sit at tree positions ``p = r + 1``;
the level of half-step ``h`` solves positions ``h, 3h, 5h, ...`` over the window
``[max(a(p - h), lo(j)), min(a(p + h), j)]``, with ``a(0) = k``, no right bound past ``R`` and
``lo(j) = max(a_{k-1}(j), k)`` (fact 2; the top row, which layer ``k - 1`` lacks, takes
``a_{k-1}(j - 1)``: fact 1, then fact 2). Consecutive windows of a level share at most one end,
so a level has at most ``M + R`` candidates; they are flattened across the program's lanes.

One level is three phases separated by ``tl.debug_barrier()`` (each reads what other lanes wrote
to the global scratch):

A. Per row of the level: its window, the exclusive prefix sum of the window sizes (``tl.cumsum``
   plus a carry across lane blocks: the row's first flat index), a flag at that index, the
   row's running minimum reset to the largest key and its argmin to ``INT32_MAX``.
B. Per flat candidate: its row from the running count of flags (cleared once read), its value,
   and ``tl.atomic_min`` of the value's order-preserving int64 key into its row's minimum.
   The candidates of a lane group (``_SEG`` consecutive) that belong to the group's first row
   are reduced first, so a long window sends one atomic per group, not one per candidate.
C. Per flat candidate whose key equals its row's minimum: ``tl.atomic_min`` of ``i`` into the
   row's argmin (the leftmost of the tied candidates, as the textbook's strict scan), and its
   value into ``D_k[j]`` (every such candidate stores the same bits).

Exactness: every candidate value is computed with the expressions and operation order of the
textbook (``_LayeredDP._values``): three prefix subtractions, ``s1 * s1``, the division by
``w``, ``s2 - q``, then ``D + cost``, in fp64, round to nearest. A division of fp64 tensors
lowers to ``div.rn.f64`` (correctly rounded; Triton's approximate division is fp32-only) and
every launch passes ``enable_fp_fusion=False``, so no multiply-add is contracted into an fma.
The minimum is a selection (integer comparisons of a bijective key; ``-0.0`` is keyed as
``+0.0`` since the two compare equal), so ``D_k[j]`` is one of the computed values, bit for
bit. Windows follow ``_layer_dc``; within a window the leftmost minimum is the textbook's
choice, and facts 1 and 2 put the textbook's argmin in the window (up to near-ties decided by
rounding, as in the numpy solver: see its docstring). ``tests/ops/test_quantizer_dp.py``
compares codewords and cost with the textbook recurrence (and, on a GPU, with
``gefen_core``'s solver at ``M = 4096``, ``K = 256``).

Cost: for ``M = 4096``, ``K = 256``, 254 layers of 12 levels, each level a pass over its rows
and two over at most ``M + R`` candidates (four blocks of 2048 lanes), about 3000 barriers'
worth of dependent global-memory round trips: latency-bound, not yet timed on a GPU. Compiled
for sm_90 (Triton 3.9, ``tests/compile_check.py --kernel _quantizer_dp --resources``), 2048
lanes over 16 warps take 128 registers per thread and no spills; 32 warps or 4096 lanes spill.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .._triton import interpret_mode, jit, require_triton, tl
from ._dispatch import check_device_for_triton, on_tensor_device
from ._triton_helpers import LAUNCH_OPTIONS

__all__ = ["optimal_quantizer_dp_triton", "quantizer_prefix"]

# Lanes per pass of the program (rows of a level, or flat candidates). Compiled: 2048 lanes over
# 16 warps; the interpreter's cost is per operation, so it takes one pass over all candidates.
_BLOCK = 2048
_NUM_WARPS = 16
# Consecutive candidates reduced together before one atomic per group (phase B).
_SEG = 32
_INT32_MAX = tl.constexpr(2**31 - 1) if tl is not None else 2**31 - 1
# Above every fp64 value's key, +inf and NaN included.
_MAX_KEY = tl.constexpr(2**63 - 1) if tl is not None else 2**63 - 1


@jit(do_not_specialize=["m", "kk", "rows", "h0", "nlev"])
def _quantizer_dp_kernel(pref_ptr, d_ptr, arg_ptr, shift_ptr, best_ptr, flag_ptr,  # type: ignore[no-untyped-def]
                         ckey_ptr, cpos_ptr, ci_ptr, code_ptr, cost_ptr,
                         m, kk, rows, h0, nlev, BLOCK: tl.constexpr, SEG: tl.constexpr,
                         GROUPS: tl.constexpr):
    """The whole recurrence in one program (module docstring).

    pref_ptr: fp64 ``[3, m + 1]`` (W, S1, S2). d_ptr: fp64 ``[2, m + 1]``, ``D_k[j]`` in row
    ``k & 1``. arg_ptr: int32 ``[kk, rows]``, ``a_k(k + r)`` at ``[k, r]`` (row 0 unused).
    shift_ptr: int32 ``[rows]``, per row of a level ``lo - first flat index``. best_ptr: int64
    ``[rows + 1]``, per tree position the minimum's key. flag_ptr: int32 ``[m + rows + 1]``,
    zero between levels. ckey_ptr, cpos_ptr, ci_ptr: per flat candidate its key, tree position
    and ``i``. code_ptr: fp64 ``[kk]``. cost_ptr: fp64 ``[]``.
    """
    stride = m + 1
    w_ptr = pref_ptr
    s1_ptr = pref_ptr + stride
    s2_ptr = pref_ptr + 2 * stride
    lanes = tl.arange(0, BLOCK)
    tl.static_assert(GROUPS * SEG == BLOCK)
    grid2 = tl.arange(0, GROUPS)[:, None] * SEG + tl.arange(0, SEG)[None, :]

    # Layer 1 (fixed centre -1) on its rows j = 1 .. rows, and a_1 = 1.
    for r0 in range(0, rows, BLOCK):
        r = r0 + lanes
        ok = r < rows
        j = r + 1
        w = tl.load(w_ptr + j, mask=ok, other=1.0)
        s1 = tl.load(s1_ptr + j, mask=ok, other=0.0)
        s2 = tl.load(s2_ptr + j, mask=ok, other=0.0)
        tl.store(d_ptr + stride + j, (s2 + 2.0 * s1) + w, mask=ok)
        tl.store(arg_ptr + rows + r, tl.full([BLOCK], 1, tl.int32), mask=ok)
    tl.debug_barrier()

    for k in range(2, kk):
        dprev = d_ptr + ((k - 1) & 1) * stride
        dcur = d_ptr + (k & 1) * stride
        aprev = arg_ptr + (k - 1) * rows
        acur = arg_ptr + k * rows
        for lev in range(nlev):
            h = h0 >> lev
            n = (rows - h) // (2 * h) + 1  # positions h, 3h, ... <= rows
            # Phase A: the windows of the level's rows and their first flat indices.
            total = 0
            for t0 in range(0, n, BLOCK):
                t = t0 + lanes
                ok = t < n
                p = h + 2 * h * t
                j = k + p - 1
                has_left = ok & (p > h)
                left = tl.load(acur + (p - h - 1), mask=has_left, other=0)
                left = tl.where(p > h, left, k)
                has_right = ok & (p + h <= rows)
                right = tl.load(acur + (p + h - 1), mask=has_right, other=0)
                hi = tl.where(p + h <= rows, tl.minimum(right, j), j)
                # a_{k-1}(j) is at offset p of layer k - 1; the top row (p = rows) has none
                # and takes the last row's, a_{k-1}(j - 1) (fact 1 in layer k, then fact 2).
                lower = tl.load(aprev + tl.minimum(p, rows - 1), mask=ok, other=0)
                lo = tl.maximum(tl.maximum(left, lower), k)
                # Exact arithmetic gives lo <= hi; keep the window well-formed if rounding
                # does not (as _layer_dc does).
                lo = tl.minimum(lo, hi)
                cnt = tl.where(ok, hi - lo + 1, 0)
                start = total + tl.cumsum(cnt, 0) - cnt
                tl.store(shift_ptr + t, lo - start, mask=ok)
                tl.store(flag_ptr + start, tl.full([BLOCK], 1, tl.int32), mask=ok & (t > 0))
                tl.store(best_ptr + p, tl.full([BLOCK], _MAX_KEY, tl.int64), mask=ok)
                tl.store(acur + (p - 1), tl.full([BLOCK], _INT32_MAX, tl.int32), mask=ok)
                total += tl.sum(cnt, 0)
            tl.debug_barrier()
            # Phase B: every candidate's value; the rows' minima.
            row0 = 0  # the level row of flat index c0
            for c0 in range(0, total, BLOCK):
                c = c0 + grid2
                ok = c < total
                f = tl.load(flag_ptr + c, mask=ok, other=0)
                tl.store(flag_ptr + c, tl.zeros([GROUPS, SEG], tl.int32), mask=ok & (f != 0))
                gsum = tl.sum(f, 1)
                t = row0 + tl.cumsum(f, 1) + (tl.cumsum(gsum, 0) - gsum)[:, None]
                row0 += tl.sum(gsum, 0)
                i = c + tl.load(shift_ptr + t, mask=ok, other=0)
                p = h + 2 * h * t
                j = k + p - 1
                im1 = i - 1
                ww = tl.load(w_ptr + j, mask=ok, other=1.0) - tl.load(w_ptr + im1, mask=ok,
                                                                       other=0.0)
                s1 = tl.load(s1_ptr + j, mask=ok, other=0.0) - tl.load(s1_ptr + im1, mask=ok,
                                                                        other=0.0)
                s2 = tl.load(s2_ptr + j, mask=ok, other=0.0) - tl.load(s2_ptr + im1, mask=ok,
                                                                        other=0.0)
                q = s1 * s1
                q = q / ww
                cost = s2 - q
                v = tl.load(dprev + im1, mask=ok, other=0.0) + cost
                # Order-preserving int64 key: negative values flip their magnitude bits (a
                # larger magnitude gives a smaller key); -0.0 takes +0.0's key (they are equal).
                bits = tl.where(v == 0.0, 0, v.to(tl.int64, bitcast=True))
                key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFFFFFFFFFF)
                key = tl.where(ok, key, _MAX_KEY)
                tl.store(ckey_ptr + c, key, mask=ok)
                tl.store(cpos_ptr + c, p, mask=ok)
                tl.store(ci_ptr + c, i, mask=ok)
                # The group's candidates of its first row: one atomic for all of them. The
                # barriers order the atomics with the phases around them: relaxed, CTA scope.
                tfirst = tl.min(t, 1)
                first = t == tfirst[:, None]
                gmin = tl.min(tl.where(first, key, _MAX_KEY), 1)
                tl.atomic_min(best_ptr + (h + 2 * h * tfirst), gmin, mask=gmin < _MAX_KEY,
                              sem="relaxed", scope="cta")
                tl.atomic_min(best_ptr + p, key, mask=ok & (t != tfirst[:, None]), sem="relaxed",
                              scope="cta")
            tl.debug_barrier()
            # Phase C: the leftmost candidate holding its row's minimum; D_k of the row.
            for c0 in range(0, total, BLOCK):
                c = c0 + lanes
                ok = c < total
                key = tl.load(ckey_ptr + c, mask=ok, other=_MAX_KEY)
                p = tl.load(cpos_ptr + c, mask=ok, other=1)
                i = tl.load(ci_ptr + c, mask=ok, other=0)
                best = tl.load(best_ptr + p, mask=ok, other=_MAX_KEY)
                win = ok & (key == best)
                tl.atomic_min(acur + (p - 1), i, mask=win, sem="relaxed", scope="cta")
                value = tl.where(key >= 0, key, key ^ 0x7FFFFFFFFFFFFFFF).to(tl.float64,
                                                                            bitcast=True)
                tl.store(dcur + (k + p - 1), value, mask=win)
            tl.debug_barrier()

    # Layer K: the one row j = m (fixed centre +1), i = kk .. m; leftmost minimum.
    dprev = d_ptr + ((kk - 1) & 1) * stride
    wm = tl.load(w_ptr + m)
    s1m = tl.load(s1_ptr + m)
    s2m = tl.load(s2_ptr + m)
    best_v = tl.full([], float("inf"), tl.float64)
    best_i = tl.full([], 0, tl.int32)
    for i0 in range(kk, m + 1, BLOCK):
        i = i0 + lanes
        ok = i <= m
        im1 = i - 1
        ww = wm - tl.load(w_ptr + im1, mask=ok, other=0.0)
        s1 = s1m - tl.load(s1_ptr + im1, mask=ok, other=0.0)
        s2 = s2m - tl.load(s2_ptr + im1, mask=ok, other=0.0)
        v = tl.load(dprev + im1, mask=ok, other=0.0) + ((s2 - 2.0 * s1) + ww)
        v = tl.where(ok, v, float("inf"))
        vmin = tl.min(v, 0)
        imin = tl.min(tl.where(ok & (v == vmin), i, _INT32_MAX), 0)
        better = vmin < best_v  # later blocks hold larger i: strict improvement only
        best_i = tl.where(better, imin, best_i)
        best_v = tl.where(better, vmin, best_v)
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


def quantizer_prefix(points: Tensor | np.ndarray | Sequence[float],
                     weights: Tensor | np.ndarray | Sequence[float]) -> Tensor:
    """The fp64 prefix sums ``W, S1, S2`` of §1.8.3 as one CPU tensor ``[3, M + 1]``.

    Built exactly as ``gefen_core.codebook._LayeredDP`` builds them: column 0 is 0 and the
    sums accumulate left to right on the host (``np.cumsum`` of ``w``, ``w*x`` and
    ``(w*x)*x``), so :func:`optimal_quantizer_dp_triton` sees the textbook's sums bit for bit
    (a parallel scan would round differently). Move it to the device with ``.to(device)``.

    Args:
        points: 1-D, ``M`` strictly increasing values in ``[-1, 1]`` (converted to fp64).
        weights: 1-D, ``M`` finite weights ``> 0`` (converted to fp64). Neither is checked
            beyond shape: ``gefen_core.codebook.optimal_quantizer`` validates its inputs.

    Raises:
        ValueError: ``points`` or ``weights`` not 1-D, or of different lengths.
    """
    x = _as_float64(points)
    w = _as_float64(weights)
    if x.ndim != 1 or w.ndim != 1:
        raise ValueError(f"points and weights must be 1-D, got shapes {list(x.shape)} and "
                         f"{list(w.shape)}")
    if x.size != w.size:
        raise ValueError(f"points and weights must have the same length, got {x.size} and "
                         f"{w.size}")
    out = np.zeros((3, x.size + 1))
    wx = w * x
    np.cumsum(w, out=out[0, 1:])
    np.cumsum(wx, out=out[1, 1:])
    np.cumsum(wx * x, out=out[2, 1:])
    return torch.from_numpy(out)


def _as_float64(values: Tensor | np.ndarray | Sequence[float]) -> np.ndarray:
    if isinstance(values, Tensor):
        return values.detach().to("cpu", torch.float64).numpy()
    return np.asarray(values, dtype=np.float64)


@on_tensor_device
def optimal_quantizer_dp_triton(prefix: Tensor, k: int, *,
                                _block: int | None = None) -> tuple[Tensor, Tensor]:
    """Exact optimal ``k``-level quantizer with forced endpoints -1 and +1, in one launch.

    ALGORITHM.md §1.8.3 for ``M >= k`` points: the codewords and cost of
    ``gefen_core.codebook.optimal_quantizer`` (the textbook recurrence's, tie choices
    included), computed on the device by one program (module docstring). Asynchronous: no
    host sync; the scratch (about ``4 k (M - k)`` bytes of argmins plus ``O(M)``) is allocated
    per call on ``prefix``'s device.

    Args:
        prefix: fp64 ``[3, M + 1]`` prefix sums ``W, S1, S2`` from :func:`quantizer_prefix`
            (column 0 zero, accumulated left to right; ``W`` strictly increasing, i.e. every
            weight positive), on a CUDA device (or the CPU under ``TRITON_INTERPRET=1``).
        k: number of codewords, ``2 <= k <= M`` (the caller handles fewer points, open choice
            O5).
        _block: lanes per pass (a power of two >= 32); tests only.

    Returns:
        ``(codewords, cost)`` on ``prefix``'s device: fp64 ``[k]``, ascending, ``-1`` first and
        ``+1`` last; fp64 ``[]``, the minimal total weighted squared error.

    Raises:
        ImportError: Triton is not installed.
        TypeError: ``prefix`` is not an fp64 tensor, or ``k`` is not an int.
        ValueError: ``prefix`` is not ``[3, M + 1]`` with ``M >= k``; ``k < 2``; a problem too
            large for int32 indices; a CPU tensor outside the interpreter.
    """
    if not isinstance(prefix, Tensor):
        raise TypeError(f"prefix must be a torch.Tensor, got {type(prefix).__name__}")
    if prefix.dtype != torch.float64:
        raise TypeError(f"prefix must be float64 (the fp64 prefix sums W, S1, S2), got "
                        f"{prefix.dtype}")
    if not isinstance(k, int) or isinstance(k, bool):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k < 2:
        raise ValueError(f"k must be >= 2 (the endpoints -1 and +1 are forced), got {k}")
    if prefix.dim() != 2 or prefix.shape[0] != 3 or prefix.shape[1] < 2:
        raise ValueError(f"prefix must have shape [3, M + 1] with M >= 1, got "
                         f"{list(prefix.shape)}")
    m = prefix.shape[1] - 1
    if m < k:
        raise ValueError(f"prefix holds M = {m} points, fewer than k = {k} codewords (handle "
                         "M < k on the host, open choice O5)")
    rows = m - k + 1
    if k * rows >= 2**31 or m + rows >= 2**30:
        raise ValueError(f"M = {m}, k = {k} is too large for the kernel's int32 indices")
    require_triton("the Triton quantizer DP")
    check_device_for_triton(prefix)
    block = _block if _block is not None else _default_block(m + rows + 1)
    if block < _SEG or block & (block - 1):
        raise ValueError(f"_block must be a power of two >= {_SEG}, got {block}")
    prefix = prefix.contiguous()
    dev = prefix.device
    i32, i64, f64 = torch.int32, torch.int64, torch.float64
    flat = m + rows + 1  # candidates of a level: at most M + R (windows share only ends)
    d = torch.empty(2, m + 1, dtype=f64, device=dev)
    args = torch.empty(k, rows, dtype=i32, device=dev)
    shift = torch.empty(rows, dtype=i32, device=dev)
    best = torch.empty(rows + 1, dtype=i64, device=dev)
    flags = torch.zeros(flat, dtype=i32, device=dev)
    ckey = torch.empty(flat, dtype=i64, device=dev)
    cpos = torch.empty(flat, dtype=i32, device=dev)
    ci = torch.empty(flat, dtype=i32, device=dev)
    codewords = torch.empty(k, dtype=f64, device=dev)
    cost = torch.empty((), dtype=f64, device=dev)
    nlev = rows.bit_length()  # levels of the divide and conquer; the first has h = 2**(nlev-1)
    # num_stages=1: no software pipelining, whose prefetches could cross the barriers.
    _quantizer_dp_kernel[(1,)](prefix, d, args, shift, best, flags, ckey, cpos, ci, codewords,
                               cost, m, k, rows, 1 << (nlev - 1), nlev, BLOCK=block, SEG=_SEG,
                               GROUPS=block // _SEG, num_warps=_NUM_WARPS, num_stages=1,
                               **LAUNCH_OPTIONS)
    return codewords, cost


def _default_block(candidates: int) -> int:
    """``_BLOCK`` lanes when compiled (fewer for small problems); in the interpreter one pass
    over the largest level (its cost is per operation, nearly independent of the width)."""
    need = max(_SEG, 1 << max(0, (candidates - 1).bit_length()))
    return need if interpret_mode() else min(_BLOCK, need)
