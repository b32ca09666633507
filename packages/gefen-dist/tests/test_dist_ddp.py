"""DDP: Gefen needs no distributed code; replicas stay bit-identical across ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist_models import batches, lm_loss, make_model
from torch.nn.parallel import DistributedDataParallel as DDP

from gefen_dist.testing import run_distributed

STEPS = 4


def _ddp_worker(rank: int, world: int, device: str = "cpu", tmp: str | None = None) -> dict:
    """``device="cuda"``: one GPU per rank (NCCL group), and ``deterministic=True`` because
    replica identity needs every rank's optimizer step to be a function of its inputs only
    (the fused CUDA kernels use float atomics otherwise, docs/algorithm.md#deterministic).
    ``tmp``: also save a
    GefenDCPState checkpoint of the replicas there (default options: factored matrices)."""
    from gefen_core import Gefen

    opt_kw: dict = {}
    if device == "cuda":
        torch.cuda.set_device(rank)
        opt_kw["deterministic"] = True
    model = make_model(seed=0).to(device)
    model = DDP(model, device_ids=[rank]) if device == "cuda" else DDP(model)
    # The tiny model's matrices are factored, so the checkpoint carries row and column statistics.
    opt = Gefen(model.module.named_parameters(), lr=3e-3, min_dim_size_to_factor=0, **opt_kw)
    # Each rank sees different data; DDP averages the gradients.
    data = batches(STEPS, batch=4, seq=16, seed=100 + rank)
    losses = []
    for x, y in data:
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Compare every parameter and every state tensor across ranks, bit for bit.
    tensors = [p.detach().clone() for p in model.parameters()]
    sd = opt.state_dict()
    for i in sorted(sd["state"]):
        for key in sorted(sd["state"][i]):
            v = sd["state"][i][key]
            if isinstance(v, torch.Tensor):
                tensors.append(v.detach().clone().reshape(-1).view(torch.uint8)
                               if v.dtype != torch.uint8 else v.reshape(-1))
            else:
                tensors.append(torch.tensor([int(v)], device=device))
    tensors.append(sd["gefen_meta"]["codebook"].clone())
    differs = []
    for j, t in enumerate(tensors):
        t = t.reshape(-1).view(torch.uint8) if t.is_floating_point() else t.reshape(-1)
        t = t.to(torch.int64)
        lo, hi = t.clone(), t.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if not torch.equal(lo, hi):
            differs.append(j)
    out = {"differs": differs, "n": len(tensors), "losses": losses,
           "codes": sum(int("exp_avg_codes" in s) for s in sd["state"].values())}
    if tmp is not None:
        import torch.distributed.checkpoint as dcp

        from gefen_dist import GefenDCPState

        dcp.save({"optim": GefenDCPState(model.module, opt)}, checkpoint_id=tmp)
        out["state"] = {n: {k: v.clone() if isinstance(v, torch.Tensor) else v
                            for k, v in opt.state[p].items()}
                        for n, p in model.module.named_parameters()}
    return out


@pytest.mark.timeout(180)
def test_ddp_replicas_stay_bit_identical(tmp_path):
    """Also: the replicas' GefenDCPState checkpoint loads into one process bit for bit (a
    replica's matrix statistics are its own, not summed over the replicas)."""
    import torch.distributed.checkpoint as dcp

    from gefen_core import Gefen
    from gefen_dist import GefenDCPState

    out = run_distributed(_ddp_worker, 2, "cpu", str(tmp_path), timeout=150,
                          collective_timeout=60)
    for r in out:
        assert r["differs"] == [], f"tensors differing across ranks: {r['differs']}"
        assert r["codes"] > 0 and r["n"] > 20
    # Different data per rank: the losses differ, so identity is not an accident of equal input.
    assert out[0]["losses"] != out[1]["losses"]
    model = make_model(seed=1)
    opt = Gefen(model.named_parameters(), lr=3e-3, min_dim_size_to_factor=0)
    dcp.load({"optim": GefenDCPState(model, opt)}, checkpoint_id=str(tmp_path))
    for name, p in model.named_parameters():
        for key, value in out[0]["state"][name].items():
            got = opt.state[p][key]
            same = torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
            assert same, (name, key)
    # The dense second moment written for a per-block loader is the replica's own
    # r_i k_j / rbar (rbar = max(mean(r), FLT_MIN); fp32 forming: within 5 ulp, see
    # test_dist_dcp_local's conversion test).
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path), str(tmp_path / "all.pt"))
    slots = torch.load(tmp_path / "all.pt", weights_only=False)["optim"]["slots"]
    matrices = 0
    for name, st in out[0]["state"].items():
        if "exp_avg_sq_row" not in st:
            continue
        matrices += 1
        r, k = st["exp_avg_sq_row"].double(), st["exp_avg_sq_col"].double()
        ref = torch.outer(r, k) / max(float(r.mean()), torch.finfo(torch.float32).tiny)
        torch.testing.assert_close(slots[name]["exp_avg_sq"].double(), ref,
                                   rtol=5 * 2.0 ** -24, atol=0)
    assert matrices > 0
