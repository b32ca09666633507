"""``GefenDCPState``: Gefen checkpoints that ``torch.distributed.checkpoint`` reshards N -> M.

Pass it to ``dcp.save`` / ``dcp.load`` in place of the optimizer::

    state = GefenDCPState(model, optimizer)
    dcp.save({"model": model.state_dict(), "optim": state}, checkpoint_id=path,
             planner=state.save_planner())           # bounded save peak (optional)
    ...
    state = GefenDCPState(model, optimizer)          # any world size
    dcp.load({"model": model.state_dict(), "optim": state}, checkpoint_id=path)

What is written (format version 2, docs/algorithm.md#checkpoint-format), per parameter keyed
by its fully qualified name in ``model``, in forms that depend neither on the blocks nor on the
saving optimizer's mode (:mod:`gefen_dist._dense`): the dense fp32 momentum ``c[q] * s``; the
dense fp32 second moment each element was stepped with (a block's value repeated over its
elements, or ``r_i k_j / rbar`` for a factored matrix), both shaped and sharded like the
parameter so DCP reshards them natively; and, for every 2-D parameter, ``exp_avg_sq_row`` fp32
``[R]`` (sharded like the rows) and ``exp_avg_sq_col`` fp32 ``[C]`` (replicated, identical on
every rank): the factored statistics, or the row and column means of a per-block second moment.
Then the counters, the period in use, the period-search result and the mode (``factored``); the
codebook, ``T`` and the hyperparameters of every group. Every checkpoint has the same keys, so
any optimizer of this transport loads any checkpoint of it (plain ``Gefen`` in one process,
``ShardedGefen`` on any number of ranks, factored or not), and DCP never meets a missing key.

Loading re-blocks each local shard with the *saved* codebook and the saved period wherever its
blocks tile the new shards (:func:`gefen_dist.sharded.period_tiles`), else the period the live
optimizer would use (:func:`gefen_dist.sharded.sharded_period` of the saved search result):
``s_b = max|m|``, ``q = nearest(m / s_b)``, ``v_b`` = the fp64 mean over the block. With the
saved period this restores the codes, scales and second moments bit for bit (the block maximum
is an element ``±s`` exactly, and ``m / s`` lies within an ulp of its codeword, far closer than
any other codeword); a factored matrix's ``r`` and ``k`` are restored exactly on any topology.
Otherwise the momentum is re-quantized (error of one 256-level quantization) and a new block's
second moment is the mean of the source blocks it overlaps: exact up to fp32 rounding when it
is a union of whole source blocks, the flat source value when it lies inside one, a weighted
mean when it straddles. A matrix saved in the other mode is converted (a warning says so): a
per-block loader averages ``r_i k_j / rbar`` over its blocks, a factored loader takes the row
and column means (``docs/checkpoints.md`` lists the measured errors).

Every collective is entered by all ranks; every rank-local check is agreed first, and a load
is validated completely on every rank before any rank commits
(docs/algorithm.md#distributed).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from gefen_core import Gefen
from gefen_core import dispatch as _core_dispatch

from ._agree import agreed, collective_device
from ._dense import (
    dense_block_values,
    dense_momentum,
    factored_dense,
    matrix_partials,
    matrix_stats,
    reblock,
)
from .capabilities import Transport, check_capabilities
from .sharded import (
    SEARCH_PERIODS_KEY,
    narrow_staged_rows,
    period_tiles,
    rows_for_staging,
    sharded_period,
)

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = [
    "FORMAT_VERSION",
    "GefenDCPState",
    "GefenSavePlanner",
    "GefenStager",
    "async_stager_supported",
]

FORMAT_VERSION = 2
_GROUP_HYPERS = ("lr", "betas", "eps", "weight_decay", "maximize", "stochastic_round",
                 "period_search", "force_1d_period_one", "force_2d_period_one",
                 "period_one_substrings")


def _is_dtensor(t: object) -> TypeIs[DTensor]:
    return isinstance(t, DTensor)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if _is_dtensor(t) else t


class GefenDCPState(Stateful):
    """A DCP ``Stateful`` holding a Gefen optimizer's state in its global, reshardable layout.

    Args:
        model: the module whose ``named_parameters()`` give every optimizer parameter its
            checkpoint key (fully qualified name), exactly like
            ``get_optimizer_state_dict``. Under FSDP2 pass the sharded module.
        optimizer: a :class:`gefen_dist.ShardedGefen` (DTensor ``Shard(0)`` parameters on any
            number of ranks) or a plain :class:`gefen_core.Gefen` on plain parameters (one
            process, or replicas), block or factored second moment, ``capturable=False``. A
            checkpoint of either loads into the other, on any number of ranks, with any
            ``factored_v_2d`` (the second moment of a matrix is converted, approximately, when
            the saving and the loading optimizer step it in different forms; a warning says so).
        process_group: group for the agreement collectives (default: the parameters' mesh
            group or the default group).

    ``state_dict()`` and ``load_state_dict()`` are collective when a process group is
    initialized: every rank must call them (``dcp.save``/``dcp.load`` do).

    Costs: the files hold 8 bytes per parameter (two dense fp32 tensors) plus metadata. Without
    :meth:`save_planner` a save holds both dense tensors of every parameter at once (8 B/param
    over the resident state); with it, at most one parameter's dense tensor exists at a time,
    built from a CPU snapshot of the compact state (about 1 B/param of host memory). A load
    allocates the dense destinations of all parameters (8 B/param) before re-blocking.

    Raises:
        TypeError: ``optimizer`` is not a ``gefen_core.Gefen``.
        gefen_dist.UnsupportedCombinationError: the optimizer cannot use this transport
            (:func:`gefen_dist.check_capabilities`): its class (the Muon family), its
            parameters' layout, or ``capturable=True``; the message names the alternative.
        ValueError: an optimizer parameter that ``model`` does not contain, or duplicate names.
    """

    def __init__(self, model: nn.Module, optimizer: Gefen, *,
                 process_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(optimizer, Gefen):
            raise TypeError(
                f"GefenDCPState needs a gefen_core.Gefen (or gefen_dist.ShardedGefen), got "
                f"{type(optimizer).__qualname__}; other optimizers checkpoint through "
                "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict"
            )
        params = [p for g in optimizer.param_groups for p in g["params"]]
        # The layouts the parameters are in and the instance's options (capturable), checked
        # against this transport before anything is read or written.
        check_capabilities(optimizer, transport=Transport.DCP_RESHARD_EXACT)
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self._names: list[str] = []
        for g in optimizer.param_groups:
            for p, pname in zip(g["params"], g["param_names"]):
                if id(p) not in names:
                    raise ValueError(
                        f"GefenDCPState: optimizer parameter {pname!r} is not a parameter of "
                        "the given model; pass the module the optimizer was built from")
                self._names.append(names[id(p)])
        if len(set(self._names)) != len(self._names):
            raise ValueError("GefenDCPState: two optimizer parameters share a model name")
        self._params = params
        self._opt = optimizer
        group = process_group
        if group is None:
            group = getattr(optimizer, "_dist_group", None)
        self._group = group
        self._lazy_next = False
        self._lazy: dict[tuple[str, str], Callable[[], Tensor]] = {}
        self._converted: list[str] = []

    # ------------------------------------------------------------------ helpers
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and \
            dist.get_world_size(self._group) > 1

    def _world(self) -> int:
        return dist.get_world_size(self._group) if self._distributed() else 1

    def _load_period(self, p: Tensor, saved: int, search: int) -> int:
        """The period a load gives ``p``: the saved one wherever its blocks tile the local
        shards of this layout (so the state comes back bit for bit), else what the live
        optimizer would choose from the search result (docs/algorithm.md#resharding)."""
        shape = tuple(p.shape)
        world = p.device_mesh.size() if _is_dtensor(p) else 1
        if period_tiles(saved, shape, world):
            return saved
        return sharded_period(search or saved, shape, world)

    def _search_period_of(self, gi: int, i: int, period: int) -> int:
        periods = self._opt.param_groups[gi].get(SEARCH_PERIODS_KEY)
        if isinstance(periods, list) and i < len(periods) and periods[i]:
            return int(periods[i])
        return period

    def _factored(self, gi: int, p: Tensor) -> bool:
        """Whether the optimizer steps ``p`` with the factored second moment
        (docs/algorithm.md#factored-second-moment)."""
        return _core_dispatch.is_factored(
            p, self._opt.param_groups[gi],
            sharded=bool(getattr(self._opt, "_reduces_factored_stats", False)))

    def _wrap_rows(self, p: Tensor, local: Tensor) -> Tensor:
        """A per-row vector as a ``Shard(0)`` DTensor of ``[R]`` (plain for plain ``p``)."""
        if not _is_dtensor(p):
            return local
        return DTensor.from_local(local, p.device_mesh, p.placements,
                                  shape=torch.Size(p.shape[:1]), stride=(1,), run_check=False)

    def _wrap(self, p: Tensor, local: Tensor) -> Tensor:
        if not _is_dtensor(p):
            return local
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                                  stride=p.stride(), run_check=False)

    # ------------------------------------------------------------------ save
    def save_planner(self) -> GefenSavePlanner:
        """A save planner for the next ``dcp.save``/``dcp.async_save`` of this state.

        The next :meth:`state_dict` then returns zero-storage placeholders and snapshots the
        compact state to the CPU; the planner builds each dense tensor when the writer asks
        for it, so at most one parameter's dense form exists at a time.
        """
        self._lazy_next = True
        return GefenSavePlanner(self)

    def async_stager(self) -> GefenStager:
        """An ``AsyncStager`` for ``dcp.async_save`` that copies ordinary tensors to the CPU
        and keeps this state's placeholders (whose data is already a CPU snapshot).

        On more than one rank, also pass ``async_save`` a process group of its own
        (``process_group=dist.new_group(backend="gloo")``, made once on every rank): the
        save's background thread runs collectives while training steps, and a sharded
        optimizer's step runs its agreement collectives on the default group meanwhile; two
        threads sharing one gloo group can interleave differently per rank and hang until
        the collective timeout.

        Raises:
            RuntimeError: the installed torch's ``dcp.async_save`` has no ``async_stager``
                argument (torch 2.7, for one); use ``dcp.save`` (optionally with
                :meth:`save_planner`) there, or upgrade torch.
        """
        if not async_stager_supported():
            raise RuntimeError(
                f"GefenDCPState.async_stager() needs torch.distributed.checkpoint.async_save("
                f"..., async_stager=...), which torch {torch.__version__} lacks; use dcp.save "
                f"(with planner=state.save_planner() for a bounded peak) or upgrade torch"
            )
        return GefenStager(self)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint in its global layout (collective). See the module docstring.

        Raises:
            gefen_dist.CollectiveCheckError: on every rank, when a rank's state is malformed
                or the ranks' metadata differ (nothing is written by ``dcp.save``).
        """
        lazy, self._lazy_next = self._lazy_next, False
        opt = self._opt
        meta_slots: list[dict[str, Any]] = []
        with agreed("GefenDCPState.state_dict validation", group=self._group if
                    self._distributed() else None):
            codebook = opt._codebook
            if opt._device_global_step:
                # Graph replays and compiled steps advance only the step-count mirrors.
                opt._sync_global_step()
            for gi, g in enumerate(opt.param_groups):
                for i, (p, pname) in enumerate(zip(g["params"], g["param_names"])):
                    meta_slots.append(self._slot_meta(gi, i, p, pname))
            if codebook is not None and not bool(torch.isfinite(codebook).all()):
                raise ValueError("the codebook has non-finite entries")
        live_codebook = opt._codebook
        has_codebook = live_codebook is not None
        cb = (live_codebook.detach().to("cpu", torch.float32).clone()
              if live_codebook is not None else torch.zeros(256, dtype=torch.float32))
        groups = [self._group_hypers(g) for g in opt.param_groups]
        header = {"format_version": FORMAT_VERSION, "global_step": int(opt._global_step),
                  "deterministic": bool(opt._deterministic), "has_codebook": has_codebook,
                  "world_size": self._world(), "param_groups": groups}
        if self._distributed():
            self._agree_digest(header, meta_slots, cb)
        stats = self._matrix_stats(meta_slots)
        self._lazy = {}
        slots: dict[str, Any] = {}
        for name, p, meta, st in zip(self._names, self._params, meta_slots, stats):
            meta["name"] = name
            momentum, second = self._dense_pair(p, meta, cb, lazy, st)
            slots[name] = {
                "initialized": meta["initialized"], "factored": meta["factored"],
                "step": meta["step"], "exp_avg_sq_step": meta["exp_avg_sq_step"],
                "period": meta["period"], "search_period": meta["search_period"],
                "momentum": momentum, **second,
            }
        return {"header": header, "codebook": cb, "slots": slots}

    def _matrix_stats(self, metas: list[dict[str, Any]],
                      ) -> list[tuple[Tensor, Tensor, float] | None]:
        """``(row, col, inv_rbar)`` of every 2-D slot (``None`` for the others), from this
        rank's partial sums and one fp64 all-reduce over the ranks (collective when
        distributed: every rank lists the same slots in the same order, agreed above)."""
        parts: list[tuple[Tensor, Tensor] | None] = []
        for p, meta in zip(self._params, metas):
            if not meta["matrix"]:
                parts.append(None)
                continue
            parts.append(matrix_partials(meta["state"], meta["factored"], meta["period"],
                                         meta["local_shape"], int(p.shape[1])))
        # Only row shards hold part of a matrix; a plain parameter (one process, or a replica)
        # holds all of it.
        sharded = [i for i, (p, part) in enumerate(zip(self._params, parts))
                   if part is not None and _is_dtensor(p)]
        totals = {i: part[1] for i, part in enumerate(parts) if part is not None}
        if sharded and self._distributed():
            flat = torch.cat([totals[i] for i in sharded]).to(collective_device(self._group))
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._group)
            for i, t in zip(sharded, flat.cpu().split([totals[i].numel() for i in sharded])):
                totals[i] = t
        out: list[tuple[Tensor, Tensor, float] | None] = []
        for i, (p, meta, part) in enumerate(zip(self._params, metas, parts)):
            if part is None:
                out.append(None)
                continue
            out.append(matrix_stats(meta["state"], meta["factored"], part[0], totals[i],
                                    int(p.shape[0]), int(p.shape[1])))
        return out

    def _slot_meta(self, gi: int, i: int, p: Tensor, pname: str) -> dict[str, Any]:
        st = self._opt.state.get(p, {})
        keys = set(st)
        factored = self._factored(gi, p)
        second_keys = ("exp_avg_sq_row", "exp_avg_sq_col") if factored else ("exp_avg_sq",)
        other = {"exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col"} - set(second_keys)
        if keys & other:
            raise ValueError(
                f"parameter {pname!r} holds a {'per-block' if factored else 'factored'} second "
                f"moment but the optimizer steps it in "
                f"{'factored' if factored else 'block'} mode; step once before saving")
        full = {"period", "step", "exp_avg_codes", "exp_avg_scale", *second_keys}
        initialized = "exp_avg_codes" in keys
        if initialized and not full <= keys:
            raise ValueError(f"parameter {pname!r} has a partial state {sorted(keys)}")
        local = _local(p)
        if not initialized:
            return {"initialized": False, "step": 0, "exp_avg_sq_step": 0,
                    "period": int(st.get("period", 0)),
                    "search_period": self._search_period_of(gi, i, int(st.get("period", 0))),
                    "state": None, "local_shape": tuple(local.shape), "factored": factored,
                    "matrix": p.ndim == 2}
        period = int(st["period"])
        codes, scale = st["exp_avg_codes"], st["exp_avg_scale"]
        blocks = local.numel() // period if period else -1
        if local.numel() % period or tuple(codes.shape) != (blocks, period) \
                or codes.dtype != torch.uint8:
            raise ValueError(f"parameter {pname!r}: exp_avg_codes {tuple(codes.shape)} does not "
                             f"match {local.numel()} local elements in blocks of {period}")
        shapes: dict[str, tuple[int, ...]] = {"exp_avg_scale": (blocks, 1),
                                              "exp_avg_sq": (blocks, 1)}
        if factored:
            shapes.update(exp_avg_sq_row=tuple(local.shape[:1]), exp_avg_sq_col=(p.shape[1],))
        for key in ("exp_avg_scale", *second_keys):
            t = st[key]
            if tuple(t.shape) != shapes[key] or t.dtype != torch.float32:
                raise ValueError(f"parameter {pname!r}: {key} must be fp32 {list(shapes[key])}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"parameter {pname!r}: {key} has non-finite values")
            if t.device != codes.device:
                raise ValueError(f"parameter {pname!r}: state tensors on different devices")
        step = int(float(st["step"]))
        sq_step = int(float(st.get("exp_avg_sq_step", step)))
        return {"initialized": True, "step": step, "exp_avg_sq_step": sq_step,
                "period": period, "search_period": self._search_period_of(gi, i, period),
                "state": (codes, scale, *(st[k] for k in second_keys)),
                "local_shape": tuple(local.shape), "factored": factored, "matrix": p.ndim == 2}

    @staticmethod
    def _group_hypers(g: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in _GROUP_HYPERS:
            if key not in g:
                continue
            v = g[key]
            if isinstance(v, Tensor):
                v = float(v.detach().reshape(()).item())
            elif isinstance(v, tuple):
                v = list(v)
            out[key] = v
        out["param_names"] = list(g["param_names"])
        return out

    def _agree_digest(self, header: dict[str, Any], slots: list[dict[str, Any]],
                      codebook: Tensor) -> None:
        h = hashlib.blake2b(digest_size=8)
        h.update(repr(sorted((k, v) for k, v in header.items() if k != "param_groups"))
                 .encode())
        h.update(repr(header["param_groups"]).encode())
        h.update(repr(self._names).encode())
        for s in slots:
            h.update(repr((s["initialized"], s["step"], s["exp_avg_sq_step"], s["period"],
                           s["search_period"], s["factored"])).encode())
        h.update(codebook.numpy().tobytes())
        value = int.from_bytes(h.digest(), "little", signed=True)
        t = torch.tensor([value, -value], dtype=torch.int64,
                         device=collective_device(self._group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        error = None
        if int(t[0]) != value or -int(t[1]) != value:
            error = ValueError(
                "ranks hold different optimizer metadata (names, counters, periods, codebook or "
                "hyperparameters); every rank must checkpoint the same optimizer")
        with agreed("GefenDCPState.state_dict metadata agreement", group=self._group):
            if error is not None:
                raise error

    def _dense_pair(self, p: Tensor, meta: dict[str, Any], codebook: Tensor, lazy: bool,
                    stats: tuple[Tensor, Tensor, float] | None,
                    ) -> tuple[Tensor, dict[str, Tensor]]:
        """One slot's dense momentum and its second-moment entries (:mod:`gefen_dist._dense`):
        ``exp_avg_sq`` like the parameter, plus ``exp_avg_sq_row``/``exp_avg_sq_col`` for a
        matrix. With ``lazy`` the dense tensors are zero-storage placeholders on the meta
        device, built from CPU snapshots taken now when the planner asks for them."""
        shape = meta["local_shape"]
        local = _local(p)
        state = meta["state"]
        dev = torch.device("cpu") if lazy else local.device
        second: dict[str, Tensor] = {}
        if stats is not None:
            row, col, inv_rbar = stats
            # Copies: a save must not alias live state (training may continue during a write).
            row = row.detach().to(dev, torch.float32, copy=True)
            col = col.detach().to(dev, torch.float32, copy=True)
            second["exp_avg_sq_row"] = self._wrap_rows(p, row)
            second["exp_avg_sq_col"] = col
        if state is None:
            def make_m() -> Tensor:
                return torch.zeros(shape, dtype=torch.float32, device=dev)
            make_v = make_m
        else:
            codes, scale = state[0], state[1]
            if lazy:
                codes, scale = (t.detach().to("cpu", copy=True) for t in (codes, scale))

            def make_m() -> Tensor:
                return dense_momentum(codes, scale, codebook, shape)

            if meta["factored"]:
                assert stats is not None

                def make_v() -> Tensor:
                    return factored_dense(row, col, inv_rbar).reshape(shape)
            else:
                sq = state[2].detach().to("cpu", copy=True) if lazy else state[2]
                period = meta["period"]

                def make_v() -> Tensor:
                    return dense_block_values(sq, period, shape)
        if not lazy:
            second["exp_avg_sq"] = self._wrap(p, make_v())
            return self._wrap(p, make_m()), second
        # Placeholders on the meta device: a planner that does not know them fails loudly
        # instead of writing garbage.
        name = meta["name"]
        self._lazy[(name, "momentum")] = make_m
        self._lazy[(name, "exp_avg_sq")] = make_v
        second["exp_avg_sq"] = self._wrap(p, torch.empty(shape, dtype=torch.float32,
                                                          device="meta"))
        return self._wrap(p, torch.empty(shape, dtype=torch.float32, device="meta")), second

    # ------------------------------------------------------------------ load
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Validate on every rank, agree, re-block, stage through gefen-core, then commit.

        Raises:
            gefen_dist.CollectiveCheckError: on every rank, with nothing changed, when any
                rank finds the checkpoint malformed or incompatible (names, shapes, format,
                counters, codebook, hyperparameters).
        """
        from gefen_core.checkpoint import commit, stage_load

        staged = None
        search: list[list[int]] = []
        lrs: list[Any] = []
        group = self._group if self._distributed() else None
        with agreed("GefenDCPState.load_state_dict validation", group=group):
            native, search, lrs = self._build_native(state_dict)
            staged = stage_load(self._opt, native)
            narrow_staged_rows(staged.state)
        assert staged is not None
        live_lrs = [g["lr"] for g in self._opt.param_groups]
        commit(self._opt, staged)
        for g, periods, live_lr, lr in zip(self._opt.param_groups, search, live_lrs, lrs):
            g[SEARCH_PERIODS_KEY] = periods
            if isinstance(live_lr, Tensor):
                # Keep the caller's tensor (schedulers hold it): fill it in place.
                live_lr.fill_(lr)
                g["lr"] = live_lr
        if self._converted:
            import warnings

            warnings.warn(
                f"GefenDCPState: the second moment of {len(self._converted)} matrix "
                f"parameter(s) (e.g. {self._converted[:3]}) was saved in the other form "
                "(factored row/column statistics vs per-block values) and was converted: an "
                "approximation of the saved state, not a bit-exact resume "
                "(docs/checkpoints.md)", RuntimeWarning, stacklevel=2)

    def _build_native(self, sd: dict[str, Any]) -> tuple[dict[str, Any], list[list[int]],
                                                          list[Any]]:
        opt = self._opt
        if not isinstance(sd, dict) or not {"header", "codebook", "slots"} <= set(sd):
            raise ValueError("not a GefenDCPState checkpoint (needs header, codebook, slots)")
        header, cb, slots = sd["header"], sd["codebook"], sd["slots"]
        if not isinstance(header, dict) or header.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"unsupported format_version {header.get('format_version')!r} "
                             f"(this gefen-dist reads {FORMAT_VERSION})")
        if bool(header.get("deterministic")) != bool(opt._deterministic):
            raise ValueError(
                f"saved with deterministic={header.get('deterministic')}, the optimizer has "
                f"deterministic={opt._deterministic}; construct it with the saved value")
        groups = header.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
            count = len(groups) if isinstance(groups, list) else "?"
            raise ValueError(f"the checkpoint has {count} param groups, the optimizer "
                             f"{len(opt.param_groups)}")
        has_codebook = bool(header.get("has_codebook"))
        codebook = _local(cb).detach().to("cpu") if isinstance(cb, Tensor) else None
        if has_codebook:
            from gefen_core.checkpoint import check_codebook

            check_codebook(codebook)
        from gefen_core.checkpoint import build_state_dict

        live_sd = build_state_dict(opt)
        new_groups, search_lists, lrs = [], [], []
        for gi, (saved, live) in enumerate(zip(groups, live_sd["param_groups"])):
            if list(saved.get("param_names", [])) != list(live["param_names"]):
                raise ValueError(f"param group {gi} lists other parameters than the optimizer")
            g = dict(live)
            for key in _GROUP_HYPERS:
                if key in saved:
                    g[key] = tuple(saved[key]) if key in ("betas", "period_one_substrings") \
                        else saved[key]
            lrs.append(g["lr"])
            g.pop(SEARCH_PERIODS_KEY, None)
            new_groups.append(g)
        meta = {"format_version": 1, "global_step": int(header["global_step"]),
                "codebook": codebook.clone() if has_codebook and codebook is not None else None,
                "deterministic": bool(opt._deterministic)}
        for g in new_groups:
            g["gefen_meta"] = dict(meta)
        state: dict[int, dict[str, Any]] = {}
        self._converted = []
        index = 0
        for gi, g in enumerate(opt.param_groups):
            periods = []
            for p in g["params"]:
                name = self._names[index]
                slot = slots.get(name) if isinstance(slots, dict) else None
                if not isinstance(slot, dict):
                    raise ValueError(f"the checkpoint has no entry for parameter {name!r}")
                entry, search, converted = self._restore_slot(
                    p, name, slot, codebook, has_codebook, factored=self._factored(gi, p))
                if converted:
                    self._converted.append(name)
                periods.append(search)
                if entry:
                    state[index] = entry
                index += 1
            search_lists.append(periods)
        return ({"state": state, "param_groups": new_groups, "gefen_meta": meta},
                search_lists, lrs)

    def _restore_slot(self, p: Tensor, name: str, slot: dict[str, Any],
                      codebook: Tensor | None, has_codebook: bool, *, factored: bool = False,
                      ) -> tuple[dict[str, Any], int, bool]:
        """One slot's native state entry for this rank, its search period, and whether its
        second moment was converted between the factored and per-block forms."""
        local = _local(p)
        shape = tuple(local.shape)
        matrix = p.ndim == 2
        keys = ("momentum", "exp_avg_sq") + (
            ("exp_avg_sq_row", "exp_avg_sq_col") if matrix else ())
        raw = [slot.get(k) for k in keys]
        if not all(isinstance(v, Tensor) for v in raw):
            raise ValueError(f"{name!r}: {', '.join(keys)} must be tensors")
        tensors = {k: _local(v) for k, v in zip(keys, raw) if isinstance(v, Tensor)}
        want = {"momentum": shape, "exp_avg_sq": shape, "exp_avg_sq_row": shape[:1],
                "exp_avg_sq_col": tuple(p.shape[1:2])}
        for key, t in tensors.items():
            if tuple(t.shape) != want[key]:
                raise ValueError(f"{name!r}: saved {key} has shape {tuple(t.shape)}, the local "
                                 f"shape is {want[key]}")
            if t.dtype != torch.float32:
                raise ValueError(f"{name!r}: {key} must be fp32, got {t.dtype}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name!r}: non-finite values in the dense state ({key})")
            if key != "momentum" and bool((t < 0).any()):
                raise ValueError(f"{name!r}: negative second moment ({key})")
        saved_factored = slot.get("factored")
        if not isinstance(saved_factored, bool):
            raise ValueError(f"{name!r}: factored must be a bool, got {saved_factored!r}")
        ints = {}
        for key in ("step", "exp_avg_sq_step", "period", "search_period"):
            val = slot.get(key)
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"{name!r}: {key} must be an int >= 0, got {val!r}")
            ints[key] = val
        numel = math.prod(p.shape)
        search = ints["search_period"]
        for key in ("search_period", "period"):
            if ints[key] and numel % ints[key]:
                raise ValueError(f"{name!r}: {key} {ints[key]} does not divide {numel}")
        if not slot.get("initialized"):
            if ints["step"] or any(bool(t.any()) for t in tensors.values()):
                raise ValueError(f"{name!r}: uninitialized slot with non-zero state")
            return {}, search, False
        if ints["step"] < 1 or ints["exp_avg_sq_step"] < 1 or ints["period"] < 1:
            raise ValueError(f"{name!r}: an initialized slot needs step, exp_avg_sq_step and "
                             "period >= 1")
        if not has_codebook:
            raise ValueError(f"{name!r} has momentum but the checkpoint has no codebook")
        assert codebook is not None
        period = self._load_period(p, ints["period"], search)
        dev = local.device
        codes, scale, sq = reblock(tensors["momentum"].to(dev), tensors["exp_avg_sq"].to(dev),
                                   period, codebook)
        entry = {"period": period, "step": torch.tensor(float(ints["step"])),
                 "exp_avg_sq_step": torch.tensor(float(ints["exp_avg_sq_step"])),
                 "exp_avg_codes": codes, "exp_avg_scale": scale}
        if factored:
            # r and k are functions of the global matrix: restored exactly on any topology.
            entry["exp_avg_sq_row"] = rows_for_staging(
                p, tensors["exp_avg_sq_row"].to(dev).clone())
            entry["exp_avg_sq_col"] = tensors["exp_avg_sq_col"].to(dev).clone()
        else:
            entry["exp_avg_sq"] = sq
        return entry, search or ints["period"], matrix and saved_factored != factored


