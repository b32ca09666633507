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

from .._triton import gather_supported, interpret_mode, jit, tl
from ._decision_table import STAGED_CODES as _staged_codes
from ._decision_table import STAGED_THRESHOLDS as _staged_thresholds
from ._decision_table import TOWARD_ZERO as _toward_zero

# Launch options every Gefen kernel uses (see the module docstring).
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
# First pair entry of the packed kernel table (_search_table.KERNEL_PAIRS_OFFSET).
PAIRS_OFFSET = tl.constexpr(4097) if tl is not None else 4097
# First pair word of the decision table (_decision_table: 4096 head words, then the pairs).
DECISION_PAIRS = tl.constexpr(4096) if tl is not None else 4096
# The toward-zero rounding's decision table (_decision_table.TOWARD_ZERO), in int64 words.
TOWARD_ZERO = tl.constexpr(_toward_zero) if tl is not None else _toward_zero
# The decision tables' staged sections (_decision_table.STAGED_*), in 32-bit words: the lower
# codes as bytes, then the fp32 thresholds (each: the nearest rounding's, then the
# toward-zero rounding's).
STAGED_CODES32 = (tl.constexpr(2 * _staged_codes) if tl is not None else 2 * _staged_codes)
STAGED_THRESHOLDS32 = (tl.constexpr(2 * _staged_thresholds) if tl is not None
                       else 2 * _staged_thresholds)
# Whether kernels run in Triton's interpreter (fixed at import, as Triton itself does).
INTERPRETED = tl.constexpr(interpret_mode()) if tl is not None else interpret_mode()
# Whether tl_codewords gathers from registers (the Triton versions that compile it).
GATHER = tl.constexpr(gather_supported()) if tl is not None else False


@jit
def tl_momentum_ema(beta1, one_minus_beta1, scale, codeword, grad):
    """m = f32(f32(beta1 * f32(scale * codeword)) + f32((1 - beta1) * grad)) (fp32)."""
    dequant = scale * codeword
    return beta1 * dequant + one_minus_beta1 * grad


@jit
def _gather(src, index):  # type: ignore[no-untyped-def]
    """``src[index]`` for a 1-D register tensor ``src`` and a 1-D or 2-D ``index`` (Triton
    lowers it through shared memory)."""
    if len(index.shape) == 2:
        # Triton 3.6 cannot lower a 2-D gather from a broadcast [rows, n] source (the
        # assertion gather_supported names); the flattened gather compiles.
        flat = tl.reshape(index, (index.shape[0] * index.shape[1],))
        out = tl.reshape(tl.gather(src, flat, 0), (index.shape[0], index.shape[1]))
    else:
        out = tl.gather(src, index, 0)
    return out


@jit
def tl_codewords(cb_ptr, code):  # type: ignore[no-untyped-def]
    """``c[code]`` for an int32 ``code`` tensor (1-D or 2-D, values in ``[0, 255]``).

    Where Triton can compile it (:func:`gefen_kernels._triton.gather_supported`), a gather
    from a register copy of the 256 codewords instead of from global memory: the same values,
    5-18% off the step tile kernel in block mode and 4-9% in factored mode on the H200 when it
    replaced the momentum's codeword load."""
    if GATHER:
        out = _gather(tl.load(cb_ptr + tl.arange(0, 256)), code)
    else:
        out = tl.load(cb_ptr + code)
    return out


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
def _bucket(x):
    """The docs/algorithm.md#quantizer bucket ``clamp(floor((x + 1) * 2048), 0, 4095)`` of fp32
    ``x`` (NaN: 0)."""
    b = tl.floor((x + 1.0) * 2048.0)
    b = tl.minimum(tl.maximum(b, 0.0), 4095.0)
    return tl.where(x != x, 0.0, b).to(tl.int32)


@jit
def _low_float(bits64):
    """The fp32 whose bit pattern is the low 32 bits of int64 ``bits64``."""
    return bits64.to(tl.int32).to(tl.float32, bitcast=True)


