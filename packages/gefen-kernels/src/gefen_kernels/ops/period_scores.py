"""Period-search scores for every candidate period in one pass (docs/algorithm.md#period-search).

For a flattened gradient ``g`` (``N`` elements, logical row-major order) and ascending candidate
periods ``p`` dividing ``N`` (``B_p = N / p`` blocks ``[b*p, (b+1)*p)``):

* ``"log_contrast"`` (Variant L): ``x_i = ln(f32(g_i * g_i) + 1e-12)`` (the square in fp32, the
  log and everything after in fp64); block log-means ``mu_b = (1/p) sum_{i in b} x_i``;
  ``S(p) = (1/(B_p - 1)) sum_b |mu_{b+1} - mu_b|``. Needs ``B_p >= 2``.
* ``"variance"`` (Variant V): ``y_i = g_i^2`` (``g`` in fp32, then squared in fp64); per block the
  population variance ``max(0, sum(y^2)/p - (sum(y)/p)^2)`` from fp64 block sums;
  ``E(p) = sqrt((1/B_p) sum_b Var_b)``; ``E(1) = 0`` (reported as ``0 * sum(y)`` so that a
  non-finite gradient still shows as a non-finite score).

How (docs/algorithm.md#period-search: one pass, no pass and no host sync per candidate). The tensor
is read once, in chunks of whole elements. Per chunk the transformed values get an fp64 *exclusive
prefix sum local to the chunk* (``E[0] = 0``, ``E[u] = sum`` of the chunk's first ``u`` values): a
flat running sum over 10^9 elements would lose the digits that adjacent-block differences need, a
chunk-local one loses at most ``eps * chunk * max|x|``. Block ends are multiples of ``p``, so
every block sum of every candidate is a difference of ``E`` sampled at those multiples, plus the
partial sum of a block left open by the previous chunk (carried per candidate). All candidates'
block ends in a chunk are gathered together, so the work is ``O(sum_p chunk / p)`` per chunk and
the number of operations does not depend on the number of candidates. Candidate ``p = 1`` uses
the values themselves. Reductions run in a fixed order (no atomics): the scores are
deterministic. The result stays on the device; the caller reads it with one sync.

Non-finite input is not an error here: a NaN or Inf gradient (or, for Variant L, a square that
overflows fp32) makes every score that covers it non-finite, ``S(1)`` and ``E(1)`` included;
``gefen_core.period.search_period`` turns that into an error.

The Triton path (:mod:`._period_kernels`) forms chunk-local prefix sums the same way (fp64 tile
scans plus fp64 tile offsets, over longer chunks) and computes every candidate's block sums and
terms with the same expressions in four kernels per chunk, without the reference's per-chunk
torch glue. Scores agree with the reference to fp64 rounding (chunk length, the tile offsets'
scan and the order of adding the terms differ).

:func:`multi_period_scores` scores many tensors of one device in one call: the reference loops
over :func:`period_scores_reference`; the Triton path packs the chunks of all tensors into
rounds of four launches each (:func:`._period_kernels.scores_triton_many`), so the number of
launches follows the total size, not the number of tensors, and each tensor's scores equal
:func:`period_scores_triton`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _validation as V
from .._triton import require_triton
from ._device import check_device_for_triton, on_tensor_device, use_triton
from ._period_kernels import TILE as _KERNEL_TILE
from ._period_kernels import host_to_device, scores_triton, scores_triton_many

__all__ = [
    "LOG_EPS",
    "VARIANTS",
    "multi_period_scores",
    "multi_period_scores_reference",
    "multi_period_scores_triton",
    "period_scores",
    "period_scores_reference",
    "period_scores_triton",
]

#: The two score definitions (docs/algorithm.md#period-search).
VARIANTS = ("log_contrast", "variance")
#: ``epsilon`` inside ``ln(g^2 + epsilon)`` (Appendix A).
LOG_EPS = 1e-12

# Elements per chunk: bounds the fp64 scratch whatever the tensor size (the reference's prefix
# sums and gathered block ends: tens of MiB; the Triton path's scans: 64 MiB, 128 for Variant V).
_CHUNK_REFERENCE = 1 << 19
_CHUNK_TRITON = 1 << 23  # _period_kernels: no per-block-end temporaries, 64 MiB of fp64 scans
_TILE = _KERNEL_TILE  # elements per tile scan, as the Triton path's: the same prefix sums
# Rounds of the batched Triton path: each round's tile scans hold at most
# clamp(total / _ROUND_SHARE, _CHUNK_TRITON, _ROUND_CHUNKS * _CHUNK_TRITON) elements per row.
# A small model's search keeps the one-chunk scratch (64 MiB, 128 for Variant V); a large one's
# takes fewer, larger rounds, with scratch at most half the bytes of its bf16 gradients (the
# search runs before the optimizer state, which takes more) and at most 256 MiB (512).
_ROUND_SHARE = 16
_ROUND_CHUNKS = 4
_BATCHED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _round_elements(total: int) -> int:
    return min(max(total // _ROUND_SHARE, _CHUNK_TRITON), _ROUND_CHUNKS * _CHUNK_TRITON)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def reject_dtensor(name: str, t: object) -> None:
    """Raise a TypeError naming the fix when ``t`` is a ``torch.distributed`` DTensor.

    The ops work on one device's memory: under FSDP2 (or any DTensor parameter) the caller
    passes the local shard, ``t.to_local()``, and reduces across ranks itself.
    """
    if type(t) is Tensor or not isinstance(t, Tensor) or not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        raise TypeError(f"{name} is a DTensor; gefen ops take the local shard: pass "
                        f"{name}.to_local() (the optimizer steps local shards; a distributed "
                        "caller reduces the statistics across ranks itself)")


def _check_meta(grad: Tensor, candidates: Tensor, variant: str, grad_name: str = "grad",
                cand_name: str = "candidates") -> None:
    reject_dtensor(grad_name, grad)
    reject_dtensor(cand_name, candidates)
    V.check_tensor(grad_name, grad)
    V.check_float(grad_name, grad)
    if grad.is_complex():
        raise TypeError(f"{grad_name} must be real")
    V.check_contiguous(grad_name, grad)
    V.check_tensor(cand_name, candidates)
    if candidates.dtype != torch.int64 or candidates.dim() != 1:
        raise ValueError(f"{cand_name} must be a 1-D int64 tensor, got {candidates.dtype} "
                         f"of shape {list(candidates.shape)}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def _host_candidates(grad: Tensor, candidates: Tensor, variant: str,
                     grad_name: str = "grad", cand_name: str = "candidates") -> list[int]:
    """The candidate values as Python ints, checked against ``N`` (reads them to the host)."""
    cands = [int(p) for p in candidates.tolist()]
    numel = grad.numel()
    for p in cands:
        if p < 1 or numel % p != 0:
            raise ValueError(f"every candidate must be a positive divisor of {grad_name}.numel()"
                             f" = {numel}, got {p}")
        if variant == "log_contrast" and numel // p < 2:
            raise ValueError(f"log_contrast needs at least 2 blocks per candidate; p = {p} "
                             f"gives {numel // p} for {grad_name}.numel() = {numel}")
    if any(b <= a for a, b in zip(cands, cands[1:])):
        raise ValueError(f"{cand_name} must be strictly ascending")
    return cands


def _check_lists(grads: list[Tensor], candidates: list[Tensor], variant: str) -> None:
    """:func:`_check_meta` of every ``(grads[i], candidates[i])``, naming ``i``; one device."""
    if len(candidates) != len(grads):
        raise ValueError(f"candidates has {len(candidates)} tensors but grads has {len(grads)}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    for i, (grad, cands) in enumerate(zip(grads, candidates)):
        _check_meta(grad, cands, variant, f"grads[{i}]", f"candidates[{i}]")
        if grad.device != grads[0].device:
            raise ValueError(f"grads[{i}] is on {grad.device}, grads[0] on {grads[0].device}; "
                             "call multi_period_scores once per device")


# --------------------------------------------------------------------------------------------
# Chunk transforms with local prefix sums
# --------------------------------------------------------------------------------------------
def _transform_reference(chunk: Tensor, variant: str) -> tuple[Tensor, Tensor]:
    """``(values, E)``: transformed fp64 values ``[A, n]`` and exclusive prefix ``[A, n + 1]``.

    ``A = 1`` (``x``) for log_contrast, ``A = 2`` (``y``, ``y^2``) for variance. The prefix is
    blocked like the Triton path's: fp64 scans of ``_TILE``-element tiles plus an fp64 scan of
    the tile totals. A flat sequential scan would accumulate rounding error in proportion to the
    chunk length times the running sum (``x`` has a mean of several units), which on blocks of
    millions of elements shows in the 9th digit of ``S(p)``.
    """
    g = chunk.to(torch.float32)
    if variant == "log_contrast":
        values = torch.log((g * g).to(torch.float64) + LOG_EPS).unsqueeze(0)
    else:
        y = g.to(torch.float64).square()
        values = torch.stack((y, y * y))
    rows, n = values.shape
    num_tiles = -(-n // _TILE)
    tiles = torch.zeros(rows, num_tiles * _TILE, dtype=torch.float64, device=chunk.device)
    tiles[:, :n] = values
    scan = tiles.view(rows, num_tiles, _TILE).cumsum_(dim=2)
    totals = scan[:, :, -1]
    offsets = torch.cumsum(totals, dim=1) - totals  # exclusive, fp64, in tile order
    scan += offsets.unsqueeze(2)
    prefix = torch.zeros(rows, n + 1, dtype=torch.float64, device=chunk.device)
    prefix[:, 1:] = scan.view(rows, -1)[:, :n]
    return values, prefix


# --------------------------------------------------------------------------------------------
# Scores from chunk-local prefix sums (the reference)
# --------------------------------------------------------------------------------------------
def _scores(grad: Tensor, cands: list[int], variant: str, chunk: int) -> Tensor:
    dev = grad.device
    numel = grad.numel()
    out = torch.empty(len(cands), dtype=torch.float64, device=dev)
    if not cands:
        return out
    flat = grad.view(-1)
    log_contrast = variant == "log_contrast"
    has_one = cands[0] == 1
    ps = cands[1:] if has_one else cands
    k = len(ps)
    rows = 1 if log_contrast else 2
    p_int = host_to_device(ps, dev)
    p_flt = p_int.to(torch.float64)
    # Per candidate: sums of the block left open by earlier chunks; (log_contrast) the sum of
    # the last closed block and whether one exists; the running score sum.
    open_sum = torch.zeros(rows, k, dtype=torch.float64, device=dev)
    last_sum = torch.zeros(k, dtype=torch.float64, device=dev)
    closed = torch.zeros(k, dtype=torch.bool, device=dev)
    acc = torch.zeros(k, dtype=torch.float64, device=dev)
    one_acc = torch.zeros((), dtype=torch.float64, device=dev)
    one_last: Tensor | None = None
    cand_ids = torch.arange(k, device=dev)

    for start in range(0, numel, chunk):
        n = min(chunk, numel - start)
        values, prefix = _transform_reference(flat[start:start + n], variant)
        total = prefix[:, n]
        if has_one:
            if log_contrast:
                x = values[0]
                one_acc = one_acc + (x[1:] - x[:-1]).abs().sum()
                if one_last is not None:
                    one_acc = one_acc + (x[0] - one_last).abs()
                one_last = x[-1]
            else:
                one_acc = one_acc + total[0]
        if k == 0:
            continue
        # Block ends in this chunk: the first at local offset p - start % p, then every p. The
        # total is counted on the host (Python ints), the per-candidate values on the device.
        n_ends = sum(0 if p - start % p > n else (n - p + start % p) // p + 1 for p in ps)
        if n_ends == 0:
            open_sum = open_sum + total.unsqueeze(1)
            continue
        first = p_int - torch.remainder(start, p_int)
        cnt = torch.where(first > n, 0, torch.div(n - first, p_int, rounding_mode="floor") + 1)
        # Candidates' block ends are laid out in *descending* p order: the per-candidate score
        # sums below are differences of one running sum over all of them, whose rounding error
        # is relative to the running sum before the segment. Ascending order would put the one
        # or two terms of the largest p after ~chunk/2 terms of p = 2 (a running sum in the
        # millions against terms near 0.05: ~1e-9 relative error); descending order keeps
        # every segment's prefix no larger than the sums of the larger candidates before it.
        seg_start = n_ends - torch.cumsum(cnt, 0)
        cid = torch.repeat_interleave(cand_ids.flip(0), cnt.flip(0), output_size=n_ends)
        rank = torch.arange(n_ends, device=dev) - seg_start[cid]
        p_of = p_int[cid]
        pos = first[cid] + rank * p_of
        is_first = rank == 0
        here = prefix[:, pos]
        before = prefix[:, (pos - p_of).clamp_(min=0)]
        # Block sums of every block ending in this chunk; the first one adds the open part.
        sums = torch.where(is_first, open_sum[:, cid] + here, here - before)
        pf = p_flt[cid]
        if log_contrast:
            mean = sums[0] / pf
            prev = torch.where(is_first, last_sum[cid] / pf, mean.roll(1))
            term = torch.where(is_first & ~closed[cid], torch.zeros_like(mean),
                               (mean - prev).abs())
        else:
            m1 = sums[0] / pf
            term = (sums[1] / pf - m1 * m1).clamp_(min=0.0)
        csum = torch.zeros(n_ends + 1, dtype=torch.float64, device=dev)
        torch.cumsum(term, 0, out=csum[1:])
        acc = acc + (csum[seg_start + cnt] - csum[seg_start])
        has_end = cnt > 0
        last = (seg_start + cnt - 1).clamp_(min=0)
        last_pos = pos[last]
        open_sum = torch.where(has_end, total.unsqueeze(1) - prefix[:, last_pos],
                               open_sum + total.unsqueeze(1))
        if log_contrast:
            last_sum = torch.where(has_end, sums[0, last], last_sum)
            closed = closed | has_end

    # Tensor by tensor: `int / tensor` is a multiplication by the reciprocal in PyTorch (not
    # exact, e.g. 98 / 49 -> 1.9999999999999998); a division of two fp64 integers is.
    blocks = torch.full_like(p_flt, float(numel)) / p_flt  # exact: p divides N
    if log_contrast:
        scores = acc / (blocks - 1.0)
        one = one_acc / float(numel - 1)
    else:
        scores = torch.sqrt(acc / blocks)
        one = 0.0 * one_acc  # E(1) = 0, NaN-propagating
    if has_one:
        out[0] = one
        out[1:] = scores
    else:
        out.copy_(scores)
    return out


def period_scores_reference(grad: Tensor, candidates: Tensor, variant: str) -> Tensor:
    """Scores of every candidate period, in one pass of chunked fp64 prefix sums.

    Args:
        grad: contiguous real float tensor (any float dtype; converted to fp32 first), ``N``
            elements in logical row-major order; CPU or CUDA.
        candidates: int64 ``[n]``, strictly ascending positive divisors of ``N`` (any device;
            read on the host). For ``"log_contrast"`` each must leave at least 2 blocks.
        variant: ``"log_contrast"`` (``S(p)``, docs/algorithm.md#period-search) or ``"variance"``
        (``E(p)``, docs/algorithm.md#period-search).

    Returns:
        float64 ``[n]`` on ``grad``'s device; non-finite where ``grad`` is (module docstring).

    Raises:
        TypeError, ValueError: a non-float or non-contiguous ``grad``, a malformed candidate
        tensor or value, or an unknown ``variant``.
    """
    _check_meta(grad, candidates, variant)
    cands = _host_candidates(grad, candidates, variant)
    return _scores(grad, cands, variant, _CHUNK_REFERENCE)


@on_tensor_device
def period_scores_triton(grad: Tensor, candidates: Tensor, variant: str) -> Tensor:
    """Triton twin of :func:`period_scores_reference` (same signature and meaning).

    Raises:
        ImportError: Triton is not installed (the message says how to get it).
        ValueError: ``grad`` is not on a CUDA device (outside ``TRITON_INTERPRET=1``), or any
            error of the reference.
    """
    _check_meta(grad, candidates, variant)
    require_triton("period_scores (Triton path)")
    check_device_for_triton(grad)
    cands = _host_candidates(grad, candidates, variant)
    if grad.numel() == 0:  # no chunk to launch: the reference's empty-tensor scores
        return _scores(grad, cands, variant, _CHUNK_REFERENCE)
    return scores_triton(grad, cands, variant, _CHUNK_TRITON)


def _into_one(pieces: list[Tensor], device: torch.device) -> Tensor:
    """The pieces concatenated (written into one buffer: no aliasing, one allocation)."""
    out = torch.empty(sum(p.numel() for p in pieces), dtype=torch.float64, device=device)
    pos = 0
    for piece in pieces:
        out[pos:pos + piece.numel()] = piece
        pos += piece.numel()
    return out


def _multi_reference_flat(grads: list[Tensor], candidates: list[Tensor], variant: str) -> Tensor:
    _check_lists(grads, candidates, variant)
    cands = [_host_candidates(g, c, variant, f"grads[{i}]", f"candidates[{i}]")
             for i, (g, c) in enumerate(zip(grads, candidates))]
    device = grads[0].device if grads else torch.device("cpu")
    return _into_one([_scores(g, c, variant, _CHUNK_REFERENCE) for g, c in zip(grads, cands)],
                     device)


def _multi_triton_flat(grads: list[Tensor], candidates: list[Tensor], variant: str) -> Tensor:
    _check_lists(grads, candidates, variant)
    require_triton("multi_period_scores (Triton path)")
    if not grads:
        return torch.empty(0, dtype=torch.float64)
    cands = [_host_candidates(g, c, variant, f"grads[{i}]", f"candidates[{i}]")
             for i, (g, c) in enumerate(zip(grads, candidates))]
    check_device_for_triton(grads[0])  # after every argument check, as the reference's errors
    # fp64 tensors keep the per-tensor path (converted to fp32 chunk by chunk there), empty ones
    # the reference's empty-tensor scores; a pointer that is not a multiple of the element size
    # cannot be an offset from another tensor's.
    batched = [not c or (g.dtype in _BATCHED_DTYPES and g.numel() > 0
                         and g.data_ptr() % g.element_size() == 0)
               for g, c in zip(grads, cands)]
    members = [i for i, b in enumerate(batched) if b]
    flat = (scores_triton_many([grads[i] for i in members], [cands[i] for i in members],
                               variant, _CHUNK_TRITON,
                               _round_elements(sum(grads[i].numel() for i in members)))
            if members else torch.empty(0, dtype=torch.float64, device=grads[0].device))
    if all(batched):
        return flat
    pieces = dict(zip(members, flat.split([len(cands[i]) for i in members])))
    for i, g in enumerate(grads):
        if not batched[i]:
            pieces[i] = (scores_triton(g, cands[i], variant, _CHUNK_TRITON) if g.numel()
                         else _scores(g, cands[i], variant, _CHUNK_REFERENCE))
    return _into_one([pieces[i] for i in range(len(grads))], grads[0].device)


def multi_period_scores_reference(grads: Sequence[Tensor], candidates: Sequence[Tensor],
                                  variant: str) -> list[Tensor]:
    """:func:`period_scores_reference` of every ``(grads[i], candidates[i])``.

    Args:
        grads: contiguous real float tensors (any float dtype), all on one device (CPU or
            CUDA), each ``N_i`` elements in logical row-major order; ``N_i = 0`` is allowed.
        candidates: one int64 ``[n_i]`` tensor per gradient, strictly ascending positive
            divisors of ``N_i`` (any device; read on the host). For ``"log_contrast"`` each must
            leave at least 2 blocks.
        variant: ``"log_contrast"`` (``S(p)``, docs/algorithm.md#period-search) or ``"variance"``
            (``E(p)``, docs/algorithm.md#period-search), for every tensor.

    Returns:
        One float64 ``[n_i]`` tensor per gradient, on the gradients' device (views of one
        buffer); non-finite where the gradient is (module docstring).

    Raises:
        TypeError, ValueError: as :func:`period_scores_reference`, naming the tensor by its
        index (``grads[i]``, ``candidates[i]``): every tensor's type, layout and device are
        checked first, then every candidate's values; gradients on different devices; lists of
        different lengths.
    """
    grads, candidates = list(grads), list(candidates)
    flat = _multi_reference_flat(grads, candidates, variant)
    return list(flat.split([c.shape[0] for c in candidates]))


@on_tensor_device
def multi_period_scores_triton(grads: Sequence[Tensor], candidates: Sequence[Tensor],
                               variant: str) -> list[Tensor]:
    """Triton twin of :func:`multi_period_scores_reference` (same signature and meaning).

    fp32, bf16 and fp16 gradients are scored together in rounds of four launches
    (:func:`._period_kernels.scores_triton_many`): each tensor's scores equal
    :func:`period_scores_triton`'s bit for bit in Triton's interpreter, and on CUDA where the
    kernels compile to the same layouts (``tests/compile_check.py --compare-layouts``). fp64
    gradients take :func:`period_scores_triton` one by one.

    Raises:
        ImportError: Triton is not installed (the message says how to get it).
        ValueError: the gradients are not on a CUDA device (outside ``TRITON_INTERPRET=1``),
            or any error of the reference.
    """
    grads, candidates = list(grads), list(candidates)
    flat = _multi_triton_flat(grads, candidates, variant)
    return list(flat.split([c.shape[0] for c in candidates]))


# --------------------------------------------------------------------------------------------
# torch.library custom op: CUDA -> Triton (when available), everything else -> reference
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("gefen::period_scores", mutates_args=())
def _period_scores_op(grad: Tensor, candidates: Tensor, variant: str) -> Tensor:
    return period_scores_reference(grad, candidates, variant)


@_period_scores_op.register_kernel("cuda")
def _period_scores_cuda(grad: Tensor, candidates: Tensor, variant: str) -> Tensor:
    # Custom ops get no device guard, and Triton launches on the current device.
    with torch.cuda.device(grad.device):
        if use_triton(grad):
            return period_scores_triton(grad, candidates, variant)
        return period_scores_reference(grad, candidates, variant)


@_period_scores_op.register_fake
def _period_scores_fake(grad: Tensor, candidates: Tensor, variant: str) -> Tensor:
    return torch.empty(candidates.shape[0], dtype=torch.float64, device=grad.device)


def period_scores(grad: Tensor, candidates: Tensor, variant: str) -> Tensor:
    """Period scores through ``torch.ops.gefen.period_scores`` (CUDA: Triton when available).

    Same arguments, result and errors as :func:`period_scores_reference`.
    """
    _check_meta(grad, candidates, variant)
    return torch.ops.gefen.period_scores(grad, candidates, variant)


# A list's scores come back as one flat tensor (a custom op's outputs may not alias each other);
# the public function splits it.
@torch.library.custom_op("gefen::multi_period_scores", mutates_args=())
def _multi_period_scores_op(grads: list[Tensor], candidates: list[Tensor],
                            variant: str) -> Tensor:
    return _multi_reference_flat(grads, candidates, variant)


@_multi_period_scores_op.register_kernel("cuda")
def _multi_period_scores_cuda(grads: list[Tensor], candidates: list[Tensor],
                              variant: str) -> Tensor:
    if not grads:
        return _multi_reference_flat(grads, candidates, variant)
    with torch.cuda.device(grads[0].device):  # as _period_scores_cuda
        if use_triton(grads[0]):
            return _multi_triton_flat(grads, candidates, variant)
        return _multi_reference_flat(grads, candidates, variant)


@_multi_period_scores_op.register_fake
def _multi_period_scores_fake(grads: list[Tensor], candidates: list[Tensor],
                              variant: str) -> Tensor:
    return torch.empty(sum(c.shape[0] for c in candidates), dtype=torch.float64,
                       device=grads[0].device if grads else "cpu")


def multi_period_scores(grads: Sequence[Tensor], candidates: Sequence[Tensor],
                        variant: str) -> list[Tensor]:
    """Period scores of many gradients through ``torch.ops.gefen.multi_period_scores``
    (docs/algorithm.md#period-search; the module docstring).

    ``multi_period_scores(grads, candidates, variant)[i]`` equals ``period_scores(grads[i],
    candidates[i], variant)``: on CUDA with Triton available, the scores of all fp32, bf16 and
    fp16 gradients come from a fixed number of launches per round of chunks
    (:func:`multi_period_scores_triton`), not per tensor; elsewhere from the reference, tensor
    by tensor. Nothing is read back from the device (the caller reads all scores with one
    copy).

    Args:
        grads: contiguous real float tensors (fp32, bf16, fp16 or fp64), all on one device,
            each ``N_i >= 0`` elements in logical row-major order.
        candidates: one int64 ``[n_i]`` tensor per gradient (any device; read on the host),
            strictly ascending positive divisors of ``N_i``; for ``"log_contrast"`` each must
            leave at least 2 blocks (``N_i / p >= 2``). May be empty.
        variant: ``"log_contrast"`` (Variant L, ``S(p)``) or ``"variance"`` (Variant V,
            ``E(p)``), for every tensor.

    Returns:
        A list of float64 ``[n_i]`` tensors on the gradients' device, one per gradient (views
        of one buffer); ``[]`` for an empty ``grads``. A NaN or Inf gradient makes its
        tensor's scores non-finite (module docstring).

    Raises:
        TypeError: a gradient is not a real float tensor, or a DTensor (pass ``.to_local()``).
        ValueError: a non-contiguous gradient, a malformed candidate tensor or value, an
            unknown ``variant``, gradients on different devices, or ``grads`` and
            ``candidates`` of different lengths. Errors name the offending tensor by its index
            (``grads[i]``, ``candidates[i]``); every tensor's type, layout and device are
            checked before any candidate's values.
    """
    grads, candidates = list(grads), list(candidates)
    _check_lists(grads, candidates, variant)
    if not grads:
        return []
    flat = torch.ops.gefen.multi_period_scores(grads, candidates, variant)
    return list(flat.split([c.shape[0] for c in candidates]))
