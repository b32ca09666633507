"""The Gefen step of a list of tensors: the one entry gefen-core steps through
(docs/algorithm.md#block-second-moment, docs/algorithm.md#factored-second-moment,
docs/algorithm.md#step).

:func:`fused_step` advances each tensor's counters, computes its per-step scalars
(:class:`StepScalars`) and runs the fused update of ``block_step`` / ``factored_step`` on every
tensor. Everything that makes an eager step over ~150 tensors cheap lives behind it: launch
plans cached per tensor (:class:`~gefen_kernels.ops.step_plan.StepPlan`), grouped launches
and their streams (:class:`~gefen_kernels.ops.step_groups.StepGroups`), capturable steps with
their scalars and seeds assembled on the device, and CUDA-graph replay (``GEFEN_CUDA_GRAPHS=1``,
:mod:`gefen_kernels.ops._step_graphs`). Every route makes the launches the public ops make, so
every route gives their bits. :class:`FusedStepRecord` repeats one step's launches for a caller
that has checked that nothing they depend on changed (gefen-core's steady step).
:func:`reference_step` is the same step through the PyTorch reference ops (every device and
dtype, fp64 included).

Per entry ``i`` the state is in block mode when ``exp_avg_sqs[i]`` is a tensor (then
``exp_avg_sq_rows[i]`` and ``exp_avg_sq_cols[i]`` are ``None``) and in factored mode otherwise:
that is the one place the mode is read, as ``factored``, the name it keeps down to the kernels'
``FACTORED`` constexpr.

The per-step scalars are named once, :class:`StepScalars` ``(lr, bc2, bc1_recip, decay)``, in
the order the kernels read them from device memory (``HYPER`` variants, ``[n, 4]`` fp32).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .._numerics import to_signed64
from .._triton import interpret_mode, triton_available
from . import _step_graphs
from ._device import keeps_tables
from .block_step import block_step, block_step_reference
from .factored_step import factored_step, factored_step_reference
from .step_groups import StepGroups
from .step_plan import StepPlan
from .step_scalars import StepScalars, step_scalars

__all__ = ["FusedStepRecord", "StepScalars", "fused_step", "reference_step", "step_scalars"]


def _host_lr(lr: float | Tensor) -> float:
    # The optimizer hands a cached Python float for tensor lrs (one read per lr change,
    # docs/algorithm.md#step); direct callers with a tensor pay one read here.
    return float(lr.item()) if isinstance(lr, Tensor) else float(lr)


def _device_scalars(step: Tensor, exp_avg_sq_step: Tensor, *, lr: float | Tensor, beta1: float,
                    beta2: float, weight_decay: float, factored: bool) -> Tensor:
    """One tensor's :class:`StepScalars` as fp32 ``[4]`` on the counters' device
    (docs/algorithm.md#capturable): ``1 - beta**t`` in fp64 on device, reciprocal/root in fp64,
    rounded to fp32 on write."""
    t = step.to(torch.float64)
    tv = exp_avg_sq_step.to(torch.float64)
    bc1_recip = 1.0 / (1.0 - torch.pow(beta1, t))
    b2 = 1.0 - torch.pow(beta2, tv)
    bc2 = 1.0 / b2 if factored else torch.rsqrt(b2)
    if isinstance(lr, Tensor):
        lr64 = lr.detach().reshape(()).to(device=step.device, dtype=torch.float64)
    else:
        lr64 = torch.full((), float(lr), dtype=torch.float64, device=step.device)
    decay = 1.0 - lr64 * weight_decay
    return torch.stack([lr64, bc2.reshape(()), bc1_recip.reshape(()), decay]).to(torch.float32)


def _device_scalars_of(
    state_steps: Sequence[Tensor], exp_avg_sq_steps: Sequence[Tensor], *,
    factored: bool | Tensor, lr: float | Tensor, beta1: float, beta2: float,
    weight_decay: float,
) -> Tensor:
    """:func:`_device_scalars` for many tensors at once: fp32 ``[n, 4]``, the same elementwise
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


def _rounded_scalars(
    steps: Sequence[float], exp_avg_sq_steps: Sequence[float], factored: Sequence[bool], *,
    lr: float, beta1: float, beta2: float, weight_decay: float,
) -> list[StepScalars]:
    """Per tensor :func:`step_scalars` rounded to fp32, computed once per distinct
    ``(step, exp_avg_sq_step, factored)``."""
    cache: dict[tuple[float, float, bool], StepScalars] = {}
    out = []
    for t, tv, fac in zip(steps, exp_avg_sq_steps, factored):
        key = (t, tv, fac)
        vals = cache.get(key)
        if vals is None:
            vals = step_scalars(t, tv, lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=weight_decay, factored=fac).rounded()
            cache[key] = vals
        out.append(vals)
    return out


def _read_counters(counters: Sequence[Tensor]) -> list[float]:
    """Every counter's value: per tensor on the CPU (where the optimizer keeps them; cheaper
    than stacking), else in one read when they share a device."""
    first = counters[0].device
    if first.type == "cpu" or not all(c.device == first for c in counters):
        return [float(c.item()) for c in counters]
    return torch.stack([c.reshape(()) for c in counters]).tolist()


# ------------------------------------------------------------------ one tensor at a time
_Op = Callable[..., None]


def _apply(
    op_block: _Op, op_factored: _Op, param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor,
    sq: Tensor | None, row: Tensor | None, col: Tensor | None, scalars: StepScalars | None,
    hyper: Tensor | None, *, codebook: Tensor, beta1: float, beta2: float, eps: float,
    maximize: bool, stochastic_round: bool, seed: int, seed_tensor: Tensor | None,
    stats: tuple[Tensor, int] | None = None,
) -> None:
    # The ops need the logical row-major order in contiguous memory
    # (docs/algorithm.md#state-layout, docs/algorithm.md#step).
    work = param if param.is_contiguous() else param.contiguous()
    g = grad if grad.is_contiguous() else grad.contiguous()
    sc = scalars if scalars is not None else StepScalars(0.0, 1.0, 1.0, 1.0)
    common: dict[str, Any] = dict(
        lr=sc.lr, beta1=beta1, beta2=beta2, eps=eps, maximize=maximize,
        stochastic_round=stochastic_round, seed=seed, hyper=hyper, seed_tensor=seed_tensor,
        bc1_recip=sc.bc1_recip, decay=sc.decay,
    )
    if sq is not None:
        op_block(work, g, codes, scale, sq, codebook, bc2_rsqrt=sc.bc2, **common)
    else:
        if stats is not None:
            common["stats"], common["global_rows"] = stats
        op_factored(work, g, codes, scale, row, col, codebook, bc2_recip=sc.bc2, **common)
    if work is not param:
        param.copy_(work)


def _each(
    op_block: _Op, op_factored: _Op, params: Sequence[Tensor], grads: Sequence[Tensor],
    exp_avg_codes: Sequence[Tensor], exp_avg_scales: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor | None], exp_avg_sq_rows: Sequence[Tensor | None],
    exp_avg_sq_cols: Sequence[Tensor | None], state_steps: Sequence[Tensor],
    exp_avg_sq_steps: Sequence[Tensor], *, codebook: Tensor, lr: float | Tensor, beta1: float,
    beta2: float, eps: float, weight_decay: float, maximize: bool, stochastic_round: bool,
    seeds: Sequence[int] | None, seed_tensors: Sequence[Tensor] | None, capturable: bool,
    batched_counters: bool, factored_stats: Sequence[tuple[Tensor, int] | None] | None = None,
) -> None:
    """One op call per tensor; the scalars in fp64 on the host (the ops round them), or on
    the device with ``capturable``. With the public ops on CPU tensors (eager, not
    ``capturable``): :func:`_cpu_list`, the ops' CPU step of the whole list in one native
    call."""
    if not params:
        return
    if (op_block is block_step and not capturable and params[0].device.type == "cpu"
            and not torch.compiler.is_compiling()):
        _cpu_list(params, grads, exp_avg_codes, exp_avg_scales, exp_avg_sqs, exp_avg_sq_rows,
                  exp_avg_sq_cols, state_steps, exp_avg_sq_steps, codebook=codebook, lr=lr,
                  beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                  maximize=maximize, stochastic_round=stochastic_round, seeds=seeds,
                  factored_stats=factored_stats)
        return
    if batched_counters:
        torch._foreach_add_(list(state_steps), 1)
        torch._foreach_add_(list(exp_avg_sq_steps), 1)
    host_lr = 0.0 if capturable else _host_lr(lr)
    for i, param in enumerate(params):
        if not batched_counters:
            state_steps[i].add_(1)
            exp_avg_sq_steps[i].add_(1)
        factored = exp_avg_sqs[i] is None
        hyper: Tensor | None = None
        scalars: StepScalars | None = None
        if capturable:
            hyper = _device_scalars(state_steps[i], exp_avg_sq_steps[i], lr=lr, beta1=beta1,
                                    beta2=beta2, weight_decay=weight_decay, factored=factored)
        else:
            scalars = step_scalars(float(state_steps[i].item()),
                                   float(exp_avg_sq_steps[i].item()), lr=host_lr, beta1=beta1,
                                   beta2=beta2, weight_decay=weight_decay, factored=factored)
        _apply(
            op_block, op_factored, param, grads[i], exp_avg_codes[i], exp_avg_scales[i],
            exp_avg_sqs[i], exp_avg_sq_rows[i], exp_avg_sq_cols[i], scalars, hyper,
            codebook=codebook, beta1=beta1, beta2=beta2, eps=eps, maximize=maximize,
            stochastic_round=stochastic_round,
            seed=0 if (seeds is None or capturable) else seeds[i],
            seed_tensor=None if seed_tensors is None or not capturable else seed_tensors[i],
            stats=None if factored_stats is None else factored_stats[i],
        )