class GefenSavePlanner(DefaultSavePlanner):
    """Save planner that expands one Gefen parameter at a time, when the writer asks for it.

    Get it from :meth:`GefenDCPState.save_planner` (which also makes the next
    ``state_dict()`` return placeholders). Everything else is the default planner's behaviour;
    ``flatten_state_dict`` must stay ``True``.

    Raises:
        ValueError: ``flatten_state_dict=False``.
    """

    def __init__(self, *states: GefenDCPState, **kwargs: Any) -> None:
        if kwargs.get("flatten_state_dict") is False:
            raise ValueError("GefenSavePlanner needs flatten_state_dict=True")
        super().__init__(**kwargs)
        self._states = states
        self._lazy_fqns: dict[str, Callable[[], Tensor]] = {}
        self.max_materialized_bytes = 0

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        for fqn, value in self.state_dict.items():
            if not isinstance(value, Tensor) or not _local(value).is_meta:
                continue
            path = self.mappings.get(fqn, ())
            if len(path) < 3 or path[-3] != "slots":
                continue
            key = (str(path[-2]), str(path[-1]))
            found = [st._lazy[key] for st in self._states if key in st._lazy]
            if len(found) > 1:
                raise ValueError(f"two GefenDCPState objects both hold {path[-2]!r}; save "
                                 "them under one planner only if their names differ")
            if found:
                self._lazy_fqns[fqn] = found[0]

    def resolve_data(self, write_item: Any) -> Any:
        fn = self._lazy_fqns.get(write_item.index.fqn)
        if fn is None:
            return super().resolve_data(write_item)
        tensor = fn()
        self.max_materialized_bytes = max(self.max_materialized_bytes,
                                          tensor.numel() * tensor.element_size())
        return tensor


