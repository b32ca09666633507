"""The quantizer DP kernel (docs/algorithm.md#codebook-solver) against the textbook recurrence, bit
for bit.

The reference is written here from the spec (gefen-kernels does not depend on gefen-core):
fp64 prefix sums accumulated left to right, ``D[k][j] = min_{i=k..j} D[k-1][i-1] +
cost_k(i, j)`` scanning ``i`` upward and replacing only on strict improvement (numpy's argmin
takes the first occurrence), backtracking from ``(M, K)``. The kernel must return the same
codewords (so the same tie choices) and the same cost. Coarse dyadic grids, equal or small
integer weights and mirror-symmetric histograms make exact (bit-equal) ties between candidates
common. Without CUDA the kernel runs in Triton's interpreter on the CPU (``tests/conftest.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from gefen_kernels.ops.quantizer_dp import optimal_quantizer_dp_triton, quantizer_prefix


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _interpreter_loops_over_runtime_ints() -> bool:
    """Whether this Triton's interpreter runs ``range`` over an int kernel argument, as the
    kernels' tile and last-layer loops do. Triton 3.3's wraps the argument in a one-element
    array that numpy 2 refuses to convert to an int (the torch 2.7 floor's); 3.9's runs it.
    Compiled kernels are unaffected."""
    from gefen_kernels._triton import interpret_mode, jit, tl

    if not interpret_mode():
        return True

    @jit
    def probe(out_ptr, n):  # type: ignore[no-untyped-def]
        acc = 0
        for _ in range(0, n, 2):
            acc += 1
        tl.store(out_ptr, acc)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        probe[(1,)](out, 5)
    except Exception:  # the interpreter's InterpreterError wrapping the TypeError
        return False
    return int(out) == 3


runs_kernel = pytest.mark.skipif(
    not _interpreter_loops_over_runtime_ints(),
    reason="this Triton's interpreter cannot loop over an int kernel argument (Triton 3.3 "
           "with numpy 2); the kernel is tested with the latest Triton and on the GPU")


def _textbook(x: np.ndarray, w: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """The docs/algorithm.md#codebook-solver recurrence, vectorised over ``i`` per (layer, j); O(k *
    M**2)."""
    m = x.size
    wx = w * x
    pw = np.concatenate([[0.0], np.cumsum(w)])
    ps1 = np.concatenate([[0.0], np.cumsum(wx)])
    ps2 = np.concatenate([[0.0], np.cumsum(wx * x)])
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
                cost = (s2 - 2.0 * f * s1) + f * f * ww
            else:
                cost = s2 - s1 * s1 / ww
            v = d[layer - 1, i - 1] + cost
            p = int(np.argmin(v))  # first occurrence: the upward scan's strict improvement
            d[layer, j], arg[layer, j] = v[p], i[p]
    out = np.empty(k)
    j = m
    for layer in range(k, 0, -1):
        i0 = int(arg[layer, j])
        if layer == 1:
            out[0] = -1.0
        elif layer == k:
            out[k - 1] = 1.0
        else:
            out[layer - 1] = (ps1[j] - ps1[i0 - 1]) / (pw[j] - pw[i0 - 1])
        j = i0 - 1
    return out, float(d[k, m])


# ------------------------------------------------------------------------------------------
# Instances: (points, weights) of M points, strictly increasing in [-1, 1], weights > 0
# ------------------------------------------------------------------------------------------
def _grid_ties(rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct points of a coarse dyadic grid, integer weights in [1, 3]."""
    grid = 1 << max(3, (m - 1).bit_length())
    pts = np.sort(rng.choice(np.arange(-grid, grid + 1), size=m, replace=False)) / grid
    return pts.astype(np.float64), rng.integers(1, 4, size=m).astype(np.float64)


