"""Gefen in the backward pass: each parameter steps as soon as its gradient is accumulated, and
its gradient is released at once (docs/algorithm.md#step-in-backward).

:func:`step_in_backward` registers ``Tensor.register_post_accumulate_grad_hook`` on each
parameter. The training loop stays the normal one (``loss.backward(); opt.step();
opt.zero_grad()``): during ``backward`` each hooked parameter is stepped by
:meth:`gefen_core.Gefen._step_group` with the step count ``T`` that ``opt.step()`` is about to
use, and its gradient is set to ``None``; ``opt.step()`` then steps whatever still has a
gradient (nothing, or parameters no hook covers) and advances ``T``, its hooks and any LR
scheduler's bookkeeping exactly once. The result is bit-identical to normal stepping, and the
optimizer, its codebook and its ``state_dict()`` are the normal ones, so checkpoints move freely
between the two. A bucket of the same parameters as on the previous backward repeats the
launches its last full step recorded (:class:`gefen_core._steady_step.BucketStep`, with the
eager steady step's checks) instead of planning them again.

The handle's first step, a step that learns or refreshes the codebook, and a parameter's first
step (its period search) are full steps: the hooks keep those gradients and ``opt.step()`` does
what it always does, then the handle releases them. The step that learns the codebook may
offload instead (``offload_first_step``): each hook takes its parameter's period and histogram,
moves the gradient to host memory and releases it; before ``opt.step()`` the handle learns the
codebook from all the histograms and steps those parameters one gradient at a time. On every
other step the smallest hooked parameter of each param group keeps its gradient for
``opt.step()`` as well, so that gradient processing between ``backward`` and ``opt.step()``
that starts on a later step (global-norm clipping, which would find no other gradient)
changes a gradient the handle watches.
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from gefen_kernels.ops import histogram_sum

from . import _compiled_step, _steady_step
from . import dispatch as _dispatch
from . import nonfinite as _nonfinite
from .codebook import optimal_codebook
from .optimizer import Gefen

__all__ = ["BackwardStep", "step_in_backward"]

# The optimizer each live handle steps (one handle per optimizer: two would step twice).
_HANDLES: weakref.WeakKeyDictionary[Gefen, BackwardStep] = weakref.WeakKeyDictionary()
_GROUP_SKIP = ("params", "param_names", "param_names_synthesized")


def step_in_backward(model_or_params: nn.Module | Iterable[Tensor], optimizer: Any, *,
                     max_grad_norm_per_param: float | None = None,
                     offload_first_step: bool | None = None,
                     bucket_cap_mb: float = 25.0) -> BackwardStep:
    r"""Step ``optimizer`` during ``backward``, one parameter at a time, releasing each gradient
    as soon as its parameter is updated (docs/algorithm.md#step-in-backward).

    Keep the normal loop: ``loss.backward(); optimizer.step(); optimizer.zero_grad();
    scheduler.step()``. ``backward`` updates each hooked parameter and frees its gradient;
    ``optimizer.step()`` steps whatever has a gradient left and advances the step count
    ``T`` (which seeds stochastic rounding), the hooks and the scheduler's bookkeeping once.
    Losses, parameters and ``state_dict()`` are bit-identical to normal stepping, and a
    checkpoint of either mode resumes in the other. Peak memory drops by up to the gradients'
    bytes (2 bytes per parameter in bf16): each gradient lives from its accumulation to its
    parameter's update. The handle's first step, steps that learn or refresh the codebook and
    each parameter's first step are full steps (gradients kept until ``optimizer.step()``),
    except the codebook-learning step under ``offload_first_step``.
    On the other steps every hooked gradient is ``None`` after ``backward`` but that of the
    smallest hooked parameter (fewest elements) of each param group, kept until
    ``optimizer.step()`` steps it: the handle watches it for gradient processing between the
    two.

    Args:
        model_or_params (nn.Module or iterable of Tensor): a module, whose parameters that
            ``optimizer`` holds get a hook (others, e.g. frozen ones, are left alone), or the
            parameters themselves, each of which ``optimizer`` must hold. A module also gets a
            forward pre-hook that refuses a second forward before ``optimizer.step()`` and fp16
            autocast.
        optimizer (Gefen or GefenMuonHybrid): a :class:`~gefen_core.Gefen`, or a
            :class:`~gefen_core.GefenMuonHybrid` whose Gefen backup steps in backward (its Muon
            half keeps its gradients and steps in ``optimizer.step()``: Newton–Schulz needs the
            whole matrix gradient and the hybrid's checks see all of them).
        max_grad_norm_per_param (float, optional): clip each gradient to this 2-norm on its
            own (``torch.nn.utils.clip_grad_norm_(p, max_norm, foreach=False)`` per parameter,
            no host sync) before its step; the in-backward replacement of global-norm
            clipping, which needs every gradient before the first update. ``None``: no
            clipping (default: None).
        offload_first_step (bool, optional): on the step that learns the codebook, move
            each hooked gradient to host memory (pinned, for CUDA gradients) as soon as its
            hook has taken its period and histogram, then learn the codebook in
            ``optimizer.step()`` and step the parameters one at a time, each gradient copied
            back and released after its update. The device then holds one such gradient at a
            time, not every gradient of the model, through the first step; it costs
            2 bytes of host memory per bf16 parameter for that step and three host syncs per
            parameter in its backward. The bits are those of the full step.
            ``None``: on when the hooked parameters are on a CUDA device (default: None).
        bucket_cap_mb (float): gradients of one param group are stepped together once their
            bytes reach this many MiB (and the rest at the end of the backward): one grouped
            launch for many small tensors instead of one step per tensor, whose host cost
            (planning and kernel launches) would otherwise be paid per parameter. At most this
            many MiB plus one gradient wait to be stepped at any time. ``0``: each parameter
            steps in its own hook (default: 25, as ``DistributedDataParallel``'s buckets).

    Returns:
        BackwardStep: the handle; ``remove()`` (or leaving its ``with`` block) takes every hook
        off, ``no_step()`` marks micro-batches whose gradients are accumulated for a later step.

    Raises:
        TypeError: ``optimizer`` is not Gefen or a hybrid with a Gefen backup (GefenMuon alone,
            an AdamW backup, another optimizer); a parameter that is not a tensor; an
            ``offload_first_step`` that is not ``True``, ``False`` or ``None``; a
            ``bucket_cap_mb`` that is not a number.
        ValueError, before any hook is registered, for what cannot step in backward:
            ``skip_nonfinite`` (needs every gradient before the first update); ``capturable``
            groups (nothing is left for a captured ``step()``); fp16 parameters (GradScaler
            must be able to skip a step after the backward, when some parameters have already
            stepped: use bf16); DTensor parameters and sharding optimizers (ShardedGefen: its
            statistics are reduced over the ranks at ``step()``); a DistributedDataParallel
            model or a process group of several ranks (gradients are reduced after the hook
            runs); a parameter the optimizer does not hold, listed twice or not requiring a
            gradient; an optimizer that already has a handle; a ``max_grad_norm_per_param``
            that is not a finite number > 0; a ``bucket_cap_mb`` that is not finite and >= 0.
        RuntimeError, while training, at the first offending step and before any parameter is
            updated in it: gradients changed between ``backward`` and ``optimizer.step()``
            (global-norm clipping such as ``clip_grad_norm_``, ``GradScaler.unscale_``), seen
            on the handle's first step, which keeps them; a second backward (or, with a
            module, a second forward) before ``optimizer.step()`` outside ``no_step()``
            (gradient accumulation); a hyperparameter changed between ``backward`` and
            ``optimizer.step()``; a ``closure``; fp16 autocast; compiled autograd, by any
            route (``torch._dynamo.config.compiled_autograd`` or
            ``torch._dynamo.compiled_autograd._enable``), at the first hook. Two cases are
            seen only after updates: gradient clipping that starts on a later step raises at
            that step's ``optimizer.step()``, after the other parameters stepped on their
            unclipped gradients in its backward (resume from a checkpoint; it is seen when the
            clipped parameters include a kept one, as ``model.parameters()`` does, and until
            then ``clip_grad_norm_`` returns the norm of the kept gradients only); a tied
            parameter whose gradient is accumulated twice in one backward (reentrant
            activation checkpointing around both uses) raises at its second accumulation.
    """
    return BackwardStep(model_or_params, optimizer,
                        max_grad_norm_per_param=max_grad_norm_per_param,
                        offload_first_step=offload_first_step, bucket_cap_mb=bucket_cap_mb)


class BackwardStep:
    """The hooks of :func:`step_in_backward`; see there. A context manager that removes them."""

    def __init__(self, model_or_params: nn.Module | Iterable[Tensor], optimizer: Any, *,
                 max_grad_norm_per_param: float | None = None,
                 offload_first_step: bool | None = None, bucket_cap_mb: float = 25.0) -> None:
        target = _gefen_of(optimizer)
        _refuse_options(target)
        norm = max_grad_norm_per_param
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float))
                                 or not math.isfinite(norm) or norm <= 0):
            raise ValueError("step_in_backward: max_grad_norm_per_param must be a finite number "
                             f"> 0 or None, got {norm!r}")
        if offload_first_step is not None and not isinstance(offload_first_step, bool):
            raise TypeError("step_in_backward: offload_first_step must be True, False or None, "
                            f"got {offload_first_step!r}")
        cap = bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)):
            raise TypeError(f"step_in_backward: bucket_cap_mb must be a number, got {cap!r}")
        if not math.isfinite(cap) or cap < 0:
            raise ValueError("step_in_backward: bucket_cap_mb must be finite and >= 0 (0 steps "
                             f"each parameter in its own hook), got {cap!r}")
        module = model_or_params if isinstance(model_or_params, nn.Module) else None
        params = _hooked_params(model_or_params, target)
        if target in _HANDLES:
            raise ValueError("step_in_backward: this optimizer already steps in backward; "
                             "remove() its handle first (two handles would step it twice)")
        self.optimizer = optimizer
        self._target = target
        self._max_norm = None if norm is None else float(norm)
        self._params = params
        self._offload = (any(p.is_cuda for p in params) if offload_first_step is None
                         else offload_first_step)
        self._learning = False  # this backward's step learns the codebook from offloads
        self._offloaded = _Offloaded()
        self._no_step_depth = 0
        self._first = True  # the handle's first step is a full step
        self._open = False  # a backward has run since the last optimizer.step()
        self._deferred = True
        self._seen: set[int] = set()
        self._entries: dict[int, tuple[dict[str, Any], Tensor, str]] = {}
        self._kept: dict[int, tuple[Tensor, Tensor, int, Tensor]] = {}
        self._bucket_cap = int(cap * 2**20)
        # Gradients waiting to step together: one param group's, in hook order.
        self._bucket: list[tuple[Tensor, Tensor, str]] = []
        self._bucket_group: dict[str, Any] | None = None
        self._bucket_bytes = 0
        self._flush_queued = False
        # Per bucket (its parameters' ids in hook order): the launches of its last full step,
        # repeated while nothing they depend on changes (_steady_step.BucketStep).
        self._records: dict[tuple[int, ...], _steady_step.BucketStep] = {}
        self._checked = False  # this step's gradients were compared at a step pre-hook
        # The smallest hooked parameter of each param group keeps its gradient until
        # optimizer.step() on every step: gradient processing between backward and step
        # (clip_grad_norm_ over the model, which would find no other gradient) changes it.
        self._watched = _watched(params, target.param_groups)
        self._snapshot: list[tuple[Any, ...]] = []
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._handles.append(target.register_step_pre_hook(self._before_step))
        self._handles.append(target.register_step_post_hook(self._after_step))
        if optimizer is not target:
            self._handles.append(optimizer.register_step_pre_hook(self._before_step))
        if module is not None:
            self._handles.append(module.register_forward_pre_hook(self._before_forward))
        _HANDLES[target] = self

    # ------------------------------------------------------------------ public
    @property
    def params(self) -> list[Tensor]:
        """The parameters that step in backward, in hook-registration order."""
        return list(self._params)

    def remove(self) -> None:
        """Take every hook off; ``optimizer`` then steps normally. A backward already taken is
        completed by the next ``optimizer.step()`` as usual."""
        for h in self._handles:
            h.remove()
        self._handles = []
        # optimizer.step() without the hooks needs the offloaded gradients back, and steps the
        # gradients still waiting in a bucket (they are on their parameters).
        self._offloaded.restore()
        self._bucket, self._bucket_group, self._bucket_bytes = [], None, 0
        self._records.clear()
        if _HANDLES.get(self._target) is self:
            del _HANDLES[self._target]

    @contextlib.contextmanager
    def no_step(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without stepping: wrap every
        micro-batch's ``backward`` but the last; the last one, outside, steps each parameter on
        the accumulated gradient (docs/algorithm.md#step-in-backward)."""
        self._no_step_depth += 1
        try:
            yield
        finally:
            self._no_step_depth -= 1

    def __enter__(self) -> BackwardStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ------------------------------------------------------------------ hooks
    def _open_step(self) -> None:
        """The first gradient of a backward: what every parameter of this step shares."""
        opt = self._target
        _compiled_step.sync_global_step(opt)
        self._entries = {id(p): (group, p, name) for group, p, name in opt._named_params()}
        every = opt._codebook_refresh_every
        refresh = every > 0 and opt._global_step > 0 and opt._global_step % every == 0
        self._deferred = self._first or opt._codebook is None or refresh
        self._learning = self._offload and opt._codebook is None
        self._snapshot = _hyperparameters(opt.param_groups)
        self._checked = False
        self._open = True

    def _on_grad(self, p: Tensor) -> None:
        if _compiled_autograd():
            raise RuntimeError(
                "step_in_backward: the gradient hooks are being traced (compiled autograd); "
                "the in-backward step runs eagerly only: disable compiled autograd (the "
                "torch._dynamo.config.compiled_autograd flag or a compiled_autograd._enable "
                "context around backward) or remove() the handle; nothing was stepped")
        if self._no_step_depth or p.grad is None:
            return
        if not self._open:
            self._open_step()
        key = id(p)
        if key in self._seen:
            raise RuntimeError(
                f"step_in_backward: parameter {self._name(p)!r} received a second gradient "
                "before optimizer.step(). Either a second backward ran without a step "
                "(gradient accumulation: wrap each micro-batch's backward but the last in "
                "`with handle.no_step():`), or a tied parameter's gradient was accumulated "
                "twice in one backward (reentrant activation checkpointing around both uses; "
                "use use_reentrant=False)")
        self._seen.add(key)
        if self._max_norm is not None:
            torch.nn.utils.clip_grad_norm_(p, self._max_norm, foreach=False)
        g = p.grad
        entry = self._entries.get(key)
        if (self._learning and entry is not None and key not in self._watched
                and self._offload_gradient(p, g, entry)):
            return
        if (self._deferred or entry is None or key in self._watched
                or "period" not in self._target.state.get(p, {})):
            # Kept for optimizer.step(), with what shows a change before it: the version
            # counter (in-place ops such as clip_grad_norm_'s, which multiplies every gradient
            # it finds, by 1 when the norm is below max_norm) and, on full steps, the norm
            # (GradScaler's unscale_ writes without bumping the version). Norms on the device.
            norm = (torch.linalg.vector_norm(g.detach(), dtype=torch.float32)
                    if self._deferred else g)  # not compared outside full steps
            self._kept[key] = (p, g, g._version, norm)
            return
        _check_grad(p, g, entry[2])
        group, _, name = entry
        if self._bucket_group is not group:
            self._flush()
            self._bucket_group = group
        self._bucket.append((p, g, name))
        self._bucket_bytes += g.numel() * g.element_size()
        if self._bucket_bytes >= self._bucket_cap:
            self._flush()
        elif not self._flush_queued:
            # The rest steps when this backward ends: the engine runs its final callbacks
            # after every gradient is accumulated, on streams synced with the gradients'.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._flush_queued = True

    def _end_backward(self) -> None:
        self._flush_queued = False
        self._flush()

    def _flush(self) -> None:
        """Step the waiting gradients (one param group's) and release them."""
        entries, group = self._bucket, self._bucket_group
        if not entries or group is None:
            return
        self._bucket, self._bucket_bytes = [], 0
        opt = self._target
        key = tuple(id(p) for p, _, _ in entries)
        record = self._records.get(key)
        with torch.no_grad():
            if record is None or not record.run(opt, group, entries):
                by_path = opt._init_group(group, entries, {})
                opt._step_group(group, by_path)
                record = _steady_step.build_bucket(opt, group, by_path, entries)
                if record is None:
                    self._records.pop(key, None)
                else:
                    if len(self._records) >= 2 * len(self._params):
                        self._records.clear()  # buckets that changed from one backward to the next
                    self._records[key] = record
        for p, _, _ in entries:
            p.grad = None

    def _offload_gradient(self, p: Tensor, g: Tensor, entry: tuple[dict[str, Any], Tensor, str]
                          ) -> bool:
        """On the step that learns the codebook: take ``p``'s period and histogram from ``g``,
        move ``g`` to host memory and release it; ``False`` (``g`` is kept for
        ``optimizer.step()``) for a gradient the full step would refuse or skip, after which the
        whole step is handed back to ``optimizer.step()``."""
        opt = self._target
        group, _, name = entry
        if not _fits(p, g) or _dispatch.local_numel(p) == 0 \
                or not _nonfinite.all_finite([g]):
            # optimizer.step() raises, or warns and skips, as it would without the handle.
            self._learning = False
            return False
        stored = opt.state[p].get("period") if p in opt.state else None
        period = int(stored) if stored is not None else opt._select_periods(
            [(p, g, name, group)])[0]
        counts = histogram_sum([g], [period], reference=[_reference_path(opt, p, group)])
        self._offloaded.add(p, g, period, counts)
        p.grad = None
        return True

    def _step_offloaded(self) -> None:
        """docs/algorithm.md#step-in-backward: the codebook from the offloaded gradients'
        histograms and those of the gradients still held, then each offloaded parameter's
        first update, one gradient on the device at a time. ``optimizer.step()`` then steps
        the held gradients with that codebook, as the full step would have."""
        off = self._offloaded
        if not off.items:
            return
        opt = self._target
        if not self._learning:
            off.restore()
            return
        rest = [e for e in opt._preflight() if _dispatch.local_numel(e[1]) > 0]
        if not opt._all_finite([g for _, _, g, _ in rest]):
            off.restore()
            return
        unknown = [(p, g, name, group) for group, p, g, name in rest
                   if "period" not in opt.state.get(p, {})]
        found = dict(zip([e[0] for e in unknown], opt._select_periods(unknown)))
        counts = off.counts
        assert counts is not None  # every offloaded gradient added its histogram
        if rest:
            counts = counts + histogram_sum(
                [g for _, _, g, _ in rest],
                [int(opt.state[p]["period"]) if p not in found else found[p]
                 for _, p, _, _ in rest],
                reference=[_reference_path(opt, p, group) for group, p, _, _ in rest])
        opt._codebook = optimal_codebook(opt._reduce_histogram(counts),
                                         device=opt._anchor_device())
        opt._codebook_cache = {}
        with torch.no_grad():
            for p, g, period in off.drain():
                group, _, name = self._entries[id(p)]
                opt._step_group(group, opt._init_group(group, [(p, g, name)], {p: period}))
                # Released before drain() uploads the next one: one gradient on the device.
                del g

    def _before_step(self, opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # torch passes step()'s positional arguments with the optimizer first.
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:
            raise RuntimeError(
                "step_in_backward: optimizer.step(closure) is not supported: the closure's "
                "backward would run inside step(); call backward, then optimizer.step()")
        for owner in {id(self.optimizer): self.optimizer, id(opt): opt}.values():
            if (getattr(owner, "grad_scale", None) is not None
                    or getattr(owner, "found_inf", None) is not None):
                raise RuntimeError(
                    "step_in_backward: a GradScaler is stepping this optimizer; a step it "
                    "skips for an overflow cannot be undone once parameters have stepped in "
                    "backward: train in bf16 without a scaler, or remove() the handle")
        if not self._open:
            return
        if not self._checked:
            # At the first pre-hook of the step: a hybrid's own, before its Muon half moves.
            self._refuse_changed_gradients()
            self._checked = True
        if opt is not self._target:
            return
        if _hyperparameters(opt.param_groups) != self._snapshot:
            raise RuntimeError(
                "step_in_backward: a hyperparameter (lr, betas, weight_decay, ...) changed "
                "between backward and optimizer.step(); parameters step in backward with the "
                "values set before it, so change them before backward (a scheduler's step() "
                "after optimizer.step() is right)")
        self._flush()  # left by a backward that stopped before its end (an error in it)
        self._step_offloaded()

    def _refuse_changed_gradients(self) -> None:
        p = self._changed_gradient()
        if p is None:
            return
        if self._deferred:
            done = "nothing was stepped"
        else:
            done = ("the other parameters already stepped in this backward on unclipped "
                    "gradients, so resume from a checkpoint")
        raise RuntimeError(
            f"step_in_backward: the gradient of {self._name(p)!r} changed between backward "
            "and optimizer.step() (global-norm clipping such as "
            "torch.nn.utils.clip_grad_norm_, GradScaler.unscale_, or other gradient "
            "processing). In-backward steps update each parameter before such processing "
            "could run: use max_grad_norm_per_param= for per-parameter clipping, train in "
            f"bf16 without a GradScaler, or step normally; {done}")

    def _changed_gradient(self) -> Tensor | None:
        """The first kept parameter whose gradient was replaced or changed since its hook, or
        ``None``: version counters first, then, on full steps, the norms (one host sync)."""
        kept = list(self._kept.values())
        for p, g, version, _ in kept:
            if p.grad is not g or g._version != version:
                return p
        if not kept or not self._deferred:
            return None
        device = kept[0][3].device
        then = torch.stack([norm.to(device) for *_, norm in kept])
        # The same tensors as at the hooks (checked above).
        now = torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32)
                           .to(device) for _, g, *_ in kept])
        same = (then == now) | (then.isnan() & now.isnan())
        if bool(same.all()):
            return None
        return kept[int((~same).nonzero()[0, 0])][0]

    def _after_step(self, opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._open:
            return
        for p, *_ in self._kept.values():
            p.grad = None
        self._kept.clear()
        self._offloaded.items.clear()  # kept only if step() raised before _step_offloaded
        self._learning = False
        self._flush_queued = False
        self._seen.clear()
        self._entries = {}
        self._open = False
        self._first = False

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        if self._open:
            raise RuntimeError(
                "step_in_backward: a forward ran after a backward and before "
                "optimizer.step(). For gradient accumulation wrap each micro-batch's backward "
                "but the last in `with handle.no_step():`; otherwise call optimizer.step() "
                "after every backward")
        device_type = self._params[0].device.type
        if (torch.is_autocast_enabled(device_type)
                and torch.get_autocast_dtype(device_type) == torch.float16):
            raise RuntimeError(
                "step_in_backward: fp16 autocast needs GradScaler, whose skipped steps cannot "
                "be undone once parameters have stepped in backward; use bfloat16 autocast")

    def _name(self, p: Tensor) -> str:
        entry = self._entries.get(id(p))
        if entry is not None:
            return entry[2]
        for _, q, name in self._target._named_params():
            if q is p:
                return name
        return "<unnamed>"


def _compiled_autograd() -> bool:
    """Whether this gradient hook runs under compiled autograd, by any route into it: traced by
    dynamo (``is_compiling``), inside a ``torch._dynamo.compiled_autograd._enable`` context (what
    the ``torch._dynamo.config.compiled_autograd`` flag enters too), or called from a compiled
    autograd graph running eagerly after a graph break (``in_compiled_autograd_region``, which
    that graph's runtime sets while it disables the ``_enable`` flag)."""
    if torch.compiler.is_compiling():
        return True
    ca = sys.modules.get("torch._dynamo.compiled_autograd")  # not imported: not in use
    return ca is not None and bool(getattr(ca, "compiled_autograd_enabled", False)
                                   or getattr(ca, "in_compiled_autograd_region", False))


def _watched(params: list[Tensor], groups: list[dict[str, Any]]) -> set[int]:
    """``id`` of the smallest hooked parameter (fewest elements, the first of equals) of each
    param group that has one."""
    hooked = {id(p) for p in params}
    chosen: set[int] = set()
    for group in groups:
        mine = [p for p in group["params"] if id(p) in hooked]
        if mine:
            chosen.add(id(min(mine, key=lambda p: p.numel())))
    return chosen


def _gefen_of(optimizer: Any) -> Gefen:
    """The Gefen that steps in backward: ``optimizer`` itself or a hybrid's Gefen backup."""
    from .hybrid import GefenMuonHybrid
    from .muon import GefenMuon

    if isinstance(optimizer, GefenMuonHybrid):
        backup = optimizer.backup
        if not isinstance(backup, Gefen) or isinstance(backup, GefenMuon):
            raise TypeError(
                "step_in_backward: this GefenMuonHybrid has no Gefen backup (backup_optimizer="
                f"{type(backup).__name__ if backup is not None else None}); only a Gefen "
                "backup steps in backward: build it with backup_optimizer='gefen'")
        return backup
    if isinstance(optimizer, GefenMuon):
        raise TypeError(
            "step_in_backward: GefenMuon cannot step in backward (only Gefen and a "
            "GefenMuonHybrid's Gefen backup do); use GefenMuonHybrid, whose backup does")
    if not isinstance(optimizer, Gefen):
        raise TypeError(
            "step_in_backward: optimizer must be a gefen_core.Gefen or a GefenMuonHybrid, got "
            f"{type(optimizer).__name__}")
    return optimizer


def _refuse_options(opt: Gefen) -> None:
    where = "step_in_backward"
    if opt._reduces_factored_stats or type(opt)._sharded_alternative is None:
        raise ValueError(
            f"{where}: {type(opt).__name__} reduces statistics over ranks inside step(); only "
            "replicated single-process Gefen steps in backward")
    if opt._skip_nonfinite:
        raise ValueError(
            f"{where}: skip_nonfinite=True needs every gradient before the first update (a "
            "skipped step would have to undo the parameters already stepped); build the "
            "optimizer with skip_nonfinite=False")
    for i, group in enumerate(opt.param_groups):
        if group["capturable"]:
            raise ValueError(
                f"{where}: param group {i} is capturable; with the step in backward nothing "
                "is left for a captured optimizer.step(): build the optimizer with "
                "capturable=False")
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        raise ValueError(
            f"{where}: a process group of {torch.distributed.get_world_size()} ranks is "
            "initialised; data parallelism reduces gradients after the gradient hook runs, so "
            "each rank would step on its local gradient. Step normally under DDP/FSDP")


def _hooked_params(model_or_params: nn.Module | Iterable[Tensor], opt: Gefen) -> list[Tensor]:
    held = {id(p): name for _, p, name in opt._named_params()}
    if isinstance(model_or_params, nn.Module):
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model_or_params, DistributedDataParallel):
            raise ValueError(
                "step_in_backward: a DistributedDataParallel model reduces gradients after the "
                "gradient hook runs, so each rank would step on its local gradient; step "
                "normally under DDP")
        params: list[Tensor] = [p for p in model_or_params.parameters() if id(p) in held]
        if not params:
            raise ValueError("step_in_backward: the optimizer holds none of the module's "
                             "parameters; pass the module the optimizer was built from")
    else:
        if isinstance(model_or_params, Tensor):
            model_or_params = [model_or_params]
        params = [p for p in model_or_params]
        seen: set[int] = set()
        for i, p in enumerate(params):
            if not isinstance(p, Tensor):
                raise TypeError(f"step_in_backward: parameter {i} is a {type(p).__name__}, "
                                "not a tensor")
            if id(p) not in held:
                raise ValueError(f"step_in_backward: parameter {i} (shape {tuple(p.shape)}) "
                                 "is not in the optimizer; pass the parameters it was built "
                                 "with")
            if id(p) in seen:
                raise ValueError(f"step_in_backward: parameter {held[id(p)]!r} is listed "
                                 "twice")
            if not p.requires_grad:
                raise ValueError(f"step_in_backward: parameter {held[id(p)]!r} does not "
                                 "require a gradient")
            seen.add(id(p))
    for p in params:
        name = held[id(p)]
        if _dispatch.is_dtensor(p):
            raise ValueError(
                f"step_in_backward: parameter {name!r} is a DTensor; its gradient is reduced "
                "or redistributed after the hook runs. Step normally (ShardedGefen)")
        if p.dtype == torch.float16:
            raise ValueError(
                f"step_in_backward: parameter {name!r} is fp16, which needs GradScaler, and a "
                "step the scaler skips cannot be undone once parameters have stepped in "
                "backward; use bf16 or fp32 parameters")
    return params


