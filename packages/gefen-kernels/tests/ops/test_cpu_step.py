"""The native CPU step (gefen_kernels.ops._cpu_step) against the PyTorch references, bit for bit.

The one documented difference: the factored denominator's square root. The canonical rounding
(gefen_kernels._numerics) asks for an IEEE round-to-nearest ``sqrt``; the native kernel computes
exactly that, while ``torch.sqrt`` on some CPU builds (AVX-512 kernels) is not correctly rounded
(one ulp off on a sizeable fraction of inputs). So the factored comparisons run the reference
with a correctly rounded square root (fp32 -> fp64 ``sqrt`` -> fp32, exact for fp32 inputs);
everything else, block mode included, is compared with the reference as it is.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kernels_inputs import make_codebook, with_zero_gradients

from gefen_kernels import _numerics
from gefen_kernels.ops import (
    _cpu_native,
    block_step,
    block_step_reference,
    factored_step,
    factored_step_reference,
    muon_momentum,
    muon_momentum_reference,
)
from gefen_kernels.ops import _cpu_step as cpu

pytestmark = pytest.mark.skipif(not cpu.native_available(),
                                reason=f"native CPU step unavailable: {_cpu_native.status()}")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TORCH_SQRT = torch.sqrt


def _ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return _TORCH_SQRT(x.double()).float()
    return _TORCH_SQRT(x)


@pytest.fixture
def ieee_sqrt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "sqrt", _ieee_sqrt)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for key in a:
        assert torch.equal(_bits(a[key]), _bits(b[key])), key


def _inputs(rows: int, cols: int, period: int, pdt: torch.dtype, gdt: torch.dtype,
            seed: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(rows, cols, generator=gen).to(pdt)
    grad = with_zero_gradients(torch.randn(rows, cols, generator=gen), period, seed).to(gdt)
    blocks = rows * cols // period
    state = {"codes": torch.randint(0, 256, (blocks, period), generator=gen, dtype=torch.uint8),
             "scale": torch.rand(blocks, 1, generator=gen),
             "sq": torch.rand(blocks, 1, generator=gen),
             "row": torch.rand(rows, generator=gen), "col": torch.rand(cols, generator=gen)}
    state["col"][1] = 0.0  # a column that never had a gradient: V = 0
    return param, grad, state


_SCALARS = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, bc1_recip=1.25, decay=0.999)


def _run_block(fn, param, grad, st, cb, **kw):  # type: ignore[no-untyped-def]
    p, s = param.clone(), {k: v.clone() for k, v in st.items()}
    fn(p, grad, s["codes"], s["scale"], s["sq"], cb, bc2_rsqrt=1.5, **{**_SCALARS, **kw})
    return {"param": p, "codes": s["codes"], "scale": s["scale"], "sq": s["sq"]}


def _run_factored(fn, param, grad, st, cb, **kw):  # type: ignore[no-untyped-def]
    p, s = param.clone(), {k: v.clone() for k, v in st.items()}
    fn(p, grad, s["codes"], s["scale"], s["row"], s["col"], cb, bc2_recip=1.7,
       **{**_SCALARS, **kw})
    return {"param": p, "codes": s["codes"], "scale": s["scale"], "row": s["row"],
            "col": s["col"]}


@pytest.mark.parametrize("pdt,gdt", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("stochastic", [False, True])
def test_block_matches_reference(pdt: torch.dtype, gdt: torch.dtype, stochastic: bool) -> None:
    for seed, maximize in ((0, False), (1, True)):  # direct and crowded codebooks
        cb = make_codebook(seed)
        param, grad, st = _inputs(24, 40, 32, pdt, gdt, seed)
        kw = dict(maximize=maximize, stochastic_round=stochastic, seed=-12345 + seed)
        _equal(_run_block(block_step_reference, param, grad, st, cb, **kw),
               _run_block(cpu.block_step_cpu, param, grad, st, cb, **kw))


@pytest.mark.parametrize("pdt,gdt", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("stochastic", [False, True])
def test_factored_matches_reference(ieee_sqrt: None, pdt: torch.dtype, gdt: torch.dtype,
                                    stochastic: bool) -> None:
    for seed, maximize in ((2, False), (3, True)):
        cb = make_codebook(seed)
        param, grad, st = _inputs(24, 40, 48, pdt, gdt, seed)
        grad[:, 1] = 0.0
        kw = dict(maximize=maximize, stochastic_round=stochastic, seed=-(2**63) + seed)
        _equal(_run_factored(factored_step_reference, param, grad, st, cb, **kw),
               _run_factored(cpu.factored_step_cpu, param, grad, st, cb, **kw))


@pytest.mark.parametrize("chunk", [64, 100])
def test_chunks_tiles_threads_and_public_ops(ieee_sqrt: None, monkeypatch: pytest.MonkeyPatch,
                                             chunk: int) -> None:
    """Periods longer than a chunk (tiled statistics), several threads, the public ops."""
    monkeypatch.setattr(_numerics, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMENTS", 1)
    cb = make_codebook(4)
    for period in (16, 160):
        param, grad, st = _inputs(32, 40, period, torch.float32, torch.bfloat16, period)
        ref = _run_block(block_step_reference, param, grad, st, cb)
        _equal(ref, _run_block(cpu.block_step_cpu, param, grad, st, cb))
        _equal(ref, _run_block(block_step, param, grad, st, cb))
        ref = _run_factored(factored_step_reference, param, grad, st, cb)
        _equal(ref, _run_factored(cpu.factored_step_cpu, param, grad, st, cb))
        _equal(ref, _run_factored(factored_step, param, grad, st, cb))


def test_lr_zero_hyper_seed_tensor_and_stats(ieee_sqrt: None) -> None:
    cb = make_codebook(0)
    param, grad, st = _inputs(8, 20, 10, torch.float32, torch.float32, 5)
    for kw in ({"lr": 0.0},
               {"hyper": torch.tensor([1e-2, 1.5, 1.25, 0.999]),
                "seed_tensor": torch.tensor([77]), "stochastic_round": True},
               {"hyper": torch.tensor([0.0, 1.5, 1.25, 0.999])}):
        _equal(_run_block(block_step_reference, param, grad, st, cb, **kw),
               _run_block(cpu.block_step_cpu, param, grad, st, cb, **kw))
        _equal(_run_factored(factored_step_reference, param, grad, st, cb, **kw),
               _run_factored(cpu.factored_step_cpu, param, grad, st, cb, **kw))
    out = _run_block(cpu.block_step_cpu, param, grad, st, cb, lr=0.0)
    assert torch.equal(out["param"], param)  # lr == 0 leaves the parameters untouched
    from gefen_kernels.ops.factored_step import factored_partial_stats_reference

    stats = factored_partial_stats_reference(param, grad, st["row"], st["col"], beta2=0.999)
    kw = {"stats": stats, "global_rows": 8}
    _equal(_run_factored(factored_step_reference, param, grad, st, cb, **kw),
           _run_factored(cpu.factored_step_cpu, param, grad, st, cb, **kw))


def test_fp64_and_other_gradients_take_the_reference() -> None:
    cb = make_codebook(0)
    param, grad, st = _inputs(8, 20, 10, torch.float64, torch.float64, 6)
    _equal(_run_block(block_step_reference, param, grad, st, cb),
           _run_block(cpu.block_step_cpu, param, grad, st, cb))
    param, grad, st = _inputs(8, 20, 10, torch.float32, torch.float64, 6)
    _equal(_run_factored(factored_step_reference, param, grad, st, cb),
           _run_factored(cpu.factored_step_cpu, param, grad, st, cb))


def test_nan_gradient_propagates_like_the_reference() -> None:
    cb = make_codebook(0)
    param, grad, st = _inputs(8, 20, 10, torch.float32, torch.float32, 7)
    grad[0, 3] = float("nan")
    grad[5, 0] = float("inf")
    ref = _run_block(block_step_reference, param, grad, st, cb)
    out = _run_block(cpu.block_step_cpu, param, grad, st, cb)
    assert torch.equal(ref["codes"], out["codes"])
    for key in ("param", "scale", "sq"):  # NaN bits are unspecified: compare NaN positions
        assert torch.equal(torch.isnan(ref[key]), torch.isnan(out[key])), key
        both = ~torch.isnan(ref[key])
        assert torch.equal(ref[key][both], out[key][both]), key
    assert torch.isnan(out["scale"][0]) and torch.isnan(out["param"][0, :10]).all()


def test_errors_before_mutation() -> None:
    cb = make_codebook(0)
    param, grad, st = _inputs(8, 20, 10, torch.float32, torch.float32, 8)
    before = param.clone()
    with pytest.raises(ValueError, match="beta1"):
        cpu.block_step_cpu(param, grad, st["codes"], st["scale"], st["sq"], cb,
                           **{**_SCALARS, "beta1": 1.5}, bc2_rsqrt=1.0)
    with pytest.raises(TypeError, match="codes"):
        cpu.factored_step_cpu(param, grad, st["codes"].float(), st["scale"], st["row"],
                              st["col"], cb, **_SCALARS, bc2_recip=1.0)
    assert torch.equal(param, before)


@pytest.mark.parametrize("gdt", DTYPES)
@pytest.mark.parametrize("nesterov,maximize,stochastic",
                         list(itertools.product([False, True], repeat=3)))
def test_muon_matches_reference(gdt: torch.dtype, nesterov: bool, maximize: bool,
                                stochastic: bool) -> None:
    cb = make_codebook(1)
    _, grad, st = _inputs(16, 24, 32, torch.float32, gdt, 9)
    kw = dict(beta=0.95, nesterov=nesterov, maximize=maximize, stochastic_round=stochastic,
              seed=31)
    ref_c, ref_s = st["codes"].clone(), st["scale"].clone()
    ref = muon_momentum_reference(grad, ref_c, ref_s, cb, **kw)
    for fn in (cpu.muon_momentum_cpu, muon_momentum):
        c, s = st["codes"].clone(), st["scale"].clone()
        out = fn(grad, c, s, cb, **kw)
        _equal({"u": ref, "codes": ref_c, "scale": ref_s}, {"u": out, "codes": c, "scale": s})
