"""Newton–Schulz orthogonalisation for Muon (docs/algorithm.md#gefenmuon).

Muon replaces the momentum matrix ``U = A Σ Bᵀ`` by approximately ``A Bᵀ`` (its orthogonal
polar factor). Each Newton–Schulz iteration applies the odd quintic
``p(σ) = a·σ + b·σ³ + c·σ⁵`` to every singular value at once, using only matrix products::

    X ← U / max(‖U‖_F, eps)                 # every singular value now in [0, 1]
    for (a, b, c) in schedule:
        A ← X Xᵀ
        X ← a·X + (b·A + c·A·A)·X            # = A·p(Σ)·Bᵀ

so after ``K`` iterations the singular values are ``p_K ∘ … ∘ p_1 (σ / ‖U‖_F)``. The
coefficients are chosen for a large slope at 0 (small singular values grow fast) rather than
for exact convergence to 1, so the result lies in a known *band* around 1 (standard: about
[0.68, 1.14] for normalised singular values in [1e-2, 1]; tuned3 ≤ 1.15, tuned4 ≤ 1.01).

Everything here is plain ``torch.matmul`` (bf16 GEMMs with fp32 accumulation by default);
the optional fp8 path uses ``torch._scaled_mm`` with row-wise scales and is gated by the
hardware and by the matrix size (docs/algorithm.md#gefenmuon, measured break-even ``min(R, C) ≥
1536``). Where the gate says no, the bf16 path runs instead, silently: the choice is a performance
decision per matrix, not a change of algorithm.

References: Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/);
the tuned schedules and the fp8 recipe are specified in docs/algorithm.md#gefenmuon.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_NS_STEPS",
    "FP8_MIN_DIM",
    "MAX_NS_STEPS",
    "NS_SCHEDULES",
    "STANDARD_COEFFICIENTS",
    "Coefficients",
    "fp8_ns_eligible",
    "fp8_ns_supported",
    "newton_schulz",
    "newton_schulz_opaque",
    "ns_workspace_bytes",
    "plan_ns_batches",
    "resolve_ns_schedule",
]

Coefficients = tuple[float, float, float]

STANDARD_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
#: A schedule (or ``ns_steps``) must be shorter than this: 0 iterations would silently turn
#: Muon into normalised-momentum SGD, and ≥ 100 is never useful (docs/algorithm.md#gefenmuon).
MAX_NS_STEPS = 100

#: Fixed schedules of docs/algorithm.md#gefenmuon (least-squares fits on Gaussian matrices; robust
#: for normalised singular values in [1e-2, 1]). "standard" is the single triple above, repeated
#: ``ns_steps``.
NS_SCHEDULES: dict[str, tuple[Coefficients, ...]] = {
    "tuned3": (
        (5.0067, -14.4125, 10.6001),
        (3.7534, -6.8083, 3.3840),
        (3.2080, -4.3501, 2.0330),
    ),
    "tuned4": (
        (5.4261, -15.5285, 11.2657),
        (3.0766, -4.9701, 2.1297),
        (3.0008, -6.4486, 4.3696),
        (2.8386, -4.1421, 2.5758),
    ),
}

#: fp8 gates (docs/algorithm.md#gefenmuon): fp8 GEMMs need compute capability ≥ 8.9; below this
#: minimum dimension bf16 is faster. ``torch._scaled_mm`` also needs both dimensions divisible by
#: 16.
FP8_MIN_CAPABILITY = (8, 9)
FP8_MIN_DIM = 1536
_E4M3_MAX = 448.0
_FP8_MIN_SCALE = 1e-12


def _as_triple(entry: Any, where: str) -> Coefficients:
    if isinstance(entry, Tensor) or not isinstance(entry, Sequence) or isinstance(entry, str):
        # ValueError, not TypeError: GefenMuon raises one error type for
        # malformed schedules.
        raise ValueError(  # noqa: TRY004
            f"{where} must be a sequence of exactly 3 numbers (a, b, c), got {entry!r}"
        )
    if len(entry) != 3:
        raise ValueError(
            f"{where} must have exactly 3 numbers (a, b, c), got {len(entry)}: {entry!r}"
        )
    out = []
    for v in entry:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{where} must hold finite real numbers, got {entry!r}")
        out.append(float(v))
    return (out[0], out[1], out[2])


def _is_single_triple(x: Any) -> bool:
    return (
        isinstance(x, Sequence)
        and not isinstance(x, str)
        and len(x) == 3
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in x)
    )


def _check_ns_steps(ns_steps: Any) -> int:
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int):
        raise TypeError(f"ns_steps must be an int in [1, {MAX_NS_STEPS}), got {ns_steps!r}")
    if not 1 <= ns_steps < MAX_NS_STEPS:
        raise ValueError(
            f"ns_steps must be in [1, {MAX_NS_STEPS}), got {ns_steps} (0 iterations would turn "
            "Muon into normalised-momentum SGD)"
        )
    return ns_steps


def _check_list(entries: Any, what: str) -> tuple[Coefficients, ...]:
    if isinstance(entries, (str, Tensor)) or not isinstance(entries, Sequence):
        raise ValueError(f"{what} must be a list of (a, b, c) triples, got {entries!r}")  # noqa: TRY004
    if not 1 <= len(entries) < MAX_NS_STEPS:
        raise ValueError(
            f"{what} must have between 1 and {MAX_NS_STEPS - 1} iterations, got {len(entries)}"
        )
    return tuple(_as_triple(e, f"{what}[{i}]") for i, e in enumerate(entries))


def resolve_ns_schedule(
    ns_schedule: str | Sequence[Sequence[float]] | None = None,
    *,
    ns_coefficients: Sequence[float] | Sequence[Sequence[float]] = STANDARD_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
) -> tuple[Coefficients, ...]:
    """Turn the user's Newton–Schulz options into the list of (a, b, c) iterations
    (docs/algorithm.md#gefenmuon).

    Args:
        ns_schedule: ``None`` (use ``ns_coefficients``/``ns_steps``), ``"standard"``
            (:data:`STANDARD_COEFFICIENTS` × ``ns_steps``), ``"tuned3"``, ``"tuned4"``, or an
            explicit list of triples. Overrides the two arguments below when not ``None``.
        ns_coefficients: one ``(a, b, c)`` triple repeated ``ns_steps`` times, or an explicit
            list of triples (then ``ns_steps`` is ignored).
        ns_steps: iterations for a single triple, an ``int`` in ``[1, 100)``.

    Returns:
        A tuple of ``(a, b, c)`` float triples, length in ``[1, 100)``.

    Raises:
        ValueError: unknown schedule name; an entry that is not exactly 3 finite numbers;
            a schedule of length 0 or ≥ 100; ``ns_steps`` outside ``[1, 100)`` (or not an int)
            when a single triple is repeated.
    """
    if ns_schedule is not None:
        if isinstance(ns_schedule, str):
            if ns_schedule == "standard":
                return (STANDARD_COEFFICIENTS,) * _check_ns_steps(ns_steps)
            if ns_schedule in NS_SCHEDULES:
                return NS_SCHEDULES[ns_schedule]
            names = ", ".join(repr(n) for n in ("standard", *NS_SCHEDULES))
            raise ValueError(f"Unknown ns_schedule {ns_schedule!r}; use one of {names} or a list")
        return _check_list(ns_schedule, "ns_schedule")
    if _is_single_triple(ns_coefficients):
        triple = _as_triple(ns_coefficients, "ns_coefficients")
        return (triple,) * _check_ns_steps(ns_steps)
    return _check_list(ns_coefficients, "ns_coefficients")


def fp8_ns_supported(device: torch.device | str) -> bool:
    """Whether ``device`` can run fp8 (e4m3) scaled GEMMs: CUDA with capability ≥ 8.9.

    Also False on a torch build without ``torch.float8_e4m3fn`` / ``torch._scaled_mm``, so the
    fp8 path degrades to bf16 there instead of failing. (CPU is never "supported": torch < 2.8
    has no CPU ``_scaled_mm`` kernel, and where one exists it is not faster than bf16.)
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if not (hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")):
        return False
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def fp8_ns_eligible(x: Tensor) -> bool:
    """Whether the fp8 Newton–Schulz path would run for the matrix ``x`` (shape ``[R, C]``).

    True only for a 2-D tensor on an fp8-capable GPU (:func:`fp8_ns_supported`) with
    ``min(R, C) ≥ FP8_MIN_DIM`` and both dimensions divisible by 16 (a ``_scaled_mm`` rule).
    """
    if x.ndim != 2:
        return False
    rows, cols = x.shape
    if min(rows, cols) < FP8_MIN_DIM or rows % 16 or cols % 16:
        return False
    return fp8_ns_supported(x.device)


def _quantize_rows_e4m3(x: Tensor) -> tuple[Tensor, Tensor]:
    # One scale per row: scale = max|row| / 448 (floored), so each row uses e4m3's full range.
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / _E4M3_MAX).clamp_min(_FP8_MIN_SCALE)
    q = (x.float() / scale).clamp_(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _fp8_iteration(x: Tensor, a: float, b: float, c: float) -> Tensor:
    # x: bf16 [m, n], m <= n, row-major. Scaled GEMMs want mat2 column-major: the transpose of
    # a row-major quantized tensor is exactly that, so each quantization is reused as mat2.
    qx, sx = _quantize_rows_e4m3(x)
    gram = torch._scaled_mm(qx, qx.t(), scale_a=sx, scale_b=sx.t(), out_dtype=torch.bfloat16)
    # gram is symmetric, so gram·gram = gram·gramᵀ reuses one row-wise quantization.
    qg, sg = _quantize_rows_e4m3(gram)
    gram2 = torch._scaled_mm(qg, qg.t(), scale_a=sg, scale_b=sg.t(), out_dtype=torch.bfloat16)
    poly = (gram.float() * b + gram2.float() * c).to(torch.bfloat16)
    qp, sp = _quantize_rows_e4m3(poly)
    # Column-wise quantization of x = row-wise quantization of xᵀ.
    qxt, sxt = _quantize_rows_e4m3(x.t().contiguous())
    px = torch._scaled_mm(qp, qxt.t(), scale_a=sp, scale_b=sxt.t(), out_dtype=torch.bfloat16)
    return (x.float() * a + px.float()).to(torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _compiled_fp8_iteration() -> Callable[[Tensor, float, float, float], Tensor]:
    # Eager fp8 is slower than bf16 (docs/algorithm.md#gefenmuon): the quantize/scale glue must
    # fuse. Static shapes, no CUDA graphs (the optimizer may itself be captured or compiled by the
    # caller).
    return torch.compile(_fp8_iteration, dynamic=False, mode="max-autotune-no-cudagraphs")


def _newton_schulz_fp8(x: Tensor, schedule: Sequence[Coefficients], compile: bool) -> Tensor:
    # x: bf16 [m, n], m <= n, already Frobenius-normalised.
    step = _compiled_fp8_iteration() if compile else _fp8_iteration
    x = x.contiguous()
    for a, b, c in schedule:
        x = step(x, a, b, c)
    return x


def newton_schulz(
    x: Tensor,
    schedule: Sequence[Coefficients],
    *,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    fp8: bool = False,
    fp8_compile: bool = True,
) -> Tensor:
    """Orthogonalise ``x`` (approximately its polar factor) with Newton–Schulz
    (docs/algorithm.md#gefenmuon).

    Args:
        x: ``[R, C]`` matrix, or ``[n, R, C]`` stack of same-shaped matrices (each handled
            independently: batched GEMMs, per-matrix norms). Any float dtype; not modified.
        schedule: ``(a, b, c)`` iterations, e.g. from :func:`resolve_ns_schedule`.
        eps: floor of the Frobenius norm used to normalise the input (finite, > 0).
        dtype: working and output dtype; bf16 (default) runs bf16 GEMMs with fp32
            accumulation; fp32/fp64 are for references and tests.
        fp8: use the fp8 (e4m3, row-wise scaled) GEMMs where :func:`fp8_ns_eligible` allows
            (2-D, fp8-capable GPU, ``min(R, C) ≥ 1536``); elsewhere the ``dtype`` path runs
            instead, silently. Only meaningful with ``dtype=torch.bfloat16``.
        fp8_compile: compile the fp8 iteration with ``torch.compile`` (eager fp8 is slower
            than bf16).

    Returns:
        Tensor of ``x``'s shape in ``dtype``. Working layout has rows ≤ cols (a tall matrix is
        transposed in and out), so the Gram matrices are ``min(R, C)²``.

    Raises:
        ValueError: ``x`` not 2-D or 3-D, or an empty schedule.
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects [R, C] or [n, R, C], got shape {tuple(x.shape)}")
    if len(schedule) == 0:
        raise ValueError("newton_schulz needs at least one (a, b, c) iteration")
    tall = x.shape[-2] > x.shape[-1]
    use_fp8 = fp8 and dtype == torch.bfloat16 and fp8_ns_eligible(x)
    src = x.mT if tall else x
    X = torch.empty(src.shape, dtype=dtype, device=x.device)
    X.copy_(src)
    if X.numel() == 0:
        return (X.mT if tall else X).contiguous()
    # fp32 accumulation of the norm even for bf16 (the bf16 sum of R·C squares would lose
    # most of its bits); the division is one in-place rounding to the working dtype.
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=acc)
    X.div_(norm.clamp_min(eps))
    if use_fp8:
        X = _newton_schulz_fp8(X, schedule, fp8_compile)
    else:
        # addmm/baddbmm round b·A + c·A·A (and a·X + B·X) once, from the fp32 accumulator;
        # a separate bf16 multiply and add rounds twice, which visibly widens the band of
        # the steep tuned schedules (tuned4 reaches ~1.3 instead of ≤ 1.01).
        mm = torch.addmm if X.ndim == 2 else torch.baddbmm
        for a, b, c in schedule:
            gram = torch.matmul(X, X.mT)
            poly = mm(gram, gram, gram, beta=b, alpha=c)
            X = mm(X, poly, X, beta=a)
    if tall:
        X = X.mT
    return X.contiguous()


@torch.library.custom_op("gefen::newton_schulz", mutates_args=())
def _newton_schulz_op(x: Tensor, coefficients: list[float], eps: float, dtype: torch.dtype,
                      fp8: bool, fp8_compile: bool) -> Tensor:
    schedule = [(coefficients[i], coefficients[i + 1], coefficients[i + 2])
                for i in range(0, len(coefficients), 3)]
    return newton_schulz(x, schedule, eps=eps, dtype=dtype, fp8=fp8, fp8_compile=fp8_compile)


@_newton_schulz_op.register_fake
def _newton_schulz_fake(x: Tensor, coefficients: list[float], eps: float, dtype: torch.dtype,
                        fp8: bool, fp8_compile: bool) -> Tensor:
    return x.new_empty(x.shape, dtype=dtype)


def newton_schulz_opaque(
    x: Tensor,
    schedule: Sequence[Coefficients],
    *,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    fp8: bool = False,
    fp8_compile: bool = True,
) -> Tensor:
    """:func:`newton_schulz` through the custom op ``torch.ops.gefen.newton_schulz``, which
    ``torch.compile`` keeps opaque: a compiled optimizer step then runs the eager GEMMs with
    their roundings (the compiler would fuse the bf16 epilogues and round elsewhere,
    docs/algorithm.md#compiled-stepping). Same arguments, result and errors as
    :func:`newton_schulz`."""
    flat = [float(c) for triple in schedule for c in triple]
    result: Tensor = torch.ops.gefen.newton_schulz(x, flat, float(eps), dtype, bool(fp8),
                                                   bool(fp8_compile))
    return result


def ns_workspace_bytes(rows: int, cols: int) -> int:
    """Workspace model of one matrix in a batched bf16 Newton–Schulz (docs/algorithm.md#gefenmuon),
    in bytes.

    ``2·(3·m·n + 2·m²)`` with ``m = min(rows, cols)``, ``n = max(rows, cols)``: the working copy,
    the product and the output (each ``m×n``) plus the Gram matrix and its square (``m×m``),
    2 bytes each.
    """
    m, n = min(rows, cols), max(rows, cols)
    return 2 * (3 * m * n + 2 * m * m)


def plan_ns_batches(
    count: int, rows: int, cols: int, workspace_bytes: int, *, min_batch: int = 8
) -> tuple[list[int], int]:
    """Cut ``count`` same-shaped matrices into batches that fit the workspace
    (docs/algorithm.md#gefenmuon).

    Batches hold at most ``workspace_bytes // ns_workspace_bytes(rows, cols)`` matrices and at
    least ``min_batch``. A short remainder is rebalanced with the previous batch when both
    halves keep ``≥ min_batch`` matrices; otherwise it is left to the serial path.

    Returns:
        ``(batch_sizes, serial_count)``: the batches in order, then how many trailing matrices
        go through the serial path. ``sum(batch_sizes) + serial_count == count``.
    """
    per = ns_workspace_bytes(rows, cols)
    cap = workspace_bytes // per if per > 0 else count
    if count < min_batch or cap < min_batch:
        return [], count
    full, rest = divmod(count, cap)
    sizes = [cap] * full
    if rest >= min_batch:
        sizes.append(rest)
        rest = 0
    elif rest and sizes:
        merged = sizes[-1] + rest
        first, second = (merged + 1) // 2, merged // 2
        if second >= min_batch:
            sizes[-1:] = [first, second]
            rest = 0
    return sizes, rest
