"""Quantized Muon momentum (docs/algorithm.md#gefenmuon) against the float64 oracle written from
docs/algorithm.md."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernels_inputs import make_codebook, random_state, ulp
from kernels_oracle import boundary_distance, momentum64, requantize64

from gefen_kernels import _numerics
from gefen_kernels.ops.muon_momentum import muon_momentum, muon_momentum_reference

BOUNDARY_MARGIN = 1e-6  # as the quantizer tests: fp32 may pick the other neighbour here


def run(grad, state, cb, **kw):
    codes, scale = state["codes"].clone(), state["scale"].clone()
    u = muon_momentum_reference(grad, codes, scale, cb, **kw)
    return u, codes, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(("blocks", "period"), [(1, 1), (7, 64), (3, 4097), (64, 16)])
@pytest.mark.parametrize("nesterov", [False, True])
def test_matches_float64_oracle(dtype, blocks, period, nesterov):
    cb = make_codebook(1)
    st = random_state(blocks, period, seed=blocks * period)
    gen = torch.Generator().manual_seed(period)
    grad = (torch.randn(blocks * period, generator=gen) * 0.05).to(dtype)
    beta = 0.95
    u, codes, scale = run(grad, st, cb, beta=beta, nesterov=nesterov)
    assert u.dtype == dtype and u.shape == grad.shape

    g64 = grad.double().numpy().reshape(blocks, period)
    m = momentum64(g64, st["codes"].long().numpy(), st["scale"].double().numpy(),
                   cb.double().numpy(), beta)
    s_new, z, q = requantize64(m, cb.double().numpy(), g64 == 0)
    # Scale: the block max of the fp32 EMA, within a few fp32 ulps of the float64 value.
    np.testing.assert_allclose(scale.double().numpy(), s_new, rtol=4 * 2.0**-23, atol=0)
    near = boundary_distance(z, cb.double().numpy(), g64 == 0) <= BOUNDARY_MARGIN
    got_q = codes.long().numpy()
    assert np.array_equal(got_q[~near], q[~near])
    assert np.all(np.abs(got_q[near] - q[near]) <= 1)
    # Dense output from the op's own codes and scale: fp(f32(fp(c[q]) * s))
    # (docs/algorithm.md#gefenmuon) ...
    cw = cb[codes.long()].to(dtype).double()
    plain = (cw * scale.double()).to(torch.float32 if dtype != torch.float64 else dtype)
    plain = plain.to(dtype)
    if not nesterov:
        assert torch.equal(u.view(blocks, period), plain)
        return
    # ... and the Nesterov look-ahead built from it, each product rounded on its own.
    # The op's constants are fp32 (docs/algorithm.md#block-second-moment: β cast to fp32, 1 - β
    # formed in fp32), fp64 for fp64 gradients.
    b = beta if dtype == torch.float64 else float(np.float32(beta))
    omb = 1 - b if dtype == torch.float64 else float(np.float32(1 - np.float32(b)))
    expect = omb * g64 + b * plain.double().numpy()
    tol = 3 * ulp(expect, dtype) + 2 * ulp(b * plain.double().numpy(), dtype)
    assert np.all(np.abs(u.double().numpy().reshape(blocks, period) - expect) <= tol)


def test_fresh_state_keeps_the_first_gradient_direction():
    cb = make_codebook(2)
    st = random_state(4, 32, seed=3, fresh=True)
    grad = torch.randn(128)
    u, codes, scale = run(grad, st, cb, beta=0.9, nesterov=False)
    # m = 0.1 g: the block max is 0.1 max|g|, and each element decodes within half a gap.
    g = grad.view(4, 32).double()
    torch.testing.assert_close(scale.double(), 0.1 * g.abs().amax(1, keepdim=True),
                               rtol=1e-6, atol=0)
    gap = float((cb[1:] - cb[:-1]).max())
    assert torch.all((u.view(4, 32).double() - 0.1 * g).abs()
                     <= scale.double() * gap / 2 * (1 + 1e-5))


def test_maximize_is_the_negated_gradient():
    cb = make_codebook(4)
    st = random_state(8, 16, seed=5)
    grad = torch.randn(128)
    a = run(grad, st, cb, beta=0.9, nesterov=True, maximize=True)
    b = run(-grad, st, cb, beta=0.9, nesterov=True)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_chunking_does_not_change_results(monkeypatch):
    cb = make_codebook(6)
    st = random_state(3, 1000, seed=7)
    grad = torch.randn(3000, generator=torch.Generator().manual_seed(8))
    whole = run(grad, st, cb, beta=0.95, nesterov=True)
    monkeypatch.setattr(_numerics, "CHUNK_ELEMENTS", 256)  # blocks longer than a chunk
    tiled = run(grad, st, cb, beta=0.95, nesterov=True)
    monkeypatch.setattr(_numerics, "CHUNK_ELEMENTS", 2000)  # two blocks per chunk at most
    grouped = run(grad, st, cb, beta=0.95, nesterov=True)
    for x, y, z in zip(whole, tiled, grouped, strict=True):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_stochastic_rounding_brackets_and_depends_on_the_seed():
    cb = make_codebook(9)
    st = random_state(16, 64, seed=10)
    grad = torch.randn(1024) * 0.05
    _, q_near, _ = run(grad, st, cb, beta=0.9, nesterov=False)
    _, q1, s1 = run(grad, st, cb, beta=0.9, nesterov=False, stochastic_round=True, seed=11)
    _, q1b, _ = run(grad, st, cb, beta=0.9, nesterov=False, stochastic_round=True, seed=11)
    _, q2, _ = run(grad, st, cb, beta=0.9, nesterov=False, stochastic_round=True, seed=-12)
    assert torch.equal(q1, q1b) and not torch.equal(q1, q2)
    assert (q1.long() - q_near.long()).abs().max() <= 1
    # Seed tensor (capturable) == host seed.
    _, q3, _ = run(grad, st, cb, beta=0.9, nesterov=False, stochastic_round=True,
                   seed_tensor=torch.tensor([11]))
    assert torch.equal(q1, q3)


def test_zero_size_and_out_argument():
    cb = make_codebook(0)
    empty = torch.zeros(0)
    u = muon_momentum_reference(empty, torch.zeros(0, 4, dtype=torch.uint8),
                                torch.zeros(0, 1), cb, beta=0.9, nesterov=True)
    assert u.shape == (0,)
    st = random_state(2, 8, seed=1)
    out = torch.empty(16)
    grad = torch.randn(16)
    ref = run(grad, st, cb, beta=0.9, nesterov=True)[0]
    got = muon_momentum(grad, st["codes"].clone(), st["scale"].clone(), cb, beta=0.9,
                        nesterov=True, out=out)
    assert got is out and torch.equal(out, ref)


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda a: a.update(beta=1.0), ValueError, "beta"),
        (lambda a: a.update(beta=True), ValueError, "beta"),
        (lambda a: a.update(codes=torch.zeros(3, 8, dtype=torch.uint8)), ValueError, "tile"),
        (lambda a: a.update(codes=torch.zeros(2, 8)), TypeError, "uint8"),
        (lambda a: a.update(scale=torch.zeros(2, 1, dtype=torch.float64)), TypeError, "scale"),
        (lambda a: a.update(grad=torch.randn(8, 2).t()), ValueError, "contiguous"),
        (lambda a: a.update(codebook=torch.zeros(255)), ValueError, "codebook"),
        (lambda a: a.update(seed=1 << 63), ValueError, "seed"),
        (lambda a: a.update(out=torch.empty(16, dtype=torch.float64)), TypeError, "out"),
    ],
)
def test_bad_arguments_raise_before_mutation(mutate, error, match):
    st = random_state(2, 8, seed=2)
    args = dict(grad=torch.randn(16), codes=st["codes"].clone(), scale=st["scale"].clone(),
                codebook=make_codebook(0), beta=0.9, seed=0, out=None)
    mutate(args)
    codes_before, scale_before = args["codes"].clone(), args["scale"].clone()
    with pytest.raises(error, match=match):
        muon_momentum_reference(args["grad"], args["codes"], args["scale"], args["codebook"],
                                beta=args["beta"], nesterov=True, seed=args["seed"],
                                out=args["out"])
    assert torch.equal(args["codes"], codes_before) and torch.equal(args["scale"], scale_before)
