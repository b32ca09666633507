"""A small ``transformers`` Llama moved between one plain process and FSDP2 on 2 and 4 ranks.

One test, two spawns (4 ranks, then 2), the plain process being this one:

1. **Misuse is refused on every rank.** Plain ``Gefen`` on FSDP2 shards fails at construction,
   naming the parameter and ``ShardedGefen``; a ``Gefen`` whose parameters a wrapper sharded
   after construction fails ``check_capabilities(opt)`` (no arguments) and its first step.
2. **Periods reshard exactly.** Every load is re-saved at once: 4 -> 2 and 2 -> 1 give back
   every tensor bit for bit; 1 -> 2 and 1 -> 4 differ exactly in the tensors whose
   single-process period does not tile the new shards (the RMSNorm weights here), predicted
   from the saved periods with the ``Shard(0)`` chunk rule written out below.
3. **Factored state moves both ways.** Default options everywhere (factored second moment):
   the FSDP2 checkpoints load into one plain process and train, and the plain one into FSDP2;
   ``exp_avg_sq_row``/``exp_avg_sq_col`` come back bit for bit in every move.
4. **One non-finite-gradient rule.** With ``skip_nonfinite=True``, an Inf in one rank's
   gradient shard skips the step on every rank (``ShardedGefen``, ``ShardedGefenMuon``,
   ``ShardedGefenMuonHybrid``), with nothing changed, and the ``ShardedGefen`` run then ends
   bit-identical to the run that never saw that step.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist_models import (
    batches,
    full_params,
    gloo_avg_sums,
    lm_loss,
    make_llama,
    shard_llama,
    train,
)

from gefen_dist.testing import run_distributed

K, J = 3, 2
LR = 3e-3
POISONED = "llama.model.layers.0.mlp.down_proj.weight"


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches(K + J, batch=2, seq=16, seed=21)


def _save(model, opt, path: str) -> None:
    from gefen_dist import GefenDCPState

    state = GefenDCPState(model, opt)
    dcp.save(
        {"model": model.state_dict(), "optim": state},
        checkpoint_id=path,
        planner=state.save_planner(),
    )


def _load(model, opt, path: str) -> None:
    from gefen_dist import GefenDCPState

    sd = {"model": model.state_dict(), "optim": GefenDCPState(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])


def _local_state(opt) -> dict:
    out = {"T": opt._global_step}
    for g in opt.param_groups:
        for p, name in zip(g["params"], g["param_names"]):
            for key, value in opt.state.get(p, {}).items():
                out[(name, key)] = value.clone() if isinstance(value, torch.Tensor) else value
            local = p.to_local() if hasattr(p, "to_local") else p
            out[(name, "param")] = local.detach().clone()
    return out


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def _step(model, opt, x, y, poison: bool) -> None:
    """One FSDP2 step; ``poison`` puts an Inf into this rank's shard of one gradient."""
    opt.zero_grad(set_to_none=True)
    lm_loss(model, x, y).backward()
    if gloo_avg_sums():  # see _dist_models.train
        for p in model.parameters():
            p.grad.div_(dist.get_world_size())
    if poison:
        dict(model.named_parameters())[POISONED].grad.to_local().view(-1)[0] = float("inf")
    opt.step()


def _misuse(world: int) -> dict:
    from gefen_core import Gefen
    from gefen_dist import ShardedGefen, UnsupportedCombinationError, check_capabilities

    out: dict = {}
    model = shard_llama(make_llama(0))
    try:
        Gefen(model.named_parameters(), lr=LR)
        out["construct"] = None
    except ValueError as exc:
        out["construct"] = str(exc)
    check_capabilities(ShardedGefen(model.named_parameters(), lr=LR))
    # A wrapper that shards the model after the optimizer exists and hands it the sharded
    # parameters (accelerate's FSDP2 preparation does that).
    late = make_llama(0)
    opt = Gefen(late.named_parameters(), lr=LR)
    shard_llama(late)
    live = dict(late.named_parameters())
    for g in opt.param_groups:
        g["params"] = [live[n] for n in g["param_names"]]
    for key, call in (("check", lambda: check_capabilities(opt)), ("step", opt.step)):
        try:
            call()
            out[key] = None
        except (ValueError, UnsupportedCombinationError) as exc:
            out[key] = str(exc)
    return out


