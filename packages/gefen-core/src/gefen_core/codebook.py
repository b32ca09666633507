"""The shared codebook: histogram bin centres and the exact optimal 256-level quantizer.

docs/algorithm.md#codebook, #histogram, #zero-codeword and #codebook-solver; open choices O4
(integer counts, fp64 sums) and O5 (fewer active bins than codewords); the cubic textbook
recurrence is too slow to run as written.

The problem
-----------
Points ``x_1 < ... < x_M`` (the active histogram bin centres, and the zero bin as the point
``0``) with weights ``w_j`` (the counts) are partitioned into ``K`` non-empty contiguous
segments. Segment 1 is represented by the fixed value ``-1``, segment ``K`` by ``+1``, one
segment in between (at a free position ``K_L``) by ``0``, and every other segment by its
weighted mean; the partition minimises the total weighted squared error. With fp64 prefix
sums ``W, S1, S2`` (accumulated left to right: ``W += w``, ``S1 += w*x``, ``S2 += (w*x)*x``)
and a segment ``[i..j]`` (``w = W(j) - W(i-1)``, likewise ``s1``, ``s2``) the segment costs
are::

    free:             s2 - s1*s1/w
    fixed centre f:   (s2 - 2f*s1) + f*f*w       (f = -1, 0 or +1)

and the textbook recurrence is ``D[k][j] = min_{i=k..j} D[k-1][i-1] + cost_k(i, j)``, scanning
``i`` upward and replacing only on strict improvement (ties keep the smallest ``i``), for each
``K_L`` (ties: the smallest). The zero point is always there (weight 0 without exact zeros:
a free segment holding only it has no mean and is never chosen).

The solve
---------
Split at 0 (:func:`solve_forced_zero`): no free segment of an optimal partition holds points
of both signs, so the points ``<= 0`` with the forced ends ``-1`` and ``0`` and the points
``>= 0`` with ``0`` and ``+1`` are two problems of the same kind as the codebook before the
zero codeword (two fixed end centres): :class:`gefen_core._layered_dp._LayeredDP` solves each,
for every number of segments in a window of ``K_L``, in one pass over its layers. Each side's
optimal cost is convex in its number of segments, so the window stops growing once both of its
ends cost more than its best split. :func:`optimal_quantizer_endpoints` is the problem before
the zero codeword (the two endpoints forced), kept as the building block and as the reference
of ``gefen_kernels.ops.quantizer_dp``.

Cost: for ``M = 4096`` about the endpoint problem's (40 ms on a 2-core CPU);
``gefen-bench codebook`` prints the measured time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ._layered_dp import _LayeredDP

__all__ = [
    "HISTOGRAM_BINS",
    "NUM_CODEWORDS",
    "histogram_bin_centers",
    "optimal_codebook",
    "optimal_quantizer",
    "optimal_quantizer_endpoints",
    "remap_codes",
    "solve_forced_zero",
]

#: Codebook size K.
NUM_CODEWORDS = 256
#: Histogram bins over [-1, 1] (docs/algorithm.md#histogram); the zero bin comes after them.
HISTOGRAM_BINS = 4096

ArrayLike = Tensor | np.ndarray | Sequence[float]

# The forced-zero solve: the first window of K_L either side of its estimate, and how far
# below it the sides' rows reach before a wider window needs them rebuilt.
_WINDOW_K = 6
_REACH = 16


def histogram_bin_centers() -> Tensor:
    """Centres of the 4096 histogram bins over ``[-1, 1]``; fp32 ``[4096]``, on the CPU.

    Edges are 4097 fp32 points evenly spaced from -1 to 1 and each centre is the fp32 mean of
    its two edges (docs/algorithm.md#histogram), so centre ``b`` is exactly ``(2b - 4095) / 4096``.
    """
    edges = torch.linspace(-1.0, 1.0, HISTOGRAM_BINS + 1, dtype=torch.float32)
    return (edges[:-1] + edges[1:]) / 2


def _as_float64(name: str, values: ArrayLike) -> np.ndarray:
    if isinstance(values, Tensor):
        if values.is_complex():
            raise TypeError(f"{name} must be real, got {values.dtype}")
        values = values.detach().to("cpu", torch.float64).numpy()
    arr = np.asarray(values)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be real numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {list(arr.shape)}")
    return arr


def _check_points(points: ArrayLike, weights: ArrayLike, k: int,
                  k_min: int) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(k, int) or isinstance(k, bool):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k < k_min:
        raise ValueError(f"k must be >= {k_min} (the forced codewords take {k_min}), got {k}")
    x = _as_float64("points", points)
    w = _as_float64("weights", weights)
    if x.shape != w.shape:
        raise ValueError(f"points and weights must have the same length, got {x.size} and "
                         f"{w.size}")
    if x.size == 0:
        raise ValueError("points is empty: at least one point with positive weight is needed")
    if not np.isfinite(x).all() or x[0] < -1.0 or x[-1] > 1.0:
        raise ValueError("points must be finite and inside [-1, 1]")
    if x.size > 1 and not (np.diff(x) > 0).all():
        raise ValueError("points must be strictly increasing (merge duplicates, summing their "
                         "weights)")
    if not np.isfinite(w).all() or not (w > 0).all():
        raise ValueError("weights must be finite and > 0 (drop points with zero weight)")
    return x, w


def optimal_quantizer(points: ArrayLike, weights: ArrayLike,
                      k: int = NUM_CODEWORDS) -> tuple[Tensor, float]:
    """Exact optimal ``k``-level 1-D quantizer with the forced codewords ``-1``, ``0``, ``+1``.

    docs/algorithm.md#codebook-solver and #zero-codeword. The problem is the textbook
    recurrence over all ``k`` codewords with three fixed centres: ``-1`` for the first
    segment, ``+1`` for the last, and ``0`` for one segment in between, whose position is free
    (ties: the smallest position); the others are weighted means. A point exactly at ``0`` is
    the histogram's zero bin; with none, the problem keeps a zero point of weight 0 (so the
    zero codeword may take no point). It is solved exactly by splitting at 0
    (:func:`solve_forced_zero`): the points ``<= 0`` with the forced ends ``-1`` and ``0``,
    the points ``>= 0`` with ``0`` and ``+1``, both for every number of codewords, then the
    split of the ``k`` codewords with the smallest total (the zero codeword shared).

    With too few points (``M_neg + M_pos + 3 <= k + 1`` for the points below and above 0) no
    point is dropped (open choice O5): the codebook is ``-1``, ``0``, ``+1`` and every point,
    padded to ``k`` entries with copies of the largest value below ``+1``; where that is one
    entry too many, the cheapest single reduction: the first point to ``-1``, the last to
    ``+1``, the point nearest 0 on either side to ``0``, or an adjacent pair of the same sign
    merged into its weighted mean (ties in that order, then the leftmost pair).

    Args:
        points: 1-D, ``M >= 1`` strictly increasing finite values in ``[-1, 1]`` (tensor, array
            or sequence; converted to fp64).
        weights: 1-D, ``M`` finite weights ``> 0`` (e.g. int64 histogram counts; exact in fp64
            up to ``2**53``).
        k: number of codewords, ``>= 3`` (default 256).

    Returns:
        ``(codewords, cost)``: fp64 tensor ``[k]`` sorted ascending, holding ``-1``, ``0`` and
        ``+1`` exactly (strictly increasing unless padded), and the minimal total weighted
        squared error as a Python float (the two sides' costs added; the textbook's sum
        accumulates the same segment costs in another order, so the two agree to rounding).

    Raises:
        TypeError: non-numeric inputs or a non-int ``k``.
        ValueError: shapes differ, ``M = 0``, points not strictly increasing, outside
            ``[-1, 1]`` or non-finite, weights not finite and positive, or ``k < 3``.
    """
    x, w = _check_points(points, weights, k, 3)
    codewords, cost = solve_forced_zero(x, w, k)
    return torch.from_numpy(codewords), cost


def optimal_quantizer_endpoints(points: ArrayLike, weights: ArrayLike,
                                k: int = NUM_CODEWORDS) -> tuple[Tensor, float]:
    """Exact optimal ``k``-level 1-D quantizer with only the endpoints ``-1`` and ``+1`` forced.

    The codebook rule before the zero codeword (docs/algorithm.md#codebook-solver): the
    building block of :func:`optimal_quantizer`, and the problem that
    ``gefen_kernels.ops.quantizer_dp`` solves on a GPU. With ``M >= k`` points the result is
    the optimum of the textbook recurrence, with its tie choices (see the module docstring for
    how it is computed without its ``O(k * M**2)`` cost). With fewer points than codewords
    (open choice O5) no point is dropped: ``M <= k - 2`` (or the points already contain
    ``-1``/``+1`` and the union fits) gives ``-1``, every point, ``+1``, padded to ``k`` entries
    with copies of the largest point below ``+1`` (or ``-1``); one entry too many takes the
    cheapest of the first point to ``-1``, the last to ``+1``, or merging one adjacent pair
    (ties in that order, then the leftmost pair).

    Args, Raises: as :func:`optimal_quantizer`, with ``k >= 2``.

    Returns:
        ``(codewords, cost)``: fp64 tensor ``[k]`` sorted ascending with ``codewords[0] = -1``
        and ``codewords[-1] = +1`` (strictly increasing when ``M >= k``), and the minimal total
        weighted squared error as a Python float.
    """
    x, w = _check_points(points, weights, k, 2)
    if x.size >= k:
        codewords, cost = _LayeredDP(x, w, k).solve()
    else:
        codewords, cost = _few_points(x, w, k)
    return torch.from_numpy(codewords), cost


def optimal_codebook(counts: Tensor, device: torch.device | str | None = None) -> Tensor:
    """The Gefen codebook learned from a histogram; fp32 ``[256]``.

    docs/algorithm.md#codebook and #histogram: the active bins (``count > 0``) give the points
    (their fp32 centres, :func:`histogram_bin_centers`) and weights (the counts, kept as
    integers until the fp64 prefix sums, open choice O4); the zero bin (index 4096, elements
    whose normalised value is exactly 0) is the point ``0``. :func:`optimal_quantizer` with
    ``k = 256`` solves it (the codewords ``-1``, ``0``, ``+1`` forced,
    docs/algorithm.md#zero-codeword) and the fp64 codewords are rounded to fp32. With enough
    active bins the result is strictly increasing (segment means are at least one bin width,
    ``2**-11``, apart, and 0 is half a bin from the nearest centre).

    The solve runs on the host (numpy, 30-50 ms for 4096 active bins on a 2-core CPU,
    ``gefen-bench codebook``); ``device`` only says where the codebook is returned.

    Args:
        counts: integer tensor ``[4097]`` (int64 as produced by ``gefen_kernels.histogram``:
            4096 bins, then the zero bin) or ``[4096]`` (a histogram without the zero bin, as
            before it existed), any device, non-negative, not all zero.
        device: where the codebook is returned (default: the CPU).

    Raises:
        TypeError: ``counts`` is not an integer tensor.
        ValueError: wrong shape, a negative count, or no count at all.
    """
    if not isinstance(counts, Tensor):
        raise TypeError(f"counts must be a torch.Tensor, got {type(counts).__name__}")
    if counts.dtype.is_floating_point or counts.is_complex() or counts.dtype == torch.bool:
        raise TypeError(f"counts must be an integer tensor (int64 histogram counts), got "
                        f"{counts.dtype}")
    if tuple(counts.shape) not in ((HISTOGRAM_BINS + 1,), (HISTOGRAM_BINS,)):
        raise ValueError(f"counts must have shape [{HISTOGRAM_BINS + 1}] (the bins and the zero "
                         f"bin) or [{HISTOGRAM_BINS}], got {list(counts.shape)}")
    c = counts.detach().to("cpu", torch.int64).numpy()
    if (c < 0).any():
        raise ValueError("counts must be non-negative")
    if not c.any():
        raise ValueError("counts are all zero: no gradient was binned, nothing to learn")
    bins = c[:HISTOGRAM_BINS]
    zero = int(c[HISTOGRAM_BINS]) if c.size > HISTOGRAM_BINS else 0
    active = np.flatnonzero(bins)
    centers = histogram_bin_centers().numpy().astype(np.float64)
    x, w = centers[active], bins[active].astype(np.float64)
    if zero:
        at = int(np.searchsorted(x, 0.0))  # no bin centre is 0: the zero bin slots in
        x, w = np.insert(x, at, 0.0), np.insert(w, at, float(zero))
    codewords, _ = optimal_quantizer(x, w, NUM_CODEWORDS)
    return codewords.to(device=device or "cpu", dtype=torch.float32)


def solve_forced_zero(x: np.ndarray, w: np.ndarray, k: int,
                       stats: dict[str, Any] | None = None) -> tuple[np.ndarray, float]:
    """:func:`optimal_quantizer`'s solve (checked inputs): the split at 0.

    The points are ``N`` (below 0), the zero point ``Z`` (weight ``w0``, 0 when absent) and
    ``P`` (above 0), with fp64 prefix sums over ``N, Z, P`` accumulated left to right as the
    textbook does. The left side is ``N, Z`` with the forced ends ``-1`` and ``0`` and ``K_L``
    segments, the right side ``Z, P`` with ``0`` and ``+1`` and ``K_R = k + 1 - K_L``; ``Z``
    is the last point of the left and the first of the right, always in the zero codeword's
    segment, so the zero segment is never empty on either side and costs ``Z`` nothing. Every
    segment cost is the textbook's expression on these prefix sums. In an optimal solution no
    free segment holds points of both signs (a free centroid ``c > 0`` next to the zero codeword
    only takes points above ``c / 2``), so the best split is the optimum.

    Each side's optimal cost is convex in its number of segments (the segment costs, the fixed
    first and last ones included, satisfy the quadrangle inequality, and minimum ``K``-link
    paths over such costs are convex in ``K``), so the total over ``K_L`` is convex. The sides
    run their layers only up to a window of ``K_L`` around a cube-root-density estimate, which
    grows until its two ends cost more than its minimum (both by more than a 1e-9 relative
    margin, well above the rounding of the sums): then no ``K_L`` outside it can be as good.
    Ties: the smallest ``K_L``, then each side's textbook choices. ``stats`` (diagnostics,
    ``gefen-bench codebook``) receives the chosen ``K_L``, the final window, the rows the sides
    computed and the rows of the layers they ran, and the bound over the optimum.
    """
    neg, pos = x < 0.0, x > 0.0
    at_zero = np.flatnonzero(x == 0.0)
    w0 = float(w[at_zero[0]]) if at_zero.size else 0.0
    n, p = int(neg.sum()), int(pos.sum())
    if n + p + 3 <= k + 1:
        return _few_points_forced(x[neg], w[neg], x[pos], w[pos], w0, k)
    xs = np.concatenate([x[neg], [0.0], x[pos]])
    ws = np.concatenate([w[neg], [w0], w[pos]])
    prefix = np.zeros((3, xs.size + 1))
    wx = ws * xs
    np.cumsum(ws, out=prefix[0, 1:])
    np.cumsum(wx, out=prefix[1, 1:])
    np.cumsum(wx * xs, out=prefix[2, 1:])

    def side(left: bool, kk: int, k_lo: int, k_max: int) -> _LayeredDP:
        if left:
            return _LayeredDP(xs[:n + 1], ws[:n + 1], kk, first=-1.0, last=0.0, k_lo=k_lo,
                              k_max=k_max, prefix=prefix[:, :n + 2])
        return _LayeredDP(xs[n:], ws[n:], kk, first=0.0, last=1.0, k_lo=k_lo, k_max=k_max,
                          prefix=prefix[:, n:])

    if n == 0 or p == 0:
        # One side has no point but the zero point: its forced end codeword takes none
        # (k_side = 2, cost 0) and the other side gets k - 1 codewords.
        dp = side(n > 0, k - 1, k - 1, k - 1)
        codewords, cost = dp.solve()
        if n == 0:
            return np.concatenate([[-1.0], codewords]), cost
        return np.concatenate([codewords, [1.0]]), cost

    lo_f, hi_f = max(2, k - p), min(n + 1, k - 1)
    cn, cp = float(np.cbrt(w[neg]).sum()), float(np.cbrt(w[pos]).sum())
    guess = min(max(2 + round((k - 3) * cn / (cn + cp)), lo_f), hi_f)
    reach = _REACH  # the K_L range the sides' rows cover before a rebuild
    right = side(False, k + 1 - guess, max(k + 1 - hi_f, k + 1 - guess - reach), k + 1 - lo_f)
    bound = side(True, guess, guess, guess)._upper_bound() + right._upper_bound()
    right.begin(bound)
    left: _LayeredDP | None = None
    left_lo, left_floor = max(lo_f, guess - reach), np.inf
    step = _WINDOW_K
    lo, hi = max(lo_f, guess - step), min(hi_f, guess + step)
    while True:
        right.advance(k + 1 - lo)
        # The left part of the optimum costs at most bound - F_R(K_R*), and F_R(K_R*) is at
        # least the right side's least cost in the window (where the optimum is certified to
        # be); a right cost above the bound is only known to exceed it. The right side runs
        # first so that the left side drops its rows against this tighter bound.
        floor = min(min(right.closing(k + 1 - kl) for kl in range(lo, hi + 1)), bound)
        if left is None or lo < left.k_lo or floor < left_floor:
            if lo < left_lo:
                left_lo = lo_f
            left, left_floor = side(True, guess, left_lo, hi_f), floor
            left.begin(bound - floor * (1.0 - 1e-9))
        left.advance(hi)
        totals = np.array([left.closing(kl) + right.closing(k + 1 - kl)
                           for kl in range(lo, hi + 1)])
        at = int(np.argmin(totals))  # first occurrence: ties keep the smallest K_L
        best = float(totals[at])
        margin = best + 1e-9 * abs(best)
        grow_lo = lo > lo_f and not totals[0] > margin
        grow_hi = hi < hi_f and not totals[-1] > margin
        if not (grow_lo or grow_hi):
            break
        step *= 2
        if grow_lo:
            lo = max(lo_f, lo - step)
        if grow_hi:
            hi = min(hi_f, hi + step)
            if k + 1 - hi < right.k_lo:
                right = side(False, k + 1 - guess, k + 1 - hi_f, k + 1 - lo_f)
                right.begin(bound)
    k_left = lo + at
    c_left, cost_left = left.backtrack(k_left)
    c_right, cost_right = right.backtrack(k + 1 - k_left)
    if stats is not None:
        sides = (left, right)
        stats.update(
            k_left=k_left, window=(lo, hi), bound_over_optimum=bound / best,
            rows_computed=sum(sum(d.rows_computed) for d in sides),
            rows_of_layers=sum(sum(min(d.rows, d.m - j) for j in range(2, d.layer + 1))
                               for d in sides))
    return np.concatenate([c_left, c_right[1:]]), cost_left + cost_right


def _few_points_forced(xn: np.ndarray, wn: np.ndarray, xp: np.ndarray, wp: np.ndarray,
                       w0: float, k: int) -> tuple[np.ndarray, float]:
    """O5 with the forced ``-1``, ``0``, ``+1``: keep every point (:func:`optimal_quantizer`)."""
    inner_n, inner_p = xn[xn > -1.0], xp[xp < 1.0]
    if inner_n.size + inner_p.size + 3 <= k:
        pad_value = inner_p[-1] if inner_p.size else 0.0
        out = np.concatenate([[-1.0], inner_n, [0.0], inner_p,
                              np.full(k - 3 - inner_n.size - inner_p.size, pad_value), [1.0]])
        return np.sort(out, kind="stable"), 0.0
    # One value too many (no point at -1 or +1): the cheapest single reduction.
    options: list[tuple[float, np.ndarray]] = []
    x = np.concatenate([xn, xp])
    w = np.concatenate([wn, wp])
    if xn.size:
        options.append((w[0] * (x[0] + 1.0) ** 2, np.delete(x, 0)))
    if xp.size:
        options.append((w[-1] * (x[-1] - 1.0) ** 2, np.delete(x, x.size - 1)))
    if xn.size:
        options.append((wn[-1] * xn[-1] ** 2, np.delete(x, xn.size - 1)))
    if xp.size:
        options.append((wp[0] * xp[0] ** 2, np.delete(x, xn.size)))
    for xs, ws, first in ((xn, wn, 0), (xp, wp, xn.size)):
        if xs.size > 1:
            wl, wr = ws[:-1], ws[1:]
            merge = wl * wr / (wl + wr) * (xs[1:] - xs[:-1]) ** 2
            j = int(np.argmin(merge))
            mean = (wl[j] * xs[j] + wr[j] * xs[j + 1]) / (wl[j] + wr[j])
            merged = np.concatenate([x[:first + j], [mean], x[first + j + 2:]])
            options.append((float(merge[j]), merged))
    cost, kept = min(options, key=lambda o: o[0])  # first of equal costs: the order above
    out = np.sort(np.concatenate([[-1.0, 0.0, 1.0], kept]), kind="stable")
    return out, float(cost)


def _few_points(x: np.ndarray, w: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """O5: fewer points than codewords; keep every point, insert the endpoints."""
    inner = x[(x > -1.0) & (x < 1.0)]
    if inner.size + 2 <= k:
        pad_value = inner[-1] if inner.size else -1.0
        out = np.concatenate([[-1.0], inner, np.full(k - 2 - inner.size, pad_value), [1.0]])
        return np.sort(out, kind="stable"), 0.0
    # inner.size == k - 1 == M: neither endpoint is a point; one reduction is needed.
    first = w[0] * (x[0] + 1.0) ** 2
    last = w[-1] * (x[-1] - 1.0) ** 2
    wl, wr = w[:-1], w[1:]
    merge = wl * wr / (wl + wr) * (x[1:] - x[:-1]) ** 2
    best = int(np.argmin(merge))
    options = [first, last, float(merge[best])]
    choice = int(np.argmin(options))
    if choice == 0:
        out = np.concatenate([[-1.0], x[1:], [1.0]])
    elif choice == 1:
        out = np.concatenate([[-1.0], x[:-1], [1.0]])
    else:
        mean = (wl[best] * x[best] + wr[best] * x[best + 1]) / (wl[best] + wr[best])
        out = np.concatenate([[-1.0], x[:best], [mean], x[best + 2:], [1.0]])
    return out, float(options[choice])


# Codes re-mapped at once on a codebook refresh: 2**23 elements (docs/algorithm.md#step).
_REMAP_CHUNK = 1 << 23


def remap_codes(codes: Tensor, old: Tensor, new: Tensor) -> Tensor:
    """Momentum codes re-quantised from codebook ``old`` to codebook ``new`` (a codebook
    refresh, docs/algorithm.md#step): each code's value ``old[q]`` rounded to the nearest
    codeword of ``new``, in chunks of 2**23 codes (bounded scratch).

    Args:
        codes: uint8 codes, any shape, on any device.
        old, new: fp32 ``[256]`` codebooks (moved to ``codes``' device).

    Returns:
        uint8 codes of ``codes``' shape and device (a new tensor).
    """
    from gefen_kernels.ops import quantize_nearest_reference

    flat = codes.reshape(-1)
    out = torch.empty_like(flat)
    old_d, new_d = old.to(codes.device), new.to(codes.device)
    for start in range(0, flat.numel(), _REMAP_CHUNK):
        chunk = flat[start:start + _REMAP_CHUNK]
        out[start:start + _REMAP_CHUNK] = quantize_nearest_reference(old_d[chunk.long()], new_d)
    return out.view_as(codes)
