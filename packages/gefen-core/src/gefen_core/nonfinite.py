"""The non-finite-gradient rule of every Gefen optimizer (docs/algorithm.md#non-finite-gradients).

A quantized momentum shares one scale per block and a second moment per block (or per row and
column), so a single non-finite gradient element does not stay in its own coordinate as it does
in ``torch.optim.AdamW``: it makes its block's scale non-finite (and, factored, its row's and
column's statistics), so the whole block, row or column of the parameter becomes non-finite.
``skip_nonfinite=True`` is the opt-in alternative: a step whose gradients hold any non-finite
element (on any rank, for the distributed classes) changes nothing at all, and is counted.

This module holds what every class shares: the finiteness test and the option's validation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from . import dispatch as _dispatch

__all__ = ["all_finite", "check_skip_option", "step_gradients"]


def all_finite(grads: Iterable[Tensor]) -> bool:
    """Whether every element of every tensor is finite. One host read per device.

    The max ``|g|`` of a tensor is finite exactly when every value is (a NaN propagates
    through the norm, an Inf is its own maximum), so one multi-tensor inf-norm per
    (device, dtype) replaces ``isfinite().all()`` per tensor, about five launches each (6-12
    ms of a Llama-3.2-1B-shaped first step on an H200). An empty tensor is finite.
    """
    lists: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        if g.numel():
            lists.setdefault((g.device, g.dtype), []).append(g)
    flags: dict[torch.device, list[Tensor]] = {}
    for (device, _), members in lists.items():
        norms = torch._foreach_norm(members, float("inf"))
        flags.setdefault(device, []).append(torch.isfinite(torch.stack(norms)).all())
    return all(bool(torch.stack(f).all()) for f in flags.values())


def step_gradients(params: Iterable[Tensor]) -> list[Tensor]:
    """The dense gradients a step would read (a DTensor's local shard), for :func:`all_finite`.

    Sparse or otherwise non-strided gradients are left out: the step's own checks refuse them
    with a message that names the parameter.
    """
    out = []
    for p in params:
        g = p.grad
        if g is not None and g.layout == torch.strided:
            out.append(_dispatch.local(g))
    return out


def check_skip_option(skip_nonfinite: Any, capturable: Any, where: str) -> None:
    """Validate ``skip_nonfinite``.

    Raises:
        TypeError: ``skip_nonfinite`` is not a bool.
        ValueError: ``skip_nonfinite=True`` with ``capturable=True``: the decision reads the
            gradients' finiteness on the host every step, which a captured graph cannot do.
    """
    if not isinstance(skip_nonfinite, bool):
        raise TypeError(f"{where}: skip_nonfinite must be a bool, got {skip_nonfinite!r}")
    if skip_nonfinite and capturable is True:
        raise ValueError(
            f"{where}: skip_nonfinite=True reads whether the gradients are finite on the host "
            "every step, which a captured (capturable=True) step cannot do; use "
            "capturable=False, or skip_nonfinite=False with torch.amp.GradScaler's own "
            "overflow skip"
        )
