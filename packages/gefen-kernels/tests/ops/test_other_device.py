"""Every public op on tensors of a CUDA device other than the current one (two GPUs).

Triton launches on the current device, and custom ops get no device guard from the
dispatcher, so each launcher sets the device of its tensors (``_device.on_tensor_device``;
``histogram_sum`` per device). Without it a tensor on ``cuda:1`` fails with "Pointer argument
cannot be accessed from Triton" while ``cuda:0`` is current. Each case runs the same inputs on
``cuda:0`` and on ``cuda:1`` and compares every output bit for bit; the current device must
stay ``cuda:0``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernels_inputs import assert_bitwise, make_codebook, random_state

import gefen_kernels as gk
from gefen_kernels.ops import histogram_sum

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices"),
]

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, bc1_recip=10.0, decay=0.999)


def _inputs(period: int = 96, blocks: int = 64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(period + blocks)
    n = period * blocks
    st = random_state(blocks, period, seed=7)
    return {"param": torch.randn(n, generator=gen).to(torch.bfloat16),
            "grad": (torch.randn(n, generator=gen) * 0.05).to(torch.bfloat16),
            "row": torch.rand(blocks, generator=gen) * 1e-3,
            "col": torch.rand(period, generator=gen) * 1e-3,
            "codebook": make_codebook(period), **st}


def _on_both(run: Callable[[dict[str, torch.Tensor]], object], *,
             result_on: str | None = None) -> None:
    """``run`` on copies of the same inputs on cuda:0 and cuda:1; every tensor it mutates or
    returns must be the same bits, and its results on the inputs' device (``result_on``: on
    that device instead)."""
    assert torch.cuda.current_device() == 0
    results = []
    for dev in ("cuda:0", "cuda:1"):
        t = {k: v.to(dev) for k, v in _inputs().items()}
        out = run(t)
        outs = out if isinstance(out, (list, tuple)) else [out]
        for o in outs:
            if isinstance(o, torch.Tensor):
                assert o.device == torch.device(result_on or dev)
        results.append([o.cpu() for o in outs if isinstance(o, torch.Tensor)]
                       + [v.cpu() for v in t.values()])
        assert torch.cuda.current_device() == 0
    for a, b in zip(*results):
        assert_bitwise(a, b, "output")


@pytest.mark.parametrize("op", [gk.block_step, gk.block_step_triton])
def test_block_step(op) -> None:
    _on_both(lambda t: op(t["param"], t["grad"], t["codes"], t["scale"], t["exp_avg_sq"],
                          t["codebook"], bc2_rsqrt=30.0, **HYPER))


@pytest.mark.parametrize("op", [gk.factored_step, gk.factored_step_triton])
def test_factored_step(op) -> None:
    def run(t):
        op(t["param"].view(64, 96), t["grad"].view(64, 96), t["codes"], t["scale"], t["row"],
           t["col"], t["codebook"], bc2_recip=1000.0, **HYPER)
    _on_both(run)


def test_multi_block_step() -> None:
    def run(t):
        half = t["param"].numel() // 2
        views = [(t[k][:half], t[k][half:]) for k in ("param", "grad")]
        st = [(t[k][:32], t[k][32:]) for k in ("codes", "scale", "exp_avg_sq")]
        gk.multi_block_step(list(views[0]), list(views[1]), *[list(s) for s in st],
                            t["codebook"], beta1=0.9, beta2=0.999, eps=1e-8,
                            hyper=torch.tensor([[1e-3, 30.0, 10.0, 1.0]] * 2,
                                               device=t["param"].device),
                            seeds=torch.tensor([3, 4], device=t["param"].device))
    _on_both(run)


@pytest.mark.parametrize("op", [gk.histogram, gk.histogram_triton])
def test_histogram(op) -> None:
    _on_both(lambda t: op(t["grad"], 96))


def test_histogram_sum() -> None:
    _on_both(lambda t: histogram_sum([t["grad"], t["param"]], [96, 32]), result_on="cpu")


def test_muon_momentum() -> None:
    _on_both(lambda t: gk.muon_momentum(t["grad"], t["codes"], t["scale"], t["codebook"],
                                        beta=0.95, nesterov=True))


@pytest.mark.parametrize("op", [gk.quantize_nearest, gk.quantize_nearest_triton])
def test_quantize_nearest(op) -> None:
    _on_both(lambda t: op(t["grad"].float().clamp(-1, 1), t["codebook"]))


@pytest.mark.parametrize("op", [gk.quantize_stochastic, gk.quantize_stochastic_triton])
def test_quantize_stochastic(op) -> None:
    _on_both(lambda t: op(t["grad"].float().clamp(-1, 1), t["codebook"], 5, 3))