@jit
def _high_float(bits64):
    """The fp32 whose bit pattern is the high 32 bits of int64 ``bits64``."""
    return (bits64 >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@jit
def tl_codeword_bracket(x, cb_ptr, table_ptr, STEPS: tl.constexpr):  # type: ignore[no-untyped-def]
    """``(L, R, c[L], c[R])`` of docs/algorithm.md#quantizer for fp32 ``x``: ``R =
    min(lower_bound(c, x), 255)``, ``L = max(R - 1, 0)``.

    ``STEPS = 0``: full 8-probe search over ``cb_ptr`` and two codebook gathers.
    ``STEPS > 0``: ``table_ptr`` is the packed int64 table of
    :func:`gefen_kernels.ops._decision_table.kernel_table`; the lower bound lies in
    ``[lo(b), lo(b + 1)]`` for ``b`` the bucket of ``x`` and ``STEPS`` halvings find it (the
    same index as the full search). With ``STEPS = 1`` a bucket holds at most one codeword,
    whose value the entry carries: one gather instead of three. ``c[L]`` and ``c[R]`` come
    from one pair entry.
    """
    tl.static_assert(STEPS >= 0, "the decision table (STEPS < 0) has no bracket")
    if STEPS == 0:
        right = tl_codeword_upper(x, cb_ptr)
        left = tl.maximum(right - 1, 0)
        c_left = tl.load(cb_ptr + left)
        c_right = tl.load(cb_ptr + right)
    else:
        b = _bucket(x)
        entry = tl.load(table_ptr + b)
        lo = entry.to(tl.int32)
        if STEPS == 1:
            # lo(b + 1) - lo(b) <= 1: the one probe is c[lo] (or +inf for an empty bucket).
            right = tl.minimum(lo + (_high_float(entry) < x).to(tl.int32), 255)
        else:
            hi = tl.load(table_ptr + b + 1).to(tl.int32)
            for _ in tl.static_range(STEPS):
                active = lo < hi
                mid = (lo + hi) >> 1
                less = tl.load(cb_ptr + tl.minimum(mid, 255)) < x
                lo = tl.where(active & less, mid + 1, lo)
                hi = tl.where(active & (less == 0), mid, hi)
            right = tl.minimum(lo, 255)
        left = tl.maximum(right - 1, 0)
        pair = tl.load(table_ptr + (PAIRS_OFFSET + right))
        c_left = _low_float(pair)
        c_right = _high_float(pair)
    return left, right, c_left, c_right


@jit
def _toward_zero_left(x, c_left, c_right):  # type: ignore[no-untyped-def]
    """Whether the toward-zero rounding (docs/algorithm.md#toward-zero-rounding) of fp32 ``x``
    takes ``L`` of its bracket ``(c[L], c[R])``: ``L`` (the largest codeword not above ``x``)
    where ``0 < x < c[R]``, else ``R``; where the bracket straddles 0 (a codebook without an
    exact 0) the nearest rounding's choice. The twin of
    :func:`gefen_kernels.ops._quant_ref.toward_zero_pick_left`."""
    straddle = (c_left < 0) & (c_right > 0)
    nearest_left = tl.abs(x - c_left) <= tl.abs(x - c_right)
    return tl.where(straddle, nearest_left, (c_right > x) & (x > 0))


@jit
def tl_quantize_nearest(x, cb_ptr, table_ptr, STEPS: tl.constexpr, zero):  # type: ignore[no-untyped-def]
    """Nearest codeword of fp32 ``x``: ``(index (int32), codeword (fp32))``; ties to the lower
    index; NaN -> 0. The codeword is ``c[index]``, bit for bit.

    Where the boolean ``zero`` (``x``'s shape) holds, the element's gradient is exactly 0 and
    ``x`` is rounded toward zero instead (docs/algorithm.md#toward-zero-rounding): with the
    decision tables the same lookups read the toward-zero table (an index offset:
    :func:`gefen_kernels.ops._decision_table.kernel_table_layout`), with the bracket search a
    select between the two choices.

    ``STEPS = -2`` where :data:`GATHER` holds: the staged sections of the decision tables
    (:func:`gefen_kernels.ops._decision_table.staged_section`), looked up in shared memory.

    ``STEPS < 0`` otherwise: ``table_ptr`` is the decision table of
    :mod:`gefen_kernels.ops._decision_table` (NaN falls in bucket 0, whose lower code is 0).
    The code comes from the bucket's head word. Where :data:`GATHER` holds, the codeword is
    then gathered from a register copy of the codebook (:func:`tl_codewords`, as for the
    momentum's old codeword) instead of read from the pair word: one random 8-byte load per
    element instead of two, the same ``c[q]`` bits. On the H200 (Triton 3.6) this took the
    step tile kernel (bf16 [8192, 8192]) from 0.569 to 0.409 ms (factored, P = 2048), 0.541 to 0.395
    (factored, P = 256), 0.424 to 0.323 (block, P = 2048) and 0.392 to 0.288 ms (block, P = 256),
    with bit-identical codes, scales and parameters. Without the gather the pair word is loaded as
    before.

    ``STEPS >= 0``: the bracket search of :func:`tl_codeword_bracket`.
    """
    if STEPS == -2 and GATHER:
        # The staged sections: the lower code of x's bucket and that code's threshold, both
        # gathered from shared-memory copies (10 KiB per program) instead of a random global
        # load of the head word (_decision_table.staged_section). A zero-gradient element
        # reads the toward-zero halves: bucket + 4096, threshold + 256.
        b = _bucket(x)
        shift = (b & 3) * 8
        zi = zero.to(tl.int32)
        words = tl.load(table_ptr.to(tl.pointer_type(tl.int32)) + STAGED_CODES32
                        + tl.arange(0, 2048))
        q_lo = (_gather(words, (b >> 2) + zi * 1024) >> shift) & 255
        thresholds = tl.load(table_ptr.to(tl.pointer_type(tl.float32)) + STAGED_THRESHOLDS32
                             + tl.arange(0, 512))
        q = q_lo + (x > _gather(thresholds, q_lo + zi * 256)).to(tl.int32)
        cq = tl_codewords(cb_ptr, q)
    elif STEPS < 0:
        b = _bucket(x) + tl.where(zero, TOWARD_ZERO, 0)
        head = tl.load(table_ptr + b)
        up = x > _low_float(head)
        codes = (head >> 32).to(tl.int32)
        q = tl.where(up, (codes >> 8) & 255, codes & 255)
        if GATHER:
            cq = tl_codewords(cb_ptr, q)
        else:
            pair = tl.load(table_ptr + (DECISION_PAIRS + b))
            cq = tl.where(up, _high_float(pair), _low_float(pair))
    else:
        left, right, c_left, c_right = tl_codeword_bracket(x, cb_ptr, table_ptr, STEPS)
        pick_left = tl.abs(x - c_left) <= tl.abs(x - c_right)
        pick_left = tl.where(zero, _toward_zero_left(x, c_left, c_right), pick_left)
        q = tl.where(pick_left, left, right)
        cq = tl.where(pick_left, c_left, c_right)
        top = tl.load(cb_ptr + 255)
        above = x > top
        q = tl.where(above, 255, q)
        cq = tl.where(above, top, cq)
        nan = x != x
        q = tl.where(nan, 0, q)
        cq = tl.where(nan, tl.load(cb_ptr), cq)
    return q, cq


@jit
def tl_sr_uniform(seed_u64, index):
    """docs/algorithm.md#stochastic-rounding splitmix64 hash of ``seed + 0x9E3779B97F4A7C15 * (index
    + 1)`` -> fp32 in [0, 1).

    ``index``: int32 or int64 (sign-extended). uint64 arithmetic wraps modulo 2**64 and shifts
    are logical, as the hash requires.
    """
    z = seed_u64 + (index.to(tl.int64).to(tl.uint64, bitcast=True) + 1) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return (z >> 40).to(tl.float32) * 5.9604644775390625e-08


@jit
def tl_quantize_stochastic(x, cb_ptr, table_ptr, STEPS: tl.constexpr, seed_u64, index, zero):  # type: ignore[no-untyped-def]
    """Stochastic rounding (docs/algorithm.md#stochastic-rounding) of fp32 ``x`` using ``U(seed,
    index)``: ``(index (int32), codeword (fp32))``; NaN -> 0. Where ``zero`` holds (an exactly-zero
    gradient), toward-zero rounding instead (docs/algorithm.md#toward-zero-rounding), from the same
    bracket."""
    left, right, c_left, c_right = tl_codeword_bracket(x, cb_ptr, table_ptr, STEPS)
    width = c_right - c_left
    clamped = tl.minimum(tl.maximum(x, c_left), c_right)
    has_width = width > 0
    p_up = tl.where(has_width,
                    tl.math.div_rn(clamped - c_left, tl.where(has_width, width, 1.0)), 0.0)
    u = tl_sr_uniform(seed_u64, index)
    up = u < p_up
    q = tl.where(up, right, left)
    cq = tl.where(up, c_right, c_left)
    toward_left = _toward_zero_left(x, c_left, c_right)
    q = tl.where(zero, tl.where(toward_left, left, right), q)
    cq = tl.where(zero, tl.where(toward_left, c_left, c_right), cq)
    nan = x != x
    return tl.where(nan, 0, q), tl.where(nan, tl.load(cb_ptr), cq)


@jit
def tl_nan_max(abs_values, is_nan, axis: tl.constexpr):  # type: ignore[no-untyped-def]
    """max over ``axis`` that returns NaN when any ``is_nan`` (GPU max instructions drop NaN)."""
    amax = tl.max(abs_values, axis=axis)
    any_nan = tl.max(is_nan.to(tl.int32), axis=axis)
    return tl.where(any_nan > 0, float("nan"), amax)


@jit
def tl_round_to(x, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """Round fp32 ``x`` to ``dtype`` to nearest-even, identically on GPU and in the interpreter.

    Compiled, this is Triton's cast (``cvt.rn``: round to nearest-even). The interpreter's own
    fp32 -> bf16 cast truncates, so there bf16 is rounded with integer arithmetic on the fp32
    bit pattern, which gives the same finite values; a NaN stays a NaN either way (its payload
    may differ).
    """
    if dtype == tl.bfloat16 and INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
