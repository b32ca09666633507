"""The steady-state eager fused step (the kernels issue: GPT-2-shaped steps are host-bound).

A full :meth:`Gefen.step` walks every parameter in Python: it validates each gradient
(docs/algorithm.md#step C), builds the per-path state lists (``_init_group``), looks up each
tensor's launch plan and checks the grouped launch tables against every planned tensor's storage.
That costs about 25 µs per tensor of host time, more than the kernels of a GPT-2-sized model take on
the GPU. In a training loop none of it changes from one step to the next.

After a full step whose tensors all took the grouped fused launches, :func:`build` records
what it launched. The next step calls :meth:`SteadyStep.run` first, which checks, before
anything is mutated, that a full step would build exactly the same launches:

* every group's parameter list (identity and order) and which parameters have a gradient;
* each gradient's layout, dtype, shape, device, contiguity and 16-byte alignment (the
  validation of docs/algorithm.md#step C, and what chose the launch classes);
* each group's options other than ``lr`` and ``weight_decay`` (the plans are built for
  ``betas``, ``eps``, ``maximize`` and the rounding; the path for ``fused``, ``foreach``,
  ``factored_v_2d``, ``min_dim_size_to_factor``, ``capturable``); ``lr`` and ``weight_decay``
  are read every step, as in the full step;
* each stepped parameter's state entries (identity), the address of every planned tensor
  (``p.data = ...`` keeps a tensor's identity but moves its storage), the parameters' dtypes,
  devices and contiguity (a transposed square matrix keeps its address and shape);
* the codebook (the same tensor on each device, unmodified, at the same address), no codebook
  refresh due, not inside ``torch.compile``.

If all hold it advances the counters and repeats each call's launches through the public
kernel entry (``gefen_kernels.FusedStepRecord.launch``: the per-step scalars computed by the
full step's code, the same plans and launch tables), so the result is bit-identical to the full
step. With graph replay on (``GEFEN_CUDA_GRAPHS=1``), each CUDA call's grouped launches are
captured and then replayed there: the grouped gradients reach the graph through staged offsets,
and everything else its addresses depend on is what this check has just established.
Otherwise it returns ``False`` having changed nothing, and the full step runs (and records
again). The record refers to parameters, state and the codebook only weakly, so
it never keeps replaced, deleted or offloaded state alive.
An optimizer that reduces factored statistics (``_reduces_factored_stats``, whose
``_factored_statistics`` hook may be a collective on every step) is never recorded.

The step counters (``state["step"]`` and ``state["exp_avg_sq_step"]``, fp32 0-d CPU tensors as in
``torch.optim``) are separate tensors, and adding one to ~300 of them costs ~300 dispatches (about
1.1 ms on the H200 host under the profiler, half the GPT-2-shaped step's host time). So
:func:`build` lays each launch call's counters out as 0-d views of one fp32 buffer, with their
values (the first record replaces the counter tensors; later records of the same tensors keep them),
and a steady step advances them all with one ``add_`` and reads them with one ``tolist``. The record
checks the counters' identity and address, so a counter replaced or moved (``.set_()``,
``.data =``) sends the step to the full path. The views are ordinary tensors to every other
reader (``state_dict``, ``torch.save``, ``torch.distributed.checkpoint``, the full step's
``_foreach_add_``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gefen_kernels import FusedStepRecord

from . import amp as _amp
from . import dispatch as _dispatch
from ._seeds import mix_seed, name_salt

__all__ = ["BucketStep", "SteadyStep", "build", "build_bucket", "counter_buffer"]

# The group options the recorded plans and paths depend on (lr and weight_decay only enter
# the per-step scalars, which are recomputed every step).
_OPTION_KEYS = ("betas", "eps", "maximize", "stochastic_round", "capturable", "fused",
                "foreach", "factored_v_2d", "min_dim_size_to_factor")
_STRIDED = torch.strided


def _options(group: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(group[k] for k in _OPTION_KEYS)


class _Call:
    """One ``functional.gefen`` call of the full step: one group's tensors on one device."""

    __slots__ = ("group", "device", "salts", "record", "codebook", "codebook_version",
                 "codebook_ptr", "counters")

    def __init__(self, group: dict[str, Any], lists: dict[str, list[Any]],
                 salts: list[int], record: FusedStepRecord) -> None:
        self.group = group
        self.device: torch.device = lists["params"][0].device
        self.salts = salts
        self.record = record  # the launches; it holds no tensors
        codebook: Tensor = lists["codebooks"][0]
        self.codebook = weakref.ref(codebook)
        self.codebook_version = codebook._version
        # `.data =` moves a tensor's storage without bumping its version; the launches (and a
        # captured graph) hold the address.
        self.codebook_ptr = codebook.data_ptr()
        # The buffer every counter of this call is a view of (`_rehome_counters`), weakly:
        # the views keep it alive as long as the state holds them.
        self.counters: weakref.ref[Tensor] | None = None


