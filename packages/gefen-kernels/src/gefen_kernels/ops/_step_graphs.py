"""CUDA-graph replay of the planned fused step (the kernels issue;
docs/algorithm.md#factored-second-moment, docs/algorithm.md#capturable).

An eager fused step issues several Triton launches; from Python each costs tens of
microseconds of host time, so a step over ~150 tensors is host-bound long before its kernels
are. A training loop, though, steps the same tensors every step. Then the step's launches are
captured once into a CUDA graph and replayed: one host call per step.

The per-step scalars (``[lr, bc2, bc1_recip, decay]`` of docs/algorithm.md#block-second-moment step
2, docs/algorithm.md#factored-second-moment step 2, rounded to fp32 on the host exactly as for the
eager launches) and the stochastic-rounding seeds are read by the kernels from device buffers (their
``HYPER`` / ``SEED_PTR`` variants), refreshed by an asynchronous copy from pinned memory before
every launch or replay. The kernels compute the same bits from a scalar in memory as from the same
scalar passed by value, so a replayed step equals the eager one bit for bit.

Two users, both opt-in with ``GEFEN_CUDA_GRAPHS=1``:

* **Steady steps** (:func:`launch_groups`, from gefen-core's steady step). The grouped
  launches of :class:`gefen_kernels.ops.step_groups.StepGroups` read every grouped gradient
  through an offset staged with the scalars, so their graph depends on no gradient's address:
  autograd may re-allocate the gradients every step (``zero_grad(set_to_none=True)``) and the
  graph still replays. Only plans launched with their gradient's own address
  (``StepGroups.direct``: a gradient that cannot be grouped, the update of a loop- or
  split-route factored tensor) tie the graph to those gradients' addresses. The steady step's
  own checks establish everything else the graph's addresses depend on (parameters, state,
  codebook).
* **Full steps** (:func:`launch`, per-plan launches through capturable plans): the addresses,
  dtypes and strides of every gradient, parameter, state tensor and the codebook must equal
  those at capture. Their ``HYPER`` kernel variants are compiled on the first step.

Either way a step whose key differs from the previous step's runs its launches eagerly and
remembers the key; only a second step in a row with the same key captures, on a side stream,
without flushing the allocator's caches (a flush would move the next step's gradients), in
thread-local capture mode (so a pin-memory DataLoader thread allocating meanwhile is not
affected), at most ``_MAX_CAPTURES`` times per entry. A capture that fails warns and leaves
that entry eager. A graph keeps its scratch (the factored statistics, at most
``GROUP_SCRATCH_BYTES`` per launch chunk, one chunk in flight per stream of the grouped
launches, each stream's in blocks of its own) in its private memory pool for as long as it
lives.

Why it stays opt-in (H200). In a GPT-2-small-shaped training loop with ``set_to_none=True``
(149 tensors) 37 of 40 steady steps replayed, and the host time of ``opt.step()`` fell by 0.8 to
2.0 ms in four runs, but the step time measured after a sync moved by -0.8 to +0.3 ms: the
steady step's checks precede its kernels in both modes, and after them replay saves the
launches' issue time, which eager launches largely hide behind the kernels' own run. The
iteration time of the loop without syncs went 36.3 -> 33.0 ms at batch 8 x 512 and 27.4 -> 32.7
ms at batch 2 x 128 (one run each). In the step benchmark the difference stayed inside the
run-to-run spread.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .step_scalars import StepScalars

__all__ = ["counts", "enabled", "launch", "launch_groups"]

_ENV = "GEFEN_CUDA_GRAPHS"
_MAX_CAPTURES = 4  # per step list: addresses that keep settling and moving stop being chased

# One entry per step list, keyed (weakly) on its first codes tensor: a list whose state is
# dropped (optimizer deleted, checkpoint reloaded) takes its graph with it.
_ENTRIES: Any = WeakIdKeyDictionary()


def enabled() -> bool:
    """Whether eager fused steps are graph-replayed (``GEFEN_CUDA_GRAPHS=1``; off by
    default: module docstring)."""
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
           rows: Sequence[StepScalars], seeds: Sequence[int] | None, *,
           anchor: Tensor) -> None:
    """One step of ``plans`` (capturable :class:`gefen_kernels.ops.step_plan.StepPlan`, all on
    one CUDA device) with gradients ``grads``: replayed from a graph when the addresses match
    the previous step's, else launched eagerly (and captured on the second match in a row).

    Args:
        plans: one capturable plan per tensor (``HYPER``/``SEED_PTR`` kernels).
        grads: the gradients, any strides (a non-contiguous one is copied inside the step).
        tensors: every parameter and state tensor the plans write or read, for the address
            check (``None`` entries allowed).
        rows: per tensor :class:`StepScalars`, already rounded to fp32.
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
          tensors: Sequence[Tensor | None], rows: Sequence[StepScalars],
          seeds: Sequence[int] | None) -> None:
    # Pinned staging from the caching host allocator: a block is reused only after the copy
    # that read it has run, so the host never waits for the device here.
    staged = torch.tensor(rows, dtype=torch.float32).pin_memory()
    entry.hyper.copy_(staged, non_blocking=True)
    if seeds is not None:
        entry.seeds.copy_(torch.tensor(seeds, dtype=torch.int64).pin_memory(), non_blocking=True)

    def launch_all() -> None:
        entry.plans = list(plans)
        _launch_all(plans, grads, entry)

    _replay_or_launch(entry, _address_key(plans, grads, tensors), launch_all)