def _cpu_list(
    params: Sequence[Tensor], grads: Sequence[Tensor], exp_avg_codes: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor | None],
    exp_avg_sq_rows: Sequence[Tensor | None], exp_avg_sq_cols: Sequence[Tensor | None],
    state_steps: Sequence[Tensor], exp_avg_sq_steps: Sequence[Tensor], *, codebook: Tensor,
    lr: float | Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
    maximize: bool, stochastic_round: bool, seeds: Sequence[int] | None,
    factored_stats: Sequence[tuple[Tensor, int] | None] | None,
) -> None:
    """The ops' CPU step of a whole list (non-capturable, eager): the tensors the native CPU
    step takes in one native call (``ops._cpu_step.step_list_cpu``, the ops' bits), the rest
    (reduced row-shard statistics, non-contiguous or other dtypes) one op call each."""
    from . import _cpu_step

    counters = list(state_steps) + list(exp_avg_sq_steps)
    torch._foreach_add_(counters, 1)
    # Per tensor StepScalars in fp64 (what the ops take; they round them for an fp32 step),
    # computed once per distinct (step, exp_avg_sq_step, mode); rounded for the native call.
    cache: dict[tuple[float, float, bool], tuple[StepScalars, StepScalars]] = {}
    host: list[tuple[StepScalars, StepScalars]] = []  # (fp64, rounded to fp32)
    host_lr = _host_lr(lr)
    for t, tv, sq in zip(_read_counters(state_steps), _read_counters(exp_avg_sq_steps),
                         exp_avg_sqs):
        key = (t, tv, sq is None)
        if key not in cache:
            exact = step_scalars(t, tv, lr=host_lr, beta1=beta1, beta2=beta2,
                                 weight_decay=weight_decay, factored=sq is None)
            cache[key] = (exact, exact.rounded())
        host.append(cache[key])
    sharded = [i for i in range(len(params))
               if factored_stats is not None and factored_stats[i] is not None]
    index = [i for i in range(len(params)) if not sharded or i not in set(sharded)]

    def pick(items: Sequence[Any]) -> list[Any]:
        return [items[i] for i in index]

    rest = _cpu_step.step_list_cpu(
        pick(params), pick(grads), pick(exp_avg_codes), pick(exp_avg_scales),
        pick(exp_avg_sqs), pick(exp_avg_sq_rows), pick(exp_avg_sq_cols),
        [host[i][1] for i in index],
        codebook=codebook, beta1=beta1, beta2=beta2, eps=eps, maximize=maximize,
        stochastic_round=stochastic_round, seeds=None if seeds is None else pick(seeds))
    for i in sorted([index[j] for j in rest] + sharded):
        _apply(block_step, factored_step, params[i], grads[i], exp_avg_codes[i],
               exp_avg_scales[i], exp_avg_sqs[i], exp_avg_sq_rows[i], exp_avg_sq_cols[i],
               host[i][0], None, codebook=codebook, beta1=beta1, beta2=beta2, eps=eps,
               maximize=maximize, stochastic_round=stochastic_round,
               seed=0 if seeds is None else seeds[i], seed_tensor=None,
               stats=None if factored_stats is None else factored_stats[i])


