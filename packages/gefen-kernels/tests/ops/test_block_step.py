"""block_step reference (docs/algorithm.md#block-second-moment) against an independent float64
implementation, plus properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kernels_inputs import (
    assert_bitwise,
    assert_within_one_ulp,
    clone_state,
    make_codebook,
    random_state,
    ulp,
    with_zero_gradients,
)
from kernels_oracle import block_step64, boundary_distance, param_update64

from gefen_kernels import _numerics
from gefen_kernels.ops._step_kernels import SPLIT_ELEMENTS, choose_route, launch_step
from gefen_kernels.ops.block_step import block_step, block_step_reference, block_step_triton

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


def _hyper(step: int, lr: float = 1e-3, weight_decay: float = 0.0) -> dict[str, float]:
    return dict(lr=lr, beta1=BETA1, beta2=BETA2, eps=EPS,
                bc1_recip=1.0 / (1.0 - BETA1**step),
                bc2_rsqrt=1.0 / math.sqrt(1.0 - BETA2**step),
                decay=1.0 - lr * weight_decay)


def check_against_float64(param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
                          codebook: torch.Tensor, *, maximize: bool = False, step: int = 3,
                          lr: float = 1e-3, weight_decay: float = 0.0, run=None) -> None:
    """Run one step (``run``: the implementation under test) and compare with float64 math.

    Rules: codes equal except where the float64 normalised momentum lies within
    ``margin`` of a decision boundary, ``margin`` = 1e-6 * (1 + terms / s') with ``terms`` the
    magnitude of the EMA's inputs (fp32 rounding of m is relative to them, not to m);
    scale and second moment within that rounding; parameters within one rounding of their
    dtype plus the fp32 error of the update, using the implementation's codes where it
    legitimately picked the other neighbour.
    """
    hp = _hyper(step, lr, weight_decay)
    run = run or block_step_reference
    # docs/algorithm.md#block-second-moment: the betas enter the fp32 arithmetic cast to fp32 (1 -
    # beta2 is then formed from the cast value), so the float64 math uses those coefficients; fp64
    # params use them as is.
    b1, b2 = float(np.float32(BETA1)), float(np.float32(BETA2))
    if param.dtype == torch.float64:
        b1, b2 = BETA1, BETA2
    num_blocks, period = state["codes"].shape
    cb64 = codebook.double().numpy()
    expect = block_step64(param.double().numpy(), grad.double().numpy(),
                          state["codes"].long().numpy(), state["scale"].double().numpy(),
                          state["exp_avg_sq"].double().numpy(), cb64,
                          lr=lr, beta1=b1, beta2=b2, eps=EPS, bc1_recip=hp["bc1_recip"],
                          bc2_rsqrt=hp["bc2_rsqrt"], decay=hp["decay"], maximize=maximize)
    p_before = param.clone()
    run(param, grad, state["codes"], state["scale"], state["exp_avg_sq"], codebook,
        maximize=maximize, **hp)
    s_new = expect["s"]
    rel = 1e-6 * expect["terms"]
    assert np.all(np.abs(state["scale"].double().numpy() - s_new) <= rel + 1e-30)
    np.testing.assert_allclose(state["exp_avg_sq"].double().numpy(), expect["v"], rtol=2e-6,
                               atol=1e-30)
    q = state["codes"].long().numpy()
    margin = 1e-6 * (1.0 + expect["terms"] / np.where(s_new > 0, s_new, 1.0))
    near = boundary_distance(expect["z"], cb64, expect["zero"]) <= margin
    assert np.array_equal(q[~near], expect["q"][~near])
    assert np.all(np.abs(q[near] - expect["q"][near]) <= 1)
    mhat = cb64[q] * s_new
    p64 = param_update64(expect["p_decayed"], mhat, expect["sigma"], lr)
    u = lr * expect["sigma"] * np.abs(mhat)
    tol = (ulp(p64, param.dtype) * (1.0 if param.dtype != torch.float32 else 2.0)
           + 1e-5 * u + lr * expect["sigma"] * 2e-6 * expect["terms"])
    got = param.double().numpy().reshape(num_blocks, period)
    assert np.all(np.abs(got - p64) <= tol), np.max(np.abs(got - p64) - tol)
    if lr == 0:
        assert torch.equal(param, p_before)


SHAPES = [(1, 1), (4097, 1), (8191, 1), (3, 2), (5, 7), (4, 64), (3, 1024), (2, 2048),
          (1, 4096), (2, 8192), (1, 65521)]


@pytest.mark.parametrize("num_blocks,period", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64(num_blocks: int, period: int, dtype: torch.dtype) -> None:
    seed = num_blocks * 131 + period
    gen = torch.Generator().manual_seed(seed)
    n = num_blocks * period
    param = torch.randn(n, generator=gen).to(dtype)
    grad = (torch.randn(n, generator=gen) * 0.05).to(dtype)
    grad[::3] = 0.0  # zero gradients round toward zero
    state = random_state(num_blocks, period, seed=seed)
    check_against_float64(param, grad, state, make_codebook(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_several_steps_from_fresh_state(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, period = 6, 96
    param = torch.randn(num_blocks * period, generator=gen, dtype=dtype)
    state = random_state(num_blocks, period, seed=1, fresh=True)
    cb = make_codebook(11)
    for step in range(1, 6):
        grad = torch.randn(num_blocks * period, generator=gen, dtype=dtype) * 0.1
        check_against_float64(param, grad, state, cb, step=step, weight_decay=0.1)


def test_fp64_param_reference_path() -> None:
    gen = torch.Generator().manual_seed(2)
    param = torch.randn(4 * 33, generator=gen, dtype=torch.float64)
    grad = torch.randn(4 * 33, generator=gen, dtype=torch.float64)
    check_against_float64(param, grad, random_state(4, 33, seed=2), make_codebook(2))


@pytest.mark.parametrize("grad_dtype", [torch.float64, torch.bfloat16])
def test_grad_dtype_independent_of_param_dtype(grad_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    param = torch.randn(3 * 50, generator=gen)
    grad = torch.randn(3 * 50, generator=gen).to(grad_dtype)
    check_against_float64(param, grad, random_state(3, 50, seed=3), make_codebook(3))


def test_maximize_equals_negated_gradient() -> None:
    gen = torch.Generator().manual_seed(4)
    param = torch.randn(5 * 40, generator=gen)
    grad = torch.randn(5 * 40, generator=gen)
    cb = make_codebook(4)
    a_p, b_p = param.clone(), param.clone()
    a_s, b_s = random_state(5, 40, seed=4), random_state(5, 40, seed=4)
    block_step_reference(a_p, grad, a_s["codes"], a_s["scale"], a_s["exp_avg_sq"], cb,
                         maximize=True, **_hyper(2))
    block_step_reference(b_p, -grad, b_s["codes"], b_s["scale"], b_s["exp_avg_sq"], cb,
                         **_hyper(2))
    assert torch.equal(a_p, b_p)
    for key in a_s:
        assert torch.equal(a_s[key], b_s[key])
    check_against_float64(param.clone(), grad, random_state(5, 40, seed=4), cb, maximize=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lr_zero_leaves_param_untouched(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    param = torch.randn(4 * 16, generator=gen).to(dtype)
    grad = torch.randn(4 * 16, generator=gen)
    grad[3] = float("nan")
    before = param.clone()
    state = random_state(4, 16, seed=5)
    block_step_reference(param, grad, state["codes"], state["scale"], state["exp_avg_sq"],
                         make_codebook(5), **_hyper(2, lr=0.0, weight_decay=0.1))
    assert torch.equal(param, before)
    hyper = torch.tensor([0.0, 1.0, 1.0, 1.0])
    block_step_reference(param, grad, state["codes"], state["scale"], state["exp_avg_sq"],
                         make_codebook(5), hyper=hyper, **_hyper(2, lr=1e-3))
    assert torch.equal(param, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weight_decay_fold_rounds_like_two_inplace_ops(dtype: torch.dtype) -> None:
    # Zero gradient on fresh state: the momentum is exactly 0, so the step is the decay alone.
    param = (torch.randn(3 * 8, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)
    lr, wd = 0.01, 0.3
    omega = 1.0 - lr * wd
    state = random_state(3, 8, seed=6, fresh=True)
    expect = param.clone().mul_(torch.tensor(omega, dtype=torch.float32))
    expect_manual = (param.float() * np.float32(omega)).to(dtype)
    block_step_reference(param, torch.zeros(24), state["codes"], state["scale"],
                         state["exp_avg_sq"], make_codebook(6), **_hyper(1, lr, wd))
    assert torch.equal(param, expect)
    assert torch.equal(param, expect_manual)


def test_hyper_tensor_and_seed_tensor_match_host_scalars() -> None:
    gen = torch.Generator().manual_seed(7)
    param = torch.randn(6 * 64, generator=gen).to(torch.bfloat16)
    grad = torch.randn(6 * 64, generator=gen)
    cb = make_codebook(7)
    hp = _hyper(4, 2e-3, 0.05)
    hyper = torch.tensor([hp["lr"], hp["bc2_rsqrt"], hp["bc1_recip"], hp["decay"]],
                         dtype=torch.float32)
    for stochastic in (False, True):
        a_p, b_p = param.clone(), param.clone()
        a_s, b_s = random_state(6, 64, seed=7), random_state(6, 64, seed=7)
        block_step_reference(a_p, grad, a_s["codes"], a_s["scale"], a_s["exp_avg_sq"], cb,
                             stochastic_round=stochastic, seed=-55, **hp)
        block_step_reference(b_p, grad, b_s["codes"], b_s["scale"], b_s["exp_avg_sq"], cb,
                             stochastic_round=stochastic, seed=0, hyper=hyper,
                             seed_tensor=torch.tensor([-55]),
                             **{**hp, "lr": 9.0, "bc1_recip": 9.0, "bc2_rsqrt": 9.0})
        assert torch.equal(a_p, b_p)
        for key in a_s:
            assert torch.equal(a_s[key], b_s[key])


@pytest.mark.parametrize("num_blocks,period,chunk", [(40, 7, 30), (3, 1024, 100),
                                                     (2, 300, 300), (1, 4099, 1000)])
def test_chunking_over_whole_blocks(monkeypatch: pytest.MonkeyPatch, num_blocks: int,
                                    period: int, chunk: int) -> None:
    """Small chunks (and periods longer than a chunk) give the same codes and scales as one
    chunk; v and p agree to rounding (the sum of squares is accumulated in another order)."""
    gen = torch.Generator().manual_seed(period)
    n = num_blocks * period
    param = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen)
    cb = make_codebook(8)
    whole_p, whole_s = param.clone(), random_state(num_blocks, period, seed=8)
    block_step_reference(whole_p, grad, whole_s["codes"], whole_s["scale"],
                         whole_s["exp_avg_sq"], cb, stochastic_round=True, seed=3, **_hyper(2))
    monkeypatch.setattr(_numerics, "CHUNK_ELEMENTS", chunk)
    part_p, part_s = param.clone(), random_state(num_blocks, period, seed=8)
    block_step_reference(part_p, grad, part_s["codes"], part_s["scale"], part_s["exp_avg_sq"],
                         cb, stochastic_round=True, seed=3, **_hyper(2))
    assert torch.equal(part_s["codes"], whole_s["codes"])
    assert torch.equal(part_s["scale"], whole_s["scale"])
    torch.testing.assert_close(part_s["exp_avg_sq"], whole_s["exp_avg_sq"], rtol=1e-6, atol=0)
    torch.testing.assert_close(part_p, whole_p, rtol=1e-6, atol=1e-7)
    check_against_float64(param.clone(), grad, random_state(num_blocks, period, seed=8), cb)


def test_stochastic_rounding_step_is_unbiased_and_seeded() -> None:
    gen = torch.Generator().manual_seed(9)
    grad = torch.randn(2 * 32, generator=gen)
    cb = make_codebook(9)
    state0 = random_state(2, 32, seed=9)
    runs = []
    for seed in range(600):
        st = {k: v.clone() for k, v in state0.items()}
        block_step_reference(torch.zeros(64), grad, st["codes"], st["scale"], st["exp_avg_sq"],
                             cb, stochastic_round=True, seed=seed, **_hyper(2))
        runs.append(cb[st["codes"].long()] * st["scale"])
    again = {k: v.clone() for k, v in state0.items()}
    block_step_reference(torch.zeros(64), grad, again["codes"], again["scale"],
                         again["exp_avg_sq"], cb, stochastic_round=True, seed=599, **_hyper(2))
    assert torch.equal(cb[again["codes"].long()] * again["scale"], runs[-1])
    mean = torch.stack(runs).double().mean(0)
    m = (float(np.float32(BETA1)) * state0["scale"].double() * cb[state0["codes"].long()].double()
         + (1 - float(np.float32(BETA1))) * grad.double().view(2, 32))
    gap = (cb[1:] - cb[:-1]).max().double() * m.abs().amax(1, keepdim=True)
    assert torch.all((mean - m).abs() <= 5 * gap / (2 * 600**0.5))


def test_zero_size_and_numel_one() -> None:
    cb = make_codebook(10)
    empty = torch.empty(0)
    st = random_state(0, 1, seed=0)
    block_step_reference(empty, empty, st["codes"], st["scale"], st["exp_avg_sq"], cb,
                         **_hyper(1))
    param = torch.tensor([0.5])
    check_against_float64(param, torch.tensor([0.2]), random_state(1, 1, seed=10, fresh=True),
                          cb, step=1)
    # numel 1 (P = 1) stores the momentum exactly: code 0 or 255, scale |m|.
    st = random_state(1, 1, seed=10, fresh=True)
    block_step_reference(torch.tensor([0.5]), torch.tensor([-0.2]), st["codes"], st["scale"],
                         st["exp_avg_sq"], cb, **_hyper(1))
    assert st["codes"].item() == 0
    assert st["scale"].item() == pytest.approx(0.02, rel=1e-6)


def test_zero_gradient_blocks_do_not_move() -> None:
    param = torch.randn(4 * 32, generator=torch.Generator().manual_seed(11))
    before = param.clone()
    st = random_state(4, 32, seed=11, fresh=True)
    cb = make_codebook(11)
    for step in range(1, 5):
        block_step_reference(param, torch.zeros(128), st["codes"], st["scale"],
                             st["exp_avg_sq"], cb, **_hyper(step))
    assert torch.equal(param, before)
    assert torch.all(st["scale"] == 0) and torch.all(st["exp_avg_sq"] == 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradient_poisons_only_its_block(bad: float) -> None:
    gen = torch.Generator().manual_seed(12)
    param = torch.randn(4 * 16, generator=gen)
    grad = torch.randn(4 * 16, generator=gen)
    grad[20] = bad  # block 1
    st = random_state(4, 16, seed=12)
    block_step_reference(param, grad, st["codes"], st["scale"], st["exp_avg_sq"],
                         make_codebook(12), **_hyper(2))
    blocks = param.view(4, 16)
    assert torch.all(torch.isnan(blocks[1]))
    assert not torch.isfinite(st["scale"][1]).item()
    for b in (0, 2, 3):
        assert torch.all(torch.isfinite(blocks[b])) and torch.isfinite(st["scale"][b]).item()


def test_bad_arguments_raise_before_mutation() -> None:
    cb = make_codebook(0)
    param = torch.randn(64)
    st = random_state(4, 16, seed=0)
    snapshot = [param.clone()] + [t.clone() for t in st.values()]

    def call(**kw):
        args = dict(param=param, grad=torch.randn(64), codes=st["codes"], scale=st["scale"],
                    exp_avg_sq=st["exp_avg_sq"], codebook=cb)
        args.update(kw)
        block_step_reference(**args, **_hyper(1))

    with pytest.raises(ValueError, match="codes shape"):
        call(codes=torch.zeros(5, 16, dtype=torch.uint8))
    with pytest.raises(TypeError, match="scale must be torch.float32"):
        call(scale=st["scale"].double())
    with pytest.raises(ValueError, match="exp_avg_sq must have shape"):
        call(exp_avg_sq=torch.zeros(4))
    with pytest.raises(ValueError, match="grad has 63 elements"):
        call(grad=torch.randn(63))
    with pytest.raises(ValueError, match="param must be contiguous"):
        call(param=torch.randn(128)[::2])
    with pytest.raises(TypeError, match="param dtype"):
        call(param=torch.zeros(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="hyper must have shape"):
        call(hyper=torch.zeros(3))
    with pytest.raises(ValueError, match="beta1"):
        block_step_reference(param, torch.randn(64), st["codes"], st["scale"], st["exp_avg_sq"],
                             cb, **{**_hyper(1), "beta1": 1.0})
    for before, after in zip(snapshot, [param] + list(st.values())):
        assert torch.equal(before, after)


# --------------------------------------------------------------------------------------------
# Triton kernel vs reference. Same fp32 operations in the same order (no fma contraction,
# IEEE division and square root), so codes and scales must be bit-identical everywhere, with
# no boundary exemption: the block max is order-independent and the normalised momentum is
# computed by the same operations. The second moment is a sum of squares reduced in a
# different order (reference: torch.sum; kernel: per-lane partials and a tree), so it may
# differ by a few fp32 ulps, and through sigma the parameters by at most one ulp of their
# dtype (kernels_inputs.assert_within_one_ulp).
# --------------------------------------------------------------------------------------------


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _run_pair(param, grad, state, cb, *, route=None, split_elements=16384, loop_tile=2048,
              **kw) -> None:
    hp = {**_hyper(3, 1e-3, 0.01), **kw}
    ref_p, ref_s = param.clone(), clone_state(state)
    block_step_reference(ref_p, grad, ref_s["codes"], ref_s["scale"], ref_s["exp_avg_sq"], cb,
                         **hp)
    tri_p, tri_s = param.clone(), clone_state(state)
    if route is None:
        block_step_triton(tri_p, grad, tri_s["codes"], tri_s["scale"], tri_s["exp_avg_sq"], cb,
                          **hp)
    else:
        hp.pop("weight_decay", None)
        launch_step(tri_p, grad, tri_s["codes"], tri_s["scale"], exp_avg_sq=tri_s["exp_avg_sq"],
                    row=None, col=None, inv_rbar=None, ncols=1, codebook=cb,
                    lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"],
                    bc1_recip=hp["bc1_recip"], bc2=hp["bc2_rsqrt"], decay=hp["decay"],
                    maximize=hp.get("maximize", False),
                    stochastic_round=hp.get("stochastic_round", False), seed=hp.get("seed", 0),
                    hyper=hp.get("hyper"), seed_tensor=hp.get("seed_tensor"), route=route,
                    split_elements=split_elements, loop_tile=loop_tile)
    assert_bitwise(tri_s["codes"], ref_s["codes"], "codes")
    assert_bitwise(tri_s["scale"], ref_s["scale"], "scale")
    torch.testing.assert_close(tri_s["exp_avg_sq"], ref_s["exp_avg_sq"], rtol=4e-7, atol=0,
                               equal_nan=True)
    assert_within_one_ulp(tri_p, ref_p, "param", before=param)
    if hp["lr"] == 0:
        assert_bitwise(tri_p, param, "param with lr=0")


PARITY_SHAPES = [(1, 1), (4097, 1), (8191, 1), (3, 2), (601, 7), (16, 64), (4, 1024),
                 (3, 2048), (2, 4096)]


@pytest.mark.parametrize("num_blocks,period", PARITY_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_reference(num_blocks: int, period: int, dtype: torch.dtype) -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(num_blocks + period)
    n = num_blocks * period
    param = torch.randn(n, generator=gen).to(dtype).to(dev)
    grad = (torch.randn(n, generator=gen) * 0.05).to(dtype).to(dev)
    with_zero_gradients(grad, period, n)
    state = random_state(num_blocks, period, seed=period, device=dev)
    _run_pair(param, grad, state, make_codebook(period).to(dev))


@pytest.mark.parametrize("route,period,num_blocks,split,tile", [
    ("loop", 5003, 3, 16384, 2048),   # prime period > 4096: looped in tiles
    ("split", 5003, 2, 2048, 1024),   # split over 3 programs per block
    ("loop", 1024, 3, 16384, 512),    # short blocks through the long-block routes
    ("split", 1000, 2, 512, 256),
    ("tile", 7, 300, 0, 0),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_every_route(route: str, period: int, num_blocks: int, split: int, tile: int,
                            dtype: torch.dtype) -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(period)
    n = num_blocks * period
    param = torch.randn(n, generator=gen).to(dtype).to(dev)
    grad = with_zero_gradients(torch.randn(n, generator=gen).to(dev), period, n)
    state = random_state(num_blocks, period, seed=1, device=dev)
    cb = make_codebook(1).to(dev)
    kw = dict(route=route, split_elements=split or 16384, loop_tile=tile or 2048)
    _run_pair(param, grad, state, cb, **kw)
    _run_pair(param, grad, state, cb, stochastic_round=True, seed=-(2**62) - 3, maximize=True,
              **kw)


def test_route_choice_splits_only_blocks_longer_than_one_split() -> None:
    """Tiles up to 4096 elements a block; the loop route (one launch) for blocks that fit one
    split, where the split route would run the same programs in two launches with a torch
    merge; the split route only for longer blocks that are too few to fill the device (off
    CUDA the rule assumes 8 SMs, so 32 blocks fill it)."""
    cpu = torch.device("cpu")
    assert choose_route(16, 4096, cpu) == "tile"
    assert choose_route(16, 8192, cpu) == "loop"
    assert choose_route(1, SPLIT_ELEMENTS, cpu) == "loop"
    assert choose_route(1, SPLIT_ELEMENTS + 1, cpu) == "split"
    assert choose_route(31, SPLIT_ELEMENTS + 1, cpu) == "split"
    assert choose_route(32, SPLIT_ELEMENTS + 1, cpu) == "loop"


@pytest.mark.parametrize("period", [1, 64, 5003])
def test_triton_stochastic_hyper_maximize_lr0(period: int) -> None:
    dev = _device()
    num_blocks = 3 if period > 1 else 4097
    gen = torch.Generator().manual_seed(period)
    n = num_blocks * period
    param = torch.randn(n, generator=gen).to(torch.bfloat16).to(dev)
    grad = with_zero_gradients(torch.randn(n, generator=gen).to(dev), period, n)
    state = random_state(num_blocks, period, seed=2, device=dev)
    cb = make_codebook(0).to(dev)
    hp = _hyper(5, 3e-3, 0.1)
    hyper = torch.tensor([hp["lr"], hp["bc2_rsqrt"], hp["bc1_recip"], hp["decay"]],
                         device=dev)
    _run_pair(param, grad, state, cb, stochastic_round=True, seed=123)
    _run_pair(param, grad, state, cb, stochastic_round=True, hyper=hyper,
              seed_tensor=torch.tensor([-9], device=dev), maximize=True)
    _run_pair(param, grad, state, cb, lr=0.0)
    _run_pair(param, grad, state, cb, hyper=torch.tensor([0.0, 1.0, 1.0, 1.0], device=dev))


def test_triton_non_finite_and_zero_blocks_match_reference() -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(8 * 64, generator=gen)
    grad[70] = float("nan")
    grad[200] = float("inf")
    grad[256:320] = 0.0
    state = random_state(8, 64, seed=3)
    state["scale"][4] = 0.0
    _run_pair(torch.randn(8 * 64, generator=gen).to(dev), grad.to(dev),
              {k: v.to(dev) for k, v in state.items()}, make_codebook(3).to(dev))


def test_triton_grad_dtype_and_empty() -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(4)
    param = torch.randn(6 * 10, generator=gen).to(dev)
    state = random_state(6, 10, seed=4, device=dev)
    _run_pair(param, torch.randn(60, generator=gen, dtype=torch.float64).to(dev), state,
              make_codebook(4).to(dev))
    st = random_state(0, 5, seed=0, device=dev)
    block_step_triton(torch.empty(0, device=dev), torch.empty(0, device=dev), st["codes"],
                      st["scale"], st["exp_avg_sq"], make_codebook(0).to(dev), **_hyper(1))


def test_triton_rejects_fp64_params() -> None:
    st = random_state(2, 4, seed=0)
    with pytest.raises(TypeError, match="fp64 parameters take the PyTorch reference path"):
        block_step_triton(torch.zeros(8, dtype=torch.float64), torch.zeros(8), st["codes"],
                          st["scale"], st["exp_avg_sq"], make_codebook(0), **_hyper(1))


def test_public_op_matches_reference_on_cpu() -> None:
    gen = torch.Generator().manual_seed(5)
    param = torch.randn(4 * 32, generator=gen)
    grad = torch.randn(4 * 32, generator=gen)
    a_p, a = param.clone(), random_state(4, 32, seed=5)
    b_p, b = param.clone(), random_state(4, 32, seed=5)
    cb = make_codebook(5)
    block_step(a_p, grad, a["codes"], a["scale"], a["exp_avg_sq"], cb, **_hyper(2))
    block_step_reference(b_p, grad, b["codes"], b["scale"], b["exp_avg_sq"], cb, **_hyper(2))
    assert torch.equal(a_p, b_p) and all(torch.equal(a[k], b[k]) for k in a)
    torch.library.opcheck(
        torch.ops.gefen.block_step.default,
        (param.clone(), grad, a["codes"].clone(), a["scale"].clone(), a["exp_avg_sq"].clone(),
         cb, None, None, 1e-3, 0.9, 0.999, 1e-8, 2.0, 3.0, 1.0, False, False, 0),
        test_utils=("test_schema", "test_faketensor"))


# --------------------------------------------------------------------------------------------
# GPU: full size, torch.compile, CUDA graphs
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_blocks,period,route", [
    ((1 << 26), 1, None), ((1 << 26) // 7 // 64 * 64, 7, None), ((1 << 26) // 2048, 2048, None),
    ((1 << 26) // 4096, 4096, None), ((1 << 26) // 8192, 8192, "loop"),
    (8, (1 << 26) // 8, "split"), ((1 << 26) // 65536, 65536, None),
])
def test_triton_matches_reference_large_gpu(num_blocks: int, period: int, route) -> None:
    gen = torch.Generator(device="cuda").manual_seed(period)
    n = num_blocks * period
    param = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    grad = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    state = {"codes": torch.randint(0, 256, (num_blocks, period), device="cuda",
                                    dtype=torch.uint8, generator=gen),
             "scale": torch.rand(num_blocks, 1, device="cuda", generator=gen) * 0.1,
             "exp_avg_sq": torch.rand(num_blocks, 1, device="cuda", generator=gen) * 1e-2}
    cb = make_codebook(period).cuda()
    _run_pair(param, grad, state, cb, route=route)
    _run_pair(param, grad, state, cb, route=route, stochastic_round=True, seed=2**40 + 1)


@pytest.mark.gpu
def test_compile_fullgraph_gpu() -> None:
    gen = torch.Generator(device="cuda").manual_seed(6)
    param = torch.randn(64 * 100, device="cuda", generator=gen)
    grad = torch.randn(64 * 100, device="cuda", generator=gen)
    a_p, a = param.clone(), random_state(100, 64, seed=6, device="cuda")
    b_p, b = param.clone(), random_state(100, 64, seed=6, device="cuda")
    cb = make_codebook(6).cuda()

    @torch.compile(fullgraph=True)
    def step(p, g, q, s, v):
        block_step(p, g * 1.0, q, s, v, cb, **_hyper(2))

    step(a_p, grad, a["codes"], a["scale"], a["exp_avg_sq"])
    block_step_triton(b_p, grad, b["codes"], b["scale"], b["exp_avg_sq"], cb, **_hyper(2))
    assert torch.equal(a_p, b_p) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
@pytest.mark.parametrize("period", [7, 2048, 8192])
def test_cuda_graph_capture_gpu(period: int) -> None:
    """Capture one step with device hyperparameters and seed, replay it with new values."""
    num_blocks = (1 << 20) // period
    gen = torch.Generator(device="cuda").manual_seed(7)
    n = num_blocks * period
    param = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    grad = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    live = random_state(num_blocks, period, seed=7, device="cuda")
    cb = make_codebook(7).cuda()
    hyper = torch.tensor([1e-3, 2.0, 3.0, 0.999], device="cuda")
    seed_t = torch.tensor([5], device="cuda", dtype=torch.int64)
    kw = dict(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, bc1_recip=0.0, bc2_rsqrt=0.0,
              decay=1.0, stochastic_round=True, hyper=hyper, seed_tensor=seed_t)
    ref_p, ref = param.clone(), clone_state(live)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles the kernels) outside the capture
        warm_p, warm = param.clone(), clone_state(live)
        block_step(warm_p, grad, warm["codes"], warm["scale"], warm["exp_avg_sq"], cb, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        block_step(param, grad, live["codes"], live["scale"], live["exp_avg_sq"], cb, **kw)
    for step, (lr, seed) in enumerate([(1e-3, 5), (2e-3, 6), (5e-4, 7)], start=1):
        hyper.copy_(torch.tensor([lr, 1 / math.sqrt(1 - 0.999**step), 1 / (1 - 0.9**step),
                                  1 - lr * 0.01]))
        seed_t.fill_(seed)
        graph.replay()
        block_step_triton(ref_p, grad, ref["codes"], ref["scale"], ref["exp_avg_sq"], cb,
                          **{**kw, "hyper": hyper.clone(), "seed_tensor": seed_t.clone()})
    torch.cuda.synchronize()
    assert torch.equal(param, ref_p)
    for key in ref:
        assert torch.equal(live[key], ref[key])


def test_int64_offsets_follow_the_launch_tiles() -> None:
    """``needs_int64`` bounds every offset a program forms, so a launch with a wider split or
    loop tile than the defaults (the tests' routes) must switch to int64 sooner."""
    from gefen_kernels.ops._step_kernels import SPLIT_ELEMENTS, needs_int64

    period = 1 << 12
    # Largest block count the default tiles keep on int32 (binary search: the bound is
    # monotone in the block count).
    lo, hi = 0, (1 << 31) // period
    assert not needs_int64(lo, period) and needs_int64(hi, period)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if not needs_int64(mid, period) else (lo, mid)
    nb = lo
    assert needs_int64(nb + 1, period)
    assert needs_int64(nb, period, loop_tile=1 << 22)
    assert needs_int64(nb, period, split_elements=64 * SPLIT_ELEMENTS)
    assert not needs_int64(nb, period, split_elements=SPLIT_ELEMENTS // 2)
    assert not needs_int64(1, 1) and needs_int64(1 << 31, 1)
