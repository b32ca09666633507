"""The codebook with the zero codeword (docs/algorithm.md#zero-codeword, #codebook-solver,
#histogram).

The reference is the textbook recurrence over all ``k`` codewords with three forced values,
written here from the spec: fp64 prefix sums over the points accumulated left to right, the
first segment represented by ``-1``, segment ``K_L`` by ``0`` and the last by ``+1``, every
other segment by its weighted mean; ``D[k][j] = min_{i=k..j} D[k-1][i-1] + cost_k(i, j)``
scanning ``i`` upward and replacing only on strict improvement; the position ``K_L`` of the zero
codeword is tried over ``2 .. k-1`` and the smallest total wins (ties: the smallest ``K_L``).
The zero bin is a point at 0; without exact zeros it is still there, with weight 0 (a free
segment holding only it has no mean and is never chosen).

The solver splits the problem at 0 and adds the two sides' costs, where the textbook
accumulates the same segment costs along one path: the costs agree to rounding (relative
1e-12 here), the codewords exactly.
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
    optimal_codebook,
    optimal_quantizer,
)


# ------------------------------------------------------------------------------------------
# The textbook recurrence with the three forced values, written from the spec
# ------------------------------------------------------------------------------------------
def _prefix(x: np.ndarray, w: np.ndarray) -> tuple[list[float], list[float], list[float]]:
    pw, ps1, ps2 = [0.0], [0.0], [0.0]
    for xi, wi in zip(x.tolist(), w.tolist()):
        wx = wi * xi
        pw.append(pw[-1] + wi)
        ps1.append(ps1[-1] + wx)
        ps2.append(ps2[-1] + wx * xi)
    return pw, ps1, ps2


def _centre(layer: int, k: int, kz: int) -> float | None:
    return -1.0 if layer == 1 else 1.0 if layer == k else 0.0 if layer == kz else None


def _textbook(x: np.ndarray, w: np.ndarray, k: int, kz: int) -> tuple[np.ndarray, float, int]:
    """Literal recurrence with the zero codeword at position ``kz``: codewords, cost, and the
    number of exact ties met on the optimal path."""
    m = len(x)
    pw, ps1, ps2 = _prefix(x, w)
    inf = float("inf")
    d = [[inf] * (m + 1) for _ in range(k + 1)]
    arg = [[0] * (m + 1) for _ in range(k + 1)]
    tie = [[False] * (m + 1) for _ in range(k + 1)]
    d[0][0] = 0.0
    for layer in range(1, k + 1):
        f = _centre(layer, k, kz)
        for j in range(layer, m + 1):
            for i in range(layer, j + 1):
                ww = pw[j] - pw[i - 1]
                s1 = ps1[j] - ps1[i - 1]
                s2 = ps2[j] - ps2[i - 1]
                if f is None:
                    if ww == 0:
                        continue  # only the zero point of weight 0: no mean
                    cost = s2 - s1 * s1 / ww
                else:
                    cost = s2 - 2.0 * f * s1 + f * f * ww
                v = d[layer - 1][i - 1] + cost
                if v < d[layer][j]:
                    d[layer][j], arg[layer][j], tie[layer][j] = v, i, False
                elif v == d[layer][j]:
                    tie[layer][j] = True
    out = np.empty(k)
    j, ties = m, 0
    for layer in range(k, 0, -1):
        i = arg[layer][j]
        ties += tie[layer][j]
        f = _centre(layer, k, kz)
        out[layer - 1] = f if f is not None else (ps1[j] - ps1[i - 1]) / (pw[j] - pw[i - 1])
        j = i - 1
    return out, d[k][m], ties


def forced_textbook(x: np.ndarray, w: np.ndarray, k: int) -> tuple[np.ndarray, float, int, int]:
    """The optimum over every position of the zero codeword (ties: the smallest); ``x`` holds
    the zero point. Returns codewords, cost, ties on the path, and ties between positions."""
    best: tuple[np.ndarray, float, int] | None = None
    position_ties = 0
    for kz in range(2, k):
        c, cost, ties = _textbook(x, w, k, kz)
        if best is None or cost < best[1]:
            best = (c, cost, ties)
        elif cost == best[1]:
            position_ties += 1
    assert best is not None
    return best[0], best[1], best[2], position_ties


def _with_zero_point(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if (x == 0).any():
        return x, w
    at = int(np.searchsorted(x, 0.0))
    return np.insert(x, at, 0.0), np.insert(w, at, 0.0)


def _solve(x: np.ndarray, w: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    c, cost = optimal_quantizer(x, w, k)
    assert c.dtype == torch.float64 and c.shape == (k,)
    return c.numpy(), cost


def _assert_cost(cost: float, ref: float) -> None:
    # The two sides' sums added, against one sum along the path: rounding only.
    assert abs(cost - ref) <= 1e-12 * ref, (cost, ref)


# Solver configurations: the default; a first window of one K_L either side of the estimate
# whose rows reach no further, so the window grows and the sides are rebuilt; no row dropped;
# divide and conquer for every layer; windows from layer 3 on.
_MODES = {
    "default": {},
    "narrow_window": {"_WINDOW_K": 1, "_REACH": 1},
    "unpruned": {"_LayeredDP._upper_bound": lambda self: np.inf},
    "dc": {"_WINDOW_FROM": 10**9},
    "windows": {"_WINDOW_FROM": 3, "_WINDOW_K": 2},
}


@pytest.fixture(params=list(_MODES))
def mode(request, monkeypatch):
    for name, value in _MODES[request.param].items():
        owner, _, attr = name.rpartition(".")
        module = cb if hasattr(cb, attr) and not owner else ldp
        monkeypatch.setattr(getattr(ldp, owner) if owner else module, attr, value)
    return request.param


def _random_instance(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    """Distinct points of a dyadic grid in (-1, 1), both signs, sometimes a point at 0, and
    weights that are small integers or powers of two (exact sums: ties are exact)."""
    while True:
        grid = int(rng.choice([4, 8, 16, 64, 2048]))
        m = int(rng.integers(3, min(14, 2 * grid - 1)))
        pts = np.sort(rng.choice(np.arange(-grid + 1, grid), size=m, replace=False)) / grid
        neg, pos = int((pts < 0).sum()), int((pts > 0).sum())
        if rng.random() < 0.5:
            w = rng.integers(1, 4, size=m).astype(np.float64)
        else:
            w = 2.0 ** rng.integers(0, 3, size=m)
        k = int(rng.integers(3, m + 2))
        if neg and pos and neg + pos + 3 > k + 1:  # the recurrence, not the few-points rule
            return pts.astype(np.float64), w, k


def test_small_random_instances_equal_the_forced_textbook_including_ties(mode):
    rng = np.random.default_rng(21)
    ties = position_ties = 0
    for trial in range(250):
        x, w, k = _random_instance(rng)
        ref_c, ref_cost, n_ties, n_pos = forced_textbook(*_with_zero_point(x, w), k)
        ties += n_ties
        position_ties += n_pos
        c, cost = _solve(x, w, k)
        assert np.array_equal(c, ref_c), (trial, x.tolist(), w.tolist(), k, c, ref_c)
        _assert_cost(cost, ref_cost)
        assert c[0] == -1.0 and c[-1] == 1.0 and (c == 0.0).any()
    # The instances must exercise the tie rules: on the path and between zero positions.
    assert ties >= 40 and position_ties >= 20


@functools.cache
def _histogram_instance(seed: int, asymmetric: float, zero_weight: float):
    rng = np.random.default_rng(seed)
    centres = histogram_bin_centers().numpy().astype(np.float64)
    bins = np.sort(rng.choice(HISTOGRAM_BINS, size=int(rng.integers(60, 110)), replace=False))
    x = centres[bins]
    w = np.floor(1e4 * np.exp(-0.5 * (x / 0.15) ** 2) + rng.integers(1, 30, size=x.size))
    w[x > 0] *= asymmetric  # mass on one side: the optimal split is far from the middle
    if zero_weight:
        x, w = _with_zero_point(x, w)
        w[x == 0] = zero_weight
    k = int(rng.integers(12, 30))
    return x, w, k


def _forced_textbook_vectorised(x: np.ndarray, w: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """:func:`forced_textbook`, vectorised over ``i`` (the same expressions)."""
    m = len(x)
    pw, ps1, ps2 = (np.array(a) for a in _prefix(x, w))
    best: tuple[np.ndarray, float] | None = None
    for kz in range(2, k):
        d = np.full((k + 1, m + 1), np.inf)
        arg = np.zeros((k + 1, m + 1), dtype=np.int64)
        d[0, 0] = 0.0
        for layer in range(1, k + 1):
            f = _centre(layer, k, kz)
            for j in range(layer, m + 1):
                i = np.arange(layer, j + 1)
                ww, s1, s2 = pw[j] - pw[i - 1], ps1[j] - ps1[i - 1], ps2[j] - ps2[i - 1]
                if f is None:
                    with np.errstate(invalid="ignore", divide="ignore"):
                        cost = np.where(ww > 0, s2 - s1 * s1 / ww, np.inf)
                else:
                    cost = s2 - 2.0 * f * s1 + f * f * ww
                v = d[layer - 1, i - 1] + cost
                p = int(np.argmin(v))
                d[layer, j], arg[layer, j] = v[p], i[p]
        if best is not None and not d[k, m] < best[1]:
            continue
        out = np.empty(k)
        j = m
        for layer in range(k, 0, -1):
            i0 = int(arg[layer, j])
            f = _centre(layer, k, kz)
            out[layer - 1] = f if f is not None else (ps1[j] - ps1[i0 - 1]) / (pw[j] - pw[i0 - 1])
            j = i0 - 1
        best = (out, float(d[k, m]))
    assert best is not None
    return best


@functools.cache
def _histogram_reference(seed: int, asymmetric: float, zero_weight: float):
    x, w, k = _histogram_instance(seed, asymmetric, zero_weight)
    return _forced_textbook_vectorised(*_with_zero_point(x, w), k)


@pytest.mark.parametrize("seed,asymmetric,zero_weight",
                         [(1, 1.0, 0.0), (2, 1000.0, 0.0), (3, 1.0, 5e4), (4, 0.002, 7.0)])
def test_histogram_like_instances_equal_the_forced_textbook(mode, seed, asymmetric,
                                                             zero_weight):
    x, w, k = _histogram_instance(seed, asymmetric, zero_weight)
    ref_c, ref_cost = _histogram_reference(seed, asymmetric, zero_weight)
    c, cost = _solve(x, w, k)
    assert np.array_equal(c, ref_c)
    _assert_cost(cost, ref_cost)


def _every_split(x: np.ndarray, w: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The split solve over every K_L with no row dropped: codewords, totals, the best K_L."""
    neg, pos = x < 0, x > 0
    n, p = int(neg.sum()), int(pos.sum())
    w0 = float(w[x == 0].sum())
    xs = np.concatenate([x[neg], [0.0], x[pos]])
    ws = np.concatenate([w[neg], [w0], w[pos]])
    pre = np.zeros((3, xs.size + 1))
    wx = ws * xs
    np.cumsum(ws, out=pre[0, 1:])
    np.cumsum(wx, out=pre[1, 1:])
    np.cumsum(wx * xs, out=pre[2, 1:])
    lo, hi = max(2, k - p), min(n + 1, k - 1)
    left = cb._LayeredDP(xs[:n + 1], ws[:n + 1], hi, first=-1.0, last=0.0, k_lo=lo, k_max=hi,
                         prefix=pre[:, :n + 2])
    right = cb._LayeredDP(xs[n:], ws[n:], k + 1 - lo, first=0.0, last=1.0, k_lo=k + 1 - hi,
                          k_max=k + 1 - lo, prefix=pre[:, n:])
    left.begin(np.inf)
    right.begin(np.inf)
    left.advance(hi)
    right.advance(k + 1 - lo)
    totals = np.array([left.closing(a) + right.closing(k + 1 - a) for a in range(lo, hi + 1)])
    best = lo + int(np.argmin(totals))
    c = np.concatenate([left.backtrack(best)[0], right.backtrack(k + 1 - best)[0][1:]])
    return c, totals, best


