"""FSDP2: ShardedGefenMuon's three sharded modes (docs/algorithm.md#distributed) against a single
process.

Every rank feeds the same batch, so FSDP2's averaged gradient is exactly the single-process
gradient (see test_dist_fsdp.py). "exact" and "distributed" all-gather those gradients and run
GefenMuon's own per-matrix code on them: period search, codebook, the quantized momentum,
bf16 Newton–Schulz and NorMuon see bit-identical inputs and run the same CPU kernels in the
same order, and each rank writes a row slice of the same full update. So the strongest claim
holds and is asserted: every parameter, every loss and every momentum code is *bit-identical*
to the single process (on GPUs this needs homogeneous devices). "approx" orthogonalises row
blocks, which is a different update by construction: it must run and stay finite, and its
deviation from the single process is printed (README.md records it).

The Muon matrices include an uneven shard (``pos``, 15 rows on 2 ranks: 8 + 7) and an empty
one (``registers``, 1 row: rank 1 holds none).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _dist_models import batches, full_params, lm_loss, make_model, shard, train

from gefen_dist.testing import run_distributed

STEPS = 4
LR = 0.02
MODEL_KW = dict(dim=32, layers=1, heads=2, seq=15, extra_rows=1)
MUON_KW = dict(lr=LR, normuon=True, weight_decay=0.1)


def _muon_named(model) -> list:
    return [(n, p) for n, p in model.named_parameters()
            if p.ndim == 2 and "embed" not in n and "head" not in n]


def _data(device: str = "cpu"):
    return [(x.to(device), y.to(device)) for x, y in batches(STEPS, batch=4, seq=12, seed=5)]


def _muon_kw(device: str = "cpu") -> dict:
    # CUDA: fixed-order reductions, so two runs on equal inputs are bit-identical
    # (docs/algorithm.md#deterministic).
    return {**MUON_KW, "deterministic": True} if device == "cuda" else MUON_KW


def _reference(device: str = "cpu"):
    """Single-process GefenMuon on the same global model and data (on ``device``)."""
    from gefen_core import GefenMuon

    ref = make_model(seed=0, **MODEL_KW).to(device)
    opt = GefenMuon(_muon_named(ref), **_muon_kw(device))
    losses = train(ref, opt, _data(device))
    state = {n: dict(opt.state[p]) for n, p in _muon_named(ref)}
    return losses, full_params(ref), opt._codebook.clone(), state


def _gathered(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _snapshot(model) -> dict:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _restore(model, snap) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.to_local().copy_(snap[n])


def _resume_matches(model, opt, make_opt, data) -> bool:
    """Same-topology checkpoint: a fresh optimizer loaded from ``opt.state_dict()`` takes the
    same next step as ``opt`` itself (parameters compared bit for bit)."""
    sd = copy.deepcopy(opt.state_dict())  # state tensors are returned by reference
    snap = _snapshot(model)
    train(model, opt, data)
    after = _snapshot(model)
    _restore(model, snap)
    fresh = make_opt()
    fresh.load_state_dict(sd)
    train(model, fresh, data)
    return all(torch.equal(after[n], p.to_local()) for n, p in model.named_parameters())


def _modes_worker(rank: int, world: int, device: str = "cpu") -> dict:
    """``device="cuda"``: one GPU per rank; the single-process reference runs on this rank's
    GPU, so both sides use the same kernels on the same device type. The gather budget is cut
    to a few matrices, so exact and distributed mode run several buckets per step."""
    from gefen_dist import ShardedGefenMuon, sharded_muon

    sharded_muon._GATHER_BUCKET_BYTES = 4096

    if device == "cuda":
        torch.cuda.set_device(rank)
    muon_kw = _muon_kw(device)
    ref_losses, ref_params, ref_codebook, ref_state = _reference(device)
    muon_names = [n for n, _ in _muon_named(make_model(seed=0, **MODEL_KW))]
    init = full_params(make_model(seed=0, **MODEL_KW))
    out: dict = {"muon_names": muon_names}
    for mode in ("exact", "distributed", "approx"):
        model = shard(make_model(seed=0, **MODEL_KW).to(device))
        named = _muon_named(model)

        def make_opt(named=named, mode=mode):
            return ShardedGefenMuon(named, sharded_mode=mode, **muon_kw)

        opt = make_opt()
        losses = train(model, opt, _data(device))
        final = full_params(model)
        r: dict = {
            "local_rows": {n: p.to_local().shape[0] for n, p in named},
            "finite": all(bool(torch.isfinite(t).all()) for t in final.values()),
            "losses_equal": losses == ref_losses,
            "params_differing": sorted(n for n in muon_names
                                       if not torch.equal(final[n], ref_params[n])),
            "max_abs_param_dev": max(float((final[n] - ref_params[n]).abs().max())
                                     for n in muon_names),
            "max_rel_update_dev": max(
                float((final[n] - ref_params[n]).norm()
                      / (ref_params[n] - init[n]).norm().clamp_min(1e-30)) for n in muon_names),
            "max_rel_loss_gap": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "codebook_equal_ref": torch.equal(opt._codebook, ref_codebook),
            "codebook_same_on_ranks": len(set(_gathered(
                opt._codebook.cpu().numpy().tobytes()))) == 1,
        }
        holders = sorted(n for n, p in named if "exp_avg_codes" in opt.state.get(p, {}))
        r["momentum_holders"] = holders
        r["codes_equal_ref"] = sorted(
            n for n, p in named if n in holders
            and torch.equal(opt.state[p]["exp_avg_codes"], ref_state[n]["exp_avg_codes"])
            and torch.equal(opt.state[p]["normuon_exp_avg_sq"],
                            ref_state[n]["normuon_exp_avg_sq"]))
        r["owners"] = {n: o for n, o in zip(
            muon_names, [j % world for j in range(len(muon_names))])}
        sd = opt.state_dict()  # collective in distributed mode: complete on every rank
        by_name = dict(zip(muon_names, range(len(muon_names))))
        r["sd_complete_and_equal_ref"] = mode != "approx" and all(
            # Entries broadcast from another owner arrive on the CPU (state_dict's contract).
            by_name[n] in sd["state"] and torch.equal(
                sd["state"][by_name[n]]["exp_avg_codes"].cpu(),
                ref_state[n]["exp_avg_codes"].cpu())
            for n in muon_names)
        if mode != "approx":
            # The full state loads on another world size: here one process, plain tensors.
            from gefen_core import GefenMuon

            plain = make_model(seed=0, **MODEL_KW).to(device)
            single = GefenMuon(_muon_named(plain), **muon_kw)
            single.load_state_dict(copy.deepcopy(sd))
            r["loads_single_process"] = all(
                torch.equal(single.state[p]["exp_avg_codes"], ref_state[n]["exp_avg_codes"])
                and torch.equal(single.state[p]["normuon_exp_avg_sq"],
                                ref_state[n]["normuon_exp_avg_sq"])
                for n, p in _muon_named(plain))
        r["resume_matches"] = _resume_matches(model, opt, make_opt, _data(device)[:1])
        out[mode] = r
    return out


def _all_worker(rank: int, world: int) -> dict:
    # One spawn for every scenario: starting two interpreters and FSDP2 costs more than the
    # scenarios themselves.
    return {"modes": _modes_worker(rank, world), "failure": _failure_worker(rank, world),
            "hybrid_gefen": _hybrid_worker(rank, world, "gefen", "distributed"),
            "hybrid_adamw": _hybrid_worker(rank, world, "adamw", "exact")}


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_distributed(_all_worker, 2, timeout=240, collective_timeout=60)


@pytest.mark.timeout(300)
def test_sharded_modes_against_single_process(outcomes):
    check_modes([o["modes"] for o in outcomes])


def check_modes(results: list[dict]) -> None:
    """The assertions on :func:`_modes_worker`'s two ranks (shared with the NCCL variant in
    test_multigpu.py)."""
    names = results[0]["muon_names"]
    # The layout the test relies on: an uneven and an empty shard.
    assert [r["exact"]["local_rows"]["pos"] for r in results] == [8, 7]
    assert [r["exact"]["local_rows"]["registers"] for r in results] == [1, 0]
    for rank, res in enumerate(results):
        for mode in ("exact", "distributed"):
            r = res[mode]
            assert r["params_differing"] == [], (rank, mode, r["params_differing"])
            assert r["losses_equal"], (rank, mode)
            assert r["codebook_equal_ref"] and r["codebook_same_on_ranks"], (rank, mode)
            assert r["codes_equal_ref"] == r["momentum_holders"], (rank, mode)
            assert r["sd_complete_and_equal_ref"], (rank, mode)
            assert r["resume_matches"] and r["loads_single_process"], (rank, mode)
        # exact: full momentum replicated on every rank; distributed: owners only.
        assert res["exact"]["momentum_holders"] == sorted(names)
        owned = sorted(n for n, o in res["distributed"]["owners"].items() if o == rank)
        assert res["distributed"]["momentum_holders"] == owned, rank
        a = res["approx"]
        assert a["finite"] and a["resume_matches"], rank
        # A row block is not the full matrix: approx must differ (else it ran exact).
        assert a["params_differing"], rank
        # Momentum only where the block is non-empty (rank 1 has no "registers" rows).
        assert ("registers" in a["momentum_holders"]) == (rank == 0)
    a = results[0]["approx"]
    print(f"approx on 2 ranks vs single process after {STEPS} steps: max |dtheta| "
          f"{a['max_abs_param_dev']:.3e}, max ||dtheta|| / ||update|| "
          f"{a['max_rel_update_dev']:.3f}, max relative loss gap {a['max_rel_loss_gap']:.3e}")


def _failure_worker(rank: int, world: int) -> dict:
    from gefen_dist import CollectiveCheckError, ShardedGefenMuon

    out: dict = {}
    x, y = _data()[0]
    for mode in ("exact", "distributed"):
        model = shard(make_model(seed=0, **MODEL_KW))
        named = _muon_named(model)
        opt = ShardedGefenMuon(named, sharded_mode=mode, **MUON_KW)
        lm_loss(model, x, y).backward()
        if rank == 1:
            # A rank-local failure inside the pipeline (e.g. out of memory in Newton–Schulz).
            def boom(u, group):
                raise RuntimeError("simulated Newton-Schulz failure")

            opt._orthogonalise = boom
        try:
            opt.step()
            out[f"{mode}_pipeline"] = None
        except CollectiveCheckError as exc:
            out[f"{mode}_pipeline"] = (exc.failed_ranks, "simulated" in str(exc))
        # The ranks are still in step: the group keeps working after the agreed error.
        out[f"{mode}_alive"] = _gathered(rank) == list(range(world))
        # Gradient presence that differs across ranks fails before any gather, everywhere.
        opt = ShardedGefenMuon(named, sharded_mode=mode, **MUON_KW)
        lm_loss(model, x, y).backward()
        before = _snapshot(model)
        if rank == 0:
            named[0][1].grad = None
        try:
            opt.step()
            out[f"{mode}_presence"] = None
        except CollectiveCheckError as exc:
            out[f"{mode}_presence"] = "gradient presence" in str(exc)
        out[f"{mode}_presence_untouched"] = all(
            torch.equal(before[n], p.to_local()) for n, p in named)
    # A checkpoint rejected on one rank is refused on every rank, and nothing changes.
    model = shard(make_model(seed=0, **MODEL_KW))
    named = _muon_named(model)
    opt = ShardedGefenMuon(named, sharded_mode="distributed", **MUON_KW)
    train(model, opt, _data()[:1])
    sd = copy.deepcopy(opt.state_dict())
    live = copy.deepcopy(opt.state_dict())
    if rank == 1:
        sd["state"][0]["exp_avg_scale"] = sd["state"][0]["exp_avg_scale"][:-1]
    try:
        opt.load_state_dict(sd)
        out["load"] = None
    except CollectiveCheckError as exc:
        out["load"] = exc.failed_ranks
    after = opt.state_dict()
    out["load_untouched"] = all(
        set(after["state"][i]) == set(entry) and all(
            torch.equal(v, after["state"][i][k]) for k, v in entry.items()
            if isinstance(v, torch.Tensor)) for i, entry in live["state"].items())
    # A GradScaler overflow seen on one rank only: every rank skips the step (a rank that
    # stepped alone would wait in a gather the others never enter), both optimizers.
    from gefen_core import amp as _amp
    from gefen_dist import ShardedGefenMuonHybrid

    real = _amp.overflow_and_inverse_scale
    for kind in ("muon", "hybrid"):
        model = shard(make_model(seed=0, **MODEL_KW))
        opt = (ShardedGefenMuon(_muon_named(model), **MUON_KW) if kind == "muon"
               else ShardedGefenMuonHybrid(model, lr=3e-3))
        lm_loss(model, x, y).backward()
        before = {n: p.to_local().clone() for n, p in model.named_parameters()}
        if rank == 1:
            _amp.overflow_and_inverse_scale = lambda opt: (True, None)
        try:
            opt.step()
        finally:
            _amp.overflow_and_inverse_scale = real
        out[f"{kind}_overflow_skipped"] = all(
            torch.equal(before[n], p.to_local()) for n, p in model.named_parameters())
    # Layout errors at construction name the fix.
    model = shard(make_model(seed=0, **MODEL_KW))
    named = _muon_named(model)
    try:
        ShardedGefenMuon([{"params": named[:2], "sharded_mode": "approx"},
                          {"params": named[2:]}], **MUON_KW)
        out["mixed_modes"] = None
    except ValueError as exc:
        out["mixed_modes"] = "approx" in str(exc)
    return out


@pytest.mark.timeout(300)
def test_one_rank_failure_raises_on_every_rank(outcomes):
    results = [o["failure"] for o in outcomes]
    for rank, r in enumerate(results):
        for mode in ("exact", "distributed"):
            assert r[f"{mode}_pipeline"] == ([1], True), (rank, mode, r[f"{mode}_pipeline"])
            assert r[f"{mode}_alive"], (rank, mode)
            assert r[f"{mode}_presence"] is True, (rank, mode)
            assert r[f"{mode}_presence_untouched"], (rank, mode)
        assert r["mixed_modes"] is True, rank
        assert r["load"] == [1] and r["load_untouched"], rank
        assert r["muon_overflow_skipped"] and r["hybrid_overflow_skipped"], rank


def _hybrid_worker(rank: int, world: int, backup: str, mode: str) -> dict:
    from gefen_core import GefenMuonHybrid
    from gefen_dist import ShardedGefen, ShardedGefenMuon, ShardedGefenMuonHybrid, sharded_period

    data = _data()
    kw = dict(lr=3e-3, backup_optimizer=backup, sharded_mode=mode)
    model = shard(make_model(seed=0, **MODEL_KW))
    hyb = ShardedGefenMuonHybrid(model, **kw)
    losses = train(model, hyb, data)
    final = full_params(model)
    out: dict = {
        "children": (type(hyb.muon).__name__, type(hyb.backup).__name__),
        "muon_is_sharded": isinstance(hyb.muon, ShardedGefenMuon),
        "backup_is_sharded_gefen": isinstance(hyb.backup, ShardedGefen),
    }
    ref = make_model(seed=0, **MODEL_KW)
    ref_hyb = GefenMuonHybrid(ref, **kw)
    if backup == "gefen":
        # ShardedGefen refines each period to tile the shards; give the single process the
        # same periods (as test_dist_fsdp does) so the comparison is exact.
        search = hyb.backup.search_periods
        for g in ref_hyb.backup.param_groups:
            for p, n in zip(g["params"], g["param_names"]):
                ref_hyb.backup.state[p]["period"] = sharded_period(
                    search[n], tuple(p.shape), world)
    ref_losses = train(ref, ref_hyb, data)
    out["losses_equal"] = losses == ref_losses
    out["params_differing"] = sorted(n for n, p in ref.named_parameters()
                                     if not torch.equal(p.detach(), final[n]))
    snap = _snapshot(model)
    sd = copy.deepcopy(hyb.state_dict())
    train(model, hyb, data[:1])
    after = _snapshot(model)
    _restore(model, snap)
    fresh = ShardedGefenMuonHybrid(model, **kw)
    fresh.load_state_dict(sd)
    train(model, fresh, data[:1])
    out["resume_matches"] = all(torch.equal(after[n], p.to_local())
                                for n, p in model.named_parameters())
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_hybrid_under_fsdp2_matches_single_process(outcomes, backup):
    # Gefen backup with the distributed Muon half, AdamW backup with the exact one.
    results = [o[f"hybrid_{backup}"] for o in outcomes]
    for rank, r in enumerate(results):
        assert r["muon_is_sharded"], (rank, r["children"])
        assert r["backup_is_sharded_gefen"] == (backup == "gefen"), (rank, r["children"])
        assert r["params_differing"] == [], (rank, r["params_differing"])
        assert r["losses_equal"], rank
        assert r["resume_matches"], rank


def test_capabilities_point_fsdp2_users_to_the_sharded_classes():
    from gefen_core import GefenMuon, GefenMuonHybrid
    from gefen_dist import (
        Layout,
        ShardedGefenMuon,
        ShardedGefenMuonHybrid,
        UnsupportedCombinationError,
        check_capabilities,
    )

    for cls in (ShardedGefenMuon, ShardedGefenMuonHybrid):
        check_capabilities(cls, layout=Layout.FSDP2_SHARD0, transport="native")
        with pytest.raises(UnsupportedCombinationError, match="approx state is rank-local"):
            check_capabilities(cls, transport="dcp_reshard_exact")
    for cls in (GefenMuon, GefenMuonHybrid):
        with pytest.raises(UnsupportedCombinationError, match="ShardedGefenMuon"):
            check_capabilities(cls, layout=Layout.FSDP2_SHARD0)


def _gather_worker(rank: int, world: int) -> dict:
    """``_gather_full`` against ``full_tensor()``: uneven and empty shards, three dtypes, a
    replicated DTensor (fallback), a 1-row matrix, and a byte budget small enough to split
    the list into several buckets (and to give one matrix a bucket of its own)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gefen_dist import sharded_muon

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)  # same full tensors on every rank
    specs = [((5, 3), torch.float32, Shard(0)), ((2, 4), torch.float32, Shard(0)),
             ((7, 2), torch.bfloat16, Shard(0)), ((1, 6), torch.float32, Shard(0)),
             ((4, 4), torch.float32, Replicate()), ((64, 8), torch.float32, Shard(0)),
             ((3, 3), torch.float16, Shard(0))]
    fulls = [torch.randn(shape, generator=gen).to(dtype) for shape, dtype, _ in specs]
    dts = [distribute_tensor(t, mesh, [pl]) for t, (_, _, pl) in zip(fulls, specs)]
    sharded_muon._GATHER_BUCKET_BYTES = 200  # (64, 8) fp32 alone is 2048 bytes
    buckets = sharded_muon._gather_buckets(dts)
    got = sharded_muon._gather_full(dts)
    return {"equal": [torch.equal(a, b) and a.is_contiguous() for a, b in zip(got, fulls)],
            "dtypes_kept": [a.dtype == b.dtype for a, b in zip(got, fulls)],
            "local_rows": [d.to_local().shape[0] for d in dts], "buckets": len(buckets)}


