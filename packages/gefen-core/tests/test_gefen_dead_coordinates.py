"""Coordinates whose gradient stops stop moving (docs/algorithm.md#toward-zero-rounding,
#zero-codeword).

A ``[64, 64]`` parameter trains on a noisy quadratic; then some of its coordinates get exactly
zero gradients: four columns (dead input features), two rows (a dead output unit, a whole
block of 64) and a random 5 % of the rest. With AdamW their per-step change decays with the
momentum and becomes exactly 0 (the update drops below half an ulp of the parameter). Gefen
must do the same within 150 steps of the coordinates dying, while the live coordinates keep
training: before the zero codeword and the toward-zero rounding, a dead coordinate kept a
nonzero code forever and its update grew as its second moment decayed.

Runs: factored and per-block second moment, nearest and stochastic rounding, fp32 and bf16
(fp32 at lr 1e-3, bf16 at lr 1e-2, where an update of 1e-3 would not move a bf16 weight of
0.5); on the CPU (the PyTorch reference path) and, on a GPU, through the fused kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from gefen_core import Gefen

LIVE = 60  # steps before the coordinates die
WITHIN = 150  # the change must be exactly 0 from at most this many steps after dying on
DEAD = {torch.float32: WITHIN + 10, torch.bfloat16: 60}
LR = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
OPTIONS = {
    "factored": {"min_dim_size_to_factor": 0},  # [64, 64] is factored only with 0
    "per_block": {"factored_v_2d": False},
    "factored_sr": {"min_dim_size_to_factor": 0, "stochastic_round": True},
    "per_block_sr": {"factored_v_2d": False, "stochastic_round": True},
}


@dataclass
class Trace:
    last_dead_move: int  # the last step (counted from the death) that moved a dead coordinate
    live_distance: tuple[float, float]  # mean |p - target| of the live coordinates: start, end
    live_moved: float  # fraction of live coordinates the last step moved
    live_step: float  # their mean |change| in the last step


def _dead_mask(gen: torch.Generator) -> torch.Tensor:
    dead = torch.rand(64, 64, generator=gen) < 0.05
    dead[:, :4] = True
    dead[10:12] = True
    return dead


def run(make: Any, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> tuple[Trace, Any]:
    """Train ``LIVE`` steps, kill the coordinates, run ``DEAD[dtype]`` more; the optimizer is
    returned for state checks."""
    gen = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(64, 64, generator=gen) < 0.5, -1.0, 1.0)
    # |p| >= 0.5: half an ulp of a weight is at least 3e-8 (fp32), so AdamW's decaying
    # update of a dead coordinate drops below it within about 110 steps at lr 1e-3.
    start = sign * (0.5 + torch.rand(64, 64, generator=gen))
    target = torch.randn(64, 64, generator=gen)
    dead = _dead_mask(gen)
    p = torch.nn.Parameter(start.clone().to(dtype).to(device))
    opt = make([("w", p)], LR[dtype])
    last = -1
    moved = torch.zeros(64, 64, dtype=torch.bool)
    step_size = torch.zeros(64, 64)
    for t in range(LIVE + DEAD[dtype]):
        g = (p.detach().float().cpu() - target) + 0.5 * torch.randn(64, 64, generator=gen)
        if t >= LIVE:
            g[dead] = 0.0
        p.grad = g.to(dtype).to(device)
        before = p.detach().clone()
        opt.step()
        change = (p.detach() - before).float().abs().cpu()
        if t >= LIVE and bool((change[dead] > 0).any()):
            last = t + 1 - LIVE
        moved, step_size = change > 0, change
    live = ~dead
    dist = ((start - target).abs()[live].mean().item(),
            (p.detach().float().cpu() - target).abs()[live].mean().item())
    trace = Trace(last, dist, moved[live].float().mean().item(), step_size[live].mean().item())
    return trace, (opt, p, dead)


def _gefen(options: dict[str, Any], **extra: Any) -> Any:
    return lambda named, lr: Gefen(named, lr=lr, weight_decay=0.0, **options, **extra)


def _adamw(named: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=0.0)


def check(trace: Trace, adamw: Trace, dtype: torch.dtype, opt: Gefen, p: torch.Tensor,
          dead: torch.Tensor) -> None:
    # AdamW: exactly 0 within the same horizon (the calibration of this test).
    assert 0 < adamw.last_dead_move <= WITHIN
    # Gefen: exactly 0 within 150 steps, and 0 on every step after that.
    assert trace.last_dead_move <= WITHIN, trace
    assert trace.last_dead_move < DEAD[dtype]
    # The live coordinates keep training as AdamW's do: most of AdamW's progress toward
    # their target, and still moving in the last step by at least half as much.
    progress = trace.live_distance[0] - trace.live_distance[1]
    assert progress >= 0.8 * (adamw.live_distance[0] - adamw.live_distance[1]), (trace, adamw)
    assert trace.live_moved >= 0.5 * adamw.live_moved, (trace, adamw)
    assert trace.live_step >= 0.5 * adamw.live_step, (trace, adamw)
    codebook = opt._codebook.cpu()
    assert codebook[0] == -1 and codebook[-1] == 1 and int((codebook == 0).sum()) == 1
    # A dead coordinate in a live block holds the zero codeword: its momentum is exactly 0.
    st = opt.state[p]
    codes = st["exp_avg_codes"].reshape(64, 64).long().cpu()
    live_block = torch.ones(64, 64, dtype=torch.bool)
    if st["period"] == 64:  # rows are blocks: the two dead rows are whole dead blocks
        live_block[10:12] = False
    assert bool((codebook[codes][dead & live_block] == 0).all())


@pytest.fixture(scope="module")
def adamw_traces() -> dict[torch.dtype, Trace]:
    return {dt: run(_adamw, dt)[0] for dt in (torch.float32, torch.bfloat16)}


# Each option set once on the CPU, both dtypes covered by each mode and each rounding.
CPU_CASES = [("factored", torch.float32), ("per_block_sr", torch.float32),
             ("per_block", torch.bfloat16), ("factored_sr", torch.bfloat16)]


@pytest.mark.parametrize("name,dtype", CPU_CASES)
def test_dead_coordinates_stop_moving_on_the_reference_path(name, dtype, adamw_traces) -> None:  # noqa: ANN001
    trace, (opt, p, dead) = run(_gefen(OPTIONS[name]), dtype)
    check(trace, adamw_traces[dtype], dtype, opt, p, dead)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_dead_coordinates_stop_moving_through_the_kernels_gpu(name, dtype, adamw_traces) -> None:  # noqa: ANN001
    trace, (opt, p, dead) = run(_gefen(OPTIONS[name], fused=True), dtype, device="cuda")
    assert opt.step_paths()["w"] == "fused"
    check(trace, adamw_traces[dtype], dtype, opt, p, dead)


def test_a_codebook_saved_without_a_zero_codeword_is_used_as_it_is() -> None:
    """A checkpoint from before the zero codeword: its codebook (no exact 0) loads and stays,
    and zero gradients round toward zero but never across it (near 0 such a codebook rounds
    as it always did, docs/algorithm.md#toward-zero-rounding)."""
    import copy

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = Gefen([("w", p)], lr=1e-3, factored_v_2d=False)
    for _ in range(3):
        p.grad = torch.randn(64, 64)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    old = sd["gefen_meta"]["codebook"].clone()
    zero = int(torch.nonzero(old == 0))
    old[zero] = old[zero + 1] / 2  # no exact 0 any more, still sorted
    sd["gefen_meta"]["codebook"] = old
    for g in sd["param_groups"]:
        g["gefen_meta"]["codebook"] = old
    resumed = Gefen([("w", p)], lr=1e-3, factored_v_2d=False)
    resumed.load_state_dict(sd)
    def momentum() -> torch.Tensor:
        st = resumed.state[p]
        return (old[st["exp_avg_codes"].long()] * st["exp_avg_scale"]).reshape(64, 64)

    signs = torch.sign(momentum())
    for _ in range(40):
        g = torch.randn(64, 64)
        g[:, :8] = 0.0
        p.grad = g
        resumed.step()
    assert torch.equal(resumed._codebook, old)  # used as it is, not relearned
    # The dead columns' momentum kept its sign (no crossing of 0) and is nonzero: without an
    # exact 0 the smallest codewords are where it stops.
    assert bool((torch.sign(momentum()[:, :8]) == signs[:, :8]).all())
    assert bool(torch.isfinite(p).all())
