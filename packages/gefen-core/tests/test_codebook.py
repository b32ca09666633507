"""The exact optimal quantizer with forced endpoints (docs/algorithm.md#codebook-solver, O4, O5).

``optimal_quantizer_endpoints`` and its layered solver, the building block of the forced-zero
codebook (``test_codebook_zero.py``). The reference is the textbook recurrence written here from
the spec: fp64 prefix sums accumulated left to right,
``D[k][j] = min_{i=k..j} D[k-1][i-1] + cost_k(i, j)`` scanning ``i`` upward and replacing only
on strict improvement, backtracking from ``(M, K)``. The solver must return the same codewords
(so the same tie choices) and the same cost, bit for bit.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from gefen_core import _layered_dp as ldp
from gefen_core import codebook as cb
from gefen_core.codebook import (
    HISTOGRAM_BINS,
    NUM_CODEWORDS,
    histogram_bin_centers,
    optimal_quantizer_endpoints,
)


# ------------------------------------------------------------------------------------------
# The textbook recurrence, written from docs/algorithm.md#codebook-solver
# ------------------------------------------------------------------------------------------
def _prefix(x: np.ndarray, w: np.ndarray) -> tuple[list[float], list[float], list[float]]:
    pw, ps1, ps2 = [0.0], [0.0], [0.0]
    for xi, wi in zip(x.tolist(), w.tolist()):
        wx = wi * xi
        pw.append(pw[-1] + wi)
        ps1.append(ps1[-1] + wx)
        ps2.append(ps2[-1] + wx * xi)
    return pw, ps1, ps2


def _seg_cost(pw, ps1, ps2, i: int, j: int, centre: float | None) -> float:
    w = pw[j] - pw[i - 1]
    s1 = ps1[j] - ps1[i - 1]
    s2 = ps2[j] - ps2[i - 1]
    if centre is None:
        return s2 - s1 * s1 / w
    f = centre
    return s2 - 2.0 * f * s1 + f * f * w


def textbook_loops(x: np.ndarray, w: np.ndarray, k: int) -> tuple[np.ndarray, float, int]:
    """Literal O(K*M^2) recurrence in plain Python. Returns codewords, cost, ties on the path."""
    m = len(x)
    pw, ps1, ps2 = _prefix(x, w)
    inf = float("inf")
    d = [[inf] * (m + 1) for _ in range(k + 1)]
    arg = [[0] * (m + 1) for _ in range(k + 1)]
    tie = [[False] * (m + 1) for _ in range(k + 1)]
    d[0][0] = 0.0
    for layer in range(1, k + 1):
        centre = -1.0 if layer == 1 else (1.0 if layer == k else None)
        for j in range(layer, m + 1):
            best, best_i, tied = inf, 0, False
            for i in range(layer, j + 1):
                v = d[layer - 1][i - 1] + _seg_cost(pw, ps1, ps2, i, j, centre)
                if v < best:
                    best, best_i, tied = v, i, False
                elif v == best:
                    tied = True
            d[layer][j], arg[layer][j], tie[layer][j] = best, best_i, tied
    return _backtrack(arg, pw, ps1, m, k), d[k][m], _count_ties(arg, tie, m, k)


def textbook_vectorised(x: np.ndarray, w: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """The same recurrence, vectorised over i per (layer, j) with the same fp64 expressions."""
    m = len(x)
    pw, ps1, ps2 = (np.array(a) for a in _prefix(x, w))
    d = np.full((k + 1, m + 1), np.inf)
    arg = np.zeros((k + 1, m + 1), dtype=np.int64)
    d[0, 0] = 0.0
    for layer in range(1, k + 1):
        for j in range(layer, m + 1):
            i = np.arange(layer, j + 1)
            ww = pw[j] - pw[i - 1]
            s1 = ps1[j] - ps1[i - 1]
            s2 = ps2[j] - ps2[i - 1]
            if layer == 1 or layer == k:
                f = -1.0 if layer == 1 else 1.0
                cost = s2 - 2.0 * f * s1 + f * f * ww
            else:
                cost = s2 - s1 * s1 / ww
            v = d[layer - 1, i - 1] + cost
            p = int(np.argmin(v))  # first occurrence = upward scan with strict improvement
            d[layer, j], arg[layer, j] = v[p], i[p]
    return _backtrack(arg, pw, ps1, m, k), float(d[k, m])


def _backtrack(arg, pw, ps1, m: int, k: int) -> np.ndarray:
    out = np.empty(k)
    j = m
    for layer in range(k, 0, -1):
        i = int(arg[layer][j])
        if layer == 1:
            out[0] = -1.0
        elif layer == k:
            out[k - 1] = 1.0
        else:
            out[layer - 1] = (ps1[j] - ps1[i - 1]) / (pw[j] - pw[i - 1])
        j = i - 1
    return out


def _count_ties(arg, tie, m: int, k: int) -> int:
    n, j = 0, m
    for layer in range(k, 0, -1):
        n += bool(tie[layer][j])
        j = int(arg[layer][j]) - 1
    return n


def _optimum_bound(self) -> float:
    """The tightest valid bound: the optimum itself (from an unpruned solve), plus slack."""
    free = cb._LayeredDP(self.x, self.w, self.k)
    free._upper_bound = lambda: np.inf
    _, cost = free.solve()
    return cost * (1 + 1e-12) + 1e-12


# Solver configurations: default routing; divide and conquer for every layer; windows from
# layer 3 on; windows of one cached candidate with no repair span, so most rows fail the
# certification and go through the repair loop one row per round; every scan in the ragged
# layout; every scan in the dense layout; no row dropped (infinite bound); the optimum itself
# as the bound, so every row that can be dropped is; rows computed one past the last kept row
# of the layer before, so layers are often redone wider (windows from layer 3 on).
_MODES = {
    "default": {},
    "dc": {"_WINDOW_FROM": 10**9},
    "windows": {"_WINDOW_FROM": 3},
    "windows_repairs": {"_WINDOW_FROM": 3, "_DENSE_WIDTH": 1, "_REPAIR_SPAN": 1},
    "ragged_scans": {"_DENSE_SCAN_MAX": 1},
    "dense_scans": {"_DENSE_SCAN_MAX": 10**6, "_DENSE_WIDTH": 2},
    "unpruned": {"_LayeredDP._upper_bound": lambda self: np.inf},
    "tightest_bound": {"_LayeredDP._upper_bound": _optimum_bound},
    "redo_wider": {"_PRUNE_EXTEND": 1, "_WINDOW_FROM": 3},
}


@pytest.fixture(params=list(_MODES))
def mode(request, monkeypatch):
    for name, value in _MODES[request.param].items():
        owner, _, attr = name.rpartition(".")
        module = cb if hasattr(cb, attr) and not owner else ldp
        monkeypatch.setattr(getattr(ldp, owner) if owner else module, attr, value)
    return request.param


def _solve(x, w, k):
    c, cost = optimal_quantizer_endpoints(x, w, k)
    assert c.dtype == torch.float64 and c.shape == (k,)
    return c.numpy(), cost


# ------------------------------------------------------------------------------------------
# Exactness against the textbook recurrence
# ------------------------------------------------------------------------------------------
def _random_instance(rng: np.random.Generator, m: int, grid: int, wmax: int):
    """m distinct points of a dyadic grid in [-1, 1] and integer weights in [1, wmax].

    Coarse grids and small weights make exact (bit-equal) ties between candidates common.
    """
    pts = np.sort(rng.choice(np.arange(-grid, grid + 1), size=m, replace=False)) / grid
    wts = rng.integers(1, wmax + 1, size=m).astype(np.float64)
    return pts.astype(np.float64), wts


def test_vectorised_textbook_matches_literal_loops():
    rng = np.random.default_rng(0)
    for _ in range(40):
        m = int(rng.integers(2, 12))
        k = int(rng.integers(2, m + 1))
        x, w = _random_instance(rng, m, 8, 3)
        c1, cost1, _ = textbook_loops(x, w, k)
        c2, cost2 = textbook_vectorised(x, w, k)
        assert np.array_equal(c1, c2) and cost1 == cost2


def _textbook_argmins(x: np.ndarray, w: np.ndarray, k: int) -> list[list[int]]:
    """Leftmost argmin a[layer][j] of the textbook recurrence (loops, strict improvement)."""
    m = len(x)
    pw, ps1, ps2 = _prefix(x, w)
    inf = float("inf")
    d = [[inf] * (m + 1) for _ in range(k + 1)]
    arg = [[0] * (m + 1) for _ in range(k + 1)]
    d[0][0] = 0.0
    for layer in range(1, k + 1):
        centre = -1.0 if layer == 1 else (1.0 if layer == k else None)
        for j in range(layer, m + 1):
            for i in range(layer, j + 1):
                v = d[layer - 1][i - 1] + _seg_cost(pw, ps1, ps2, i, j, centre)
                if v < d[layer][j]:
                    d[layer][j], arg[layer][j] = v, i
    return arg


def test_window_bounds_hold_on_textbook_argmins():
    # The two facts the solver's windows rest on (codebook module docstring), checked on the
    # textbook's own leftmost argmins, tie-heavy instances included:
    # fact 1, a_k(j) <= a_k(j + 1); fact 2, a_{k-1}(j) <= a_k(j) for the free layers.
    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(120):
        m = int(rng.integers(4, 16))
        k = int(rng.integers(3, m + 1))
        x, w = _random_instance(rng, m, int(rng.choice([8, 16, 2048])),
                                int(rng.choice([1, 2, 50])))
        a = _textbook_argmins(x, w, k)
        # Rows that can still lead to a k-segment partition: j <= m - k + layer.
        for layer in range(2, k):
            for j in range(layer, m - k + layer):
                assert a[layer][j] <= a[layer][j + 1], (x, w, k, layer, j)
                checked += 1
            if layer >= 3:
                for j in range(layer, m - k + layer + 1):
                    assert a[layer - 1][j] <= a[layer][j], (x, w, k, layer, j)
    assert checked > 500


def test_small_random_instances_equal_textbook_including_ties(mode):
    rng = np.random.default_rng(1)
    ties = 0
    for trial in range(300):
        m = int(rng.integers(2, 15))
        k = int(rng.integers(2, m + 1))
        grid = int(rng.choice([8, 8, 8, 16, 2048]))
        x, w = _random_instance(rng, m, grid, int(rng.choice([1, 1, 2, 5])))
        ref_c, ref_cost, n_ties = textbook_loops(x, w, k)
        ties += n_ties
        c, cost = _solve(x, w, k)
        assert np.array_equal(c, ref_c), (trial, x, w, k, c, ref_c)
        assert cost == ref_cost
    # The instances must actually exercise the tie rule on the optimal path.
    assert ties >= 40


def test_equal_cost_alternatives_keep_the_smallest_start():
    # Unit weights on an evenly spaced dyadic grid: many partitions cost exactly the same.
    x = np.linspace(-1.0, 1.0, 17)
    w = np.ones(17)
    for k in range(2, 17):
        ref_c, ref_cost, _ = textbook_loops(x, w, k)
        c, cost = _solve(x, w, k)
        assert np.array_equal(c, ref_c) and cost == ref_cost


@functools.cache
def _larger_instance(seed: int, m: int, k: int):
    rng = np.random.default_rng(seed)
    x, w = _random_instance(rng, m, HISTOGRAM_BINS // 2, 1)
    # Gradient-like weights: a peak at 0, thin tails, heavy end bins.
    w = np.floor(1e4 * np.exp(-0.5 * (x / 0.15) ** 2) + rng.integers(1, 30, size=m))
    w[0] += 500
    w[-1] += 500
    return x, w, textbook_vectorised(x, w, k)


@pytest.mark.parametrize("seed,m,k", [(2, 220, 24), (3, 300, 40), (4, 400, 16), (5, 500, 60)])
def test_larger_instances_equal_textbook(mode, seed, m, k):
    x, w, (ref_c, ref_cost) = _larger_instance(seed, m, k)
    c, cost = _solve(x, w, k)
    assert np.array_equal(c, ref_c)
    assert cost == ref_cost


@functools.cache
def _histogram_instance():
    rng = np.random.default_rng(6)
    centers = histogram_bin_centers().numpy().astype(np.float64)
    bins = np.sort(rng.choice(HISTOGRAM_BINS, size=700, replace=False))
    x = centers[bins]
    w = rng.geometric(0.05, size=700).astype(np.float64)
    return x, w, textbook_vectorised(x, w, 48)


def test_histogram_sized_instance_equals_textbook(mode):
    # Bin centres and integer counts, as optimal_codebook feeds the solver.
    x, w, (ref_c, ref_cost) = _histogram_instance()
    c, cost = _solve(x, w, 48)
    assert np.array_equal(c, ref_c) and cost == ref_cost


# Tie-heavy families (issue 3): the result must equal the textbook's tie choices, not only its
# cost. Bin centres are dyadic, so equal counts on mirrored bins give bit-equal costs.
def _centres_and_counts(bins: np.ndarray, counts: np.ndarray):
    centres = histogram_bin_centers().numpy().astype(np.float64)
    order = np.argsort(bins)
    return centres[bins[order]], counts[order].astype(np.float64)


@functools.cache
def _tie_family(name: str, seed: int):
    rng = np.random.default_rng(seed)
    if name == "symmetric":
        # Mirror-symmetric bins and counts: every partition has a mirror of equal cost.
        half = np.sort(rng.choice(np.arange(2048, 4096), size=60, replace=False))
        bins = np.concatenate([4095 - half[::-1], half])
        c = rng.integers(1, 4, size=60)
        counts = np.concatenate([c[::-1], c])
        k = int(rng.integers(6, 40))
    elif name == "equal_counts":
        # Evenly spaced bins, one count: translated segments cost exactly the same.
        stride = int(rng.choice([1, 2, 8, 32]))
        first = int(rng.integers(0, stride))
        bins = np.arange(first, 4096, stride)[:int(rng.integers(40, 120))]
        counts = np.full(bins.size, int(rng.integers(1, 1000)))
        k = int(rng.integers(3, min(bins.size, 48)))
    elif name == "sparse":
        # Few mirrored active bins far apart with unit counts, just above k: most segments are
        # forced singletons and the free choices come in mirrored pairs of equal cost.
        k = int(rng.integers(4, 40))
        half = np.sort(rng.choice(np.arange(2048, 4096), size=(k + 6) // 2, replace=False))
        bins = np.concatenate([4095 - half[::-1], half])
        counts = np.ones(bins.size, np.int64)
    elif name == "one_heavy_bin":
        # Almost all mass in one bin, unit counts on evenly spaced bins elsewhere (the ends
        # included): equal-cost alternatives on both sides of the heavy bin.
        stride = int(rng.choice([16, 32, 64]))
        bins = np.unique(np.concatenate([np.arange(0, 4096, stride), [4095]]))
        counts = np.ones(bins.size, np.int64)
        counts[int(rng.integers(1, bins.size - 1))] = 2**40
        k = int(rng.integers(3, 40))
    else:
        raise AssertionError(name)
    x, w = _centres_and_counts(bins, counts)
    k = min(k, x.size)
    return x, w, k, textbook_vectorised(x, w, k)


@pytest.mark.parametrize("name", ["symmetric", "equal_counts", "sparse", "one_heavy_bin"])
@pytest.mark.parametrize("seed", range(3))
def test_tie_heavy_histograms_equal_textbook(mode, name, seed):
    x, w, k, (ref_c, ref_cost) = _tie_family(name, seed)
    c, cost = _solve(x, w, k)
    assert np.array_equal(c, ref_c), (name, seed, k)
    assert cost == ref_cost


@functools.cache
def _sparse_codebook_instance():
    # 300 active bins (more than 256 codewords): a symmetric, equal-count histogram with the
    # end bins active, solved at K = 256 and by the textbook recurrence.
    rng = np.random.default_rng(12)
    half = np.sort(rng.choice(np.arange(2049, 4095), size=149, replace=False))
    bins = np.concatenate([[0], 4095 - half[::-1], half, [4095]])
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    c = torch.from_numpy(rng.integers(1, 3, size=149))
    counts[torch.from_numpy(bins)] = torch.cat([torch.tensor([7]), c.flip(0), c,
                                                torch.tensor([7])])
    x, w = _centres_and_counts(bins, counts.numpy()[bins])
    return counts, textbook_vectorised(x, w, NUM_CODEWORDS)


def test_sparse_symmetric_histogram_equals_textbook_at_256_codewords(mode):
    counts, (ref_c, ref_cost) = _sparse_codebook_instance()
    active = np.flatnonzero(counts.numpy())
    x, w = _centres_and_counts(active, counts.numpy()[active])
    c, cost = _solve(x, w, NUM_CODEWORDS)
    assert np.array_equal(c, ref_c) and cost == ref_cost
    assert (np.diff(c) > 0).all()


# ------------------------------------------------------------------------------------------
# The row bound
# ------------------------------------------------------------------------------------------
def _benchmark_like_instance():
    """Points and counts of a realistic 4096-bin histogram (as ``optimal_codebook`` feeds)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2048, 256, generator=g) * torch.exp(torch.randn(2048, 1, generator=g))
    z = x / x.abs().amax(dim=1, keepdim=True)
    idx = torch.floor((z + 1) * 2048).clamp_(0, 4095).long()
    counts = torch.bincount(idx.view(-1), minlength=HISTOGRAM_BINS).numpy()
    active = np.flatnonzero(counts)
    centres = histogram_bin_centers().numpy().astype(np.float64)
    return centres[active], counts[active].astype(np.float64)