def reference_step(*args: Any, batched_counters: bool = False, **kwargs: Any) -> None:
    """:func:`fused_step` through ``block_step_reference`` / ``factored_step_reference``, one
    tensor at a time: valid on every device and dtype (fp64 included), and what the fused
    routes are checked against. Same arguments as :func:`fused_step`, plus
    ``batched_counters``: advance the counters by one multi-tensor add per list instead of
    one add per tensor (the same values)."""
    _each(block_step_reference, factored_step_reference, *args,
          batched_counters=batched_counters, **kwargs)


def op_step(*args: Any, batched_counters: bool = False, **kwargs: Any) -> None:
    """:func:`reference_step` through the public custom ops ``block_step`` / ``factored_step``
    instead of their references: on the CPU (eager, not ``capturable``) their CPU kernel for
    the whole list in one native call (``ops._cpu_step.step_list_cpu``, the reference's bits,
    docs/decisions.md "The CPU step"), elsewhere each op with the device's kernel. Same
    arguments as :func:`reference_step`."""
    _each(block_step, factored_step, *args, batched_counters=batched_counters, **kwargs)


# ------------------------------------------------------------------------ the fused step
def fused_step(
    params: Sequence[Tensor], grads: Sequence[Tensor], exp_avg_codes: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor | None],
    exp_avg_sq_rows: Sequence[Tensor | None], exp_avg_sq_cols: Sequence[Tensor | None],
    state_steps: Sequence[Tensor], exp_avg_sq_steps: Sequence[Tensor], *, codebook: Tensor,
    lr: float | Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
    maximize: bool, stochastic_round: bool, seeds: Sequence[int] | None,
    seed_tensors: Sequence[Tensor] | None, capturable: bool,
    factored_stats: Sequence[tuple[Tensor, int] | None] | None = None,
) -> None:
    """One fused Gefen step of a list of initialised tensors, in place
    (docs/algorithm.md#block-second-moment, docs/algorithm.md#factored-second-moment).

    Eagerly on CUDA with Triton, through cached launch plans: one launch per block-mode tensor
    and three per factored one, or a few grouped launches for the whole list, the scalars
    computed once per distinct step count, no host synchronisation; graph-replayed with
    ``GEFEN_CUDA_GRAPHS=1``. Under ``torch.compile``, off CUDA, and for a tensor the plans do
    not take (non-contiguous, reduced row-shard statistics), through the public custom ops
    ``block_step`` / ``factored_step``, which the compiler keeps in its graph. Every route
    gives the bits of the public ops.

    Args:
        params: parameters, any layout (a non-contiguous one is stepped through a contiguous
            work copy that is copied back); fp32, bf16 or fp16 on CUDA.
        grads: gradients, same shapes, any float dtype.
        exp_avg_codes: uint8 ``[B, P]`` momentum codes (in/out).
        exp_avg_scales: fp32 ``[B, 1]`` per-block momentum scales (in/out).
        exp_avg_sqs: fp32 ``[B, 1]`` per-block second moments (block mode), or ``None``
            (factored mode).
        exp_avg_sq_rows, exp_avg_sq_cols: factored statistics fp32 ``[R]`` / ``[C]`` of a 2-D
            ``params[i]`` ``[R, C]``, or ``None`` (block mode).
        state_steps: fp32 0-dim momentum ages ``t``, advanced by one here.
        exp_avg_sq_steps: fp32 0-dim second-moment ages ``tv``, advanced by one here.
        codebook: fp32 ``[256]`` on the parameters' device.
        lr: learning rate, float or 1-element tensor (read once on the host unless
            ``capturable``).
        beta1, beta2, eps, weight_decay, maximize: as in ``block_step``.
        stochastic_round: stochastic instead of nearest rounding of the codes
            (docs/algorithm.md#stochastic-rounding).
        seeds: one signed 64-bit seed per tensor (stochastic rounding, not ``capturable``).
        seed_tensors: int64 ``[1]`` device seeds per tensor (``capturable``).
        capturable: scalars and seeds are computed and read on the device: no host
            synchronisation, capturable in a CUDA graph (docs/algorithm.md#capturable).
        factored_stats: per tensor ``None`` or, for a factored tensor that is one row shard of
            a larger matrix, ``(stats, global_rows)`` as ``factored_step`` takes them.

    The caller validates the lists (gefen-core's ``gefen_core.functional.gefen`` does).
    """
    if _plans_apply(params):
        # Triton launches on the current device's stream: make it the tensors' device.
        with torch.cuda.device(params[0].device):
            _planned(params, grads, exp_avg_codes, exp_avg_scales, exp_avg_sqs,
                     exp_avg_sq_rows, exp_avg_sq_cols, state_steps, exp_avg_sq_steps,
                     codebook=codebook, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                     weight_decay=weight_decay, maximize=maximize,
                     stochastic_round=stochastic_round, seeds=seeds, seed_tensors=seed_tensors,
                     capturable=capturable, factored_stats=factored_stats)
    else:
        _each(block_step, factored_step, params, grads, exp_avg_codes, exp_avg_scales,
              exp_avg_sqs, exp_avg_sq_rows, exp_avg_sq_cols, state_steps, exp_avg_sq_steps,
              codebook=codebook, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
              weight_decay=weight_decay, maximize=maximize, stochastic_round=stochastic_round,
              seeds=seeds, seed_tensors=seed_tensors, capturable=capturable,
              batched_counters=True, factored_stats=factored_stats)