def _uniform_equal(rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
    """A uniform grid from -1 to 1 with equal weights (every segment length ties)."""
    return np.linspace(-1.0, 1.0, m), np.full(m, 5.0)


def _symmetric(rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Histogram bin centres mirrored around 0 with mirrored integer counts, peaked at 0."""
    half = m // 2
    bins = np.sort(rng.choice(np.arange(1, 2048), size=half, replace=False))
    right = (2 * bins + 1) / 4096.0  # bin centres right of 0: (2b + 1) / 4096
    counts = np.maximum(1, np.round(1000 * np.exp(-8 * right))).astype(np.float64)
    pts = np.concatenate([-right[::-1], [0.0] if m % 2 else [], right])
    wts = np.concatenate([counts[::-1], [1000.0] if m % 2 else [], counts])
    return pts, wts


def _random_float(rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Continuous points (endpoints included) and log-normal float weights."""
    pts = np.sort(rng.uniform(-1.0, 1.0, size=m))
    pts[0], pts[-1] = -1.0, 1.0
    return pts, np.exp(rng.normal(0.0, 2.0, size=m))


def _histogram_counts(rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Bin centres of a block-normalised Gaussian histogram: integer counts, sparse tails."""
    g = rng.normal(size=(256, 64)) * np.exp(rng.normal(size=(256, 1)))
    z = g / np.abs(g).max(axis=1, keepdims=True)
    b = np.clip(np.floor((z + 1.0) * 2048), 0, 4095).astype(np.int64)
    counts = np.bincount(b.ravel(), minlength=4096)
    active = np.flatnonzero(counts)
    keep = np.sort(rng.choice(active, size=min(m, active.size), replace=False))
    return (2 * keep - 4095) / 4096.0, counts[keep].astype(np.float64)


INSTANCES: dict[str, Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]]] = {
    "grid_ties": _grid_ties,
    "uniform_equal": _uniform_equal,
    "symmetric": _symmetric,
    "random_float": _random_float,
    "histogram": _histogram_counts,
}


def _check(x: np.ndarray, w: np.ndarray, k: int, block: int | None = None) -> None:
    assert x.size == w.size and x.size >= k and np.all(np.diff(x) > 0) and np.all(w > 0)
    want_c, want_cost = _textbook(x, w, k)
    codewords, cost = optimal_quantizer_dp_triton(quantizer_prefix(x, w).to(_device()), k,
                                                  _block=block)
    assert codewords.dtype == torch.float64 and codewords.shape == (k,)
    assert cost.dtype == torch.float64 and cost.shape == ()
    assert codewords.device.type == _device() and cost.device.type == _device()
    assert torch.equal(codewords.cpu(), torch.from_numpy(want_c)), (
        codewords.cpu().numpy() - want_c)
    assert float(cost) == want_cost


SMALL = [(8, 2), (8, 3), (8, 5), (33, 2), (33, 3), (33, 5), (33, 16), (33, 32), (100, 2),
         (100, 3), (100, 5), (100, 16)]


@runs_kernel
@pytest.mark.parametrize("kind", list(INSTANCES))
@pytest.mark.parametrize("m,k", SMALL)
def test_matches_textbook(kind: str, m: int, k: int) -> None:
    rng = np.random.default_rng(1000 * m + k)
    _check(*INSTANCES[kind](rng, m), k)


@runs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grid_ties", "uniform_equal", "histogram"])
def test_matches_textbook_many_layers(kind: str) -> None:
    rng = np.random.default_rng(7)
    _check(*INSTANCES[kind](rng, 100), 32)


# M = 300 (R up to 298 rows per layer, windows over several column tiles), one instance kind
# per k.
@pytest.mark.slow
@pytest.mark.parametrize("k,kind", [(2, "random_float"), (3, "uniform_equal"), (5, "grid_ties"),
                                    (16, "symmetric"), (32, "histogram"),
                                    (32, "uniform_equal")])
@runs_kernel
def test_matches_textbook_300_points(k: int, kind: str) -> None:
    rng = np.random.default_rng(300 + k)
    _check(*INSTANCES[kind](rng, 300), k)


@runs_kernel
@pytest.mark.parametrize("m", [2, 8, 33])
@pytest.mark.parametrize("kind", ["grid_ties", "uniform_equal", "random_float"])
def test_as_many_codewords_as_points(m: int, kind: str) -> None:
    # k == M: R = 1 row per layer, every segment a single point.
    rng = np.random.default_rng(m)
    x, w = INSTANCES[kind](rng, m)
    _check(x, w, m)
    if m > 2:
        _check(x, w, m - 1)  # R = 2: the top row bounded by the previous layer's last row


@runs_kernel
@pytest.mark.slow
def test_as_many_codewords_as_points_100() -> None:
    _check(*_symmetric(np.random.default_rng(5), 100), 100)


@pytest.mark.slow
@pytest.mark.parametrize("m,k,kind,block", [(100, 16, "grid_ties", 16),
                                            (100, 5, "uniform_equal", 16),
                                            (300, 5, "symmetric", 32),
                                            (300, 16, "histogram", 64),
                                            (33, 16, "random_float", 16)])
@runs_kernel
def test_many_programs_per_layer(m: int, k: int, kind: str, block: int) -> None:
    # Few rows per program: a layer takes several programs, each reading the previous layer's
    # argmins and values written by other programs of the previous launch, and its windows
    # span several column tiles (strict improvement across tiles), as on the GPU at M = 4096.
    rng = np.random.default_rng(m + k + block)
    _check(*INSTANCES[kind](rng, m), k, block)


def test_quantizer_prefix_is_the_left_to_right_cumsum() -> None:
    rng = np.random.default_rng(3)
    x = np.sort(rng.uniform(-1, 1, 50))
    w = rng.integers(1, 1000, 50).astype(np.float64)
    pre = quantizer_prefix(x, w)
    assert pre.dtype == torch.float64 and pre.shape == (3, 51) and pre.device.type == "cpu"
    want = np.zeros((3, 51))
    for j in range(50):  # the textbook's accumulation, one point at a time
        wx = w[j] * x[j]
        want[0, j + 1] = want[0, j] + w[j]
        want[1, j + 1] = want[1, j] + wx
        want[2, j + 1] = want[2, j] + wx * x[j]
    assert np.array_equal(pre.numpy(), want)
    assert torch.equal(quantizer_prefix(torch.from_numpy(x).float(), list(w)),
                       quantizer_prefix(x.astype(np.float32), w))
    with pytest.raises(ValueError, match="same length"):
        quantizer_prefix(x, w[:-1])
    with pytest.raises(ValueError, match="1-D"):
        quantizer_prefix(x[None], w[None])


def test_input_errors() -> None:
    dev = _device()
    pre = quantizer_prefix(np.linspace(-1, 1, 5), np.ones(5)).to(dev)
    with pytest.raises(TypeError, match="float64"):
        optimal_quantizer_dp_triton(pre.float(), 3)
    with pytest.raises(TypeError, match="torch.Tensor"):
        optimal_quantizer_dp_triton(pre.cpu().numpy(), 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="k must be an int"):
        optimal_quantizer_dp_triton(pre, 3.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k must be >= 2"):
        optimal_quantizer_dp_triton(pre, 1)
    with pytest.raises(ValueError, match=r"shape \[3, M \+ 1\]"):
        optimal_quantizer_dp_triton(pre[:2], 3)
    with pytest.raises(ValueError, match=r"shape \[3, M \+ 1\]"):
        optimal_quantizer_dp_triton(pre[None], 3)
    with pytest.raises(ValueError, match="fewer than k = 6"):
        optimal_quantizer_dp_triton(pre, 6)
    with pytest.raises(ValueError, match="_block"):
        optimal_quantizer_dp_triton(pre, 3, _block=48)


# ------------------------------------------------------------------------------------------
# Full size on the GPU: 4096 active bins, 256 codewords, against gefen-core's solver
# ------------------------------------------------------------------------------------------
def _full_histogram(seed: int, all_active: bool) -> tuple[np.ndarray, np.ndarray]:
    """A 4096-bin histogram of block-normalised gradients (docs/algorithm.md#histogram), as fp64
    points and counts of its active bins: 4M samples plus one count in every bin (``all_active``, M
    = 4096), or 131K samples (about 3500 active bins, sparse tails)."""
    rng = np.random.default_rng(seed)
    blocks = 1 << 14 if all_active else 1 << 9
    g = rng.standard_t(4, size=(blocks, 256)) * np.exp(rng.normal(size=(blocks, 1)))
    g = g.astype(np.float32)
    z = g / np.abs(g).max(axis=1, keepdims=True)
    b = np.clip(np.floor((z + np.float32(1.0)) * np.float32(2048.0)), 0, 4095).astype(np.int64)
    counts = np.bincount(b.ravel(), minlength=4096) + (1 if all_active else 0)
    active = np.flatnonzero(counts)
    centres = (2 * active - 4095) / 4096.0  # the fp32 bin centres, exactly
    return centres, counts[active].astype(np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("all_active", [True, False])
def test_full_size_matches_core_solver(all_active: bool) -> None:
    core = pytest.importorskip("gefen_core.codebook")
    x, w = _full_histogram(11, all_active)
    assert x.size == 4096 if all_active else 256 <= x.size < 4096
    want_c, want_cost = core.optimal_quantizer_endpoints(x, w, 256)
    codewords, cost = optimal_quantizer_dp_triton(quantizer_prefix(x, w).cuda(), 256)
    assert torch.equal(codewords.cpu(), want_c)
    assert float(cost) == want_cost
