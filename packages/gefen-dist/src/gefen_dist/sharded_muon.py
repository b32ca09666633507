"""``ShardedGefenMuon``, ``ShardedGefenMuonHybrid``: the Muon family on FSDP2
(docs/algorithm.md#distributed).

Newton–Schulz orthogonalises a *whole* matrix; FSDP2 (``fully_shard``) leaves each rank a
``Shard(0)`` row block of it. :class:`ShardedGefenMuon` is :class:`gefen_core.GefenMuon` plus
the collectives of the three ``sharded_mode`` values (docs/algorithm.md#distributed, per param
group):

* ``"exact"`` (default): every rank all-gathers the full gradient of every matrix each step
  (consecutive matrices share one all-gather, up to 128 MiB of full gradients) and
  runs the whole pipeline of docs/algorithm.md#gefenmuon (quantized momentum with the full tensor's
  period and the shared codebook, Nesterov, Newton–Schulz, NorMuon, cautious) on the full matrix.
  The momentum state is full-size and identical on every rank (replicated, ~1 byte per *global*
  element per rank). Each rank then writes rows ``[k·c, min(R, (k+1)·c))`` of the update
  into its shard, ``c = ceil(R / W)`` (DTensor's ``torch.chunk`` rule; a shard may be empty).
* ``"distributed"`` ("parallel Muon"): the distributed-mode matrices are listed in group order
  (also those without a gradient); matrix ``j`` is owned by rank ``j mod W``. Gradient-bearing
  matrices go in the same gather buckets: every rank all-gathers the bucket's gradients, each
  owner runs the pipeline on the bucket's matrices it owns, and one all-gather delivers every
  update ``O`` in the Newton–Schulz dtype (bf16) to every rank, which writes its rows. Only
  owners hold momentum (and NorMuon) state; the other ranks keep the matrix's ``period`` (an
  int), so every rank takes the same decisions.
* ``"approx"``: each rank runs the pipeline on its local row block only (period, codebook and
  Newton–Schulz of the block), with no collectives. The update is not the orthogonalisation
  of the full matrix; the deviation grows with the world size (``README.md`` has figures).

Every collective is entered by every rank in the same order. The step's structural checks and
every rank-local computation that precedes a collective run inside
:func:`gefen_dist.agreed`, and the ranks agree on which matrices have gradients before the first
gather (:func:`gefen_dist.check_grad_presence`), so one rank's failure is a
:class:`gefen_dist.CollectiveCheckError` on every rank rather than a hang.

Exact and distributed modes see exactly the gradients a single process sees and run the same
per-matrix code on them, so they reproduce a single-process :class:`~gefen_core.GefenMuon` step
for step (bit-identical on homogeneous devices; tested on CPU/gloo).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from gefen_core import Gefen
from gefen_core.hybrid import GefenMuonHybrid
from gefen_core.muon import NORMUON_STATE_KEYS, GefenMuon

from ._agree import agree, agreed, check_grad_presence, collective_device
from .capabilities import SHARDED_GEFEN_MUON_CAPABILITIES, Capabilities
from .sharded import ShardedGefen

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["ShardedGefenMuon", "ShardedGefenMuonHybrid", "row_range"]

Entry = tuple[dict[str, Any], Tensor, Tensor, str]
_MOMENTUM_KEYS = ("step", "exp_avg_codes", "exp_avg_scale", *NORMUON_STATE_KEYS)


def _is_dtensor(t: object) -> TypeIs[DTensor]:
    return isinstance(t, DTensor)


def row_range(rows: int, world_size: int, coordinate: int) -> tuple[int, int]:
    """``(first_row, num_rows)`` of mesh coordinate ``coordinate`` in a ``Shard(0)`` layout of
    ``rows`` rows over ``world_size`` ranks: ``c = ceil(rows / world_size)`` rows per rank,
    rank ``k`` holding ``[k·c, min(rows, (k+1)·c))`` (DTensor's ``torch.chunk`` rule; the last
    ranks may hold fewer rows or none).

    Raises:
        ValueError: ``world_size < 1`` or ``coordinate`` outside ``[0, world_size)``.
    """
    if world_size < 1 or not 0 <= coordinate < world_size:
        raise ValueError(f"need 0 <= coordinate < world_size, got {coordinate}, {world_size}")
    chunk = -(-rows // world_size)
    start = min(coordinate * chunk, rows)
    return start, min(rows, start + chunk) - start


def _local(t: Tensor) -> Tensor:
    return t.to_local() if _is_dtensor(t) else t


# Full gradients assembled per all-gather in exact and distributed mode. One collective per
# matrix (DTensor.full_tensor) costs a redistribute's host overhead each, which dominated the
# step (docs/decisions.md); the budget bounds the transient memory of the bigger collectives
# (one matrix may exceed it alone). A bucket holds its send buffer (1/W of it), the receive
# buffer and the assembled full gradients at once: about (2 + 1/W) x the budget at its peak.
_GATHER_BUCKET_BYTES = 128 << 20

# torch >= 2.9 names the one-tensor all-gather all_gather_single (all_gather_into_tensor then
# warns); the floor only has the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather_buckets(grads: list[DTensor]) -> list[list[int]]:
    """Indices of ``grads`` in consecutive runs of one dtype, device and mesh whose full sizes
    add up to at most :data:`_GATHER_BUCKET_BYTES` (a larger gradient is a run of its own)."""
    buckets: list[list[int]] = []
    size = 0
    key: Any = None
    for i, g in enumerate(grads):
        nbytes = g.numel() * g.element_size()
        k = (g.dtype, g.device, g.device_mesh)
        if not buckets or k != key or size + nbytes > _GATHER_BUCKET_BYTES:
            buckets.append([])
            size, key = 0, k
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _row_sharded(g: DTensor) -> bool:
    """``g`` is laid out by DTensor's ``Shard(0)`` chunk rule (a strided shard is not)."""
    return len(g.placements) == 1 and type(g.placements[0]) is Shard and g.placements[0].dim == 0


