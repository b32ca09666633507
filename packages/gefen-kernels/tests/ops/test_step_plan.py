"""StepPlan (the optimizer's cached launches) against the public Triton launchers: same bits."""

from __future__ import annotations

import importlib

import pytest
import torch
from kernels_inputs import (
    assert_bitwise,
    clone_state,
    make_codebook,
    random_state,
    with_zero_gradients,
)

from gefen_kernels._numerics import f32
from gefen_kernels.ops.block_step import block_step_triton
from gefen_kernels.ops.factored_step import factored_step_triton
from gefen_kernels.ops.step_plan import StepPlan

HP = dict(lr=3e-3, bc1_recip=1.0 / (1.0 - 0.9**3), bc2=1.0 / (1.0 - 0.999**3), decay=0.99997)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rounded(hp: dict[str, float]) -> dict[str, float]:
    return {k: f32(v) for k, v in hp.items()}


@pytest.mark.parametrize("num_blocks,period,dtype,flags", [
    (30, 7, torch.bfloat16, {}),
    (3, 1024, torch.float32, {"maximize": True, "stochastic_round": True}),
    (2, 4099, torch.float16, {}),  # split route: the plan delegates to the generic launcher
])
def test_block_plan_matches_block_step_triton(num_blocks, period, dtype, flags) -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(period)
    n = num_blocks * period
    param = torch.randn(n, generator=gen).to(dtype).to(dev)
    grad = with_zero_gradients(torch.randn(n, generator=gen).to(dtype).to(dev), period, n)
    st = {k: v.to(dev) for k, v in random_state(num_blocks, period, seed=period).items()}
    cb = make_codebook(period).to(dev)
    maximize = flags.get("maximize", False)
    stochastic = flags.get("stochastic_round", False)
    a_p, a = param.clone(), clone_state(st)
    block_step_triton(a_p, grad, a["codes"], a["scale"], a["exp_avg_sq"], cb, beta1=0.9,
                      beta2=0.999, eps=1e-8, bc1_recip=HP["bc1_recip"], bc2_rsqrt=HP["bc2"],
                      lr=HP["lr"], decay=HP["decay"], maximize=maximize,
                      stochastic_round=stochastic, seed=-5)
    b_p, b = param.clone(), clone_state(st)
    plan = StepPlan(b_p, b["codes"], b["scale"], b["exp_avg_sq"], None, None, cb, beta1=0.9,
                    beta2=0.999, eps=1e-8, maximize=maximize, stochastic_round=stochastic,
                    capturable=False)
    plan.launch(grad, seed=-5, **_rounded(HP))
    assert_bitwise(b_p, a_p, "param")
    for k in a:
        assert_bitwise(b[k], a[k], k)
    assert plan.matches(b_p, b["codes"], b["scale"], b["exp_avg_sq"], None, None, cb)
    assert not plan.matches(b_p, a["codes"], b["scale"], b["exp_avg_sq"], None, None, cb)
    cb.add_(0.0)  # an in-place change of the codebook invalidates the plan
    assert not plan.matches(b_p, b["codes"], b["scale"], b["exp_avg_sq"], None, None, cb)
    with pytest.raises(ValueError, match="grad must be contiguous with shape"):
        plan.launch(grad[:-1], seed=0, **_rounded(HP))


