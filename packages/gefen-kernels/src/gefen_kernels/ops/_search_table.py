"""The codebook search table of docs/algorithm.md#quantizer (acceleration only; never changes a
code).

``L[b]`` (int32, ``b = 0 .. 4096``) counts the codewords whose bucket
``clamp(floor((c + 1) * 2048), 0, 4095)`` (fp32) is below ``b``. For any ``x``, the lower bound
of ``x`` in the codebook lies in ``[L[bucket(x)], L[bucket(x) + 1]]``: a codeword in a lower
bucket is below ``x`` and one in a higher bucket above it, because the bucket map is monotone
and computed identically (fp32) here and in the kernels. A learned codebook has at most about
one codeword per bucket, so one or two probes replace the eight of a full binary search.

Building a table reads the widest range back to the host (one synchronisation), so tables are
cached per codebook tensor and its version counter; the cache is keyed on the tensor object
(weakly), so a new or modified codebook gets a new table. During CUDA-graph capture a missing
table is not built: the kernels then take the full search (same codes).

The Triton kernels use a packed form of the same table (:func:`build_kernel_table`, int64
``[4097 + 256]``) so one gather replaces several: entry ``b < 4097`` holds ``L[b]`` in its low
32 bits and, in its high 32 bits, the fp32 bit pattern of ``c[L[b]]`` when bucket ``b`` holds a
codeword (``L[b + 1] > L[b]``), else of ``+inf`` (the one probe of a single-step search reads it
instead of the codebook; ``+inf < x`` is false for every ``x``, as an empty range never moves).
Entry ``4097 + j`` holds the bit patterns of ``c[max(j - 1, 0)]`` (low) and ``c[j]`` (high): the
two codewords around ``R = j`` of docs/algorithm.md#quantizer in one load. Only bit patterns are
copied: the kernels compare and subtract exactly the codewords the codebook holds.

Nearest rounding usually takes the decision table of :mod:`._decision_table` instead (one
lookup, no search): :func:`._decision_table.kernel_table` chooses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .._numerics import HISTOGRAM_BINS

# Keyed on tensor identity (a weak reference): tensors compare elementwise, not by identity.
_CACHE = WeakIdKeyDictionary()
_KERNEL_CACHE = WeakIdKeyDictionary()

KERNEL_PAIRS_OFFSET = HISTOGRAM_BINS + 1  # first pair entry of the packed kernel table


def build_search_table(codebook: Tensor) -> tuple[Tensor, int]:
    """(int32 ``[4097]`` table on the codebook's device, probes needed ``>= 1``)."""
    bucket = torch.floor((codebook + 1.0) * float(HISTOGRAM_BINS // 2))
    bucket = bucket.clamp_(0, HISTOGRAM_BINS - 1).to(torch.int64)
    edges = torch.arange(HISTOGRAM_BINS + 1, device=codebook.device, dtype=torch.int64)
    table = torch.searchsorted(bucket, edges, right=False).to(torch.int32)
    widest = int((table[1:] - table[:-1]).max())
    return table, max(1, widest.bit_length())


def cached(cache: Any, build: Callable[[Tensor], tuple[Tensor, int]],
            codebook: Tensor) -> tuple[Tensor, int]:
    """``build(codebook)`` cached per codebook tensor and version; ``(codebook, 0)`` ("use the
    full search") while a CUDA graph is being captured and nothing is cached yet."""
    hit = cache.get(codebook)
    if hit is not None and hit[0] == codebook._version:
        return hit[1], hit[2]
    if codebook.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return codebook, 0
    table, steps = build(codebook)
    cache[codebook] = (codebook._version, table, steps)
    return table, steps


def search_table(codebook: Tensor) -> tuple[Tensor, int]:
    """Cached table for ``codebook``; ``(codebook, 0)`` means "use the full search"."""
    return cached(_CACHE, build_search_table, codebook)


def _bits(values: Tensor) -> Tensor:
    """fp32 bit patterns as non-negative int64 (the low 32 bits of a packed entry)."""
    return values.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def build_kernel_table(codebook: Tensor) -> tuple[Tensor, int]:
    """(packed int64 ``[4097 + 256]`` table of the module docstring, probes needed ``>= 1``)."""
    table, steps = build_search_table(codebook)
    lo = table.to(torch.int64)
    count = torch.cat([lo[1:] - lo[:-1], lo.new_zeros(1)])
    inf = torch.full_like(codebook[:1], float("inf"))
    probe = torch.cat([codebook, inf])[lo.clamp(max=codebook.numel())]
    probe = torch.where(count > 0, probe, inf)
    entries = lo | (_bits(probe) << 32)
    left = torch.cat([codebook[:1], codebook[:-1]])
    pairs = _bits(left) | (_bits(codebook) << 32)
    return torch.cat([entries, pairs]), steps


def stochastic_kernel_table(codebook: Tensor) -> tuple[Tensor, int]:
    """Cached :func:`build_kernel_table` of ``codebook`` (the table stochastic rounding
    reads; :func:`._decision_table.kernel_table` chooses per rounding)."""
    return cached(_KERNEL_CACHE, build_kernel_table, codebook)
