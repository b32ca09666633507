"""Dead coordinates stop moving through the Triton kernels
(docs/algorithm.md#toward-zero-rounding; in the interpreter here, compiled on a GPU).

The op-level twin of gefen-core's ``test_gefen_dead_coordinates.py``: a ``[64, 64]``
parameter (blocks of one row) trains on a noisy quadratic, then four columns, two rows (whole
blocks) and a random 5 % of the rest get exactly zero gradients. Stepped by the kernels alone,
the dead coordinates' per-step change must be exactly 0 within 150 steps of dying, as
``torch.optim.AdamW``'s is, while the live coordinates keep training. Every step is also run
by the PyTorch reference from the same inputs: the same codes and scales, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernels_inputs import assert_bitwise, make_codebook

from gefen_kernels.ops.block_step import block_step_reference, block_step_triton
from gefen_kernels.ops.factored_step import factored_step_reference, factored_step_triton

LIVE = 40
WITHIN = 150
B1, B2, EPS = 0.9, 0.999, 1e-8


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _trajectory(step_fn, dtype: torch.dtype, lr: float, dead_steps: int, device: str):  # noqa: ANN001
    """``(last step after death that moved a dead coordinate, live distance start/end,
    mean |change| of the live coordinates in the last step)``."""
    gen = torch.Generator().manual_seed(0)
    sign = torch.where(torch.rand(64, 64, generator=gen) < 0.5, -1.0, 1.0)
    start = sign * (0.5 + torch.rand(64, 64, generator=gen))
    target = torch.randn(64, 64, generator=gen)
    dead = torch.rand(64, 64, generator=gen) < 0.05
    dead[:, :4] = True
    dead[10:12] = True
    p = start.clone().to(dtype).to(device)
    last, live_step = -1, 0.0
    for t in range(LIVE + dead_steps):
        g = (p.float().cpu() - target) + 0.5 * torch.randn(64, 64, generator=gen)
        if t >= LIVE:
            g[dead] = 0.0
        before = p.clone()
        step_fn(p, g.to(dtype).to(device), t + 1)
        change = (p - before).float().abs().cpu()
        if t >= LIVE and bool((change[dead] > 0).any()):
            last = t + 1 - LIVE
        live_step = change[~dead].mean().item()
    dist = ((start - target).abs()[~dead].mean().item(),
            (p.float().cpu() - target).abs()[~dead].mean().item())
    return last, dist, live_step


def _adamw(dtype: torch.dtype, lr: float, dead_steps: int):  # noqa: ANN202
    holder: dict[str, torch.optim.Optimizer] = {}

    def step(p: torch.Tensor, g: torch.Tensor, t: int) -> None:
        if "opt" not in holder:
            holder["w"] = torch.nn.Parameter(p)
            holder["opt"] = torch.optim.AdamW([holder["w"]], lr=lr, weight_decay=0.0)
        holder["w"].grad = g
        holder["opt"].step()

    return _trajectory(step, dtype, lr, dead_steps, "cpu")


def _kernel_step(factored: bool, stochastic: bool, lr: float, device: str):  # noqa: ANN202
    cb = make_codebook(0).to(device)  # learned-like, with the zero codeword
    assert bool((cb == 0).any())
    codes = torch.zeros(64, 64, dtype=torch.uint8, device=device)
    scale = torch.zeros(64, 1, device=device)
    second = ([torch.zeros(64, device=device), torch.zeros(64, device=device)] if factored
              else [torch.zeros(64, 1, device=device)])

    def step(p: torch.Tensor, g: torch.Tensor, t: int) -> None:
        hp = dict(lr=lr, beta1=B1, beta2=B2, eps=EPS, bc1_recip=1.0 / (1.0 - B1**t), decay=1.0,
                  stochastic_round=stochastic, seed=1000 + t)
        ref = [p.clone(), codes.clone(), scale.clone(), *[s.clone() for s in second]]
        if factored:
            hp["bc2_recip"] = 1.0 / (1.0 - B2**t)
            factored_step_triton(p, g, codes, scale, *second, cb, **hp)
            factored_step_reference(ref[0], g, *ref[1:3], *ref[3:], cb, **hp)
        else:
            hp["bc2_rsqrt"] = 1.0 / math.sqrt(1.0 - B2**t)
            block_step_triton(p.view(-1), g.view(-1), codes, scale, *second, cb, **hp)
            block_step_reference(ref[0].view(-1), g.view(-1), *ref[1:3], *ref[3:], cb, **hp)
        assert_bitwise(codes, ref[1], f"codes at step {t}")
        assert_bitwise(scale, ref[2], f"scales at step {t}")

    return step, codes, cb


@pytest.mark.parametrize("factored,stochastic,dtype", [
    (True, False, torch.float32),   # lr 1e-3: the slow case, zero within about 35 steps
    (False, True, torch.bfloat16),  # lr 1e-2 (bf16 ignores updates of 1e-3 at |p| >= 0.5)
])
def test_dead_coordinates_stop_moving_through_the_kernels(factored: bool, stochastic: bool,
                                                          dtype: torch.dtype) -> None:
    lr = 1e-3 if dtype == torch.float32 else 1e-2
    dead_steps = WITHIN + 10 if dtype == torch.float32 else 60
    dev = _device()
    step, codes, cb = _kernel_step(factored, stochastic, lr, dev)
    last, dist, live_step = _trajectory(step, dtype, lr, dead_steps, dev)
    a_last, a_dist, a_live_step = _adamw(dtype, lr, dead_steps)
    assert 0 < a_last <= WITHIN  # AdamW's dead change is exactly 0 within the horizon too
    assert last <= WITHIN and last < dead_steps, last
    assert dist[0] - dist[1] >= 0.8 * (a_dist[0] - a_dist[1]), (dist, a_dist)
    assert live_step >= 0.5 * a_live_step, (live_step, a_live_step)
    # The dead columns of the live rows hold the zero codeword: their momentum is exactly 0.
    assert bool((cb.cpu()[codes.cpu().long()][20:, :4] == 0).all())