def _gather_full(grads: list[DTensor]) -> list[Tensor]:
    """The full tensors of DTensor gradients (collective over each gradient's mesh; every
    rank passes the same global shapes, placements and meshes in the same order).

    ``Shard(0)`` gradients go in buckets (:func:`_gather_buckets`), one all-gather each over
    their mesh: every rank sends its shard padded to the chunk of ``ceil(R / W)`` rows, so
    rank ``k``'s rows land at ``[k·c, (k+1)·c)`` of the gathered buffer. Other placements
    fall back to ``full_tensor()``. Returns contiguous tensors in the order given; the values
    are the shards' values, so the result equals ``full_tensor()`` bit for bit.

    Raises:
        gefen_dist.CollectiveCheckError: on every rank of the mesh, when a rank could not
            allocate or fill a bucket's buffers (out of memory, say) before its all-gather.
    """
    out: dict[int, Tensor] = {}
    sharded = [i for i, g in enumerate(grads) if _row_sharded(g)]
    for bucket in _gather_buckets([grads[i] for i in sharded]):
        members = [sharded[b] for b in bucket]
        mesh = grads[members[0]].device_mesh
        group, world = mesh.get_group(), mesh.size()
        chunks = []
        for i in members:
            shape = grads[i].shape
            row = math.prod(shape[1:])
            chunks.append(-(-shape[0] // world) * row)
        total = sum(chunks)
        send = recv = None
        # A rank failing here (the buffers are the bucket's size) must not leave the others
        # waiting in the all-gather.
        with agreed("ShardedGefenMuon gradient gather buffers", group=group):
            first = grads[members[0]].to_local()
            send = torch.empty(total, dtype=first.dtype, device=first.device)
            offset = 0
            for i, n in zip(members, chunks, strict=True):
                local = grads[i].to_local()
                if local.numel():
                    send.narrow(0, offset, local.numel()).copy_(local.reshape(-1))
                offset += n
            recv = torch.empty(world * total, dtype=send.dtype, device=send.device)
        assert send is not None and recv is not None
        _all_gather_single(recv, send, group=group)
        per_rank = recv.view(world, total)
        offset = 0
        for i, n in zip(members, chunks, strict=True):
            shape = grads[i].shape
            if n == 0:
                out[i] = send.new_empty(shape)
                continue
            stacked = per_rank.narrow(1, offset, n).reshape(-1, *shape[1:])
            out[i] = stacked[:shape[0]].contiguous()
            offset += n
    for i, g in enumerate(grads):
        if i not in out:
            out[i] = g.full_tensor()
    return [out[i] for i in range(len(grads))]


def _mesh_group(distributed_mesh: Any, where: str) -> Any:
    if distributed_mesh is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(distributed_mesh, DeviceMesh):
        if distributed_mesh.ndim != 1:
            raise ValueError(
                f"{where}: distributed_mesh must be 1-D, got a {distributed_mesh.ndim}-D mesh; "
                "for HSDP pass the mesh FSDP2 shards over (mesh['shard'])")
        return distributed_mesh.get_group()
    if isinstance(distributed_mesh, dist.ProcessGroup):
        return distributed_mesh
    raise TypeError(f"{where}: distributed_mesh must be a DeviceMesh, a ProcessGroup or None, "
                    f"got {type(distributed_mesh).__name__}")


class ShardedGefenMuon(GefenMuon):
    """:class:`gefen_core.GefenMuon` for FSDP2 ``Shard(0)`` DTensor matrices
    (docs/algorithm.md#distributed).

    Use it like ``GefenMuon`` after ``fully_shard(model)``::

        fully_shard(model)
        opt = ShardedGefenMuon(hidden_matrices, lr=0.02, sharded_mode="distributed")

    Args:
        params, lr, ...: every argument of :class:`gefen_core.GefenMuon`, unchanged;
            ``sharded_mode`` (``"exact"``, ``"distributed"`` or ``"approx"``, per group) now
            takes effect. See the module docstring for what each mode computes and stores.
        distributed_mesh (DeviceMesh | ProcessGroup | None, keyword-only): the 1-D mesh (or its
            group) the matrices are sharded over. ``None`` (default): the DTensors' mesh.
        skip_nonfinite (bool, keyword-only): as ``GefenMuon``; a NaN or Inf in any rank's
            gradient shard skips the step on every rank (decided in the all-reduce that agrees
            on the AMP overflow; docs/algorithm.md#non-finite-gradients).

    Every rank must call :meth:`step` (collective in exact and distributed modes, and for the
    agreement on its checks) and, in distributed mode, :meth:`state_dict` (collective).
    On one rank (or without DTensor parameters) it is exactly ``GefenMuon``.

    Memory per matrix ``R × C`` on each of ``W`` ranks (state; ``P`` the period):
    exact ``R·C·(1 + 4/P)`` bytes; distributed the same on the owner, 0 elsewhere; approx the
    local rows' ``(R/W)·C·(1 + 4/P)``. Transiently, exact and distributed mode gather the full
    gradients of consecutive matrices in buckets of up to 128 MiB (or one larger matrix): the
    send and receive buffers and the assembled gradients peak at about ``(2 + 1/W)`` times the
    bucket. Exact mode adds the full update of the matrix being processed. Distributed mode
    adds the bucket's updates, in the Newton–Schulz dtype, exchanged with every rank's part
    padded to the largest owner's. On the step that learns the codebook every full gradient is
    gathered at once.

    Raises:
        ValueError: a DTensor whose placements are not exactly ``(Shard(0),)``; DTensors on
            different meshes; DTensor and plain parameters mixed (the plain ones' gradients
            would have to be replicated identically, which FSDP2 does not guarantee); approx
            groups mixed with exact/distributed groups on DTensors (the codebook is shared by
            all groups: rank-local under approx, global otherwise); a ``distributed_mesh``
            spanning other ranks than the matrices' mesh; and every ``GefenMuon`` error.
        TypeError: ``distributed_mesh`` of another type.
        gefen_dist.CollectiveCheckError: in :meth:`step` and :meth:`load_state_dict`, on every
            rank, when a check or a rank-local computation failed on some rank, or the ranks
            disagree on which matrices have gradients.
    """

    gefen_capabilities: Capabilities = SHARDED_GEFEN_MUON_CAPABILITIES

    def __init__(self, params: Any, *args: Any, distributed_mesh: Any = None,
                 **kwargs: Any) -> None:
        group = _mesh_group(distributed_mesh, "ShardedGefenMuon")
        super().__init__(params, *args, **kwargs)
        self._dist_group = group
        self._check_layout()
        if group is None:
            for _, p, _ in self._named_params():
                if _is_dtensor(p):
                    self._dist_group = p.device_mesh.get_group()
                    break

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``GefenMuon.add_param_group``, then the layout checks of the class docstring
        (the new group is removed again when they fail)."""
        super().add_param_group(param_group)
        if hasattr(self, "_dist_group"):  # torch's constructor adds groups before __init__ ends
            try:
                self._check_layout()
            except ValueError:
                self.param_groups.pop()
                raise

    # ------------------------------------------------------------------ layout
    def _check_layout(self) -> None:
        from torch.distributed.tensor import Shard

        kinds: set[str] = set()
        modes: set[str] = set()
        mesh = None
        for group, p, name in self._named_params():
            if not _is_dtensor(p):
                kinds.add("plain")
                continue
            kinds.add("dtensor")
            modes.add("approx" if group["sharded_mode"] == "approx" else "global")
            if tuple(p.placements) != (Shard(0),):
                raise ValueError(
                    f"ShardedGefenMuon: parameter {name!r} has placements "
                    f"{tuple(p.placements)}; only (Shard(0),) on a 1-D mesh is supported "
                    "(fully_shard's default)")
            if mesh is None:
                mesh = p.device_mesh
            elif p.device_mesh != mesh:
                raise ValueError(
                    f"ShardedGefenMuon: parameter {name!r} is on another device mesh than the "
                    "first DTensor parameter; use one optimizer per mesh")
        explicit = getattr(self, "_dist_group", None)
        if mesh is not None and explicit is not None:
            # Ownership, the update exchange and the row slices all assume the optimizer's
            # group is the matrices' mesh.
            want = sorted(dist.get_process_group_ranks(mesh.get_group()))
            got = sorted(dist.get_process_group_ranks(explicit))
            if want != got:
                raise ValueError(
                    f"ShardedGefenMuon: distributed_mesh spans ranks {got}, but the matrices "
                    f"are sharded over ranks {want}; pass the mesh fully_shard used (for HSDP "
                    "mesh['shard']) or None")
        if kinds == {"plain", "dtensor"}:
            raise ValueError(
                "ShardedGefenMuon: mixes DTensor and plain parameters; shard every matrix with "
                "fully_shard, or give the replicated ones to a separate gefen_core.GefenMuon")
        if modes == {"approx", "global"}:
            raise ValueError(
                "ShardedGefenMuon: mixes sharded_mode='approx' with 'exact'/'distributed' "
                "groups; the codebook is shared by every group and is rank-local under approx "
                "but global otherwise. Use two optimizers")

    # ------------------------------------------------------------------ helpers
    def _world(self) -> int:
        if not dist.is_available() or not dist.is_initialized():
            return 1
        return dist.get_world_size(self._dist_group)

    def _collective(self) -> bool:
        return self._world() > 1 and any(_is_dtensor(p) for _, p, _ in self._named_params())

    def _mode(self, group: Mapping[str, Any], p: Tensor) -> str:
        """``"plain"``, ``"approx"``, ``"exact"`` or ``"distributed"`` (one rank: exact)."""
        if not _is_dtensor(p):
            return "plain"
        mode = str(group["sharded_mode"])
        if mode == "distributed" and self._world() < 2:
            return "exact"
        return mode

    def _owners(self) -> dict[int, int]:
        """``{id(p): owning group rank}`` of the distributed-mode matrices
        (docs/algorithm.md#distributed)."""
        world = self._world()
        out: dict[int, int] = {}
        for group, p, _ in self._named_params():
            if self._mode(group, p) == "distributed":
                out[id(p)] = len(out) % world
        return out

    def _rank(self) -> int:
        return dist.get_rank(self._dist_group)

    def _global_rank(self, group_rank: int) -> int:
        if self._dist_group is None:
            return group_rank
        return dist.get_global_rank(self._dist_group, group_rank)

    # ------------------------------------------------------------------ GefenMuon hooks
    def _check_sharded(self, entries: list[Entry]) -> None:
        """DTensor matrices are this class's job; nothing to refuse."""

    def _update_target(self, p: Tensor, o: Tensor) -> tuple[Tensor, Tensor]:
        """A DTensor's local shard and the rows of ``o`` it owns (docs/algorithm.md#distributed
        slicing).

        ``o`` is either the full ``R × C`` update (exact, distributed) or already the local
        block (approx, whose pipeline ran on the shard).
        """
        if not _is_dtensor(p):
            return p, o
        local = p.to_local()
        if tuple(o.shape) == tuple(p.shape):
            mesh = p.device_mesh
            start, rows = row_range(p.shape[0], mesh.size(), mesh.get_local_rank())
            if rows != local.shape[0]:
                raise RuntimeError(
                    f"ShardedGefenMuon: a local shard has {local.shape[0]} rows, the Shard(0) "
                    f"chunk rule gives {rows}; only DTensor's torch.chunk Shard(0) layout is "
                    "supported")
            return local, o.narrow(0, start, rows)
        if o.shape != local.shape:
            raise RuntimeError(f"ShardedGefenMuon: update of shape {tuple(o.shape)} fits neither "
                               f"the matrix {tuple(p.shape)} nor its shard {tuple(local.shape)}")
        return local, o

    def _muon_preflight(self) -> list[Entry]:
        """GefenMuon's structural checks, agreed over the mesh (docs/algorithm.md#gefenmuon)."""
        if not self._collective():
            return super()._muon_preflight()
        entries: list[Entry] | None = None
        with agreed("ShardedGefenMuon step checks", group=self._dist_group):
            entries = super()._muon_preflight()
        assert entries is not None
        return entries

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One GefenMuon step (docs/algorithm.md#gefenmuon) with the sharded modes of
        docs/algorithm.md#distributed.

        Order: the closure; GefenMuon's checks, agreed over the mesh; the AMP decision, agreed
        (an overflow on any rank skips the step on every rank); agreement on which
        exact/distributed matrices have gradients; codebook learning from the full gradients
        (first step); the exact matrices; the distributed buckets. Approx groups (never mixed
        with the other two) step their local blocks with no further collective.

        Raises:
            gefen_dist.CollectiveCheckError: on every rank, see the class docstring.
            ValueError, RuntimeError: as ``GefenMuon.step`` when not collective.
        """
        from gefen_core import amp as _amp

        self._capture_guard()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = self._muon_preflight()
        overflow, inv_scale = _amp.overflow_and_inverse_scale(self)
        # skip_nonfinite reads the gradients as step() receives them, like GefenMuon.
        nonfinite = self._skip_nonfinite and self._step_is_nonfinite()
        if self._collective():
            # One all-reduce decides both skips on every rank alike.
            flag = torch.tensor([int(overflow), int(nonfinite)], dtype=torch.int32,
                                device=collective_device(self._dist_group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._dist_group)
            overflow, nonfinite = (bool(v) for v in flag.tolist())
        if nonfinite:
            self._record_skipped_step()
            return loss
        if overflow:
            return loss
        if inv_scale is not None:
            _amp.unscale_([g for _, _, g, _ in entries], inv_scale)
        self._apply(entries)
        self.last_step_skipped = False
        return loss

    def _apply(self, entries: list[Entry]) -> None:
        if not self._collective():
            super()._apply(entries)
            return
        group_pg = self._dist_group
        global_entries = [(g, p, n) for g, p, n in self._named_params()
                          if self._mode(g, p) in ("exact", "distributed")]
        if global_entries:
            # Before the first gather: the same matrices must have gradients everywhere.
            check_grad_presence([p for _, p, _ in global_entries],
                                [n for _, _, n in global_entries], group=group_pg)
        local_items: list[Entry] = []
        exact_items: list[Entry] = []
        dist_items: list[Entry] = []
        for e in entries:
            mode = self._mode(e[0], e[1])
            if mode == "exact":
                exact_items.append(e)
            elif mode == "distributed":
                dist_items.append(e)
            elif e[2].numel() > 0:  # approx: this rank's non-empty block
                local_items.append(e)
        full: dict[int, Tensor] = {}

        def gathered(items: list[Entry]) -> list[Entry]:
            """The entries with their full gradients (collective: the same items, in the same
            order, on every rank). A gradient gathered for codebook learning is used once."""
            missing = [e for e in items if id(e[1]) not in full]
            grads = []
            for _, p, _, _ in missing:
                grad = p.grad
                assert _is_dtensor(grad)
                grads.append(grad)
            if grads:
                full.update(zip((id(e[1]) for e in missing), _gather_full(grads), strict=True))
            return [(group, p, full.pop(id(p)), name) for group, p, _, name in items]

        if local_items:
            # approx (never mixed with the global modes): GefenMuon on the local blocks.
            stepped_local = self._prepare(local_items)
            if stepped_local is None:
                return
            self._run(stepped_local)
        if self._codebook is None and (exact_items or dist_items):
            # The codebook is learned from the full gradients, so it is the single-process one
            # and identical on every rank; all ranks take the same skip decision (O9).
            for e in gathered(exact_items + dist_items):
                full[id(e[1])] = e[2]
            learned = None
            with agreed("ShardedGefenMuon codebook learning", group=group_pg):
                learned = self._prepare([(g, p, full[id(p)], n)
                                         for g, p, _, n in exact_items + dist_items])
            if learned is None:
                return
        if exact_items:
            # One bucket of full gradients at a time (_GATHER_BUCKET_BYTES). A rank whose
            # pipeline fails keeps joining the remaining gathers and reports at the end, so
            # its peers never wait on it.
            error: Exception | None = None
            exact_grads = [cast(DTensor, p.grad) for _, p, _, _ in exact_items]
            for bucket in _gather_buckets(exact_grads):
                entries_full = gathered([exact_items[i] for i in bucket])
                if error is not None:
                    continue
                try:
                    stepped = self._prepare(entries_full)
                    assert stepped is not None  # the codebook exists: nothing is skipped
                    self._run(stepped)
                except Exception as exc:  # noqa: BLE001 - agreed below, raised on every rank
                    error = exc
                del entries_full
            agree(error, "ShardedGefenMuon exact-mode pipeline", group=group_pg)
        if dist_items:
            self._run_distributed(dist_items, gathered)
        for t in self._device_global_step.values():
            t.add_(1)
        self._global_step += 1

    def _run(self, stepped: list[Entry]) -> None:
        """docs/algorithm.md#gefenmuon on each entry's gradient (full matrix or local block), in
        group order."""
        for group, p, g, name in stepped:
            lr = group["lr"] if group["capturable"] else self._host_lr(group["lr"])
            u = self._momentum(p, g, name, group)
            o = self._orthogonalise(u, group)
            self._finish(p, g, o, group, lr)

    def _run_distributed(self, items: list[Entry],
                         gathered: Callable[[list[Entry]], list[Entry]]) -> None:
        """The owner pipeline of docs/algorithm.md#distributed, over gather buckets of
        gradient-bearing matrices (:func:`_gather_buckets`; matrix ownership stays ``j mod W``, so
        each rank runs the pipeline on the bucket's matrices it owns, in parallel with the other
        owners). The updates of a bucket are then exchanged in one all-gather, in the Newton–Schulz
        dtype: the same values a broadcast from each owner delivers."""
        rank = self._rank()
        owners = self._owners()
        grads = [cast(DTensor, p.grad) for _, p, _, _ in items]
        for bucket in _gather_buckets(grads):
            entries = gathered([items[i] for i in bucket])
            outs: dict[int, Tensor] = {}
            stepped: list[Entry] | None = None
            packed: tuple[Tensor, Tensor] | None = None
            with agreed("ShardedGefenMuon distributed-mode pipeline", group=self._dist_group):
                # Every rank runs the period gate (full gradients are identical everywhere),
                # so all agree on what is stepped; only owners touch momentum.
                stepped = self._prepare(entries)
                assert stepped is not None
                for group, p, g, name in stepped:
                    if owners[id(p)] != rank:
                        continue
                    u = self._momentum(p, g, name, group)
                    o = self._post_ns(p, g, self._orthogonalise(u, group), group)
                    outs[id(p)] = o.to(self._ns_dtype).contiguous()
                # The exchange buffers too: a rank that cannot allocate them must not leave
                # the others waiting in the all-gather.
                packed = self._pack_updates(stepped, outs, owners)
            assert stepped is not None and packed is not None
            updates = self._exchange_updates(stepped, packed, owners)
            del entries, outs, packed
            for group, p, _, _ in stepped:
                lr = group["lr"] if group["capturable"] else self._host_lr(group["lr"])
                self._apply_update(p, updates[id(p)], group, lr)
            for _, p, _, _ in stepped:
                if owners[id(p)] != rank:
                    # Non-owners keep only the period (geometry, agreed by every rank).
                    st = self.state.get(p, {})
                    for key in _MOMENTUM_KEYS:
                        st.pop(key, None)

    def _pack_updates(self, stepped: list[Entry], outs: dict[int, Tensor],
                      owners: dict[int, int]) -> tuple[Tensor, Tensor]:
        """``(send, recv)`` for :meth:`_exchange_updates`: this rank's owned updates,
        concatenated in ``stepped`` order and padded to the largest rank's total, and the
        receive buffer for every rank's part."""
        world, rank = self._world(), self._rank()
        device = stepped[0][2].device if stepped else torch.device("cpu")
        totals = [0] * world
        for _, p, _, _ in stepped:
            totals[owners[id(p)]] += p.numel()
        width = max(totals)
        send = torch.empty(width, dtype=self._ns_dtype, device=device)
        offset = 0
        for _, p, _, _ in stepped:
            if owners[id(p)] == rank:
                o = outs[id(p)]
                send.narrow(0, offset, o.numel()).copy_(o.reshape(-1))
                offset += o.numel()
        return send, torch.empty(world * width, dtype=self._ns_dtype, device=device)

    def _exchange_updates(self, stepped: list[Entry], packed: tuple[Tensor, Tensor],
                          owners: dict[int, int]) -> dict[int, Tensor]:
        """Every stepped matrix's full update ``O`` on every rank (collective, one all-gather
        of :meth:`_pack_updates`' buffers; ``stepped`` is the same on every rank)."""
        if not stepped:
            return {}
        send, recv = packed
        world = self._world()
        _all_gather_single(recv, send, group=self._dist_group)
        per_rank = recv.view(world, send.numel())
        offsets = [0] * world
        updates: dict[int, Tensor] = {}
        for _, p, _, _ in stepped:
            owner = owners[id(p)]
            n = p.numel()
            updates[id(p)] = per_rank[owner].narrow(0, offsets[owner], n).view(tuple(p.shape))
            offsets[owner] += n
        return updates

    # ------------------------------------------------------------------ checkpoints
    def _indexed(self) -> list[tuple[dict[str, Any], Tensor, str]]:
        return list(self._named_params())

    def state_dict(self) -> dict[str, Any]:
        """GefenMuon's checkpoint (docs/algorithm.md#checkpoint-format,
        docs/algorithm.md#distributed); collective in distributed mode.

        * exact: every rank returns the full-size, replicated state (identical on every rank);
          it loads on any world size, into this class in exact or distributed mode, or into a
          single-process ``GefenMuon`` over the full matrices.
        * distributed: each owner broadcasts its matrices' entries, so every rank returns the
          complete state, as exact does (every rank must call this).
        * approx: each rank's local-block state and its rank-local codebook: loads only on the
          same topology (same world size, same rank).
        """
        sd = super().state_dict()
        if not self._collective():
            return sd
        owners = self._owners()
        if not owners:
            return sd
        rank = self._rank()
        state = dict(sd["state"])
        for i, (_, p, _) in enumerate(self._indexed()):
            if id(p) not in owners:
                continue
            owner = owners[id(p)]
            entry = state.get(i) if owner == rank else None
            payload: list[Any] = [None if entry is None else {
                k: (v.detach().cpu() if isinstance(v, Tensor) else v) for k, v in entry.items()}]
            dist.broadcast_object_list(payload, src=self._global_rank(owner),
                                       group=self._dist_group)
            if owner != rank:
                if payload[0] is None:
                    state.pop(i, None)
                else:
                    state[i] = payload[0]
        sd["state"] = state
        return sd

    def stage_load(self, state_dict: Mapping[str, Any]) -> Any:
        """Validate ``state_dict`` and return the staged load; collective with DTensors.

        Exact/distributed matrices take full-size entries (validated against the global
        shape; in distributed mode a non-owner keeps only the period); approx matrices take
        local-block entries. Every rank validates, the ranks agree, and only then does
        :meth:`commit_load` run, so a checkpoint rejected on one rank changes nothing anywhere.

        Raises:
            gefen_dist.CollectiveCheckError: (collective) a rank rejected its checkpoint.
            ValueError: (one process) the checkpoint is malformed.
        """
        if not self._collective():
            return self._stage_local(state_dict)
        staged = None
        with agreed("ShardedGefenMuon.load_state_dict validation", group=self._dist_group):
            staged = self._stage_local(state_dict)
        return staged

    def _stage_local(self, state_dict: Mapping[str, Any]) -> Any:
        from gefen_core.checkpoint import CheckpointError

        def err(msg: str) -> CheckpointError:
            return CheckpointError(
                f"ShardedGefenMuon.load_state_dict: {msg}; the optimizer was left unchanged")

        if not isinstance(state_dict, Mapping):
            raise err(f"expected a dict, got {type(state_dict).__name__}")
        saved_state = state_dict.get("state")
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_state, Mapping) or not isinstance(saved_groups, list) \
                or len(saved_groups) != len(self.param_groups):
            return super().stage_load(state_dict)  # GefenMuon names the problem
        id_map: dict[Any, tuple[dict[str, Any], Tensor, str]] = {}
        for live, saved in zip(self.param_groups, saved_groups, strict=True):
            ids = saved.get("params") if isinstance(saved, Mapping) else None
            if isinstance(ids, list) and len(ids) == len(live["params"]):
                for sid, p, name in zip(ids, live["params"], live["param_names"], strict=True):
                    id_map[sid] = (live, p, name)
        owners = self._owners() if self._world() > 1 else {}
        rank = self._rank() if owners else 0
        rest: dict[Any, Any] = {}
        full_entries: dict[Any, Any] = {}
        block_normuon: dict[Any, dict[str, Any]] = {}
        for sid, entry in saved_state.items():
            target = id_map.get(sid)
            mode = "plain" if target is None else self._mode(target[0], target[1])
            if mode in ("exact", "distributed"):
                full_entries[sid] = entry
            elif mode == "approx" and isinstance(entry, Mapping) \
                    and any(k in entry for k in NORMUON_STATE_KEYS):
                block_normuon[sid] = {k: entry[k] for k in NORMUON_STATE_KEYS if k in entry}
                rest[sid] = {k: v for k, v in entry.items() if k not in NORMUON_STATE_KEYS}
            else:
                rest[sid] = entry
        sd = dict(state_dict)
        sd["state"] = rest
        staged = super().stage_load(sd)
        if staged.codebook is None and any(
                isinstance(e, Mapping) and "exp_avg_codes" in e for e in full_entries.values()):
            raise err("the state holds momentum codes but no codebook")
        for sid, entry in full_entries.items():
            group, p, name = id_map[sid]
            new = _stage_full_entry(entry, p, name, group, err)
            if owners.get(id(p), rank) != rank:
                new = {"period": new["period"]} if "period" in new else {}
            if new:
                staged.state[p] = new
        for sid, extra in block_normuon.items():
            group, p, name = id_map[sid]
            st = staged.state.get(p, {})
            if "exp_avg_codes" not in st:
                raise err(f"state[{name!r}] has NorMuon statistics but no momentum")
            local = p.to_local() if _is_dtensor(p) else p
            st.update(_stage_normuon(extra, local.shape[0], local.device, name, group, err))
        return staged


def _stage_normuon(extra: Mapping[str, Any], rows: int, device: torch.device, name: str,
                   group: Mapping[str, Any], err: Callable[[str], Exception]) -> dict[str, Tensor]:
    if set(extra) != set(NORMUON_STATE_KEYS):
        raise err(f"state[{name!r}] needs both {NORMUON_STATE_KEYS}, got {sorted(extra)}")
    v = extra["normuon_exp_avg_sq"]
    if not isinstance(v, Tensor) or v.dtype != torch.float32 or tuple(v.shape) != (rows, 1):
        got = (v.dtype, list(v.shape)) if isinstance(v, Tensor) else type(v).__name__
        raise err(f"state[{name!r}]['normuon_exp_avg_sq'] must be fp32 [{rows}, 1], got {got}")
    if not bool(torch.isfinite(v).all()) or bool((v < 0).any()):
        raise err(f"state[{name!r}]['normuon_exp_avg_sq'] must be finite and >= 0")
    t = extra["normuon_step"]
    tv = float(t.detach().reshape(()).item()) if isinstance(t, Tensor) and t.numel() == 1 \
        else (float(t) if isinstance(t, (int, float)) and not isinstance(t, bool)
              else float("nan"))
    if not math.isfinite(tv) or tv < 1 or tv != int(tv):
        raise err(f"state[{name!r}]['normuon_step'] must be an integer >= 1, got {t!r}")
    step_dev = device if group["capturable"] else torch.device("cpu")
    return {"normuon_exp_avg_sq": v.detach().to(device=device, copy=True),
            "normuon_step": torch.tensor(tv, dtype=torch.float32, device=step_dev)}


def _stage_full_entry(entry: Any, p: Tensor, name: str, group: Mapping[str, Any],
                      err: Callable[[str], Exception]) -> dict[str, Any]:
    """Validate one full-size entry (exact/distributed) against the *global* shape."""
    from gefen_core.checkpoint import stage_entry

    if not isinstance(entry, Mapping):
        raise err(f"state[{name!r}] must be a dict, got {type(entry).__name__}")
    for banned in ("exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq_step"):
        if banned in entry:
            raise err(f"state[{name!r}] has {banned!r}: GefenMuon keeps no second moment")
    e = {k: v for k, v in entry.items() if k not in NORMUON_STATE_KEYS}
    extra = {k: entry[k] for k in NORMUON_STATE_KEYS if k in entry}
    codes = e.get("exp_avg_codes")
    if isinstance(codes, Tensor) and codes.ndim == 2:
        # gefen-core's entry check wants a second moment; GefenMuon keeps none.
        e["exp_avg_sq"] = torch.zeros(codes.shape[0], 1, dtype=torch.float32)
    local = p.to_local() if _is_dtensor(p) else p
    # A zero-stride stand-in with the global shape on the shard's device: the entry check
    # reads numel, ndim, shape and device only.
    proxy = torch.empty((), dtype=local.dtype, device=local.device).expand(tuple(p.shape))
    try:
        staged = stage_entry(e, proxy, name, bool(group["capturable"]))
    except ValueError as exc:
        raise err(str(exc)) from exc
    staged.pop("exp_avg_sq", None)
    staged.pop("exp_avg_sq_step", None)
    if extra:
        if "exp_avg_codes" not in staged:
            raise err(f"state[{name!r}] has NorMuon statistics but no momentum")
        staged.update(_stage_normuon(extra, p.shape[0], local.device, name, group, err))
    return staged


class ShardedGefenMuonHybrid(GefenMuonHybrid):
    """:class:`gefen_core.GefenMuonHybrid` under FSDP2: the Muon half is a
    :class:`ShardedGefenMuon` (``sharded_mode`` applies) and a Gefen backup is a
    :class:`gefen_dist.ShardedGefen` (global codebook and periods). An AdamW backup is
    ``torch.optim.AdamW``, which steps DTensor shards element-wise as it is.

    Same arguments and checkpoint layout (docs/algorithm.md#hybrid) as ``GefenMuonHybrid``. Every
    rank must call
    :meth:`step`, :meth:`state_dict` (distributed mode) and :meth:`load_state_dict`. With
    ``skip_nonfinite=True`` the ranks agree (one all-reduce per step) so a NaN or Inf in any
    rank's gradients skips the step of both halves on every rank
    (docs/algorithm.md#non-finite-gradients).

    Raises:
        As ``GefenMuonHybrid``, ``ShardedGefenMuon`` and ``ShardedGefen``; a checkpoint half
        rejected on any rank raises ``gefen_dist.CollectiveCheckError`` on every rank, and
        neither half is changed on any rank.
    """

    gefen_capabilities: Capabilities = SHARDED_GEFEN_MUON_CAPABILITIES
    _muon_class = ShardedGefenMuon
    _gefen_class = ShardedGefen
    _sharded_alternative = None

    def _collective(self) -> bool:
        muon = self.muon
        backup = self.backup
        return (isinstance(muon, ShardedGefenMuon) and muon._collective()) or (
            isinstance(backup, ShardedGefen) and backup._world() > 1
            and backup._has_dtensors())

    def _group(self) -> Any:
        if isinstance(self.muon, ShardedGefenMuon):
            return self.muon._dist_group
        return self.backup._dist_group if isinstance(self.backup, ShardedGefen) else None

    def _backup_preflight(self) -> None:
        # The Muon half's checks were agreed in its own preflight; agree on the backup's too.
        if not self._collective():
            super()._backup_preflight()
            return
        with agreed("ShardedGefenMuonHybrid backup checks", group=self._group()):
            super()._backup_preflight()

    def _amp_decision(self) -> tuple[bool, Any]:
        overflow, inv_scale = super()._amp_decision()
        if not self._collective():
            return overflow, inv_scale
        # GradScaler's found_inf is per rank unless the user's scaler reduces it: skip on every
        # rank when any rank overflowed.
        flag = torch.tensor([int(overflow)], dtype=torch.int32,
                            device=collective_device(self._group()))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group())
        return bool(flag.item()), inv_scale

    def _first_step_has_non_finite(self) -> bool:
        # The hybrid's "skip both halves" decision, taken on the local shards and agreed (every
        # step, so ranks whose children differ in what they still have to learn stay in step).
        if not self._collective():
            return super()._first_step_has_non_finite()
        learning = any(isinstance(c, Gefen) and c._codebook is None for c in self._children())
        bad = False
        if learning or self._skip_nonfinite:
            grads = [p.grad for g in self.param_groups for p in g["params"]
                     if p.grad is not None]
            bad = not all(bool(torch.isfinite(_local(g)).all()) for g in grads)
        flag = torch.tensor([int(bad)], dtype=torch.int32,
                            device=collective_device(self._group()))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group())
        return bool(flag.item())

    def _stage_backup(self, sd: Mapping[str, Any]) -> Any:
        # ShardedGefen's load_state_dict, minus the commit, so the hybrid can stage both halves
        # before committing either: DTensor state to compact shards, then gefen-core's staging;
        # the ranks agree on the verdict.
        backup = self.backup
        if not isinstance(backup, ShardedGefen):
            return super()._stage_backup(sd)
        from gefen_core.checkpoint import stage_load

        from .sharded import _check_no_missing_state, narrow_staged_rows

        def stage() -> Any:
            _check_no_missing_state(dict(sd))
            staged = stage_load(backup, backup._localize(dict(sd)))
            narrow_staged_rows(staged.state)
            return staged

        if not (backup._world() > 1 and backup._has_dtensors()):
            return stage()
        result = None
        with agreed("ShardedGefenMuonHybrid backup validation", group=backup._dist_group):
            result = stage()
        return result

    def _commit_backup(self, staged: Any) -> None:
        super()._commit_backup(staged)
        backup = self.backup
        if isinstance(backup, ShardedGefen):
            from .sharded import SEARCH_PERIODS_KEY

            for g in backup.param_groups:
                periods = g.get(SEARCH_PERIODS_KEY)
                if not (isinstance(periods, list) and len(periods) == len(g["params"])):
                    g[SEARCH_PERIODS_KEY] = [0] * len(g["params"])