def async_stager_supported() -> bool:
    """Whether the installed ``dcp.async_save`` accepts ``async_stager=`` (torch 2.7 does
    not), which :meth:`GefenDCPState.async_stager` needs."""
    import inspect

    from torch.distributed.checkpoint import async_save

    return "async_stager" in inspect.signature(async_save).parameters


class GefenStager:
    """``AsyncStager`` for ``dcp.async_save``: snapshots ordinary tensors to the CPU and passes
    :class:`GefenDCPState` placeholders through (their data is already a CPU snapshot), so
    staging never allocates the dense optimizer state.

    Use with ``async_save(..., planner=state.save_planner(), async_stager=state.async_stager())``.
    """

    _synchronize_after_execute: bool = False

    def __init__(self, *states: GefenDCPState) -> None:
        self._states = states

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    @staticmethod
    def _is_placeholder(t: Tensor) -> bool:
        # Only GefenDCPState puts meta tensors in a state dict to be saved.
        return _local(t).is_meta

    def _copy(self, obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: self._copy(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._copy(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self._copy(v) for v in obj)
        if isinstance(obj, Tensor):
            if self._is_placeholder(obj):
                return obj
            if _is_dtensor(obj):
                        return DTensor.from_local(obj.to_local().detach().to("cpu", copy=True),
                                          obj.device_mesh, obj.placements, shape=obj.shape,
                                          stride=obj.stride(), run_check=False)
            return obj.detach().to("cpu", copy=True)
        return obj

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._copy(state_dict)

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """Nothing to release."""