def test_rows_above_the_bound_are_dropped_without_changing_the_result(monkeypatch):
    x, w = _benchmark_like_instance()
    rows: list[int] = []
    windows = cb._LayeredDP._layer_windows
    dc = cb._LayeredDP._layer_dc

    def count_windows(self, k, j, lower, *args):
        rows.append(lower.size)
        return windows(self, k, j, lower, *args)

    def count_dc(self, k, lower, *args):
        rows.append(lower.size)
        return dc(self, k, lower, *args)

    monkeypatch.setattr(cb._LayeredDP, "_layer_windows", count_windows)
    monkeypatch.setattr(cb._LayeredDP, "_layer_dc", count_dc)
    pruned = cb._LayeredDP(x, w, NUM_CODEWORDS)
    c, cost = pruned.solve()
    full = x.size - NUM_CODEWORDS + 1
    # Layers 2..K-1, some redone wider when their kept rows outgrew the rows computed.
    assert len(rows) >= NUM_CODEWORDS - 2
    assert max(rows) <= full
    # The early layers compute a small part of their rows; the run as a whole drops a good
    # share of them.
    assert max(rows[:10]) < full // 2
    assert sum(rows) < 0.8 * full * len(rows)
    free = cb._LayeredDP(x, w, NUM_CODEWORDS)
    free._upper_bound = lambda: np.inf
    ref_c, ref_cost = free.solve()
    assert np.array_equal(c, ref_c) and cost == ref_cost


