"""Checks of ShardedGefen's factored second moment (docs/algorithm.md#factored-second-moment) on
FSDP2, run inside the spawned ranks of ``test_dist_fsdp.py`` (2 and 4 ranks) and
``test_dist_dcp.py`` (1 and 2 ranks), whose process groups they share so that the suite pays no
extra spawns. The row/column statistics must be those of the global matrix.

The reference is a single-process ``gefen_core.Gefen`` on the same global model, with the
periods the shard layout uses, fed every step the gradient that FSDP2 produced (gathered), so
the two optimizers see identical inputs and every difference comes from the optimizer:

* momentum codes and scales, and the row statistics ``r`` restricted to the rank's rows, must
  be bit-identical (they depend on whole rows only);
* the column statistics ``k`` are identical on every rank (empty shards included) and equal
  the reference's up to the reordering of the fp32 column sums: a sum of ``n`` non-negative
  fp32 terms in any order is within ``(n - 1) u`` (``u = 2**-24``) of the exact sum relative
  to it, so two orders over ``R`` rows plus ``W`` shard partials differ by at most
  ``(2R + W) u`` relative; the EMA is a convex combination, so the bound does not grow with
  the step count beyond the ``4 u`` per step its own roundings add;
* parameters differ only through ``sigma`` (``V = r k / rbar``), so each step adds at most
  ``|update| * (eps_k + eps_rbar + 8 u)`` plus one ulp of the parameter per rounding; the test
  accumulates that bound from the reference's own updates.

It also checks: uneven shards and an empty shard, that a failure on one rank before the
all-reduce raises on every rank and changes nothing, native resume (full and sharded state
dicts) bit for bit, and GefenDCPState 2 -> 1 and 1 -> 2 restoring the factored state exactly.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist_models import (
    ALIGNED_KW,
    ALIGNED_OPT_KW,
    batches,
    full_params,
    gloo_avg_sums,
    lm_loss,
    make_model,
    shard,
    train,
)

STEPS = 3
LR = 3e-3
U = 2.0 ** -24
K_SAVE, J_MORE = 2, 1


def _gathered(obj) -> list:
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs


def _fsdp_step(model, opt, x, y) -> tuple[float, dict[str, torch.Tensor]]:
    """One FSDP2 step; returns the loss and the gathered (global) gradients it used."""
    opt.zero_grad(set_to_none=True)
    loss = lm_loss(model, x, y)
    loss.backward()
    if gloo_avg_sums():  # see _dist_models.train
        for p in model.parameters():
            p.grad.div_(dist.get_world_size())
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    opt.step()
    return loss.item(), grads


def _rows_of(p) -> tuple[int, int]:
    from gefen_dist.sharded import _row_range

    return _row_range(p)


def factored_training(rank: int, world: int) -> dict:
    """FSDP2 training against the lock-stepped single-process reference, then a one-rank
    failure before the all-reduce (see the module docstring)."""
    from gefen_core import Gefen
    from gefen_dist import ShardedGefen, sharded_period

    data = batches(STEPS, batch=4, seq=16, seed=3)
    model = shard(make_model(seed=0))
    # min_dim_size_to_factor = 0: every matrix of the tiny model factored (the default of 128
    # would keep them all per-block).
    opt = ShardedGefen(model.named_parameters(), lr=LR, min_dim_size_to_factor=0)
    ref = make_model(seed=0)
    ref_opt = Gefen(ref.named_parameters(), lr=LR, min_dim_size_to_factor=0)
    fsdp = dict(model.named_parameters())
    # The factoring rule reads the global shape (docs/algorithm.md#factoring-rule): registers
    # [3, 32] has at most 2 rows on a rank but 3 in all.
    from gefen_core import dispatch as _dispatch

    rule = {"factored_v_2d": True, "min_dim_size_to_factor": 3}
    out_rule = [_dispatch.is_factored(fsdp["registers"], rule, sharded=True),
                _dispatch.is_factored(fsdp["registers"], {**rule, "min_dim_size_to_factor": 4},
                                      sharded=True)]
    plain = dict(ref.named_parameters())
    mats = [n for n, p in fsdp.items() if p.ndim == 2]
    out: dict = {}
    bound = {n: torch.zeros(fsdp[n].to_local().shape) for n in mats}
    worst = {"k_rel_over_bound": 0.0, "param_over_bound": 0.0, "k_max_rel": 0.0,
             "param_max_abs": 0.0}
    mismatches: list[str] = []
    k_same_everywhere = True
    for t, (x, y) in enumerate(data, start=1):
        before = {n: plain[n].detach().clone() for n in mats}
        _, grads = _fsdp_step(model, opt, x, y)
        if t == 1:
            for n, p in plain.items():
                ref_opt.state[p]["period"] = sharded_period(
                    opt.search_periods[n], tuple(fsdp[n].shape), world)
        for n, p in plain.items():
            p.grad = grads[n]
        ref_opt.step()
        for n in mats:
            p, q = fsdp[n], plain[n]
            st, rst = opt.state[p], ref_opt.state[q]
            start, rows = _rows_of(p)
            cols = q.shape[1]
            k_same_everywhere &= len({bytes(k.numpy().tobytes()) for k in
                                      _gathered(st["exp_avg_sq_col"].clone())}) == 1
            if rows == 0:
                assert st["exp_avg_sq_row"].numel() == 0
                continue
            lo, hi = start * cols, (start + rows) * cols
            if not torch.equal(st["exp_avg_codes"].reshape(-1),
                               rst["exp_avg_codes"].reshape(-1)[lo:hi]):
                mismatches.append(f"step {t} {n} codes")
            period = st["period"]
            if not torch.equal(st["exp_avg_scale"].reshape(-1),
                               rst["exp_avg_scale"].reshape(-1)[lo // period:hi // period]):
                mismatches.append(f"step {t} {n} scale")
            if not torch.equal(st["exp_avg_sq_row"], rst["exp_avg_sq_row"][start:start + rows]):
                mismatches.append(f"step {t} {n} row statistics")
            r_global = q.shape[0]
            eps_k = (2 * r_global + world + 4 * t) * U
            k, k_ref = st["exp_avg_sq_col"], rst["exp_avg_sq_col"]
            rel = ((k - k_ref).abs() / k_ref.clamp_min(1e-38)).max().item()
            worst["k_max_rel"] = max(worst["k_max_rel"], rel)
            worst["k_rel_over_bound"] = max(worst["k_rel_over_bound"], rel / eps_k)
            # sigma ~ V**-1/2: half the relative error of V = r k / rbar, plus its roundings.
            eta = 0.5 * (eps_k + (r_global + world + 4 * t) * U) + 8 * U
            new = q.detach()[start:start + rows]
            update = (new - before[n][start:start + rows]).abs()
            bound[n] += update * eta + 2 * torch.finfo(torch.float32).eps * new.abs() + 1e-45
            diff = (p.detach().to_local() - new).abs()
            worst["param_max_abs"] = max(worst["param_max_abs"], diff.max().item())
            worst["param_over_bound"] = max(worst["param_over_bound"],
                                            (diff / bound[n]).max().item())
    out.update(worst)
    out["rule_on_global_shape"] = out_rule
    out["factored"] = sorted(n for n in mats if "exp_avg_sq_row" in opt.state[fsdp[n]]
                             and "exp_avg_sq" not in opt.state[fsdp[n]])
    out["mismatches"] = mismatches
    out["k_same_on_every_rank"] = k_same_everywhere
    out["codebook_equal"] = torch.equal(opt._codebook, ref_opt._codebook)
    out["empty_shards"] = sorted(n for n, p in fsdp.items() if p.to_local().numel() == 0)
    out["uneven"] = sorted(n for n in mats if fsdp[n].shape[0] % world)

    # A failure on one rank before the all-reduce: every rank raises, nothing changes.
    snapshot = {n: (fsdp[n].detach().to_local().clone(),
                    {k: v.clone() for k, v in opt.state[fsdp[n]].items()
                     if isinstance(v, torch.Tensor)}) for n in mats}
    if rank == 1:
        st = opt.state[fsdp["head.weight"]]
        st["exp_avg_sq_col"] = torch.zeros(st["exp_avg_sq_col"].numel() + 1)
    x, y = data[0]
    opt.zero_grad(set_to_none=True)
    lm_loss(model, x, y).backward()
    try:
        opt.step()
        out["failure_error"] = None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        out["failure_error"] = f"{type(exc).__name__}: {exc}"
    if rank == 1:
        opt.state[fsdp["head.weight"]]["exp_avg_sq_col"] = \
            snapshot["head.weight"][1]["exp_avg_sq_col"]
    out["failure_changed"] = sorted(
        n for n in mats if not torch.equal(fsdp[n].detach().to_local(), snapshot[n][0])
        or any(not torch.equal(opt.state[fsdp[n]][k], v) for k, v in snapshot[n][1].items()))
    return out


def check_factored_training(results: list[dict], world: int) -> None:
    """Assertions on :func:`factored_training`'s per-rank results."""
    for rank, r in enumerate(results):
        assert r["mismatches"] == [], (rank, r["mismatches"])
        assert r["k_same_on_every_rank"], rank
        assert r["codebook_equal"], rank
        assert r["k_rel_over_bound"] <= 1.0, (rank, r["k_max_rel"])
        assert r["param_over_bound"] <= 1.0, (rank, r["param_max_abs"])
        assert r["failure_error"] and "CollectiveCheckError" in r["failure_error"], r
        assert "rank(s) [1]" in r["failure_error"] and "exp_avg_sq_col" in r["failure_error"]
        assert r["failure_changed"] == [], (rank, r["failure_changed"])
        assert r["rule_on_global_shape"] == [True, False], rank
    assert len({r["failure_error"] for r in results}) == 1
    # Every 2-D parameter is factored; registers [3, 32]: uneven on 2 ranks, empty on rank 3
    # of 4 (which still joins every all-reduce and keeps k).
    assert "registers" in results[0]["factored"] and "head.weight" in results[0]["factored"]
    if world == 2:
        assert "registers" in results[0]["uneven"]
    if world == 4:
        assert results[3]["empty_shards"] == ["registers"]
    print(f"factored, world {world}: max relative k difference "
          f"{max(r['k_max_rel'] for r in results):.2e}, max parameter difference "
          f"{max(r['param_max_abs'] for r in results):.2e} (both within the derived bounds)")