def _binned(g: torch.Tensor) -> torch.Tensor:
    from gefen_kernels.ops import histogram_reference

    return histogram_reference(g.contiguous(), g.shape[-1])


@functools.cache
def _realistic_counts() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(2048, 512, generator=gen) * torch.exp(torch.randn(2048, 1, generator=gen))
    g[:, :37] = 0.0  # dead columns and rows: exact zeros in the zero bin
    g[100:140] = 0.0
    return _binned(g)


def test_full_size_codebook_holds_minus_one_zero_plus_one_and_is_the_best_split():
    counts = _realistic_counts()
    assert counts.shape == (HISTOGRAM_BINS + 1,)
    assert int(counts[HISTOGRAM_BINS]) == 2048 * 37 + 40 * (512 - 37)
    c = optimal_codebook(counts)
    assert c.dtype == torch.float32 and c.shape == (NUM_CODEWORDS,)
    assert c[0].item() == -1.0 and c[-1].item() == 1.0
    assert int((c == 0.0).sum()) == 1
    assert bool((torch.diff(c) > 0).all())
    active = np.flatnonzero(counts.numpy()[:HISTOGRAM_BINS])
    x = histogram_bin_centers().numpy().astype(np.float64)[active]
    w = counts.numpy()[active].astype(np.float64)
    x, w = _with_zero_point(x, w)
    w[x == 0] = float(counts[HISTOGRAM_BINS])
    ref, totals, _ = _every_split(x, w, NUM_CODEWORDS)
    assert torch.equal(c, torch.from_numpy(ref).float())
    # The windowed solve rests on the total being convex in K_L: check it on this histogram.
    second = np.diff(totals, 2)
    assert (second >= -1e-12 * totals.min()).all()


