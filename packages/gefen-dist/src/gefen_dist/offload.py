"""Optimizer-state offload for plain Gefen on replicated CUDA parameters
(docs/algorithm.md#distributed).

* :func:`move_state_` — move every per-parameter state tensor to its parameter's device (or
  one explicit device), all or nothing.
* :func:`offload_state_` — keep the per-parameter state in (page-locked) host memory between
  steps. Each ``step()`` works as usual: gefen-core brings state that is not on the gradient's
  device to it (docs/algorithm.md#step); a step post-hook copies the updated state back into the
  same host buffers and releases the device copies. The codebook stays on the GPU. Between steps the
  device holds none of the ~1 byte/param state, which is what forward and backward gain.
* :func:`restore_state_` — turn it off and bring the state back to the parameters' devices.

Every change is staged (all copies made and checked) before anything is swapped, so a failure
leaves the optimizer as it was. If copying the state back after a step fails, the device copy
stays authoritative but the optimizer is *poisoned*: ``step()`` and ``state_dict()`` raise
until a checkpoint is loaded, because the offload contract (state on the host between steps)
no longer holds.

Fails closed (``ValueError``, nothing changed) for DTensor / FSDP-sharded parameters (FSDP2's
``CPUOffloadPolicy`` owns placement there, docs/algorithm.md#distributed), ``capturable=True``
(graph-captured steps cannot allocate or copy), parameters not on CUDA, state keys gefen-core does
not define, and state tensors that are non-contiguous or share storage. Calling ``step()`` while
``torch.compile`` traces it raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gefen_core import Gefen

__all__ = ["move_state_", "offload_state_", "restore_state_", "state_offload_active"]

_TENSOR_KEYS = ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_row",
                "exp_avg_sq_col")
_ALLOWED_KEYS = frozenset(_TENSOR_KEYS + ("period", "step", "exp_avg_sq_step"))


def _copy_to(t: Tensor, device: torch.device, pin: bool) -> Tensor:
    """One staged copy (tests replace this to inject failures)."""
    if device.type == "cpu":
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        out.copy_(t)
        return out
    return t.to(device, copy=True)


@dataclass
class _Offload:
    pin: bool
    buffers: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    poisoned: str | None = None
    handles: list[Any] = field(default_factory=list)


def _controller(opt: torch.optim.Optimizer) -> _Offload | None:
    return getattr(opt, "_gefen_offload", None)


def state_offload_active(optimizer: Gefen) -> bool:
    """Whether :func:`offload_state_` is in effect for ``optimizer`` (default ``False``)."""
    return _controller(optimizer) is not None


def _check_optimizer(opt: Any, *, need_cuda: bool) -> None:
    from torch.distributed.tensor import DTensor

    if not isinstance(opt, Gefen):
        raise TypeError(f"expected a gefen_core.Gefen, got {type(opt).__qualname__}")
    for gi, g in enumerate(opt.param_groups):
        if g["capturable"]:
            raise ValueError(
                f"param group {gi} has capturable=True: a captured step cannot copy state "
                "between host and device; use capturable=False with state offload")
        for p, name in zip(g["params"], g["param_names"]):
            if isinstance(p, DTensor):
                raise ValueError(
                    f"parameter {name!r} is a DTensor: sharded state is placed by the framework "
                    "(FSDP2 CPUOffloadPolicy), not by offload_state_")
            if need_cuda and p.device.type != "cuda":
                raise ValueError(
                    f"parameter {name!r} is on {p.device}; state offload keeps the state of "
                    "CUDA parameters on the host (CPU parameters already have it there)")
    seen: dict[int, str] = {}
    for g in opt.param_groups:
        for p, name in zip(g["params"], g["param_names"]):
            st = opt.state.get(p, {})
            unknown = set(st) - _ALLOWED_KEYS
            if unknown:
                raise ValueError(f"parameter {name!r} has state keys gefen-core does not define "
                                 f"({sorted(map(str, unknown))}); offload refuses to guess")
            for key in _TENSOR_KEYS:
                t = st.get(key)
                if t is None:
                    continue
                if not isinstance(t, Tensor) or not t.is_contiguous():
                    raise ValueError(f"state[{name!r}][{key!r}] must be a contiguous tensor")
                if t.numel() and t.untyped_storage().nbytes() != t.numel() * t.element_size():
                    raise ValueError(f"state[{name!r}][{key!r}] is a view of a larger storage")
                ptr = t.data_ptr()
                if t.numel() and ptr in seen:
                    raise ValueError(f"state[{name!r}][{key!r}] shares storage with "
                                     f"{seen[ptr]}")
                seen[ptr] = f"state[{name!r}][{key!r}]"


def _stage(opt: Gefen, target: Callable[[Tensor], torch.device], pin: bool
           ) -> dict[Tensor, dict[str, Tensor]]:
    """Copy every state tensor that is not on its target device; mutate nothing."""
    staged: dict[Tensor, dict[str, Tensor]] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            dev = target(p)
            moved = {}
            for key in _TENSOR_KEYS:
                t = st.get(key)
                if t is not None and t.device != dev:
                    moved[key] = _copy_to(t, dev, pin)
            if moved:
                staged[p] = moved
    return staged


def _swap(opt: Gefen, staged: dict[Tensor, dict[str, Tensor]]) -> None:
    # Plain dict assignments: cannot fail half-way.
    for p, moved in staged.items():
        opt.state[p].update(moved)


def move_state_(optimizer: Gefen, device: torch.device | str | None = None) -> None:
    """Move all per-parameter state to the parameters' devices (or ``device``), atomically.

    Args:
        optimizer: a :class:`gefen_core.Gefen` (not DTensor-sharded, not capturable).
        device: one device for all state, or ``None`` for each parameter's own device.

    Raises:
        TypeError: not a Gefen optimizer.
        ValueError: the fail-closed cases of the module docstring, or state offload active
            (call :func:`restore_state_` first). Nothing is changed.
        RuntimeError: a copy failed (out of memory); nothing is changed.
    """
    _check_optimizer(optimizer, need_cuda=False)
    if state_offload_active(optimizer):
        raise ValueError("state offload is active; call restore_state_ before move_state_")
    dev = None if device is None else torch.device(device)
    staged = _stage(optimizer, (lambda p: p.device) if dev is None else (lambda p: dev),
                    pin=False)
    _swap(optimizer, staged)


def offload_state_(optimizer: Gefen, *, pin_memory: bool = True) -> None:
    """Keep ``optimizer``'s per-parameter state on the host between steps
    (docs/algorithm.md#distributed).

    Args:
        optimizer: plain :class:`gefen_core.Gefen` whose parameters are ordinary CUDA tensors.
        pin_memory: page-locked host buffers (faster copies; page-locked memory is not
            returned to the OS while the buffers live).

    Raises:
        TypeError, ValueError: the fail-closed cases of the module docstring, or offload
            already active. Nothing is changed.
        RuntimeError: a copy failed; nothing is changed.
    """
    _check_optimizer(optimizer, need_cuda=True)
    if state_offload_active(optimizer):
        raise ValueError("state offload is already active")
    ctl = _Offload(pin=pin_memory)
    cpu = torch.device("cpu")
    staged = _stage(optimizer, lambda p: cpu, pin_memory)
    # A checkpoint loaded with map_location="cpu" leaves the codebook on the host: bring it to
    # the anchor device in the same atomic update (the step expects it there).
    codebook = optimizer._codebook
    new_codebook = None
    if codebook is not None:
        anchor = optimizer.param_groups[0]["params"][0].device
        if codebook.device != anchor:
            new_codebook = codebook.to(anchor, copy=True)
    _swap(optimizer, staged)
    if new_codebook is not None:
        optimizer._codebook = new_codebook
        optimizer._codebook_cache = {}
    for p, moved in staged.items():
        ctl.buffers[id(p)] = dict(moved)
    ctl.handles = [
        optimizer.register_step_pre_hook(_pre_step),
        optimizer.register_step_post_hook(_post_step),
        optimizer.register_state_dict_pre_hook(_pre_state_dict),
        optimizer.register_load_state_dict_post_hook(_post_load),
    ]
    optimizer._gefen_offload = ctl  # type: ignore[attr-defined]


def restore_state_(optimizer: Gefen) -> None:
    """Stop offloading and move the state back to the parameters' devices, atomically.

    Raises:
        ValueError: offload is not active, or the optimizer is poisoned (load a checkpoint).
        RuntimeError: a copy failed; offload stays active and nothing is changed.
    """
    ctl = _controller(optimizer)
    if ctl is None:
        raise ValueError("state offload is not active")
    if ctl.poisoned:
        raise ValueError(f"the optimizer is poisoned ({ctl.poisoned}); load a checkpoint first")
    staged = _stage(optimizer, lambda p: p.device, pin=False)
    _swap(optimizer, staged)
    for h in ctl.handles:
        h.remove()
    del optimizer._gefen_offload  # type: ignore[attr-defined]


def _pre_step(opt: Gefen, args: Any, kwargs: Any) -> None:
    ctl = _controller(opt)
    if ctl is None:
        return
    if ctl.poisoned:
        raise RuntimeError(f"Gefen state offload: the optimizer is poisoned ({ctl.poisoned}); "
                           "load a known-good checkpoint before stepping")
    if torch.compiler.is_compiling():
        raise RuntimeError("Gefen state offload cannot run inside torch.compile; compile the "
                           "model, not optimizer.step, or call restore_state_ first")


def _post_step(opt: Gefen, args: Any, kwargs: Any) -> None:
    ctl = _controller(opt)
    if ctl is None:
        return
    try:
        copies: list[tuple[Tensor, str, Tensor]] = []
        for g in opt.param_groups:
            for p in g["params"]:
                st = opt.state.get(p)
                if not st:
                    continue
                bufs = ctl.buffers.setdefault(id(p), {})
                for key in _TENSOR_KEYS:
                    t = st.get(key)
                    if t is None or t.device.type == "cpu":
                        continue
                    buf = bufs.get(key)
                    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                        buf = _copy_to(t, torch.device("cpu"), ctl.pin)
                    else:
                        buf.copy_(t)
                    copies.append((p, key, buf))
        for p, key, buf in copies:
            ctl.buffers[id(p)][key] = buf
            opt.state[p][key] = buf
    except Exception as exc:
        ctl.poisoned = f"copying the state back to the host failed: {exc}"
        raise


def _pre_state_dict(opt: torch.optim.Optimizer) -> None:
    ctl = _controller(opt)
    if ctl is not None and ctl.poisoned:
        raise RuntimeError(f"Gefen state offload: the optimizer is poisoned ({ctl.poisoned}); "
                           "its state is not exported until a checkpoint is loaded")


def _post_load(opt: torch.optim.Optimizer) -> None:
    ctl = _controller(opt)
    if ctl is None or not isinstance(opt, Gefen):
        return
    # The load put fresh state on the parameters' devices: offload it again, then clear the
    # poison (the loaded checkpoint is the known-good state).
    staged = _stage(opt, lambda p: torch.device("cpu"), ctl.pin)
    _swap(opt, staged)
    ctl.buffers = {id(p): dict(m) for p, m in staged.items()}
    ctl.poisoned = None