class SteadyStep:
    """What the last full step launched, and what must not have changed to launch it again.

    Built by :func:`build`; :meth:`run` is the whole step when it returns ``True``. It holds
    only weak references to parameters and state, so state that is replaced, deleted or
    offloaded (``gefen_dist.offload_state_``) is freed at once, and the next step then takes
    the full path.
    """

    def __init__(self, opt: Any, calls: list[_Call],
                 expects: list[list[tuple[Any, ...] | None]]) -> None:
        self._groups = [(g, [weakref.ref(p) for p in g["params"]], _options(g))
                        for g in opt.param_groups]
        self._calls = calls
        # Per group, per parameter: None (no gradient) or a tuple of: the index of its call,
        # or -1 for a gradient that is validated but not stepped (no elements); the
        # gradient's dtype, shape (the parameter's), device (the parameter's) and 16-byte
        # alignment; the parameter's dtype and address; and, for a stepped parameter,
        # ((state key, weak reference, address), ...) of the state its launches use,
        # the two step counters last.
        self._expects = expects

    def run(self, opt: Any) -> bool:
        """Step ``opt`` if nothing the recorded launches depend on has changed; ``False``
        (nothing done) otherwise. Called after the closure, before any other work."""
        if opt._codebook_refresh_every > 0 and opt._global_step > 0 \
                and opt._global_step % opt._codebook_refresh_every == 0:
            return False
        if torch.compiler.is_compiling():
            return False
        if len(opt.param_groups) != len(self._groups):
            return False
        calls = self._calls
        grads: list[list[Tensor]] = [[] for _ in calls]
        steps: list[list[Tensor]] = [[] for _ in calls]
        sq_steps: list[list[Tensor]] = [[] for _ in calls]
        every: list[Tensor] = []  # every gradient, for the AMP unscale of the full step
        state = opt.state
        for group, (ref, params, options), expects in zip(opt.param_groups, self._groups,
                                                           self._expects):
            current: list[Tensor] = group["params"]
            if group is not ref or len(current) != len(params) or _options(group) != options:
                return False
            for p, q, e in zip(current, params, expects):
                if p is not q():
                    return False
                g = p.grad
                if e is None:
                    if g is not None:
                        return False
                    continue
                if g is None or not _gradient_fits(p, g, e):
                    return False
                every.append(g)
                call = e[0]
                if call < 0:
                    continue
                st = state.get(p)
                if st is None or not _state_fits(p, st, e[7]):
                    return False
                grads[call].append(g)
                steps[call].append(st["step"])
                sq_steps[call].append(st["exp_avg_sq_step"])
        if not all(_codebook_fits(opt, call) for call in calls):
            return False
        # Everything the full step would check and build is as recorded: from here on this
        # is the full step's work, in its order.
        overflow, inv_scale = _amp.overflow_and_inverse_scale(opt)
        if overflow:
            return True  # docs/algorithm.md#mixed-precision: nothing learned, counted or touched.
        if inv_scale is not None:
            _amp.unscale_(every, inv_scale)
        for i, call in enumerate(calls):
            _launch(opt, call, grads[i], steps[i], sq_steps[i])
        for t in opt._device_global_step.values():
            t.add_(1)
        opt._global_step += 1
        return True


