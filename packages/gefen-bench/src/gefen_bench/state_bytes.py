"""Optimizer state size: bytes of every distinct tensor storage an optimizer holds.

Method (the same for every optimizer, so figures compare): walk ``opt.state``, the
optimizer's own attributes and any child optimizers it holds (hybrids, chained peers),
descending into dicts, lists, tuples and tensor subclasses (``__tensor_flatten__``, e.g.
torchao's quantized states); count each distinct storage once by its data pointer and
device; exclude the storages of the parameters and their gradients.  The result divided by
the number of parameter elements is *state bytes/param*.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

_MAX_DEPTH = 8


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (str(t.device), storage.data_ptr())


def _leaf_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return [t]
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    out: list[torch.Tensor] = []
    for name in names:
        out.extend(_leaf_tensors(getattr(t, name)))
    return out


def _children(opt: torch.optim.Optimizer) -> list[Any]:
    """The objects that can hold state: ``opt.state`` and the optimizer's attributes."""
    items: list[Any] = [opt.state]
    for key, value in vars(opt).items():
        if key in ("state", "param_groups", "defaults"):
            continue
        items.append(value)
    return items


def state_bytes(
    optimizers: Iterable[torch.optim.Optimizer], params: Iterable[torch.Tensor]
) -> int:
    """Total bytes (int) of distinct storages held by ``optimizers``, parameters/grads excluded."""
    excluded: set[tuple[str, int]] = set()
    for p in params:
        for t in (p, p.grad):
            if t is not None:
                key = _storage_key(t)
                if key is not None:
                    excluded.add(key)
    seen: dict[tuple[str, int], int] = {}
    visited: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if depth > _MAX_DEPTH or id(obj) in visited:
            return
        if isinstance(obj, torch.Tensor):
            for leaf in _leaf_tensors(obj):
                key = _storage_key(leaf)
                if key is not None and key not in excluded:
                    seen[key] = max(seen.get(key, 0), leaf.untyped_storage().nbytes())
            return
        visited.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer):
            for child in _children(obj):
                visit(child, depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                visit(v, depth + 1)

    for opt in optimizers:
        visit(opt, 0)
    return sum(seen.values())


def optimizer_numel(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Number of distinct parameter elements across the optimizers' param groups."""
    seen: dict[int, int] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                seen[id(p)] = p.numel()
    return sum(seen.values())


def state_bytes_per_param(
    optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor]
) -> dict[str, float | int]:
    """``{"state_bytes": int, "numel": int, "bytes_per_param": float}`` for ``optimizers``."""
    total = state_bytes(optimizers, params)
    numel = optimizer_numel(optimizers) or sum(p.numel() for p in params)
    return {
        "state_bytes": total,
        "numel": numel,
        "bytes_per_param": total / numel if numel else 0.0,
    }