class _GroupEntry:
    """The per-step value buffer of one :class:`gefen_kernels.ops.step_groups.StepGroups`,
    and its graph once captured."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.buffer = torch.empty(4 * n, dtype=torch.int64, device=device)
        self.key: tuple[Any, ...] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0
        self.failed = False


# Keyed (weakly) on the StepGroups object: the tables, plans and kernel table it holds are
# what its graph reads, and a StepGroups dropped (new plans, moved state) takes its graph along.
_GROUP_ENTRIES: Any = WeakIdKeyDictionary()


def launch_groups(groups: Any, grads: Sequence[Tensor],
                  scalars: Sequence[StepScalars],
                  seeds: Sequence[int] | None) -> None:
    """One step of ``groups`` (a CUDA :class:`~gefen_kernels.ops.step_groups.StepGroups`)
    through its staged launches, replayed from a graph when the gradients its launches take by
    address (``groups.direct``: none when every tensor is grouped) are where they were at the
    previous step (captured on the second such step in a row), else launched eagerly. The
    grouped gradients may move freely: their offsets are staged with the scalars.

    The caller guarantees what the graph's raw addresses depend on besides the gradients: the
    plans' tensors are those the groups were built for, at the same addresses, and the codebook
    is unmodified and where it was (the caller, gefen-core's steady step, checks all of
    it).

    Args:
        grads: contiguous gradients fitting ``groups.matches``.
        scalars: per plan :class:`StepScalars` rounded to fp32.
        seeds: per plan signed 64-bit seeds, or ``None`` (nearest rounding).
    """
    entry = _GROUP_ENTRIES.get(groups)
    if entry is None:
        entry = _GroupEntry(len(grads), groups.device)
        _GROUP_ENTRIES[groups] = entry
    with torch.cuda.device(groups.device):
        # Every step's values go into the one buffer the graph reads, in stream order before
        # the replay (or the eager launches) that read them.
        groups.stage(grads, scalars, seeds, out=entry.buffer)
        # Grouped gradients reach the kernels as staged offsets: only the plans launched with
        # their gradient's own address (StepGroups.direct) tie the graph to addresses.
        _replay_or_launch(
            entry, tuple(grads[i].data_ptr() for i in groups.direct),
            lambda: groups.launch_staged(grads, entry.buffer, None, None, device_scalars=True))


def counts() -> dict[str, int]:
    """How this process's graphed steps ran so far: ``replays``, ``eager`` launches and
    ``captures`` (a debugging and benchmarking aid; never reset)."""
    return dict(_COUNTS)


_COUNTS = {"replays": 0, "eager": 0, "captures": 0}


def _replay_or_launch(entry: Any, key: tuple[Any, ...], launch: Callable[[], None]) -> None:
    """Replay ``entry``'s graph when ``key`` (the addresses) equals the one it was captured
    at; otherwise run ``launch`` eagerly, or, on the second step in a row at the same
    addresses, capture it on a side stream and replay it."""
    if entry.graph is not None and key == entry.key:
        _COUNTS["replays"] += 1
        entry.graph.replay()
        return
    if (entry.failed or key != entry.key or entry.captures >= _MAX_CAPTURES
            or torch.cuda.is_current_stream_capturing()):
        _COUNTS["eager"] += 1
        entry.graph = None
        entry.key = key
        launch()
        return
    entry.captures += 1
    _COUNTS["captures"] += 1
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                launch()
            finally:
                graph.capture_end()
    except RuntimeError as exc:  # capture is an optimisation: fall back to eager launches
        entry.failed = True
        warnings.warn(f"Gefen: CUDA-graph capture of the fused step failed ({exc}); stepping "
                      "eagerly from now on", RuntimeWarning, stacklevel=4)
        current.wait_stream(side)
        launch()
        return
    current.wait_stream(side)
    entry.graph = graph
    graph.replay()