class _Offloaded:
    """Gradients of the codebook-learning step moved off the device, in hook order, with their
    periods and the sum of their histograms (int64 ``[4097]``, CPU)."""

    def __init__(self) -> None:
        self.items: list[tuple[Tensor, Tensor, int, Any]] = []
        self.counts: Tensor | None = None

    def add(self, p: Tensor, g: Tensor, period: int, counts: Tensor) -> None:
        event = None
        if g.is_cuda:
            host = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
            host.copy_(g, non_blocking=True)
            # The copy reads g after the hook returns and frees it: keep its memory from reuse
            # on another stream until then, and let the upload wait for the copy.
            stream = torch.cuda.current_stream(g.device)
            g.record_stream(stream)
            event = stream.record_event()
        else:
            host = g  # already in host memory: released from the parameter, not copied
        self.items.append((p, host, period, event))
        self.counts = counts if self.counts is None else self.counts + counts

    def _upload(self, p: Tensor, host: Tensor, event: Any) -> Tensor:
        if event is None:
            return host
        torch.cuda.current_stream(p.device).wait_event(event)
        return host.to(p.device, non_blocking=True)

    def drain(self) -> Iterator[tuple[Tensor, Tensor, int]]:
        """Each offloaded ``(param, gradient on its device, period)``, released as it goes."""
        items, self.items, self.counts = self.items, [], None
        for p, host, period, event in items:
            yield p, self._upload(p, host, event), period

    def restore(self) -> None:
        """Put every offloaded gradient back on its parameter."""
        for p, g, _ in self.drain():
            p.grad = g


