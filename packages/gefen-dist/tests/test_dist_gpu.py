"""GPU (world size 1, NCCL for CUDA and gloo for CPU tensors): FSDP2 + ShardedGefen with the
fused kernels (per-block and factored second moment), against a single-process Gefen with the
same periods; a DCP round trip (sync with the planner, and async) that continues
bit-identically.

``deterministic=True`` on both sides: the fused factored/two-phase kernels use float atomics
otherwise (docs/algorithm.md#deterministic), which would make even two single-process runs differ at
ulp level.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist_models import batches, full_params, lm_loss, make_model, shard, train

from gefen_dist.testing import run_distributed

K, J = 3, 2


def _gpu_worker(rank: int, world: int, tmp: str, factored: bool) -> dict:
    from gefen_core import Gefen
    from gefen_dist import GefenDCPState, ShardedGefen

    torch.cuda.set_device(rank)
    data = [(x.cuda(), y.cuda()) for x, y in batches(K + J, batch=4, seq=16, seed=4)]
    kw = dict(lr=3e-3, factored_v_2d=factored, min_dim_size_to_factor=0,
              deterministic=True)

    model = shard(make_model(seed=0).cuda())
    opt = ShardedGefen(model.named_parameters(), **kw)
    paths = set(opt.step_paths().values())
    train(model, opt, data[:K])
    state = GefenDCPState(model, opt)
    planner = state.save_planner()
    dcp.save({"model": model.state_dict(), "optim": state},
             checkpoint_id=os.path.join(tmp, "sync"), planner=planner)
    state2 = GefenDCPState(model, opt)
    # The save's background thread runs collectives while the training thread steps (whose
    # ShardedGefen agreement checks use the default group's gloo side): as torch's async
    # recipe does, the checkpoint gets its own group, or the two threads' collectives on one
    # gloo group interleave differently on each rank and deadlock (seen on two GPUs).
    ckpt_group = dist.new_group(backend="gloo")
    fut = dcp.async_save({"model": model.state_dict(), "optim": state2},
                         checkpoint_id=os.path.join(tmp, "async"), process_group=ckpt_group,
                         planner=state2.save_planner(), async_stager=state2.async_stager())
    train(model, opt, data[K:])   # training continues while the async write runs
    fut.result()
    final = full_params(model)

    ref = make_model(seed=0).cuda()
    ref_opt = Gefen(ref.named_parameters(), **kw)
    for p, q in zip(ref.parameters(), model.parameters()):
        ref_opt.state[p]["period"] = opt.state[q]["period"]
    train(ref, ref_opt, data)
    out = {"paths": sorted(paths),
           "matches_single_process": all(torch.equal(p.detach().cpu(), final[n])
                                         for n, p in ref.named_parameters())}
    for tag in ("sync", "async"):
        m2 = shard(make_model(seed=1).cuda())
        o2 = ShardedGefen(m2.named_parameters(), **kw)
        sd = {"model": m2.state_dict(), "optim": GefenDCPState(m2, o2)}
        dcp.load(sd, checkpoint_id=os.path.join(tmp, tag))
        m2.load_state_dict(sd["model"])
        train(m2, o2, data[K:])
        out[f"{tag}_resume_exact"] = all(torch.equal(t, final[n])
                                         for n, t in full_params(m2).items())
    return out


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("factored", [False, True], ids=["block", "factored"])
def test_gpu_fsdp2_nccl_world1_matches_and_resumes(tmp_path, factored):
    """``factored``: 2-D shards take the factored second moment from all-reduced row/column
    statistics (the two-call partial-stats + finalize kernels), which must equal the one-call
    factored step of a single-process Gefen bit for bit when the shard is the whole matrix."""
    r = run_distributed(_gpu_worker, 1, str(tmp_path), factored, backend="cpu:gloo,cuda:nccl",
                        timeout=500, collective_timeout=240)[0]
    # deterministic=True routes factored parameters to the reference ops on CUDA ("foreach",
    # decision O12); everything else takes the Triton kernels.
    assert r["paths"] == (["foreach", "fused"] if factored else ["fused"]), r["paths"]
    assert r["matches_single_process"]
    assert r["sync_resume_exact"] and r["async_resume_exact"], r


def _muon_gpu_worker(rank: int, world: int, backup: str) -> dict:
    from gefen_core import GefenMuonHybrid
    from gefen_dist import ShardedGefenMuon, ShardedGefenMuonHybrid, sharded_period

    torch.cuda.set_device(rank)
    data = [(x.cuda(), y.cuda()) for x, y in batches(K + J, batch=4, seq=16, seed=4)]
    kw = dict(lr=3e-3, backup_optimizer=backup, sharded_mode="exact", fused=True,
              deterministic=True)
    model = shard(make_model(seed=0).cuda())
    hyb = ShardedGefenMuonHybrid(model, **kw)
    losses = train(model, hyb, data)
    final = full_params(model)
    ref = make_model(seed=0).cuda()
    ref_hyb = GefenMuonHybrid(ref, **kw)
    if backup == "gefen":  # the same shard-aligned periods, as in the Gefen test above
        for g in ref_hyb.backup.param_groups:
            for p, n in zip(g["params"], g["param_names"]):
                ref_hyb.backup.state[p]["period"] = sharded_period(
                    hyb.backup.search_periods[n], tuple(p.shape), world)
    ref_losses = train(ref, ref_hyb, data)
    return {"muon_is_sharded": isinstance(hyb.muon, ShardedGefenMuon),
            "muon_paths": sorted(set(hyb.muon.step_paths().values())),
            "losses_equal": losses == ref_losses,
            "params_differing": sorted(n for n, p in ref.named_parameters()
                                       if not torch.equal(p.detach().cpu(), final[n]))}


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_gpu_sharded_muon_hybrid_nccl_world1_matches_single_process(tmp_path, backup):
    """ShardedGefenMuonHybrid (exact mode, fused Muon momentum kernel) on FSDP2 with NCCL equals
    the single-process GefenMuonHybrid on the same GPU bit for bit."""
    r = run_distributed(_muon_gpu_worker, 1, backup, backend="cpu:gloo,cuda:nccl",
                        timeout=500, collective_timeout=240)[0]
    assert r["muon_is_sharded"] and r["muon_paths"] == ["fused"], r
    assert r["params_differing"] == [] and r["losses_equal"], r


def _llama_gpu_worker(rank: int, world: int, tmp: str, device: str = "cuda") -> dict:
    """test_dist_llama's checks on one GPU with an NCCL group: the fused kernels, DTensor
    shards on CUDA and GefenDCPState between FSDP2 and a plain process on the same GPU."""
    from _dist_models import make_llama, shard_llama
    from test_dist_llama import _load, _local_state, _same, _save

    from gefen_core import Gefen
    from gefen_dist import ShardedGefen, UnsupportedCombinationError, check_capabilities

    if device == "cuda":
        torch.cuda.set_device(rank)
    data = [(x.to(device), y.to(device)) for x, y in batches(K + J, batch=2, seq=16, seed=21)]
    # default factored_v_2d; the tiny Llama's matrices are below the default factoring size
    kw = dict(lr=3e-3, deterministic=True, min_dim_size_to_factor=0)
    out: dict = {}
    model = shard_llama(make_llama(0).to(device))
    try:
        Gefen(model.named_parameters(), **kw)
    except ValueError as exc:
        out["refused"] = "ShardedGefen" in str(exc)
    opt = ShardedGefen(model.named_parameters(), skip_nonfinite=True, **kw)
    check_capabilities(opt, transport="dcp_reshard_exact")
    out["paths"] = sorted(set(opt.step_paths().values()))
    train(model, opt, data[:2])
    before = _local_state(opt)
    opt.zero_grad()
    lm_loss(model, *data[2]).backward()
    next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("nan")
    opt.step()
    out["skipped"] = opt.last_step_skipped and _same(before, _local_state(opt))
    train(model, opt, data[2:K])
    _save(model, opt, os.path.join(tmp, "fsdp"))
    plain = make_llama(1).to(device)
    plain_opt = Gefen(plain.named_parameters(), **kw)
    _load(plain, plain_opt, os.path.join(tmp, "fsdp"))
    _save(plain, plain_opt, os.path.join(tmp, "fsdp-on-plain"))
    out["plain_trains"] = all(math.isfinite(v) for v in train(plain, plain_opt, data[K:]))
    back = shard_llama(make_llama(2).to(device))
    back_opt = ShardedGefen(back.named_parameters(), **kw)
    _load(back, back_opt, os.path.join(tmp, "fsdp-on-plain"))
    _save(back, back_opt, os.path.join(tmp, "plain-on-fsdp"))
    out["fsdp_trains"] = all(math.isfinite(v) for v in train(back, back_opt, data[K:]))
    try:
        check_capabilities(Gefen(make_llama(0).to(device).parameters(), capturable=True),
                           transport="dcp_reshard_exact")
    except UnsupportedCombinationError:
        out["capturable_refused"] = True
    return out


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_llama_nccl_world1_skip_and_checkpoints_between_fsdp2_and_plain(tmp_path):
    """One GPU, NCCL: plain Gefen refused on FSDP2 shards; skip_nonfinite on the fused path
    skips a NaN step with nothing changed; an FSDP2 checkpoint (factored, the default) loads
    into a plain Gefen on the same GPU and back, each re-save bit-identical (on one rank every
    saved period tiles), and both continue training."""
    from test_dist_llama import _read

    tmp = str(tmp_path)
    r = run_distributed(_llama_gpu_worker, 1, tmp, backend="cpu:gloo,cuda:nccl",
                        timeout=500, collective_timeout=240)[0]
    assert r.get("refused") and r.get("capturable_refused"), r
    assert r["paths"] == ["foreach", "fused"], r  # deterministic: factored on the reference
    assert r["skipped"] and r["plain_trains"] and r["fsdp_trains"], r
    for a, b in (("fsdp", "fsdp-on-plain"), ("fsdp-on-plain", "plain-on-fsdp")):
        sa, sb = _read(os.path.join(tmp, a)), _read(os.path.join(tmp, b))
        assert torch.equal(sa["codebook"], sb["codebook"])
        for name, slot in sa["slots"].items():
            for key, value in slot.items():
                other = sb["slots"][name][key]
                same = torch.equal(value, other) if isinstance(value, torch.Tensor) \
                    else value == other
                assert same, (a, b, name, key)
