"""Compile, ahead of a job, the kernels a model's Gefen steps will launch.

A fresh process pays for every kernel specialisation its first steps launch (Triton compiles
them on CUDA; the native CPU step is built once per machine). :func:`warm_up` takes those
costs before training starts: it steps throwaway copies of the parameters, so the job's own
steps find the kernels in the process and in the compilers' on-disk caches (Triton's cache
directory, ``GEFEN_KERNELS_CACHE``), which later processes on the machine reuse.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .backward_step import step_in_backward
from .optimizer import Gefen

__all__ = ["warm_up"]


def warm_up(params: nn.Module | Iterable[Tensor] | Iterable[tuple[str, Tensor]], *,
            in_backward: bool = False, **options: Any) -> float:
    """Run Gefen's first step and one steady step on throwaway tensors shaped like ``params``
    (same shapes, dtypes and devices, random values), then free them: the kernels these steps
    launch are compiled and cached before a job's first step needs them.

    Launch the same work the job will: pass the options the job's :class:`Gefen` gets (the
    kernels specialise on the shapes, dtypes and options such as ``factored_v_2d``,
    ``min_dim_size_to_factor``, ``stochastic_round``, ``capturable``), and
    ``in_backward=True`` when the job steps with :func:`step_in_backward`, whose hooks launch
    per-tensor kernels from its second step on. Nothing of ``params`` (values, gradients,
    hooks) is read but shapes, dtypes and devices, and nothing is changed.

    Memory: for the duration of the call, a copy of the parameters, their gradients and Gefen's
    state (about 1 byte per parameter), as the job's own training step will need, and with
    ``in_backward`` one more parameter-sized tensor per parameter (what the backward saves);
    call it before the model's optimizer state exists, or in a process of its own to warm the
    on-disk caches.

    Args:
        params: a module, tensors, or ``(name, tensor)`` pairs (only the tensors' metadata is
            used).
        in_backward: also warm the per-tensor launches of :func:`step_in_backward`.
        **options: keyword arguments of :class:`Gefen` (``lr`` defaults to Gefen's).

    Returns:
        The call's wall time in seconds (s).

    Raises:
        ValueError: ``params`` holds no tensor; an option :class:`Gefen` refuses (its error).
    """
    start = time.perf_counter()
    tensors: list[Tensor]
    if isinstance(params, nn.Module):
        tensors = [p for p in params.parameters() if p.requires_grad]
    else:
        tensors = [item[1] if isinstance(item, tuple) else item for item in params]
    if not tensors or not all(isinstance(t, Tensor) for t in tensors):
        raise ValueError("warm_up: params must be a module with trainable parameters, or a "
                         "non-empty iterable of tensors or (name, tensor) pairs")
    with torch.no_grad():
        copies = [nn.Parameter(torch.randn(t.shape, device=t.device).to(t.dtype))
                  for t in tensors]
    opt = Gefen([(f"warm_up.{i}", c) for i, c in enumerate(copies)], **options)
    handle = step_in_backward(copies, opt) if in_backward else None
    try:
        for _ in range(2):  # the first step (codebook, periods, state), then a steady one
            if handle is None:
                for c in copies:
                    c.grad = torch.randn_like(c)
            else:
                # A backward, so that the hooks step each tensor as its gradient arrives.
                loss = sum((c * torch.randn_like(c)).sum() for c in copies)
                loss.backward()  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad(set_to_none=True)
        for device in {c.device for c in copies if c.device.type == "cuda"}:
            torch.cuda.synchronize(device)
    finally:
        if handle is not None:
            handle.remove()
    del opt, copies
    return time.perf_counter() - start
