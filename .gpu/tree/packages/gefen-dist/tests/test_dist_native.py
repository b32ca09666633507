"""Native checkpoints of ShardedGefen through torch.distributed.checkpoint.state_dict, and the
all-or-nothing load discipline, on 2 gloo ranks.

* ``get_optimizer_state_dict(full_state_dict=True)`` -> a fresh optimizer through
  ``set_optimizer_state_dict`` -> continuation bit-identical to the uninterrupted run;
* sharded ``get``/``set`` round trip on the same topology (roll back and replay);
* a checkpoint malformed on one rank only raises on every rank and changes nothing anywhere;
* a GefenDCPState load that fails on one rank raises on every rank and changes nothing;
* sharded DCP files loaded into a fresh optimizer restore exactly or fail loudly.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist_models import batches, full_params, make_model, shard, train
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from gefen_dist.testing import run_distributed

K, J = 3, 2
LR = 3e-3


def _fresh(device: str = "cpu"):
    """``device="cuda"`` adds ``deterministic=True``: a bit-identical continuation needs a step
    that is a function of its inputs (the fused CUDA kernels use float atomics otherwise)."""
    from gefen_dist import ShardedGefen

    opt_kw = {"deterministic": True} if device == "cuda" else {}
    model = shard(make_model(seed=0).to(device))
    return model, ShardedGefen(model.named_parameters(), lr=LR, factored_v_2d=False, **opt_kw)


def _local_state(opt) -> dict:
    out = {}
    for g in opt.param_groups:
        for p, name in zip(g["params"], g["param_names"]):
            for k, v in opt.state.get(p, {}).items():
                out[(name, k)] = v.clone() if isinstance(v, torch.Tensor) else v
    out["T"] = opt._global_step
    out["codebook"] = None if opt._codebook is None else opt._codebook.clone()
    out["lr"] = [g["lr"] for g in opt.param_groups]
    return out


def _diff(a: dict, b: dict) -> list:
    """Keys whose values differ (dtype, shape or any bit); [] when identical."""
    out = sorted(map(str, a.keys() ^ b.keys()))
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.dtype == y.dtype and torch.equal(x, y)):
                out.append(str(k))
        elif x != y:
            out.append(str(k))
    return out


def _catch(fn) -> str | None:
    try:
        fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return f"{type(exc).__name__}: {exc}"
    return None


def _native_worker(rank: int, world: int, tmp: str, device: str = "cpu") -> dict:
    """``device="cuda"``: one GPU per rank (``torch.cuda.set_device(rank)``)."""
    from gefen_dist import GefenDCPState

    if device == "cuda":
        torch.cuda.set_device(rank)
    data = [(x.to(device), y.to(device)) for x, y in batches(K + J, batch=2, seq=16, seed=21)]
    out: dict = {}
    model, opt = _fresh(device)
    train(model, opt, data[:K])
    # Copies, as torch.save would make: state dicts hold live tensors by reference.
    full = copy.deepcopy(
        get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)))
    sharded = copy.deepcopy(get_optimizer_state_dict(model, opt))
    snapshot = _local_state(opt)
    dcp.save({"optim": GefenDCPState(model, opt)}, checkpoint_id=os.path.join(tmp, "ck"))
    train(model, opt, data[K:])
    reference = full_params(model)

    # (a) full state -> fresh optimizer -> identical continuation.
    model2, opt2 = _fresh(device)
    set_optimizer_state_dict(model2, opt2, full,
                             options=StateDictOptions(full_state_dict=True))
    out["full_state_restored"] = _diff(snapshot, _local_state(opt2))
    model2.load_state_dict(_model_at_k(data, device))
    train(model2, opt2, data[K:])
    out["full_state_continuation_exact"] = all(
        torch.equal(t, reference[n]) for n, t in full_params(model2).items())

    # (a) sharded round trip on the same topology: roll back to step K and replay.
    set_optimizer_state_dict(model, opt, sharded)
    out["sharded_restored"] = _diff(snapshot, _local_state(opt))

    # (d) one rank gets a malformed checkpoint: every rank raises, nothing changes anywhere.
    before = _local_state(opt)
    bad = copy.deepcopy(sharded)
    if rank == 1:
        fqn = next(k for k, v in bad["state"].items() if "exp_avg_scale" in v)
        bad["state"][fqn]["exp_avg_scale"] = bad["state"][fqn]["exp_avg_scale"] * -1 - 1
    out["corrupt_one_rank_error"] = _catch(lambda: set_optimizer_state_dict(model, opt, bad))
    out["corrupt_one_rank_unchanged"] = _diff(before, _local_state(opt))

    # (d) a GefenDCPState load that fails on one rank only.
    state = GefenDCPState(model, opt)
    dest = state.state_dict()
    dcp.load({"optim": dest}, checkpoint_id=os.path.join(tmp, "ck"))
    if rank == 0:
        dest["slots"]["head.weight"]["momentum"].to_local().view(-1)[0] = float("nan")
    out["dcp_one_rank_error"] = _catch(lambda: state.load_state_dict(dest))
    out["dcp_one_rank_unchanged"] = _diff(before, _local_state(opt))

    # Sharded DCP files into a fresh optimizer: torch initialises it with a zero-gradient step,
    # whose periods shape the destinations. Where they differ from the saved ones the load
    # fails loudly (never a silent mix); where they match it restores exactly.
    model3, opt3 = _fresh(device)
    osd3 = get_optimizer_state_dict(model3, opt3)
    dcp.save({"optim": sharded}, checkpoint_id=os.path.join(tmp, "sharded"))

    def load3():
        dcp.load({"optim": osd3}, checkpoint_id=os.path.join(tmp, "sharded"))
        set_optimizer_state_dict(model3, opt3, osd3)

    out["fresh_sharded_error"] = _catch(load3)
    out["fresh_sharded_exact"] = out["fresh_sharded_error"] is None and not _diff(
        snapshot, _local_state(opt3))
    return out


def _model_at_k(data, device: str = "cpu"):
    """The model weights after K steps, replayed (the model is not the optimizer's concern)."""
    model, opt = _fresh(device)
    train(model, opt, data[:K])
    return model.state_dict()


@pytest.mark.timeout(400)
def test_native_checkpoints_and_one_rank_failures(tmp_path):
    results = run_distributed(_native_worker, 2, str(tmp_path), timeout=360,
                              collective_timeout=120)
    check_native(results)


def check_native(results: list[dict]) -> None:
    """The assertions on :func:`_native_worker`'s two ranks (shared with the NCCL variant in
    test_multigpu.py)."""
    for rank, r in enumerate(results):
        assert r["full_state_restored"] == [], (rank, r["full_state_restored"])
        assert r["full_state_continuation_exact"], rank
        assert r["sharded_restored"] == [], (rank, r["sharded_restored"])
        assert r["corrupt_one_rank_error"] and "rank(s) [1]" in r["corrupt_one_rank_error"], r
        assert r["corrupt_one_rank_unchanged"] == [], (rank, r["corrupt_one_rank_unchanged"])
        assert r["dcp_one_rank_error"] and "rank(s) [0]" in r["dcp_one_rank_error"], r
        assert "non-finite" in r["dcp_one_rank_error"]
        assert r["dcp_one_rank_unchanged"] == [], (rank, r["dcp_one_rank_unchanged"])
        assert r["fresh_sharded_exact"] or "Size mismatch" in r["fresh_sharded_error"], r
    assert results[0]["corrupt_one_rank_error"] == results[1]["corrupt_one_rank_error"]