def build(opt: Any, inits: Sequence[tuple[dict[str, Any], dict[str, dict[str, list[Any]]]]],
          live: Sequence[tuple[dict[str, Any], Tensor, Tensor, str]],
          stepped: Sequence[tuple[dict[str, Any], Tensor, Tensor, str]],
          split: Any) -> SteadyStep | None:
    """Record a full step that has just run, or ``None`` when :meth:`SteadyStep.run` could not
    repeat it: a tensor off the grouped fused launches (another path, capturable, not
    contiguous, a DTensor, reduced statistics), a live tensor the step skipped, no codebook
    yet, or an optimizer that reduces factored statistics (its ``_factored_statistics`` hook
    is called on every step). ``split`` is the optimizer's per-device split of a path's lists
    (``_dispatch.split_by_device``)."""
    if (opt._codebook is None or len(stepped) != len(live) or not stepped
            or opt._reduces_factored_stats):
        return None
    names = {id(p): name for _, p, _, name in stepped}
    calls: list[_Call] = []
    call_of: dict[int, int] = {}
    factored: dict[int, bool] = {}
    for group, by_path in inits:
        if set(by_path) != {"fused"} or group["capturable"]:
            return None
        for lists in split(by_path["fused"]):
            params = lists["params"]
            if (any(s is not None for s in lists["factored_stats"])
                    or any(_dispatch.is_dtensor(p) for p in params)):
                return None
            record = _record(group, lists)
            if record is None:
                return None
            for p, sq in zip(params, lists["sqs"]):
                call_of[id(p)] = len(calls)
                factored[id(p)] = sq is None
            calls.append(_Call(group, lists, [name_salt(names[id(p)]) for p in params], record))
    graded = {id(p): g for _, p, g, _ in live}
    stepped_states: list[list[dict[str, Any]]] = [[] for _ in calls]
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None and call_of.get(id(p), -1) >= 0:
                stepped_states[call_of[id(p)]].append(opt.state[p])
    for launch_call, states in zip(calls, stepped_states):
        launch_call.counters = _rehome_counters(states)
    expects: list[list[tuple[Any, ...] | None]] = []
    for group in opt.param_groups:
        row: list[tuple[Any, ...] | None] = []
        for p in group["params"]:
            g = p.grad
            if g is None:
                row.append(None)
                continue
            if (_dispatch.is_dtensor(p) or g.layout is not _STRIDED or g.shape != p.shape
                    or g.device != p.device):
                return None
            call = call_of.get(id(p), -1)
            entries: tuple[tuple[str, Any, int | None], ...] = ()
            if call >= 0:
                if graded.get(id(p)) is not g:
                    return None
                entries = _state_entries(opt.state[p], factored[id(p)])
            elif p.numel() > 0:
                return None
            row.append(_expect(call, p, g, entries))
        expects.append(row)
    return SteadyStep(opt, calls, expects)


class BucketStep:
    """What the full step of one bucket of :func:`gefen_core.step_in_backward` launched: one
    param group's gradients, in hook order, stepped together during the backward
    (docs/algorithm.md#step-in-backward). :meth:`run` repeats those launches on a later
    backward when the bucket holds the same parameters in the same order and everything
    :class:`SteadyStep` checks for its tensors is unchanged, so that a bucket costs a few
    checks per tensor and its launches instead of the full step's planning. Built by
    :func:`build_bucket`; weak references only, as :class:`SteadyStep`."""

    __slots__ = ("_group", "_options", "_params", "_call", "_expects")

    def __init__(self, group: dict[str, Any], params: list[Tensor], call: _Call,
                 expects: list[tuple[Any, ...]]) -> None:
        self._group = group
        self._options = _options(group)
        self._params = [weakref.ref(p) for p in params]
        self._call = call
        self._expects = expects

    def run(self, opt: Any, group: dict[str, Any],
            entries: Sequence[tuple[Tensor, Tensor, str]]) -> bool:
        """Step the bucket ``entries`` (``(param, grad, name)``, in hook order) of ``group``
        if the recorded launches still apply; ``False`` (nothing done) otherwise."""
        call = self._call
        # Tensor betas compare equal to themselves after an in-place change, and the recorded
        # launches hold their values: as in Gefen.step, they take the full step.
        if (group is not self._group or len(entries) != len(self._params)
                or opt._has_tensor_betas() or _options(group) != self._options
                or not _codebook_fits(opt, call)):
            return False
        grads: list[Tensor] = []
        steps: list[Tensor] = []
        sq_steps: list[Tensor] = []
        state = opt.state
        for (p, g, _), ref, e in zip(entries, self._params, self._expects):
            if p is not ref() or not _gradient_fits(p, g, e):
                return False
            st = state.get(p)
            if st is None or not _state_fits(p, st, e[7]):
                return False
            grads.append(g)
            steps.append(st["step"])
            sq_steps.append(st["exp_avg_sq_step"])
        _launch(opt, call, grads, steps, sq_steps)
        return True


