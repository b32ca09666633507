"""The Triton Muon momentum (docs/algorithm.md#gefenmuon) against its PyTorch reference, bit for
bit.

Why bit for bit: the op has one reduction, the per-block max of ``|m|``, and a maximum does not
depend on the order it is taken in (NaN propagates in both: the reference's ``amax`` and the
kernels' explicit NaN flag). Every other value is elementwise, the same IEEE fp32 operations in
the same order on both sides (products rounded separately, no fma: ``LAUNCH_OPTIONS``), and the
roundings to the gradient dtype are round-to-nearest-even on both. So the codes, the scales and
the dense output must agree exactly, NaN positions included; only a NaN's payload bits may
differ (CPU and GPU produce different quiet NaNs), so NaNs are compared by position.

The float64 oracle of the op's math lives in ``test_muon_momentum.py`` (it checks the reference).
On CPU the kernels run in Triton's interpreter; every case here stays at or below 64K elements.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from kernels_inputs import assert_bitwise, make_codebook, random_state, with_zero_gradients

from gefen_kernels import _numerics
from gefen_kernels.ops import _muon_kernels
from gefen_kernels.ops._muon_kernels import launch_muon_momentum
from gefen_kernels.ops.muon_momentum import (
    muon_momentum,
    muon_momentum_reference,
    muon_momentum_triton,
)

BETA = 0.95
# The module (``gefen_kernels.ops.muon_momentum`` the attribute is the dispatching function).
muon_module = importlib.import_module("gefen_kernels.ops.muon_momentum")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def assert_same_output(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equal, NaN compared by position (its payload is platform-defined)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    an, bn = torch.isnan(a), torch.isnan(b)
    assert torch.equal(an, bn), f"{what}: NaN positions differ"
    assert_bitwise(a[~an], b[~bn], what)


def run_pair(grad: torch.Tensor, state: dict[str, torch.Tensor], cb: torch.Tensor, *,
             route: str | None = None, split_elements: int = 16384, loop_tile: int | None = None,
             use_table: bool = True, **kw) -> tuple[torch.Tensor, ...]:
    """Reference and kernel from the same state; asserts equality; returns the kernel's."""
    kw.setdefault("beta", BETA)
    kw.setdefault("nesterov", True)
    ref_q, ref_s = state["codes"].clone(), state["scale"].clone()
    ref_u = muon_momentum_reference(grad, ref_q, ref_s, cb, **kw)
    tri_q, tri_s = state["codes"].clone(), state["scale"].clone()
    if route is None and use_table:
        tri_u = muon_momentum_triton(grad, tri_q, tri_s, cb, **kw)
    else:
        tri_u = torch.empty_like(grad)
        launch_muon_momentum(grad, tri_q, tri_s, cb, tri_u, beta=kw["beta"],
                             nesterov=kw["nesterov"], maximize=kw.get("maximize", False),
                             stochastic_round=kw.get("stochastic_round", False),
                             seed=kw.get("seed", 0), seed_tensor=kw.get("seed_tensor"),
                             route=route, split_elements=split_elements, loop_tile=loop_tile,
                             use_table=use_table)
    assert_bitwise(tri_q, ref_q, "codes")
    assert_bitwise(tri_s, ref_s, "scale")
    assert_same_output(tri_u, ref_u, "dense momentum")
    return tri_u, tri_q, tri_s


