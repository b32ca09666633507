"""factored_step reference (docs/algorithm.md#factored-second-moment) against an independent float64
implementation."""

from __future__ import annotations

import importlib
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
from kernels_oracle import (
    boundary_distance,
    factored_stats64,
    momentum64,
    param_update64,
    requantize64,
)

from gefen_kernels import _numerics
from gefen_kernels.ops import _step_kernels as step_kernels
from gefen_kernels.ops._step_kernels import launch_step
from gefen_kernels.ops._step_ref import make_scalars
from gefen_kernels.ops.factored_step import (
    _ema,
    _rbar_reciprocal,
    _row_col_sums_triton,
    factored_step,
    factored_step_reference,
    factored_step_triton,
)

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


def _hyper(step: int, lr: float = 1e-3, weight_decay: float = 0.0) -> dict[str, float]:
    return dict(lr=lr, beta1=BETA1, beta2=BETA2, eps=EPS,
                bc1_recip=1.0 / (1.0 - BETA1**step), bc2_recip=1.0 / (1.0 - BETA2**step),
                decay=1.0 - lr * weight_decay)


def make_state(rows: int, cols: int, period: int, *, seed: int, fresh: bool = False):
    st = random_state(rows * cols // period, period, seed=seed, fresh=fresh)
    del st["exp_avg_sq"]
    gen = torch.Generator().manual_seed(seed + 1)
    if fresh:
        st["row"], st["col"] = torch.zeros(rows), torch.zeros(cols)
    else:
        st["row"] = torch.rand(rows, generator=gen) * 1e-3
        st["col"] = torch.rand(cols, generator=gen) * 1e-3
    return st


def run(param, grad, st, cb, **kw):
    factored_step_reference(param, grad, st["codes"], st["scale"], st["row"], st["col"], cb, **kw)


def check_against_float64(param, grad, st, cb, *, step=3, lr=1e-3, weight_decay=0.0,
                          maximize=False, impl=run) -> None:
    """Same rules as the block-mode comparison (see test_block_step.check_against_float64)."""
    hp = _hyper(step, lr, weight_decay)
    rows, cols = param.shape
    num_blocks, period = st["codes"].shape
    fp64 = param.dtype == torch.float64
    b1 = BETA1 if fp64 else float(np.float32(BETA1))
    b2 = BETA2 if fp64 else float(np.float32(BETA2))
    cb64 = cb.double().numpy()
    g = grad.double().numpy() * (-1.0 if maximize else 1.0)
    r_new, k_new, big_v = factored_stats64(g, st["row"].double().numpy(),
                                           st["col"].double().numpy(), beta2=b2)
    sigma = hp["bc1_recip"] / (np.sqrt(big_v * hp["bc2_recip"]) + EPS)
    gb = g.reshape(num_blocks, period)
    m = momentum64(gb, st["codes"].long().numpy(), st["scale"].double().numpy(), cb64, b1)
    s_new, z, q64 = requantize64(m, cb64, gb == 0)
    terms = b1 * st["scale"].double().numpy() + (1 - b1) * np.abs(gb).max(1, keepdims=True)
    p_dec = param.double().numpy().reshape(num_blocks, period) * hp["decay"]
    before = param.clone()
    impl(param, grad, st, cb, maximize=maximize, **hp)
    np.testing.assert_allclose(st["row"].double().numpy(), r_new, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(st["col"].double().numpy(), k_new, rtol=2e-6, atol=1e-30)
    assert np.all(np.abs(st["scale"].double().numpy() - s_new) <= 1e-6 * terms + 1e-30)
    q = st["codes"].long().numpy()
    margin = 1e-6 * (1.0 + terms / np.where(s_new > 0, s_new, 1.0))
    near = boundary_distance(z, cb64, gb == 0) <= margin
    assert np.array_equal(q[~near], q64[~near])
    assert np.all(np.abs(q[near] - q64[near]) <= 1)
    mhat = (cb64[q] * s_new).reshape(rows, cols)
    mhat = np.where(big_v == 0, 0.0, mhat)  # zero-V policy (see gefen_kernels._numerics)
    p64 = param_update64(p_dec.reshape(rows, cols), mhat, sigma, lr)
    u = lr * sigma * np.abs(mhat)
    tol = (ulp(p64, param.dtype) * (2.0 if param.dtype == torch.float32 else 1.0) + 1e-5 * u
           + lr * sigma * 2e-6 * np.repeat(terms, period, axis=1).reshape(rows, cols))
    got = param.double().numpy()
    assert np.all(np.abs(got - p64) <= tol), np.max(np.abs(got - p64) - tol)
    if lr == 0:
        assert torch.equal(param, before)


SHAPES = [(1, 1, 1), (1, 4097, 4097), (4097, 1, 1), (7, 13, 7), (13, 7, 91), (8, 128, 64),
          (16, 96, 1), (6, 1024, 2048), (4, 4096, 4096), (2, 8192, 16384), (31, 33, 3)]


@pytest.mark.parametrize("rows,cols,period", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64(rows: int, cols: int, period: int, dtype: torch.dtype) -> None:
    seed = rows * 7 + cols + period
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(rows, cols, generator=gen).to(dtype)
    grad = (torch.randn(rows, cols, generator=gen) * 0.05).to(dtype)
    check_against_float64(param, grad, make_state(rows, cols, period, seed=seed),
                          make_codebook(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_several_steps_from_fresh_state(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    param = torch.randn(12, 40, generator=gen, dtype=dtype)
    st = make_state(12, 40, 20, seed=1, fresh=True)
    cb = make_codebook(1)
    for step in range(1, 6):
        grad = torch.randn(12, 40, generator=gen, dtype=dtype) * 0.1
        check_against_float64(param, grad, st, cb, step=step, weight_decay=0.1,
                              maximize=step % 2 == 0)


@pytest.mark.parametrize("period", [1, 8, 24, 96])
def test_all_zero_rows_and_columns_do_not_drift(period: int) -> None:
    gen = torch.Generator().manual_seed(2)
    rows, cols = 8, 24
    param = torch.randn(rows, cols, generator=gen)
    before = param.clone()
    st = make_state(rows, cols, period, seed=2, fresh=True)
    cb = make_codebook(2)
    for step in range(1, 12):
        grad = torch.randn(rows, cols, generator=gen)
        grad[2] = 0.0
        grad[:, 5] = 0.0
        grad[:, 17] = 0.0
        factored_step_reference(param, grad, st["codes"], st["scale"], st["row"], st["col"], cb,
                                **_hyper(step, lr=1e-2))
    assert torch.equal(param[2], before[2])
    assert torch.equal(param[:, 5], before[:, 5]) and torch.equal(param[:, 17], before[:, 17])
    assert st["row"][2] == 0 and st["col"][5] == 0 and st["col"][17] == 0
    moved = (param != before).float().mean()
    assert moved > 0.5  # everything else trains


@pytest.mark.parametrize("chunk", [50, 200, 1000])
def test_chunking(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    gen = torch.Generator().manual_seed(3)
    param = torch.randn(20, 300, generator=gen)
    grad = torch.randn(20, 300, generator=gen)
    cb = make_codebook(3)
    whole_p, whole = param.clone(), make_state(20, 300, 600, seed=3)
    run(whole_p, grad, whole, cb, stochastic_round=True, seed=11, **_hyper(2))
    monkeypatch.setattr(_numerics, "CHUNK_ELEMENTS", chunk)
    part_p, part = param.clone(), make_state(20, 300, 600, seed=3)
    run(part_p, grad, part, cb, stochastic_round=True, seed=11, **_hyper(2))
    assert torch.equal(part["codes"], whole["codes"])
    assert torch.equal(part["scale"], whole["scale"])
    torch.testing.assert_close(part["row"], whole["row"], rtol=1e-6, atol=0)
    torch.testing.assert_close(part["col"], whole["col"], rtol=1e-6, atol=0)
    torch.testing.assert_close(part_p, whole_p, rtol=1e-6, atol=1e-7)
    check_against_float64(param.clone(), grad, make_state(20, 300, 600, seed=3), cb)


def test_lr_zero_hyper_and_seed_tensor() -> None:
    gen = torch.Generator().manual_seed(4)
    param = torch.randn(10, 12, generator=gen).to(torch.bfloat16)
    grad = torch.randn(10, 12, generator=gen)
    cb = make_codebook(4)
    before = param.clone()
    run(param, grad, make_state(10, 12, 6, seed=4), cb, **_hyper(2, lr=0.0, weight_decay=0.5))
    assert torch.equal(param, before)
    hp = _hyper(3, 3e-3, 0.01)
    hyper = torch.tensor([hp["lr"], hp["bc2_recip"], hp["bc1_recip"], hp["decay"]])
    a_p, b_p = param.clone(), param.clone()
    a, b = make_state(10, 12, 6, seed=4), make_state(10, 12, 6, seed=4)
    run(a_p, grad, a, cb, stochastic_round=True, seed=2**62, **hp)
    run(b_p, grad, b, cb, stochastic_round=True, hyper=hyper,
        seed_tensor=torch.tensor([2**62]), **{**hp, "lr": 5.0})
    assert torch.equal(a_p, b_p)
    for key in a:
        assert torch.equal(a[key], b[key])


def test_zero_size_and_errors() -> None:
    cb = make_codebook(5)
    st = make_state(0, 5, 5, seed=5)
    run(torch.empty(0, 5), torch.empty(0, 5), st, cb, **_hyper(1))
    param = torch.randn(4, 6)
    st = make_state(4, 6, 6, seed=5)
    snapshot = [param.clone()] + [t.clone() for t in st.values()]
    with pytest.raises(ValueError, match="2-D"):
        factored_step_reference(param.view(-1), torch.randn(24), st["codes"], st["scale"],
                                st["row"], st["col"], cb, **_hyper(1))
    with pytest.raises(ValueError, match="exp_avg_sq_col must have shape"):
        factored_step_reference(param, torch.randn(4, 6), st["codes"], st["scale"],
                                st["row"], torch.zeros(4), cb, **_hyper(1))
    with pytest.raises(ValueError, match="grad shape"):
        factored_step_reference(param, torch.randn(6, 4), st["codes"], st["scale"],
                                st["row"], st["col"], cb, **_hyper(1))
    for before, after in zip(snapshot, [param] + list(st.values())):
        assert torch.equal(before, after)


def test_nan_gradient_propagates() -> None:
    gen = torch.Generator().manual_seed(6)
    param = torch.randn(4, 8, generator=gen)
    grad = torch.randn(4, 8, generator=gen)
    grad[1, 3] = float("nan")
    st = make_state(4, 8, 8, seed=6)
    run(param, grad, st, make_codebook(6), **_hyper(2))
    assert torch.isnan(st["row"][1]) and torch.isnan(st["col"][3])
    assert torch.isnan(param[1]).all() and torch.isnan(param[:, 3]).all()
    assert not math.isfinite(st["scale"][1].item())


# --------------------------------------------------------------------------------------------
# Triton path vs reference: codes and scales bit-identical (same operations in the same order;
# the block max is order-independent); r and k may differ by fp32 ulps (the kernel reduces the
# sums of squares in another order), and the parameters by at most one ulp of their dtype.
# --------------------------------------------------------------------------------------------


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _triton_with_route(param, grad, st, cb, route, split_elements=16384, loop_tile=2048, **hp):
    rows, cols = param.shape
    sc = make_scalars(dtype=torch.float32, lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"],
                      eps=hp["eps"], bc1_recip=hp["bc1_recip"], bc2=hp["bc2_recip"],
                      decay=hp["decay"], hyper=None)
    row_sum, col_sum = _row_col_sums_triton(grad)
    st["row"].copy_(_ema(st["row"], row_sum, 1.0 / cols, sc))
    st["col"].copy_(_ema(st["col"], col_sum, 1.0 / rows, sc))
    launch_step(param, grad, st["codes"], st["scale"], exp_avg_sq=None, row=st["row"],
                col=st["col"], inv_rbar=_rbar_reciprocal(st["row"], rows).view(1), ncols=cols,
                codebook=cb, lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"],
                bc1_recip=hp["bc1_recip"], bc2=hp["bc2_recip"], decay=hp["decay"],
                maximize=hp.get("maximize", False),
                stochastic_round=hp.get("stochastic_round", False), seed=hp.get("seed", 0),
                hyper=None, seed_tensor=None, route=route, split_elements=split_elements,
                loop_tile=loop_tile)


def _sum_rtol(terms: int) -> float:
    """Relative difference allowed between two fp32 sums of ``terms`` non-negative squares
    taken in different (blocked, tree) orders: each carries about ``log2(terms)`` roundings of
    at most 2**-24, and the r/k EMA passes that on at most once. At the CPU sizes (<= 4097
    terms) this is 4e-7 to 1.5e-6; at 8192 terms (the GPU shapes) 1.6e-6: far below what a
    lost row, a lost column or a wrong 1/C (>= 1e-4) would give."""
    return 2.0 * max(4, math.ceil(math.log2(max(terms, 2)))) * 2.0**-24


def _pair(param, grad, st, cb, *, route=None, split_elements=16384, loop_tile=2048, **kw):
    hp = {**_hyper(3, 1e-3, 0.01), **kw}
    ref_p, ref = param.clone(), clone_state(st)
    run(ref_p, grad, ref, cb, **hp)
    tri_p, tri = param.clone(), clone_state(st)
    if route is None:
        factored_step_triton(tri_p, grad, tri["codes"], tri["scale"], tri["row"], tri["col"],
                             cb, **hp)
    else:
        _triton_with_route(tri_p, grad, tri, cb, route, split_elements, loop_tile, **hp)
    assert_bitwise(tri["codes"], ref["codes"], "codes")
    assert_bitwise(tri["scale"], ref["scale"], "scale")
    rows, cols = param.shape
    torch.testing.assert_close(tri["row"], ref["row"], rtol=_sum_rtol(cols), atol=0,
                               equal_nan=True)
    torch.testing.assert_close(tri["col"], ref["col"], rtol=_sum_rtol(rows), atol=0,
                               equal_nan=True)
    assert_within_one_ulp(tri_p, ref_p, "param", before=param)
    return tri_p


# (64, 96, 32), (12, 64, 16) and (8, 48, 48) take the tile route's per-block row statistic
# and vector column loads (IN_ROW); (6, 80, 40) (a period not a multiple of 16) the
# per-element form; (16, 1024, 2048) (blocks across rows) the quantising tile and the flat
# update (_step_kernels.flat_update). The last eight take a head and a tail piece
# (tile_shape's TAIL): 1152, 144 and 1024 / 2304 (a 4096-lane tile, 256-lane tail) with the
# flat update, 2304 / 1152, 288 / 144, 1040 / 1040 and 2304 / 2304 with IN_ROW, 150 (not a
# multiple of 16) with per-element statistics and a 32-lane tail.
PARITY = [(1, 1, 1), (7, 13, 7), (64, 96, 32), (1, 4097, 4097), (4097, 1, 1), (31, 33, 3),
          (16, 1024, 2048), (5, 300, 1500), (12, 64, 16), (8, 48, 48), (6, 80, 40),
          (10, 576, 1152), (6, 96, 144), (6, 2304, 1152), (4, 288, 144), (3, 1040, 1040),
          (5, 150, 150), (9, 1024, 2304), (4, 2304, 2304)]


def test_parity_shapes_cover_both_column_forms() -> None:
    from gefen_kernels.ops._step_kernels import blocks_in_rows

    tile = [(c, p) for _, c, p in PARITY if p <= 4096]
    assert {blocks_in_rows(True, p, c) for c, p in tile} == {True, False}
    tails = [(c, p) for c, p in tile if step_kernels.tile_shape(p, True)[2]]
    assert {blocks_in_rows(True, p, c) for c, p in tails} == {True, False}


@pytest.mark.parametrize("period,factored,tail", [
    (1152, True, 128), (1040, True, 16), (1280, True, 256), (144, True, 16), (150, True, 32),
    (1281, True, 0), (1536, True, 0), (1024, True, 0), (2048, True, 0), (135, True, 0),
    (7, True, 0), (1152, False, 0)])
def test_tile_shape_tail(period: int, factored: bool, tail: int) -> None:
    """A tail only in factored mode, for P2/2 < P <= 5 P2/8, and only 16 lanes or wider; the
    head and the tail then cover the block with fewer lanes than one P2 tile."""
    p2, bpp, got = step_kernels.tile_shape(period, factored)
    assert p2 == 1 << (period - 1).bit_length() and bpp >= 1
    assert got == tail


def test_tile_shape_pieces_cover_every_period() -> None:
    """For every tile-route period, the head ``[0, P2/2)`` and the tail ``[P2/2, P2/2 +
    TAIL)`` cover ``[0, P)`` (masked by ``cols < P``) with fewer lanes than one tile, and a
    tail is a power of two of at least 16 lanes."""
    for period in range(1, step_kernels.TILE_MAX_PERIOD + 1):
        assert step_kernels.tile_shape(period, False)[2] == 0
        p2, _, tail = step_kernels.tile_shape(period, True)
        if tail:
            assert tail >= 16 and tail & (tail - 1) == 0
            assert p2 // 2 < period <= p2 // 2 + tail < p2, period


@pytest.mark.parametrize("nan", [False, True])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("rows,cols,period", [(10, 576, 1152), (6, 2304, 1152), (6, 96, 144)])
def test_tail_piece_matches_one_tile(monkeypatch: pytest.MonkeyPatch, rows: int, cols: int,
                                     period: int, stochastic: bool, nan: bool) -> None:
    """Head and tail against the same step on one ``[BPP, P2]`` tile: the same bits in every
    output (a max does not depend on its order, and factored mode sums nothing per block),
    with a block whose maximum lies in its tail and a column whose statistic is zero (V = 0,
    so no update there); with stochastic rounding each element keeps its own random draw.
    With ``nan``, a NaN gradient in a tail lane: that block's scale is NaN, and so are ``rbar``
    and with it every parameter, so only codes and scales are compared then."""
    dev = _device()
    gen = torch.Generator().manual_seed(period)
    param = torch.randn(rows, cols, generator=gen).to(torch.bfloat16).to(dev)
    grad = (torch.randn(rows, cols, generator=gen) * 0.05).to(torch.bfloat16).to(dev)
    with_zero_gradients(grad, period, period)
    grad.view(-1)[period - 2] = 3.0  # the first block's largest |m| in its tail
    grad[:, 5] = 0.0  # a column without gradient: V = 0 there
    if nan:
        grad.view(-1)[2 * period - 1] = float("nan")  # the last lane (tail) of the second block
    st = {k: v.to(dev) for k, v in make_state(rows, cols, period, seed=period).items()}
    st["col"][5] = 0.0
    cb = make_codebook(period).to(dev)
    # A large lr and no decay: most bf16 parameters move, the V = 0 column must not.
    hp = {**_hyper(3, 0.1, 0.0), "stochastic_round": stochastic, "seed": 12345}
    assert step_kernels.tile_shape(period, True)[2] > 0
    outs = []
    for one_tile in (False, True):
        if one_tile:
            monkeypatch.setattr(step_kernels, "tile_shape",
                                lambda p, f, split=step_kernels.tile_shape: (*split(p, f)[:2], 0))
        p, tri = param.clone(), clone_state(st)
        factored_step_triton(p, grad, tri["codes"], tri["scale"], tri["row"], tri["col"], cb,
                             **hp)
        outs.append((p, tri))
    (p_tail, tail), (p_one, one) = outs
    for key in ("codes", "scale", "row", "col"):
        assert_bitwise(tail[key], one[key], key)
    if nan:
        assert tail["scale"][1].isnan().all()
        return
    assert not tail["scale"].isnan().any() and not p_tail.isnan().any()
    others = torch.arange(cols, device=dev) != 5
    assert (p_tail != param)[:, others].float().mean() > 0.5
    assert_bitwise(p_tail[:, 5], param[:, 5], "param, V = 0 column")
    assert_bitwise(p_tail, p_one, "param")


@pytest.mark.parametrize("rows,cols,period", [(10, 576, 1152), (4, 288, 144), (4, 2304, 2304)])
def test_tail_piece_matches_reference_maximize(rows: int, cols: int, period: int) -> None:
    """A head and a tail piece with ``maximize`` (the gradient negated in both pieces)
    against the reference."""
    assert step_kernels.tile_shape(period, True)[2] > 0
    dev = _device()
    gen = torch.Generator().manual_seed(period + 7)
    param = torch.randn(rows, cols, generator=gen).to(torch.bfloat16).to(dev)
    grad = (torch.randn(rows, cols, generator=gen) * 0.05).to(torch.bfloat16).to(dev)
    with_zero_gradients(grad, period, period)
    st = {k: v.to(dev) for k, v in make_state(rows, cols, period, seed=period).items()}
    _pair(param, grad, st, make_codebook(period).to(dev), maximize=True)


@pytest.mark.parametrize("rows,cols,period", PARITY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_reference(rows: int, cols: int, period: int, dtype: torch.dtype) -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(rows + cols + period)
    param = torch.randn(rows, cols, generator=gen).to(dtype).to(dev)
    grad = (torch.randn(rows, cols, generator=gen) * 0.05).to(dtype).to(dev)
    with_zero_gradients(grad, period, rows * cols)
    st = {k: v.to(dev) for k, v in make_state(rows, cols, period, seed=period).items()}
    _pair(param, grad, st, make_codebook(period).to(dev))


@pytest.mark.parametrize("route,rows,cols,period,split,tile", [
    ("loop", 3, 5003, 5003, 16384, 2048),
    ("split", 2, 4099, 4099, 2048, 1024),
    ("split", 4, 250, 500, 256, 128),
])
def test_triton_every_route(route, rows, cols, period, split, tile) -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(cols)
    param = torch.randn(rows, cols, generator=gen).to(torch.bfloat16).to(dev)
    grad = with_zero_gradients(torch.randn(rows, cols, generator=gen).to(dev), period, cols)
    st = {k: v.to(dev) for k, v in make_state(rows, cols, period, seed=3).items()}
    cb = make_codebook(1).to(dev)
    _pair(param, grad, st, cb, route=route, split_elements=split, loop_tile=tile)
    _pair(param, grad, st, cb, route=route, split_elements=split, loop_tile=tile,
          stochastic_round=True, seed=77, maximize=True)


# Small stand-ins for the GPU sizes at which the statistics layout changes shape: several column
# tiles per split (the row partials' bound), more splits than one finalize chunk of row partials,
# more row programs than one chunk of column partials, more r' block sums than one chunk.
# (_STATS_STRIP_CHUNKS=1: strips of one chunk, so small shapes get several row programs.)
LAYOUTS = [
    pytest.param(40, 1100, dict(_STATS_TILE=2048, _STATS_ROW_PART_FLOATS=80,
                                _STATS_COL_PART_FLOATS=4000, _STATS_STRIP_CHUNKS=1), None,
                 "tiles", id="tiles-per-split"),
    pytest.param(8, 72, dict(_STATS_TILE=16, _STATS_CB=4), None, "splits", id="many-splits"),
    pytest.param(260, 4, dict(_STATS_TILE=16, _STATS_CB=4, _STATS_STRIP_CHUNKS=1), 1, "rows",
                 id="many-row-programs"),
    # Strips of three chunks, the last one shorter (200 = 16 x 12 + 8 rows).
    pytest.param(200, 72, dict(_STATS_TILE=16, _STATS_CB=4, _STATS_STRIP_CHUNKS=3), None,
                 "strips", id="multi-chunk-strips"),
]


@pytest.mark.parametrize("rows,cols,consts,total_chunk,expect", LAYOUTS)
def test_triton_statistics_layouts(monkeypatch, rows, cols, consts, total_chunk, expect) -> None:
    fs = importlib.import_module("gefen_kernels.ops._factored_step_kernels")
    monkeypatch.setattr(fs, "program_elements", lambda gpu: gpu)
    for name, value in consts.items():
        monkeypatch.setattr(fs, name, value)
    if total_chunk is not None:
        monkeypatch.setitem(fs._FIN_CONSTS, "FT", total_chunk)
    rb, cb, splits, n_row_programs, rows_per_program = fs.stats_layout(rows, cols)
    shape = (splits, -(-cols // cb), n_row_programs)
    if expect == "tiles":
        assert splits < shape[1] and n_row_programs > 1, shape
    elif expect == "splits":
        assert splits > fs._FIN_SR, shape
    elif expect == "strips":
        assert rows_per_program == 3 * rb and n_row_programs > 1, shape
        assert rows % rows_per_program != 0, shape
    else:
        assert n_row_programs > fs._FIN_SP and -(-rows // fs._FIN_ROWS) > total_chunk, shape
    dev = _device()
    gen = torch.Generator().manual_seed(rows)
    param = torch.randn(rows, cols, generator=gen).to(torch.bfloat16).to(dev)
    scale = torch.logspace(-2, 0, rows).reshape(-1, 1) * torch.logspace(0, -1, cols)
    grad = (torch.randn(rows, cols, generator=gen) * scale).to(torch.bfloat16).to(dev)
    st = {k: v.to(dev) for k, v in make_state(rows, cols, cols, seed=rows).items()}
    cb_ = make_codebook(4).to(dev)
    hp = _hyper(3, 1e-3, 0.01)
    one_p = _pair(param, grad, st, cb_)

    # r and k against float64 sums of the same gradient (independent of both implementations).
    one = clone_state(st)
    factored_step_triton(param.clone(), grad, one["codes"], one["scale"], one["row"], one["col"],
                         cb_, **hp)
    r64, k64, _ = factored_stats64(grad.double().cpu().numpy(), st["row"].double().cpu().numpy(),
                                   st["col"].double().cpu().numpy(),
                                   beta2=float(np.float32(BETA2)))
    np.testing.assert_allclose(one["row"].double().cpu().numpy(), r64, rtol=_sum_rtol(cols))
    np.testing.assert_allclose(one["col"].double().cpu().numpy(), k64, rtol=_sum_rtol(rows))

    # The row-shard path with unreduced sums (PHASE 1 then 2) equals the one-call step (PHASE 0).
    two = clone_state(st)
    two_p = param.clone()
    launchers = importlib.import_module("gefen_kernels.ops.factored_step")
    stats = launchers._partial_stats_triton(grad, two["row"], BETA2)
    factored_step_triton(two_p, grad, two["codes"], two["scale"], two["row"], two["col"], cb_,
                         **hp, stats=stats, global_rows=rows)
    assert_bitwise(two_p, one_p, "param")
    for k in one:
        assert_bitwise(two[k], one[k], k)


def test_triton_zero_rows_columns_hyper_and_nan() -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(8)
    rows, cols = 24, 40
    param = torch.randn(rows, cols, generator=gen).to(dev)
    st = {k: v.to(dev) for k, v in make_state(rows, cols, 20, seed=8, fresh=True).items()}
    cb = make_codebook(8).to(dev)
    before = param.clone()
    for step in range(1, 4):
        grad = torch.randn(rows, cols, generator=gen).to(dev)
        grad[3] = 0.0
        grad[:, 7] = 0.0
        hp = _hyper(step, 1e-2)
        hyper = torch.tensor([hp["lr"], hp["bc2_recip"], hp["bc1_recip"], hp["decay"]],
                             device=dev)
        new_p = _pair(param, grad, st, cb, stochastic_round=True, hyper=hyper,
                      seed_tensor=torch.tensor([step], device=dev), **hp)
        factored_step_triton(param, grad, st["codes"], st["scale"], st["row"], st["col"], cb,
                             stochastic_round=True, hyper=hyper,
                             seed_tensor=torch.tensor([step], device=dev), **hp)
        assert_bitwise(param, new_p, "param")
    assert torch.equal(param[3], before[3]) and torch.equal(param[:, 7], before[:, 7])
    grad = torch.randn(rows, cols, generator=gen).to(dev)
    grad[5, 5] = float("nan")
    _pair(param, grad, st, cb)
    _pair(param, grad, st, cb, lr=0.0)


def test_public_op_on_cpu() -> None:
    gen = torch.Generator().manual_seed(9)
    param = torch.randn(6, 10, generator=gen)
    grad = torch.randn(6, 10, generator=gen)
    cb = make_codebook(9)
    a_p, a = param.clone(), make_state(6, 10, 5, seed=9)
    b_p, b = param.clone(), make_state(6, 10, 5, seed=9)
    factored_step(a_p, grad, a["codes"], a["scale"], a["row"], a["col"], cb, **_hyper(2))
    run(b_p, grad, b, cb, **_hyper(2))
    assert torch.equal(a_p, b_p) and all(torch.equal(a[k], b[k]) for k in a)
    torch.library.opcheck(
        torch.ops.gefen.factored_step.default,
        (param.clone(), grad, a["codes"].clone(), a["scale"].clone(), a["row"].clone(),
         a["col"].clone(), cb, None, None, 1e-3, 0.9, 0.999, 1e-8, 2.0, 3.0, 1.0, False, False,
         0), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,period,route", [
    (8192, 8192, 8192, None), (8192, 8192, 2048, None), (4096, 16384, 4096, None),
    (65536, 1024, 1, None), (2, 1 << 25, 1 << 25, "split"), (16384, 4096, 16384, "loop"),
    (12288, 3072, 1152, None), (12288, 2304, 1152, None),  # head and tail (tile_shape)
])
def test_triton_matches_reference_large_gpu(rows, cols, period, route) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    param = torch.randn(rows, cols, device="cuda", generator=gen).to(torch.bfloat16)
    grad = torch.randn(rows, cols, device="cuda", generator=gen).to(torch.bfloat16)
    grad[min(7, rows - 1)] = 0.0  # a zero row and a zero column (some shapes have 2 rows)
    grad[:, 3] = 0.0
    b = rows * cols // period
    st = {"codes": torch.randint(0, 256, (b, period), device="cuda", dtype=torch.uint8,
                                 generator=gen),
          "scale": torch.rand(b, 1, device="cuda", generator=gen) * 0.1,
          "row": torch.rand(rows, device="cuda", generator=gen) * 1e-3,
          "col": torch.rand(cols, device="cuda", generator=gen) * 1e-3}
    cb = make_codebook(1).cuda()
    _pair(param, grad, st, cb, route=route)
    _pair(param, grad, st, cb, route=route, stochastic_round=True, seed=5)


@pytest.mark.gpu
def test_compile_and_cuda_graph_gpu() -> None:
    gen = torch.Generator(device="cuda").manual_seed(10)
    rows, cols = 512, 768
    param = torch.randn(rows, cols, device="cuda", generator=gen).to(torch.bfloat16)
    grad = torch.randn(rows, cols, device="cuda", generator=gen).to(torch.bfloat16)
    cb = make_codebook(10).cuda()
    st = {k: v.cuda() for k, v in make_state(rows, cols, 768, seed=10).items()}
    hyper = torch.tensor([1e-3, 1.5, 2.0, 0.9999], device="cuda")
    seed_t = torch.tensor([3], device="cuda")
    kw = dict(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, bc1_recip=0.0, bc2_recip=0.0,
              decay=1.0, stochastic_round=True, hyper=hyper, seed_tensor=seed_t)

    @torch.compile(fullgraph=True)
    def step(p, g, q, s, r, k):
        factored_step(p, g, q, s, r, k, cb, **kw)

    a_p, a = param.clone(), clone_state(st)
    step(a_p, grad, a["codes"], a["scale"], a["row"], a["col"])
    b_p, b = param.clone(), clone_state(st)
    factored_step_triton(b_p, grad, b["codes"], b["scale"], b["row"], b["col"], cb, **kw)
    assert torch.equal(a_p, b_p) and all(torch.equal(a[k], b[k]) for k in a)

    live_p, live = param.clone(), clone_state(st)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        w_p, w = param.clone(), clone_state(st)
        factored_step(w_p, grad, w["codes"], w["scale"], w["row"], w["col"], cb, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        factored_step(live_p, grad, live["codes"], live["scale"], live["row"], live["col"], cb,
                      **kw)
    ref_p, ref = param.clone(), clone_state(st)
    for lr, seed in [(1e-3, 3), (3e-3, 4)]:
        hyper[0] = lr
        seed_t.fill_(seed)
        graph.replay()
        factored_step_triton(ref_p, grad, ref["codes"], ref["scale"], ref["row"], ref["col"],
                             cb, **{**kw, "hyper": hyper.clone(), "seed_tensor": seed_t.clone()})
    torch.cuda.synchronize()
    assert torch.equal(live_p, ref_p) and all(torch.equal(live[k], ref[k]) for k in ref)


@pytest.mark.parametrize("ncols", [1, 2, 3, 5, 7, 13, 96, 641, 2047, 2048, 2049, 4097, 8191, 8192,
                                   50257, 128256, 2**20 + 1, 2**30 - 1, 2**30, 2**30 + 1,
                                   2**31 - 1])
def test_ncols_divider_is_exact(ncols: int) -> None:
    """The factored kernels' row = offs // ncols by multiply-high (int32 offsets), written out
    in exact integers: every offset below 2**31 at and around each multiple of ncols, the
    ends of the range, and random offsets."""
    from gefen_kernels.ops._step_kernels import ncols_divider

    magic, shift = ncols_divider(ncols)
    assert -2**31 <= magic < 2**31 and 0 <= shift <= 31
    magic_u = magic & 0xFFFFFFFF
    rng = np.random.default_rng(ncols)
    multiples = np.unique(np.concatenate([
        np.arange(0, min(2**31 // ncols, 64)), rng.integers(0, 2**31 // ncols, 256),
        [2**31 // ncols]])) * ncols
    n = np.concatenate([multiples - 1, multiples, multiples + 1, rng.integers(0, 2**31, 4096),
                        [0, 1, 2**31 - 2, 2**31 - 1]])
    for value in n[(n >= 0) & (n < 2**31)].tolist():
        high = ((2 * value) * magic_u) >> 32
        assert high >> shift == value // ncols, (value, ncols)
    with pytest.raises(ValueError, match="ncols"):
        ncols_divider(0)
