"""The shared codebook: histogram bin centres and the exact optimal 256-level quantizer.

Math: docs/algorithm.md#histogram and docs/algorithm.md#codebook-solver; decisions O4 (integer
counts, fp64 sums) and O5 (fewer active bins than codewords) in docs/decisions.md. The cubic
textbook recurrence is too slow for a first step, hence the solver below.

The problem
-----------
Points ``x_1 < ... < x_M`` (the active histogram bin centres) with weights ``w_j > 0`` (the
counts) are partitioned into ``K`` non-empty contiguous segments. Segment 1 is represented by
the fixed value ``-1``, segment ``K`` by ``+1`` and every other segment by its weighted mean;
the partition minimises the total weighted squared error. With fp64 prefix sums
``W, S1, S2`` (accumulated left to right: ``W += w``, ``S1 += w*x``, ``S2 += (w*x)*x``) and a
segment ``[i..j]`` (``w = W(j) - W(i-1)``, likewise ``s1``, ``s2``) the segment costs are::

    free:             s2 - s1*s1/w
    fixed centre f:   (s2 - 2f*s1) + f*f*w       (f = -1 or +1)

and the textbook recurrence is ``D[k][j] = min_{i=k..j} D[k-1][i-1] + cost_k(i, j)``, scanning
``i`` upward and replacing only on strict improvement (ties keep the smallest ``i``).

How this module solves it (exact, numpy only)
---------------------------------------------
Every candidate value is computed with exactly the expressions above, in the same order, so
each value this solver looks at is bit-identical to the textbook's; within a row candidates are
merged left to right replacing only on strict improvement, as the textbook scans. What changes
is which candidates are looked at. Write ``a_k(j)`` for the textbook's choice (the *leftmost*
minimiser of row ``j`` of layer ``k``). Two facts of the exact arithmetic are used:

1. Row monotonicity, ``a_k(j) <= a_k(j + 1)``. For a fixed layer the matrix
   ``A[j][i] = D[k-1][i-1] + cost(i, j)`` is Monge: the free 1-D k-means cost satisfies the
   quadrangle inequality ``c(i, j) + c(i', j') <= c(i, j') + c(i', j)`` for ``i <= i' <= j <= j'``
   (the weighted variance of a union of overlapping intervals), and the fixed-centre cost is a
   difference of prefix sums (additive), so it satisfies it with equality. If the leftmost
   minimiser of row ``j + 1`` were ``i < a_k(j) = i'``, the inequality
   ``A[j][i] + A[j+1][i'] <= A[j][i'] + A[j+1][i]`` with ``A[j][i] > A[j][i']`` (``i`` is left
   of the leftmost minimiser of row ``j``) would give ``A[j+1][i'] < A[j+1][i]``, a
   contradiction.
2. Layer monotonicity, ``a_{k-1}(j) <= a_k(j)`` for ``3 <= k <= K - 1``: a path-exchange argument
   shows ``D_{k-2}(j) - D_{k-1}(j)`` is non-decreasing in ``j`` (the first, fixed-centre segment
   takes part in the exchange through ``fixed(0, c) + free(b, d) <= fixed(0, d) + free(b, c)``
   for ``b < c < d``, true because ``-1`` is left of every point in ``[-1, 1]``), and a leftmost
   argmin that moved left would contradict it. (Knuth's bound for optimal partitions.)

``tests/test_codebook.py`` checks both facts on the textbook's own argmin tables.

Certified windows. Let row ``j`` of layer ``k`` be scanned over a window ``[lo(j), hi(j)]`` with
``lo(j) <= a_k(j)`` known (``lo = a_{k-1}(j)``, fact 2; the bottom row has a single candidate),
and let ``b(j)`` be the window's leftmost minimiser. If the top row's window reaches ``j`` and
every other row has ``hi(j) >= b(j + 1)`` or ``hi(j) = j``, then ``b = a`` on every row. Proof,
from the top row down: the top row's window holds every candidate right of ``lo``, so
``b = a`` there. If ``b(j + 1) = a(j + 1)`` then ``a(j) <= a(j + 1) <= hi(j)`` (fact 1) and
``a(j) >= lo(j)``, so ``a(j)`` lies in the window; the window's minimum is then the row's
minimum, and a window position left of ``a(j)`` holding it would contradict ``a(j)`` being the
leftmost minimiser, so ``b(j) = a(j)``. The window's minimum value is the textbook's
``D[k][j]`` bit for bit.

Layers ``k >= _WINDOW_FROM`` scan, for every row, the window ``[lo(j), lo(j) + W - 1]``
(``W = _DENSE_WIDTH``) in one ``[W, R]`` pass. The free-segment costs ``s2 - s1*s1/w`` of that
window do not depend on the layer, and ``lo(j) = a_{k-1}(j)`` is the same as in the previous
layer for most rows (about 97% late in the recurrence), so they are kept per row ``j`` and
recomputed only where ``lo(j)`` moved; a window position past ``j`` holds ``+inf``. A layer then
costs one gather of ``D[k-1]``, one addition and the leftmost-minimum reduction over ``W``
columns. The top row (``hi = j`` by definition) is scanned in full.
Failing rows are widened to ``b(j + 1)`` (and the ``_REPAIR_SPAN`` rows just below them, whose
bound it also is) scanning only the new candidates and replacing on strict improvement (new
candidates lie to the right, so ties still keep the smallest ``i``), until no row fails.
Windows only grow, so this terminates; at the end the condition holds, so the result is the
textbook's. Early layers (``k < _WINDOW_FROM``), whose lower bounds from fact 2 are far from the
argmins, use a level-synchronous divide and conquer over rows instead (fact 1 plus the same
lower bound): rows sit on a binary tree by position, and each level scans the rows halfway
between two solved ones (strided slices) in one pass. Scans of many short windows use a dense
``[width, rows]`` layout (columns past a row's end repeat its last candidate, which never
replaces under strict improvement); scans with long windows a flat ragged layout. The last layer
is a single row (``j = M``), scanned in full. Backtracking follows the stored argmins, as the
textbook does.

Dropping rows that cannot be on the optimal path. Three more facts of the exact arithmetic:
``D[k][j] <= D[k][j + 1]`` (one more point never lowers the optimal cost),
``D[k][j] <= D[k-1][j]`` (splitting a segment never raises it) and, since every segment cost
is non-negative, ``D[k][j_k] <= OPT`` on the rows ``j_k`` of the optimal path. The cost ``U``
of any feasible partition is at least ``OPT``: :meth:`_LayeredDP._upper_bound` takes a few
Lloyd iterations from a cube-root-density start (0.6% above the optimum on the benchmark
histogram), computes its cost with the recurrence's expressions and adds a rounding slack
(computed segment costs can round below zero, so the computed ``D`` along the path can exceed
the computed optimum by the rounding of the later segments). The rows of a layer with
``D[k][j] > U`` are then a suffix, and none is on the optimal path: each layer keeps its rows up
to the last one with ``D[k][j] <= U`` (``jmax(k)``) and sets ``D[k]`` to ``+inf`` past it. A
kept row's dropped candidates have ``D[k-1][i-1] > U`` while its minimum is at most ``U``, so
its minimum and leftmost minimiser are the textbook's; dropping a suffix of columns keeps every
layer matrix Monge (fact 1 and the certificate hold unchanged). Layer ``k`` computes rows up to
``jmax(k-1) + E`` (``E`` follows how fast the kept rows grew; a layer whose last computed row is
still kept is redone wider, since ``jmax(k) >= jmax(k-1)``). Its rows past ``jmax(k-1)`` have no
row of layer ``k - 1`` to bound them; their argmins are at least ``a_{k-1}(jmax(k-1))`` (fact 1
within layer ``k``, then fact 2 at the kept row ``jmax(k-1)``), and they are scanned in full from
there to the last kept column: exact, they certify the windowed rows below them as the top row
does. On the benchmark histogram this drops 41% of all rows and 66-89% of layers 2-21's
(``gefen-bench codebook`` prints these, and the bound's distance to the optimum).

Floating point: facts 1 and 2 are statements about exact arithmetic; the computed values carry
rounding, so the two can only disagree where distinct candidates are equal up to rounding (a
near-tie decided by the last bit), and then the optimum differs from the textbook's by rounding
only. Exact ties (equal fp64 values) resolve to the smallest ``i`` on both.
``tests/test_codebook.py`` checks codebook, cost and tie choices against the textbook recurrence.

Cost: for ``M = 4096``, ``K = 256`` about 4 candidates per row and layer after the first 22,
on 59% of the textbook's rows (about 2.6 million candidate evaluations in all, against the
textbook's 2e9), most of them with cached segment costs; ``gefen-bench codebook`` prints the
measured time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "HISTOGRAM_BINS",
    "NUM_CODEWORDS",
    "histogram_bin_centers",
    "optimal_codebook",
    "optimal_quantizer",
]

#: Codebook size K.
NUM_CODEWORDS = 256
#: Histogram bins over [-1, 1] (docs/algorithm.md#histogram).
HISTOGRAM_BINS = 4096

ArrayLike = Tensor | np.ndarray | Sequence[float]

# Layers k >= _WINDOW_FROM use windows; earlier ones divide and conquer (their proven lower
# bounds are far from the argmins). Only speed depends on these constants.
_WINDOW_FROM = 24
# Candidates per row of a window layer's dense pass (the cached segment costs).
_DENSE_WIDTH = 4
# A failing row also widens this many rows (itself included) ending just below it.
_REPAIR_SPAN = 8
# Scans whose longest window has at most this many candidates use the dense layout.
_DENSE_SCAN_MAX = 8
_UB_ITERATIONS = 2
_PRUNE_EXTEND = 32


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


def optimal_quantizer(points: ArrayLike, weights: ArrayLike,
                      k: int = NUM_CODEWORDS) -> tuple[Tensor, float]:
    """Exact optimal ``k``-level 1-D quantizer with forced endpoints ``-1`` and ``+1``.

    docs/algorithm.md#codebook-solver. With ``M >= k`` points the result is the optimum of the
    textbook recurrence, with its tie choices (see the module docstring for how it is computed
    without its ``O(k * M**2)`` cost). With fewer points than codewords (open choice O5,
    recommendation taken) no point is dropped:

    * ``M <= k - 2`` (or the points already contain ``-1``/``+1`` and the union fits): the
      codebook is ``-1``, every point, ``+1``, padded to ``k`` entries with copies of the largest
      point below ``+1`` (or ``-1`` when there is none); cost 0. Duplicates only occur here.
    * one entry too many (``M = k - 1`` points, neither endpoint among them): the cheapest of
      assigning the first point to ``-1``, assigning the last point to ``+1``, or merging one
      adjacent pair into its weighted mean (ties in that order, then the leftmost pair).

    Args:
        points: 1-D, ``M >= 1`` strictly increasing finite values in ``[-1, 1]`` (tensor, array
            or sequence; converted to fp64).
        weights: 1-D, ``M`` finite weights ``> 0`` (e.g. int64 histogram counts; exact in fp64
            up to ``2**53``).
        k: number of codewords, ``>= 2`` (default 256).

    Returns:
        ``(codewords, cost)``: fp64 tensor ``[k]`` sorted ascending with ``codewords[0] = -1``
        and ``codewords[-1] = +1`` (strictly increasing when ``M >= k``), and the minimal total
        weighted squared error as a Python float.

    Raises:
        TypeError: non-numeric inputs or a non-int ``k``.
        ValueError: shapes differ, ``M = 0``, points not strictly increasing, outside
            ``[-1, 1]`` or non-finite, weights not finite and positive, or ``k < 2``.
    """
    if not isinstance(k, int) or isinstance(k, bool):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k < 2:
        raise ValueError(f"k must be >= 2 (the endpoints -1 and +1 are forced), got {k}")
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
    if x.size >= k:
        codewords, cost = _LayeredDP(x, w, k).solve()
    else:
        codewords, cost = _few_points(x, w, k)
    return torch.from_numpy(codewords), cost


def optimal_codebook(counts: Tensor, device: torch.device | str | None = None) -> Tensor:
    """The Gefen codebook learned from a 4096-bin histogram; fp32 ``[256]``.

    docs/algorithm.md#histogram, docs/algorithm.md#codebook-solver: the active bins (``count > 0``)
    give the points (their fp32 centres, :func:`histogram_bin_centers`) and weights (the counts,
    kept as integers until the fp64 prefix sums, open choice O4); :func:`optimal_quantizer` with ``k
    = 256`` solves it and the fp64 codewords are rounded to fp32. With ``M >= 256`` active bins the
    result is strictly increasing (segment means are at least one bin width, ``2**-11``, apart),
    ``c[0] = -1`` and ``c[255] = +1``; with fewer, see :func:`optimal_quantizer` (open choice O5).

    On a CUDA ``device`` with Triton (and ``M >= 256``) the same recurrence runs there, one
    launch per layer (``gefen_kernels.ops.quantizer_dp``): the same codewords bit for bit,
    without the numpy solver's 40-110 ms of host time, and the codebook is returned before the
    solve completes (the counts are still read to the host, and the prefix sums accumulated
    there in the textbook's order).

    Args:
        counts: integer tensor ``[4096]`` (int64 as produced by ``gefen_kernels.histogram``),
            any device, non-negative, not all zero.
        device: where the codebook is returned (default: the CPU); a CUDA device also solves
            there.

    Raises:
        TypeError: ``counts`` is not an integer tensor.
        ValueError: wrong shape, a negative count, or no count at all.
    """
    if not isinstance(counts, Tensor):
        raise TypeError(f"counts must be a torch.Tensor, got {type(counts).__name__}")
    if counts.dtype.is_floating_point or counts.is_complex() or counts.dtype == torch.bool:
        raise TypeError(f"counts must be an integer tensor (int64 histogram counts), got "
                        f"{counts.dtype}")
    if tuple(counts.shape) != (HISTOGRAM_BINS,):
        raise ValueError(f"counts must have shape [{HISTOGRAM_BINS}], got "
                         f"{list(counts.shape)}")
    c = counts.detach().to("cpu", torch.int64).numpy()
    if (c < 0).any():
        raise ValueError("counts must be non-negative")
    active = np.flatnonzero(c)
    if active.size == 0:
        raise ValueError("counts are all zero: no gradient was binned, nothing to learn")
    centers = histogram_bin_centers().numpy().astype(np.float64)
    x, w = centers[active], c[active].astype(np.float64)
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and x.size >= NUM_CODEWORDS:
        import gefen_kernels

        if gefen_kernels.triton_available():
            from gefen_kernels.ops.quantizer_dp import (
                optimal_quantizer_dp_triton,
                quantizer_prefix,
            )

            prefix = quantizer_prefix(x, w).pin_memory().to(device, non_blocking=True)
            codewords_dev, _ = optimal_quantizer_dp_triton(prefix, NUM_CODEWORDS)
            return codewords_dev.to(torch.float32)
    codewords, _ = optimal_quantizer(x, w, NUM_CODEWORDS)
    return codewords.to(device=device or "cpu", dtype=torch.float32)


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


class _LayeredDP:
    """The layered recurrence of docs/algorithm.md#codebook-solver with certified monotone-argmin
    windows (module docstring).

    Indices: points are ``1..M``; prefix arrays have ``M + 1`` entries (index ``r`` = the first
    ``r`` points) plus ``W`` entries of padding for windows that run past ``j``. Layer ``k`` has
    rows ``j = k .. k + R - 1`` with ``R = M - K + 1`` (the other rows cannot lead to a
    ``K``-segment partition); row offset ``r = j - k``. ``D`` values and cached costs are indexed
    by ``j``; argmins are stored per layer by row offset.
    """

    def __init__(self, x: np.ndarray, w: np.ndarray, k: int) -> None:
        m = x.size
        self.m, self.k, self.rows = m, k, m - k + 1
        self.x, self.w = x, w
        self.width = width = max(1, _DENSE_WIDTH)
        wx = w * x
        # Rows: W, S1, S2 (left-to-right accumulation, as the textbook's) and two D buffers
        # (D[k-1] read, D[k] written). The zero padding keeps reads past j finite.
        self.tab = np.zeros((5, m + 1 + width))
        np.cumsum(w, out=self.tab[0, 1:m + 1])
        np.cumsum(wx, out=self.tab[1, 1:m + 1])
        np.cumsum(wx * x, out=self.tab[2, 1:m + 1])
        self.pref = self.tab[:3]
        self.pw, self.ps1, self.ps2 = self.pref
        self.dbuf = (self.tab[3], self.tab[4])
        self.dprev = self.dbuf[1]
        self.drow = 4  # the row of tab holding D[k-1]
        self.arange = np.arange(max(2 * m + 16, 1 << 12), dtype=np.int64)
        self.cols = np.arange(max(width, _DENSE_SCAN_MAX, 1), dtype=np.int64)[:, None]
        # Cached free-segment costs of each row's window: ccost[c, j] = cost(start[j] + c, j).
        self.start = np.full(m + 1, -1, np.int64)
        self.ccost = np.zeros((width, m + 1))
        # Divide and conquer: rows at tree positions 1..R, sentinels at 0 and past R.
        self.argp = np.empty(4 << self.rows.bit_length(), np.int64)

    # -- candidate scans (every value is the textbook's expression, bit for bit) -------------
    def _cost(self, pj: np.ndarray, im1: np.ndarray) -> np.ndarray:
        """Free cost ``s2 - s1*s1/w`` of segments ``[i..j]``; ``im1 = i - 1``.

        ``pj`` holds the prefix sums ``W, S1, S2`` at ``j`` stacked on a leading axis of 3 and
        broadcasts against ``im1``. One stacked gather replaces three: the calls, not the
        elements, cost the time here.
        """
        t = self.pref.take(im1, axis=1)
        np.subtract(pj, t, out=t)
        ww, s1, s2 = t
        np.multiply(s1, s1, out=s1)
        np.divide(s1, ww, out=s1)
        return np.subtract(s2, s1, out=s2)

    def _values(self, pj: np.ndarray, im1: np.ndarray) -> np.ndarray:
        """``D[k-1][i-1] + cost(i, j)`` (as :meth:`_cost`, with ``D[k-1]`` in the same gather)."""
        t = self.tab.take(im1, axis=1)
        pre = t[:3]
        np.subtract(pj, pre, out=pre)
        ww, s1, s2 = pre
        np.multiply(s1, s1, out=s1)
        np.divide(s1, ww, out=s1)
        np.subtract(s2, s1, out=s2)
        s2 += t[self.drow]
        return s2

    def _scan(self, j: np.ndarray, lo: np.ndarray,
              hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Leftmost minimum of ``D[k-1][i-1] + cost(i, j)`` over ``i in [lo, hi]`` per row."""
        e = int((hi - lo).max()) + 1
        if e <= _DENSE_SCAN_MAX:
            return self._scan_dense(j, lo, hi, e)
        return self._scan_ragged(j, lo, hi)

    def _scan_dense(self, j: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                    e: int) -> tuple[np.ndarray, np.ndarray]:
        """``[e, n]`` layout; columns past ``hi`` repeat ``hi`` (same value, never replaces)."""
        if e > self.cols.shape[0]:
            self.cols = np.arange(e, dtype=np.int64)[:, None]
        cols = self.cols[:e]
        im1 = (lo - 1) + cols
        np.minimum(im1, hi - 1, out=im1)
        val = self._values(self.pref.take(j, axis=1)[:, None, :], im1)
        best = np.minimum.reduce(val, axis=0)
        # First column holding the minimum = the textbook's upward scan with strict improvement.
        pos = np.minimum.reduce(np.where(val == best, cols, e), axis=0)
        pos += lo
        return best, pos

    def _scan_ragged(self, j: np.ndarray, lo: np.ndarray,
                     hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Flat layout, one segment of candidates per row (``hi >= lo``)."""
        cnt = hi - lo + 1
        ends = np.add.accumulate(cnt)
        total = int(ends[-1])
        starts = ends - cnt
        if total > self.arange.size:
            self.arange = np.arange(2 * total, dtype=np.int64)
        shift = lo - 1 - starts
        im1 = shift.repeat(cnt)
        im1 += self.arange[:total]
        val = self._values(self.pref.take(j, axis=1).repeat(cnt, axis=1), im1)
        best = np.minimum.reduceat(val, starts)
        # First position holding each row's minimum (every row has one; NaN never equals it).
        hit = (val == best.repeat(cnt)).nonzero()[0]
        first = hit.take(hit.searchsorted(starts))
        first += shift
        first += 1
        return best, first

    def _merge(self, j: np.ndarray, rows: np.ndarray, lo: np.ndarray,
               hi: np.ndarray, best: np.ndarray, arg: np.ndarray) -> None:
        """Scan candidates right of those already scanned; replace only on strict improvement."""
        b, a = self._scan(j.take(rows), lo, hi)
        better = b < best.take(rows)
        upd = rows[better]
        best[upd] = b[better]
        arg[upd] = a[better]

    # -- layers ------------------------------------------------------------------------------
    def _layer_dc(self, k: int, lower: np.ndarray, best: np.ndarray, arg: np.ndarray,
                  cmax: int) -> None:
        """Level-synchronous divide and conquer over the rows of one layer (fact 1 + bound).

        Row ``r`` sits at tree position ``p = r + 1``; the level of half-step ``h`` solves the
        positions ``h, 3h, 5h, ...`` between the solved positions ``p - h`` and ``p + h``
        (position 0 bounds from below by ``k``, positions past ``R`` do not bound).
        """
        rows, argp = lower.size, self.argp
        argp[0] = k
        argp[rows + 1:] = cmax
        h = 1 << (rows.bit_length() - 1)  # the largest power of two <= rows
        while h:
            step = 2 * h
            n = len(range(h, rows + 1, step))
            lo = np.maximum(argp[0:step * n:step], lower[h - 1::step])
            jm = self.arange[h - 1 + k:rows + k:step]
            hi = np.minimum(argp[step:step * (n + 1):step], jm)
            # Exact arithmetic gives lo <= hi; keep the scan well-formed if rounding does not.
            np.minimum(lo, hi, out=lo)
            b, a = self._scan(jm, lo, hi)
            best[h - 1::step] = b
            argp[h:rows + 1:step] = a
            h >>= 1
        arg[:] = argp[1:rows + 1]

    def _refresh(self, k: int, lower: np.ndarray) -> None:
        """Recompute the cached window costs of the rows whose lower bound moved."""
        rows, cols = lower.size, self.cols[:self.width]
        sl = slice(k, k + rows)
        start = self.start[sl]
        moved = (start != lower).nonzero()[0]
        if not moved.size:
            return
        if 2 * moved.size > rows:
            # Most rows moved (early window layers): slices beat gathers of the row values.
            im1 = (lower - 1) + cols
            jm1 = self.arange[k - 1:k - 1 + rows]
            past = im1 > jm1
            np.minimum(im1, jm1, out=im1)
            cost = self._cost(self.pref[:, None, sl], im1)
            cost[past] = np.inf
            self.ccost[:, sl] = cost
            start[:] = lower
        else:
            lo = lower.take(moved)
            jj = moved + k
            im1 = (lo - 1) + cols
            jm1 = jj - 1
            past = im1 > jm1
            np.minimum(im1, jm1, out=im1)
            cost = self._cost(self.pref.take(jj, axis=1)[:, None, :], im1)
            cost[past] = np.inf
            self.ccost[:, jj] = cost
            start[moved] = lo

    def _layer_windows(self, k: int, j: np.ndarray, lower: np.ndarray,
                       best: np.ndarray, arg: np.ndarray, top: int, cmax: int) -> None:
        """Windows ``[lower(j), hi(j)]``: the cached dense pass, the exact rows, then repairs.

        Rows ``0 .. top - 1`` are windowed: ``lower`` is the proven bound ``a_{k-1}(j)``
        (fact 2); ``hi`` grows until every one is certified: ``hi(j) >= a(j + 1)`` or
        ``hi(j) = j``. Rows ``top ..`` (at least the top row, which has no row above it to
        certify it) are scanned in full over ``[lower(j), min(j, cmax)]``.
        """
        width = self.width
        low, bst, ag = lower[:top], best[:top], arg[:top]
        self._refresh(k, low)
        # D[k-1][i-1] + cost(i, j) for i = lower + c; positions past j cost +inf (never the
        # minimum: i = lower <= j is always finite) and read the zero padding of D.
        val = self.dprev.take((low - 1) + self.cols[:width])
        val += self.ccost[:, k:k + top]
        np.minimum.reduce(val, axis=0, out=bst)
        if width > 1:
            # Leftmost column holding the minimum: count the leading columns that do not.
            ne = val != bst
            acc = ne[0]
            pos = acc.astype(np.int64)
            for c in range(1, width - 1):
                np.logical_and(acc, ne[c], out=acc)
                pos += acc
            np.add(low, pos, out=ag)
        else:
            ag[:] = low
        if top == len(j) - 1:
            # One exact row, the top: contiguous slices.
            jt = int(j[top])
            lo = int(lower[top]) - 1
            hi = min(jt, cmax)
            ww = self.pw[jt] - self.pw[lo:hi]
            s1 = self.ps1[jt] - self.ps1[lo:hi]
            s2 = self.ps2[jt] - self.ps2[lo:hi]
            np.multiply(s1, s1, out=s1)
            np.divide(s1, ww, out=s1)
            np.subtract(s2, s1, out=s2)
            np.add(self.dprev[lo:hi], s2, out=s2)
            p = int(s2.argmin())  # first occurrence: ties keep the smallest i
            best[top] = s2[p]
            arg[top] = lo + 1 + p
        else:
            je = j[top:]
            b, a = self._scan(je, lower[top:], np.minimum(je, cmax))
            best[top:] = b
            arg[top:] = a
        jm = j[:top]
        him = np.minimum(low + (width - 1), jm)
        span = max(1, _REPAIR_SPAN)
        while True:
            # Row r is certified by row r + 1 when its window reaches a(r + 1) (fact 1).
            need = np.minimum(arg[1:top + 1], jm)
            fail = (need > him).nonzero()[0]
            if not fail.size:
                return
            # Widen each failing row to its bound a(r + 1). The rows just below it most likely
            # fail next (its argmin moves right when widened), so they are widened to the same
            # bound now, valid for them too by fact 1: a sliding maximum over `span` rows.
            reach = np.zeros(top, np.int64)
            reach[fail] = need.take(fail)
            shift = 1
            while shift < span:
                np.maximum(reach[:-shift], reach[shift:], out=reach[:-shift])
                shift <<= 1
            np.minimum(reach, jm, out=reach)
            grown = (reach > him).nonzero()[0]
            grow = reach.take(grown)
            self._merge(j, grown, him.take(grown) + 1, grow, best, arg)
            him[grown] = grow

    @staticmethod
    def _last_kept(d: np.ndarray, ub: float, first: int) -> int:
        """Largest ``j`` whose ``D`` value is at most ``ub`` (``d[0]`` is row ``j = first``)."""
        keep = (d <= ub).nonzero()[0]
        return first + (int(keep[-1]) if keep.size else 0)

    def _upper_bound(self) -> float:
        """Cost of a feasible ``K``-segment partition (Lloyd iterations), plus rounding slack.

        Any partition into ``K`` non-empty contiguous segments costs at least the optimum, so
        its cost bounds every ``D[k][j]`` on the optimal path from above (segment costs are
        non-negative). The cost is computed with the recurrence's own expressions (with
        weights below about 1e-154, ``s1 * s1`` underflows there too). Starts from segments of
        equal ``sum(w**(1/3))`` (the codeword density of an optimal fine quantizer goes as the
        point density to the 1/3); each iteration moves every boundary to the midpoint of the
        adjacent segment values, clamped so that every segment keeps a point. The slack covers
        the rounding of the computed segment costs along a path (``16 (M + K)`` ulps of the
        prefix sums' magnitude), so the rows of the optimal path stay below the bound.
        """
        m, kk = self.m, self.k
        pw, ps1, ps2 = self.pw, self.ps1, self.ps2
        x = self.x
        t = np.arange(1, kk, dtype=np.int64)
        # s[t - 1] = first point of segment t (1-based points), t = 1 .. K-1.
        lo_b, hi_b = t + 1, m - kk + 1 + t
        # Codeword density of an optimal high-resolution quantizer ~ density**(1/3).
        cdf = np.cumsum(np.cbrt(self.w))
        s = np.searchsorted(cdf, cdf[-1] * (t / kk), side="right") + 1
        best = np.inf
        for it in range(_UB_ITERATIONS + 1):
            np.maximum(s, lo_b, out=s)
            s = np.maximum.accumulate(s - t) + t  # strictly increasing
            np.minimum(s, hi_b, out=s)  # still strictly increasing: hi_b - t is constant
            starts = np.concatenate(([1], s))
            ends = np.concatenate((s - 1, [m]))
            ww = pw[ends] - pw[starts - 1]
            s1 = ps1[ends] - ps1[starts - 1]
            s2 = ps2[ends] - ps2[starts - 1]
            # The recurrence's own expressions, so this is the cost it computes for the
            # partition (up to the order of the sum), underflow and all.
            cost = s2 - s1 * s1 / ww
            cost[0] = (s2[0] + 2.0 * s1[0]) + ww[0]
            cost[-1] = (s2[-1] - 2.0 * s1[-1]) + ww[-1]
            best = min(best, float(np.maximum(cost, 0.0).sum()))
            if it == _UB_ITERATIONS:
                break
            mean = s1 / ww
            mean[0], mean[-1] = -1.0, 1.0
            s = np.searchsorted(x, 0.5 * (mean[:-1] + mean[1:]), side="left") + 1
        # Computed segment costs can round below zero, so a row of the optimal path may exceed
        # the optimum by the rounding of the costs after it: the prefix sums' errors (at most
        # about M ulps of their magnitude, telescoping along a path) and each segment's own.
        scale = float(pw[m] + np.abs(self.ps1).max() + ps2[m])
        return best * (1.0 + 1e-9) + 16.0 * (m + kk) * np.finfo(np.float64).eps * scale

    def solve(self) -> tuple[np.ndarray, float]:
        m, kk, full = self.m, self.k, self.rows
        pw, ps1, ps2 = self.pw, self.ps1, self.ps2
        ar = self.arange[:full]
        args = np.empty((kk + 1, full), np.int64)
        ub = self.bound = self._upper_bound()
        # Rows of layers 2..K-1 computed by the final pass of each (diagnostics:
        # ``gefen-bench codebook`` reports them against the ``R`` rows of the textbook).
        self.rows_computed: list[int] = []
        # Layer 1: one segment [1..j] represented by -1 (f = -1: (s2 - 2f*s1) + f*f*w).
        j1 = slice(1, 1 + full)
        d1 = self.dprev[j1]
        d1[:] = (ps2[j1] + 2.0 * ps1[j1]) + pw[j1]
        args[1] = 1
        jmax = self._last_kept(d1, ub, 1)
        self.dprev[jmax + 1:] = np.inf
        lower = np.empty(full, np.int64)
        ext = _PRUNE_EXTEND
        for k in range(2, kk):
            arg = args[k]
            nxt = self.dbuf[k & 1]
            while True:
                top = min(k + full - 1, jmax + ext)
                n = top - k + 1
                best = nxt[k:k + n]  # D[k] is written in place of D[k-2]
                low = lower[:n]
                # a_{k-1}(j) at offset j - (k-1) of layer k-1; rows past the last kept row of
                # layer k-1 use its argmin (fact 1).
                np.minimum(ar[:n] + 1, jmax - k + 1, out=low)
                args[k - 1].take(low, out=low)
                np.maximum(low, k, out=low)
                if k < _WINDOW_FROM:
                    self._layer_dc(k, low, best, arg[:n], jmax + 1)
                else:
                    # Rows past the last kept row of layer k-1 have no bound of their own:
                    # they are scanned in full, up to the last column D[k-1] keeps.
                    self._layer_windows(k, ar[:n] + k, low, best, arg[:n],
                                        min(n - 1, jmax - k + 1), jmax + 1)
                new = self._last_kept(best, ub, k)
                if new < top or top == k + full - 1:
                    break
                ext *= 2  # the kept rows may go on past the rows computed: redo wider
            self.rows_computed.append(n)
            ext = max(_PRUNE_EXTEND, 2 * (new - jmax))
            jmax = new
            nxt[jmax + 1:] = np.inf
            self.dprev, self.drow = nxt, 3 + (k & 1)
        dprev = self.dprev
        # Layer K: the single row j = M, last segment represented by +1, scanned in full.
        i = np.arange(kk, m + 1)
        ww = pw[m] - pw[i - 1]
        s1 = ps1[m] - ps1[i - 1]
        s2 = ps2[m] - ps2[i - 1]
        val = dprev[i - 1] + ((s2 - 2.0 * s1) + ww)
        pos = int(np.argmin(val))  # first occurrence: ties keep the smallest i
        cost = float(val[pos])
        start = int(i[pos])
        codewords = np.empty(kk)
        codewords[kk - 1] = 1.0
        end = start - 1
        for layer in range(kk - 1, 1, -1):
            start = int(args[layer, end - layer])
            codewords[layer - 1] = (ps1[end] - ps1[start - 1]) / (pw[end] - pw[start - 1])
            end = start - 1
        codewords[0] = -1.0
        return codewords, cost