@pytest.mark.parametrize("seed", range(6))
def test_upper_bound_is_a_feasible_cost_at_least_the_optimum(seed):
    rng = np.random.default_rng(seed)
    centres = histogram_bin_centers().numpy().astype(np.float64)
    m = int(rng.integers(NUM_CODEWORDS, 1200))
    bins = np.sort(rng.choice(HISTOGRAM_BINS, size=m, replace=False))
    w = rng.geometric(0.02, size=m).astype(np.float64)
    w[rng.integers(0, m, size=3)] *= 1e5  # a few heavy bins
    for k in (2, 3, 17, NUM_CODEWORDS, m):
        solver = cb._LayeredDP(centres[bins], w, k)
        bound = solver._upper_bound()
        free = cb._LayeredDP(centres[bins], w, k)
        free._upper_bound = lambda: np.inf
        _, optimum = free.solve()
        assert np.isfinite(bound) and bound >= optimum


def test_bound_covers_segment_costs_that_round_below_zero():
    """A heavy point at -1 and a thousand points 1e-13 apart: computed segment costs round
    below zero, so a row of the textbook's optimal path costs more than the optimum (768
    against 609). The bound's rounding slack must keep that row."""
    x = np.concatenate([[-1.0, -0.6], 0.7708278277520779 + 1e-13 * np.arange(1000), [1.0]])
    w = np.concatenate([[1e15, 4800.0], np.full(1000, 15.649354564917187), [1.0]])
    ref_c, ref_cost = textbook_vectorised(x, w, 3)
    c, cost = _solve(x, w, 3)
    assert np.array_equal(c, ref_c) and cost == ref_cost


