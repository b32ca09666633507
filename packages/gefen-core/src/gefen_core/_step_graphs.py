"""CUDA-graph replay of the planned fused step (the kernels issue; ALGORITHM.md §3.7, §1.16).

An eager fused step issues one to three Triton launches per tensor; from Python each launch
costs tens of microseconds of host time, so a step over ~150 tensors is host-bound long before
its kernels are. A training loop, though, steps the same tensors every step, and once the
caching allocator has settled its gradients come back at the same addresses. Then the step's
launches are captured once into a CUDA graph and replayed: one host call per step.

The per-step scalars (``[lr, bc2, bc1_recip, decay]`` of §1.10 step 2 / §1.11 step 2, rounded
to fp32 on the host exactly as for the eager launches) and the stochastic-rounding seeds are
read by the kernels from two device buffers (their ``HYPER`` / ``SEED_PTR`` variants), refreshed
by an asynchronous copy from pinned memory before every launch or replay. The kernels compute
the same bits from a scalar in memory as from the same scalar passed by value, so a replayed
step equals the eager one bit for bit.

A graph holds raw addresses, so it is replayed only when the launch plans (which check tensor
identity and the codebook's version) and the address, dtype and strides of every gradient,
parameter, state tensor and the codebook equal those at capture. Otherwise the step runs its
launches eagerly and remembers the new addresses; only a second step in a row with the same
addresses captures, on a side stream, without flushing the allocator's caches (a flush would
move the next step's gradients and defeat the replay), in thread-local capture mode (so a
pin-memory DataLoader thread allocating meanwhile is not affected), at most
``_MAX_CAPTURES`` times per step list. A loop whose gradients move every step therefore never
captures, and pays one address comparison per tensor.

Opt-in: set ``GEFEN_CUDA_GRAPHS=1``. With this side-stream capture, replayed steps were
bit-identical to eager ones on H200s for static, alternating and strided gradients and in a
training loop that frees its gradients every step (``tests/test_step_graphs_gpu.py``, in the
gefen-core GPU list of the two-GPU release gate of 2026-11-29: 29 passed, 0 skipped). That
loop checks bits, not how often it replays. It stays off by default until replay rates and
step times are measured in real loops with ``zero_grad(set_to_none=True)``, where the
allocator decides whether addresses repeat.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["enabled", "launch"]

_ENV = "GEFEN_CUDA_GRAPHS"
_MAX_CAPTURES = 4  # per step list: addresses that keep settling and moving stop being chased

# One entry per step list, keyed (weakly) on its first codes tensor: a list whose state is
# dropped (optimizer deleted, checkpoint reloaded) takes its graph with it.
_ENTRIES: Any = WeakIdKeyDictionary()


def enabled() -> bool:
    """Whether eager fused steps may be graph-replayed (``GEFEN_CUDA_GRAPHS=1``; off by
    default)."""
    return os.environ.get(_ENV, "0") == "1"


class _Entry:
    """The device scalar buffers of one step list, and its graph once captured."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.hyper = torch.zeros(n, 4, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(n, dtype=torch.int64, device=device)
        self.hyper_rows = [self.hyper[i] for i in range(n)]
        self.seed_rows = [self.seeds[i:i + 1] for i in range(n)]
        self.key: tuple[Any, ...] | None = None  # addresses of the last step
        self.plans: list[Any] = []  # keeps the captured plans (and their ids) alive
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0
        self.failed = False


def _address_key(plans: Sequence[Any], grads: Sequence[Tensor],
                 tensors: Sequence[Tensor | None]) -> tuple[Any, ...]:
    return (tuple(map(id, plans)),
            tuple((g.data_ptr(), g.dtype, g.stride()) for g in grads),
            tuple(0 if t is None else t.data_ptr() for t in tensors))


def _launch_all(plans: Sequence[Any], grads: Sequence[Tensor], entry: _Entry) -> None:
    for plan, grad, hyper, seed in zip(plans, grads, entry.hyper_rows, entry.seed_rows):
        plan.launch(grad if grad.is_contiguous() else grad.contiguous(), lr=0.0, bc1_recip=0.0,
                    bc2=0.0, decay=1.0, seed=0, hyper=hyper, seed_tensor=seed)


def launch(plans: Sequence[Any], grads: Sequence[Tensor], tensors: Sequence[Tensor | None],
           rows: Sequence[tuple[float, float, float, float]], seeds: Sequence[int] | None, *,
           anchor: Tensor) -> None:
    """One step of ``plans`` (capturable :class:`gefen_kernels.ops.step_plan.StepPlan`, all on
    one CUDA device) with gradients ``grads``: replayed from a graph when the addresses match
    the previous step's, else launched eagerly (and captured on the second match in a row).

    Args:
        plans: one capturable plan per tensor (``HYPER``/``SEED_PTR`` kernels).
        grads: the gradients, any strides (a non-contiguous one is copied inside the step).
        tensors: every parameter and state tensor the plans write or read, for the address
            check (``None`` entries allowed).
        rows: per tensor ``(lr, bc2, bc1_recip, decay)``, already rounded to fp32.
        seeds: per tensor signed 64-bit stochastic-rounding seeds, or ``None`` (nearest).
        anchor: a state tensor that lives as long as this list's state (the first codes);
            the list's graph is kept while it lives.
    """
    n = len(plans)
    entry = _ENTRIES.get(anchor)
    if entry is None or entry.hyper.shape[0] != n:
        entry = _Entry(n, anchor.device)
        _ENTRIES[anchor] = entry
    # Triton launches on the current device's stream and a capture allocates from the
    # current device's pool: both must be the tensors' device.
    with torch.cuda.device(anchor.device):
        _step(entry, plans, grads, tensors, rows, seeds)


def _step(entry: _Entry, plans: Sequence[Any], grads: Sequence[Tensor],
          tensors: Sequence[Tensor | None], rows: Sequence[tuple[float, float, float, float]],
          seeds: Sequence[int] | None) -> None:
    # Pinned staging from the caching host allocator: a block is reused only after the copy
    # that read it has run, so the host never waits for the device here.
    staged = torch.tensor(rows, dtype=torch.float32).pin_memory()
    entry.hyper.copy_(staged, non_blocking=True)
    if seeds is not None:
        entry.seeds.copy_(torch.tensor(seeds, dtype=torch.int64).pin_memory(), non_blocking=True)
    key = _address_key(plans, grads, tensors)
    if entry.graph is not None and key == entry.key:
        entry.graph.replay()
        return
    if (entry.failed or key != entry.key or entry.captures >= _MAX_CAPTURES
            or torch.cuda.is_current_stream_capturing()):
        entry.graph = None
        entry.key = key
        entry.plans = list(plans)
        _launch_all(plans, grads, entry)
        return
    # Second step in a row at the same addresses: capture, then replay for this step.
    entry.captures += 1
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                _launch_all(plans, grads, entry)
            finally:
                graph.capture_end()
    except RuntimeError as exc:  # capture is an optimisation: fall back to eager launches
        entry.failed = True
        warnings.warn(f"Gefen: CUDA-graph capture of the fused step failed ({exc}); stepping "
                      "eagerly from now on", RuntimeWarning, stacklevel=4)
        current.wait_stream(side)
        _launch_all(plans, grads, entry)
        return
    current.wait_stream(side)
    entry.graph = graph
    entry.plans = list(plans)
    graph.replay()
