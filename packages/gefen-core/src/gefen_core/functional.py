"""Functional Gefen step over lists of tensors (the ``torch.optim`` functional layer).

:func:`gefen` steps already-initialised parameters: it advances the counters, computes the
bias corrections (docs/algorithm.md#block-second-moment step 2,
docs/algorithm.md#factored-second-moment step 2) and calls one fused op per tensor from
``gefen_kernels``. It owns no math of its own: the per-tensor update (second-moment EMA, decoupled
decay, momentum EMA on the dequantized codes, re-quantization, parameter write) is
``gefen_kernels.ops.block_step`` / ``factored_step``. Period search and codebook learning belong to
:class:`gefen_core.Gefen`.

Three implementations share one keyword-only signature:

* :func:`_single_tensor_gefen` — the reference ops, one tensor at a time;
* :func:`_foreach_gefen` — the reference ops, with counters and bias corrections batched;
* :func:`_fused_gefen` — the dispatching public ops (Triton on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

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


def _host_lr(lr: float | Tensor) -> float:
    # The class hands a cached Python float for tensor lrs (one read per lr change,
    # docs/algorithm.md#step); direct functional callers with a tensor pay one read here.
    return float(lr.item()) if isinstance(lr, Tensor) else float(lr)


def _host_scalars(
    t: float, tv: float, *, lr: float, beta1: float, beta2: float, weight_decay: float,
    factored: bool,
) -> dict[str, float]:
    """Bias corrections and decay in fp64 on the host (docs/algorithm.md#block-second-moment step 2,
    docs/algorithm.md#factored-second-moment step 2)."""
    bc1_recip = 1.0 / (1.0 - beta1 ** t)
    b2 = 1.0 - beta2 ** tv
    out = {"lr": lr, "bc1_recip": bc1_recip, "decay": 1.0 - lr * weight_decay}
    if factored:
        out["bc2_recip"] = 1.0 / b2
    else:
        out["bc2_rsqrt"] = 1.0 / math.sqrt(b2)
    return out


def _device_hyper(
    step: Tensor, sq_step: Tensor, *, lr: float | Tensor, beta1: float, beta2: float,
    weight_decay: float, factored: bool,
) -> Tensor:
    """The capturable 4-float buffer ``[lr, bc2, bc1_recip, decay]`` computed on device
    (docs/algorithm.md#capturable): ``1 - beta**t`` in fp64 on device, reciprocal/root in fp64,
    rounded to fp32 on write."""
    t = step.to(torch.float64)
    tv = sq_step.to(torch.float64)
    bc1_recip = 1.0 / (1.0 - torch.pow(beta1, t))
    b2 = 1.0 - torch.pow(beta2, tv)
    bc2 = 1.0 / b2 if factored else torch.rsqrt(b2)
    if isinstance(lr, Tensor):
        lr64 = lr.detach().reshape(()).to(device=step.device, dtype=torch.float64)
    else:
        lr64 = torch.full((), float(lr), dtype=torch.float64, device=step.device)
    decay = 1.0 - lr64 * weight_decay
    return torch.stack([lr64, bc2.reshape(()), bc1_recip.reshape(()), decay]).to(torch.float32)


_Op = Callable[..., None]


def _ops(kind: str) -> tuple[_Op, _Op]:
    from gefen_kernels import ops

    if kind == "reference":
        return ops.block_step_reference, ops.factored_step_reference
    return ops.block_step, ops.factored_step


def _apply(
    op_block: _Op, op_factored: _Op, i: int, param: Tensor, grad: Tensor, codes: Tensor,
    scale: Tensor,
    sq: Tensor | None, row: Tensor | None, col: Tensor | None, scalars: dict[str, float] | None,
    hyper: Tensor | None, *, codebook: Tensor, beta1: float, beta2: float, eps: float,
    maximize: bool, stochastic_round: bool, seed: int, seed_tensor: Tensor | None,
    stats: tuple[Tensor, int] | None = None,
) -> None:
    # The ops need the logical row-major order in contiguous memory (docs/algorithm.md#state-layout,
    # docs/algorithm.md#step).
    work = param if param.is_contiguous() else param.contiguous()
    g = grad if grad.is_contiguous() else grad.contiguous()
    common: dict[str, Any] = dict(
        lr=0.0, beta1=beta1, beta2=beta2, eps=eps, maximize=maximize,
        stochastic_round=stochastic_round, seed=seed, hyper=hyper, seed_tensor=seed_tensor,
    )
    if scalars is not None:
        common["lr"] = scalars["lr"]
    if sq is not None:
        op_block(
            work, g, codes, scale, sq, codebook,
            bc1_recip=1.0 if scalars is None else scalars["bc1_recip"],
            bc2_rsqrt=1.0 if scalars is None else scalars["bc2_rsqrt"],
            decay=1.0 if scalars is None else scalars["decay"],
            **common,
        )
    else:
        if stats is not None:
            common["stats"], common["global_rows"] = stats
        op_factored(
            work, g, codes, scale, row, col, codebook,
            bc1_recip=1.0 if scalars is None else scalars["bc1_recip"],
            bc2_recip=1.0 if scalars is None else scalars["bc2_recip"],
            decay=1.0 if scalars is None else scalars["decay"],
            **common,
        )
    if work is not param:
        param.copy_(work)


def _run(
    kind: str, params: Sequence[Tensor], grads: Sequence[Tensor],
    exp_avg_codes: Sequence[Tensor], exp_avg_scales: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor | None], exp_avg_sq_rows: Sequence[Tensor | None],
    exp_avg_sq_cols: Sequence[Tensor | None], state_steps: Sequence[Tensor],
    exp_avg_sq_steps: Sequence[Tensor], *, codebook: Tensor, lr: float | Tensor, beta1: float,
    beta2: float, eps: float, weight_decay: float, maximize: bool, stochastic_round: bool,
    seeds: Sequence[int] | None, seed_tensors: Sequence[Tensor] | None, capturable: bool,
    batched: bool, factored_stats: Sequence[tuple[Tensor, int] | None] | None = None,
) -> None:
    if not params:
        return
    op_block, op_factored = _ops(_cpu_default(kind, params))
    if batched:
        torch._foreach_add_(list(state_steps), 1)
        torch._foreach_add_(list(exp_avg_sq_steps), 1)
    host_lr = 0.0 if capturable else _host_lr(lr)
    for i, param in enumerate(params):
        if not batched:
            state_steps[i].add_(1)
            exp_avg_sq_steps[i].add_(1)
        factored = exp_avg_sqs[i] is None
        if capturable:
            hyper = _device_hyper(
                state_steps[i], exp_avg_sq_steps[i], lr=lr, beta1=beta1, beta2=beta2,
                weight_decay=weight_decay, factored=factored,
            )
            scalars = None
        else:
            hyper = None
            scalars = _host_scalars(
                float(state_steps[i].item()), float(exp_avg_sq_steps[i].item()),
                lr=host_lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                factored=factored,
            )
        _apply(
            op_block, op_factored, i, param, grads[i], exp_avg_codes[i], exp_avg_scales[i],
            exp_avg_sqs[i], exp_avg_sq_rows[i], exp_avg_sq_cols[i], scalars, hyper,
            codebook=codebook, beta1=beta1, beta2=beta2, eps=eps, maximize=maximize,
            stochastic_round=stochastic_round,
            seed=0 if (seeds is None or capturable) else seeds[i],
            seed_tensor=None if seed_tensors is None or not capturable else seed_tensors[i],
            stats=None if factored_stats is None else factored_stats[i],
        )