def test_histogram_without_the_zero_bin_still_gets_the_zero_codeword():
    counts = _realistic_counts()[:HISTOGRAM_BINS]  # the layout before the zero bin existed
    c = optimal_codebook(counts)
    assert int((c == 0).sum()) == 1 and c[0] == -1 and c[-1] == 1
    assert bool((torch.diff(c) > 0).all())


# ------------------------------------------------------------------------------------------
# Few points (open choice O5 with the three forced codewords)
# ------------------------------------------------------------------------------------------
def test_few_points_keep_every_point_and_pad():
    x = np.array([-0.5, -0.25, 0.0, 0.125, 0.75])
    w = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    c, cost = _solve(x, w, 12)
    assert cost == 0.0
    assert set(c.tolist()) == {-1.0, -0.5, -0.25, 0.0, 0.125, 0.75, 1.0}
    assert int((c == 0.75).sum()) == 12 - 6  # padded with the largest value below +1
    assert (np.diff(c) >= 0).all()


def test_one_value_too_many_takes_the_cheapest_reduction():
    # k = 8: -1, 0, +1 and six points (three each side) are one value too many.
    x = np.array([-0.9, -0.5, -0.45, 0.02, 0.5, 0.95])
    w = np.array([5.0, 4.0, 4.0, 1.0, 3.0, 9.0])
    c, cost = _solve(x, w, 8)
    # Candidates written from the math: first point to -1, last point to +1, the point
    # nearest 0 on either side to 0, or an adjacent same-sign pair merged.
    options = {
        "first": 5.0 * 0.1**2, "last": 9.0 * 0.05**2, "zero_left": 4.0 * 0.45**2,
        "zero_right": 1.0 * 0.02**2, "merge_left_01": 5 * 4 / 9 * 0.4**2,
        "merge_left_12": 4 * 4 / 8 * 0.05**2, "merge_right": 1 * 3 / 4 * 0.48**2,
    }
    assert min(options, key=options.__getitem__) == "zero_right"
    assert cost == 1.0 * 0.02**2
    assert c.tolist() == [-1.0, -0.9, -0.5, -0.45, 0.0, 0.5, 0.95, 1.0]