def _skip(model_state_at_k: dict, params_at_k: dict) -> dict:
    """``skip_nonfinite``: the poisoned step is skipped on every rank; ShardedGefen then ends
    where the run without that step ended (``*_at_k``)."""
    from gefen_dist import ShardedGefen, ShardedGefenMuon, ShardedGefenMuonHybrid

    rank, world = dist.get_rank(), dist.get_world_size()
    data = _data()
    out: dict = {}
    model = shard_llama(make_llama(0))
    opt = ShardedGefen(model.named_parameters(), lr=LR, skip_nonfinite=True)
    sequence = data[:2] + [data[1]] + data[2:K]
    for i, (x, y) in enumerate(sequence):
        before = _local_state(opt) if i == 2 else None
        _step(model, opt, x, y, poison=(i == 2 and rank == world - 1))
        if before is not None:
            out["gefen"] = (opt.last_step_skipped, _same(before, _local_state(opt)))
    out["gefen_count"] = opt.skipped_steps
    out["gefen_continues_exactly"] = _same(model_state_at_k, _local_state(opt)) and all(
        torch.equal(t, params_at_k[n]) for n, t in full_params(model).items()
    )
    for label in ("muon", "hybrid"):
        model = shard_llama(make_llama(0))
        if label == "muon":
            hidden = [
                (n, p) for n, p in model.named_parameters() if p.ndim == 2 and ".layers." in n
            ]
            opt = ShardedGefenMuon(hidden, lr=0.02, skip_nonfinite=True)
        else:
            opt = ShardedGefenMuonHybrid(model, lr=LR, skip_nonfinite=True)
        for i, (x, y) in enumerate(data[:3]):
            before = _local_state(opt.muon if label == "hybrid" else opt)
            params = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
            _step(model, opt, x, y, poison=(i == 1 and rank == world - 1))
            if i == 1:
                unchanged = _same(before, _local_state(opt.muon if label == "hybrid" else opt))
                unchanged = unchanged and all(
                    torch.equal(p.to_local(), params[n]) for n, p in model.named_parameters()
                )
                out[label] = (opt.last_step_skipped, unchanged)
        out[f"{label}_count"] = opt.skipped_steps
    return out


def _ranks(rank: int, world: int, tmp: str, loads: list[str]) -> dict:
    from gefen_dist import ShardedGefen

    out = {"misuse": _misuse(world)}
    data = _data()
    model = shard_llama(make_llama(0))
    opt = ShardedGefen(model.named_parameters(), lr=LR)
    train(model, opt, data[:K])
    _save(model, opt, os.path.join(tmp, f"w{world}"))
    state_at_k, params_at_k = _local_state(opt), full_params(model)
    for src in loads:
        m2 = shard_llama(make_llama(1))
        o2 = ShardedGefen(m2.named_parameters(), lr=LR)
        _load(m2, o2, os.path.join(tmp, src))
        _save(m2, o2, os.path.join(tmp, f"{src}-on{world}"))
        out[f"{src}_trains"] = all(math.isfinite(v) for v in train(m2, o2, data[K:]))
    out["skip"] = _skip(state_at_k, params_at_k)
    return out