# ---- Default CPU dispatch --------------------------------------------------------------------
def _cpu_default(kind: str, params: Sequence[Tensor]) -> str:
    """The ops the reference paths call: on CPU (eager) the public ops, whose CPU kernel is the
    native CPU step of ``gefen_kernels`` (the reference's bits, docs/decisions.md "The CPU
    step"); elsewhere, and under ``torch.compile``, the reference ops themselves."""
    if kind == "reference" and params[0].device.type == "cpu" \
            and not torch.compiler.is_compiling():
        return "fused"
    return kind
# ---- End of the default CPU dispatch -----------------------------------------------------------


def _single_tensor_gefen(*args: Any, **kwargs: Any) -> None:
    """Reference ops, one tensor at a time (valid on every device and dtype, fp64 included)."""
    _run("reference", *args, batched=False, **kwargs)


def _foreach_gefen(*args: Any, **kwargs: Any) -> None:
    """Reference ops with the counters advanced by one multi-tensor add per list.

    Bit-identical to :func:`_single_tensor_gefen`: only the bookkeeping is batched."""
    _run("reference", *args, batched=True, **kwargs)


def _fused_gefen(*args: Any, **kwargs: Any) -> None:
    """The fused (Triton) step on CUDA.

    Eagerly, through cached launch plans (``gefen_kernels.ops.step_plan``): one launch per
    block-mode tensor, three per factored tensor, the per-step scalars computed once per
    distinct step count, no host synchronisation. Under ``torch.compile`` (and for tensors the
    plans cannot take) through the public custom ops, which the compiler keeps in its graph.
    Both give the same bits: the plans make the launches the ops make.
    """
    if _plans_apply(args[0]):
        # Triton launches on the current device's stream: make it the tensors' device.
        with torch.cuda.device(args[0][0].device):
            _planned_gefen(*args, **kwargs)
    else:
        _run("fused", *args, batched=True, **kwargs)


