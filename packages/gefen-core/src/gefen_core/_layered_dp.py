"""The layered recurrence of the exact optimal 1-D quantizer (docs/algorithm.md#codebook-solver).

The solver behind :mod:`gefen_core.codebook`: segment 1 and the last segment have fixed
centres, the others are free (weighted means); every value it looks at is the textbook's
expression on the same fp64 prefix sums (see :mod:`gefen_core.codebook` for the problem).

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
   for ``b < c < d``, true because its centre is at or left of every point: ``-1``, or ``0`` for
   the points ``>= 0`` of the forced-zero solve), and a leftmost argmin that moved left would
   contradict it. (Knuth's bound for optimal partitions.)

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
does. On the benchmark histogram this drops 41% of all rows and 66-89% of layers 2-21's in the
endpoint problem
(``gefen-bench codebook`` prints these, and the bound's distance to the optimum).

Floating point: facts 1 and 2 are statements about exact arithmetic; the computed values carry
rounding, so the two can only disagree where distinct candidates are equal up to rounding (a
near-tie decided by the last bit), and then the optimum differs from the textbook's by rounding
only. Exact ties (equal fp64 values) resolve to the smallest ``i`` on both.
``tests/test_codebook.py`` checks codebook, cost and tie choices against the textbook recurrence.

Cost: for ``M = 4096``, ``K = 256`` about 4 candidates per row and layer after the divide and
conquer layers,
on 59% of the textbook's rows (about 2.6 million candidate evaluations in all, against the
textbook's 2e9), most of them with cached segment costs; ``gefen-bench codebook`` prints the
measured time.
"""

from __future__ import annotations

import numpy as np

# Layers k >= _WINDOW_FROM use windows; earlier ones divide and conquer (their proven lower
# bounds are far from the argmins). Only speed depends on these constants.
_WINDOW_FROM = 16
# Candidates per row of a window layer's dense pass (the cached segment costs).
_DENSE_WIDTH = 4
# A failing row also widens this many rows (itself included) ending just below it.
_REPAIR_SPAN = 8
# Scans whose longest window has at most this many candidates use the dense layout.
_DENSE_SCAN_MAX = 8
_UB_ITERATIONS = 2
_PRUNE_EXTEND = 32


