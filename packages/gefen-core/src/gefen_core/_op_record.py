"""The steady launches of the compiled step's op (docs/algorithm.md#compiled-stepping).

Under ``torch.compile`` a steady step is one ``torch.ops.gefen.functional_step`` call per
(group, path, device), whose kernel is :func:`gefen_core._compiled_step.functional_step`. The
compiled graph hands that kernel the same parameter and state tensors on every step, and the
full fused path it would otherwise take costs about 25 µs of host time per tensor (validation,
launch-plan lookups, one dispatch per step counter): a compiled GPT-2-shaped step took several
times the eager step, whose own steady path (:mod:`gefen_core._steady_step`) repeats recorded
launches instead.

This module gives the op the same: after a full fused call it records the launches
(``gefen_kernels.FusedStepRecord``) and what they depend on, and a later call with the same
tensors repeats them. :func:`run` checks, before anything is mutated, that the full path would
build exactly these launches:

* the same parameters, codes, scales and second-moment statistics (identity and address: the
  launch tables hold addresses), the parameters' dtypes, shapes and contiguity, and the same
  codebook (identity, version, address);
* each gradient's layout, dtype, shape, device, contiguity and 16-byte alignment (a gradient
  may be a new tensor every step: the grouped launches read it through a staged offset);
* the options the plans were built for (``betas``, ``eps``, ``maximize``, the rounding, each
  tensor's mode);
* the step counters (identity and address).

``lr`` and ``weight_decay`` are per-step scalars, as in the full path. A call with a tensor
``lr`` or in ``capturable`` mode is never recorded. The record refers to every tensor weakly,
so replaced or freed state is not kept alive and simply sends the next call to the full path.

A compiler backend that hands the op copies of the tensors it mutates (one that does not
re-inplace them, such as ``aot_eager``) gives every call new tensors, so no record is ever
repeated; such call sites stop recording on every call (:data:`RETRY`).

The counters: where every counter of the call is a 0-d view of one fp32 buffer, ``step`` of
each tensor then ``exp_avg_sq_step`` of each, in order (the layout the eager steady step gives
them), one ``add_`` and one ``tolist`` advance and read them all; otherwise one multi-tensor add
and one read per counter.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from gefen_kernels import FusedStepRecord

from ._steady_step import counter_buffer

__all__ = ["record", "run"]

# One record per op call site, keyed (weakly) on its first codes tensor.
_RECORDS: Any = WeakIdKeyDictionary()
# Per codebook (weakly): calls in a row that found no record. Past RETRY, only every RETRY-th
# such call records (module docstring).
_UNUSED: Any = WeakIdKeyDictionary()
RETRY = 64


def _tensors(params: Sequence[Tensor], codes: Sequence[Tensor], scales: Sequence[Tensor],
             sqs: Sequence[Tensor | None], rows: Sequence[Tensor | None],
             cols: Sequence[Tensor | None], steps: Sequence[Tensor],
             sq_steps: Sequence[Tensor], codebook: Tensor) -> list[Tensor]:
    """Every tensor whose identity and address the launches and counters depend on."""
    out = [*params, *codes, *scales, *steps, *sq_steps, codebook]
    out += [t for t in (*sqs, *rows, *cols) if t is not None]
    return out


def _grad_meta(grads: Sequence[Tensor]) -> list[tuple[Any, ...]]:
    return [(g.layout, g.dtype, g.shape, g.device, g.is_contiguous(), g.data_ptr() & 15 == 0)
            for g in grads]


def _param_meta(params: Sequence[Tensor]) -> list[tuple[Any, ...]]:
    # A transposed square matrix keeps its address and shape, not its contiguity.
    return [(p.dtype, p.shape, p.is_contiguous()) for p in params]


class _Record:
    """What one fused call launched, and what must not have changed to launch it again."""

    __slots__ = ("launches", "refs", "ptrs", "params", "grads", "options", "codebook_version",
                 "buffer")

    def __init__(self, launches: FusedStepRecord, tensors: list[Tensor],
                 params: Sequence[Tensor], grads: Sequence[Tensor], options: tuple[Any, ...],
                 codebook: Tensor, buffer: Tensor | None) -> None:
        self.launches = launches  # holds no tensor
        self.refs = [weakref.ref(t) for t in tensors]
        self.ptrs = [t.data_ptr() for t in tensors]
        self.params = _param_meta(params)
        self.grads = _grad_meta(grads)
        self.options = options
        self.codebook_version = codebook._version
        self.buffer = None if buffer is None else weakref.ref(buffer)

    def matches(self, tensors: list[Tensor], params: Sequence[Tensor], grads: Sequence[Tensor],
                options: tuple[Any, ...], codebook: Tensor) -> bool:
        refs = self.refs
        return (len(tensors) == len(refs) and options == self.options
                and all(map(operator.is_, tensors, (r() for r in refs)))
                and [t.data_ptr() for t in tensors] == self.ptrs
                and codebook._version == self.codebook_version
                and _param_meta(params) == self.params and _grad_meta(grads) == self.grads)


def _options(beta1: float, beta2: float, eps: float, maximize: bool, stochastic_round: bool,
             sqs: Sequence[Tensor | None]) -> tuple[Any, ...]:
    return (beta1, beta2, eps, maximize, stochastic_round, tuple(s is None for s in sqs))


def run(params: Sequence[Tensor], grads: Sequence[Tensor], codes: Sequence[Tensor],
        scales: Sequence[Tensor], sqs: Sequence[Tensor | None], rows: Sequence[Tensor | None],
        cols: Sequence[Tensor | None], steps: Sequence[Tensor], sq_steps: Sequence[Tensor], *,
        codebook: Tensor, lr: float, beta1: float, beta2: float, eps: float,
        weight_decay: float, maximize: bool, stochastic_round: bool,
        seeds: Sequence[int] | None) -> bool:
    """Repeat the recorded launches of this call if nothing they depend on has changed (module
    docstring); ``False`` (nothing done) otherwise. Arguments as
    :func:`gefen_core.functional.gefen` (per-tensor ``sqs``/``rows``/``cols`` with ``None``
    for the other mode), ``lr`` a host float."""
    if not codes:
        return False
    rec: _Record | None = _RECORDS.get(codes[0])
    if rec is None:
        _UNUSED[codebook] = _UNUSED.get(codebook, 0) + 1
        return False
    tensors = _tensors(params, codes, scales, sqs, rows, cols, steps, sq_steps, codebook)
    options = _options(beta1, beta2, eps, maximize, stochastic_round, sqs)
    if not rec.matches(tensors, params, grads, options, codebook):
        return False
    _UNUSED[codebook] = 0
    n = len(steps)
    buffer = rec.buffer() if rec.buffer is not None else None
    if buffer is not None:
        buffer.add_(1)  # every counter of the call is a view of it, in order (record())
        values = buffer.tolist()
    else:
        counters = [*steps, *sq_steps]
        torch._foreach_add_(counters, 1)
        values = [float(c.item()) for c in counters]
    with torch.cuda.device(params[0].device):
        rec.launches.launch(grads, values[:n], values[n:], lr=lr, weight_decay=weight_decay,
                            seeds=seeds)
    return True


def record(params: Sequence[Tensor], grads: Sequence[Tensor], codes: Sequence[Tensor],
           scales: Sequence[Tensor], sqs: Sequence[Tensor | None],
           rows: Sequence[Tensor | None], cols: Sequence[Tensor | None],
           steps: Sequence[Tensor], sq_steps: Sequence[Tensor], *, codebook: Tensor,
           beta1: float, beta2: float, eps: float, maximize: bool,
           stochastic_round: bool) -> None:
    """Record the fused call that has just run with these arguments, for :func:`run`; drop
    any earlier record of this call site when its launches cannot be repeated (not the
    planned launches, or a tensor or gradient not contiguous). Where this codebook's calls
    have found no record for more than :data:`RETRY` calls in a row, only every
    :data:`RETRY`-th call records."""
    if not codes:
        return
    unused = _UNUSED.get(codebook, 0)
    if unused > RETRY and unused % RETRY:
        return
    launches = FusedStepRecord.build(
        params, grads, codes, scales, sqs, rows, cols, codebook=codebook, beta1=beta1,
        beta2=beta2, eps=eps, maximize=maximize, stochastic_round=stochastic_round)
    if launches is None:
        _RECORDS.pop(codes[0], None)
        return
    tensors = _tensors(params, codes, scales, sqs, rows, cols, steps, sq_steps, codebook)
    _RECORDS[codes[0]] = _Record(
        launches, tensors, params, grads,
        _options(beta1, beta2, eps, maximize, stochastic_round, sqs), codebook,
        counter_buffer([*steps, *sq_steps]))