def test_bound_uses_the_recurrence_expressions_when_they_underflow():
    """Weights near 1e-170: ``s1 * s1`` underflows in the recurrence, so a bound computed
    another way would sit below the cost the recurrence computes for its optimum."""
    x = np.linspace(-0.9, 0.9, 5)
    w = 1e-170 * np.arange(1, 6)
    ref_c, ref_cost = textbook_vectorised(x, w, 3)
    c, cost = _solve(x, w, 3)
    assert np.array_equal(c, ref_c) and cost == ref_cost


def test_one_active_bin_too_many_takes_the_cheapest_reduction():
    # M = K - 1 points, neither endpoint among them: K + 1 values do not fit.
    centers = histogram_bin_centers().double()
    bins = torch.arange(1, 1 + 255 * 16, 16)
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    counts[bins] = 1000
    counts[bins[100]] = 1  # merging bins[100] with a neighbour is the cheapest reduction
    x, w = centers[bins], counts[bins].double()
    c, cost = optimal_quantizer_endpoints(x, w)
    # Candidates written from the math: first point to -1, last point to +1, or merge a pair.
    first = float(w[0] * (x[0] + 1) ** 2)
    last = float(w[-1] * (x[-1] - 1) ** 2)
    pair = w[:-1] * w[1:] / (w[:-1] + w[1:]) * (x[1:] - x[:-1]) ** 2
    assert cost == min(first, last, float(pair.min()))
    p = int(torch.argmin(pair))
    assert p == 99  # bins[99] and bins[100]: the lighter of the two pairs with bins[100]
    mean = (w[p] * x[p] + w[p + 1] * x[p + 1]) / (w[p] + w[p + 1])
    expected = torch.cat([torch.tensor([-1.0], dtype=torch.float64), x[:p], mean[None],
                          x[p + 2:], torch.tensor([1.0], dtype=torch.float64)])
    assert torch.equal(c, expected)


def test_quantizer_input_errors():
    x = np.array([-0.5, 0.0, 0.5])
    w = np.ones(3)
    with pytest.raises(ValueError, match="k must be >= 2"):
        optimal_quantizer_endpoints(x, w, 1)
    with pytest.raises(TypeError, match="k must be an int"):
        optimal_quantizer_endpoints(x, w, 2.0)
    with pytest.raises(ValueError, match="same length"):
        optimal_quantizer_endpoints(x, w[:2], 2)
    with pytest.raises(ValueError, match="strictly increasing"):
        optimal_quantizer_endpoints(x[::-1].copy(), w, 2)
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        optimal_quantizer_endpoints(x * 3, w, 2)
    with pytest.raises(ValueError, match="> 0"):
        optimal_quantizer_endpoints(x, np.array([1.0, 0.0, 1.0]), 2)
    with pytest.raises(ValueError, match="empty"):
        optimal_quantizer_endpoints(np.array([]), np.array([]), 2)