@pytest.mark.parametrize("capturable", [False, True])
def test_factored_plan_matches_factored_step_triton(capturable: bool) -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(4)
    rows, cols, period = 24, 40, 20
    param = torch.randn(rows, cols, generator=gen).to(torch.bfloat16).to(dev)
    grad = with_zero_gradients(torch.randn(rows, cols, generator=gen).to(dev), period, 4)
    grad[3] = 0.0  # a zero-gradient row: its statistics decay, its partial sums are 0
    st = {k: v.to(dev) for k, v in random_state(rows * cols // period, period, seed=4).items()}
    del st["exp_avg_sq"]
    st["row"] = (torch.rand(rows, generator=gen) * 1e-3).to(dev)
    st["col"] = (torch.rand(cols, generator=gen) * 1e-3).to(dev)
    cb = make_codebook(4).to(dev)
    hyper = torch.tensor([HP["lr"], HP["bc2"], HP["bc1_recip"], HP["decay"]], device=dev)
    seed_t = torch.tensor([11], device=dev)
    dev_kw = dict(hyper=hyper, seed_tensor=seed_t) if capturable else {}
    a_p, a = param.clone(), clone_state(st)
    factored_step_triton(a_p, grad, a["codes"], a["scale"], a["row"], a["col"], cb, beta1=0.9,
                         beta2=0.999, eps=1e-8, bc1_recip=HP["bc1_recip"], bc2_recip=HP["bc2"],
                         lr=HP["lr"], decay=HP["decay"], stochastic_round=True, seed=11,
                         **dev_kw)
    b_p, b = param.clone(), clone_state(st)
    plan = StepPlan(b_p, b["codes"], b["scale"], None, b["row"], b["col"], cb, beta1=0.9,
                    beta2=0.999, eps=1e-8, maximize=False, stochastic_round=True,
                    capturable=capturable)
    plan.launch(grad, seed=11, **_rounded(HP), **dev_kw)
    assert_bitwise(b_p, a_p, "param")
    for k in a:
        assert_bitwise(b[k], a[k], k)


def test_plan_refuses_bad_state_at_construction() -> None:
    dev = _device()  # CPU tensors outside the interpreter would fail the device check first
    param = torch.zeros(8, 6, device=dev)
    with pytest.raises(ValueError, match="exp_avg_sq_col must have shape"):
        StepPlan(param, torch.zeros(4, 12, dtype=torch.uint8, device=dev),
                 torch.zeros(4, 1, device=dev), None, torch.zeros(8, device=dev),
                 torch.zeros(5, device=dev), make_codebook(1).to(dev), beta1=0.9, beta2=0.999,
                 eps=1e-8, maximize=False, stochastic_round=False, capturable=False)


# (rows, columns, period, parameter dtype, gradient dtype, flags): blocks across rows.
FLAT_CASES = [
    (6, 96, 144, torch.bfloat16, torch.float32, {}),  # a head-and-tail tile (tile_shape)
    (40, 112, 80, torch.float32, torch.float32, {}),  # several flat programs, fp32 parameters
    (10, 96, 240, torch.float16, torch.float16, {"stochastic_round": True, "maximize": True}),
    (9, 1024, 2304, torch.float32, torch.bfloat16, {}),  # a 4096-lane tile, 8 warps
    (12, 48, 32, torch.bfloat16, torch.bfloat16, {"capturable": True, "decay": 1.0}),
    (12, 48, 32, torch.float32, torch.float32, {"lr": 0.0}),  # codes and scales only
]


@pytest.mark.parametrize("rows,cols,period,pdt,gdt,flags", FLAT_CASES)
def test_flat_update_matches_the_fused_tile(rows, cols, period, pdt, gdt, flags,
                                            monkeypatch) -> None:
    """FLAT_UPDATE (a quantising tile, then the flat update: _step_kernels.flat_update) gives
    the fused tile kernel's codes, scales and parameters bit for bit, through the public
    launcher and StepPlan. The state has a block with a NaN scale (its momentum and
    parameters NaN), a block of zero momentum (new scale 0) and a row whose statistics are
    exactly 0 (V = 0: no update); every other parameter must move (unless lr = 0) and stay
    finite, so the comparison is not between NaNs."""
    step_kernels = importlib.import_module("gefen_kernels.ops._step_kernels")
    step_plan = importlib.import_module("gefen_kernels.ops.step_plan")
    dev = _device()
    gen = torch.Generator().manual_seed(period + rows)
    param = torch.randn(rows, cols, generator=gen).to(pdt).to(dev)
    grad = torch.randn(rows, cols, generator=gen)
    st = random_state(rows * cols // period, period, seed=period)
    del st["exp_avg_sq"]
    st["row"] = torch.rand(rows, generator=gen) * 1e-3
    st["col"] = torch.rand(cols, generator=gen) * 1e-3
    nan_block, zero_block, zero_row = 1, st["scale"].shape[0] - 1, rows - 1
    st["scale"][nan_block] = float("nan")
    st["scale"][zero_block] = 0.0
    grad.view(-1)[zero_block * period:] = 0.0
    grad[zero_row] = 0.0
    st["row"][zero_row] = 0.0
    st = {k: v.to(dev) for k, v in st.items()}
    grad = grad.to(gdt).to(dev)
    cb = make_codebook(6).to(dev)
    hp = dict(HP, **{k: v for k, v in flags.items() if k in HP})
    stochastic = bool(flags.get("stochastic_round"))
    maximize = bool(flags.get("maximize"))
    capturable = bool(flags.get("capturable"))
    hyper = torch.tensor([hp["lr"], hp["bc2"], hp["bc1_recip"], hp["decay"]], device=dev)
    dev_kw = dict(hyper=hyper, seed_tensor=torch.tensor([5], device=dev)) if capturable else {}
    assert step_kernels.flat_update(True, period, cols, False)

    def public() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        p, s = param.clone(), clone_state(st)
        factored_step_triton(p, grad, s["codes"], s["scale"], s["row"], s["col"], cb,
                             beta1=0.9, beta2=0.999, eps=1e-8, bc1_recip=hp["bc1_recip"],
                             bc2_recip=hp["bc2"], lr=hp["lr"], decay=hp["decay"],
                             maximize=maximize, stochastic_round=stochastic, seed=5, **dev_kw)
        return p, s

    def planned(expect_flat: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        p, s = param.clone(), clone_state(st)
        plan = StepPlan(p, s["codes"], s["scale"], None, s["row"], s["col"], cb, beta1=0.9,
                        beta2=0.999, eps=1e-8, maximize=maximize, stochastic_round=stochastic,
                        capturable=capturable)
        assert plan._consts["FLAT_UPDATE"] == expect_flat
        plan.launch(grad, seed=5, **_rounded(hp), **dev_kw)
        return p, s

    flat = [public(), planned(True)]
    fused_rule = lambda *args: False  # noqa: E731
    monkeypatch.setattr(step_kernels, "flat_update", fused_rule)
    monkeypatch.setattr(step_plan, "flat_update", fused_rule)
    fused = [public(), planned(False)]
    for (p, s), (p_ref, s_ref) in zip(flat, fused):
        assert_bitwise(p, p_ref, "param")
        for k in s:
            assert_bitwise(s[k], s_ref[k], k)
    p, s = flat[0]
    scale = s["scale"].view(-1)
    assert torch.isnan(scale[nan_block]) and scale[zero_block] == 0.0
    assert torch.isfinite(scale[:nan_block]).all() and (scale[:nan_block] > 0).all()
    blocks = p.view(-1, period)
    assert torch.isnan(blocks[nan_block]).all() if hp["lr"] != 0.0 else True
    rest = torch.ones_like(blocks, dtype=torch.bool)
    rest[nan_block] = False
    rest[zero_block] = False
    rest = rest.view(rows, cols)
    rest[zero_row] = False
    # The V = 0 row only decays: p <- fp(p * decay), no update (no write at all when lr = 0).
    decayed = (param[zero_row].float() * f32(hp["decay"])).to(pdt)
    assert_bitwise(p[zero_row], param[zero_row] if hp["lr"] == 0.0 else decayed,
                   "param (V = 0 row)")
    assert torch.isfinite(p[rest]).all()
    if hp["lr"] == 0.0:
        assert_bitwise(p, param, "param (lr 0)")
    else:
        assert (p[rest] != param[rest]).float().mean() > 0.1  # bf16 rounds small steps away
