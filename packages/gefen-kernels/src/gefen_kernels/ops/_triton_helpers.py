"""``@triton.jit`` building blocks shared by the Gefen kernels.

Each helper is the in-kernel twin of a PyTorch function used by the references
(:func:`gefen_kernels._numerics.momentum_ema`, :mod:`gefen_kernels.ops._quant_ref`) and performs
the same IEEE fp32 operations in the same order. Every launch passes ``enable_fp_fusion=False``
so no multiply-add is contracted into an fma, and divisions and square roots use the
round-to-nearest forms (``tl.math.div_rn``, ``tl.math.sqrt_rn``), not Triton's approximate
defaults. Under that contract a kernel's codes and scales equal the reference's bit for bit.

Importing this module never needs Triton: without it the helpers are stubs.
"""

from __future__ import annotations

from .._triton import jit, tl

# Launch options every Gefen kernel uses (see the module docstring).
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


@jit
def tl_momentum_ema(beta1, one_minus_beta1, scale, codeword, grad):
    """m = f32(f32(beta1 * f32(scale * codeword)) + f32((1 - beta1) * grad)) (fp32)."""
    dequant = scale * codeword
    return beta1 * dequant + one_minus_beta1 * grad


@jit
def tl_codeword_upper(x, cb_ptr):
    """R = min(lower_bound(c, x), 255): branch-free binary search over the sorted codebook.

    Eight probes ``c[j + w - 1] < x`` for ``w = 128 .. 1`` (the codebook, 1 KiB, stays in L1);
    a NaN compares false everywhere and gives 0.
    """
    j = tl.zeros(x.shape, dtype=tl.int32)
    for k in tl.static_range(8):
        c = tl.load(cb_ptr + (j + ((128 >> k) - 1)))
        j = tl.where(c < x, j + (128 >> k), j)
    return j


@jit
def tl_codeword_upper_table(x, cb_ptr, table_ptr, STEPS: tl.constexpr):  # type: ignore[no-untyped-def]
    """R = min(lower_bound(c, x), 255) narrowed by the search table of §1.8.4.

    ``table_ptr``: int32 ``[4097]``, ``L[b]`` = number of codewords whose bucket
    ``clamp(floor((c + 1) * 2048), 0, 4095)`` is below ``b``; the lower bound of ``x`` lies in
    ``[L[bucket(x)], L[bucket(x) + 1]]`` and ``STEPS`` halvings (the bit length of the widest
    range, computed with the table) find it: the same index as the full search.
    """
    b = tl.floor((x + 1.0) * 2048.0)
    b = tl.minimum(tl.maximum(b, 0.0), 4095.0)
    b = tl.where(x != x, 0.0, b).to(tl.int32)
    lo = tl.load(table_ptr + b)
    hi = tl.load(table_ptr + b + 1)
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) >> 1
        less = tl.load(cb_ptr + tl.minimum(mid, 255)) < x
        lo = tl.where(active & less, mid + 1, lo)
        hi = tl.where(active & (less == 0), mid, hi)
    return tl.minimum(lo, 255)


@jit
def tl_codeword_right(x, cb_ptr, table_ptr, STEPS: tl.constexpr):  # type: ignore[no-untyped-def]
    """R of §1.9: the table-narrowed search when ``STEPS > 0``, else the full 8-probe one."""
    if STEPS > 0:
        right = tl_codeword_upper_table(x, cb_ptr, table_ptr, STEPS)
    else:
        right = tl_codeword_upper(x, cb_ptr)
    return right


@jit
def tl_quantize_nearest(x, cb_ptr, table_ptr, STEPS: tl.constexpr):  # type: ignore[no-untyped-def]
    """Nearest codeword index (int32) of fp32 ``x``; ties to the lower index; NaN -> 0."""
    right = tl_codeword_right(x, cb_ptr, table_ptr, STEPS)
    left = tl.maximum(right - 1, 0)
    c_left = tl.load(cb_ptr + left)
    c_right = tl.load(cb_ptr + right)
    q = tl.where(tl.abs(x - c_left) <= tl.abs(x - c_right), left, right)
    top = tl.load(cb_ptr + 255)
    q = tl.where(x > top, 255, q)
    return tl.where(x != x, 0, q)


@jit
def tl_sr_uniform(seed_u64, index):
    """§1.9 splitmix64 hash of ``seed + 0x9E3779B97F4A7C15 * (index + 1)`` -> fp32 in [0, 1).

    uint64 arithmetic wraps modulo 2**64 and shifts are logical, as the hash requires.
    """
    z = seed_u64 + (index.to(tl.uint64, bitcast=True) + 1) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return (z >> 40).to(tl.float32) * 5.9604644775390625e-08


@jit
def tl_quantize_stochastic(x, cb_ptr, table_ptr, STEPS: tl.constexpr, seed_u64, index):  # type: ignore[no-untyped-def]
    """Stochastic rounding (§1.9) of fp32 ``x`` using ``U(seed, index)``; NaN -> 0."""
    right = tl_codeword_right(x, cb_ptr, table_ptr, STEPS)
    left = tl.maximum(right - 1, 0)
    c_left = tl.load(cb_ptr + left)
    c_right = tl.load(cb_ptr + right)
    width = c_right - c_left
    clamped = tl.minimum(tl.maximum(x, c_left), c_right)
    has_width = width > 0
    p_up = tl.where(has_width,
                    tl.math.div_rn(clamped - c_left, tl.where(has_width, width, 1.0)), 0.0)
    u = tl_sr_uniform(seed_u64, index)
    q = tl.where(u < p_up, right, left)
    return tl.where(x != x, 0, q)


@jit
def tl_nan_max(abs_values, is_nan, axis: tl.constexpr):  # type: ignore[no-untyped-def]
    """max over ``axis`` that returns NaN when any ``is_nan`` (GPU max instructions drop NaN)."""
    amax = tl.max(abs_values, axis=axis)
    any_nan = tl.max(is_nan.to(tl.int32), axis=axis)
    return tl.where(any_nan > 0, float("nan"), amax)


@jit
def tl_round_to(x, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """Round fp32 ``x`` to ``dtype`` to nearest-even, identically on GPU and in the interpreter.

    bf16 is rounded with integer arithmetic on the fp32 bit pattern (the interpreter's own
    fp32 -> bf16 cast truncates); NaN stays a quiet NaN. Other dtypes use Triton's cast.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