def _plans_apply(params: Sequence[Tensor]) -> bool:
    """Eager CUDA steps with Triton take the planned launches."""
    if not params or torch.compiler.is_compiling() or params[0].device.type != "cuda":
        return False
    return bool(triton_available())


# Plans keyed (weakly) by each parameter's codes tensor: a new state tensor means a new plan.
_PLANS: Any = WeakIdKeyDictionary()


def _plan_for(
    param: Tensor, codes: Tensor, scale: Tensor, sq: Tensor | None, row: Tensor | None,
    col: Tensor | None, codebook: Tensor, options: tuple[Any, ...],
) -> StepPlan:
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


def _planned(
    params: Sequence[Tensor], grads: Sequence[Tensor], exp_avg_codes: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor | None],
    exp_avg_sq_rows: Sequence[Tensor | None], exp_avg_sq_cols: Sequence[Tensor | None],
    state_steps: Sequence[Tensor], exp_avg_sq_steps: Sequence[Tensor], *, codebook: Tensor,
    lr: float | Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
    maximize: bool, stochastic_round: bool, seeds: Sequence[int] | None,
    seed_tensors: Sequence[Tensor] | None, capturable: bool,
    factored_stats: Sequence[tuple[Tensor, int] | None] | None = None,
) -> None:
    """The planned launches: grouped capturable, graph-replayed, grouped, or one plan per
    tensor (the ops for a tensor the plans do not take)."""
    n = len(params)
    counters = list(state_steps) + list(exp_avg_sq_steps)
    if all(c.device == counters[0].device for c in counters):
        torch._foreach_add_(counters, 1)
    else:
        torch._foreach_add_(list(state_steps), 1)
        torch._foreach_add_(list(exp_avg_sq_steps), 1)
    factored = [sq is None for sq in exp_avg_sqs]
    hypers: list[Tensor] = []
    host: list[StepScalars] = []
    if capturable and _grouped_capturable(
            params, grads, exp_avg_codes, exp_avg_scales, exp_avg_sqs, exp_avg_sq_rows,
            exp_avg_sq_cols, state_steps, exp_avg_sq_steps, seed_tensors, factored_stats,
            codebook=codebook, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, maximize=maximize, stochastic_round=stochastic_round):
        return
    if capturable:
        hypers = [None] * n  # type: ignore[list-item]
        for mode in (False, True):
            idx = [i for i in range(n) if factored[i] == mode]
            if not idx:
                continue
            rows_ = _device_scalars_of([state_steps[i] for i in idx],
                                       [exp_avg_sq_steps[i] for i in idx], factored=mode, lr=lr,
                                       beta1=beta1, beta2=beta2, weight_decay=weight_decay)
            for j, i in enumerate(idx):
                hypers[i] = rows_[j]
    else:
        host = _rounded_scalars(_read_counters(state_steps), _read_counters(exp_avg_sq_steps),
                                factored, lr=_host_lr(lr), beta1=beta1, beta2=beta2,
                                weight_decay=weight_decay)
    if host and _graphable(params, factored_stats):
        _graphed_step(params, grads, exp_avg_codes, exp_avg_scales, exp_avg_sqs,
                      exp_avg_sq_rows, exp_avg_sq_cols, host, codebook=codebook,
                      options=(beta1, beta2, eps, bool(maximize), bool(stochastic_round), True),
                      seeds=seeds if stochastic_round else None)
        return
    options = (beta1, beta2, eps, bool(maximize), bool(stochastic_round), bool(capturable))
    grouped: list[tuple[StepPlan, Tensor, int]] = []  # (plan, contiguous grad, index)
    for i in range(n):
        param, grad = params[i], grads[i]
        sq, row, col = exp_avg_sqs[i], exp_avg_sq_rows[i], exp_avg_sq_cols[i]
        seed = 0 if (seeds is None or capturable) else seeds[i]
        seed_tensor = seed_tensors[i] if (capturable and seed_tensors is not None) else None
        stats = None if factored_stats is None else factored_stats[i]
        if stats is not None or not param.is_contiguous():
            # The ops' path keeps its contiguous work copy and copy-back; reduced statistics
            # of a row shard (which the plans do not take) go through the ops too.
            _apply(block_step, factored_step, param, grad, exp_avg_codes[i], exp_avg_scales[i],
                   sq, row, col, host[i] if host else None, hypers[i] if hypers else None,
                   codebook=codebook, beta1=beta1, beta2=beta2, eps=eps, maximize=maximize,
                   stochastic_round=stochastic_round, seed=seed, seed_tensor=seed_tensor,
                   stats=stats)
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
        sc = host[i]
        plan.launch(g, lr=sc.lr, bc1_recip=sc.bc1_recip, bc2=sc.bc2, decay=sc.decay,
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
        # Tables built outside this capture (a capture builds none): a reference, no allocation.
        kept = _CAPTURED_GROUPS.setdefault(exp_avg_codes[0], [])
        if not any(k is groups for k in kept):
            kept.append(groups)
    hyper = _device_scalars_of(state_steps, exp_avg_sq_steps, factored=groups.factored,
                               lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    seeds = torch.cat([s.reshape(1) for s in seed_tensors])
    groups.launch_staged(grads, groups.device_buffer(hyper, gptr, seeds), None, None,
                         device_scalars=True)
    return True


# The StepGroups that captured graphs read, kept (weakly keyed) by the first tensor's codes:
# the _GROUPS cache replaces an entry when a later step has another tensor list, which would
# free the tables a graph still reads.
_CAPTURED_GROUPS: Any = WeakIdKeyDictionary()
# Grouped launches, keyed (weakly) by the first plan's codes.
_GROUPS: Any = WeakIdKeyDictionary()


def _step_groups(plans: Sequence[StepPlan], grads: Sequence[Tensor], anchor: Tensor, *,
                 build: bool = True) -> StepGroups | None:
    """The cached :class:`StepGroups` of these plans and gradients (rebuilt when they no
    longer fit it, or ``None`` then if not ``build``). ``anchor``: the first tensor's codes;
    the launch tables live as long as it does."""
    groups = _GROUPS.get(anchor)
    if groups is None or not groups.matches(plans, grads):
        if not build:
            return None
        groups = StepGroups(plans, grads)
        if keeps_tables():
            _GROUPS[anchor] = groups
    return groups


def _grouped_launch(grouped: Sequence[tuple[StepPlan, Tensor, int]],
                    host: Sequence[StepScalars], seeds: Sequence[int] | None, *,
                    anchor: Tensor) -> None:
    """The planned tensors of one step in a few launches per class of tensors (one per
    block-mode class, three per chunk of a factored class; factored tensors of the loop and
    split routes two per chunk plus their own update) instead of one to three per tensor:
    bit-identical to the per-plan launches."""
    grads = [item[1] for item in grouped]
    groups = _step_groups([item[0] for item in grouped], grads, anchor)
    assert groups is not None
    groups.launch(grads, [host[i] for _, _, i in grouped],
                  None if seeds is None else [seeds[i] for _, _, i in grouped])


def _graphable(params: Sequence[Tensor],
               factored_stats: Sequence[tuple[Tensor, int] | None] | None) -> bool:
    """Whether this eager step can be graph-replayed (:mod:`._step_graphs`): every tensor
    takes a plan (contiguous, no reduced row-shard statistics) and no graph is being captured
    by the caller (then the launches belong in the caller's graph)."""
    return (_step_graphs.enabled() and keeps_tables() and len(params) > 1
            and (factored_stats is None or all(s is None for s in factored_stats))
            and all(p.is_contiguous() for p in params)
            and not torch.cuda.is_current_stream_capturing())


def _graphed_step(
    params: Sequence[Tensor], grads: Sequence[Tensor], exp_avg_codes: Sequence[Tensor],
    exp_avg_scales: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor | None],
    exp_avg_sq_rows: Sequence[Tensor | None], exp_avg_sq_cols: Sequence[Tensor | None],
    host: Sequence[StepScalars], *, codebook: Tensor, options: tuple[Any, ...],
    seeds: Sequence[int] | None,
) -> None:
    """The planned launches through capturable plans and device scalars, graph-replayed when
    the addresses repeat (bit-identical to the by-value launches)."""
    plans = []
    tensors: list[Tensor | None] = []
    for i, param in enumerate(params):
        state = (exp_avg_codes[i], exp_avg_scales[i], exp_avg_sqs[i], exp_avg_sq_rows[i],
                 exp_avg_sq_cols[i])
        plans.append(_plan_for(param, *state, codebook, options))
        tensors.append(param)
        tensors.extend(state)
    tensors.append(codebook)
    _step_graphs.launch(plans, grads, tensors, host,
                        None if seeds is None else [to_signed64(s) for s in seeds],
                        anchor=exp_avg_codes[0])


# ------------------------------------------------------------------ repeating one step
class FusedStepRecord:
    """The launches of one eager :func:`fused_step` over a fixed list of tensors on one CUDA
    device, decided once, for a caller that steps the same tensors again and has checked that
    nothing the launches depend on changed: the tensors (identity and address), the
    gradients' dtypes, shapes, contiguity and 16-byte alignment, the options, and the codebook
    (unmodified, at the same address). gefen-core's steady step is that caller. Repeating the
    record gives the bits of :func:`fused_step`. It holds no tensor (the plans and launch
    tables refer to them weakly).

    Build it with :meth:`build`; step with :meth:`launch`.
    """

    def __init__(self, plans: list[StepPlan], groups: StepGroups | None, factored: list[bool],
                 beta1: float, beta2: float) -> None:
        self.plans = plans
        self.groups = groups  # None for a single tensor (one plan launch)
        #: Per tensor: factored mode (``exp_avg_sqs[i] is None``).
        self.factored = factored
        self.beta1, self.beta2 = beta1, beta2

    @classmethod
    def build(
        cls, params: Sequence[Tensor], grads: Sequence[Tensor], exp_avg_codes: Sequence[Tensor],
        exp_avg_scales: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor | None],
        exp_avg_sq_rows: Sequence[Tensor | None], exp_avg_sq_cols: Sequence[Tensor | None], *,
        codebook: Tensor, beta1: float, beta2: float, eps: float, maximize: bool,
        stochastic_round: bool,
    ) -> FusedStepRecord | None:
        """The record of the step :func:`fused_step` has just made over these tensors (same
        arguments, non-``capturable``, no reduced statistics), or ``None`` when it did not
        take the planned launches or a tensor or gradient is not contiguous."""
        if (not _plans_apply(params) or not all(p.is_contiguous() for p in params)
                or not all(g.is_contiguous() for g in grads)):
            return None
        options = (beta1, beta2, eps, bool(maximize), bool(stochastic_round), False)
        plans = [_plan_for(p, c, s, sq, r, col, codebook, options)
                 for p, c, s, sq, r, col in zip(params, exp_avg_codes, exp_avg_scales,
                                                exp_avg_sqs, exp_avg_sq_rows, exp_avg_sq_cols)]
        groups = _step_groups(plans, grads, exp_avg_codes[0]) if len(plans) > 1 else None
        return cls(plans, groups, [sq is None for sq in exp_avg_sqs], beta1, beta2)

    def launch(self, grads: Sequence[Tensor], steps: Sequence[float],
               exp_avg_sq_steps: Sequence[float], *, lr: float, weight_decay: float,
               seeds: Sequence[int] | None) -> None:
        """One step with gradients ``grads`` (those of :meth:`build`'s checks), on the current
        CUDA device. ``steps`` / ``exp_avg_sq_steps``: every tensor's counters, already
        advanced; ``lr`` a host float; ``seeds``: per tensor signed 64-bit seeds, or ``None``
        (nearest rounding; seed 0). Graph-replayed with ``GEFEN_CUDA_GRAPHS=1``."""
        scalars = _rounded_scalars(steps, exp_avg_sq_steps, self.factored, lr=lr,
                                   beta1=self.beta1, beta2=self.beta2, weight_decay=weight_decay)
        groups = self.groups
        if groups is None:
            sc = scalars[0]
            self.plans[0].launch(grads[0], lr=sc.lr, bc1_recip=sc.bc1_recip, bc2=sc.bc2,
                                 decay=sc.decay, seed=0 if seeds is None else seeds[0])
        elif _step_graphs.enabled() and groups.device.type == "cuda":
            _step_graphs.launch_groups(groups, grads, scalars, seeds)
        else:
            groups.launch(grads, scalars, seeds)
