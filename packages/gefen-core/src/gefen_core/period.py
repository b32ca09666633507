"""Block-period search (docs/algorithm.md#period-search; decision O2 in docs/decisions.md).

:func:`search_period` scores the candidate periods its rules read with the ``gefen_kernels``
op ``multi_period_scores`` (one pass of chunked fp64 prefix sums over the tensor, no pass and
no host sync per candidate) and reads the scores back with a single device-to-host copy; the
decision rules run on the host. Variant V reads every candidate's score. Variant L reads the
suffix its peak rule looks at, or scores ``p = 1`` alone when no peak is possible, only to
refuse a non-finite gradient (:func:`_log_contrast_scored`). :func:`search_periods` does the
same for many tensors (a whole model's first step) with one call of the op and one
device-to-host copy per device: on CUDA its Triton path scores all of a device's tensors in a
number of launches that follows their total size, not their number.

Determinism (docs/algorithm.md#period-search, docs/algorithm.md#deterministic): the scores are
computed with fixed-order reductions on every backend (the op has no atomics), so there is no
separate deterministic mode: the same gradient on the same device gives the same scores bit for bit,
hence the same period, and ``deterministic=True`` needs nothing more from this module. The op
dispatches on the gradient's device at every call (CUDA: Triton when available, else the PyTorch
reference); nothing about the backend is remembered between calls (docs/algorithm.md#period-search).

The force gates of docs/algorithm.md#period-search (numel 0 or 1, ``force_1d_period_one``,
``force_2d_period_one``, ``period_one_substrings``) belong to the optimizer, which calls
:func:`search_period` after them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gefen_kernels.ops.period_scores import VARIANTS, multi_period_scores, reject_dtensor

__all__ = [
    "FALLBACK_CAP",
    "VARIANTS",
    "memory_safe_fallback",
    "period_candidates",
    "search_period",
    "search_periods",
]

# Appendix A constants.
MIN_BLOCKS_LOG_CONTRAST = 4      # Variant L keeps candidates with N / p >= 4
MIN_PEAK_PERIOD = 8              # Variant L peaks need p > 8
LARGE_PERIOD = 1024              # Variant L rounds P > 1024 down to a divisor > 1024
FIRST_INCREMENT = 1e-12          # Variant V: increment of the first candidate (p = 1)
MIN_PERIOD_VARIANCE = 8          # Variant V: P < 8 -> 1
FALLBACK_MIN_NUMEL = 8           # fallback: N < 8 -> 1
FALLBACK_MIN_CANDIDATE = 8       # fallback candidates must be >= 8
FALLBACK_CAP = 2048              # fallback: largest divisor of N that is <= 2048


def _divisors(n: int) -> list[int]:
    """All positive divisors of ``n >= 1``, ascending (factorisation by trial division)."""
    factors: list[tuple[int, int]] = []
    rest, q = n, 2
    while q * q <= rest:
        if rest % q == 0:
            e = 0
            while rest % q == 0:
                rest //= q
                e += 1
            factors.append((q, e))
        q += 1 if q == 2 else 2
    if rest > 1:
        factors.append((rest, 1))
    divs = [1]
    for prime, e in factors:
        divs = [d * prime**i for d in divs for i in range(e + 1)]
    return sorted(divs)


def _check_numel(numel: int) -> None:
    if not isinstance(numel, int) or isinstance(numel, bool):
        raise TypeError(f"numel must be an int, got {type(numel).__name__}")
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel} (empty tensors have no period)")


def period_candidates(numel: int) -> list[int]:
    """The candidate set ``D(N)`` of docs/algorithm.md#period-search: every divisor ``p < N`` of
    ``N``, ascending.

    ``1`` is included (for ``N > 1``); ``N`` itself never is.

    Raises:
        TypeError, ValueError: ``numel`` is not an int ``>= 1``.
    """
    _check_numel(numel)
    return _divisors(numel)[:-1]


def memory_safe_fallback(numel: int, shape: tuple[int, ...]) -> int:
    """The period used when the search returns 1 (docs/algorithm.md#period-search).

    ``N < 8`` gives 1. Otherwise the largest of: ``shape[-1]`` (tensors of 2 or more dims, when
    ``shape[-1] >= 8`` and it divides ``N``) and the largest divisor of ``N`` that is ``<= 2048``
    (``N`` itself counts) when it is ``>= 8``; 1 if neither exists. ``shape`` is the parameter's
    (global) shape; ``numel`` the local element count, which ``shape`` need not multiply to.

    Examples: a 1-D norm of 1024 -> 1024; ``[4096, 4096]`` -> 4096; ``[151936, 1024]`` -> 2048.

    Raises:
        TypeError, ValueError: ``numel`` not an int ``>= 1``, or ``shape`` not a tuple of ints.
    """
    _check_numel(numel)
    shape = _check_shape(shape)
    if numel < FALLBACK_MIN_NUMEL:
        return 1
    options = []
    if len(shape) >= 2 and shape[-1] >= FALLBACK_MIN_CANDIDATE and numel % shape[-1] == 0:
        options.append(shape[-1])
    capped = max(d for d in _divisors(numel) if d <= FALLBACK_CAP)
    if capped >= FALLBACK_MIN_CANDIDATE:
        options.append(capped)
    return max(options, default=1)


def _check_shape(shape: object) -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise TypeError(f"shape must be a tuple of non-negative ints, got {shape!r}")
    return tuple(shape)


def _round_large_period(period: int) -> int:
    """docs/algorithm.md#period-search rule 4: ``P > 1024`` becomes the smallest divisor of ``P``
    exceeding 1024."""
    if period <= LARGE_PERIOD:
        return period
    return min(d for d in _divisors(period) if d > LARGE_PERIOD)


def _log_contrast_choice(cands: list[int], scores: list[float]) -> int:
    """docs/algorithm.md#period-search rules 2-3 on candidates with at least 4 blocks (ascending)
    and their S(p)."""
    best_p, best_s = 1, -math.inf
    for j in range(1, len(cands) - 1):
        p, s = cands[j], scores[j]
        if p > MIN_PEAK_PERIOD and s > scores[j - 1] and s > scores[j + 1]:
            if s >= best_s:  # ties -> the larger p (cands ascend)
                best_p, best_s = p, s
    return best_p


def _variance_choice(cands: list[int], scores: list[float]) -> int:
    """docs/algorithm.md#period-search: smallest increment of E(p) (first one 1e-12, ties -> smaller
    p); P < 8 -> 1."""
    best_p, best_inc = cands[0], FIRST_INCREMENT
    for j in range(1, len(cands)):
        inc = scores[j] - scores[j - 1]
        if inc < best_inc:
            best_p, best_inc = cands[j], inc
    return 1 if best_p < MIN_PERIOD_VARIANCE else best_p


@dataclass
class _Plan:
    """One tensor's search: what to score and how to decide (host-side values only)."""

    numel: int
    shape: tuple[int, ...]
    variant: str
    cands: list[int]        # the candidates the rules look at
    scored: list[int]       # the candidates scored: a suffix of cands, or [1] (module notes)


