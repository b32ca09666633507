"""Functional Gefen step over lists of tensors (the ``torch.optim`` functional layer).

:func:`gefen` steps already-initialised parameters: it checks the lists and picks an
implementation, which advances the counters, computes the per-step scalars
(``gefen_kernels.StepScalars``: docs/algorithm.md#block-second-moment step 2,
docs/algorithm.md#factored-second-moment step 2) and runs the per-tensor update (second-moment
EMA, decoupled decay, momentum EMA on the dequantized codes, re-quantization, parameter write) of
``gefen_kernels.ops.block_step`` / ``factored_step``. It owns no math and no launch state of its
own. Period search and codebook learning belong to :class:`gefen_core.Gefen`.

Three implementations share one keyword-only signature, as in ``torch.optim``:

* :func:`_single_tensor_gefen` — the reference ops, one tensor at a time
  (``gefen_kernels.reference_step``; on the CPU, eager, ``gefen_kernels.op_step``: the same bits
  from the native CPU step);
* :func:`_foreach_gefen` — the same, with the counters advanced by one multi-tensor add per list;
* :func:`_fused_gefen` — the fused step of the whole list (``gefen_kernels.fused_step``: cached
  launch plans, grouped launches, CUDA-graph replay on CUDA; the public ops elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from gefen_kernels import fused_step, op_step, reference_step

__all__ = ["gefen"]


def gefen(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avg_codes: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor | None],
    exp_avg_sq_rows: Sequence[Tensor | None],
    exp_avg_sq_cols: Sequence[Tensor | None],
    state_steps: Sequence[Tensor],
    exp_avg_sq_steps: Sequence[Tensor],
    *,
    codebook: Tensor,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
    stochastic_round: bool = False,
    seeds: Sequence[int] | None = None,
    seed_tensors: Sequence[Tensor] | None = None,
    foreach: bool | None = None,
    fused: bool | None = None,
    capturable: bool = False,
    differentiable: bool = False,
    factored_stats: Sequence[tuple[Tensor, int] | None] | None = None,
) -> None:
    r"""One Gefen step for a list of initialised parameters (docs/algorithm.md#block-second-moment,
    docs/algorithm.md#factored-second-moment).

    Entry ``i`` is in block mode when ``exp_avg_sqs[i]`` is a tensor (then
    ``exp_avg_sq_rows[i]`` and ``exp_avg_sq_cols[i]`` are ``None``) and in factored mode
    otherwise (``params[i]`` is 2-D ``[R, C]``, rows fp32 ``[R]``, cols fp32 ``[C]``).

    Args:
        params: parameters, any layout (non-contiguous ones are updated through a contiguous
            work copy that is copied back); fp32, bf16 or fp16 (fp64 on the reference paths).
        grads: gradients, same shapes, any float dtype.
        exp_avg_codes: uint8 ``[B, P]`` momentum codes (in/out).
        exp_avg_scales: fp32 ``[B, 1]`` per-block momentum scales (in/out).
        exp_avg_sqs: fp32 ``[B, 1]`` per-block second moments, or ``None`` (factored).
        exp_avg_sq_rows, exp_avg_sq_cols: factored statistics, or ``None`` (block).
        state_steps: fp32 0-dim momentum ages ``t``, advanced by one here.
        exp_avg_sq_steps: fp32 0-dim second-moment ages, advanced by one here.
        codebook: fp32 ``[256]`` on the parameters' device.
        lr: learning rate, float or 1-element tensor.
        beta1, beta2, eps, weight_decay, maximize: as in :class:`gefen_core.Gefen`.
        stochastic_round: stochastic instead of nearest rounding of the codes
        (docs/algorithm.md#stochastic-rounding). seeds: one already-salted signed 64-bit seed per
            tensor (O7); required with ``stochastic_round`` unless ``capturable``.
        seed_tensors: int64 ``[1]`` device seeds per tensor (capturable).
        foreach, fused: implementation choice; ``fused`` wins, then ``foreach``, else the
            for-loop. :class:`gefen_core.Gefen` resolves ``None`` per tensor before calling.
        capturable: bias corrections and lr are read from device tensors (no host sync).
        differentiable: must be ``False``.
        factored_stats: per parameter ``None`` or, for a factored parameter that is one row
            shard of a larger matrix, ``(stats, global_rows)``: the shard's
            ``gefen_kernels.ops.factored_step.factored_partial_stats`` with its column sums
            and ``sum(r')`` already summed over every shard, and the global row count
            (docs/algorithm.md#factored-second-moment on the global matrix; the factored op's
            ``stats`` argument).

    Raises:
        RuntimeError: ``differentiable=True``, or ``fused`` and ``foreach`` both true.
        ValueError: list lengths differ, or ``stochastic_round`` without seeds.
    """
    if differentiable:
        raise RuntimeError("gefen: differentiable=True is not supported (codes have no gradient)")
    if fused and foreach:
        raise RuntimeError("gefen: fused=True and foreach=True cannot both be set")
    n = len(params)
    lists = (grads, exp_avg_codes, exp_avg_scales, exp_avg_sqs, exp_avg_sq_rows,
             exp_avg_sq_cols, state_steps, exp_avg_sq_steps)
    if any(len(x) != n for x in lists) or (factored_stats is not None
                                           and len(factored_stats) != n):
        raise ValueError("gefen: every tensor list must have one entry per parameter")
    if stochastic_round and not capturable and (seeds is None or len(seeds) != n):
        raise ValueError("gefen: stochastic_round=True needs one seed per parameter (seeds=...)")
    if capturable and (seed_tensors is None or len(seed_tensors) != n):
        raise ValueError("gefen: capturable=True needs one int64 seed tensor per parameter")
    if fused:
        impl = _fused_gefen
    elif foreach:
        impl = _foreach_gefen
    else:
        impl = _single_tensor_gefen
    impl(
        params, grads, exp_avg_codes, exp_avg_scales, exp_avg_sqs, exp_avg_sq_rows,
        exp_avg_sq_cols, state_steps, exp_avg_sq_steps,
        codebook=codebook, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, maximize=maximize, stochastic_round=stochastic_round,
        seeds=seeds, seed_tensors=seed_tensors, capturable=capturable,
        factored_stats=factored_stats,
    )


def _per_tensor(params: Sequence[Tensor]) -> Callable[..., None]:
    """The per-tensor step of the reference paths. On the CPU outside ``torch.compile``: the
    public ops, whose CPU kernel is the native CPU step with the reference's bits
    (docs/decisions.md "The CPU step"); elsewhere the reference ops, which the compiler traces."""
    if params and params[0].device.type == "cpu" and not torch.compiler.is_compiling():
        return op_step
    return reference_step


def _single_tensor_gefen(params: Sequence[Tensor], *args: Any, **kwargs: Any) -> None:
    """Reference ops, one tensor at a time (valid on every device and dtype, fp64 included)."""
    _per_tensor(params)(params, *args, batched_counters=False, **kwargs)


def _foreach_gefen(params: Sequence[Tensor], *args: Any, **kwargs: Any) -> None:
    """Reference ops with the counters advanced by one multi-tensor add per list.

    Bit-identical to :func:`_single_tensor_gefen`: only the bookkeeping is batched."""
    _per_tensor(params)(params, *args, batched_counters=True, **kwargs)


def _fused_gefen(*args: Any, **kwargs: Any) -> None:
    """The fused step of the list (``gefen_kernels.fused_step``): Triton on CUDA through cached
    plans and grouped launches, the public custom ops under ``torch.compile``; the same bits
    either way."""
    fused_step(*args, **kwargs)
