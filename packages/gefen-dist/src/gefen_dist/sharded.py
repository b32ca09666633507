"""``ShardedGefen``: Gefen on FSDP2 (DTensor ``Shard(0)``) with a topology-free state.

Plain :class:`gefen_core.Gefen` steps a DTensor parameter on its local shard and would learn
the codebook and each block period from that rank's shard alone, so the optimizer state
would depend on the world size (docs/algorithm.md#distributed). :class:`ShardedGefen` takes the
same arguments plus ``distributed_mesh`` and makes both functions of the *global* tensor
(docs/algorithm.md#distributed):

* **Period.** On the first step a parameter has a gradient, every rank all-gathers that
  gradient once (``DTensor.full_tensor()``) and runs Gefen's own gates and period search
  (docs/algorithm.md#period-search) on the full tensor with the global shape, exactly as a
  single process would. The result ``P`` is then refined by :func:`sharded_period`: blocks
  must not straddle a boundary of the live layout's shards (``Shard(0)`` shards start at
  multiples of ``ceil(R / W) * row_numel`` elements, DTensor's ``torch.chunk`` rule), and they
  also tile the shards of 2, 4 and 8 ranks as long as blocks of at least 8 elements allow it,
  so a checkpoint moves between those world sizes without re-blocking
  (docs/algorithm.md#resharding). When ``P`` already tiles all of them (every period that
  divides ``ceil(R / 8) * row_numel``) the stored period is the single-process period;
  otherwise the blocks are a refinement of the single-process blocks (``docs/checkpoints.md``
  lists which tensors). The unrefined search result is kept in :attr:`search_periods`.
* **Codebook.** Each rank bins its local shards with the aligned periods; the integer
  histograms are summed by one all-reduce (exact in any order), so every rank learns the same
  codebook, identical to a single-process run that uses the same periods.

Every collective is entered by every rank in the same order. Before the first one of a step,
the ranks agree on which parameters have a gradient (:func:`gefen_dist._agree.check_grad_presence`);
on a step that learns the codebook or searches a period they also agree on whether every
gradient is finite (Gefen's first-step rule), and with ``skip_nonfinite=True`` they agree on it
on every step, first of all (one all-reduce), so a non-finite gradient on any rank skips the
step on every rank (docs/algorithm.md#non-finite-gradients). A rank-local problem thus becomes
the same error (or the same skipped step) on every rank instead of a hang.

* **Factored second moment** (``factored_v_2d=True``, docs/algorithm.md#factored-second-moment), for
  matrices whose global sides are both at least ``min_dim_size_to_factor`` (default 128,
  docs/algorithm.md#factoring-rule; smaller ones keep the per-block second moment, as in ``Gefen``).
  A ``Shard(0)`` rank holds whole rows, so its row statistics ``r`` are complete locally, while the
  column sums of ``g^2`` and ``sum(r')`` (for ``rbar``) are sums over every rank's rows. gefen-core
  computes each rank's part (:meth:`gefen_core.Gefen._factored_statistics`, mutating nothing); this
  class sums them with **one fp32 all-reduce per step** for all factored parameters (a bucket of ``C
  + 1`` values each, ranks with an empty shard adding zeros), so ``k`` and ``rbar`` are those of the
  global matrix and ``k`` is identical on every rank; ``r`` stays local to the rank's rows.
  A failure while a rank computes its part is folded into the same all-reduce and becomes the
  same :class:`gefen_dist.CollectiveCheckError` on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from gefen_core import Gefen
from gefen_core import dispatch as _core_dispatch
from gefen_core.nonfinite import all_finite

from ._agree import agree, agreed, check_grad_presence, collective_device
from .capabilities import SHARDED_GEFEN_CAPABILITIES, Capabilities

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["SEARCH_PERIODS_KEY", "ShardedGefen", "aligned_period", "period_tiles", "shard_unit",
           "sharded_period"]

SEARCH_PERIODS_KEY = "search_periods"
"""Group key: list parallel to ``params`` of unaligned search periods (0 = not searched)."""


def _is_dtensor(t: object) -> TypeIs[DTensor]:
    return isinstance(t, DTensor)


def shard_unit(global_shape: tuple[int, ...], world_size: int) -> int:
    """Elements in one full ``Shard(0)`` chunk: ``ceil(R / W) * prod(shape[1:])``.

    Every shard of a ``Shard(0)`` DTensor starts at a multiple of this many flat elements
    (``torch.chunk`` rule used by DTensor and FSDP2), and every shard's numel is either this
    or what remains of the tensor.

    Raises:
        ValueError: a 0-dim shape or ``world_size < 1``.
    """
    if not global_shape:
        raise ValueError("a Shard(0) parameter has at least one dimension")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    rows = global_shape[0]
    row_numel = math.prod(global_shape[1:])
    return -(-rows // world_size) * row_numel


def aligned_period(period: int, global_shape: tuple[int, ...], world_size: int) -> int:
    """The largest divisor of ``period`` whose blocks never straddle a ``Shard(0)`` boundary.

    ``gcd(period, shard_unit(global_shape, world_size))`` (or ``period`` itself for an empty
    tensor). Blocks of the result nest inside blocks of ``period``. Pure function: the same
    on every rank and for a checkpoint being re-aligned to another world size.
    """
    unit = shard_unit(global_shape, world_size)
    return period if unit == 0 else math.gcd(period, unit)


PORTABLE_WORLD_SIZES = (2, 4, 8)
"""World sizes whose ``Shard(0)`` chunks ShardedGefen's blocks also tile when the tensor allows
it (:func:`sharded_period`), so checkpoints move between them without re-blocking."""

MIN_PORTABLE_PERIOD = 8
"""Blocks are never refined below this many elements to tile another world size."""


def sharded_period(period: int, global_shape: tuple[int, ...], world_size: int) -> int:
    """The period ShardedGefen uses for a parameter whose single-process period is ``period``.

    ``P_W = aligned_period(period, shape, world_size)`` (blocks never straddle a shard of the
    live layout), then refined for each of :data:`PORTABLE_WORLD_SIZES` in turn (2, 4, 8):
    ``aligned_period(P_W, shape, V)`` is taken when it leaves ``P_W`` unchanged or keeps
    blocks of at least :data:`MIN_PORTABLE_PERIOD` elements; the first world size that would
    need smaller blocks ends the refinement. The result's blocks nest inside ``period``'s and
    tile the shards of ``world_size`` ranks and of 1, 2, 4 and 8 ranks up to that point, so a
    checkpoint written on any of them is loaded with its own period
    (docs/algorithm.md#resharding). Pure: the same on every rank.

    Examples: a 64-element norm whose single-process period is 64 gets 8 on any of 1, 2, 4
    or 8 ranks; a ``[256, 64]`` matrix with ``period = 64`` keeps 64; a 100-element bias with
    ``period = 100`` gets 25 (tiles 1, 2 and 4 ranks; 8 ranks would need blocks of 1).
    """
    out = aligned_period(period, global_shape, world_size)
    for world in PORTABLE_WORLD_SIZES:
        finer = aligned_period(out, global_shape, world)
        if finer != out and finer < MIN_PORTABLE_PERIOD:
            break
        out = finer
    return out


def period_tiles(period: int, global_shape: tuple[int, ...], world_size: int) -> bool:
    """Whether blocks of ``period`` elements tile every ``Shard(0)`` shard on ``world_size``
    ranks (none straddles a shard boundary), i.e. whether a load may keep this period."""
    numel = math.prod(global_shape)
    if period < 1 or (numel and numel % period):
        return False
    return aligned_period(period, global_shape, world_size) == period


def _mesh_of(distributed_mesh: Any) -> Any:
    if distributed_mesh is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(distributed_mesh, DeviceMesh):
        if distributed_mesh.ndim != 1:
            raise ValueError(
                f"ShardedGefen: distributed_mesh must be 1-D, got a {distributed_mesh.ndim}-D "
                "mesh; for HSDP pass the mesh FSDP2 shards over (mesh['shard'])"
            )
        return distributed_mesh.get_group()
    if isinstance(distributed_mesh, dist.ProcessGroup):
        return distributed_mesh
    raise TypeError(
        "ShardedGefen: distributed_mesh must be a DeviceMesh, a ProcessGroup or None, got "
        f"{type(distributed_mesh).__name__}"
    )


class ShardedGefen(Gefen):
    """:class:`gefen_core.Gefen` whose codebook and block periods are those of the global
    tensors, for FSDP2 (``fully_shard``) and other ``Shard(0)`` DTensor parameters.

    Use it exactly like ``Gefen`` after ``fully_shard(model)``::

        fully_shard(model)                       # parameters become Shard(0) DTensors
        opt = ShardedGefen(model.named_parameters(), lr=1e-3)

    Args:
        params, lr, betas, eps, weight_decay, and every keyword of ``Gefen``: unchanged.
        distributed_mesh (DeviceMesh | ProcessGroup | None, keyword-only): the 1-D mesh (or
            its group) the parameters are sharded over. ``None`` (default) takes the mesh of
            the DTensor parameters, or the default process group when there are none.

        skip_nonfinite (bool, keyword-only): as ``Gefen``; the ranks agree (one all-reduce,
            before any other collective of the step) so a NaN or Inf in any rank's gradient
            shard skips the step on every rank (docs/algorithm.md#non-finite-gradients).

    Every rank must call :meth:`step` (it is collective on the steps that search a period,
    learn or refresh the codebook, on every step that updates a factored 2-D parameter:
    one all-reduce of the column statistics, see the module docstring, and on every step with
    ``skip_nonfinite=True``). Plain (replicated)
    parameters are allowed only when no parameter is a DTensor, because a replicated
    gradient's histogram would otherwise be counted once per rank.

    Raises:
        ValueError: a DTensor parameter whose placements are not exactly ``(Shard(0),)``,
            DTensor parameters on different meshes, a mix of DTensor and plain parameters, a
            mesh that is not 1-D, and every ``Gefen`` constructor error.
        TypeError: ``distributed_mesh`` of another type.
        gefen_dist.CollectiveCheckError: in :meth:`step`, on every rank, when ranks disagree on
            which parameters have gradients or a rank-local check fails.
    """

    gefen_capabilities: Capabilities = SHARDED_GEFEN_CAPABILITIES
    _reduces_factored_stats = True
    _sharded_alternative = None

    def __init__(self, params: Any, *args: Any, distributed_mesh: Any = None,
                 **kwargs: Any) -> None:
        group = _mesh_of(distributed_mesh)
        super().__init__(params, *args, **kwargs)
        self._check_layout()
        meshes = {id(p.device_mesh): p.device_mesh for _, p, _ in self._named_params()
                  if _is_dtensor(p)}
        if group is None and meshes:
            group = next(iter(meshes.values())).get_group()
        self._dist_group = group
        self._agreed_finite: bool | None = None
        for g in self.param_groups:
            g.setdefault(SEARCH_PERIODS_KEY, [0] * len(g["params"]))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``Gefen.add_param_group``; also starts the group's ``search_periods`` list."""
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        if len(g.get(SEARCH_PERIODS_KEY, ())) != len(g["params"]):
            g[SEARCH_PERIODS_KEY] = [0] * len(g["params"])

    @property
    def search_periods(self) -> dict[str, int]:
        """``{name: P}``: the unaligned single-process period-search result of every parameter
        searched so far (0 = not yet). Kept in each group's ``search_periods`` list (parallel to
        ``params``) so native checkpoints carry it."""
        out = {}
        for g in self.param_groups:
            for name, period in zip(g["param_names"], g.get(SEARCH_PERIODS_KEY, ())):
                if period:
                    out[name] = int(period)
        return out

    # ------------------------------------------------------------------ setup checks
    def _check_layout(self) -> None:
        from torch.distributed.tensor import Shard

        kinds = set()
        mesh = None
        for _, p, name in self._named_params():
            if not _is_dtensor(p):
                kinds.add("plain")
                continue
            kinds.add("dtensor")
            if tuple(p.placements) != (Shard(0),):
                raise ValueError(
                    f"ShardedGefen: parameter {name!r} has placements {tuple(p.placements)}; "
                    "only (Shard(0),) on a 1-D mesh is supported (fully_shard's default)"
                )
            if mesh is None:
                mesh = p.device_mesh
            elif p.device_mesh != mesh:
                raise ValueError(
                    f"ShardedGefen: parameter {name!r} is on another device mesh than the "
                    "first DTensor parameter; use one optimizer per mesh"
                )
        if kinds == {"plain", "dtensor"}:
            raise ValueError(
                "ShardedGefen: mixes DTensor and plain parameters; shard every parameter with "
                "fully_shard (e.g. call fully_shard on the root module too), or give the "
                "replicated ones to a separate gefen_core.Gefen"
            )

    # ------------------------------------------------------------------ helpers
    def _world(self) -> int:
        if not dist.is_available() or not dist.is_initialized():
            return 1
        return dist.get_world_size(self._dist_group)

    def _entries(self) -> list[tuple[dict[str, Any], int, Tensor, str]]:
        return [(g, i, p, n) for g in self.param_groups
                for i, (p, n) in enumerate(zip(g["params"], g["param_names"]))]

    # ------------------------------------------------------------------ Gefen hooks
    def _reduce_histogram(self, counts: Tensor) -> Tensor:
        """Sum the int64 ``[4097]`` histogram (the bins and the zero bin) over ranks (exact:
        integer addition), so every rank learns the same codebook, zero codeword included."""
        if self._world() == 1 or not self._has_dtensors():
            return counts
        buf = counts.to(device=collective_device(self._dist_group), dtype=torch.int64)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self._dist_group)
        return buf.to(counts.device)

    def _all_finite(self, grads: list[Tensor]) -> bool:  # type: ignore[override]
        # During a collective step the verdict was agreed over every rank's gradients.
        if self._agreed_finite is not None:
            return self._agreed_finite
        return all(bool(torch.isfinite(_local(g)).all()) for g in grads)

    def _select_periods(self, items: Sequence[tuple[Tensor, Tensor, str, dict[str, Any]]],
                        ) -> list[int]:
        """Gefen's gates and search on the full gradients; records each result in
        ``search_periods`` and returns the periods a DTensor's state uses
        (:func:`sharded_period`, on any number of ranks, one included)."""
        periods = super()._select_periods(items)
        out = []
        for (param, _, _, group), period in zip(items, periods):
            for i, q in enumerate(group["params"]):
                if q is param:
                    group[SEARCH_PERIODS_KEY][i] = int(period)
                    break
            if _is_dtensor(param):
                period = sharded_period(int(period), tuple(param.shape), self._world())
            out.append(period)
        return out

    def _factored_statistics(
        self, entries: list[tuple[Tensor, Tensor, Tensor, Tensor, float, bool]],
    ) -> list[Tensor]:
        """gefen-core's per-rank statistics, then one all-reduce that sums their global part.

        Collective when DTensor parameters are present on more than one rank: every rank
        enters it once per step (gefen-core calls it even when this rank steps no factored
        parameter). The bucket lists, in step order, every factored DTensor parameter that has
        a gradient (identical on every rank: presence was agreed in the prologue); a rank adds
        its ``[C + 1]`` sums for the ones it stepped and zeros for the others (empty shards).
        fp32 bucket (fp64 parameters: a second fp64 bucket), one trailing error flag.

        Raises:
            gefen_dist.CollectiveCheckError: on every rank, when computing or checking the
                statistics failed on any rank (nothing has been updated yet).
        """
        if not (self._world() > 1 and self._has_dtensors()):
            return super()._factored_statistics(entries)
        canonical = [(g, i, p) for g, i, p, _ in self._entries() if _is_dtensor(p)
                     and p.grad is not None and _core_dispatch.is_factored(p, g, sharded=True)]
        if not canonical:
            if entries:
                raise RuntimeError("ShardedGefen: factored statistics requested for parameters "
                                   "without gradients")
            return []
        error: BaseException | None = None
        stats: list[Tensor] = []
        try:
            stats = super()._factored_statistics(entries)
            self._check_factored_entries(canonical, entries)
        except Exception as exc:  # noqa: BLE001 - agreed below, then raised on every rank
            error = exc
        mine = {id(e[0]): st for e, st in zip(entries, stats)} if error is None else {}
        dev = collective_device(self._dist_group)
        sizes = [int(p.shape[1]) + 1 for _, _, p in canonical]
        wide = [_local(p).dtype == torch.float64 for _, _, p in canonical]
        buckets = {
            torch.float32: torch.zeros(sum(n for n, w in zip(sizes, wide) if not w) + 1,
                                       dtype=torch.float32, device=dev),
            torch.float64: torch.zeros(sum(n for n, w in zip(sizes, wide) if w),
                                       dtype=torch.float64, device=dev),
        }
        slots: list[tuple[Tensor, int, int]] = []
        offsets = {torch.float32: 0, torch.float64: 0}
        for (_, _, p), n, w in zip(canonical, sizes, wide):
            dtype = torch.float64 if w else torch.float32
            slots.append((buckets[dtype], offsets[dtype], n))
            st = mine.get(id(p))
            if st is not None:
                rows = _local(p).shape[0]
                buckets[dtype][offsets[dtype]:offsets[dtype] + n].copy_(st[rows:])
            offsets[dtype] += n
        buckets[torch.float32][-1] = 0.0 if error is None else 1.0
        for bucket in buckets.values():
            if bucket.numel():
                dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=self._dist_group)
        if float(buckets[torch.float32][-1]) > 0:
            agree(error, "ShardedGefen factored statistics", group=self._dist_group)
        for (g, i, p), (bucket, off, n) in zip(canonical, slots):
            total = bucket[off:off + n]
            st = mine.get(id(p))
            if st is not None:
                st[_local(p).shape[0]:].copy_(total)
            elif _local(p).numel() == 0 and g[SEARCH_PERIODS_KEY][i]:
                self._finalize_empty_shard(g, p, total)
        return stats

    def _check_factored_entries(self, canonical: list[tuple[dict[str, Any], int, DTensor]],
                                entries: list[tuple[Any, ...]]) -> None:
        listed = {id(p) for _, _, p in canonical}
        stepped = {id(e[0]) for e in entries}
        for g, i, p in canonical:
            if _local(p).numel() and g[SEARCH_PERIODS_KEY][i] and id(p) not in stepped:
                name = g["param_names"][i]
                raise RuntimeError(f"parameter {name!r} has a period but was not stepped on "
                                   "this rank, so its column statistics would miss these rows")
        if not stepped <= listed:
            raise RuntimeError("a factored parameter without a gradient was stepped")

    def _finalize_empty_shard(self, group: dict[str, Any], p: Tensor, total: Tensor) -> None:
        """Keep ``k`` of an empty local shard equal to its peers' (checkpoints replicate it)."""
        from gefen_kernels.ops.factored_step import factored_finalize_stats

        local = _local(p)
        state = self.state[p]
        if "exp_avg_sq_col" not in state:
            state["exp_avg_sq_row"] = torch.zeros(0, dtype=torch.float32, device=local.device)
            state["exp_avg_sq_col"] = torch.zeros(p.shape[1], dtype=torch.float32,
                                                  device=local.device)
        path = _core_dispatch.choose_path(p, group, deterministic=self._deterministic,
                                          sharded_factored=True)
        factored_finalize_stats(state["exp_avg_sq_row"], state["exp_avg_sq_col"],
                                total.to(local.device), beta2=group["betas"][1],
                                global_rows=int(p.shape[0]), reference=path != "fused")

    def _has_dtensors(self) -> bool:
        return any(_is_dtensor(p) for _, p, _ in self._named_params())

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Gefen step; collective on steps that search periods or (re)learn the codebook,
        and (one fp32 all-reduce) on every step that updates factored 2-D parameters.

        Order: the closure; agreement on gradient presence and finiteness; the global period
        of every parameter that gets its first gradient (one all-gather each); then
        ``Gefen.step``, whose codebook histogram is all-reduced.

        Raises:
            gefen_dist.CollectiveCheckError: on every rank, see the class docstring.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        collective = self._world() > 1 and self._has_dtensors()
        before = self._global_step
        try:
            if collective and self._skip_nonfinite:
                # Before any other collective: every rank skips, or none does.
                self._agree_finite([p for _, _, p, _ in self._entries() if p.grad is not None])
                if not self._agreed_finite:
                    self._record_skipped_step()
                    return loss
            if collective:
                self._collective_prologue()
            super().step()
        finally:
            self._agreed_finite = None
        if collective and self._global_step != before:
            self._mirror_empty_shards()
        return loss

    def _mirror_empty_shards(self) -> None:
        """Give empty local shards zero-size state and the same counters as their peers.

        gefen-core skips a zero-numel local shard (docs/algorithm.md#step). Keeping a zero-size
        entry with the momentum age of the parameter makes every rank's ``state_dict()`` list the
        same parameters and keys, which DCP's collective gathers and planners require.
        """
        for group, i, p, _ in self._entries():
            if not _is_dtensor(p) or p.grad is None or _local(p).numel() > 0:
                continue
            period = group[SEARCH_PERIODS_KEY][i]
            if not period:
                continue
            state = self.state[p]
            if "exp_avg_codes" not in state:
                dev = _local(p).device
                aligned = sharded_period(period, tuple(p.shape), self._world())
                state.update(
                    period=aligned,
                    step=torch.zeros((), dtype=torch.float32),
                    exp_avg_sq_step=torch.zeros((), dtype=torch.float32),
                    exp_avg_codes=torch.zeros(0, aligned, dtype=torch.uint8, device=dev),
                    exp_avg_scale=torch.zeros(0, 1, dtype=torch.float32, device=dev),
                )
                if _core_dispatch.is_factored(p, group, sharded=True):
                    # k was kept in step with the peers by _finalize_empty_shard.
                    state.setdefault("exp_avg_sq_row",
                                     torch.zeros(0, dtype=torch.float32, device=dev))
                    state.setdefault("exp_avg_sq_col", torch.zeros(
                        p.shape[1], dtype=torch.float32, device=dev))
                else:
                    state["exp_avg_sq"] = torch.zeros(0, 1, dtype=torch.float32, device=dev)
            state["step"] += 1
            state["exp_avg_sq_step"] += 1

    # ------------------------------------------------------------------ checkpoints
    def _indexed_params(self) -> list[Tensor]:
        # gefen-core numbers parameters in group order (torch's convention).
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """Gefen's native checkpoint, with each DTensor parameter's state as DTensors.

        For a ``Shard(0)`` parameter of global shape ``[R, ...]``: ``exp_avg_codes`` is a uint8
        DTensor of the parameter's shape, ``exp_avg_scale``/``exp_avg_sq`` fp32 DTensors of
        shape ``[R, row_numel / gcd(P, row_numel)]`` (:mod:`gefen_dist._layout`), all sharded
        like the parameter; in factored mode ``exp_avg_sq_row`` is an fp32 ``[R]`` DTensor
        sharded like the rows and ``exp_avg_sq_col`` the plain fp32 ``[C]`` tensor (identical on
        every rank). ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
        therefore gathers them (``full_state_dict=True``) or DCP saves each rank's rows
        (sharded), with no rank-local payload. Not collective.
        """
        from . import _layout

        sd = super().state_dict()
        state = dict(sd["state"])
        for i, p in enumerate(self._indexed_params()):
            if not _is_dtensor(p) or i not in state:
                continue
            entry = dict(state[i])
            if "exp_avg_codes" not in entry:
                state[i] = entry
                continue
            period = int(entry["period"])
            local_shape = tuple(_local(p).shape)
            mesh, placements = p.device_mesh, p.placements
            entry["exp_avg_codes"] = DTensor.from_local(
                _layout.codes_to_param_shape(entry["exp_avg_codes"], local_shape), mesh,
                placements, shape=p.shape, stride=p.stride(), run_check=False)
            gshape = _layout.units_shape(period, p.shape[0], tuple(p.shape))
            for key in ("exp_avg_scale", "exp_avg_sq"):
                if key in entry:
                    units = _layout.block_values_to_units(
                        entry[key], period, local_shape, tuple(p.shape))
                    entry[key] = DTensor.from_local(
                        units, mesh, placements, shape=torch.Size(gshape), stride=(gshape[1], 1),
                        run_check=False)
            if "exp_avg_sq_row" in entry:
                # r is per row: sharded like the rows. k (exp_avg_sq_col) is identical on every
                # rank and stays a plain (replicated) tensor.
                entry["exp_avg_sq_row"] = DTensor.from_local(
                    entry["exp_avg_sq_row"], mesh, placements, shape=torch.Size(p.shape[:1]),
                    stride=(1,), run_check=False)
            state[i] = entry
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a native checkpoint; collective when DTensor parameters are present.

        Accepts what :meth:`state_dict` writes (DTensor state), the same gathered to full plain
        tensors (``full_state_dict=True``), or compact per-shard tensors. Every rank converts
        and validates its part (gefen-core's staging, docs/algorithm.md#checkpoint-format); the
        ranks agree on the verdict; only then does any rank commit. A malformed checkpoint on one
        rank raises
        :class:`gefen_dist.CollectiveCheckError` on every rank and changes nothing.
        """
        from gefen_core.checkpoint import commit, stage_load

        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        staged = None
        collective = self._world() > 1 and self._has_dtensors()
        with agreed("ShardedGefen.load_state_dict validation",
                    group=self._dist_group if collective else None):
            _check_no_missing_state(state_dict)
            staged = stage_load(self, self._localize(state_dict))
            narrow_staged_rows(staged.state)
        assert staged is not None
        commit(self, staged)
        for g in self.param_groups:
            periods = g.get(SEARCH_PERIODS_KEY)
            if not (isinstance(periods, list) and len(periods) == len(g["params"])):
                g[SEARCH_PERIODS_KEY] = [0] * len(g["params"])
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _localize(self, sd: dict[str, Any]) -> dict[str, Any]:
        """DTensor / full global-layout state -> this rank's compact tensors (no mutation)."""
        from . import _layout

        state = sd.get("state")
        groups = sd.get("param_groups")
        if not isinstance(state, dict) or not isinstance(groups, list):
            return sd
        # Saved ids (ints from state_dict(), FQNs from set_optimizer_state_dict) map to live
        # parameters by position in the groups, as in torch.optim.
        id_map: dict[Any, Tensor] = {}
        for saved, live in zip(groups, self.param_groups):
            ids = saved.get("params") if isinstance(saved, dict) else None
            if isinstance(ids, list) and len(ids) == len(live["params"]):
                for sid, p in zip(ids, live["params"]):
                    id_map.setdefault(sid, p)
        out_state = dict(state)
        for i, entry in state.items():
            p = id_map.get(i)
            if p is None or not _is_dtensor(p) or not isinstance(entry, dict) \
                    or "period" not in entry:
                continue
            entry = dict(entry)
            period = entry["period"]
            if not isinstance(period, int) or period < 1:
                continue  # gefen-core's validation names the problem
            start, rows = _row_range(p)
            gshape = tuple(p.shape)
            local_shape = (rows, *gshape[1:])
            for key in ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq"):
                value = entry.get(key)
                if not isinstance(value, torch.Tensor):
                    continue
                if key == "exp_avg_codes":
                    full_shape, local_layout = gshape, local_shape
                else:
                    full_shape = _layout.units_shape(period, gshape[0], gshape)
                    local_layout = _layout.units_shape(period, rows, gshape)
                if isinstance(value, DTensor):
                    value = value.to_local()
                elif tuple(value.shape) == full_shape and full_shape != local_layout:
                    value = value.narrow(0, start, rows)  # gathered by full_state_dict=True
                if tuple(value.shape) == local_layout:
                    if key == "exp_avg_codes" and value.numel() % period == 0:
                        value = _layout.codes_from_param_shape(value, period)
                    elif key != "exp_avg_codes":
                        value = _layout.block_values_from_units(value, period, gshape)
                # Anything else is compact [B, P] / [B, 1], or malformed: gefen-core's staging
                # checks shapes and dtypes and names the problem.
                entry[key] = value
            row = entry.get("exp_avg_sq_row")
            if isinstance(row, torch.Tensor):
                if isinstance(row, DTensor):
                    row = row.to_local()
                elif row.ndim == 1 and row.shape[0] == gshape[0] != rows:
                    row = row.narrow(0, start, rows)  # gathered by full_state_dict=True
                entry["exp_avg_sq_row"] = rows_for_staging(p, row)
            out_state[i] = entry
        out = dict(sd)
        out["state"] = out_state
        return out

    def _collective_prologue(self) -> None:
        entries = self._entries()
        names = [n for _, _, _, n in entries]
        present = check_grad_presence([p for _, _, p, _ in entries], names,
                                      group=self._dist_group)
        with_grad = [e for e, has in zip(entries, present) if has]
        if not with_grad:
            return
        refresh = self._codebook_refresh_every
        learn = self._codebook is None or (
            refresh > 0 and self._global_step > 0 and self._global_step % refresh == 0)
        # One all-reduce decides, identically on every rank, whether this step is collective
        # and which parameters need a global period (a checkpoint restored on some ranks only,
        # or written by plain Gefen, cannot make the ranks diverge here).
        flags = torch.tensor(
            [int(learn)] + [int(not g[SEARCH_PERIODS_KEY][i]) for g, i, _, _ in with_grad],
            dtype=torch.int32, device=collective_device(self._dist_group))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._dist_group)
        decided = flags.tolist()
        missing = [e for e, f in zip(with_grad, decided[1:]) if f]
        if not decided[0] and not missing:
            return
        if self._agreed_finite is None:
            self._agree_finite([p for _, _, p, _ in with_grad])
        if not self._agreed_finite:
            return  # Gefen skips learning / the new parameters on every rank alike (O9).
        for group, i, p, name in missing:
            self._assign_global_period(group, i, p, name)
        if decided[0]:
            live_local = sum(int(_local(p).numel() > 0) for _, _, p, _ in with_grad)
            self._check_every_rank_contributes(live_local)

    def _agree_finite(self, params: list[Tensor]) -> None:
        """Set :attr:`_agreed_finite`: whether every rank's gradients of ``params`` are
        finite (one all-reduce; docs/algorithm.md#non-finite-gradients)."""
        ok = all_finite(_local(p.grad) for p in params if p.grad is not None)
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32,
                            device=collective_device(self._dist_group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._dist_group)
        self._agreed_finite = int(flag.item()) == 0

    def _check_every_rank_contributes(self, live_local: int) -> None:
        # gefen-core's codebook pass runs only on ranks with a non-empty local gradient; a
        # rank whose shards are all empty would never reach the histogram all-reduce.
        error = None
        if live_local == 0:
            error = RuntimeError(
                "this rank holds only empty shards of the parameters with gradients, so it "
                "cannot join the codebook all-reduce; use fewer ranks or larger parameters"
            )
        agree(error, "ShardedGefen codebook learning", group=self._dist_group)

    def _assign_global_period(self, group: dict[str, Any], index: int, p: Tensor,
                              name: str) -> None:
        grad = p.grad
        assert grad is not None
        full = _full_tensor(grad) if _is_dtensor(grad) else grad
        period: int | None = None
        with agreed(f"period search for {name!r}", group=self._dist_group):
            period = self._select_period(p, full, name, group)
        del full
        assert period is not None
        state = self.state[p]
        if _local(p).numel() > 0 and "period" not in state:
            # A period restored from a checkpoint is the state geometry: never replaced.
            state["period"] = sharded_period(period, tuple(p.shape), self._world())


