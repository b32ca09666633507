"""Nearest-codeword decision table: the docs/algorithm.md#quantizer nearest rounding as one lookup
(acceleration only).

The kernels bucket ``x`` as the search table does (``b = clamp(floor((x + 1) * 2048), 0,
4095)``, fp32, NaN -> 0). Both that bucket map and the nearest rounding of
:func:`gefen_kernels.ops._quant_ref.nearest_codes` are monotone non-decreasing in ``x``, so
each bucket is an interval of fp32 values on which the nearest code is a step function. A
learned codebook keeps neighbouring codewords at least about one bucket apart, so on each
bucket that step function jumps at most once. The table stores, for every bucket ``b``,
the code below and above that jump and the largest fp32 value that still takes the lower
code. The kernels then need one lookup, one comparison and a select instead of a search
and a second gather, with no dependent loads (``STEPS = DIRECT_STEPS``):

* word ``b`` (the head word): bits 0-31 the fp32 pattern of the threshold ``t`` (``+inf``
  where the bucket has no jump), bits 32-39 ``q_lo``, bits 40-47 ``q_hi``;
* word ``4096 + b`` (the pair word): the fp32 patterns of ``c[q_lo]`` (low) and ``c[q_hi]``
  (high).

The head words come first, together (32 KiB), because the kernels on Triton >= 3.6 read only them.
On an H200, against head and pair words interleaved (the layout before 2026-11-30), the step tile
kernel on bf16 [8192, 8192] took 0.5-11% less time (mean 5%) in the six cases measured on production
code, bit-identical (factored and block mode, each against the mean of two production timings).

``q = q_hi if x > t else q_lo``, and its codeword likewise. Where Triton compiles
``tl.gather``, the kernels read only the head word and gather ``c[q]`` from a register copy
of the codebook (:func:`gefen_kernels.ops._triton_helpers.tl_quantize_nearest`); older
Triton reads the pair word too. NaN lands in bucket 0, where
``x > t`` is false and ``q_lo = 0`` (the nearest code of ``-inf``), which is the rule.

Every entry is computed from the reference itself: each bucket's end points come from a
bisection over the fp32 values in order, its two codes from ``nearest_codes`` at those end
points, the jump from a bisection with ``nearest_codes`` (started within a few keys of the
two codewords' fp32 midpoint and taken over the whole bucket only where the jump is not
there: a few probes instead of about 32 per bucket, the same table). The build then checks that the
value right after each threshold already takes ``q_hi``. A codebook with two jumps inside
one bucket (codewords closer than about a bucket width) gets no table, and the kernels
keep the bracket search. The table gives the reference's codes bit for bit: the tests
compare it with ``nearest_codes`` at every bucket edge and threshold and on random values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .._numerics import HISTOGRAM_BINS
from ._quant_ref import nearest_codes, toward_zero_codes
from ._search_table import build_kernel_table, cached, stochastic_kernel_table

DIRECT_STEPS = -1  # the kernels' STEPS value for "use the decision table"
STAGED_STEPS = -2  # the decision table followed by its staged section
# The kernel table (kernel_table_layout): the nearest rounding's head and pair words, then the
# toward-zero rounding's, then the staged sections. In int64 words: where the toward-zero
# table starts, and where the staged part starts: the 4096 lower codes of each rounding as
# bytes (2 x 512 words), then the 256 fp32 thresholds of each (2 x 128 words).
TOWARD_ZERO = 2 * HISTOGRAM_BINS
STAGED_CODES = 2 * TOWARD_ZERO
STAGED_THRESHOLDS = STAGED_CODES + 2 * (HISTOGRAM_BINS // 8)
# Keys either side of the codewords' midpoint searched first for a bucket's jump (the jump
# of the fp32 nearest rule lies within a few ulps of it; a miss falls back to the bucket).
_WINDOW = 4

# fp32 values <-> int64 keys with the same order (-0.0 just below +0.0); NaNs excluded.
_NEG_INF_KEY = -1 - 0x7F800000
_POS_INF_KEY = 0x7F800000


def _to_key(x: Tensor) -> Tensor:
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, -1 - (bits & 0x7FFFFFFF))


def _from_key(key: Tensor) -> Tensor:
    bits = torch.where(key >= 0, key, (-1 - key) | 0x80000000)
    # The low 32 bits as int32 (two's complement), then reinterpreted as fp32.
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


def _bucket(x: Tensor) -> Tensor:
    """The kernels' bucket (``_triton_helpers._bucket``): the same fp32 operations."""
    b = torch.floor((x + 1.0) * float(HISTOGRAM_BINS // 2))
    return b.nan_to_num(nan=0.0).clamp(0, HISTOGRAM_BINS - 1).to(torch.int64)


def _first_key(lo: Tensor, hi: Tensor, pred: functools.partial[Tensor]) -> Tensor:
    """Smallest key ``k`` in ``[lo, hi]`` with ``pred(k)`` (monotone; ``pred(hi)`` true)."""
    lo, hi = lo.clone(), hi.clone()
    while bool((lo < hi).any()):
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        ok = pred(mid)
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid + 1)
    return lo


def _first_key_near(lo: Tensor, hi: Tensor, guess: Tensor, pred: functools.partial[Tensor],
                    bind: Callable[[Tensor], functools.partial[Tensor]]) -> Tensor:
    """:func:`_first_key` started from a window of ``_WINDOW`` keys either side of ``guess``.

    Where ``pred`` is false just below the window and true at its top, the answer lies in
    the window (``pred`` is monotone) and about eight halvings find it instead of about 32
    over the whole range; the other entries (a guess too far off) are searched over
    ``[lo, hi]`` with ``bind(rows)``, ``pred`` restricted to those rows."""
    a = torch.clamp(guess - _WINDOW, min=lo, max=hi)
    b = torch.clamp(guess + _WINDOW, min=a, max=hi)
    valid = pred(b) & ((a == lo) | ~pred(torch.maximum(a - 1, lo)))
    out = _first_key(torch.where(valid, a, b), b, pred)
    rows = torch.nonzero(~valid).flatten()
    if rows.numel():
        out[rows] = _first_key(lo[rows], hi[rows], bind(rows))
    return out


def _bucket_at_least(targets: Tensor, key: Tensor) -> Tensor:
    return _bucket(_from_key(key)) >= targets


@functools.cache
def bucket_key_ranges() -> tuple[Tensor, Tensor]:
    """(first key, last key) of each bucket's fp32 interval, int64 ``[4096]`` each (CPU)."""
    targets = torch.arange(HISTOGRAM_BINS, dtype=torch.int64)
    lo = _first_key(torch.full_like(targets, _NEG_INF_KEY), torch.full_like(targets, _POS_INF_KEY),
                    functools.partial(_bucket_at_least, targets))
    hi = torch.cat([lo[1:] - 1, torch.tensor([_POS_INF_KEY])])
    return lo, hi


Rounding = Callable[[Tensor, Tensor], Tensor]


def _rounding(toward_zero: bool) -> Rounding:
    return toward_zero_codes if toward_zero else nearest_codes


def _code_above(codebook: Tensor, q_lo: Tensor, toward_zero: bool, key: Tensor) -> Tensor:
    return _rounding(toward_zero)(_from_key(key), codebook) > q_lo


def build_decision_table(codebook: Tensor, *, device: torch.device | str | None = None,
                         toward_zero: bool = False) -> Tensor | None:
    """The int64 ``[2 * 4096]`` table of the module docstring (head words, then pair words) on
    ``device`` (default: ``codebook``'s), or
    ``None`` where some bucket holds two jumps (then the bracket search is used).

    ``toward_zero``: the table of the toward-zero rounding
    (:func:`gefen_kernels.ops._quant_ref.toward_zero_codes`, docs/algorithm.md#toward-zero-rounding)
    instead of the nearest rounding. It is monotone too, and jumps at the codewords themselves
    (and, for a codebook without an exact 0, at the nearest rounding's midpoint between the two
    codewords around 0), so the same build and the same kernel lookup serve it.

    Built on the CPU from a copy of the codebook (one device-to-host copy of 1 KiB).
    """
    rounding = _rounding(toward_zero)
    cb = codebook.detach().to("cpu", torch.float32).contiguous()
    lo, hi = bucket_key_ranges()
    q_lo = rounding(_from_key(lo), cb)
    q_hi = rounding(_from_key(hi), cb)
    jump = q_hi != q_lo
    # First key of each bucket whose code is above q_lo (hi + 1 where none is). The nearest
    # rounding's jump is within a few ulps of the codewords' midpoint, the toward-zero
    # rounding's at a codeword (c[q_hi] above 0, just past c[q_lo] below it): search near it
    # first.
    if toward_zero:
        near = torch.where(cb[q_hi] > 0, cb[q_hi], cb[q_lo])
    else:
        near = (cb[q_lo] + cb[q_hi]) * 0.5
    guess = torch.where(jump, _to_key(near), hi + 1)
    first_up = _first_key_near(
        lo, hi + 1, guess, functools.partial(_above_or_past, cb, q_lo, hi, toward_zero),
        lambda rows: functools.partial(_above_or_past, cb, q_lo[rows], hi[rows], toward_zero))
    if bool((jump & (rounding(_from_key(torch.minimum(first_up, hi)), cb) != q_hi)).any()):
        return None
    threshold = torch.where(jump, _from_key(first_up - 1), torch.tensor(float("inf")))
    t_bits = threshold.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    head = t_bits | (q_lo << 32) | (q_hi << 40)
    c_bits = cb.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    pair = c_bits[q_lo] | (c_bits[q_hi] << 32)
    return torch.cat([head, pair]).to(codebook.device if device is None else device)


def _above_or_past(cb: Tensor, q_lo: Tensor, hi: Tensor, toward_zero: bool,
                   key: Tensor) -> Tensor:
    past = key > hi
    return past | _code_above(cb, q_lo, toward_zero, torch.minimum(key, hi))


def staged_section(table: Tensor) -> Tensor | None:
    """The staged section of a CPU decision table: int64 ``[640]``, or ``None`` where some
    bucket's jump skips a code (``q_hi != q_lo + 1``: a repeated codeword).

    Words ``[0, 512)`` hold ``q_lo`` of every bucket as bytes (bucket ``b`` is byte ``b``,
    little-endian), words ``[512, 640)`` the fp32 threshold ``t[i]`` of every code ``i``: the
    largest fp32 value whose code is at most ``i`` where that value lies inside a
    bucket (the bucket's own threshold), ``+inf`` otherwise. Because each bucket jumps at most
    once and only to the next code, ``q = q_lo[b] + (x > t[q_lo[b]])`` is the head word's rule
    for every ``x`` of bucket ``b``; the build checks it at every bucket's last value.

    Both parts, 5 KiB, are small enough for a program to copy into shared memory once per
    tile and look up there (``tl.gather``), where the head word is a random 8-byte load from
    a 32 KiB table: about one L1 wavefront per element, which made the L1 the step tile
    kernel's busiest unit (90 % in block mode, Nsight Compute).
    """
    head = table[:HISTOGRAM_BINS]
    t_bits = (head & 0xFFFFFFFF).to(torch.int32)  # wraps to the fp32 bit pattern
    q_lo, q_hi = (head >> 32) & 255, (head >> 40) & 255
    jump = q_hi != q_lo
    if bool((jump & (q_hi != q_lo + 1)).any()):
        return None
    thresholds = torch.full((256,), float("inf"))
    thresholds.view(torch.int32)[q_lo[jump]] = t_bits[jump]
    # A bucket without a jump must stay at q_lo up to its last value.
    _, hi = bucket_key_ranges()
    calm = ~jump
    if not bool((thresholds[q_lo[calm]] >= _from_key(hi[calm])).all()):
        return None
    codes = q_lo.to(torch.uint8).view(torch.int64)
    return torch.cat([codes, thresholds.view(torch.int64)])


def kernel_table_layout(codebook: Tensor) -> tuple[Tensor, int] | None:
    """The kernels' table for nearest rounding with toward-zero rounding of zero-gradient
    elements (docs/algorithm.md#toward-zero-rounding), on the CPU: ``(table, STEPS)``, or
    ``None`` where either rounding has no decision table (then the bracket search serves both).

    Layout (int64 words): the nearest rounding's decision table (``[0, 8192)``: head words,
    pair words), the toward-zero rounding's (``[TOWARD_ZERO, TOWARD_ZERO + 8192)``), and, with
    ``STEPS = STAGED_STEPS``, both staged sections, split so that one index offset selects the
    rounding: the nearest then the toward-zero lower codes (``[STAGED_CODES, +1024)``, bucket
    ``b`` of the toward-zero rounding is byte ``4096 + b``), then the nearest then the
    toward-zero thresholds (``[STAGED_THRESHOLDS, +256)``, code ``i`` of the toward-zero
    rounding is threshold ``256 + i``). A kernel adds ``4096`` to an element's bucket and
    ``256`` to its threshold index (or ``TOWARD_ZERO`` to its head and pair word) where the
    element's gradient is exactly 0: a compare and a select, the same loads. ``STEPS =
    DIRECT_STEPS`` where either staged section does not exist.
    """
    near = build_decision_table(codebook, device="cpu")
    toward = build_decision_table(codebook, device="cpu", toward_zero=True)
    if near is None or toward is None:
        return None
    staged_near, staged_toward = staged_section(near), staged_section(toward)
    if staged_near is None or staged_toward is None:
        return torch.cat([near, toward]), DIRECT_STEPS
    codes = HISTOGRAM_BINS // 8
    return torch.cat([near, toward, staged_near[:codes], staged_toward[:codes],
                      staged_near[codes:], staged_toward[codes:]]), STAGED_STEPS


# The nearest-rounding kernel tables, per codebook (weakly keyed).
_NEAREST_CACHE = WeakIdKeyDictionary()


def _build_nearest_table(codebook: Tensor) -> tuple[Tensor, int]:
    built = kernel_table_layout(codebook)
    if built is None:
        return build_kernel_table(codebook)
    table, steps = built
    return table.to(codebook.device), steps


def kernel_table(codebook: Tensor, *, stochastic: bool = False) -> tuple[Tensor, int]:
    """Cached kernel table for ``codebook``: ``(table, STEPS)``.

    Nearest rounding (``stochastic=False``) gets the decision tables of
    :mod:`._decision_table`, here (nearest, and toward-zero for zero-gradient elements:
    :func:`kernel_table_layout`) where the codebook allows them, with their
    staged sections (``STEPS = STAGED_STEPS``) where those exist too, else alone
    (``DIRECT_STEPS``); else the packed search table. Stochastic rounding needs the bracket
    and always gets the packed search table (the toward-zero rounding then comes from the
    bracket too). ``(codebook, 0)`` means "use the full search".
    """
    if stochastic:
        return stochastic_kernel_table(codebook)
    return cached(_NEAREST_CACHE, _build_nearest_table, codebook)
