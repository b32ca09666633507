"""GefenDCPState: DCP save on N ranks, load on M ranks.

* Block-aligned model (every period divides every shard, see ``ALIGNED_KW``): a run that is
  saved on N ranks and continued on M ranks ends bit-identical to the uninterrupted run.
* Small model (uneven shards, an empty shard), its one-process run a plain Gefen: a load keeps
  every saved period whose blocks tile the new shards, so 2 -> 4, 2 -> 1 and 4 -> 2 restore
  the state bit for bit; 1 -> 2 re-blocks the tensors whose single-process period does not
  tile two ranks' shards, and their restored state is checked element by element against a
  reference computed here from the saved dense state (momentum within half a codebook gap of
  the block scale; second moment equal to the fp64 mean of the saved values over the new
  block).
* A load that is malformed on one rank fails on every rank and changes nothing.
* Factored second moment (``_factored_checks``, in the same spawned ranks): native resume
  bit for bit, and GefenDCPState 2 -> 1 and 1 -> 2 restoring codes, scales, ``r`` and ``k``
  exactly.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist_models import (
    ALIGNED_KW,
    ALIGNED_OPT_KW,
    batches,
    full_params,
    make_model,
    shard,
    train,
)
from _factored_checks import check_factored_checkpoints, factored_checkpoint_jobs

from gefen_dist.testing import run_distributed

K, J = 3, 2
LR = 3e-3


def _data(kw, device: str = "cpu"):
    return [(x.to(device), y.to(device))
            for x, y in batches(K + J, batch=2, seq=kw.get("seq", 16), seed=11)]


def _setup(world: int, kw: dict, opt_kw: dict, device: str = "cpu", plain: bool = False):
    """``plain``: a plain Gefen on the unsharded model (one process), else FSDP2 +
    ShardedGefen whenever a process group exists (a 1-rank group included)."""
    from gefen_core import Gefen
    from gefen_dist import ShardedGefen

    if device == "cuda":
        # A bit-identical continuation needs a step that is a function of its inputs (the
        # fused CUDA kernels use float atomics otherwise).
        opt_kw = {**opt_kw, "deterministic": True}
    model = make_model(seed=0, **kw).to(device)
    if not plain and (world > 1 or dist.is_initialized()):
        model = shard(model)
        opt = ShardedGefen(model.named_parameters(), lr=LR, factored_v_2d=False, **opt_kw)
    else:
        opt = Gefen(model.named_parameters(), lr=LR, factored_v_2d=False, **opt_kw)
    return model, opt


def _dense_state(model, opt) -> dict:
    """Full dense momentum / second moment per parameter, built here from the compact state
    and the codebook (independent of GefenDCPState)."""
    from torch.distributed.tensor import DTensor

    out = {}
    cb = opt._codebook
    for name, p in model.named_parameters():
        st = opt.state.get(p, {})
        local = p.to_local() if isinstance(p, DTensor) else p
        if "exp_avg_codes" in st and local.numel():
            m = (cb.to(local.device)[st["exp_avg_codes"].long()]
                 * st["exp_avg_scale"]).reshape(local.shape)
            v = st["exp_avg_sq"].expand(-1, st["period"]).reshape(local.shape)
        else:
            m = torch.zeros(local.shape, device=local.device)
            v = torch.zeros(local.shape, device=local.device)
        if isinstance(p, DTensor):
            m = DTensor.from_local(m.contiguous(), p.device_mesh, p.placements, shape=p.shape,
                                   stride=p.stride()).full_tensor()
            v = DTensor.from_local(v.contiguous(), p.device_mesh, p.placements, shape=p.shape,
                                   stride=p.stride()).full_tensor()
        out[name] = (m.cpu().clone(), v.cpu().clone(), _periods_of(model, opt).get(name))
    return out


def _periods_of(model, opt) -> dict:
    """The period each parameter's state uses (``None`` before its first step)."""
    out = {}
    for g in opt.param_groups:
        for p, name in zip(g["params"], g["param_names"]):
            out[name] = opt.state.get(p, {}).get("period")
    return out


def _save(model, opt, path: str, planner: bool) -> dict:
    from gefen_dist import GefenDCPState

    state = GefenDCPState(model, opt)
    sd = {"model": model.state_dict(), "optim": state}
    if planner:
        p = state.save_planner()
        dcp.save(sd, checkpoint_id=path, planner=p)
        return {"max_dense_bytes": p.max_materialized_bytes}
    dcp.save(sd, checkpoint_id=path)
    return {}