def _plans_apply(params: Sequence[Tensor]) -> bool:
    """Eager CUDA steps with Triton take the planned launches."""
    if not params or torch.compiler.is_compiling() or params[0].device.type != "cuda":
        return False
    import gefen_kernels

    return bool(gefen_kernels.triton_available())


# Plans keyed (weakly) by each parameter's codes tensor: a new state tensor means a new plan.
_PLANS: Any = None


def _plan_for(
    param: Tensor, codes: Tensor, scale: Tensor, sq: Tensor | None, row: Tensor | None,
    col: Tensor | None, codebook: Tensor, options: tuple[Any, ...],
) -> Any:
    global _PLANS
    from gefen_kernels.ops.step_plan import StepPlan

    if _PLANS is None:
        from torch.utils.weak import WeakIdKeyDictionary

        _PLANS = WeakIdKeyDictionary()
    hit = _PLANS.get(codes)
    if hit is not None and hit[0] == options and hit[1].matches(param, codes, scale, sq, row,
                                                                 col, codebook):
        return hit[1]
    beta1, beta2, eps, maximize, stochastic_round, capturable = options
    plan = StepPlan(param, codes, scale, sq, row, col, codebook, beta1=beta1, beta2=beta2,
                    eps=eps, maximize=maximize, stochastic_round=stochastic_round,
                    capturable=capturable)
    _PLANS[codes] = (options, plan)
    return plan


def _device_hypers(
    state_steps: Sequence[Tensor], exp_avg_sq_steps: Sequence[Tensor], *,
    factored: bool | Tensor, lr: float | Tensor, beta1: float, beta2: float,
    weight_decay: float,
) -> Tensor:
    """:func:`_device_hyper` for many tensors at once: fp32 ``[n, 4]``, the same elementwise
    fp64 operations (so the same bits), a handful of launches instead of ~10 per tensor,
    nothing copied from the host (CUDA-graph capturable). ``factored``: the mode of all of
    them, or a bool device tensor ``[n]`` with each one's."""
    t = torch.stack([s.reshape(()) for s in state_steps]).to(torch.float64)
    tv = torch.stack([s.reshape(()) for s in exp_avg_sq_steps]).to(torch.float64)
    bc1_recip = 1.0 / (1.0 - torch.pow(beta1, t))
    b2 = 1.0 - torch.pow(beta2, tv)
    if isinstance(factored, Tensor):
        bc2 = torch.where(factored, 1.0 / b2, torch.rsqrt(b2))
    else:
        bc2 = 1.0 / b2 if factored else torch.rsqrt(b2)
    if isinstance(lr, Tensor):
        lr64 = lr.detach().reshape(()).to(device=t.device, dtype=torch.float64)
    else:
        lr64 = torch.full((), float(lr), dtype=torch.float64, device=t.device)
    lr64 = lr64.expand(t.shape)
    decay = 1.0 - lr64 * weight_decay
    return torch.stack([lr64, bc2, bc1_recip, decay], dim=1).to(torch.float32)


