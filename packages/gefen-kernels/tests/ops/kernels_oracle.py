"""Independent float64 implementations of the Gefen op math, written from docs/algorithm.md.

Plain numpy, whole tensors, no chunking and no code shared with gefen_kernels: these are the
references the tests hold the package's PyTorch references (and, through them, the Triton
kernels) to.
"""

from __future__ import annotations

import numpy as np

K = 256
MASK64 = (1 << 64) - 1
FLT_MIN = 2.0**-126


def splitmix_uniform(seed: int, idx: int) -> float:
    """docs/algorithm.md#stochastic-rounding counter-based uniform with Python integers (exact
    modular arithmetic)."""
    z = (seed + 0x9E3779B97F4A7C15 * (idx + 1)) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z = z ^ (z >> 31)
    return (z >> 40) * 2.0**-24


def nearest64(z: np.ndarray, cb: np.ndarray) -> np.ndarray:
    """Nearest codeword, ties to the lower index, in float64 (docs/algorithm.md#quantizer)."""
    z = np.asarray(z, dtype=np.float64)
    cb = np.asarray(cb, dtype=np.float64)
    j = np.searchsorted(cb, z, side="left")
    right = np.clip(j, 0, K - 1)
    left = np.maximum(right - 1, 0)
    q = np.where(np.abs(z - cb[left]) <= np.abs(z - cb[right]), left, right)
    q = np.where(z > cb[-1], K - 1, q)
    return np.where(np.isnan(z), 0, q)


def boundary_distance(z: np.ndarray, cb: np.ndarray,
                      zero: np.ndarray | None = None) -> np.ndarray:
    """Distance from each z to the nearest decision boundary: a midpoint of adjacent codewords,
    and, where ``zero`` (toward-zero rounding), a codeword itself."""
    cb = np.asarray(cb, dtype=np.float64)
    mids = (cb[1:] + cb[:-1]) / 2.0
    j = np.clip(np.searchsorted(mids, z), 1, len(mids) - 1)
    out = np.minimum(np.abs(z - mids[j - 1]), np.abs(z - mids[j]))
    if zero is not None:
        i = np.clip(np.searchsorted(cb, z), 1, len(cb) - 1)
        at_codeword = np.minimum(np.abs(z - cb[i - 1]), np.abs(z - cb[i]))
        out = np.where(zero, np.minimum(out, at_codeword), out)
    return out


def stochastic64(z: np.ndarray, cb: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stochastic rounding in float64; also returns p_up (to find near-threshold draws)."""
    cb = np.asarray(cb, dtype=np.float64)
    j = np.searchsorted(cb, z, side="left")
    right = np.clip(j, 0, K - 1)
    left = np.maximum(right - 1, 0)
    width = cb[right] - cb[left]
    x = np.clip(z, cb[left], cb[right])
    p_up = np.where(width > 0, (x - cb[left]) / np.where(width > 0, width, 1.0), 0.0)
    return np.where(u < p_up, right, left), p_up


def toward_zero64(z: np.ndarray, cb: np.ndarray) -> np.ndarray:
    """Toward-zero rounding in float64 (docs/algorithm.md#toward-zero-rounding): above 0 the
    largest codeword not above z, otherwise the smallest not below it; between the two
    codewords around 0 of a codebook without an exact 0, the nearest one; NaN -> 0."""
    z = np.asarray(z, dtype=np.float64)
    cb = np.asarray(cb, dtype=np.float64)
    floor = np.clip(np.searchsorted(cb, z, side="right") - 1, 0, K - 1)
    ceil = np.clip(np.searchsorted(cb, z, side="left"), 0, K - 1)
    q = np.where(z > 0, floor, ceil)
    below, above = cb[cb < 0], cb[cb > 0]
    if not (cb == 0).any() and below.size and above.size:
        gap = (z > below[-1]) & (z < above[0])
        q = np.where(gap, nearest64(z, cb), q)
    return np.where(np.isnan(z), 0, q)


def requantize64(m: np.ndarray, cb: np.ndarray, zero: np.ndarray | None = None):
    """Block max, normalised values and codes of momentum rows ``m`` ``[B, P]``: nearest
    rounding, toward-zero rounding where ``zero`` (the gradient is exactly 0)."""
    s_new = np.abs(m).max(axis=1, keepdims=True)
    z = np.where(s_new > 0, m / np.where(s_new > 0, s_new, 1.0), 0.0)
    q = nearest64(z, cb)
    if zero is not None:
        q = np.where(zero, toward_zero64(z, cb), q)
    return s_new, z, q


def momentum64(g, q, s, cb, beta1):
    return beta1 * s * np.asarray(cb, np.float64)[q] + (1.0 - beta1) * g


def block_step64(p, g, q, s, v, cb, *, lr, beta1, beta2, eps, bc1_recip, bc2_rsqrt, decay,
                 maximize=False):
    """One block-mode step (docs/algorithm.md#block-second-moment) in float64. Returns a dict of the
    new state and extras."""
    num_blocks, period = q.shape
    g = np.asarray(g, np.float64).reshape(num_blocks, period) * (-1.0 if maximize else 1.0)
    v_new = beta2 * v + (1.0 - beta2) * (g * g).mean(axis=1, keepdims=True)
    sigma = bc1_recip / (np.sqrt(v_new) * bc2_rsqrt + eps)
    m = momentum64(g, q, s, cb, beta1)
    s_new, z, q_new = requantize64(m, cb, g == 0)
    terms = beta1 * s + (1.0 - beta1) * np.abs(g).max(axis=1, keepdims=True)
    return dict(v=v_new, sigma=sigma, m=m, s=s_new, z=z, q=q_new, terms=terms, zero=g == 0,
                p_decayed=np.asarray(p, np.float64).reshape(num_blocks, period) * decay)


def factored_stats64(g, r, k, *, beta2):
    g = np.asarray(g, np.float64)
    r_new = beta2 * r + (1.0 - beta2) * (g * g).mean(axis=1)
    k_new = beta2 * k + (1.0 - beta2) * (g * g).mean(axis=0)
    rbar = max(r_new.mean(), FLT_MIN)
    big_v = np.outer(r_new, k_new) / rbar
    return r_new, k_new, big_v


def param_update64(p_decayed, mhat, sigma, lr):
    return p_decayed - lr * sigma * mhat


def histogram_naive(g: np.ndarray, period: int) -> np.ndarray:
    """The histogram with a Python loop over blocks, in numpy float32; non-finite blocks skipped;
    4096 bins then the zero bin (a normalised value exactly 0, docs/algorithm.md#histogram)."""
    counts = np.zeros(4097, dtype=np.int64)
    flat = np.asarray(g, dtype=np.float32).reshape(-1)
    for b in range(flat.size // period):
        blk = flat[b * period:(b + 1) * period]
        a = np.float32(np.abs(blk).max())
        if not np.isfinite(a):
            continue
        if a > 0:
            z = (blk / a).astype(np.float32)
        else:
            z = np.zeros_like(blk)
        idx = np.floor((z + np.float32(1.0)) * np.float32(2048.0)).astype(np.int64)
        idx = np.where(z == 0, 4096, np.clip(idx, 0, 4095))
        np.add.at(counts, idx, 1)
    return counts
