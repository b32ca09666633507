"""Histogram of block-normalised gradients (docs/algorithm.md#histogram).

The flattened gradient is viewed as ``[B, P]``; each block is divided by its max-abs
``a_b`` (``z = 0`` when ``a_b == 0``). A ``z`` that is exactly 0 (a zero gradient, an all-zero
block, or a quotient that underflows) is counted in the zero bin, index 4096
(``gefen_kernels._numerics.ZERO_BIN``), whose point is exactly 0 (the zero codeword,
docs/algorithm.md#zero-codeword); every other ``z`` is binned by
``clamp(floor((z + 1) * 2048), 0, 4095)`` in fp32: ``-1`` lands in bin 0, ``+1`` in bin 4095.
The result has 4097 exact int64 counts. Blocks whose max-abs is not finite (a NaN or Inf in
the block) are skipped entirely (non-finite policy O9, :mod:`gefen_kernels._numerics`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _validation as V
from .._numerics import HISTOGRAM_BINS, HISTOGRAM_SIZE, ZERO_BIN
from .._triton import program_elements, require_triton, triton
from ._chunks import block_groups
from ._device import check_device_for_triton, on_tensor_device, use_triton
from ._histogram_kernels import (
    _histogram_partial_max_kernel,
    _histogram_split_kernel,
    _histogram_tile_kernel,
)
from ._triton_helpers import LAUNCH_OPTIONS
from .period_scores import reject_dtensor

__all__ = ["histogram", "histogram_reference", "histogram_sum", "histogram_triton"]


def _check(grad: Tensor, period: int) -> int:
    reject_dtensor("grad", grad)
    V.check_tensor("grad", grad)
    V.check_float("grad", grad)
    if grad.is_complex():
        raise TypeError("grad must be real")
    V.check_contiguous("grad", grad)
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise ValueError(f"period must be a positive int, got {period!r}")
    numel = grad.numel()
    if numel % period != 0:
        raise ValueError(f"period {period} does not divide grad.numel() = {numel}")
    return numel // period


def _bins(g: Tensor, amax: Tensor) -> Tensor:
    """Bin indices (int64) of fp32 ``g`` rows normalised by their fp32 ``amax`` ``[n, 1]``;
    ``ZERO_BIN`` where the normalised value is exactly 0."""
    positive = amax > 0
    z = torch.where(positive, g / torch.where(positive, amax, torch.ones_like(amax)),
                    torch.zeros_like(g))
    idx = torch.floor((z + 1.0) * float(HISTOGRAM_BINS // 2))
    idx = idx.clamp_(0, HISTOGRAM_BINS - 1).to(torch.int64)
    return idx.masked_fill_(z == 0, ZERO_BIN)


def histogram_reference(grad: Tensor, period: int) -> Tensor:
    """Histogram of ``grad`` viewed as ``[N / period, period]``; int64 ``[4097]``.

    Args:
        grad: contiguous float tensor (any float dtype; converted to fp32 chunk by chunk).
        period: block length ``P`` dividing ``grad.numel()``.

    Returns:
        int64 ``[4097]`` on ``grad``'s device: bins 0-4095 and the zero bin (index 4096, module
        docstring); the counts sum to ``N`` minus the elements of blocks with a non-finite
        max-abs.

    Raises:
        TypeError, ValueError: non-float, non-contiguous ``grad`` or a bad ``period``.
    """
    num_blocks = _check(grad, period)
    counts = torch.zeros(HISTOGRAM_SIZE, dtype=torch.int64, device=grad.device)
    flat = grad.view(-1)
    for group in block_groups(num_blocks, period):
        nb = group.stop - group.first
        rows = nb if len(group.tiles) == 1 else 1
        amax: Tensor | None = None
        for start, end in group.tiles:
            tile_max = flat[start:end].view(rows, -1).float().abs().amax(dim=1, keepdim=True)
            amax = tile_max if amax is None else torch.maximum(amax, tile_max)
        assert amax is not None
        finite = torch.isfinite(amax)
        for start, end in group.tiles:
            g = flat[start:end].view(rows, -1).float()
            idx = _bins(g, amax)
            # Non-finite blocks go to an overflow bin that is dropped below.
            idx = torch.where(finite, idx, HISTOGRAM_SIZE)
            counts += torch.bincount(idx.view(-1), minlength=HISTOGRAM_SIZE + 1)[:HISTOGRAM_SIZE]
    return counts


# Launch shapes of the histogram kernels (ops/_histogram_kernels.py).
_HIST_TILE = 2048  # elements per program (tile route) / per iteration (split route)
_HIST_TILE_MAX_PERIOD = 4096
_HIST_SPLIT = 16384  # elements of one block per program (split route)
_HIST_CHUNK = 1 << 24  # bin indices per count (fp32: 64 MiB; fp32 counts exact up to 2**24)


def _index_chunk(flat: Tensor, idx: Tensor, num_blocks: int, period: int, route: str,
                 split_elements: int) -> None:
    """Write the bin of every element of ``flat`` (``num_blocks`` whole blocks) into ``idx``."""
    if route == "tile":
        p2 = 1 << max(0, (period - 1).bit_length())
        bpp = max(1, program_elements(_HIST_TILE) // p2)
        _histogram_tile_kernel[(triton.cdiv(num_blocks, bpp),)](
            flat, idx, num_blocks, period, BPP=bpp, P2=p2, NUM_BINS=HISTOGRAM_BINS,
            num_warps=8, **LAUNCH_OPTIONS)
        return
    num_splits = triton.cdiv(period, split_elements)
    tile = min(_HIST_TILE, split_elements)
    part = torch.empty(num_blocks, num_splits, dtype=torch.float32, device=flat.device)
    # One flat grid axis: CUDA caps grid y at 65535, which blocks or splits can exceed.
    _histogram_partial_max_kernel[(num_blocks * num_splits,)](
        flat, part, period, num_splits, SPLIT=split_elements, TILE=tile, num_warps=8,
        **LAUNCH_OPTIONS)
    amax = part.amax(dim=1)
    _histogram_split_kernel[(num_blocks * num_splits,)](
        flat, amax, idx, period, num_splits, SPLIT=split_elements, TILE=tile,
        NUM_BINS=HISTOGRAM_BINS, num_warps=8, **LAUNCH_OPTIONS)


def _triton_counts(items: Sequence[tuple[Tensor, int]], device: torch.device, *,
                   route: str | None = None, split_elements: int = _HIST_SPLIT) -> Tensor:
    """Summed counts of checked, contiguous, non-empty ``(grad, period)`` pairs on one device.

    The bins of whole blocks (one block at least) go into a shared fp32 buffer of up to
    ``_HIST_CHUNK`` elements, and :func:`_count` counts each filled buffer, without a host
    sync.
    """
    counts = torch.zeros(HISTOGRAM_SIZE, dtype=torch.int64, device=device)
    total = sum(g.numel() for g, _ in items)
    buf = torch.empty(min(total, _HIST_CHUNK), dtype=torch.float32, device=device)
    used = 0
    for grad, period in items:
        if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            grad = grad.to(torch.float32)
        flat = grad.view(-1)
        num_blocks = flat.numel() // period
        chosen = route or ("tile" if period <= _HIST_TILE_MAX_PERIOD else "split")
        per_chunk = max(1, _HIST_CHUNK // period)  # whole blocks per chunk
        for first in range(0, num_blocks, per_chunk):
            nb = min(per_chunk, num_blocks - first)
            n = nb * period
            if used + n > buf.numel():
                if used:
                    counts += _count(buf[:used])
                    used = 0
                if n > buf.numel():  # one block longer than the buffer
                    buf = torch.empty(n, dtype=torch.float32, device=device)
            _index_chunk(flat[first * period:first * period + n], buf[used:used + n], nb,
                         period, chosen, split_elements)
            used += n
    if used:
        counts += _count(buf[:used])
    return counts


def _count(bins: Tensor) -> Tensor:
    """int64 ``[4097]`` counts of the fp32 bin indices ``bins`` (``-1`` dropped)."""
    if bins.numel() > 1 << 24:
        # One block longer than the buffer: fp32 counts would stop being exact.
        return sum((_count(part) for part in bins.split(1 << 24)),
                   torch.zeros(HISTOGRAM_SIZE, dtype=torch.int64, device=bins.device))
    if torch.are_deterministic_algorithms_enabled():
        shifted = bins.to(torch.int64) + 1  # -1 -> 0, dropped below
        return torch.bincount(shifted, minlength=HISTOGRAM_SIZE + 1)[1:]
    return torch.histc(bins, bins=HISTOGRAM_SIZE, min=0, max=HISTOGRAM_SIZE).to(torch.int64)


@on_tensor_device
def histogram_triton(grad: Tensor, period: int, *, _route: str | None = None,
                     _split_elements: int = _HIST_SPLIT) -> Tensor:
    """Triton twin of :func:`histogram_reference` (same signature, identical counts).

    Whole blocks of at most ``_HIST_CHUNK`` elements (or one block) at a time: a kernel writes
    each element's bin and ``torch.histc`` counts them (no host sync; see the kernels'
    comment).

    Raises:
        ImportError: Triton is not installed. TypeError, ValueError: as the reference, plus
            non-CUDA tensors outside the interpreter.
    """
    _check(grad, period)
    require_triton("the Triton histogram")
    check_device_for_triton(grad)
    if grad.numel() == 0:
        return torch.zeros(HISTOGRAM_SIZE, dtype=torch.int64, device=grad.device)
    return _triton_counts([(grad, period)], grad.device, route=_route,
                          split_elements=_split_elements)


@torch.library.custom_op("gefen::histogram", mutates_args=())
def _histogram_op(grad: Tensor, period: int) -> Tensor:
    return histogram_reference(grad, period)


@_histogram_op.register_kernel("cuda")
def _histogram_cuda(grad: Tensor, period: int) -> Tensor:
    if use_triton(grad):
        return histogram_triton(grad, period)
    return histogram_reference(grad, period)


@_histogram_op.register_fake
def _histogram_fake(grad: Tensor, period: int) -> Tensor:
    return torch.empty(HISTOGRAM_SIZE, dtype=torch.int64, device=grad.device)


def histogram(grad: Tensor, period: int) -> Tensor:
    """int64 ``[4097]`` histogram through ``torch.ops.gefen.histogram`` (see the reference)."""
    _check(grad, period)
    return torch.ops.gefen.histogram(grad, period)


def histogram_sum(grads: Sequence[Tensor], periods: Sequence[int], *,
                  reference: bool | Sequence[bool] = False) -> Tensor:
    """Summed histogram of many gradients, each with its own period; int64 ``[4097]`` on the CPU
    (bins 0-4095, then the zero bin).

    The codebook pass of a whole model (docs/algorithm.md#codebook, docs/algorithm.md#histogram):
    each gradient's counts are added into one int64 accumulator per device (exact, order-independent
    integer sums) and each accumulator is copied to the host once. On the Triton path a device's
    contiguous gradients share fp32 bin buffers of up to 16M elements, counted without a host sync:
    a model's pass costs one sync per device.

    Args:
        grads: float tensors (any float dtype and device; a non-contiguous one is copied once by
            ``.contiguous()``). Under FSDP2 pass local shards (``grad.to_local()``).
        periods: block length ``P`` of each gradient, dividing its numel.
        reference: ``True`` bins with :func:`histogram_reference` (the PyTorch path) instead of
            the dispatching :func:`histogram`; one bool for all or one per gradient.

    Returns:
        int64 ``[4097]`` on the CPU: the sum of the per-tensor histograms.

    Raises:
        TypeError, ValueError: as :func:`histogram`, naming the offending position, before any
            counting; ``grads``, ``periods`` (and a per-gradient ``reference``) of different
            lengths.
    """
    grads = list(grads)
    periods = list(periods)
    refs = [reference] * len(grads) if isinstance(reference, bool) else list(reference)
    if not len(grads) == len(periods) == len(refs):
        raise ValueError(f"grads, periods and reference must have the same length, got "
                         f"{len(grads)}, {len(periods)} and {len(refs)}")
    for idx, (grad, period) in enumerate(zip(grads, periods)):
        try:
            if not isinstance(grad, Tensor):
                raise TypeError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
            _check(grad if grad.is_contiguous() else grad.contiguous(), period)
        except (TypeError, ValueError) as err:
            raise type(err)(f"grads[{idx}]: {err}") from err
    acc: dict[torch.device, Tensor] = {}
    # The Triton path's tensors of each device share bin buffers (_triton_counts);
    # the others go through the op one by one.
    batched: dict[torch.device, list[tuple[Tensor, int]]] = {}
    for grad, period, ref in zip(grads, periods, refs):
        if not ref and use_triton(grad) and grad.numel() and grad.is_contiguous():
            # (A contiguous copy of a strided gradient is binned now, not kept for the batch.)
            batched.setdefault(grad.device, []).append((grad, period))
            continue
        g = grad if grad.is_contiguous() else grad.contiguous()
        counts = (histogram_reference if ref else histogram)(g, period)
        if g.device in acc:
            acc[g.device] += counts
        else:
            acc[g.device] = counts
    for device, items in batched.items():
        with torch.cuda.device(device):  # Triton launches on the current device (on_tensor_device)
            counts = _triton_counts(items, device)
        if device in acc:
            acc[device] += counts
        else:
            acc[device] = counts
    total = torch.zeros(HISTOGRAM_SIZE, dtype=torch.int64)
    for counts in acc.values():
        total += counts.cpu()  # the one sync for this device
    return total