def _check_no_missing_state(sd: Any) -> None:
    """Refuse a checkpoint whose groups record searched parameters that have no state entry.

    That is what a sharded DCP load into a fresh optimizer produces (DCP only loads keys the
    destination already has): loading it would silently restart the momentum.
    """
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict):
        return
    state = sd["state"]
    missing = []
    for g in sd.get("param_groups") or []:
        if not isinstance(g, dict):
            continue
        ids, periods = g.get("params"), g.get(SEARCH_PERIODS_KEY)
        if not (isinstance(ids, list) and isinstance(periods, list) and len(ids) == len(periods)):
            continue
        names = g.get("param_names") or ids
        for pid, period, name in zip(ids, periods, names):
            if period and pid not in state:
                missing.append(name)
    if missing:
        raise ValueError(
            f"ShardedGefen.load_state_dict: the checkpoint's groups record trained parameters "
            f"without state ({missing[:5]}); a sharded DCP load into a fresh optimizer cannot "
            "create Gefen's state. Use gefen_dist.GefenDCPState with dcp.load, or "
            "get/set_optimizer_state_dict with full_state_dict=True; the optimizer was left "
            "unchanged")


def rows_for_staging(p: Tensor, row: Tensor) -> Tensor:
    """This rank's ``exp_avg_sq_row`` (``[R_local]``) in the ``[R]`` form gefen-core's staging
    validates (it checks ``param.shape[0]``, the global row count of a DTensor): the local
    rows at their global offset, zeros elsewhere. :func:`narrow_staged_rows` undoes it.
    Anything that is not this rank's ``[R_local]`` is passed through for staging to reject."""
    if not _is_dtensor(p) or row.ndim != 1:
        return row
    start, rows = _row_range(p)
    if row.shape[0] != rows or rows == p.shape[0]:
        return row
    out = torch.zeros(p.shape[0], dtype=row.dtype, device=row.device)
    out[start:start + rows] = row
    return out