# ------------------------------------------------------------------------------ checkpoints
def _aligned(world: int):
    from gefen_core import Gefen
    from gefen_dist import ShardedGefen

    model = make_model(seed=0, **ALIGNED_KW)
    if dist.is_initialized():
        model = shard(model)
        return model, ShardedGefen(model.named_parameters(), lr=LR, **ALIGNED_OPT_KW)
    return model, Gefen(model.named_parameters(), lr=LR, **ALIGNED_OPT_KW)


def _global_state(model, opt) -> dict:
    """Every parameter's state gathered to global tensors (codes, scales, r, k)."""
    from torch.distributed.tensor import DTensor

    out = {}
    world = dist.get_world_size()
    for name, p in model.named_parameters():
        st = opt.state[p]
        for key in ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_row"):
            if key not in st:
                continue
            parts = _gathered(st[key].reshape(-1).clone())
            out[(name, key)] = torch.cat(parts) if isinstance(p, DTensor) and world > 1 \
                else parts[0]
        if "exp_avg_sq_col" in st:
            out[(name, "exp_avg_sq_col")] = st["exp_avg_sq_col"].clone()
        out[(name, "step")] = float(st["step"])
    return out


def factored_checkpoint_jobs(rank: int, world: int, tmp: str, jobs: list) -> dict:
    """``native``: full and sharded native round trips; ``save``: train and write a
    GefenDCPState checkpoint (and the global state for comparison); ``load<W>``: restore the
    one written on W ranks. Results are global (identical on every rank)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from gefen_dist import GefenDCPState

    data = batches(K_SAVE + J_MORE, batch=2, seq=16, seed=11)
    out: dict = {}
    for job in jobs:
        model, opt = _aligned(world)
        if job == "native":
            train(model, opt, data[:K_SAVE])
            full = copy.deepcopy(get_optimizer_state_dict(
                model, opt, options=StateDictOptions(full_state_dict=True)))
            sharded = copy.deepcopy(get_optimizer_state_dict(model, opt))
            saved = _global_state(model, opt)
            model_k = copy.deepcopy(model.state_dict())
            train(model, opt, data[K_SAVE:])
            final = full_params(model)
            model2, opt2 = _aligned(world)
            set_optimizer_state_dict(model2, opt2, full,
                                     options=StateDictOptions(full_state_dict=True))
            out["native_full_restored"] = _same(saved, _global_state(model2, opt2))
            model2.load_state_dict(model_k)
            train(model2, opt2, data[K_SAVE:])
            out["native_full_continuation"] = all(
                torch.equal(t, final[n]) for n, t in full_params(model2).items())
            set_optimizer_state_dict(model, opt, sharded)
            out["native_sharded_restored"] = _same(saved, _global_state(model, opt))
        elif job.startswith("save"):
            train(model, opt, data[:K_SAVE])
            state = GefenDCPState(model, opt)
            dcp.save({"optim": state}, checkpoint_id=os.path.join(tmp, f"factored-w{world}"),
                     planner=state.save_planner())
            saved = _global_state(model, opt)  # collective
            if rank == 0:
                torch.save(saved, os.path.join(tmp, f"factored-w{world}.pt"))
        else:  # "load<W>": restore the checkpoint written on W ranks
            src = job[len("load"):]
            state = GefenDCPState(model, opt)
            dest = {"optim": state}
            dcp.load(dest, checkpoint_id=os.path.join(tmp, f"factored-w{src}"))
            # The optimizer's state must exist before comparing: it is restored by the load.
            saved = torch.load(os.path.join(tmp, f"factored-w{src}.pt"))
            out[f"dcp_from_{src}"] = _same(saved, _global_state(model, opt))
            out[f"dcp_from_{src}_trains"] = all(
                v == v for v in train(model, opt, data[K_SAVE:]))
    return out


def _same(a: dict, b: dict) -> list:
    diff = sorted(map(str, a.keys() ^ b.keys()))
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        if not same:
            diff.append(str(k))
    return diff


def check_factored_checkpoints(r2: dict, r1: dict) -> None:
    """Assertions on the 2-rank (``native``, ``load1``) and 1-rank (``load2``) results."""
    assert r2["native_full_restored"] == [], r2["native_full_restored"]
    assert r2["native_full_continuation"]
    assert r2["native_sharded_restored"] == [], r2["native_sharded_restored"]
    assert r2["dcp_from_1"] == [], r2["dcp_from_1"]
    assert r2["dcp_from_1_trains"]
    assert r1["dcp_from_2"] == [], r1["dcp_from_2"]
    assert r1["dcp_from_2_trains"]