def build_bucket(opt: Any, group: dict[str, Any], by_path: dict[str, dict[str, list[Any]]],
                 entries: Sequence[tuple[Tensor, Tensor, str]]) -> BucketStep | None:
    """Record the full step of one in-backward bucket that has just run (``by_path``: its
    :meth:`Gefen._init_group` lists), or ``None`` where :class:`SteadyStep` would not record
    it either: another path than the grouped fused launches, several devices, capturable,
    DTensors or reduced statistics, no codebook, tensor betas."""
    if (opt._codebook is None or opt._reduces_factored_stats or set(by_path) != {"fused"}
            or group["capturable"] or opt._has_tensor_betas()):
        return None
    lists = by_path["fused"]
    params = lists["params"]
    if (len(_dispatch.split_by_device(lists)) != 1 or len(params) != len(entries)
            or any(s is not None for s in lists["factored_stats"])
            or any(_dispatch.is_dtensor(p) for p in params)):
        return None
    record = _record(group, lists)
    if record is None:
        return None
    call = _Call(group, lists, [name_salt(name) for _, _, name in entries], record)
    call.counters = _rehome_counters([opt.state[p] for p, _, _ in entries])
    expects = []
    for (p, g, _), q, sq in zip(entries, params, lists["sqs"]):
        if (p is not q or g.layout is not _STRIDED or g.shape != p.shape
                or g.device != p.device):
            return None
        expects.append(_expect(0, p, g, _state_entries(opt.state[p], sq is None)))
    return BucketStep(group, [p for p, _, _ in entries], call, expects)


def _record(group: dict[str, Any], lists: dict[str, list[Any]]) -> FusedStepRecord | None:
    beta1, beta2 = group["betas"]
    return FusedStepRecord.build(
        lists["params"], lists["grads"], lists["codes"], lists["scales"], lists["sqs"],
        lists["rows"], lists["cols"], codebook=lists["codebooks"][0], beta1=beta1,
        beta2=beta2, eps=group["eps"], maximize=group["maximize"],
        stochastic_round=group["stochastic_round"])


def _state_entries(st: dict[str, Any], factored: bool) -> tuple[tuple[str, Any, int], ...]:
    """``(key, weak reference, address)`` of each state tensor the launches use, the two step
    counters last: a steady step advances the buffer the counters are views of
    (:func:`_rehome_counters`), which ``.set_()`` or ``.data =`` would detach them from."""
    keys = ["exp_avg_codes", "exp_avg_scale"]
    keys += ["exp_avg_sq_row", "exp_avg_sq_col"] if factored else ["exp_avg_sq"]
    keys += ["step", "exp_avg_sq_step"]
    return tuple((k, weakref.ref(st[k]), st[k].data_ptr()) for k in keys)


def _expect(call: int, p: Tensor, g: Tensor, entries: tuple[Any, ...]) -> tuple[Any, ...]:
    """What :func:`_gradient_fits` and :func:`_state_fits` compare (see ``SteadyStep``)."""
    return (call, g.dtype, p.shape, p.device, g.data_ptr() & 15 == 0, p.dtype, p.data_ptr(),
            entries)