def narrow_staged_rows(staged_state: dict[Tensor, dict[str, Any]]) -> None:
    """Cut each staged DTensor parameter's ``exp_avg_sq_row`` back to this rank's rows."""
    for p, entry in staged_state.items():
        row = entry.get("exp_avg_sq_row")
        if row is None or not _is_dtensor(p) or row.shape[0] != p.shape[0]:
            continue
        start, rows = _row_range(p)
        if rows != p.shape[0]:
            entry["exp_avg_sq_row"] = row[start:start + rows].clone()


def _row_range(p: DTensor) -> tuple[int, int]:
    """``(first_row, rows)`` of this rank's ``Shard(0)`` chunk (DTensor's ``torch.chunk``
    rule)."""
    world = p.device_mesh.size()
    coord = p.device_mesh.get_local_rank()
    rows = p.shape[0]
    chunk = -(-rows // world)
    start = min(coord * chunk, rows)
    return start, min(rows, start + chunk) - start


def _local(t: Tensor) -> Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _full_tensor(t: DTensor) -> Tensor:
    """All-gather a ``Shard(0)`` DTensor into a plain tensor on the local shard's device.

    A shard that lives on the CPU while the mesh is on an accelerator (``CPUOffloadPolicy``)
    is gathered on the mesh's device, then brought back.
    """
    local = t.to_local()
    mesh = t.device_mesh
    if local.device.type != mesh.device_type:
        dev = torch.device(mesh.device_type, torch.accelerator.current_device_index()) \
            if mesh.device_type != "cpu" else torch.device("cpu")
        moved = DTensor.from_local(local.to(dev), mesh, t.placements, shape=t.shape,
                                   stride=t.stride())
        return moved.full_tensor().to(local.device)
    return t.full_tensor()