# Every period class of the routes: 1, 2, 7, 64, 1024, 2048 and 4096 (tile), a prime above
# 4096 (loop or split), sizes 1, 4097 and primes (8191 = one block of a prime period).
PARITY_SHAPES = [(1, 1), (4097, 1), (513, 2), (601, 7), (16, 64), (4, 1024), (3, 2048),
                 (2, 4096), (3, 5003), (1, 8191)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("num_blocks,period", PARITY_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference(num_blocks: int, period: int, dtype: torch.dtype) -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(num_blocks + period)
    n = num_blocks * period
    grad = (torch.randn(n, generator=gen) * 0.05).to(dtype).to(dev)
    with_zero_gradients(grad, period, n)
    state = random_state(num_blocks, period, seed=period, device=dev)
    cb = make_codebook(period).to(dev)
    run_pair(grad, state, cb, nesterov=False)
    run_pair(grad, state, cb, nesterov=True)
    run_pair(grad, state, cb, nesterov=True, maximize=True, stochastic_round=True,
             seed=-(2**62) - 3)


@pytest.mark.parametrize("route,period,num_blocks,split,tile", [
    ("loop", 5003, 3, 16384, 2048),   # prime period > 4096: looped in tiles
    ("split", 5003, 2, 2048, 1024),   # three programs per block, flat grid
    ("loop", 1024, 3, 16384, 512),    # short blocks through the long-block routes
    ("split", 1000, 3, 512, 256),
    ("loop", 1, 6, 16384, 256),       # period 1 on every route
    ("split", 1, 6, 512, 256),
    ("tile", 7, 300, 0, 0),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_every_route(route: str, period: int, num_blocks: int, split: int, tile: int,
                            dtype: torch.dtype) -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(period)
    n = num_blocks * period
    grad = with_zero_gradients(torch.randn(n, generator=gen).to(dtype).to(dev), period, n)
    state = random_state(num_blocks, period, seed=1, device=dev)
    cb = make_codebook(0).to(dev)
    kw = dict(route=route, split_elements=split or 16384, loop_tile=tile or None)
    run_pair(grad, state, cb, nesterov=False, **kw)
    run_pair(grad, state, cb, stochastic_round=True, seed=2**62 + 5, maximize=True, **kw)


def test_full_search_without_table_and_beta_zero() -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(11)
    grad = with_zero_gradients(torch.randn(33 * 64, generator=gen).to(dev), 64, 11)
    state = random_state(33, 64, seed=11, device=dev)
    for cb in (make_codebook(11), make_codebook(12, duplicates=True)):
        cb = cb.to(dev)
        run_pair(grad, state, cb, use_table=False)
        run_pair(grad, state, cb, use_table=False, stochastic_round=True, seed=7)
        # beta = 0: m is the gradient itself (1 - beta = 1 exactly).
        u = run_pair(grad, state, cb, beta=0.0, nesterov=True)[0]
        assert torch.isfinite(u).all()


def test_stochastic_rounding_is_seeded_and_brackets_nearest() -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(12)
    grad = (torch.randn(16 * 512, generator=gen) * 0.05).to(dev)
    state = random_state(16, 512, seed=12, device=dev)
    cb = make_codebook(12).to(dev)
    _, q_near, _ = run_pair(grad, state, cb, nesterov=False)
    u1, q1, s1 = run_pair(grad, state, cb, nesterov=False, stochastic_round=True, seed=11)
    u1b, q1b, s1b = run_pair(grad, state, cb, nesterov=False, stochastic_round=True, seed=11)
    _, q2, _ = run_pair(grad, state, cb, nesterov=False, stochastic_round=True, seed=-12)
    assert torch.equal(q1, q1b) and torch.equal(u1, u1b) and torch.equal(s1, s1b)
    assert not torch.equal(q1, q2)
    assert not torch.equal(q1, q_near)
    assert int((q1.long() - q_near.long()).abs().max()) <= 1
    # The device seed (capturable) is the host seed.
    _, q3, _ = run_pair(grad, state, cb, nesterov=False, stochastic_round=True,
                        seed_tensor=torch.tensor([11], device=dev))
    assert torch.equal(q1, q3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("period,route", [(64, None), (1000, "loop"), (1000, "split")])
def test_non_finite_and_zero_blocks_match_reference(dtype: torch.dtype, period: int,
                                                    route: str | None) -> None:
    dev = _device()
    num_blocks = 8 if route is None else 4
    gen = torch.Generator().manual_seed(13)
    grad = torch.randn(num_blocks * period, generator=gen)
    grad[period + 6] = float("nan")  # block 1
    grad[2 * period + 9] = float("inf")  # block 2
    grad[3 * period + 1] = -float("inf")  # block 3
    grad[3 * period + 2] = float("inf")  # block 3: +inf and -inf
    state = random_state(num_blocks, period, seed=13, device=dev)
    if num_blocks > 4:
        grad[4 * period:5 * period] = 0.0
        state["scale"][4] = 0.0  # a block that never moved: exact zeros out
        state["scale"][5] = float("inf")  # a poisoned state stays poisoned
    kw = dict(route=route, split_elements=512, loop_tile=512) if route else {}
    cb = make_codebook(13).to(dev)
    for nesterov in (False, True):
        u = run_pair(grad.to(dtype).to(dev), state, cb, nesterov=nesterov, **kw)[0]
        blocks = u.view(num_blocks, period)
        assert torch.isnan(blocks[1]).all()
        if num_blocks > 4 and not nesterov:
            assert torch.equal(blocks[4], torch.zeros_like(blocks[4]))
        assert torch.isfinite(blocks[0]).all()


def test_zero_size_and_out_argument() -> None:
    dev = _device()
    cb = make_codebook(0).to(dev)
    for dtype in DTYPES:
        empty = torch.zeros(0, dtype=dtype, device=dev)
        codes = torch.zeros(0, 4, dtype=torch.uint8, device=dev)
        scale = torch.zeros(0, 1, device=dev)
        u = muon_momentum_triton(empty, codes, scale, cb, beta=0.9, nesterov=True)
        assert u.shape == (0,) and u.dtype == dtype
        out = torch.empty(0, dtype=dtype, device=dev)
        assert muon_momentum(empty, codes, scale, cb, beta=0.9, nesterov=False, out=out) is out
    gen = torch.Generator().manual_seed(1)
    grad = torch.randn(4, 8, generator=gen).to(dev)
    state = random_state(2, 16, seed=1, device=dev)
    ref = run_pair(grad, state, cb)[0]
    out = torch.full_like(grad, 7.0)
    got = muon_momentum_triton(grad, state["codes"].clone(), state["scale"].clone(), cb,
                               beta=BETA, nesterov=True, out=out)
    assert got is out and got.shape == (4, 8)
    assert_same_output(out, ref, "out")


def test_triton_rejects_fp64_and_bad_arguments_before_mutation() -> None:
    st = random_state(2, 4, seed=0)
    cb = make_codebook(0)
    codes, scale = st["codes"].clone(), st["scale"].clone()
    with pytest.raises(TypeError, match="fp64 gradients take the PyTorch reference"):
        muon_momentum_triton(torch.zeros(8, dtype=torch.float64), codes, scale, cb, beta=0.9,
                             nesterov=True)
    with pytest.raises(ValueError, match="beta"):
        muon_momentum_triton(torch.zeros(8), codes, scale, cb, beta=1.0, nesterov=True)
    with pytest.raises(ValueError, match="tile"):
        muon_momentum_triton(torch.zeros(9), codes, scale, cb, beta=0.9, nesterov=True)
    assert torch.equal(codes, st["codes"]) and torch.equal(scale, st["scale"])


def test_public_op_dispatch_and_fp64_on_cpu() -> None:
    gen = torch.Generator().manual_seed(5)
    grad = torch.randn(4 * 32, generator=gen)
    cb = make_codebook(5)
    for g in (grad, grad.double()):
        a, b = random_state(4, 32, seed=5), random_state(4, 32, seed=5)
        ua = muon_momentum(g, a["codes"], a["scale"], cb, beta=BETA, nesterov=True,
                           stochastic_round=True, seed=3)
        ub = muon_momentum_reference(g, b["codes"], b["scale"], cb, beta=BETA, nesterov=True,
                                     stochastic_round=True, seed=3)
        assert torch.equal(ua, ub) and ua.dtype == g.dtype
        assert torch.equal(a["codes"], b["codes"]) and torch.equal(a["scale"], b["scale"])
    st = random_state(4, 32, seed=5)
    torch.library.opcheck(
        torch.ops.gefen.muon_momentum.default,
        (grad, st["codes"].clone(), st["scale"].clone(), cb, None, torch.empty_like(grad),
         BETA, True, False, False, 0),
        test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(
        torch.ops.gefen.muon_momentum.default,
        (grad, st["codes"].clone(), st["scale"].clone(), cb, torch.tensor([4]),
         torch.empty_like(grad), BETA, False, True, True, 0),
        test_utils=("test_schema", "test_faketensor"))


def test_chunk_size_of_the_reference_does_not_matter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference's chunking (blocks split over chunks) still equals the one-pass kernel."""
    dev = _device()
    monkeypatch.setattr(_numerics, "CHUNK_ELEMENTS", 1000)
    gen = torch.Generator().manual_seed(8)
    grad = torch.randn(3 * 2048, generator=gen).to(torch.bfloat16).to(dev)
    run_pair(grad, random_state(3, 2048, seed=8, device=dev), make_codebook(8).to(dev))


# --------------------------------------------------------------------------------------------
# GPU: full size, dispatch, torch.compile, CUDA graphs
# --------------------------------------------------------------------------------------------


def _gpu_state(num_blocks: int, period: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"codes": torch.randint(0, 256, (num_blocks, period), device="cuda",
                                   dtype=torch.uint8, generator=gen),
            "scale": torch.rand(num_blocks, 1, device="cuda", generator=gen) * 0.1}


@pytest.mark.gpu
@pytest.mark.parametrize("num_blocks,period,route", [
    (2, 1 << 25, None),                      # 2 x 33.5M elements: the split route
    ((1 << 24), 1, None),                    # a 4096 x 4096 matrix, every period class
    ((1 << 24) // 64, 64, None),
    ((1 << 24) // 2048, 2048, None),
    ((1 << 24) // 4096, 4096, None),
    ((1 << 24) // 16384, 16384, "loop"),
    (1, 1 << 24, None),
    ((1 << 26) // 7 // 64 * 64, 7, None),    # 67M elements of a prime period (int64 offsets)
])
def test_triton_matches_reference_large_gpu(num_blocks: int, period: int, route) -> None:
    gen = torch.Generator(device="cuda").manual_seed(period)
    n = num_blocks * period
    grad = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    state = _gpu_state(num_blocks, period, gen)
    cb = make_codebook(period).cuda()
    run_pair(grad, state, cb, route=route)
    run_pair(grad, state, cb, route=route, nesterov=False, stochastic_round=True,
             seed=2**40 + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_matrix_parity_every_dtype_gpu(dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(21)
    grad = (torch.randn(4096, 4096, device="cuda", generator=gen) * 0.05).to(dtype)
    for period in (1, 64, 4096, 1 << 16):
        state = _gpu_state(grad.numel() // period, period, gen)
        cb = make_codebook(period).cuda()
        run_pair(grad, state, cb)
        run_pair(grad, state, cb, maximize=True, stochastic_round=True, seed=-5)


@pytest.mark.gpu
def test_public_op_runs_the_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = _muon_kernels.launch_muon_momentum

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(muon_module, "launch_muon_momentum", counting)
    gen = torch.Generator(device="cuda").manual_seed(3)
    grad = torch.randn(64 * 100, device="cuda", generator=gen)
    a = _gpu_state(100, 64, gen)
    b = {k: v.clone() for k, v in a.items()}
    cb = make_codebook(3).cuda()
    ua = muon_momentum(grad, a["codes"], a["scale"], cb, beta=BETA, nesterov=True)
    assert calls == [torch.float32]
    ub = muon_momentum_reference(grad, b["codes"], b["scale"], cb, beta=BETA, nesterov=True)
    assert torch.equal(ua, ub) and torch.equal(a["codes"], b["codes"])
    muon_momentum(grad.double(), a["codes"], a["scale"], cb, beta=BETA, nesterov=True)
    assert calls == [torch.float32]  # fp64 gradients take the reference


@pytest.mark.gpu
def test_compile_fullgraph_gpu() -> None:
    gen = torch.Generator(device="cuda").manual_seed(6)
    grad = torch.randn(64 * 100, device="cuda", generator=gen).to(torch.bfloat16)
    a = _gpu_state(100, 64, gen)
    b = {k: v.clone() for k, v in a.items()}
    cb = make_codebook(6).cuda()

    @torch.compile(fullgraph=True)
    def step(g, q, s):
        return muon_momentum(g * 1.0, q, s, cb, beta=BETA, nesterov=True) * 1.0

    ua = step(grad, a["codes"], a["scale"])
    ub = muon_momentum_triton(grad, b["codes"], b["scale"], cb, beta=BETA, nesterov=True)
    assert torch.equal(ua, ub)
    assert torch.equal(a["codes"], b["codes"]) and torch.equal(a["scale"], b["scale"])


@pytest.mark.gpu
@pytest.mark.parametrize("period", [7, 2048, 8192, 1 << 19])
def test_cuda_graph_capture_gpu(period: int) -> None:
    """Capture one step with a device seed, replay it with new seeds and gradients."""
    num_blocks = (1 << 20) // period
    gen = torch.Generator(device="cuda").manual_seed(7)
    n = num_blocks * period
    grad = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    live = _gpu_state(num_blocks, period, gen)
    ref = {k: v.clone() for k, v in live.items()}
    cb = make_codebook(7).cuda()
    seed_t = torch.tensor([5], device="cuda", dtype=torch.int64)
    out = torch.empty_like(grad)
    kw = dict(beta=BETA, nesterov=True, stochastic_round=True, seed_tensor=seed_t, out=out)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles, builds the search table) uncaptured
        warm = {k: v.clone() for k, v in live.items()}
        muon_momentum(grad, warm["codes"], warm["scale"], cb, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        muon_momentum(grad, live["codes"], live["scale"], cb, **kw)
    for seed in (5, 6, 7):
        grad.copy_(torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16))
        seed_t.fill_(seed)
        graph.replay()
        expect = muon_momentum_triton(grad, ref["codes"], ref["scale"], cb,
                                      **{**kw, "seed_tensor": seed_t.clone(), "out": None})
        torch.cuda.synchronize()
        assert torch.equal(out, expect)
    assert torch.equal(live["codes"], ref["codes"]) and torch.equal(live["scale"], ref["scale"])