def test_bucketed_gather_equals_full_tensor():
    res = run_distributed(_gather_worker, 3, timeout=120, collective_timeout=60)
    for r in res:
        assert all(r["equal"]) and all(r["dtypes_kept"]), r
        assert r["buckets"] >= 4, r
    # Rows 5, 2, 7 over 3 ranks: chunks of 2, 1, 3 with a short or empty last shard.
    assert [r["local_rows"][:3] for r in res] == [[2, 1, 3], [2, 1, 3], [1, 0, 1]]


def _mesh_mismatch_worker(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gefen_dist import ShardedGefenMuon

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = torch.nn.Linear(8, 6, bias=False)
    fully_shard(model, mesh=mesh["shard"])
    try:
        ShardedGefenMuon(model.parameters(), distributed_mesh=dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return "no error"


def test_distributed_mesh_must_be_the_matrices_mesh():
    """A ``distributed_mesh`` spanning other ranks than the mesh the matrices are sharded over
    (here the world, with the matrices sharded over 2 of 4 ranks) is refused at construction:
    the gathers, ownership and update exchange would otherwise disagree about the layout."""
    res = run_distributed(_mesh_mismatch_worker, 4, timeout=180, collective_timeout=90)
    for msg in res:
        assert "distributed_mesh spans ranks [0, 1, 2, 3]" in msg, msg
