"""DDP: Gefen needs no distributed code; replicas stay bit-identical across ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist_models import batches, lm_loss, make_model
from torch.nn.parallel import DistributedDataParallel as DDP

from gefen_dist.testing import run_distributed

STEPS = 4


def _ddp_worker(rank: int, world: int, device: str = "cpu") -> dict:
    """``device="cuda"``: one GPU per rank (NCCL group), and ``deterministic=True`` because
    replica identity needs every rank's optimizer step to be a function of its inputs only
    (the fused CUDA kernels use float atomics otherwise, docs/algorithm.md#deterministic)."""
    from gefen_core import Gefen

    opt_kw: dict = {}
    if device == "cuda":
        torch.cuda.set_device(rank)
        opt_kw["deterministic"] = True
    model = make_model(seed=0).to(device)
    model = DDP(model, device_ids=[rank]) if device == "cuda" else DDP(model)
    opt = Gefen(model.module.named_parameters(), lr=3e-3, **opt_kw)
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
    return {"differs": differs, "n": len(tensors), "losses": losses,
            "codes": sum(int("exp_avg_codes" in s) for s in sd["state"].values())}


@pytest.mark.timeout(180)
def test_ddp_replicas_stay_bit_identical():
    out = run_distributed(_ddp_worker, 2, timeout=150, collective_timeout=60)
    for r in out:
        assert r["differs"] == [], f"tensors differing across ranks: {r['differs']}"
        assert r["codes"] > 0 and r["n"] > 20
    # Different data per rank: the losses differ, so identity is not an accident of equal input.
    assert out[0]["losses"] != out[1]["losses"]