def _reference_path(opt: Gefen, p: Tensor, group: dict[str, Any]) -> bool:
    """Whether the full step bins ``p``'s gradient on the PyTorch path (as :meth:`Gefen._learn`)."""
    return _dispatch.choose_path(p, group, deterministic=opt._deterministic,
                                 sharded_factored=opt._reduces_factored_stats) != "fused"


def _fits(p: Tensor, g: Tensor) -> bool:
    """Whether :func:`_check_grad` passes."""
    return (g.layout is torch.strided and g.shape == p.shape and g.device == p.device
            and g.is_floating_point() and not g.is_complex())


def _check_grad(p: Tensor, g: Tensor, name: str) -> None:
    """The gradient checks of the full step (docs/algorithm.md#step C) for one parameter."""
    if g.layout is not torch.strided:
        raise RuntimeError(f"Gefen does not support sparse gradients, please consider "
                           f"SparseAdam instead (parameter {name!r} has a {g.layout} "
                           "gradient; densify it)")
    if g.shape != p.shape or g.device != p.device or not g.is_floating_point() \
            or g.is_complex():
        raise RuntimeError(
            f"Gefen: gradient of {name!r} ({g.dtype}, shape {tuple(g.shape)}, on {g.device}) "
            f"does not fit the parameter ({p.dtype}, {tuple(p.shape)}, {p.device})")


def _freeze(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ("tensor", id(value), value._version)
    if isinstance(value, (tuple, list)):
        return tuple(_freeze(v) for v in value)
    return value


def _hyperparameters(groups: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Every group's options (tensors by identity and version), to compare across a step."""
    return [tuple((k, _freeze(v)) for k, v in g.items() if k not in _GROUP_SKIP)
            for g in groups]