def _check_grad(grad: object, variant: str) -> None:
    if not isinstance(grad, Tensor):
        raise TypeError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
    reject_dtensor("grad", grad)
    if not grad.is_floating_point() or grad.is_complex():
        raise TypeError(f"grad must be a real floating-point tensor, got {grad.dtype}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def _plan(grad: Tensor, shape: object, variant: str) -> _Plan:
    numel = grad.numel()
    _check_numel(numel)
    checked = _check_shape(shape)
    if numel == 1:
        return _Plan(numel, checked, variant, [], [])
    divisors = period_candidates(numel)
    if variant == "log_contrast":
        cands = [p for p in divisors if numel // p >= MIN_BLOCKS_LOG_CONTRAST]
        scored = _log_contrast_scored(cands)
    else:
        cands = scored = divisors
    return _Plan(numel, checked, variant, cands, scored)


def _log_contrast_scored(cands: list[int]) -> list[int]:
    """The candidates whose Variant L scores the rules read (docs/algorithm.md#period-search rules
    2-3).

    A peak is an interior candidate above ``MIN_PEAK_PERIOD`` compared with its two
    neighbours; candidates ascend, so these form the suffix of ``cands`` that starts one
    before the first candidate above 8. Scoring only it gives the same period: the others'
    scores are never read. On the benchmark's Llama-3.2-1B shapes this skips ``p = 1, 2, 4``
    (and ``3, 6`` on the embedding and head), about three quarters of the block ends the scores
    visit; ``p = 1``'s term costs the search kernel a second fp64 log per element. With no
    possible peak the period is 1 whatever the scores; ``p = 1`` alone is then scored, only to
    refuse a non-finite gradient. Refusal is unchanged: a candidate of the suffix has at least
    4 blocks, and ``p = 1`` at least 2, and the blocks cover every element. So a NaN or Inf
    (or an fp32 square that overflows) makes some block mean, hence the score, non-finite."""
    first = next((j for j in range(1, len(cands) - 1) if cands[j] > MIN_PEAK_PERIOD), None)
    return [1] if first is None else cands[first - 1:]


def _decide(plan: _Plan, scores: list[float], fallback: bool) -> int:
    if plan.numel == 1:
        return 1
    if not all(math.isfinite(s) for s in scores):
        raise ValueError(
            f"grad has NaN or Inf values (the {plan.variant} period scores are not finite"
            + (", or a value's square overflows fp32" if plan.variant == "log_contrast" else "")
            + "); the block period can only be learned from a finite gradient")
    if plan.variant == "log_contrast":
        # The scored suffix (or [1], which cannot hold a peak: no interior candidate is > 8).
        suffix = plan.cands[len(plan.cands) - len(plan.scored):] if plan.scored != [1] else []
        period = _round_large_period(_log_contrast_choice(suffix, scores[:len(suffix)]))
    else:
        period = _variance_choice(plan.cands, scores)
    if period == 1 and fallback:
        period = memory_safe_fallback(plan.numel, plan.shape)
    return period


def search_period(grad: Tensor, shape: tuple[int, ...], *, variant: str = "log_contrast",
                  fallback: bool = True) -> int:
    """Block period ``P`` of a parameter from its gradient (docs/algorithm.md#period-search, then
    docs/algorithm.md#period-search).

    One pass over the gradient and one device-to-host sync. The scores use fixed-order
    reductions on every backend, so the result is deterministic (module docstring); this is the
    path ``deterministic=True`` asks for (docs/algorithm.md#period-search).

    Args:
        grad: the (local) gradient, any real float dtype and device, ``N >= 1`` elements, taken
            in logical row-major order (a non-contiguous view is copied once by
            ``.contiguous()``). Under FSDP2 pass the local shard (``grad.to_local()``).
        shape: the parameter's (global) shape, used by the fallback's row-length candidate.
        variant: ``"log_contrast"`` (Variant L, the paper's search: adjacent block log-mean
            contrast, peaks with at least 4 blocks and ``p > 8``, largest peak, ``P > 1024``
            rounded down to its smallest divisor above 1024) or ``"variance"`` (Variant V: the
            smallest increment of the within-block standard deviation of ``g^2``; ``P < 8`` is 1).
        fallback: apply the memory-safe fallback (:func:`memory_safe_fallback`) when the search
            returns 1.

    Returns:
        ``P``, a divisor of ``N`` (``1 <= P <= N``; ``P = N`` only through the fallback).

    Raises:
        TypeError: ``grad`` is not a real float tensor (or is a DTensor: pass
            ``grad.to_local()``), or ``shape`` is malformed.
        ValueError: ``N = 0``, an unknown ``variant``, or a gradient with NaN/Inf values (or,
            for Variant L, values whose square overflows fp32). The optimizer decides what a
            non-finite first-step gradient means (open choice O9); this function only refuses it.
    """
    return search_periods([grad], [shape], variant=variant, fallback=fallback)[0]


def search_periods(grads: Sequence[Tensor], shapes: Sequence[tuple[int, ...]], *,
                   variant: str = "log_contrast", fallback: bool = True,
                   names: Sequence[str] | None = None) -> list[int]:
    """:func:`search_period` for many tensors with one device-to-host sync per device.

    Each device's contiguous gradients are scored by one ``multi_period_scores`` call (one pass
    over each gradient, asynchronous on CUDA; a strided gradient is copied and scored by a call
    of its own) before any score is read; then each device's scores are concatenated and read
    back with a single copy, and the decision rules run on the host. The result equals
    ``[search_period(g, s, ...) for g, s in zip(grads, shapes)]`` exactly (a tensor's scores do
    not depend on the other tensors of the call; same rules); a model's first step costs one
    sync instead of one per tensor.

    Args:
        grads: the (local) gradients, as for :func:`search_period`; devices may differ.
        shapes: the parameters' (global) shapes, one per gradient.
        variant, fallback: as for :func:`search_period`, applied to every tensor.
        names: what an error calls each tensor (e.g. the parameter names); default
            ``grads[i]``.

    Returns:
        The periods, one ``int`` per gradient, in order.

    Raises:
        TypeError, ValueError: as :func:`search_period`, for the first offending tensor (named
            by ``names`` or its position), before any score is computed (a non-finite gradient:
            after); ``grads``, ``shapes`` and ``names`` of different lengths.
    """
    grads = list(grads)
    shapes = list(shapes)
    labels = [f"grads[{i}]" for i in range(len(grads))] if names is None else list(names)
    if not len(grads) == len(shapes) == len(labels):
        raise ValueError(f"grads, shapes and names must have the same length, got "
                         f"{len(grads)}, {len(shapes)} and {len(labels)}")
    plans = []
    for idx, (grad, shape) in enumerate(zip(grads, shapes)):
        try:
            _check_grad(grad, variant)
            plans.append(_plan(grad, shape, variant))
        except (TypeError, ValueError) as err:
            if len(grads) == 1 and names is None:
                raise
            raise type(err)(f"{labels[idx]}: {err}") from err
    # Launch every device's scores, then one read per device.
    def launch(members: list[int]) -> list[tuple[int, Tensor]]:
        outs = multi_period_scores(
            [grads[i].detach().contiguous() for i in members],
            [torch.tensor(plans[i].scored, dtype=torch.int64) for i in members], variant)
        return list(zip(members, outs))

    per_device: dict[torch.device, list[int]] = {}
    for idx, (grad, plan) in enumerate(zip(grads, plans)):
        if plan.scored:
            per_device.setdefault(grad.device, []).append(idx)
    launched = []
    for members in per_device.values():
        # One call for the contiguous gradients; a strided one is copied and scored alone, so
        # no two copies are alive at once.
        dense = [i for i in members if grads[i].is_contiguous()]
        entries = launch(dense) if dense else []
        for i in members:
            if not grads[i].is_contiguous():
                entries += launch([i])
        launched.append(entries)
    scores: list[list[float]] = [[] for _ in plans]
    for entries in launched:
        flat = torch.cat([t for _, t in entries]).tolist()  # the one sync for this device
        pos = 0
        for idx, t in entries:
            scores[idx] = flat[pos:pos + t.numel()]
            pos += t.numel()
    out = []
    for idx, plan in enumerate(plans):
        try:
            out.append(_decide(plan, scores[idx], fallback))
        except ValueError as err:
            if len(grads) == 1 and names is None:
                raise
            raise ValueError(f"{labels[idx]}: {err}") from err
    return out