def _read(path: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = path + ".pt"
    dcp_to_torch_save(path, target)
    return torch.load(target, weights_only=False)["optim"]


def _tiles(period: int, shape: tuple[int, ...], world: int) -> bool:
    """Whether blocks of ``period`` tile ``Shard(0)`` shards on ``world`` ranks: each shard
    holds ``ceil(R / W)`` rows (the last one fewer), so it starts at a multiple of
    ``ceil(R / W) * row_numel`` elements."""
    rows, row_numel = shape[0], math.prod(shape[1:])
    return (-(-rows // world) * row_numel) % period == 0


def _compare(saved: dict, resaved: dict, shapes: dict, world: int) -> tuple[set, set]:
    """(tensors that differ after the move, tensors whose saved period does not tile)."""
    assert torch.equal(saved["codebook"], resaved["codebook"])
    for key in ("global_step", "param_groups", "deterministic", "has_codebook"):
        assert saved["header"][key] == resaved["header"][key], key
    differ, reblock = set(), set()
    for name, a in saved["slots"].items():
        b = resaved["slots"][name]
        if not _tiles(a["period"], shapes[name], world):
            reblock.add(name)
        for key in ("exp_avg_sq_row", "exp_avg_sq_col"):  # exact on any layout
            if key in a:
                assert torch.equal(a[key], b[key]), (name, key)
        for key in ("initialized", "factored", "step", "exp_avg_sq_step", "search_period"):
            assert a[key] == b[key], (name, key)
        if a["period"] != b["period"] or not (
            torch.equal(a["momentum"], b["momentum"])
            and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        ):
            differ.add(name)
    return differ, reblock


@pytest.mark.timeout(900)
def test_llama_moves_between_one_process_and_fsdp2_on_2_and_4_ranks(tmp_path):
    from gefen_core import Gefen

    tmp = str(tmp_path)
    data = _data()
    model = make_llama(0)
    opt = Gefen(model.named_parameters(), lr=LR)  # default options: factored matrices
    train(model, opt, data[:K])
    _save(model, opt, os.path.join(tmp, "w1"))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}

    r4 = run_distributed(_ranks, 4, tmp, ["w1"], timeout=420, collective_timeout=180)
    r2 = run_distributed(_ranks, 2, tmp, ["w1", "w4"], timeout=420, collective_timeout=180)
    # 2 -> 1: the FSDP2 checkpoint into one plain process with default options; it trains.
    plain = make_llama(1)
    plain_opt = Gefen(plain.named_parameters(), lr=LR)
    _load(plain, plain_opt, os.path.join(tmp, "w2"))
    _save(plain, plain_opt, os.path.join(tmp, "w2-on1"))
    assert all(math.isfinite(v) for v in train(plain, plain_opt, data[K:]))

    # 1. Misuse: refused on every rank, naming the parameter and the class to use.
    for r in r4 + r2:
        m = r["misuse"]
        assert (
            m["construct"]
            and "llama.model.embed_tokens.weight" in m["construct"]
            and "ShardedGefen" in m["construct"]
        ), m
        assert m["check"] and "fsdp2_shard0" in m["check"] and "ShardedGefen" in m["check"], m
        assert m["step"] and "ShardedGefen" in m["step"], m
    # 2 and 3. Every move re-saves bit for bit except where the saved blocks cannot tile.
    moved = {}
    for src, world in (("w1", 4), ("w1", 2), ("w4", 2), ("w2", 1)):
        differ, reblock = _compare(
            _read(os.path.join(tmp, src)),
            _read(os.path.join(tmp, f"{src}-on{world}")),
            shapes,
            world,
        )
        assert differ == reblock, (src, world, sorted(differ), sorted(reblock))
        moved[(src, world)] = sorted(reblock)
    norms = sorted(n for n, s in shapes.items() if len(s) == 1)
    assert moved[("w4", 2)] == [] and moved[("w2", 1)] == []
    # From one plain process: at least the norms, whose single-process block is the whole
    # 64-element tensor; 1 -> 4 re-blocks everything 1 -> 2 does.
    assert set(norms) <= set(moved[("w1", 2)]) <= set(moved[("w1", 4)])
    print("re-blocked on load:", {f"{s}->{w}": v for (s, w), v in moved.items()})
    assert r4[0]["w1_trains"] and r2[0]["w1_trains"] and r2[0]["w4_trains"]
    # 4. skip_nonfinite: every rank skipped the poisoned step together, changing nothing.
    for r in r4 + r2:
        s = r["skip"]
        for label in ("gefen", "muon", "hybrid"):
            assert s[label] == (True, True), (label, s)
            assert s[f"{label}_count"] == 1, (label, s)
        assert s["gefen_continues_exactly"], s