def _gradient_fits(p: Tensor, g: Tensor, e: tuple[Any, ...]) -> bool:
    """Whether gradient ``g`` of ``p`` takes the launches planned for ``e``'s: the validation
    of docs/algorithm.md#step C and what chose the launch classes, and ``p`` in place."""
    _, dtype, shape, device, aligned, p_dtype, p_ptr, _ = e
    return not (g.layout is not _STRIDED or g.dtype is not dtype or g.shape != shape
                or g.device != device or not g.is_contiguous()
                or (g.data_ptr() & 15 == 0) is not aligned or p.dtype is not p_dtype
                or p.shape != shape or p.device != device or p.data_ptr() != p_ptr)


def _state_fits(p: Tensor, st: dict[str, Any], entries: tuple[Any, ...]) -> bool:
    """Whether a stepped ``p`` is contiguous (a transposed view of a square matrix keeps its
    address and shape) and its state holds the tensors the launches were planned for."""
    if not p.is_contiguous():
        return False
    for key, t_ref, ptr in entries:
        t = st.get(key)
        if t is None or t is not t_ref() or t.data_ptr() != ptr:
            return False
    return True


def _codebook_fits(opt: Any, call: _Call) -> bool:
    """The codebook is the same tensor on the call's device, unmodified, at the same address."""
    codebook = call.codebook()
    return not (codebook is None or opt._codebook_on(call.device) is not codebook
                or codebook._version != call.codebook_version
                or codebook.data_ptr() != call.codebook_ptr)


def _launch(opt: Any, call: _Call, grads: list[Tensor], steps: list[Tensor],
            sq_steps: list[Tensor]) -> None:
    """Advance the call's counters and repeat its launches with this step's scalars (the
    full step's order: the group's lr is read before its counters move)."""
    group = call.group
    lr = opt._host_lr(group["lr"])
    with torch.cuda.device(call.device):
        buffer = call.counters() if call.counters is not None else None
        n = len(steps)
        if buffer is not None:
            # Every counter stepped here is a view of `buffer`, in this order (their identity
            # was checked by the caller), and nothing else is.
            buffer.add_(1)
            values = buffer.tolist()
        else:
            torch._foreach_add_(steps + sq_steps, 1)
            values = [float(c.item()) for c in steps + sq_steps]
        seeds = ([mix_seed(opt._global_step, s) for s in call.salts]
                 if group["stochastic_round"] else None)
        call.record.launch(grads, values[:n], values[n:], lr=lr,
                           weight_decay=group["weight_decay"], seeds=seeds)


def _rehome_counters(states: Sequence[dict[str, Any]]) -> weakref.ref[Tensor] | None:
    """Make the counters of ``states`` 0-d views of one fp32 CPU buffer (``step`` of every
    state, then ``exp_avg_sq_step`` of every state, in ``states``' order), with their values;
    a weak reference to it. Counters already laid out so (an earlier record of the same
    tensors) are kept as they are; otherwise they are replaced by views of a new buffer, so a
    reference to an old counter tensor taken before stops following the state. ``None``
    (nothing changed) unless every counter is an fp32 0-d CPU tensor."""
    old = [st["step"] for st in states] + [st["exp_avg_sq_step"] for st in states]
    if not old or any(t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 0
                      or t.requires_grad for t in old):
        return None
    base = counter_buffer(old)
    if base is not None:
        return weakref.ref(base)
    buffer = torch.stack(old)
    n = len(states)
    for i, st in enumerate(states):
        st["step"] = buffer[i]
        st["exp_avg_sq_step"] = buffer[n + i]
    return weakref.ref(buffer)


def counter_buffer(counters: Sequence[Tensor]) -> Tensor | None:
    """The fp32 CPU buffer whose 0-d views ``counters`` are, in order and with nothing else in
    it (the layout :func:`_rehome_counters` gives them), or ``None``."""
    if not counters:
        return None
    base = counters[0]._base
    if (base is None or base.dim() != 1 or base.numel() != len(counters)
            or base.dtype != torch.float32 or base.device.type != "cpu"):
        return None
    # Addresses, not storage offsets: `.data =` gives a view new storage but keeps its `_base`.
    start = base.data_ptr()
    if all(t._base is base and t.dim() == 0 and t.data_ptr() == start + 4 * i
           for i, t in enumerate(counters)):
        return base
    return None