def test_one_side_without_points_gives_the_other_side_every_free_codeword():
    # Only positive points (and the zero bin): -1 takes no point, the right side solves with
    # the forced 0 and +1 and k - 1 codewords, exactly as the textbook over those points.
    rng = np.random.default_rng(5)
    x = np.sort(rng.choice(np.arange(1, 64), size=14, replace=False)) / 64.0
    w = rng.integers(1, 5, size=14).astype(np.float64)
    xz, wz = np.concatenate([[0.0], x]), np.concatenate([[2.0], w])
    c, cost = _solve(xz, wz, 9)
    assert c[0] == -1.0
    # The rest: the textbook with the first segment represented by 0, the last by +1.
    ref_from_zero = _zero_first_textbook(xz, wz, 8)
    assert np.array_equal(c[1:], ref_from_zero[0])
    _assert_cost(cost, ref_from_zero[1])


def _zero_first_textbook(x: np.ndarray, w: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """The textbook recurrence with the first segment represented by 0, the last by +1."""
    m = len(x)
    pw, ps1, ps2 = _prefix(x, w)
    d = np.full((k + 1, m + 1), np.inf)
    arg = np.zeros((k + 1, m + 1), dtype=np.int64)
    d[0, 0] = 0.0
    for layer in range(1, k + 1):
        f = 0.0 if layer == 1 else 1.0 if layer == k else None
        for j in range(layer, m + 1):
            for i in range(layer, j + 1):
                ww, s1, s2 = pw[j] - pw[i - 1], ps1[j] - ps1[i - 1], ps2[j] - ps2[i - 1]
                cost = s2 - s1 * s1 / ww if f is None else s2 - 2.0 * f * s1 + f * f * ww
                if d[layer - 1, i - 1] + cost < d[layer, j]:
                    d[layer, j], arg[layer, j] = d[layer - 1, i - 1] + cost, i
    out = np.empty(k)
    j = m
    for layer in range(k, 0, -1):
        i = int(arg[layer, j])
        f = 0.0 if layer == 1 else 1.0 if layer == k else None
        out[layer - 1] = f if f is not None else (ps1[j] - ps1[i - 1]) / (pw[j] - pw[i - 1])
        j = i - 1
    return out, float(d[k, m])


# ------------------------------------------------------------------------------------------
# optimal_codebook
# ------------------------------------------------------------------------------------------
def test_bin_centers_are_exact_edge_means():
    c = histogram_bin_centers()
    assert c.dtype == torch.float32 and c.shape == (HISTOGRAM_BINS,)
    b = torch.arange(HISTOGRAM_BINS, dtype=torch.float64)
    assert torch.equal(c.double(), (2 * b - 4095) / 4096)


def _counts(bins: torch.Tensor, values: torch.Tensor | int, zero: int = 0) -> torch.Tensor:
    counts = torch.zeros(HISTOGRAM_BINS + 1, dtype=torch.int64)
    counts[bins] = values
    counts[HISTOGRAM_BINS] = zero
    return counts


def test_codebook_is_the_fp32_rounding_of_the_quantizer_with_the_zero_bin_as_point_zero():
    counts = _realistic_counts()
    active = counts[:HISTOGRAM_BINS] > 0
    x = histogram_bin_centers()[active].double()
    w = counts[:HISTOGRAM_BINS][active].double()
    at = int(torch.searchsorted(x, torch.tensor(0.0, dtype=torch.float64)))
    x = torch.cat([x[:at], torch.zeros(1, dtype=torch.float64), x[at:]])
    w = torch.cat([w[:at], counts[HISTOGRAM_BINS:].double(), w[at:]])
    c64, cost = optimal_quantizer(x, w)
    assert torch.equal(optimal_codebook(counts), c64.float())
    # No larger than the error of nearest-codeword assignment with a uniform codebook.
    uniform = torch.linspace(-1, 1, NUM_CODEWORDS, dtype=torch.float64)
    err_uniform = float((w * (x[:, None] - uniform[None]).pow(2).min(dim=1).values).sum())
    assert cost <= err_uniform


def test_two_separated_clusters_are_recovered_exactly():
    left = torch.arange(1000, 1126)  # 126 + 127 centres, -1, 0, +1: 256 values
    right = torch.arange(3000, 3127)
    counts = _counts(torch.cat([left, right]), 50, zero=9)
    c = optimal_codebook(counts)
    centers = histogram_bin_centers()
    expected = torch.cat([torch.tensor([-1.0]), centers[left], torch.tensor([0.0]),
                          centers[right], torch.tensor([1.0])])
    assert torch.equal(c, expected)


def test_exactly_the_codewords_needed_use_the_forced_endpoints():
    # Bins 0 and 4095 plus 253 others: -1 and +1 take the end bins, 0 takes no point (there
    # is no zero bin), the 253 others are their own codewords.
    inner = torch.arange(100, 100 + 253 * 7, 7)
    counts = _counts(torch.cat([torch.tensor([0, 4095]), inner]), 3)
    counts[0], counts[4095] = 9, 11
    c = optimal_codebook(counts)
    centers = histogram_bin_centers()
    assert torch.equal(c[c != 0][1:-1], centers[inner]) and int((c == 0).sum()) == 1
    active = counts[:HISTOGRAM_BINS] > 0
    _, cost = optimal_quantizer(centers[active].double(), counts[:HISTOGRAM_BINS][active].double())
    assert cost == 9 * (1 / 4096) ** 2 + 11 * (1 / 4096) ** 2


def test_fewer_active_bins_than_codewords_keeps_every_centre():
    bins = torch.tensor([0, 17, 900, 2048, 2049, 3000, 4095])
    counts = _counts(bins, torch.tensor([5, 1, 2, 100, 99, 3, 4]), zero=6)
    c = optimal_codebook(counts)
    assert c[0] == -1 and c[-1] == 1 and bool((torch.diff(c) >= 0).all())
    centers = histogram_bin_centers()[bins]
    assert set(c.tolist()) == set(centers.tolist()) | {-1.0, 0.0, 1.0}
    # Padding repeats the largest centre below +1; exactly K entries.
    n_pad = NUM_CODEWORDS - len(bins) - 3
    assert int((c == centers.max()).sum()) == n_pad + 1


def test_integer_counts_beyond_fp32_precision_are_kept():
    # O4: counts above 2**24 differ by 1 yet must not be rounded together.
    counts = torch.zeros(HISTOGRAM_BINS + 1, dtype=torch.int64)
    counts[0:HISTOGRAM_BINS:8] = 2**25
    counts[4:HISTOGRAM_BINS:8] = 2**25 + 1
    counts[HISTOGRAM_BINS] = 2**25 + 3
    c = optimal_codebook(counts)
    active = counts[:HISTOGRAM_BINS] > 0
    x = torch.cat([histogram_bin_centers()[active].double(), torch.zeros(1, dtype=torch.float64)])
    w = torch.cat([counts[:HISTOGRAM_BINS][active], counts[HISTOGRAM_BINS:]]).to(torch.float64)
    order = torch.argsort(x)
    c64, _ = optimal_quantizer(x[order], w[order])
    assert torch.equal(c, c64.float())


def test_codebook_device_argument_places_the_result():
    c = optimal_codebook(_realistic_counts(), device="cpu")
    assert c.device.type == "cpu"
    if torch.cuda.is_available():
        on_cuda = optimal_codebook(_realistic_counts(), device=torch.device("cuda"))
        assert on_cuda.device.type == "cuda" and torch.equal(on_cuda.cpu(), c)


def test_codebook_input_errors():
    with pytest.raises(TypeError, match="integer"):
        optimal_codebook(torch.ones(HISTOGRAM_BINS + 1))
    with pytest.raises(ValueError, match="shape"):
        optimal_codebook(torch.ones(10, dtype=torch.int64))
    bad = torch.ones(HISTOGRAM_BINS + 1, dtype=torch.int64)
    bad[3] = -1
    with pytest.raises(ValueError, match="non-negative"):
        optimal_codebook(bad)
    with pytest.raises(ValueError, match="all zero"):
        optimal_codebook(torch.zeros(HISTOGRAM_BINS + 1, dtype=torch.int64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        optimal_codebook(np.ones(HISTOGRAM_BINS + 1, dtype=np.int64))


def test_quantizer_input_errors():
    x = np.array([-0.5, 0.0, 0.5])
    w = np.ones(3)
    with pytest.raises(ValueError, match="k must be >= 3"):
        optimal_quantizer(x, w, 2)
    with pytest.raises(ValueError, match="same length"):
        optimal_quantizer(x, w[:2], 3)
    with pytest.raises(ValueError, match="> 0"):
        optimal_quantizer(x, np.array([1.0, 0.0, 1.0]), 3)