def _planned_gefen(
    params: Sequence[Tensor], grads: Sequence[Tensor], exp_avg_codes: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor | None],
    exp_avg_sq_rows: Sequence[Tensor | None], exp_avg_sq_cols: Sequence[Tensor | None],
    state_steps: Sequence[Tensor], exp_avg_sq_steps: Sequence[Tensor], *, codebook: Tensor,
    lr: float | Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
    maximize: bool, stochastic_round: bool, seeds: Sequence[int] | None,
    seed_tensors: Sequence[Tensor] | None, capturable: bool,
    factored_stats: Sequence[tuple[Tensor, int] | None] | None = None,
) -> None:
    n = len(params)
    counters = list(state_steps) + list(exp_avg_sq_steps)
    if all(c.device == counters[0].device for c in counters):
        torch._foreach_add_(counters, 1)
    else:
        torch._foreach_add_(list(state_steps), 1)
        torch._foreach_add_(list(exp_avg_sq_steps), 1)
    factored_flags = [sq is None for sq in exp_avg_sqs]
    hypers: list[Tensor] = []
    host: list[tuple[float, float, float, float]] = []
    if capturable and _grouped_capturable(
            params, grads, exp_avg_codes, exp_avg_scales, exp_avg_sqs, exp_avg_sq_rows,
            exp_avg_sq_cols, state_steps, exp_avg_sq_steps, seed_tensors, factored_stats,
            codebook=codebook, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, maximize=maximize, stochastic_round=stochastic_round):
        return
    if capturable:
        hypers = [None] * n  # type: ignore[list-item]
        for mode in (False, True):
            idx = [i for i in range(n) if factored_flags[i] == mode]
            if not idx:
                continue
            rows_ = _device_hypers([state_steps[i] for i in idx],
                                   [exp_avg_sq_steps[i] for i in idx], factored=mode, lr=lr,
                                   beta1=beta1, beta2=beta2, weight_decay=weight_decay)
            for j, i in enumerate(idx):
                hypers[i] = rows_[j]
    else:
        host = _host_rows(state_steps, exp_avg_sq_steps, factored_flags, lr=_host_lr(lr),
                          beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    if host and _graphable(params, factored_stats):
        _graphed_step(params, grads, exp_avg_codes, exp_avg_scales, exp_avg_sqs,
                      exp_avg_sq_rows, exp_avg_sq_cols, host, codebook=codebook,
                      options=(beta1, beta2, eps, bool(maximize), bool(stochastic_round), True),
                      seeds=seeds if stochastic_round else None)
        return
    options = (beta1, beta2, eps, bool(maximize), bool(stochastic_round), bool(capturable))
    grouped: list[tuple[Any, Tensor, int]] = []  # (plan, contiguous grad, index)
    for i in range(n):
        param, grad = params[i], grads[i]
        sq, row, col = exp_avg_sqs[i], exp_avg_sq_rows[i], exp_avg_sq_cols[i]
        seed = 0 if (seeds is None or capturable) else seeds[i]
        seed_tensor = seed_tensors[i] if (capturable and seed_tensors is not None) else None
        stats = None if factored_stats is None else factored_stats[i]
        if stats is not None or not param.is_contiguous():
            # The ops' path keeps its contiguous work copy and copy-back; reduced statistics
            # of a row shard (which the plans do not take) go through the ops too.
            _apply_one_fused(i, param, grad, exp_avg_codes[i], exp_avg_scales[i], sq, row, col,
                             host[i] if host else None, hypers[i] if hypers else None,
                             codebook=codebook, beta1=beta1, beta2=beta2, eps=eps,
                             maximize=maximize, stochastic_round=stochastic_round, seed=seed,
                             seed_tensor=seed_tensor, stats=stats)
            continue
        plan = _plan_for(param, exp_avg_codes[i], exp_avg_scales[i], sq, row, col, codebook,
                         options)
        g = grad if grad.is_contiguous() else grad.contiguous()
        if hypers:
            plan.launch(g, lr=0.0, bc1_recip=0.0, bc2=0.0, decay=1.0, seed=0, hyper=hypers[i],
                        seed_tensor=seed_tensor)
        else:
            grouped.append((plan, g, i))
    if len(grouped) > 1 and not torch.cuda.is_current_stream_capturing():
        _grouped_launch(grouped, host, seeds if stochastic_round else None,
                        anchor=exp_avg_codes[grouped[0][2]])
        return
    for plan, g, i in grouped:
        lr32, bc1_32, bc2_32, decay32 = host[i]
        plan.launch(g, lr=lr32, bc1_recip=bc1_32, bc2=bc2_32, decay=decay32,
                    seed=0 if seeds is None else seeds[i])


def _grouped_capturable(
    params: Sequence[Tensor], grads: Sequence[Tensor], exp_avg_codes: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor | None],
    exp_avg_sq_rows: Sequence[Tensor | None], exp_avg_sq_cols: Sequence[Tensor | None],
    state_steps: Sequence[Tensor], exp_avg_sq_steps: Sequence[Tensor],
    seed_tensors: Sequence[Tensor] | None,
    factored_stats: Sequence[tuple[Tensor, int] | None] | None, *, codebook: Tensor,
    lr: float | Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
    maximize: bool, stochastic_round: bool,
) -> bool:
    """A ``capturable`` step in grouped launches, its scalars and seeds assembled on the
    device (a few launches for the whole list instead of one to three per tensor): what a
    captured graph replays. Bit-identical to the per-tensor capturable launches. Returns
    ``False`` having launched nothing where it does not apply: one tensor, a tensor the plans
    do not take, or, inside a capture, launch tables or gradient offsets that no eager step
    of the same tensors built first (they are copied from the host). So a graph of the
    optimizer step alone, captured after an eager step over the same gradient tensors (torch's
    recipe), replays the grouped launches; a whole-network capture, whose gradients are
    allocated inside the graph, replays the per-tensor launches (the same bits, more kernels).
    The launch tables of a capture are kept as long as the first tensor's state
    (``_CAPTURED_GROUPS``): the graph reads them at every replay."""
    from gefen_kernels._triton import interpret_mode

    n = len(params)
    on_cuda = params[0].device.type == "cuda"
    if (n < 2 or seed_tensors is None or not (on_cuda or interpret_mode())
            or (factored_stats is not None and any(s is not None for s in factored_stats))
            or not all(p.is_contiguous() for p in params)):
        return False
    capturing = on_cuda and torch.cuda.is_current_stream_capturing()
    if capturing and not all(g.is_contiguous() for g in grads):
        return False  # the contiguous copies are new tensors: their offsets cannot be known
    options = (beta1, beta2, eps, bool(maximize), bool(stochastic_round), True)
    plans = [_plan_for(params[i], exp_avg_codes[i], exp_avg_scales[i], exp_avg_sqs[i],
                       exp_avg_sq_rows[i], exp_avg_sq_cols[i], codebook, options)
             for i in range(n)]
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    groups = _step_groups(plans, grads, exp_avg_codes[0], build=not capturing)
    if groups is None:
        return False
    gptr = groups.device_offsets(grads)
    if gptr is None:
        return False
    if capturing:
        _keep_for_graphs(exp_avg_codes[0], groups)
    hyper = _device_hypers(state_steps, exp_avg_sq_steps, factored=groups.factored_mask,
                           lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    seeds = torch.cat([s.reshape(1) for s in seed_tensors])
    groups.launch_staged(grads, groups.device_buffer(hyper, gptr, seeds), None, None,
                         device_scalars=True)
    return True


# The StepGroups that captured graphs read, kept (weakly keyed) by the first tensor's codes:
# the _GROUPS cache replaces an entry when a later step has another tensor list, which would
# free the tables a graph still reads.
_CAPTURED_GROUPS: Any = None


def _keep_for_graphs(anchor: Tensor, groups: Any) -> None:
    global _CAPTURED_GROUPS
    if _CAPTURED_GROUPS is None:
        from torch.utils.weak import WeakIdKeyDictionary

        _CAPTURED_GROUPS = WeakIdKeyDictionary()
    kept = _CAPTURED_GROUPS.setdefault(anchor, [])
    if not any(k is groups for k in kept):
        kept.append(groups)


def _host_rows(
    state_steps: Sequence[Tensor], exp_avg_sq_steps: Sequence[Tensor],
    factored_flags: Sequence[bool], *, lr: float, beta1: float, beta2: float,
    weight_decay: float,
) -> list[tuple[float, float, float, float]]:
    """Per tensor ``(lr, bc1_recip, bc2, decay)`` rounded to fp32 (``bc2`` is ``bc2_recip``
    in factored mode, ``bc2_rsqrt`` in block mode): :func:`_host_scalars` once per distinct
    ``(step, exp_avg_sq_step, mode)``, every counter read once (CPU tensors in the
    optimizer: no device sync)."""
    return _host_rows_from(_read_counters(state_steps), _read_counters(exp_avg_sq_steps),
                           factored_flags, lr=lr, beta1=beta1, beta2=beta2,
                           weight_decay=weight_decay)


def _host_rows_from(
    ts: Sequence[float], tvs: Sequence[float], factored_flags: Sequence[bool], *, lr: float,
    beta1: float, beta2: float, weight_decay: float,
) -> list[tuple[float, float, float, float]]:
    """:func:`_host_rows` from the counters' values (``step``, ``exp_avg_sq_step``)."""
    from gefen_kernels._numerics import f32

    cache: dict[tuple[float, float, bool], tuple[float, float, float, float]] = {}
    host = []
    for t, tv, fac in zip(ts, tvs, factored_flags):
        key = (t, tv, fac)
        vals = cache.get(key)
        if vals is None:
            sc = _host_scalars(t, tv, lr=lr, beta1=beta1, beta2=beta2,
                               weight_decay=weight_decay, factored=fac)
            bc2 = sc["bc2_recip"] if fac else sc["bc2_rsqrt"]
            vals = (f32(sc["lr"]), f32(sc["bc1_recip"]), f32(bc2), f32(sc["decay"]))
            cache[key] = vals
        host.append(vals)
    return host


# Grouped launches (gefen_kernels.ops.step_groups), keyed (weakly) by the first plan's codes.
_GROUPS: Any = None


def _step_groups(plans: Sequence[Any], grads: Sequence[Tensor], anchor: Tensor, *,
                 build: bool = True) -> Any:
    """The cached :class:`~gefen_kernels.ops.step_groups.StepGroups` of these plans and
    gradients (rebuilt when they no longer fit it, or ``None`` then if not ``build``).
    ``anchor``: the first tensor's codes; the launch tables live as long as it does."""
    global _GROUPS
    from gefen_kernels.ops.step_groups import StepGroups

    if _GROUPS is None:
        from torch.utils.weak import WeakIdKeyDictionary

        _GROUPS = WeakIdKeyDictionary()
    groups = _GROUPS.get(anchor)
    if groups is None or not groups.matches(plans, grads):
        if not build:
            return None
        groups = StepGroups(plans, grads)
        _GROUPS[anchor] = groups
    return groups


def _grouped_launch(grouped: Sequence[tuple[Any, Tensor, int]],
                    host: Sequence[tuple[float, float, float, float]],
                    seeds: Sequence[int] | None, *, anchor: Tensor) -> None:
    """The planned tensors of one step in a few launches per class of tensors (one per
    block-mode class, three per chunk of a factored class; factored tensors of the loop and
    split routes two per chunk plus their own update) instead of one to three per tensor:
    bit-identical to the per-plan launches."""
    grads = [item[1] for item in grouped]
    groups = _step_groups([item[0] for item in grouped], grads, anchor)
    groups.launch(grads, [host[i] for _, _, i in grouped],
                  None if seeds is None else [seeds[i] for _, _, i in grouped])


def _graphable(params: Sequence[Tensor],
               factored_stats: Sequence[tuple[Tensor, int] | None] | None) -> bool:
    """Whether this eager step can go through :mod:`gefen_core._step_graphs`: every tensor
    takes a plan (contiguous, no reduced row-shard statistics) and no graph is being captured
    by the caller (then the launches belong in the caller's graph)."""
    from . import _step_graphs

    return (_step_graphs.enabled() and len(params) > 1
            and (factored_stats is None or all(s is None for s in factored_stats))
            and all(p.is_contiguous() for p in params)
            and not torch.cuda.is_current_stream_capturing())


def _graphed_step(
    params: Sequence[Tensor], grads: Sequence[Tensor], exp_avg_codes: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor | None],
    exp_avg_sq_rows: Sequence[Tensor | None], exp_avg_sq_cols: Sequence[Tensor | None],
    host: Sequence[tuple[float, float, float, float]], *, codebook: Tensor,
    options: tuple[Any, ...], seeds: Sequence[int] | None,
) -> None:
    """The planned launches through capturable plans and device scalars, graph-replayed when
    the addresses repeat (bit-identical to the by-value launches)."""
    from gefen_kernels._numerics import to_signed64

    from . import _step_graphs

    plans = []
    tensors: list[Tensor | None] = []
    for i, param in enumerate(params):
        state = (exp_avg_codes[i], exp_avg_scales[i], exp_avg_sqs[i], exp_avg_sq_rows[i],
                 exp_avg_sq_cols[i])
        plans.append(_plan_for(param, *state, codebook, options))
        tensors.append(param)
        tensors.extend(state)
    tensors.append(codebook)
    # host rows are (lr, bc1_recip, bc2, decay); the kernels' device layout is
    # [lr, bc2, bc1_recip, decay].
    rows = [(lr, bc2, bc1, decay) for lr, bc1, bc2, decay in host]
    _step_graphs.launch(plans, grads, tensors, rows,
                        None if seeds is None else [to_signed64(s) for s in seeds],
                        anchor=exp_avg_codes[0])


def _read_counters(counters: Sequence[Tensor]) -> list[float]:
    """Every counter's value: per tensor on the CPU (where the optimizer keeps them; cheaper
    than stacking), else in one read when they share a device."""
    first = counters[0].device
    if first.type == "cpu" or not all(c.device == first for c in counters):
        return [float(c.item()) for c in counters]
    return torch.stack([c.reshape(()) for c in counters]).tolist()


def _apply_one_fused(
    i: int, param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor, sq: Tensor | None,
    row: Tensor | None, col: Tensor | None, vals: tuple[float, float, float, float] | None,
    hyper: Tensor | None, **kw: Any,
) -> None:
    op_block, op_factored = _ops("fused")
    scalars = None
    if vals is not None:
        lr32, bc1_32, bc2_32, decay32 = vals
        scalars = {"lr": lr32, "bc1_recip": bc1_32, "decay": decay32,
                   "bc2_recip" if sq is None else "bc2_rsqrt": bc2_32}
    _apply(op_block, op_factored, i, param, grad, codes, scale, sq, row, col, scalars, hyper,
           **kw)