def _load(model, opt, path: str) -> None:
    from gefen_dist import GefenDCPState

    sd = {"model": model.state_dict(), "optim": GefenDCPState(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])


def _scenario(rank: int, world: int, tmp: str, jobs: list, device: str = "cpu") -> dict:
    """Runs the listed jobs in order: ("train_save", tag) trains K steps, saves, continues J;
    ("resume", tag) loads tag's checkpoint and continues J steps. ``device="cuda"``: one GPU
    per rank; the returned tensors are on the CPU."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    out = {}
    for kind, tag, kw_name in jobs:
        if kind == "factored":
            out[("factored", world)] = factored_checkpoint_jobs(rank, world, tmp, tag)
            continue
        kw = ALIGNED_KW if kw_name == "aligned" else {}
        opt_kw = ALIGNED_OPT_KW if kw_name == "aligned" else {}
        data = _data(kw, device)
        # The small model's one-process run is a plain Gefen, whose periods are the
        # single-process ones: 1 -> 2 re-blocks the tensors they do not tile.
        model, opt = _setup(world, kw, opt_kw, device, plain=world == 1 and kw_name == "small")
        path = os.path.join(tmp, f"{tag}-{kw_name}")
        if kind == "train_save":
            train(model, opt, data[:K])
            info = _save(model, opt, path, planner=(tag != "w1"))
            dense = _dense_state(model, opt)
            train(model, opt, data[K:])
            out[(tag, kw_name)] = {"final": full_params(model), "dense": dense, **info}
        else:
            _load(model, opt, path)
            dense = _dense_state(model, opt)
            train(model, opt, data[K:])
            out[(f"{tag}-on{world}", kw_name)] = {"final": full_params(model), "dense": dense}
    return out if rank == 0 else {}


def _check_exact(saved: dict, resumed: dict) -> None:
    for name, (m, v, _) in saved["dense"].items():
        m2, v2, _ = resumed["dense"][name]
        assert torch.equal(m, m2), f"{name}: momentum not restored bit for bit"
        assert torch.equal(v, v2), f"{name}: second moment not restored bit for bit"
    for name, t in saved["final"].items():
        assert torch.equal(t, resumed["final"][name]), f"{name}: continuation differs"


def _check_reblocked(saved: dict, resumed: dict, codebook_gap: float) -> dict:
    """Reference for a re-blocked load, from the math of the module docstring."""
    errors = {}
    for name, (m, v, p_old) in saved["dense"].items():
        m2, v2, p_new = resumed["dense"][name]
        if p_old == p_new or not bool(m.any()):
            assert torch.equal(m, m2) and torch.equal(v, v2), name
            continue
        mb = m.reshape(-1, p_new)
        scale = mb.abs().amax(dim=1, keepdim=True)
        # nearest rounding in units of the new block scale: at most half the widest gap.
        bound = 0.5 * codebook_gap * scale * (1 + 1e-6) + 1e-30
        assert bool(((m2.reshape(-1, p_new) - mb).abs() <= bound).all()), name
        ref_v = v.reshape(-1, p_new).double().mean(dim=1, keepdim=True).float()
        assert torch.equal(v2.reshape(-1, p_new)[:, :1], ref_v), name
        errors[name] = (
            float((m2 - m).norm() / m.norm()),
            float((v2 - v).norm() / v.norm().clamp_min(1e-30)),
        )
    return errors


@pytest.mark.timeout(600)
def test_dcp_reshard_2_4_1_2(tmp_path):
    tmp = str(tmp_path)
    kws = ("aligned", "small")
    s2 = run_distributed(_scenario, 2, tmp, [("train_save", "w2", k) for k in kws]
                         + [("factored", ["native", "save"], None)],
                         timeout=300, collective_timeout=120)[0]
    s4 = run_distributed(_scenario, 4, tmp, [("resume", "w2", k) for k in kws]
                         + [("train_save", "w4", k) for k in kws],
                         timeout=300, collective_timeout=120)[0]
    s1 = run_distributed(_scenario, 1, tmp, [("resume", "w2", k) for k in kws]
                         + [("train_save", "w1", k) for k in kws]
                         + [("factored", ["load2", "save"], None)],
                         timeout=300, collective_timeout=120)[0]
    s2b = run_distributed(_scenario, 2, tmp, [("resume", "w4", k) for k in kws]
                          + [("resume", "w1", k) for k in kws]
                          + [("factored", ["load1"], None)],
                          timeout=300, collective_timeout=120)[0]
    check_factored_checkpoints({**s2.pop(("factored", 2)), **s2b.pop(("factored", 2))},
                               s1.pop(("factored", 1)))
    runs = {**s2, **s4, **s1, **s2b}
    moves = (("w2", "w2-on4"), ("w2", "w2-on1"), ("w4", "w4-on2"), ("w1", "w1-on2"))
    # Aligned: 2->4, 2->1, 4->2, 1->2 continue bit-identically, and the three uninterrupted
    # runs (1, 2, 4 ranks) agree with each other.
    for src, dst in moves:
        _check_exact(runs[(src, "aligned")], runs[(dst, "aligned")])
    for name, t in runs[("w2", "aligned")]["final"].items():
        assert torch.equal(t, runs[("w4", "aligned")]["final"][name])
        assert torch.equal(t, runs[("w1", "aligned")]["final"][name])
    # The planner expanded one parameter at a time: never more than the largest local shard.
    biggest = max(math.prod(t.shape) for t in runs[("w2", "aligned")]["final"].values())
    assert 0 < runs[("w2", "aligned")]["max_dense_bytes"] <= 4 * biggest
    print("re-blocked parameters (relative L2 change of the dense momentum; of the dense "
          "second moment, which is exact for a union of source blocks):")
    for src, dst in moves:
        gap = _gap_of_codebook(tmp, src)
        errs = _check_reblocked(runs[(src, "small")], runs[(dst, "small")], gap)
        # Only the plain single-process periods need re-blocking (sharded_period tiles 1, 2
        # and 4 ranks wherever the tensor allows it).
        assert bool(errs) == (src == "w1"), (src, dst, sorted(errs))
        worst_m = max((e[0] for e in errs.values()), default=0.0)
        print(f"  {src} -> {dst}: {len(errs)} re-blocked, max momentum change {worst_m:.2e}; "
              + ", ".join(f"{n} {em:.1e}/{ev:.1e}" for n, (em, ev) in sorted(errs.items())))


def _gap_of_codebook(tmp: str, tag: str) -> float:
    from torch.distributed.checkpoint import FileSystemReader

    sd = {"optim": {"codebook": torch.zeros(256)}}
    dcp.load(sd, storage_reader=FileSystemReader(os.path.join(tmp, f"{tag}-small")), no_dist=True)
    cb = sd["optim"]["codebook"]
    return float((cb[1:] - cb[:-1]).max())


def _async_worker(rank: int, world: int, tmp: str) -> dict:
    from gefen_dist import GefenDCPState, ShardedGefen
    from gefen_dist.dcp import async_stager_supported

    data = batches(5, batch=4, seq=16, seed=4)
    kw = dict(lr=3e-3, factored_v_2d=False)
    model = shard(make_model(seed=0))
    opt = ShardedGefen(model.named_parameters(), **kw)
    train(model, opt, data[:3])
    state = GefenDCPState(model, opt)
    if not async_stager_supported():
        with pytest.raises(RuntimeError, match="async_stager"):
            state.async_stager()
        return {"supported": False}
    # Its own group (docs/checkpoints.md): on the default group the save thread's collectives
    # and the step's agreement checks interleave differently per rank and hang.
    fut = dcp.async_save({"model": model.state_dict(), "optim": state},
                         checkpoint_id=os.path.join(tmp, "async"),
                         process_group=dist.new_group(backend="gloo"),
                         planner=state.save_planner(), async_stager=state.async_stager())
    train(model, opt, data[3:])  # ShardedGefen steps (collectives) while the write runs
    fut.result()
    final = full_params(model)
    model2 = shard(make_model(seed=1))
    opt2 = ShardedGefen(model2.named_parameters(), **kw)
    sd = {"model": model2.state_dict(), "optim": GefenDCPState(model2, opt2)}
    dcp.load(sd, checkpoint_id=os.path.join(tmp, "async"))
    model2.load_state_dict(sd["model"])
    train(model2, opt2, data[3:])
    return {"supported": True,
            "differing": sorted(n for n, t in full_params(model2).items()
                                if not torch.equal(t, final[n]))}


def test_async_save_on_two_ranks_while_training_resumes_exactly(tmp_path):
    """``dcp.async_save`` with its own gloo group on two ranks while ShardedGefen keeps
    stepping: the save completes (no cross-thread collective deadlock), holds the state at
    save time, and a resume from it ends bit-identical to the uninterrupted run."""
    res = run_distributed(_async_worker, 2, str(tmp_path), timeout=240, collective_timeout=120)
    for r in res:
        assert r["supported"] is False or r["differing"] == [], r
