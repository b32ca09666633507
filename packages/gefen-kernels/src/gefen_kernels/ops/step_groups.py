"""Grouped launches of planned Gefen steps: a whole parameter list in a few launches
(docs/algorithm.md#block-second-moment, docs/algorithm.md#factored-second-moment).

With one :class:`.step_plan.StepPlan` launch per tensor, a Llama-3.2-1B-shaped step issued
about 375 Triton launches, and Triton's Python launcher (tens of µs each) made the eager step
host-bound on an H200 (``docs/internals/kernels.md``). :class:`StepGroups` sorts a list of
plans once into classes that one kernel variant serves (mode, dtypes, tile shape, statistics
tile, alignment) and launches each class as one tile launch (block mode) or one statistics, one
finalize and one tile launch per chunk of factored tensors whose scratch fits
:data:`GROUP_SCRATCH_BYTES` (and one flat update launch after the tile where the class's
blocks cross rows: :func:`._step_kernels.flat_update`). Factored plans of the other routes
(loop, split) form classes of their own whose statistics and finalize launches are grouped the
same way, and then launch their update alone (:meth:`.step_plan.StepPlan.launch_update`, with
``1/rbar`` from the group's scratch): on an H200 the statistics of one bf16 ``[2048, 8192]``
gradient alone read it at about 0.4 TB/s, those of 16 such gradients in one launch at about
1.4 TB/s. Block-mode plans of those routes launch
one by one.

On CUDA the launches use more than one stream (``docs/internals/kernels.md``, "Streams"):
the small classes (:data:`SIDE_PROGRAMS`) run on a high-priority side stream, and the large
classes' chunks are dealt round-robin over the current stream and ``CHAIN_STREAMS - 1`` others
(three streams in all with the default ``CHAIN_STREAMS = 2``), so no chunk waits for an
unrelated chunk's last programs. The other streams are taken from torch's stream pools once
per thread and device (:func:`_streams`), start after the work queued on the current stream,
and are waited for by it before :meth:`StepGroups.launch_staged` returns, also when a launch
raises; the launches, and so the bits, are those of one stream. Pool streams are handed out
round-robin (32 per priority and device), so other code of the process (a data-loading
stream, a communication library, another thread's capture) may get the same stream: eager
work on it then just runs in order with these launches, but a CUDA graph captured on one
thread while another thread launches on that shared stream can take those launches into the
capture or fail it. ``SIDE_PROGRAMS = 0`` and ``CHAIN_STREAMS = 1``, set before the groups are
built, keep every launch on the current stream. On an H200 the captured GPT-2 step went from
1.14 to 1.00 ms, the captured Llama step from 7.41 to 7.29 ms.

Per step, the scalars, seeds and gradient offsets travel in one host-to-device copy from
pinned memory (a ``capturable`` step, whose scalars and seeds are device tensors, assembles the
same buffer on the device instead: :meth:`StepGroups.device_buffer`); nothing else is
rebuilt while the plans, their tensors' addresses and the gradients' dtypes and alignment
stay the same (:meth:`StepGroups.matches`). The tables hold offsets and plans (weak
references), never a tensor of the optimizer (their own tensors are the tables and one
16-byte anchor per class that gradient offsets are measured from, so a grouped launch depends
on no gradient's address but through the staged offsets).
:meth:`StepGroups.launch` stages from host memory and cannot be captured in a CUDA graph;
:meth:`StepGroups.stage` outside a capture and :meth:`StepGroups.launch_staged` with
``device_scalars=True`` inside it can (the graph is then replayed after each new staging into
the same buffer). The kernels
(:mod:`._group_kernels`) do each tensor's per-program work of the one-tensor kernels with the
same compiled layouts, so the result is bit-identical to :meth:`StepPlan.launch` on every plan
with the same scalars and seeds.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._numerics import f32, to_signed64
from ._device import keeps_tables
from ._factored_step_kernels import (
    _FIN_COLS,
    _FIN_CONSTS,
    _FIN_ROWS,
    _cdiv,
    stats_items_per_program,
    stats_prefetch,
)
from ._group_kernels import (
    META,
    _group_finalize_kernel,
    _group_stats_kernel,
    _group_tile_kernel,
    _group_update_kernel,
)
from ._step_kernels import FLAT_CHUNKS, FLAT_WARPS, ncols_divider
from ._triton_helpers import LAUNCH_OPTIONS
from .step_plan import StepPlan
from .step_scalars import StepScalars

__all__ = ["GROUP_SCRATCH_BYTES", "StepGroups", "tile_meta_row"]

# Statistics scratch of one factored launch chunk. A step's peak extra memory on the device is
# one chunk per chain stream (CHAIN_STREAMS) and a side stream's chunk, not the sum over the
# model (a Llama-3.2-1B step's partials total about 130 MiB). A chunk holds at least one
# tensor, so a tensor whose scratch alone exceeds this is a chunk of its own: up to about
# 4 * (max(R, 2**20) + max(C, 2**20)) bytes for an [R, C] gradient (factored_step.stats_layout;
# 8 MiB while R, C <= 2**20), e.g. 7.8 MiB for a Llama-3-8B-shaped [128256, 4096] embedding.
# Each stream's scratch lives in that stream's cached allocator blocks.
# torch.cuda.max_memory_allocated sees only one chunk at a time: a chunk's scratch is released
# on the host, stream-ordered, before the next chunk's launches are issued, while another
# stream's chunk may still run on the device.
GROUP_SCRATCH_BYTES = 6 << 20
# The large classes' chunks (each a statistics, finalize and tile launch, and a flat update
# launch in FLAT_UPDATE classes, independent of the others) are dealt round-robin over this
# many streams, the current one and CHAIN_STREAMS - 1 others, so one chunk's launches start
# while another chunk's last programs drain (CUDA only). 1 keeps them all on the current
# stream.
CHAIN_STREAMS = 2
# A class whose tile launch has at most this many programs, and whose statistics scratch (if
# factored) fits SIDE_SCRATCH_BYTES, runs on a high-priority side stream beside the larger
# classes (CUDA only, and only where a larger class exists). Such a launch is bound by its
# own latency, not by the device: a CUDA graph of GPT-2 small's step ran twelve block-mode
# launches of 5-9 µs each (about 80 µs of a 1.13 ms step) one after another (an H200
# profile). About one wave of the tile
# kernel (132 SMs, six 4-warp programs each at its 37.5 % occupancy).
# 0 keeps every class off the side stream.
SIDE_PROGRAMS = 1024
SIDE_SCRATCH_BYTES = 1 << 20
# Device copies of gradient offsets kept per StepGroups for capturable steps
# (StepGroups.device_offsets): enough for the few gradient layouts a training loop cycles
# through, bounded where the gradients move every step.
OFFSET_TABLES = 8

_ELEMENT_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
_COL = {name: i for i, name in enumerate(META)}


def _spec(x: int) -> int:
    """Triton's launch-time view of an int argument: 1 (the constant), 16 (divisible by 16)
    or 0 (nothing known)."""
    return 1 if x == 1 else (16 if x % 16 == 0 else 0)


def _stored(x: int, spec: int) -> int:
    return x // 16 if spec == 16 else x


def tile_meta_row(param: Tensor, codes: Tensor, scale: Tensor, state: Tensor, col: Tensor | None,
                  bases: tuple[Tensor, Tensor, Tensor], *, t: int, num_blocks: int, period: int,
                  ncols: int, magic: int, shift: int, specs: tuple[int, int],
                  tile_first: int) -> list[int]:
    """The tile kernel's columns of one tensor's meta row (:data:`._group_kernels.META`; the
    others 0): addresses as 16-byte offsets from ``bases`` (a parameter, codes and fp32 tensor
    of the class, all 16-byte aligned like these), ``period``/``ncols`` stored for
    ``specs`` (:func:`_spec` of each). ``state`` is ``exp_avg_sq`` in block mode and
    ``exp_avg_sq_row`` in factored mode; ``t`` the row of the scalar, seed and gradient
    tables."""
    p_base, q_base, f_base = (b.data_ptr() for b in bases)
    row = [0] * len(META)
    row[_COL["param"]] = (param.data_ptr() - p_base) // 16
    row[_COL["codes"]] = (codes.data_ptr() - q_base) // 16
    row[_COL["scale"]] = (scale.data_ptr() - f_base) // 16
    row[_COL["exp_avg_sq"]] = (state.data_ptr() - f_base) // 16
    if col is not None:
        row[_COL["exp_avg_sq_col"]] = (col.data_ptr() - f_base) // 16
    row[_COL["t"]] = t
    row[_COL["num_blocks"]] = num_blocks
    row[_COL["period"]] = _stored(period, specs[0])
    row[_COL["ncols"]] = _stored(ncols, specs[1])
    row[_COL["ncols_magic"]], row[_COL["ncols_shift"]] = magic, shift
    row[_COL["tile_first"]] = tile_first
    return row


def _groupable(plan: StepPlan, grad: Tensor) -> bool:
    """A non-empty tensor, a standard gradient, and every pointer 16-byte aligned (a
    one-tensor launch would get an alignment hint for each; see :mod:`._group_kernels`).
    Tile-route plans are grouped whole; factored plans of the other routes have their
    statistics grouped (:func:`_stats_only`) and launch their update alone."""
    if not (plan.numel > 0 and grad.dtype in _ELEMENT_BYTES and grad.is_contiguous()
            and tuple(grad.shape) == plan.shape and grad.device == plan.device
            and (plan.route == "tile" or plan.factored)):
        return False
    tensors = [t for t in plan.tensors()[:6] if t is not None] + [grad]
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _stats_only(plan: StepPlan) -> bool:
    """A grouped plan whose statistics alone run in the grouped launches: the loop and split
    routes have no grouped kernel, but their factored statistics are those of any shape."""
    return plan.route != "tile"


def _partials(plan: StepPlan) -> tuple[int, int, int]:
    """Floats of the row partials, column partials and block sums of a factored plan, as
    ``factored_step._stats_partials`` lays them out."""
    assert plan._stats_layout is not None
    rows, cols = plan.shape
    _, _, splits, n_row_programs, _ = plan._stats_layout
    return splits * rows, n_row_programs * cols, _cdiv(rows, _FIN_ROWS)


def _class_specs(plan: StepPlan) -> tuple[int, ...]:
    """The specialisation of every int the one-tensor kernels take for this plan (period,
    ncols; for factored plans the statistics layout and the partials' alignment)."""
    num_blocks, period, ncols = plan._ints[:3]
    if not plan.factored:
        return (_spec(period), _spec(ncols))
    assert plan._stats_layout is not None
    rows, cols = plan.shape
    _, cb, splits, n_row_programs, rows_per_program = plan._stats_layout
    n_col_tiles = _cdiv(cols, cb)
    n_row, n_col, _ = _partials(plan)
    return (_spec(period), _spec(ncols), _spec(rows), _spec(n_col_tiles), _spec(splits),
            _spec(_cdiv(n_col_tiles, splits)), _spec(rows_per_program),
            _spec(n_row_programs), int(n_row % 4 == 0), int((n_row + n_col) % 4 == 0))


class _Launches:
    """One class of tensors: its meta table and program maps, split into chunks whose
    statistics scratch fits :data:`GROUP_SCRATCH_BYTES`."""

    def __init__(self, key: tuple[Any, ...], members: list[int], plans: Sequence[StepPlan],
                 device: torch.device) -> None:
        first = plans[members[0]]
        self.factored = first.factored
        self.stats_only = _stats_only(first)
        self.members = members
        self.specs: tuple[int, ...] = key[-1]
        self.p_vec = 16 // _ELEMENT_BYTES[first.dtype]
        self.g_vec = 16 // _ELEMENT_BYTES[key[2]]
        # The address the class's gradient offsets are measured from (StepGroups.__init__).
        self.g_anchor = torch.empty(self.g_vec, dtype=key[2], device=device)
        self.consts = ({} if self.stats_only else
                       {k: first._consts[k] for k in ("BPP", "P2", "TAIL", "MAXIMIZE", "STOCHASTIC",
                                                      "STEPS", "OFFS64", "IN_ROW",
                                                      "FLAT_UPDATE", "num_warps")})
        self.layout = first._stats_layout
        self.side = False  # launched on the side stream (StepGroups.__init__)
        # The class's bases are the first member's parameter, codes and scales, looked up
        # through its plan when needed: the tables hold no tensor, so an optimizer's state is
        # freed with it (a cache keyed weakly on a state tensor stays weak).
        self._first = first
        self.chunks: list[dict[str, Any]] = []
        chunk: list[int] = []
        used = 0
        for i in members:
            need = self._region_floats(plans[i]) if self.factored else 0
            if chunk and used + need > GROUP_SCRATCH_BYTES // 4:
                self.chunks.append(self._build(chunk, plans, device))
                chunk, used = [], 0
            chunk.append(i)
            used += need
        if chunk:
            self.chunks.append(self._build(chunk, plans, device))

    def small(self) -> bool:
        """Whether this class may run on the side stream: a tile launch of at most
        :data:`SIDE_PROGRAMS` programs in all, and at most :data:`SIDE_SCRATCH_BYTES` of
        statistics scratch per chunk (a statistics-only class launches its updates alone)."""
        return (not self.stats_only
                and sum(chunk["n_tile"] for chunk in self.chunks) <= SIDE_PROGRAMS
                and all(4 * (chunk["scratch"] + chunk["tensors"]) <= SIDE_SCRATCH_BYTES
                        for chunk in self.chunks if self.factored))

    @staticmethod
    def _region_floats(plan: StepPlan) -> int:
        """Row partials, column partials, block sums and ``1/rbar``, contiguous as in the
        one-tensor launch, rounded up to 16 bytes."""
        return _cdiv(sum(_partials(plan)) + 1, 4) * 4

    def bases(self) -> tuple[Tensor, Tensor, Tensor]:
        """The class's base parameter, codes and fp32 (scales) tensors."""
        param, codes, scale = self._first.tensors()[:3]
        assert param is not None and codes is not None and scale is not None
        return param, codes, scale

    def _build(self, members: list[int], plans: Sequence[StepPlan],
               device: torch.device) -> dict[str, Any]:
        specs = self.specs
        bases = self.bases()
        rows_out: list[list[int]] = []
        # Programs per member of each launch; the program -> member maps are expanded in C
        # below (Llama-3.2-1B's tile launch alone has ~730K programs: a Python list of them
        # took tens of milliseconds of the first step).
        counts: dict[str, list[int]] = {"tile": [], "stats": [], "finalize": [], "update": []}
        firsts = {"tile": 0, "stats": 0, "finalize": 0, "update": 0}
        flat = bool(self.consts.get("FLAT_UPDATE"))
        inv_rbar_at: list[int] = []  # each member's 1/rbar, as a float index into the scratch
        offset = 0
        for local, i in enumerate(members):
            plan = plans[i]
            param, codes, scale, sq, r, k, _ = plan.tensors()
            num_blocks, period, ncols, magic, shift = plan._ints
            row = tile_meta_row(
                param, codes, scale, sq if sq is not None else r, k,  # type: ignore[arg-type]
                bases, t=i, num_blocks=num_blocks, period=period,  # type: ignore[arg-type]
                ncols=ncols, magic=magic, shift=shift, specs=(specs[0], specs[1]),
                tile_first=firsts["tile"])
            n_tile = 0 if self.stats_only else _cdiv(num_blocks, self.consts["BPP"])
            counts["tile"].append(n_tile)
            firsts["tile"] += n_tile
            if not self.factored:
                rows_out.append(row)
                continue
            assert plan._stats_layout is not None
            nrows = plan.shape[0]
            _, cb, splits, n_row_programs, rows_per_program = plan._stats_layout
            n_col_tiles = _cdiv(ncols, cb)
            n_row, n_col, n_blocks = _partials(plan)
            for name, value, spec in (
                    ("nrows", nrows, specs[2]), ("n_col_tiles", n_col_tiles, specs[3]),
                    ("n_splits", splits, specs[4]),
                    ("tiles_per_split", _cdiv(n_col_tiles, splits), specs[5]),
                    ("rows_per_program", rows_per_program, specs[6]),
                    ("n_row_programs", n_row_programs, specs[7])):
                row[_COL[name]] = _stored(value, spec)
            row[_COL["region"]] = offset // 4
            row[_COL["col_part"]] = n_row // 4 if specs[8] else n_row
            row[_COL["block_sum"]] = (n_row + n_col) // 4 if specs[9] else n_row + n_col
            row[_COL["inv_rbar"]] = n_row + n_col + n_blocks
            inv_rbar_at.append(offset + n_row + n_col + n_blocks)
            offset += self._region_floats(plan)
            row[_COL["ticket"]] = local
            items = stats_items_per_program(plan._stats_layout, ncols)
            row[_COL["stats_items"]] = items
            row[_COL["stats_first"]] = firsts["stats"]
            counts["stats"].append(_cdiv(n_row_programs * splits, items))
            firsts["stats"] += counts["stats"][-1]
            row[_COL["finalize_first"]] = firsts["finalize"]
            counts["finalize"].append(max(1, _cdiv(nrows, _FIN_ROWS) + _cdiv(ncols, _FIN_COLS)))
            firsts["finalize"] += counts["finalize"][-1]
            row[_COL["inv_c"]] = _f32_bits(1.0 / ncols)
            row[_COL["inv_r"]] = _f32_bits(1.0 / nrows)
            if flat:  # the flat update after the tile launch (_group_update_kernel)
                n_update = _cdiv(plan.numel, 16 * FLAT_CHUNKS)
                row[_COL["update_first"]] = firsts["update"]
                row[_COL["numel16"]] = plan.numel // 16
                row[_COL["period_magic"]], row[_COL["period_shift"]] = ncols_divider(period)
                counts["update"].append(n_update)
                firsts["update"] += n_update
            rows_out.append(row)
        local_ids = torch.arange(len(members), dtype=torch.int32)
        prog = torch.cat([
            local_ids[:len(c)].repeat_interleave(torch.tensor(c, dtype=torch.int64))
            for c in (counts["tile"], counts["stats"], counts["finalize"],
                      counts["update"])]).to(device)
        n_tile, n_stats, n_fin = firsts["tile"], firsts["stats"], firsts["finalize"]
        return {
            "meta": torch.tensor(rows_out, dtype=torch.int64).to(device),
            "tile": prog[:n_tile], "stats": prog[n_tile:n_tile + n_stats],
            "finalize": prog[n_tile + n_stats:n_tile + n_stats + n_fin],
            "update": prog[n_tile + n_stats + n_fin:], "scratch": offset,
            "tensors": len(members), "n_tile": n_tile, "n_stats": n_stats, "n_finalize": n_fin,
            "n_update": firsts["update"], "members": members, "inv_rbar_at": inv_rbar_at,
        }


_STREAMS = threading.local()


def _streams(device: torch.device, chains: int) -> list[torch.cuda.Stream]:
    """This thread's side stream (high priority) and ``chains`` chain streams on ``device``,
    taken from torch's stream pools once per thread and device and shared by every
    :class:`StepGroups` of the thread: a new ``StepGroups`` (a rebuilt step) reuses the
    streams, and the scratch blocks cached on them, instead of taking further pool streams.
    Per thread, so that a thread capturing a CUDA graph is unlikely to have another thread's
    launches on a stream it forked into its capture; unlikely, not impossible: the pools wrap
    around after 32 streams per priority, and other code (``torch.cuda.Stream()`` users, a
    capture's own streams) draws from the same pools. The high-priority stream is taken even
    where no class runs on it (one pool stream, no launches)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    cache = getattr(_STREAMS, "by_device", None)
    if cache is None:
        cache = _STREAMS.by_device = {}
    streams = cache.setdefault(index, [])
    if not streams:
        streams.append(torch.cuda.Stream(index, priority=-1))
    while len(streams) < 1 + chains:
        streams.append(torch.cuda.Stream(index))
    return streams[:1 + chains]


Pairs = list[tuple[_Launches, dict[str, Any]]]


def _deal(classes: list[_Launches], singles: bool,
          streams: Callable[[int], list[Any]] | None) -> tuple[Any, list[tuple[Any, Pairs]], Pairs]:
    """Which stream each ``(class, chunk)`` launches on: ``(side stream or None, [(stream,
    pairs)] for every stream other than the current one, the current stream's pairs)``.

    The small classes (:meth:`_Launches.small`) go to the side stream where something runs
    beside them (a larger class, or a non-empty lone plan: ``singles``); every other chunk, in
    order, is dealt round-robin over the current stream and ``CHAIN_STREAMS - 1`` others.
    ``streams(n)``: the side stream and ``n`` chain streams (:func:`_streams`); ``None`` off
    CUDA, where everything stays on the current stream. Sets each class's ``side``."""
    small = [cls.small() for cls in classes]
    use_side = streams is not None and any(small) and (singles or not all(small))
    for cls, is_small in zip(classes, small):
        cls.side = use_side and is_small
    side = [(cls, chunk) for cls in classes if cls.side for chunk in cls.chunks]
    chain = [(cls, chunk) for cls in classes if not cls.side for chunk in cls.chunks]
    ways = max(1, min(CHAIN_STREAMS, len(chain))) if streams is not None else 1
    got = streams(ways - 1) if streams is not None and (side or ways > 1) else []
    forks = [(stream, chain[k + 1::ways]) for k, stream in enumerate(got[1:])]
    if side:
        forks.insert(0, (got[0], side))
    return (got[0] if side else None), forks, chain[0::ways]


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", f32(x)))[0]


class StepGroups:
    """The grouped launches of one list of plans (one optimizer step's tensors of one device,
    codebook and options).

    Args:
        plans: the tensors' plans, all built with the same codebook, betas, eps, maximize and
            rounding (those of one optimizer call).
        grads: this step's gradients, in the same order (their dtypes and alignment choose
            the classes; :meth:`matches` says whether later gradients fit the same classes).

    Raises:
        ValueError: the plans differ in device, codebook or options.
    """

    def __init__(self, plans: Sequence[StepPlan], grads: Sequence[Tensor]) -> None:
        if not plans or len(plans) != len(grads):
            raise ValueError(f"StepGroups needs one gradient per plan and at least one plan, "
                             f"got {len(plans)} plans and {len(grads)} gradients")
        first = plans[0]
        for j, plan in enumerate(plans):
            if (plan.device != first.device or plan.tensors()[6] is not first.tensors()[6]
                    or plan._floats != first._floats or plan.maximize != first.maximize
                    or plan.stochastic_round != first.stochastic_round):
                raise ValueError(f"plans[{j}] differs from plans[0] in device, codebook or "
                                 "options; group only the plans of one optimizer call")
        self.device = first.device
        self._plans = list(plans)
        self._ids = tuple(map(id, plans))
        self._signature = self.signature(plans, grads)
        classes: dict[tuple[Any, ...], list[int]] = {}
        self._singles: list[int] = []
        for i, (plan, grad) in enumerate(zip(plans, grads)):
            if not _groupable(plan, grad):
                self._singles.append(i)
                continue
            c = plan._consts
            layout = plan._stats_layout[:2] if plan._stats_layout is not None else None
            tile = (None if _stats_only(plan) else
                    (c["P2"], c["BPP"], c["TAIL"], c["OFFS64"], c["IN_ROW"], c["FLAT_UPDATE"]))
            key = (plan.factored, plan.dtype, grad.dtype, tile, layout, _class_specs(plan))
            classes.setdefault(key, []).append(i)
        self._classes = [_Launches(key, members, plans, self.device)
                         for key, members in classes.items()]
        device = self.device
        self._side_stream, self._forks, self._current = _deal(
            self._classes, any(plans[i].numel > 0 for i in self._singles),
            (lambda chains: _streams(device, chains)) if device.type == "cuda" else None)
        # Per class, the address its gradients' offsets are measured from: a 16-byte tensor
        # of the gradients' dtype owned by the groups, not a gradient, so the launches depend
        # on no gradient's address but through the staged offsets (a captured graph stays
        # valid when autograd re-allocates the gradients, if each step stages their offsets
        # into the graph's buffer; a graph of device_offsets' copy needs the gradients where
        # they were at capture). The allocator aligns it like the
        # gradients (16 bytes at least), so the kernels compile as with a gradient as base.
        self._grad_anchor: list[Tensor | None] = [None] * len(plans)
        for cls in self._classes:
            for i in cls.members:
                self._grad_anchor[i] = cls.g_anchor
        # The plans launched with their gradient's own address (alone, or the update of a
        # statistics-only class): what a captured graph of these launches depends on.
        self.direct = sorted(set(self._singles).union(
            i for cls in self._classes if cls.stats_only for i in cls.members))
        self._pin = self.device.type == "cuda"
        # Capturable steps (device_buffer): each plan's mode, for its scalars' formula, and
        # the device copies of the gradient offsets, kept because a captured graph reads the
        # copy it was captured with at every replay.
        self.factored = torch.tensor([plan.factored for plan in plans], dtype=torch.bool,
                                     device=self.device)
        self._offset_tables: dict[tuple[int, ...], Tensor] = {}

    @staticmethod
    def signature(plans: Sequence[StepPlan], grads: Sequence[Tensor]) -> tuple[Any, ...]:
        """What the tables depend on beyond the plans' identity: the address and dtype of every
        planned tensor (``p.data = ...`` or ``set_()`` keeps a tensor's identity but moves its
        storage) and each gradient's dtype, layout and 16-byte alignment."""
        return (tuple((t.data_ptr(), t.dtype) if t is not None else None
                      for plan in plans for t in plan.tensors()),
                tuple((g.dtype, g.is_contiguous(), g.data_ptr() % 16 == 0) for g in grads))

    def matches(self, plans: Sequence[StepPlan], grads: Sequence[Tensor]) -> bool:
        """Whether these plans (identity), their tensors' storage and these gradients fit the
        tables built."""
        return (tuple(map(id, plans)) == self._ids
                and self.signature(plans, grads) == self._signature)

    def launch(self, grads: Sequence[Tensor], scalars: Sequence[StepScalars],
               seeds: Sequence[int] | None) -> None:
        """One step of every plan with gradients ``grads``: :meth:`stage` into a new device
        buffer, then :meth:`launch_staged`.

        Args:
            grads: contiguous gradients, one per plan, fitting :meth:`matches` (the caller
                checks; a grouped gradient that lost its 16-byte alignment raises
                ``ValueError`` before anything is launched).
            scalars: per plan :class:`~gefen_kernels.ops.step_scalars.StepScalars` already
                rounded to fp32 (as :meth:`StepPlan.launch` takes them; ``bc2`` is
                ``bc2_rsqrt`` in block mode and ``bc2_recip`` in factored mode).
            seeds: per plan signed 64-bit stochastic-rounding seeds, or ``None`` (nearest).

        Raises:
            RuntimeError: called while the current stream is capturing a CUDA graph (the
                staging copy reads host memory; capture :meth:`launch_staged` instead).
        """
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("StepGroups.launch stages its per-step values from host memory "
                               "and cannot be captured in a CUDA graph; stage() outside the "
                               "capture and capture launch_staged(..., device_scalars=True)")
        # A new device buffer every step (one small allocation): a step on another stream
        # never overwrites values the previous step's kernels may still be reading.
        buffer = self.stage(grads, scalars, seeds)
        self.launch_staged(grads, buffer, scalars, seeds)

    def stage(self, grads: Sequence[Tensor], scalars: Sequence[StepScalars],
              seeds: Sequence[int] | None, out: Tensor | None = None) -> Tensor:
        """Copy one step's per-plan values to the device: int64 ``[4 * n]`` holding the fp32
        scalars ``[n, 4]`` (the kernels' ``[lr, bc2, bc1_recip, decay]``), each grouped gradient's
        offset in 16-byte units from its class's anchor (0 for the others), and the seeds (0
        for nearest). One
        asynchronous copy from pinned host memory into ``out`` (a buffer of that shape and
        dtype on the device, reused by a graph replay) or a new buffer; returns it.

        Raises:
            ValueError: a grouped gradient lost its 16-byte alignment (nothing is copied).
        """
        n = len(self._plans)
        floats: list[float] = []
        for sc in scalars:
            floats += sc  # StepScalars: the kernels' order [lr, bc2, bc1_recip, decay]
        words = list(struct.unpack(f"<{2 * n}q", struct.pack(f"<{4 * n}f", *floats)))
        words += self._offsets(grads)
        words += [to_signed64(s) for s in seeds] if seeds is not None else [0] * n
        staged = torch.tensor(words, dtype=torch.int64)
        # Pinned, from the caching host allocator: reused only after this copy has run.
        buffer = out if out is not None else torch.empty(4 * n, dtype=torch.int64,
                                                         device=self.device)
        buffer.copy_(staged.pin_memory() if self._pin else staged, non_blocking=self._pin)
        return buffer

    def _offsets(self, grads: Sequence[Tensor]) -> list[int]:
        """Each grouped gradient's distance from its class's anchor in 16-byte units (both are
        16-byte aligned: :meth:`matches`); 0 for the others.

        Raises:
            ValueError: a grouped gradient lost its 16-byte alignment.
        """
        offsets = [0 if anchor is None else g.data_ptr() - anchor.data_ptr()
                   for g, anchor in zip(grads, self._grad_anchor)]
        if any(d & 15 for d in offsets):
            raise ValueError("a grouped gradient is no longer 16-byte aligned; check "
                             "StepGroups.matches() before launch and rebuild the groups")
        return [d >> 4 for d in offsets]

    def device_offsets(self, grads: Sequence[Tensor]) -> Tensor | None:
        """The gradient offsets of :meth:`stage` as an int64 ``[n]`` device tensor, for a step
        whose scalars and seeds are already on the device (``capturable``). A copy is kept
        per distinct offsets (the first :data:`OFFSET_TABLES`), so a graph captured with it
        stays valid while these groups live. Inside a capture, offsets that no earlier step
        kept give ``None``: a copy from host memory cannot be captured.

        Raises:
            ValueError: a grouped gradient lost its 16-byte alignment.
        """
        offsets = tuple(self._offsets(grads))
        table = self._offset_tables.get(offsets)
        if table is not None:
            return table
        if self._pin and torch.cuda.is_current_stream_capturing():
            return None
        staged = torch.tensor(offsets, dtype=torch.int64)
        table = torch.empty(len(offsets), dtype=torch.int64, device=self.device)
        table.copy_(staged.pin_memory() if self._pin else staged, non_blocking=self._pin)
        if len(self._offset_tables) < OFFSET_TABLES and keeps_tables():
            self._offset_tables[offsets] = table
        return table

    @staticmethod
    def device_buffer(hyper: Tensor, offsets: Tensor, seeds: Tensor) -> Tensor:
        """The buffer of :meth:`stage` assembled on the device in one launch: ``hyper`` fp32
        ``[n, 4]`` (the kernels' ``[lr, bc2, bc1_recip, decay]``), ``offsets`` from
        :meth:`device_offsets`, ``seeds`` int64 ``[n]``."""
        words = hyper.to(torch.float32).contiguous().view(torch.int64).reshape(-1)
        return torch.cat([words, offsets, seeds.to(torch.int64).reshape(-1)])

    def launch_staged(self, grads: Sequence[Tensor], buffer: Tensor,
                      scalars: Sequence[StepScalars] | None,
                      seeds: Sequence[int] | None, *, device_scalars: bool = False) -> None:
        """The kernels of one step, reading their per-step values from ``buffer``
        (:meth:`stage` of these ``grads``). Plans launched alone (not groupable, or the
        update of a statistics-only class) take ``scalars`` and ``seeds`` by value, or, with
        ``device_scalars``, read them from ``buffer`` too (``scalars``/``seeds`` unused): then
        nothing here reads host memory and the launches can be captured in a CUDA graph and
        replayed after each new :meth:`stage` into the same buffer. Both give the same bits."""
        n = len(self._plans)
        hyper = buffer[:2 * n].view(torch.float32).view(n, 4)
        gptr, seed_table = buffer[2 * n:3 * n], buffer[3 * n:]

        def alone(i: int) -> dict[str, Any]:
            if device_scalars:
                return dict(lr=0.0, bc1_recip=0.0, bc2=0.0, decay=1.0, seed=0, hyper=hyper[i],
                            seed_tensor=seed_table[i:i + 1])
            assert scalars is not None
            sc = scalars[i]
            return dict(lr=sc.lr, bc1_recip=sc.bc1_recip, bc2=sc.bc2, decay=sc.decay,
                        seed=0 if seeds is None else seeds[i])

        views = (hyper, gptr, seed_table)
        current = torch.cuda.current_stream(self.device) if self._forks else None
        forked: list[torch.cuda.Stream] = []
        try:
            # The other streams start after the work queued before this step (the staging of
            # `buffer`, the gradients), and the current stream waits for every one of them
            # before this returns, also when a launch raises, so nothing they read is freed
            # and reused before they are done. (Where a pooled stream is the current stream
            # itself, its launches just run in order.) The side stream's launches go first,
            # so they start beside the first large one.
            for stream, pairs in self._forks:
                stream.wait_stream(current)  # type: ignore[arg-type]
                forked.append(stream)
                with torch.cuda.stream(stream):
                    self._launch_chunks(pairs, grads, views, alone)
            for i in self._singles:
                self._plans[i].launch(grads[i], **alone(i))
            self._launch_chunks(self._current, grads, views, alone)
        finally:
            for stream in forked:
                current.wait_stream(stream)  # type: ignore[union-attr]

    def _launch_chunks(self, pairs: Sequence[tuple[_Launches, dict[str, Any]]],
                       grads: Sequence[Tensor], views: tuple[Tensor, Tensor, Tensor],
                       alone: Callable[[int], dict[str, Any]]) -> None:
        """The launches of each ``(class, chunk)`` of ``pairs``, in order, on the current
        stream; ``views``: the step buffer's scalars ``[n, 4]``, gradient offsets and seeds."""
        hyper, gptr, seed_table = views
        first = self._plans[0]
        codebook = first.tensors()[6]
        b1, omb1, b2, omb2, eps = first._floats
        scratch: Tensor | None
        tickets: Tensor | None
        for cls, chunk in pairs:
            c = cls.consts
            sp = cls.specs
            p_base, q_base, f_base = cls.bases()
            g_base = cls.g_anchor
            # The previous chunk's scratch goes back to the allocator before this one's
            # is taken (stream order makes the reuse safe): the peak is one chunk's per
            # stream.
            scratch = tickets = None
            if cls.factored:
                scratch = torch.empty(chunk["scratch"] + chunk["tensors"],
                                      dtype=torch.float32, device=self.device)
                tickets = scratch[chunk["scratch"]:].view(torch.int32)
                rb, cb = cls.layout[:2]  # type: ignore[index]
                _group_stats_kernel[(chunk["n_stats"],)](
                    chunk["meta"], chunk["stats"], gptr, g_base, scratch, tickets,
                    G_VEC=cls.g_vec, RB=rb, CB=cb, SPEC_NROWS=sp[2], SPEC_NCOLS=sp[1],
                    SPEC_TILES=sp[3], SPEC_SPLITS=sp[4], SPEC_TPS=sp[5], SPEC_RPP=sp[6],
                    COL_PART_ALIGNED=bool(sp[8]),
                    PREFETCH=stats_prefetch(_ELEMENT_BYTES[g_base.dtype]), num_warps=8,
                    **LAUNCH_OPTIONS)
                _group_finalize_kernel[(chunk["n_finalize"],)](
                    chunk["meta"], chunk["finalize"], f_base, scratch, tickets, b2, omb2,
                    SPEC_NROWS=sp[2], SPEC_NCOLS=sp[1], SPEC_SPLITS=sp[4], SPEC_NRP=sp[7],
                    COL_PART_ALIGNED=bool(sp[8]), BLOCK_SUM_ALIGNED=bool(sp[9]),
                    **_FIN_CONSTS)
            if cls.stats_only:
                assert scratch is not None
                for i, at in zip(chunk["members"], chunk["inv_rbar_at"]):
                    self._plans[i].launch_update(grads[i], scratch[at:at + 1], **alone(i))
                continue
            _group_tile_kernel[(chunk["n_tile"],)](
                chunk["meta"], chunk["tile"], gptr, p_base, g_base, q_base, f_base,
                codebook if scratch is None else scratch, codebook, first._table,
                hyper, seed_table, b1, omb1, b2, omb2, eps, P_VEC=cls.p_vec,
                G_VEC=cls.g_vec, BPP=c["BPP"], P2=c["P2"], TAIL=c["TAIL"],
                FACTORED=cls.factored, MAXIMIZE=c["MAXIMIZE"], STOCHASTIC=c["STOCHASTIC"],
                STEPS=c["STEPS"], OFFS64=c["OFFS64"], IN_ROW=c["IN_ROW"], SPEC_PERIOD=sp[0],
                SPEC_NCOLS=sp[1], FLAT_UPDATE=c["FLAT_UPDATE"],
                num_warps=c["num_warps"], **LAUNCH_OPTIONS)
            if c["FLAT_UPDATE"]:
                assert scratch is not None
                _group_update_kernel[(chunk["n_update"],)](
                    chunk["meta"], chunk["update"], p_base, q_base, f_base, scratch, codebook,
                    hyper, eps, P_VEC=cls.p_vec, SPEC_PERIOD=sp[0], SPEC_NCOLS=sp[1],
                    CHUNKS=FLAT_CHUNKS, num_warps=FLAT_WARPS, **LAUNCH_OPTIONS)