class _LayeredDP:
    """The layered recurrence with certified monotone-argmin windows (module docstring).

    Segment 1 has the fixed centre ``first``, the last segment the fixed centre ``last``, the
    others are free. :meth:`solve` gives the optimum with ``k`` segments; the forced-zero solve
    (:func:`solve_forced_zero`) instead runs the free layers one at a time (:meth:`begin`,
    :meth:`advance`) and closes every layer with the last segment (:meth:`closing`), giving the
    optimum for every number of segments in ``[k_lo, k_max]`` from one pass.

    Indices: points are ``1..M``; prefix arrays have ``M + 1`` entries (index ``r`` = the first
    ``r`` points; ``prefix`` may give them, with any value at index 0, e.g. a slice of the
    prefix sums of a larger point set) plus ``W`` entries of padding for windows that run past
    ``j``. Layer ``k`` has rows ``j = k .. min(k + R - 1, M - 1)`` with ``R = M - k_lo + 1``
    (the other rows cannot lead to a partition of at least ``k_lo`` segments); row offset
    ``r = j - k``. ``D`` values and cached costs are indexed by ``j``; argmins are stored per
    layer by row offset.
    """

    def __init__(self, x: np.ndarray, w: np.ndarray, k: int, *, first: float = -1.0,
                 last: float = 1.0, k_lo: int | None = None, k_max: int | None = None,
                 prefix: np.ndarray | None = None) -> None:
        m = x.size
        self.k_lo = k if k_lo is None else k_lo
        self.k_max = k if k_max is None else k_max
        self.m, self.k, self.rows = m, k, m - self.k_lo + 1
        self.first, self.last = first, last
        self.x, self.w = x, w
        self.width = width = max(1, _DENSE_WIDTH)
        # Rows: W, S1, S2 (left-to-right accumulation, as the textbook's) and two D buffers
        # (D[k-1] read, D[k] written). The zero padding keeps reads past j finite.
        self.tab = np.zeros((5, m + 1 + width))
        if prefix is None:
            wx = w * x
            np.cumsum(w, out=self.tab[0, 1:m + 1])
            np.cumsum(wx, out=self.tab[1, 1:m + 1])
            np.cumsum(wx * x, out=self.tab[2, 1:m + 1])
        else:
            self.tab[:3, :m + 1] = prefix
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
        f0, f1 = self.first, self.last
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
            # partition (up to the order of the sum), underflow and all. A segment of only
            # the forced-zero solve's zero point (weight 0) is an end segment: its free cost
            # and mean (0 / 0) are replaced below.
            with np.errstate(invalid="ignore"):
                cost = s2 - s1 * s1 / ww
                mean = s1 / ww
            cost[0] = (s2[0] - 2.0 * f0 * s1[0]) + f0 * f0 * ww[0]
            cost[-1] = (s2[-1] - 2.0 * f1 * s1[-1]) + f1 * f1 * ww[-1]
            best = min(best, float(np.maximum(cost, 0.0).sum()))
            if it == _UB_ITERATIONS:
                break
            mean[0], mean[-1] = f0, f1
            s = np.searchsorted(x, 0.5 * (mean[:-1] + mean[1:]), side="left") + 1
        # Computed segment costs can round below zero, so a row of the optimal path may exceed
        # the optimum by the rounding of the costs after it: the prefix sums' errors (at most
        # about M ulps of their magnitude, telescoping along a path) and each segment's own.
        scale = float(pw[m] + np.abs(self.ps1).max() + ps2[m])
        return best * (1.0 + 1e-9) + 16.0 * (m + kk) * np.finfo(np.float64).eps * scale

    def begin(self, bound: float) -> None:
        """Layer 1 (``D_1``: the first segment ``[1..j]`` with the fixed centre ``first``);
        rows whose ``D`` exceeds ``bound`` (an upper bound on the cost of the optimal path's
        rows, module docstring) are dropped in every layer."""
        full = self.rows
        pw, ps1, ps2 = self.pw, self.ps1, self.ps2
        self.bound = bound
        self.args = np.empty((self.k_max + 1, full), np.int64)
        self.lower = np.empty(full, np.int64)
        self.closings: dict[int, tuple[float, int]] = {}
        # Rows of layers 2.. computed by the final pass of each (diagnostics:
        # ``gefen-bench codebook`` reports them against the ``R`` rows of the textbook).
        self.rows_computed: list[int] = []
        # Layer 1: one segment [1..j] represented by f: (s2 - 2f*s1) + f*f*w.
        j1 = slice(1, 1 + full)
        f = self.first
        d1 = self.dprev[j1]
        d1[:] = ((ps2[j1] - ps2[0]) - 2.0 * f * (ps1[j1] - ps1[0])) + f * f * (pw[j1] - pw[0])
        self.args[1] = 1
        self.jmax = self._last_kept(d1, bound, 1)
        self.dprev[self.jmax + 1:] = np.inf
        self.ext = _PRUNE_EXTEND
        self.layer = 1
        self._close(1)

    def advance(self, k_hi: int) -> None:
        """Run the free layers up to ``k_hi - 1``, each closed by the last segment: the
        optimum with ``K`` segments for every ``K`` in ``[k_lo, k_hi]`` (:meth:`closing`)."""
        for k in range(self.layer + 1, min(k_hi, self.k_max)):
            self._layer(k)
            self.layer = k
            self._close(k)

    def _layer(self, k: int) -> None:
        full, args, ub = self.rows, self.args, self.bound
        ar = self.arange[:full]
        cap = min(k + full - 1, self.m - 1)  # the last segment needs a point after row j
        jmax, ext = self.jmax, self.ext
        arg = args[k]
        nxt = self.dbuf[k & 1]
        lower = self.lower
        while True:
            top = min(cap, jmax + ext)
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
            if new < top or top == cap:
                break
            ext *= 2  # the kept rows may go on past the rows computed: redo wider
        self.rows_computed.append(n)
        self.ext = max(_PRUNE_EXTEND, 2 * (new - jmax))
        self.jmax = new
        nxt[new + 1:] = np.inf
        self.dprev, self.drow = nxt, 3 + (k & 1)

    def _close(self, k: int) -> None:
        """The last segment ``[i..M]`` (fixed centre ``last``) after layer ``k``: the optimum
        with ``K = k + 1`` segments, scanned in full (ties keep the smallest ``i``)."""
        kk = k + 1
        if not self.k_lo <= kk <= self.k_max:
            return
        m, f = self.m, self.last
        pw, ps1, ps2 = self.pw, self.ps1, self.ps2
        i = self.arange[kk:m + 1]
        ww = pw[m] - pw[i - 1]
        s1 = ps1[m] - ps1[i - 1]
        s2 = ps2[m] - ps2[i - 1]
        val = self.dprev[i - 1] + ((s2 - 2.0 * f * s1) + f * f * ww)
        pos = int(np.argmin(val))  # first occurrence: ties keep the smallest i
        self.closings[kk] = (float(val[pos]), int(i[pos]))

    def closing(self, kk: int) -> float:
        """The optimal cost with ``kk`` segments (:meth:`advance` must have reached it); a
        value above the bound is only known to exceed it."""
        return self.closings[kk][0]

    def backtrack(self, kk: int) -> tuple[np.ndarray, float]:
        """Codewords (fp64 ``[kk]``, ``first`` .. ``last``) and cost of the optimum with ``kk``
        segments, following the stored argmins as the textbook does."""
        pw, ps1 = self.pw, self.ps1
        cost, start = self.closings[kk]
        codewords = np.empty(kk)
        codewords[kk - 1] = self.last
        end = start - 1
        for layer in range(kk - 1, 1, -1):
            start = int(self.args[layer, end - layer])
            codewords[layer - 1] = (ps1[end] - ps1[start - 1]) / (pw[end] - pw[start - 1])
            end = start - 1
        codewords[0] = self.first
        return codewords, cost

    def solve(self) -> tuple[np.ndarray, float]:
        """The optimum with ``k`` segments (its own bound, :meth:`_upper_bound`)."""
        self.begin(self._upper_bound())
        self.advance(self.k)
        return self.backtrack(self.k)
