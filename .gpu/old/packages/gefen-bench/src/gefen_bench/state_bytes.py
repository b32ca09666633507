"""Optimizer state size: bytes of every distinct tensor storage an optimizer holds.

Method (the same for every optimizer, so figures compare): walk ``opt.state``, the
optimizer's own attributes and any child optimizers it holds (hybrids, chained peers),
descending into dicts, lists, tuples and tensor subclasses (``__tensor_flatten__``, e.g.
torchao's quantized states); count each distinct storage once by its data pointer and
device; exclude the storages of the parameters and their gradients.  The result divided by
the number of parameter elements is *state bytes/param*.

Muon-family optimizers (``GefenMuonHybrid``; ``torch.optim.Muon`` stepped beside an AdamW)
are also counted per *half* (:func:`state_bytes_by_half`): the Muon half over the
Muon-routed parameters, the backup half over the rest, each measured on its own, beside the
whole measured once, so a report can show that the halves add up to the whole.
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


def _is_muon(opt: torch.optim.Optimizer) -> bool:
    # By class name along the MRO, so gefen_core need not be importable here.
    return any(cls.__name__ in ("Muon", "GefenMuon") for cls in type(opt).__mro__)


def optimizer_halves(
    optimizers: Sequence[torch.optim.Optimizer],
) -> dict[str, list[torch.optim.Optimizer]] | None:
    """The Muon half and the backup half of a Muon-family optimizer list, else ``None``.

    A hybrid (an optimizer with ``muon`` and ``backup`` child optimizers, as
    ``GefenMuonHybrid``) contributes its children; a ``torch.optim.Muon`` or ``GefenMuon``
    goes to the Muon half; any other optimizer in the list (the AdamW beside
    ``torch.optim.Muon``) to the backup half.

    Returns:
        ``{"muon": [...], "backup": [...]}`` (either list may be empty), or ``None`` when no
        optimizer in the list is Muon-family.
    """
    muon: list[torch.optim.Optimizer] = []
    backup: list[torch.optim.Optimizer] = []
    found = False
    for opt in optimizers:
        if hasattr(opt, "muon") and hasattr(opt, "backup"):
            found = True
            for child, half in ((opt.muon, muon), (opt.backup, backup)):
                if isinstance(child, torch.optim.Optimizer):
                    half.append(child)
        elif _is_muon(opt):
            found = True
            muon.append(opt)
        else:
            backup.append(opt)
    return {"muon": muon, "backup": backup} if found else None


def _summary(total: int, numel: int) -> dict[str, Any]:
    return {"state_bytes": total, "numel": numel,
            "bytes_per_param": total / numel if numel else 0.0}


def state_bytes_by_half(
    optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor]
) -> dict[str, Any] | None:
    """State of each half of a Muon-family optimizer list, and of the whole (bytes, B/param).

    Each half is measured on its own with :func:`state_bytes` over the half's optimizers
    (its bytes/param divides by the elements of the parameters that half trains); the whole
    is measured once over ``optimizers``. Storage shared between the halves, or held by a
    hybrid outside its children, makes ``halves_sum_bytes`` differ from the whole's
    ``state_bytes``; ``unattributed_bytes`` is that difference (whole − sum, bytes).

    Returns:
        ``None`` when :func:`optimizer_halves` finds no Muon half; else
        ``{"muon": S, "backup": S, "whole": S, "halves_sum_bytes": int,
        "unattributed_bytes": int}`` where ``S = {"state_bytes": int, "numel": int,
        "bytes_per_param": float}``.
    """
    halves = optimizer_halves(optimizers)
    if halves is None:
        return None
    out: dict[str, Any] = {}
    for label in ("muon", "backup"):
        opts = halves[label]
        total = state_bytes(opts, params) if opts else 0
        out[label] = _summary(total, optimizer_numel(opts))
    whole = _summary(state_bytes(optimizers, params),
                     optimizer_numel(optimizers) or sum(p.numel() for p in params))
    out["whole"] = whole
    out["halves_sum_bytes"] = out["muon"]["state_bytes"] + out["backup"]["state_bytes"]
    out["unattributed_bytes"] = whole["state_bytes"] - out["halves_sum_bytes"]
    return out


def state_bytes_per_param(
    optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor]
) -> dict[str, Any]:
    """``{"state_bytes": int, "numel": int, "bytes_per_param": float}`` for ``optimizers``.

    For a Muon-family list the dict also holds ``"halves"``: :func:`state_bytes_by_half`.
    """
    total = state_bytes(optimizers, params)
    numel = optimizer_numel(optimizers) or sum(p.numel() for p in params)
    out = _summary(total, numel)
    halves = state_bytes_by_half(optimizers, params)
    if halves is not None:
        out["halves"] = halves
    return out
